"""`mlx-h2o generate`: mlx_lm.generate with an H2O-bounded KV cache.

Takes every ``mlx_lm.generate`` flag plus ``--h2o-*``. Without ``--model`` it
runs the embedded default model (prepared offline from a PyPI package).
Under ``mlx.launch`` the model is sharded over the ranks (cli/ranks.py) and
rank 0 prints.
"""

import argparse
import json
import struct
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
from mlx_lm.generate import setup_arg_parser as mlx_lm_arg_parser

from ..integration.distributed import pipeline_stages, shared_seed, world
from ..models import DEFAULT_MODEL
from .common import check_model_arg, fail, load_model_or_fail
from .h2o_args import (  # noqa: F401  (h2o_config_from_args: tests and scripts)
    add_h2o_args,
    check_h2o_args,
    check_mlx_lm_cache_flags,
    given_h2o_flags,
    h2o_config_from_args,
    h2o_value,
    quant_config_from_args,
)
from .ranks import check_rank_args, fail_once, is_distributed, load_on_ranks

H2O_FORMAT = "mlx-h2o-cache/1"  # mlx_h2o.files.io.FORMAT (read here without importing it)


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = mlx_lm_arg_parser()
    parser.prog = "mlx-h2o generate"
    parser.usage = ("mlx-h2o generate [-h] [--model MODEL] [--prompt PROMPT] "
                    "[--max-tokens N] [--h2o-* ...] [mlx_lm.generate flags]")
    parser.description = __doc__.splitlines()[0]
    parser.set_defaults(verbose=True)
    for action in parser._actions:
        if action.dest == "model":
            action.help = (f"Model path, hub repo or packaged name (default: {DEFAULT_MODEL}, "
                           "or the model a --prompt-cache-file was made with)")
        if action.dest == "prompt_cache_file":
            action.help = ("A prompt cache to continue from: H2O caches from `mlx-h2o "
                           "cache_prompt` (they keep their own budget), or with --no-h2o "
                           "mlx-lm's from `mlx_lm.cache_prompt`")
    parser.add_argument("--pipeline", action="store_true",
                        help="Under mlx.launch: pipeline parallel (whole layers per rank) "
                        "instead of tensor parallel (whole KV heads per rank)")
    add_h2o_args(parser)
    return parser


def check_args(parser, args):
    """Every user error, before anything loads: (H2OConfig or None, QuantConfig or None)."""
    if args.image:
        fail(parser, "--image: mlx-h2o generate runs text models only; use mlx_lm.generate")
    check_mlx_lm_cache_flags(parser, args)
    if args.prompt_cache_file is not None:
        _check_cache_file(parser, args)
    config, quant = check_h2o_args(parser, args)
    check_model_arg(parser, args.model)
    if args.draft_model:
        check_model_arg(parser, args.draft_model, "--draft-model")
    if args.chat_template_config:
        try:
            json.loads(args.chat_template_config)
        except ValueError as e:
            fail(parser, f"--chat-template-config is not JSON ({e})")
    return config, quant


def cache_file_kind(path) -> tuple:
    """("mlx-h2o" | "mlx-lm" | None, class names) from a .safetensors header."""
    try:
        with open(path, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            if n > Path(path).stat().st_size:
                return None, []
            meta = json.loads(fh.read(n)).get("__metadata__", {})
    except (OSError, ValueError, AttributeError, struct.error):
        return None, []
    if meta.get("format") == H2O_FORMAT:
        return "mlx-h2o", json.loads(meta.get("classes", "[]"))
    keys = sorted((k for k in meta if k.startswith("1.")), key=lambda k: int(k[2:]))
    if not keys:  # mlx-lm's layout: metadata, classes, scalars flattened as 0.*, 1.*, 2.*
        return None, []
    return "mlx-lm", [meta[k] for k in keys]


def _check_cache_file(parser, args) -> None:
    path, flag = args.prompt_cache_file, "--prompt-cache-file"
    if not Path(path).is_file():
        fail(parser, f"{flag} {path}: no such file; make one with `mlx-h2o cache_prompt` "
             "(or `mlx_lm.cache_prompt` for --no-h2o)")
    kind, classes = cache_file_kind(path)
    if kind is None:
        fail(parser, f"{flag} {path}: not a prompt-cache file (.safetensors from "
             "`mlx-h2o cache_prompt` or `mlx_lm.cache_prompt`)")
    h2o_classes = sorted({c for c in classes if "H2O" in c})
    if kind == "mlx-lm" and h2o_classes:
        fail(parser, f"{flag} {path}: mlx_lm's save_prompt_cache wrote H2O caches "
             f"({h2o_classes[0]}) without their budget and scores, so no one can load "
             "them; save H2O caches with mlx_h2o.cache.save_prompt_cache or `mlx-h2o "
             "cache_prompt`")
    if kind == "mlx-lm" and not args.no_h2o:
        fail(parser, f"{flag} {path} holds mlx-lm caches ({classes[0]}), not H2O ones: "
             "add --no-h2o to continue from it, or make an H2O one with `mlx-h2o "
             "cache_prompt`")
    if kind == "mlx-h2o" and args.no_h2o:
        fail(parser, f"{flag} {path} holds H2O caches: drop --no-h2o")
    given = given_h2o_flags(args)
    if kind == "mlx-h2o" and given:
        fail(parser, f"{given[0]} has no effect with {flag}: the file's H2O caches keep "
             f"the budget they were made with; drop {given[0]}, or make a new file with "
             f"`mlx-h2o cache_prompt {given[0]} ...`")


def _load_cache_file(parser, args):
    """(cache, metadata) of --prompt-cache-file (its kind checked by check_args)."""
    if args.no_h2o:
        from mlx_lm.models.cache import load_prompt_cache
    else:
        from ..files import load_prompt_cache
    try:
        return load_prompt_cache(args.prompt_cache_file, return_metadata=True)
    except (ValueError, KeyError, TypeError) as e:
        fail(parser, f"--prompt-cache-file {args.prompt_cache_file}: {e}")


def _prompt_tokens(args, tokenizer, continues: bool) -> List[int]:
    """The prompt's tokens; ``continues``: after a cached prompt (mlx-lm's rule:
    with a chat template only the text after the user turn's opening)."""
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    prompt = sys.stdin.read() if prompt == "-" else prompt
    use_chat = not args.ignore_chat_template and tokenizer.has_chat_template
    if use_chat:
        messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
        messages.append({"role": "user", "content": prompt})
        prefill = args.prefill_response is not None
        if prefill:
            messages.append({"role": "assistant", "content": args.prefill_response})
        kwargs = json.loads(args.chat_template_config) if args.chat_template_config else {}
        template = lambda m: tokenizer.apply_chat_template(  # noqa: E731
            m, tokenize=False, continue_final_message=prefill,
            add_generation_prompt=not prefill, **kwargs)
        prompt = template(messages)
        if continues:
            messages[-1]["content"] = "<query>"
            prompt = prompt[template(messages).index("<query>"):]
    return tokenizer.encode(prompt, add_special_tokens=not use_chat)


def _model_name(parser, args, metadata) -> Optional[str]:
    made_with = (metadata or {}).get("model")
    if made_with and args.model is not None and not _same_model(args.model, made_with):
        fail(parser, f"--model {args.model}: the --prompt-cache-file was made with "
             f"{made_with}; drop --model or make the cache with this model")
    return args.model or made_with


def _same_model(a: str, b: str) -> bool:
    from ..models import resolve_model

    return a == b or Path(resolve_model(a)).resolve() == Path(resolve_model(b)).resolve()


def _build_cache(parser, args, model, draft, config, quant, group):
    from ..cache.quantized import quantized_cache_type
    from ..integration.factory import make_h2o_cache

    cache_type = quantized_cache_type(quant)
    budget = h2o_value(args, "h2o_layer_budget")
    try:
        cache = make_h2o_cache(model, config, cache_type, layer_budget=budget)
        if draft is not None:
            cache += make_h2o_cache(draft, config, cache_type, layer_budget=budget)
    except (ValueError, TypeError) as e:
        from .h2o_args import flagify

        fail_once(parser, group, flagify(str(e)))
    return cache


def _load(parser, args, group, metadata):
    """(model, tokenizer) of this process: sharded over the ranks under mlx.launch."""
    tokenizer_config = json.loads((metadata or {}).get("tokenizer_config", "{}"))
    tokenizer_config["trust_remote_code"] = args.trust_remote_code
    name = _model_name(parser, args, metadata)
    if is_distributed(group):
        return load_on_ranks(parser, args, group, name, tokenizer_config)
    return load_model_or_fail(parser, name, adapter_path=args.adapter_path,
                              tokenizer_config=tokenizer_config)


def main(argv: Optional[List[str]] = None) -> int:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    config, quant = check_args(parser, args)
    group = world()
    check_rank_args(parser, args, group)
    from mlx_lm.sample_utils import make_sampler

    from ..integration.generate import generate

    seed = shared_seed(args.seed, group) if is_distributed(group) else args.seed
    if seed is not None:
        mx.random.seed(seed)
    cache, metadata = (None, None)
    if args.prompt_cache_file:
        cache, metadata = _load_cache_file(parser, args)
    model, tokenizer = _load(parser, args, group, metadata)
    for eos in args.extra_eos_token:
        tokenizer.add_eos_token(eos)
    prompt = _prompt_tokens(args, tokenizer, continues=cache is not None)
    draft = load_model_or_fail(parser, args.draft_model, "--draft-model")[0] \
        if args.draft_model else None
    if cache is not None:
        _check_layers(parser, args, cache, model, draft)
    elif config is not None:
        cache = _build_cache(parser, args, model, draft, config, quant, group)
    sampler = make_sampler(
        args.temp, args.top_p, args.min_p, args.min_tokens_to_keep, top_k=args.top_k,
        xtc_probability=args.xtc_probability, xtc_threshold=args.xtc_threshold,
        xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids),
    )
    with pipeline_stages() if args.pipeline and is_distributed(group) else nullcontext():
        text = generate(  # every rank runs it (collectives); rank 0 prints
            model, tokenizer, prompt, verbose=args.verbose and group.rank() == 0,
            max_tokens=args.max_tokens, sampler=sampler, prompt_cache=cache,
            max_kv_size=args.max_kv_size, prefill_step_size=args.prefill_step_size,
            kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
            quantized_kv_start=args.quantized_kv_start, draft_model=draft,
            num_draft_tokens=args.num_draft_tokens,
        )
    _report(args, text, len(prompt), cache, group)
    return 0


def _report(args, text: str, prompt_tokens: int, cache, group) -> None:
    """The text (--verbose False) or the cache stats of every rank, printed once."""
    if not args.verbose:  # the text only, as mlx_lm.generate: pipeable
        if group.rank() == 0:
            print(text)
        return
    if cache is None or not any(hasattr(c, "h2o_attention") for c in cache):
        return
    from ..integration.stats import cache_stats

    stats = cache_stats(cache, group, "layers" if args.pipeline else "heads")  # collective
    if group.rank() == 0:
        print(f"Prompt: {prompt_tokens} tokens | {stats.summary()}")
        print(layer_budget_line(stats.layer_budget, h2o_value(args, "h2o_layer_budget"),
                                from_file=args.prompt_cache_file))


def _check_layers(parser, args, cache, model, draft) -> None:
    layers = len(model.layers) + (len(draft.layers) if draft is not None else 0)
    if len(cache) != layers:
        fail(parser, f"--prompt-cache-file {args.prompt_cache_file} holds {len(cache)} "
             f"layer caches but the model has {layers} layers: it was made with another "
             "model; make it again with `mlx-h2o cache_prompt --model ...`")


def layer_budget_line(sizes, layer_budget, from_file=None) -> str:
    """``sizes``: each H2O layer's max_size (``CacheStats.layer_budget``)."""
    origin = f"from {from_file}" if from_file else layer_budget
    if len(set(sizes)) == 1:
        return (f"Layer budget ({origin}): {sizes[0]} tokens in every layer (the output "
                f"equals mlx-lm's while the sequence has at most {sizes[0]} tokens)")
    mean = f"mean {sum(sizes) / len(sizes):.0f}" + ("" if from_file else " (--max-kv-size)")
    return (f"Layer budget ({origin}): {min(sizes)}..{max(sizes)} tokens a layer, {mean}, "
            f"total {sum(sizes)} over {len(sizes)} layers; the smallest evict past "
            f"{min(sizes)} tokens")
