"""`mlx-h2o profile`: per-layer attention entropy, heavy-hitter concentration, score spread.

Example:
    mlx-h2o profile --model smollm2-135m --corpus austen -n 4 --seq-len 1024
"""

import argparse
import json

from ..eval.common import fmt_table, load_any
from ..eval.plots import plot_profile
from ..eval.profile import STATS, profile_model
from ..eval.results import DEFAULT_ROOT, ResultsDir, machine_info


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--corpus", default="austen")
    p.add_argument("--num-samples", "-n", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--topk", type=float, default=0.1, help="fraction of keys for topk_share")
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", default=DEFAULT_ROOT)
    return p


def main(argv=None) -> int:
    args = setup_arg_parser().parse_args(argv)
    from ..eval.corpora import load_corpus, sample_token_windows

    config = {k: getattr(args, k) for k in
              ("model", "corpus", "num_samples", "seq_len", "topk", "sink", "seed")}
    rdir = ResultsDir(args.results_dir, "profile", config, ("model", "corpus"))
    print("# " + " ".join(f"{k}={v}" for k, v in config.items()))
    model, tokenizer = load_any(args.model)
    tokens = sample_token_windows(tokenizer, load_corpus(args.corpus), args.num_samples,
                                  args.seq_len, args.seed, bos=True)
    rows = profile_model(model, tokens, args.topk, args.sink)
    print(fmt_table(rows, ("layer", "kind") + STATS))
    out = plot_profile(rows, STATS, rdir.path / "profile.png",
                       f"{args.model} {args.corpus} L={args.seq_len} n={args.num_samples}")
    print(f"# plot {out}")
    summary = {"config": config, "machine": machine_info(), "layers": rows}
    rdir.save("profile", summary)
    print(json.dumps({"results": str(rdir.path), "layers": rows}))
    return 0
