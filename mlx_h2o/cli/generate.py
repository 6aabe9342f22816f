"""`mlx-h2o generate`: mlx_lm.generate with an H2O-bounded KV cache.

Takes every ``mlx_lm.generate`` flag plus ``--h2o-*``. Without ``--model`` it
runs the embedded default model (prepared offline from a PyPI package).
"""

import argparse
import dataclasses
import json
import sys
from typing import List, Optional

import mlx.core as mx
from mlx_lm.generate import setup_arg_parser as mlx_lm_arg_parser
from mlx_lm.sample_utils import make_sampler

from ..cache import load_prompt_cache
from ..cache.quantized import QuantConfig, quantized_cache_type
from ..config import PREFILL_COMPACT, SCORE_MODES, H2OConfig
from ..integration.factory import make_h2o_cache
from ..integration.generate import generate
from ..integration.stats import cache_stats
from ..models import DEFAULT_MODEL, load_model


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(H2OConfig)}


def add_h2o_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("H2O eviction")
    group.add_argument("--h2o-max-size", type=int, default=256,
                       help="KV budget per layer in tokens (default: 256)")
    group.add_argument("--h2o-heavy-budget", type=int, default=None,
                       help="Heavy-hitter slots (default: derived)")
    group.add_argument("--h2o-recent-budget", type=int, default=None,
                       help="Recent-window slots (default: derived)")
    group.add_argument("--h2o-sink-size", type=int, default=4,
                       help="Attention-sink positions always kept (default: 4)")
    group.add_argument("--h2o-score", choices=SCORE_MODES, default=None,
                       help=f"Score mode (default: {_DEFAULTS['score']})")
    group.add_argument("--h2o-prefill-window", type=int, default=None,
                       help="Score a prompt chunk that overflows the budget by its last "
                       f"queries only (default: {_DEFAULTS['prefill_window']}; 0 = all)")
    group.add_argument("--h2o-prefill-pool", type=int, default=None,
                       help="Max-pool such a chunk's scores over neighbouring positions "
                       f"(default: {_DEFAULTS['prefill_pool']})")
    group.add_argument("--h2o-prefill-compact", choices=PREFILL_COMPACT, default=None,
                       help="Compact an overflowing prompt after each prefill chunk "
                       "('chunk') or once, at the first decode step, scored by the last "
                       f"chunk ('prompt'; default: {_DEFAULTS['prefill_compact']})")
    group.add_argument("--h2o-evict-batch", type=int, default=None,
                       help="A full cache evicts this many tokens at once, then appends "
                       "(sliding-window speed; 1 = per-step H2O; default: "
                       f"{_DEFAULTS['evict_batch']})")
    group.add_argument("--h2o-layer-budget", default="auto", metavar="{auto,uniform,PATH}",
                       help="Share the budget between layers: 'auto' = the shipped layer "
                       "profile of a packaged model, else uniform; 'uniform'; or a "
                       "profile file from `mlx-h2o calibrate` (default: auto)")
    group.add_argument("--h2o-kv-bits", type=int, choices=(4, 8), default=None,
                       help="Quantize the kept K/V (QuantizedH2OKVCache)")
    group.add_argument("--h2o-kv-group-size", type=int, choices=(32, 64, 128), default=64,
                       help="Quantization group size along head_dim (default: 64)")
    group.add_argument("--h2o-kv-recent-bits", type=int, choices=(4,), default=None,
                       help="Mixed precision: recent window at these bits, the rest "
                       "at --h2o-kv-bits (e.g. 8 heavy / 4 recent)")
    group.add_argument("--no-h2o", action="store_true",
                       help="Plain mlx-lm caches (for comparison)")


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = mlx_lm_arg_parser()
    parser.prog = "mlx-h2o generate"
    parser.description = __doc__.splitlines()[0]
    parser.set_defaults(verbose=True)
    for action in parser._actions:
        if action.dest == "model":
            action.help = f"Model path, hub repo or packaged name (default: {DEFAULT_MODEL})"
    add_h2o_args(parser)
    return parser


def h2o_config_from_args(args) -> Optional[H2OConfig]:
    if args.no_h2o:
        return None
    options = dict(score=args.h2o_score, prefill_window=args.h2o_prefill_window,
                   prefill_pool=args.h2o_prefill_pool,
                   prefill_compact=args.h2o_prefill_compact,
                   evict_batch=args.h2o_evict_batch)
    return H2OConfig(
        max_size=args.h2o_max_size, sink_size=args.h2o_sink_size,
        heavy_budget=args.h2o_heavy_budget, recent_budget=args.h2o_recent_budget,
        **{k: v for k, v in options.items() if v is not None},
    )


def quant_config_from_args(args) -> Optional[QuantConfig]:
    if args.h2o_kv_bits is None:
        if args.h2o_kv_recent_bits is not None:
            raise ValueError("--h2o-kv-recent-bits needs --h2o-kv-bits (e.g. 8)")
        return None
    return QuantConfig(bits=args.h2o_kv_bits, group_size=args.h2o_kv_group_size,
                       recent_bits=args.h2o_kv_recent_bits)


def _check_unsupported(args, config) -> None:
    if args.image:
        raise ValueError("--image is not supported by mlx-h2o generate (text models only)")
    if config is not None and args.max_kv_size is not None:
        raise ValueError("--max-kv-size and --h2o-max-size both bound the cache: use one")
    if config is not None and args.kv_bits is not None:
        raise ValueError(
            "--kv-bits quantizes mlx-lm's cache; with H2O use --no-h2o or drop --kv-bits"
        )


def _prompt_tokens(args, tokenizer) -> List[int]:
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
        prompt = tokenizer.apply_chat_template(
            messages, tokenize=False, continue_final_message=prefill,
            add_generation_prompt=not prefill, **kwargs,
        )
    return tokenizer.encode(prompt, add_special_tokens=not use_chat)


def main(argv: Optional[List[str]] = None) -> int:
    args = setup_arg_parser().parse_args(argv)
    config = h2o_config_from_args(args)
    _check_unsupported(args, config)
    if args.seed is not None:
        mx.random.seed(args.seed)
    model, tokenizer = load_model(
        args.model, adapter_path=args.adapter_path,
        tokenizer_config={"trust_remote_code": args.trust_remote_code},
    )
    for eos in args.extra_eos_token:
        tokenizer.add_eos_token(eos)
    prompt = _prompt_tokens(args, tokenizer)
    draft = load_model(args.draft_model)[0] if args.draft_model else None
    if args.prompt_cache_file:
        cache = load_prompt_cache(args.prompt_cache_file)
    elif config is not None:
        cache_type = quantized_cache_type(quant_config_from_args(args))
        budget = args.h2o_layer_budget
        cache = make_h2o_cache(model, config, cache_type, layer_budget=budget)
        if draft is not None:
            cache += make_h2o_cache(draft, config, cache_type, layer_budget=budget)
    else:
        cache = None
    sampler = make_sampler(
        args.temp, args.top_p, args.min_p, args.min_tokens_to_keep, top_k=args.top_k,
        xtc_probability=args.xtc_probability, xtc_threshold=args.xtc_threshold,
        xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids),
    )
    text = generate(
        model, tokenizer, prompt, verbose=args.verbose, max_tokens=args.max_tokens,
        sampler=sampler, prompt_cache=cache, max_kv_size=args.max_kv_size,
        prefill_step_size=args.prefill_step_size, kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size, quantized_kv_start=args.quantized_kv_start,
        draft_model=draft, num_draft_tokens=args.num_draft_tokens,
    )
    if not args.verbose:
        print(text)
    if cache is not None and any(hasattr(c, "h2o_attention") for c in cache):
        print(f"Prompt: {len(prompt)} tokens | {cache_stats(cache).summary()}")
        print(_layer_budget_line(cache, args.h2o_layer_budget))
    return 0


def _layer_budget_line(cache, layer_budget) -> str:
    sizes = [c.max_size for c in cache if hasattr(c, "h2o_attention")]
    if len(set(sizes)) == 1:
        return f"Layer budget ({layer_budget}): uniform, {sizes[0]} per layer"
    return (f"Layer budget ({layer_budget}): per-layer max_size {min(sizes)}..{max(sizes)}, "
            f"total {sum(sizes)} over {len(sizes)} layers")
