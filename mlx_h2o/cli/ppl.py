"""`mlx-h2o ppl`: perplexity of cache strategies over budgets and sequence lengths.

Example (the paper protocol: 10 samples x 512 tokens, 32-token prefill):
    mlx-h2o ppl --model smollm2-135m --corpus austen --max-kv 256
Sweeps: ``--max-kv 128 256 512 1024 --seq-len 2048`` or
``--max-kv 256 --seq-len 512 1024 2048 4096``.
"""

import argparse
import json
import time

from ..eval.common import fmt_table, load_any
from ..eval.plots import plot_ppl
from ..eval.ppl import sweep
from ..eval.results import DEFAULT_ROOT, ResultsDir, machine_info
from ..eval.strategies import DEFAULT_STRATEGIES, parse_strategy

COLUMNS = ("seq_len", "strategy", "max_kv", "ppl", "ppl_se", "delta_pct", "delta_se_pct",
           "seconds")


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m",
                   help="packaged model (smollm2-135m, gemma3-270m) or an mlx-lm path")
    p.add_argument("--corpus", default="austen",
                   help="austen, python-docs, sharegpt or hf:<dataset>")
    p.add_argument("--num-samples", "-n", type=int, default=10)
    p.add_argument("--seq-len", type=int, nargs="+", default=[512])
    p.add_argument("--max-kv", type=int, nargs="+", default=[256])
    p.add_argument("--strategies", nargs="+", default=list(DEFAULT_STRATEGIES),
                   help="names from mlx_h2o.eval.strategies (name:key=value,...)")
    p.add_argument("--mode", choices=("decode", "chunked"), default="decode",
                   help="decode: paper protocol; chunked: full sequence in chunks")
    p.add_argument("--prefill", type=int, default=32, help="prefill tokens (decode mode)")
    p.add_argument("--chunk", type=int, default=64, help="chunk tokens (chunked mode)")
    p.add_argument("--batch-size", type=int, default=0,
                   help="samples per batch (0: all samples in one batch)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-bos", action="store_true", help="do not start samples with BOS")
    p.add_argument("--results-dir", default=DEFAULT_ROOT)
    p.add_argument("--no-progress", action="store_true")
    return p


def run_config(args) -> dict:
    return {
        "model": args.model, "corpus": args.corpus, "num_samples": args.num_samples,
        "mode": args.mode, "prefill": args.prefill if args.mode == "decode" else None,
        "chunk": args.chunk if args.mode == "chunked" else None, "seed": args.seed,
        "bos": not args.no_bos,
    }


def load_data(tokenizer, args) -> dict:
    from ..eval.corpora import load_corpus, sample_token_windows

    docs = load_corpus(args.corpus)
    return {
        L: sample_token_windows(tokenizer, docs, args.num_samples, L, args.seed,
                                bos=not args.no_bos)
        for L in args.seq_len
    }


def main(argv=None) -> int:
    args = setup_arg_parser().parse_args(argv)
    strategies = [parse_strategy(s) for s in args.strategies]
    config = run_config(args)
    rdir = ResultsDir(args.results_dir, "ppl", config, ("model", "corpus", "mode"))
    print(f"# mlx-h2o ppl  results={rdir.path}")
    print("# " + " ".join(f"{k}={v}" for k, v in config.items()))
    print(f"# seq_len={args.seq_len} max_kv={args.max_kv} strategies={args.strategies}")
    model, tokenizer = load_any(args.model)
    strategies = [s.calibrated(model, tokenizer) for s in strategies]
    data = load_data(tokenizer, args)
    tic = time.perf_counter()
    kw = dict(mode=args.mode, prefill=args.prefill, chunk=args.chunk,
              show=not args.no_progress)
    rows = sweep(model, data, strategies, args.max_kv, rdir, batch_size=args.batch_size,
                 **kw)
    print()
    print(fmt_table(rows, COLUMNS))
    _plots(rows, args, rdir)
    summary = {"config": config, "machine": machine_info(),
               "seconds": time.perf_counter() - tic,
               "rows": [{k: r.get(k) for k in COLUMNS} for r in rows]}
    (rdir.path / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({"results": str(rdir.path), "rows": summary["rows"]}))
    return 0


def _plots(rows, args, rdir):
    name = f"{args.model} {args.corpus} {args.mode} n={args.num_samples}"
    if len(args.max_kv) > 1:
        for L in args.seq_len:
            sel = [r for r in rows if r["seq_len"] == L]
            out = plot_ppl(sel, "max_kv", rdir.path / f"ppl_vs_max_kv_L{L}.png",
                           f"{name} seq_len={L}")
            print(f"# plot {out}")
    if len(args.seq_len) > 1:
        for kv in args.max_kv:
            sel = [r for r in rows if r["max_kv"] in (kv, None)]
            out = plot_ppl(sel, "seq_len", rdir.path / f"ppl_vs_seq_len_kv{kv}.png",
                           f"{name} max_kv={kv}")
            print(f"# plot {out}")
