"""`mlx-h2o cache_prompt`: mlx_lm.cache_prompt with H2O caches.

Takes every ``mlx_lm.cache_prompt`` flag plus ``--h2o-*``; ``--max-kv-size`` is
the H2O budget (with ``--no-h2o`` mlx-lm's rotating cache size). The file continues
with ``mlx-h2o generate --prompt-cache-file FILE --prompt "..."`` (the cache
keeps the budget it was made with). With ``--no-h2o`` it writes mlx-lm's own
prompt cache, as ``mlx_lm.cache_prompt`` does.
"""

import argparse
import json
import sys
import time
from typing import List, Optional

from mlx_lm.cache_prompt import setup_arg_parser as mlx_lm_arg_parser

from ..models import DEFAULT_MODEL
from .common import check_model_arg, check_out_file, fail, load_model_or_fail
from .h2o_args import (
    add_h2o_args,
    check_h2o_args,
    check_mlx_lm_cache_flags,
    flagify,
    h2o_value,
)


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = mlx_lm_arg_parser()
    parser.prog = "mlx-h2o cache_prompt"
    parser.usage = ("mlx-h2o cache_prompt [-h] --prompt-cache-file FILE --prompt PROMPT "
                    "[--model MODEL] [--h2o-* ...] [mlx_lm.cache_prompt flags]")
    parser.description = __doc__.splitlines()[0]
    for action in parser._actions:
        if action.dest == "model":
            action.default = None
            action.help = f"Model path, hub repo or packaged name (default: {DEFAULT_MODEL})"
        if action.dest == "prompt_cache_file":
            action.help = "The .safetensors file to write the prompt cache to"
    add_h2o_args(parser)
    return parser


def check_args(parser, args):
    """Every user error, before anything loads: (H2OConfig or None, QuantConfig or None)."""
    check_mlx_lm_cache_flags(parser, args)
    if not args.prompt_cache_file.endswith(".safetensors"):
        fail(parser, f"--prompt-cache-file {args.prompt_cache_file}: the file name must end "
             "with .safetensors")
    check_out_file(parser, "--prompt-cache-file", args.prompt_cache_file)
    config, quant = check_h2o_args(parser, args)
    check_model_arg(parser, args.model)
    return config, quant


def _make_cache(parser, args, model, config, quant):
    if config is None:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(model, args.max_kv_size)
    from ..cache.quantized import quantized_cache_type
    from ..integration.factory import make_h2o_cache

    try:
        return make_h2o_cache(model, config, quantized_cache_type(quant),
                              layer_budget=h2o_value(args, "h2o_layer_budget"))
    except (ValueError, TypeError) as e:
        fail(parser, flagify(str(e)))


def _prefill(model, tokens, cache, args) -> None:
    """mlx_lm.cache_prompt's prefill (with its progress line), H2O routed."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from ..integration.preview import MLX_LM_PREFILL_STEP, preview_prompt
    from ..integration.routing import patch

    start, width = time.time(), 0

    def callback(processed, total):
        nonlocal width
        msg = f"\rProcessed {processed:6d} tokens ({processed / (time.time() - start):6.2f} tok/s)"
        width = max(width, len(msg))
        print(msg.ljust(width), end="", flush=True)

    preview_prompt(model, cache, tokens, MLX_LM_PREFILL_STEP)  # generate_step's own
    steps = generate_step(mx.array(tokens), model, max_tokens=0, prompt_cache=cache,
                          kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                          quantized_kv_start=args.quantized_kv_start,
                          prompt_progress_callback=callback)
    with patch():
        for _ in steps:
            pass
    print()


def main(argv: Optional[List[str]] = None) -> int:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    config, quant = check_args(parser, args)
    import mlx.core as mx

    tokenizer_config = {"trust_remote_code": args.trust_remote_code}
    if args.eos_token is not None:
        tokenizer_config["eos_token"] = args.eos_token
    model, tokenizer = load_model_or_fail(parser, args.model, adapter_path=args.adapter_path,
                                          tokenizer_config=tokenizer_config)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if tokenizer.has_chat_template:  # as mlx_lm.cache_prompt: an open user turn
        tokens = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                               add_generation_prompt=False,
                                               continue_final_message=True)
    else:
        tokens = tokenizer.encode(prompt)
    cache = _make_cache(parser, args, model, config, quant)
    _prefill(model, tokens, cache, args)
    print(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB")
    metadata = {"model": args.model or DEFAULT_MODEL,
                "tokenizer_config": json.dumps(tokenizer_config)}
    if config is None:  # mlx-lm's file: mlx_lm.generate loads its model by this path
        from mlx_lm.models.cache import save_prompt_cache

        from ..models import resolve_model

        metadata["model"] = resolve_model(args.model)
    else:
        from ..files import save_prompt_cache

        from ..integration.stats import cache_stats

        print(f"Prompt: {len(tokens)} tokens | {cache_stats(cache).summary()}")
    save_prompt_cache(args.prompt_cache_file, cache, metadata)
    print(f"Saved {args.prompt_cache_file}")
    return 0
