"""serve_bench's model folders and prompts: a random-weight model with a real model's
shapes, what the benchmark reads from a folder (tokenizer, end-of-sequence ids, KV
shapes), and prompts of exact token lengths."""

import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

PROSE = Path(__file__).resolve().parents[1] / "tests" / "data" / "python_docs_prose.txt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def save_random_model(out: Path, name: str, bits: int, tokenizer_dir: Path) -> Path:
    """A random-weight model with ``name``'s shapes as an mlx-lm folder, with
    ``tokenizer_dir``'s tokenizer. Output rows past the tokenizer's vocabulary
    are zero, so greedy decoding picks only ids the tokenizer can decode."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import save_config, save_model
    from tokenizers import Tokenizer

    from mlx_h2o.eval.bench import RANDOM_CONFIGS, random_model

    if name not in RANDOM_CONFIGS:
        raise ValueError(f"--random {name}: use one of {sorted(RANDOM_CONFIGS)}")
    config = dict(RANDOM_CONFIGS[name])
    vocab = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
    if vocab > config["vocab_size"]:
        raise ValueError(f"the tokenizer's {vocab} ids do not fit {name}'s vocabulary")
    model = random_model(name)  # bfloat16
    head = model.lm_head if "lm_head" in model else model.model.embed_tokens
    weight = head.weight
    weight[vocab:] = 0  # (vocab_size, hidden): logits of undecodable ids stay 0
    head.weight = weight
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
        config["quantization"] = {"group_size": 64, "bits": bits}
    mx.eval(model.parameters())
    save_model(out, model)
    if (tokenizer_dir / "config.json").exists():  # the tokenizer's model: its special ids
        source = json.loads((tokenizer_dir / "config.json").read_text())
        config.update({k: source[k] for k in ("bos_token_id", "eos_token_id") if k in source})
    save_config(config, out / "config.json")
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, out / f)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"  # transformers 4 and 5
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return out


def model_info(path: Path):
    """(tokenizer, banned end-of-sequence ids, layers, KV heads) of a model folder."""
    from tokenizers import Tokenizer

    config = json.loads((path / "config.json").read_text())
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    eos = config.get("eos_token_id")
    ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    eos_token = tok_config.get("eos_token")
    eos_token = eos_token.get("content") if isinstance(eos_token, dict) else eos_token
    if eos_token and tok.token_to_id(eos_token) is not None:
        ids.add(tok.token_to_id(eos_token))
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    return tok, sorted(ids), config["num_hidden_layers"], kv_heads


def resolve(args, tmp: Path, script) -> Path:
    """The served model's folder (a random one built by ``script --save-random`` in a
    child process, so the benchmark holds no model)."""
    from mlx_h2o.models import PACKAGED_MODELS, resolve_model

    if args.random:
        out = tmp / f"random-{args.random}"
        subprocess.run([sys.executable, str(script), "--save-random", str(out),
                        *random_args(args)], check=True)
        return out
    if args.model is None or args.model in PACKAGED_MODELS:
        return Path(resolve_model(args.model))
    if not Path(args.model, "config.json").exists():
        raise SystemExit(f"--model {args.model}: needs a local model folder or packaged name")
    return Path(args.model)


def random_args(args):
    """``--save-random``'s flags for ``args`` (the tokenizer: the packaged SmolLM2's)."""
    from mlx_h2o.models import resolve_model

    tokenizer = args.tokenizer or resolve_model("smollm2-135m")
    return ["--random", args.random, "--random-bits", str(args.random_bits), "--tokenizer",
            str(tokenizer)]


def make_prompts(tokenizer, lengths, seed):
    """A prompt of each length from the prose's sentences, shuffled; no two share
    their first token (so no prompt reuses another's cached prefix)."""
    rng = random.Random(seed)
    sentences = PROSE.read_text().replace("\n", " ").split(". ")
    words = sorted({w for w in re.findall(r"[A-Za-z]+", " ".join(sentences))})
    rng.shuffle(words)
    leads, firsts = [], set()
    for w in words:
        first = tokenizer.encode(w, add_special_tokens=False).ids[0]
        if first not in firsts and len(leads) < len(lengths):
            leads.append(w)
            firsts.add(first)
    if len(leads) < len(lengths):
        raise ValueError(f"{len(lengths)} prompts need as many distinct first tokens; the "
                         f"prose has {len(leads)}: ask for fewer clients or rounds")
    prompts = []
    for lead, n in zip(leads, lengths):
        ids = tokenizer.encode(lead + ":", add_special_tokens=False).ids
        while len(ids) < n:
            rng.shuffle(sentences)
            ids += tokenizer.encode(" " + ". ".join(sentences), add_special_tokens=False).ids
        prompts.append(tokenizer.decode(ids[:n]))
    return prompts
