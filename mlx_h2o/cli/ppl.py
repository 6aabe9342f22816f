"""`mlx-h2o ppl`: perplexity of cache strategies over budgets and sequence lengths.

Example (the paper protocol: 10 samples x 512 tokens, 32-token prefill):
    mlx-h2o ppl --model smollm2-135m --corpus austen --max-kv-size 256
Sweeps: ``--max-kv-size 128 256 512 1024 --sequence-length 2048`` or
``--max-kv-size 256 --sequence-length 512 1024 2048 4096``.
Writes <results-dir>/ppl/<model>-<corpus>-<mode>-<hash>/: one JSON per finished
(strategy, max_kv, seq_len) (a rerun skips them), summary.json and PNG plots.
"""

import json
import time

from ..eval.common import fmt_table
from ..eval.results import ResultsDir, machine_info
from ..eval.strategies import DEFAULT_STRATEGIES
from .common import (
    add_alias,
    add_corpus_arg,
    add_max_kv_size_arg,
    add_model_arg,
    add_output_args,
    check_at_least,
    check_budgets,
    check_model_arg,
    command_parser,
    ensure_corpus_or_fail,
    fail,
    has_matplotlib,
    load_model_or_fail,
    save_plot,
    strategies_or_fail,
)

COLUMNS = ("seq_len", "strategy", "max_kv", "ppl", "ppl_se", "delta_pct", "delta_se_pct",
           "seconds")


def setup_arg_parser():
    p = command_parser("ppl", __doc__)
    add_model_arg(p)
    add_corpus_arg(p)
    p.add_argument("--num-samples", "-n", type=int, default=10,
                   help="token windows drawn from the corpus")
    p.add_argument("--sequence-length", type=int, nargs="+", default=[512],
                   help="tokens per window; several: a sweep")
    add_alias(p, "--seq-len", "sequence_length", type=int, nargs="+")
    add_max_kv_size_arg(p)
    p.add_argument("--strategies", nargs="+", default=list(DEFAULT_STRATEGIES),
                   help="names from mlx_h2o.eval.strategies (name:key=value,...)")
    p.add_argument("--mode", choices=("decode", "chunked"), default="decode",
                   help="decode: paper protocol; chunked: full sequence in chunks")
    p.add_argument("--prefill", type=int, default=32, help="prefill tokens (decode mode)")
    p.add_argument("--prefill-step-size", type=int, default=0, metavar="N",
                   help="prefill in chunks of N tokens, as mlx-lm's generate does "
                   "(decode mode; 0: the prefill in one chunk)")
    p.add_argument("--chunk", type=int, default=64, help="chunk tokens (chunked mode)")
    p.add_argument("--batch-size", type=int, default=0,
                   help="samples per batch (0: all samples in one batch)")
    p.add_argument("--seed", type=int, default=0, help="seed of the window sampling")
    p.add_argument("--no-bos", action="store_true", help="do not start samples with BOS")
    add_output_args(p)
    return p


def check_args(parser, args) -> list:
    """The strategies, and counts, lengths and budgets that can run: before
    anything loads."""
    check_model_arg(parser, args.model)
    strategies = strategies_or_fail(parser, args.strategies)
    check_at_least(parser, "--num-samples", args.num_samples, 1)
    check_at_least(parser, "--batch-size", args.batch_size, 0)
    check_at_least(parser, "--chunk", args.chunk, 1)
    least = args.prefill + 1 if args.mode == "decode" else 2
    for L in args.sequence_length:
        if L < least:
            fail(parser, f"--sequence-length {L}: a window needs at least {least} tokens "
                 + (f"(--prefill {args.prefill} plus one decoded)" if args.mode == "decode"
                    else "(one predicted)"))
    if args.mode == "decode":
        check_at_least(parser, "--prefill", args.prefill, 1)
    check_at_least(parser, "--prefill-step-size", args.prefill_step_size, 0)
    if args.prefill_step_size and args.mode != "decode":
        fail(parser, "--prefill-step-size is a decode-mode option: with --mode chunked "
             "use --chunk")
    check_budgets(parser, strategies, args.max_kv_size)
    return strategies


def run_config(args) -> dict:
    config = {
        "model": args.model, "corpus": args.corpus, "num_samples": args.num_samples,
        "mode": args.mode, "prefill": args.prefill if args.mode == "decode" else None,
        "chunk": args.chunk if args.mode == "chunked" else None, "seed": args.seed,
        "bos": not args.no_bos,
    }
    if args.prefill_step_size:  # absent when 0: results folders from before match
        config["prefill_step"] = args.prefill_step_size
    return config


def load_data(tokenizer, args) -> dict:
    from ..eval.corpora import load_corpus, sample_token_windows

    docs = load_corpus(args.corpus)
    return {
        L: sample_token_windows(tokenizer, docs, args.num_samples, L, args.seed,
                                bos=not args.no_bos)
        for L in args.sequence_length
    }


def main(argv=None) -> int:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    strategies = check_args(parser, args)
    ensure_corpus_or_fail(parser, args.corpus)
    plots = has_matplotlib(parser.prog)
    config = run_config(args)
    rdir = ResultsDir(args.results_dir, "ppl", config, ("model", "corpus", "mode"))
    print(f"# mlx-h2o ppl  results={rdir.path}")
    print("# " + " ".join(f"{k}={v}" for k, v in config.items()))
    print(f"# sequence_length={args.sequence_length} max_kv_size={args.max_kv_size} "
          f"strategies={args.strategies}")
    model, tokenizer = load_model_or_fail(parser, args.model)
    from ..eval.ppl import sweep

    strategies = [s.calibrated(model, tokenizer) for s in strategies]
    data = load_data(tokenizer, args)
    tic = time.perf_counter()
    kw = dict(mode=args.mode, prefill=args.prefill, chunk=args.chunk,
              prefill_step=args.prefill_step_size, show=not args.no_progress)
    rows = sweep(model, data, strategies, args.max_kv_size, rdir,
                 batch_size=args.batch_size, **kw)
    print()
    print(fmt_table(rows, COLUMNS))
    summary = {"config": config, "machine": machine_info(),
               "seconds": time.perf_counter() - tic,
               "rows": [{k: r.get(k) for k in COLUMNS} for r in rows]}
    rdir.save("summary", summary)  # before the plots: they may fail
    if plots:
        _plots(rows, args, rdir)
    print(json.dumps({"results": str(rdir.path), "rows": summary["rows"]}))
    return 0


def _plots(rows, args, rdir):
    from ..eval.plots import plot_ppl, plot_ppl_bars

    name = f"{args.model} {args.corpus} {args.mode} n={args.num_samples}"
    for L in args.sequence_length:  # always one: PPL increase per strategy and budget
        sel = [r for r in rows if r["seq_len"] == L]
        save_plot(plot_ppl_bars, sel, rdir.path / f"ppl_L{L}.png", f"{name} seq_len={L}")
    if len(args.max_kv_size) > 1:
        for L in args.sequence_length:
            sel = [r for r in rows if r["seq_len"] == L]
            save_plot(plot_ppl, sel, "max_kv", rdir.path / f"ppl_vs_max_kv_L{L}.png",
                      f"{name} seq_len={L}")
    if len(args.sequence_length) > 1:
        for kv in args.max_kv_size:
            sel = [r for r in rows if r["max_kv"] in (kv, None)]
            save_plot(plot_ppl, sel, "seq_len", rdir.path / f"ppl_vs_seq_len_kv{kv}.png",
                      f"{name} max_kv={kv}")
