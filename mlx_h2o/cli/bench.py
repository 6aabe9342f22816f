"""`mlx-h2o bench`: prefill/decode tok/s and peak memory per cache strategy.

Examples:
    mlx-h2o bench --model smollm2-135m -p 512 -g 128 --max-kv-size 256
    mlx-h2o bench --random-config qwen3-8b --bits 4 -p 4096 -g 256 --max-kv-size 1024
Prints a config header, one key=value line per trial, a summary table and a
final JSON line (for scripts).
"""

import json

from ..eval.bench import RANDOM_CONFIGS
from .common import (
    add_max_kv_size_arg,
    add_prefill_step_arg,
    check_at_least,
    check_budgets,
    check_model_arg,
    command_parser,
    fail,
    load_model_or_fail,
    strategies_or_fail,
)

COLUMNS = ("strategy", "max_kv", "prefill_tps", "decode_tps", "decode_ratio",
           "prefill_ratio", "decode_spread_pct", "peak_gb", "peak_delta_gb", "kv_mb")


def setup_arg_parser():
    p = command_parser("bench", __doc__)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None,
                     help="packaged model or mlx-lm path (default: smollm2-135m)")
    src.add_argument("--random-config", choices=sorted(RANDOM_CONFIGS),
                     help="random weights with a real model's shapes (speed only)")
    p.add_argument("--bits", type=int, default=0, help="quantize a random model (4, 8)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="random-model dtype")
    p.add_argument("--prompt-tokens", "-p", type=int, default=512,
                   help="random prompt tokens per sequence")
    p.add_argument("--generation-tokens", "-g", type=int, default=128,
                   help="decoded tokens per trial")
    p.add_argument("--batch-size", "-b", type=int, default=1, help="sequences per batch")
    add_max_kv_size_arg(p)
    p.add_argument("--strategies", nargs="+", default=["baseline", "rotating", "h2o-heavy"],
                   help="names from mlx_h2o.eval.strategies (name:key=value,...)")
    p.add_argument("--num-trials", "-n", type=int, default=3,
                   help="trials per strategy, interleaved")
    add_prefill_step_arg(p)
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the untimed first trial of each strategy")
    return p


def check_args(parser, args) -> list:
    """The strategies and everything the run needs, before anything loads."""
    strategies = strategies_or_fail(parser, args.strategies)
    if args.model is not None:
        check_model_arg(parser, args.model)
    if args.bits not in (0, 4, 8):
        fail(parser, f"--bits {args.bits}: quantize a random model to 4 or 8 bits (0: not)")
    if args.bits and not args.random_config:
        fail(parser, "--bits quantizes a --random-config model: add --random-config, "
             "or drop --bits")
    for flag, value in (("--prompt-tokens", args.prompt_tokens),
                        ("--generation-tokens", args.generation_tokens),
                        ("--batch-size", args.batch_size), ("--num-trials", args.num_trials),
                        ("--prefill-step-size", args.prefill_step_size)):
        check_at_least(parser, flag, value, 1)
    check_budgets(parser, strategies, args.max_kv_size)
    return strategies


def _load(parser, args):
    import mlx.core as mx

    from ..eval.bench import random_model

    if args.random_config:
        dtype = getattr(mx, args.dtype)
        return random_model(args.random_config, args.bits, dtype=dtype), args.random_config
    name = args.model or "smollm2-135m"
    return load_model_or_fail(parser, name)[0], name


def main(argv=None) -> int:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    strategies = check_args(parser, args)
    import mlx.core as mx

    from ..eval.bench import one_trial, summarize
    from ..eval.common import fmt_table
    from ..eval.results import machine_info

    model, name = _load(parser, args)
    strategies = [s.calibrated(model) for s in strategies]  # layer budgets: no tokenizer
    units = [(st, kv) for st in strategies
             for kv in (args.max_kv_size if st.bounded else [0])]
    config = {"model": name, "bits": args.bits, "prompt_tokens": args.prompt_tokens,
              "generation_tokens": args.generation_tokens, "batch_size": args.batch_size,
              "prefill_step": args.prefill_step_size, "trials": args.num_trials,
              **machine_info()}
    for k, v in config.items():
        print(f"# {k}={v}")
    vocab = model.args.vocab_size if hasattr(model, "args") else 1000
    prompt = mx.random.randint(0, vocab, (args.batch_size, args.prompt_tokens),
                               key=mx.random.key(0))
    run = lambda st, kv: one_trial(model, prompt, st, kv or args.prompt_tokens,  # noqa
                                   args.generation_tokens, args.prefill_step_size)
    if not args.no_warmup:
        for st, kv in units:
            run(st, kv)
    trials = []
    for i in range(args.num_trials):
        for st, kv in units:  # interleaved: every strategy once per trial
            t = dict(trial=i + 1, **run(st, kv))
            trials.append(t)
            print(" ".join(f"{k}={_fmt(v)}" for k, v in t.items()), flush=True)
    rows = summarize(trials)
    print()
    print(fmt_table(rows, COLUMNS))
    print(json.dumps({"config": config, "summary": rows}))
    return 0


def _fmt(v):
    return f"{v:.3f}" if isinstance(v, float) else v
