"""`mlx-h2o profile`: per-layer attention entropy, heavy-hitter concentration, score spread.

Example:
    mlx-h2o profile --model smollm2-135m --corpus austen -n 4 --sequence-length 1024
Statistics per attention layer (mean over samples, heads and queries):
  entropy, entropy_norm     attention entropy in nats; / log(visible keys), 1 = uniform
  topk_share                share of the summed attention held by the top --topk keys
  topk_share_norm           the same for the score normalised by the queries that saw it
  score_cv                  std / mean of the normalised score over keys
  sink_share                attention mass on the first --sink positions
Writes <results-dir>/profile/<model>-<corpus>-<hash>/: profile.json and profile.png.
"""

import json

from ..eval.common import fmt_table
from ..eval.results import DEFAULT_ROOT, ResultsDir, machine_info
from .common import (
    add_alias,
    add_corpus_arg,
    add_model_arg,
    check_at_least,
    check_model_arg,
    command_parser,
    ensure_corpus_or_fail,
    fail,
    has_matplotlib,
    load_model_or_fail,
    save_plot,
)


def setup_arg_parser():
    p = command_parser("profile", __doc__)
    add_model_arg(p)
    add_corpus_arg(p)
    p.add_argument("--num-samples", "-n", type=int, default=4,
                   help="token windows drawn from the corpus")
    p.add_argument("--sequence-length", type=int, default=1024, help="tokens per window")
    add_alias(p, "--seq-len", "sequence_length", type=int)
    p.add_argument("--topk", type=float, default=0.1,
                   help="fraction of keys for topk_share (0 < topk <= 1)")
    p.add_argument("--sink", type=int, default=4, help="positions counted by sink_share")
    p.add_argument("--seed", type=int, default=0, help="seed of the window sampling")
    p.add_argument("--results-dir", default=DEFAULT_ROOT, help="root of the results")
    return p


def main(argv=None) -> int:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    if not 0 < args.topk <= 1:
        fail(parser, f"--topk {args.topk:g}: use a fraction of the keys in (0, 1]")
    check_at_least(parser, "--num-samples", args.num_samples, 1)
    check_at_least(parser, "--sequence-length", args.sequence_length, 2)
    check_at_least(parser, "--sink", args.sink, 0)
    check_model_arg(parser, args.model)
    ensure_corpus_or_fail(parser, args.corpus)
    plots = has_matplotlib(parser.prog)
    from ..eval.corpora import load_corpus, sample_token_windows
    from ..eval.profile import STATS, profile_model

    config = {"model": args.model, "corpus": args.corpus, "num_samples": args.num_samples,
              "seq_len": args.sequence_length, "topk": args.topk, "sink": args.sink,
              "seed": args.seed}
    rdir = ResultsDir(args.results_dir, "profile", config, ("model", "corpus"))
    print("# " + " ".join(f"{k}={v}" for k, v in config.items()))
    model, tokenizer = load_model_or_fail(parser, args.model)
    tokens = sample_token_windows(tokenizer, load_corpus(args.corpus), args.num_samples,
                                  args.sequence_length, args.seed, bos=True)
    rows = profile_model(model, tokens, args.topk, args.sink)
    print(fmt_table(rows, ("layer", "kind") + STATS))
    summary = {"config": config, "machine": machine_info(), "layers": rows}
    rdir.save("profile", summary)  # before the plot: it may fail
    if plots:
        from ..eval.plots import plot_profile

        save_plot(plot_profile, rows, STATS, rdir.path / "profile.png",
                  f"{args.model}: attention per layer ({args.corpus}, "
                  f"{args.num_samples} x {args.sequence_length} tokens)", topk=args.topk,
                  sink=args.sink)
    print(json.dumps({"results": str(rdir.path), "layers": rows}))
    return 0
