"""NVIDIA kvpress (PyTorch + transformers) on the prompts of `mlx-h2o retrieval`.

Example (a CUDA machine; kvpress 0.5.5 on PYTHONPATH, see below):
    python benchmarks/kvpress_retrieval.py --model smollm2-135m --contexts 2048 4096 \
        --budgets 0.1 0.25 0.5 --out results/kvpress
    python benchmarks/kvpress_retrieval.py --model gemma3-270m --contexts 2048 4096 8192 \
        --budgets 0.1 0.25 0.5 --haystack python-docs --seed 1 --out results/kvpress_gemma
CPU smoke run:
    python benchmarks/kvpress_retrieval.py --device cpu --contexts 2048 --depths 0.5 \
        --tasks single docqa --presses baseline knorm snapkv --budgets 0.25 --out /tmp/kvp

Same prompts: `mlx_h2o.eval.retrieval.make_prompts` with the arguments of
`mlx-h2o retrieval` (--tasks, --depths, --seed, --haystack, --no-chat; its
defaults) and the packaged model's own tokenizer, so the token ids are the
ones MLX is fed: SmolLM2's chat template, Gemma 3 270M (a base model, no
template) a plain prompt after <bos>; an answer ends at the tokenizer's eos.
Same weights: the packaged model's prepared dir (float32 mlx-lm, from a GGUF)
loads into `AutoModelForCausalLM` as it is: mlx-lm's llama and gemma3_text
weight names are Hugging Face's, and transformers reads gemma3's config keys
(rope_local_base_freq, sliding_window_pattern, query_pre_attn_scalar, a tied
lm_head; both RMSNorms scale by 1 + w). One change, in memory (`MAPPINGS`):
mlx-lm scales Gemma's embeddings by sqrt(hidden_size) rounded to bfloat16
(25.25, not 25.30), transformers keeps float32, a gap of ~5e-2 in the logits.
Other model types raise ValueError. The header prints the largest |logit|
difference to the mlx-lm model on one prompt (CPU float32, the 2K prompt:
SmolLM2 1.5e-4, Gemma 5e-5), MLX run with MLX_ENABLE_TF32=0 (on CUDA MLX
otherwise multiplies float32 in TF32, as `mlx-h2o retrieval` then does;
torch's float32 matmuls are exact).
Same scoring: `passkey.score_trial` (`retrieval_data.score_output`) on the
decoded text; rows have the shape of the retrieval summary's.

Protocol (kvpress's own pipeline prefills a context, then feeds the question):
our prompt ends with the question, so a press compresses the whole prompt but
its last token, question included, as H2O's prefill sees it. `mlx-h2o` prefills
all but the last token too, then feeds the last one as the first decode step.
The press's forward hooks (`press_hooks`) act on the prefill forward only
(kvpress's `is_prefilling`); decoding runs without hooks, on the compressed
DynamicCache, with explicit position ids (the cache is shorter than the
positions), greedy for --new-tokens, a row ending at the tokenizer's eos.
Budget: compression_ratio = 1 - (max_kv + 0.5) / (L - 1), so kvpress's
`int((L - 1) * (1 - ratio))` keeps exactly max_kv = `budget_tokens(budget, L)`.

Unequal by design of kvpress: the cache then grows by one entry per decoded
token (no eviction while decoding; H2O stays at max_kv); pyramidkv keeps
max_kv on average over layers (more in low layers); adakv keeps max_kv per
layer on average over heads (per-head budgets, enforced by masking, not by
freeing memory); observed_attention needs eager attention (it materialises the
L x L weights: its batch is cut to --eager-gb). Gemma 3: kvpress compresses
the full-attention layers only (its rule for Gemma3ForConditionalGeneration,
applied here to Gemma3ForCausalLM too, `press_hooks`); the sliding-window
layers keep their last 511 tokens whatever the budget (mlx-h2o's H2O keeps
min(max_kv, 512) there), as transformers' DynamicCache does for the config.

Presses left out: they download weights or statistics (duo_attention, qfilter,
kvzap, fastkvzip, restorekv, expected_attention_stats, lukv), need a trained
model (dms), compress while decoding (decoding, compression_ratio_decoding, cam,
prefill_decoding), re-run the model or need the context and question apart
(kvzip, kvgrad, kvcompose, finch), wrap another press (block, chunk, chunkkv,
entropy_gated_chunkkv, composed, per_layer_compression, key_rerotation,
merging) or have no token budget (think: key channels; simlayerkv: per-layer
lazy detection).

Runs kvpress 0.5.5 on transformers 5.17 (kvpress asks for < 5.3): the press
hooks read `cache_position`, which 5.17 no longer passes to the attention
layers, so the prefill passes it explicitly; Gemma 3's rotary embedding takes
the layer type, so each hooked layer gets its own (expected_attention uses it).
"""

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import sys
import time
import types
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch

BUDGET_GUARD = 0.5  # compression_ratio = 1 - (max_kv + BUDGET_GUARD) / k_len: no float truncation


def _presses(kv) -> dict:
    """{name: (factory(ratio), needs eager attention)}: presses of kvpress 0.5.5
    that need no download, no training, and have one token budget."""
    ea = kv.ExpectedAttentionPress
    return {
        "knorm": (lambda r: kv.KnormPress(compression_ratio=r), False),
        "streaming_llm": (lambda r: kv.StreamingLLMPress(compression_ratio=r), False),
        "snapkv": (lambda r: kv.SnapKVPress(compression_ratio=r), False),
        "tova": (lambda r: kv.TOVAPress(compression_ratio=r), False),
        "expected_attention": (lambda r: ea(compression_ratio=r), False),
        "observed_attention": (lambda r: kv.ObservedAttentionPress(compression_ratio=r), True),
        "pyramidkv": (lambda r: kv.PyramidKVPress(compression_ratio=r), False),
        "adakv_expected_attention": (lambda r: kv.AdaKVPress(ea(compression_ratio=r)), False),
        # CriticalKV weighs scores by the value norm itself: kvpress asks use_vnorm=False
        "criticalkv_expected_attention": (
            lambda r: kv.CriticalKVPress(ea(compression_ratio=r, use_vnorm=False)), False),
        "criticaladakv_expected_attention": (
            lambda r: kv.CriticalAdaKVPress(ea(compression_ratio=r, use_vnorm=False)), False),
        "keydiff": (lambda r: kv.KeyDiffPress(compression_ratio=r), False),
        "lagkv": (lambda r: kv.LagKVPress(compression_ratio=r), False),
        "cur": (lambda r: kv.CURPress(compression_ratio=r), False),
        "leverage": (lambda r: kv.LeverageScorePress(compression_ratio=r), False),
        "compactor": (lambda r: kv.CompactorPress(compression_ratio=r), False),
        "cap": (lambda r: kv.CapPress(compression_ratio=r), False),
        "non_causal_attention": (lambda r: kv.NonCausalAttnPress(compression_ratio=r), False),
        "random": (lambda r: kv.RandomPress(compression_ratio=r, seed=0), False),
    }


def import_kvpress():
    """`import kvpress`. Its __init__ imports every press; DuoAttention and
    ExpectedAttentionStats import `datasets` only to download calibration data.
    Where `datasets` is missing (it needs pyarrow, ~40 MB), a stand-in whose
    `load_dataset` raises takes its name."""
    if importlib.util.find_spec("datasets") is None:
        stub = types.ModuleType("datasets")

        def load_dataset(*args, **kwargs):
            raise ImportError("datasets is not installed")

        stub.load_dataset = load_dataset
        sys.modules["datasets"] = stub
    import kvpress

    return kvpress


def setup_arg_parser():
    from mlx_h2o.eval.retrieval_data import TASKS

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="packaged model name or mlx-lm dir")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    p.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.25, 0.5],
                   help="<= 1 a fraction of the context, else tokens (as mlx-h2o retrieval)")
    p.add_argument("--presses", nargs="+", default=None,
                   help="'baseline' and kvpress presses (default: all; see the docstring)")
    p.add_argument("--haystack", default="austen",
                   help="noise, a corpus (austen, python-docs, ...), a text file or folder")
    p.add_argument("--no-chat", action="store_true",
                   help="plain prompts even where the model has a chat template")
    p.add_argument("--seed", type=int, default=0, help="seed of the needles")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=7)
    p.add_argument("--eager-gb", type=float, default=8.0,
                   help="cap on one layer's eager attention weights (B x heads x L^2 floats)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--logit-tol", type=float, default=1e-2,
                   help="largest |logit| difference to mlx-lm accepted on the check prompt")
    p.add_argument("--out", required=True, help="output dir (finished cells are skipped)")
    return p


def bf16_embed_scale(model) -> None:
    """mlx-lm's gemma3_text scales the embeddings by sqrt(hidden_size) rounded to
    bfloat16; transformers' Gemma 3 by the float32 value: use mlx-lm's."""
    emb = model.model.embed_tokens
    scale = torch.tensor(model.config.hidden_size**0.5).to(torch.bfloat16).item()
    emb.embed_scale.fill_(scale)
    emb.scalar_embed_scale = scale  # what transformers' init would reset it to


# model_type -> the change, in memory, that makes transformers' model of a prepared
# mlx-lm dir compute what mlx-lm's does (names and config keys load as they are)
MAPPINGS = {"llama": None, "gemma3_text": bf16_embed_scale}


def load_torch_model(path: str, device: str, dtype: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    kind = AutoConfig.from_pretrained(path).model_type
    if kind not in MAPPINGS:
        raise ValueError(f"{path}: model_type {kind!r} has no mapping from mlx-lm to "
                         f"transformers here; mapped: {', '.join(MAPPINGS)}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                 attn_implementation="sdpa")
    if MAPPINGS[kind] is not None:
        MAPPINGS[kind](model)
    return model.to(device).eval()


def press_hooks(press, model):
    """`press(model)`: kvpress's prefill hooks. Where some layers slide (Gemma 3),
    on the full-attention layers only, as kvpress does for Gemma 3 (its test is on
    Gemma3ForConditionalGeneration, which Gemma3ForCausalLM is not)."""
    layers = model.model.layers
    if not any(getattr(layer.self_attn, "is_sliding", False) for layer in layers):
        return press(model)
    return _full_attention_hooks(press, model)


@contextlib.contextmanager
def _full_attention_hooks(press, model):
    # BasePress.__call__ minus the sliding layers. transformers 5's Gemma 3 rotary
    # embedding takes the layer type; expected_attention calls rotary_emb(x, pos).
    press.post_init_from_model(model)
    hooks = []
    try:
        for layer in model.model.layers:
            attn = layer.self_attn
            if attn.is_sliding:
                continue
            rotary = functools.partial(model.model.rotary_emb, layer_type=attn.layer_type)
            attn.rotary_emb = rotary
            hooks.append(attn.register_forward_hook(press.forward_hook, with_kwargs=True))
        yield
    finally:
        for hook in hooks:
            hook.remove()


@torch.no_grad()
def logit_diff(mx_model, model, tokens: list, last: int = 32) -> float:
    """Largest |logit| difference, torch vs mlx-lm, over the prompt's last positions."""
    import mlx.core as mx

    ref = mx_model(mx.array(tokens)[None])[0, -last:].astype(mx.float32)
    ids = torch.tensor([tokens], device=model.device)
    out = model(input_ids=ids, logits_to_keep=last).logits[0].float().cpu().numpy()
    ref = np.array(ref)
    print(f"# logit check: max|mlx| {np.abs(ref).max():.2f}  argmax agree "
          f"{(ref.argmax(-1) == out.argmax(-1)).mean():.3f}", flush=True)
    return float(np.abs(ref - out).max())


@torch.no_grad()
def prefill(model, ids: torch.Tensor, cache, press) -> None:
    """All but the last token into `cache`, compressed by `press` (None: kept whole).
    `cache_position` is passed because kvpress's hooks read it."""
    L = ids.shape[1] - 1
    with press_hooks(press, model) if press is not None else contextlib.nullcontext():
        model.model(input_ids=ids[:, :L], past_key_values=cache, use_cache=True,
                    cache_position=torch.arange(L, device=ids.device))


@torch.no_grad()
def greedy(model, ids: torch.Tensor, cache, n: int, eos: set) -> list:
    """(B, <= n) greedy tokens after the prompt's last token, which goes first;
    stops once every row has produced an eos."""
    B, pos = ids.shape[0], ids.shape[1] - 1
    tok, out = ids[:, -1:], []
    done = torch.zeros(B, dtype=torch.bool, device=ids.device)
    for i in range(n):
        position_ids = torch.full((B, 1), pos + i, device=ids.device)
        logits = model(input_ids=tok, past_key_values=cache, position_ids=position_ids,
                       logits_to_keep=1).logits[:, -1]
        tok = logits.argmax(-1, keepdim=True)  # (B, 1)
        out.append(tok)
        done |= torch.isin(tok[:, 0], torch.tensor(sorted(eos), device=ids.device))
        if bool(done.all()):
            break
    return torch.cat(out, dim=1).tolist()


def cut_at_eos(ids: list, eos: set) -> list:
    return next((ids[: i + 1] for i, t in enumerate(ids) if t in eos), ids)


def run_cell(model, tokenizer, prompts, press, batch_size, new_tokens, device) -> dict:
    """Every prompt (one length) through one press; trials as `mlx-h2o retrieval`'s."""
    from transformers import DynamicCache

    from mlx_h2o.eval.passkey import score_trial

    eos = {tokenizer.eos_token_id}
    tic, trials, kept = time.perf_counter(), [], []
    for s in range(0, len(prompts), batch_size):
        batch = prompts[s : s + batch_size]
        ids = torch.tensor([list(map(int, p["tokens"])) for p in batch], device=device)
        cache = DynamicCache(config=model.config)  # Gemma 3's sliding layers: 511 tokens
        prefill(model, ids, cache, press)
        kept.append([layer.keys.shape[-2] for layer in cache.layers])
        out = greedy(model, ids, cache, new_tokens, eos)
        trials += [score_trial(p, tokenizer.decode(cut_at_eos(o, eos)))
                   for p, o in zip(batch, out)]
    if device == "cuda":
        torch.cuda.synchronize()
    return {"trials": trials, "seconds": time.perf_counter() - tic,
            "kept_per_layer": kept[0], "accuracy": sum(t["correct"] for t in trials) / len(trials)}


def eager_batch(model, ctx: int, batch_size: int, gb: float) -> int:
    per_prompt = model.config.num_attention_heads * ctx * ctx * 4
    return max(1, min(batch_size, int(gb * 2**30 // per_prompt)))


def cell(model, tokenizer, prompts, name, factory, eager, budget, ctx, args) -> dict:
    from mlx_h2o.eval.passkey import budget_tokens

    max_kv = budget_tokens(budget, ctx) if factory else None
    ratio = 1 - (max_kv + BUDGET_GUARD) / (ctx - 1) if factory else 0.0
    press = factory(ratio) if factory else None
    bs = eager_batch(model, ctx, args.batch_size, args.eager_gb) if eager else args.batch_size
    if eager:
        model.set_attn_implementation("eager")
    try:
        res = run_cell(model, tokenizer, prompts, press, bs, args.new_tokens, args.device)
    finally:
        if eager:
            model.set_attn_implementation("sdpa")
    return res | {"press": name, "context": ctx, "budget": budget if factory else None,
                  "max_kv": max_kv, "compression_ratio": ratio, "batch_size": bs}


def load_and_check(args):
    """(torch model, tokenizer, {context: prompts}, max |logit| diff to mlx-lm)."""
    import mlx.core as mx

    from mlx_h2o.eval.retrieval import haystack_text, make_prompts
    from mlx_h2o.models import load_model, resolve_model

    # MLX on CUDA multiplies float32 in TF32 unless told not to (read at first use):
    # the check compares weights, not TF32 rounding. torch keeps float32 matmuls.
    os.environ.setdefault("MLX_ENABLE_TF32", "0")
    mx_model, tokenizer = load_model(args.model)
    model = load_torch_model(resolve_model(args.model), args.device, args.dtype)
    hay = haystack_text(args.haystack)
    prompts = {c: make_prompts(tokenizer, args.tasks, [c], args.depths, args.seed, hay,
                               not args.no_chat) for c in args.contexts}
    # The shortest context's first prompt: the same weights show at any length, and
    # an 8K forward on two CPU cores took longer than the whole grid's read-back.
    diff = logit_diff(mx_model, model, prompts[min(prompts)][0]["tokens"])
    del mx_model
    mx.clear_cache()
    return model, tokenizer, prompts, diff


def run_config(args, diff: float) -> dict:
    import transformers

    config = {k: getattr(args, k) for k in ("model", "tasks", "depths", "haystack", "seed",
                                            "new_tokens", "batch_size", "device", "dtype")}
    config["chat"] = not args.no_chat
    return config | {
        "torch": torch.__version__, "transformers": transformers.__version__,
        "kvpress": version("kvpress"), "logit_max_abs_diff": diff,
        "mlx_tf32": os.environ["MLX_ENABLE_TF32"],
        "torch_tf32": torch.backends.cuda.matmul.allow_tf32,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None}


def main(argv=None) -> int:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    from mlx_h2o.cli.common import ensure_corpus_or_fail
    from mlx_h2o.eval.common import fmt_table
    from mlx_h2o.eval.retrieval import task_accuracy

    table = {"baseline": (None, False)} | _presses(import_kvpress())
    names = args.presses or list(table)
    bad = [n for n in names if n not in table]
    if bad:
        parser.error(f"--presses {' '.join(bad)}: unknown; use some of {' '.join(table)}")
    if args.haystack != "noise":
        ensure_corpus_or_fail(parser, args.haystack, "--haystack")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer, prompts, diff = load_and_check(args)
    config = run_config(args, diff)
    print("# kvpress retrieval  " + " ".join(f"{k}={v}" for k, v in config.items()), flush=True)
    if diff > args.logit_tol:
        print(f"logit check failed: {diff:.3g} > --logit-tol {args.logit_tol}", file=sys.stderr)
        return 1
    rows = run_grid(model, tokenizer, prompts, table, names, out, args, task_accuracy)
    cols = ("context", "strategy", "budget", "max_kv", *args.tasks, "mean", "kept", "seconds")
    (out / "summary.json").write_text(json.dumps({"config": config, "rows": rows}, indent=1))
    (out / "summary.md").write_text(fmt_table(rows, cols) + "\n")
    print("\n" + fmt_table(rows, cols))
    print(json.dumps({"results": str(out), "rows": rows}))
    return 0


def run_grid(model, tokenizer, prompts, table, names, out, args, task_accuracy) -> list:
    """One row per (context, budget, press); a finished cell's JSON is read back."""
    from mlx_h2o.eval.retrieval import kept_columns

    rows = []
    for ctx, ps in prompts.items():
        full = None  # the baseline's result at this context (run it first)
        for budget in args.budgets:
            for name in names:
                factory, eager = table[name]
                if factory is None and budget != args.budgets[0]:
                    continue  # the unbounded baseline once per context
                path = out / (f"{name}-ctx{ctx}" + (f"-b{budget:g}" if factory else "") + ".json")
                res = json.loads(path.read_text()) if path.exists() else None
                if res is None:
                    res = try_cell(model, tokenizer, ps, name, factory, eager, budget, ctx, args)
                    if res is None:
                        continue
                    path.write_text(json.dumps(res, indent=1))
                rows.append(print_row(res, name, args.tasks, task_accuracy))
                if factory is None:
                    full = res
                elif full is not None:
                    rows[-1] |= kept_columns(res, full)
    return rows


def try_cell(model, tokenizer, ps, name, factory, eager, budget, ctx, args):
    try:
        return cell(model, tokenizer, ps, name, factory, eager, budget, ctx, args)
    except Exception as e:  # noqa: BLE001  one press failing (OOM, assert) must not end the grid
        print(f"ctx={ctx} strategy=kvpress-{name} budget={budget} FAILED "
              f"{type(e).__name__}: {e}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None


def print_row(res: dict, name: str, tasks, task_accuracy) -> dict:
    acc = task_accuracy(res)
    row = {"context": res["context"], "strategy": f"kvpress-{name}", "budget": res["budget"],
           "max_kv": res["max_kv"], **acc, "seconds": res["seconds"]}
    print(f"ctx={row['context']} strategy={row['strategy']} max_kv={row['max_kv']} "
          f"kept_mean={np.mean(res['kept_per_layer']):.0f} mean={acc['mean']:.3f} "
          + " ".join(f"{t}={acc[t]:.2f}" for t in tasks)
          + f" seconds={res['seconds']:.1f}", flush=True)
    return row


if __name__ == "__main__":
    sys.exit(main())
