"""Ratio of two strategies' PPL increases, with paired uncertainty.

    python benchmarks/eval/ratio.py results/ppl/<dir> h2o-heavy-<hash>-kv256-L512 \
        rotating-kv256-L512 [--baseline baseline-L512] [--target 0.3333]

Reads the per-sample mean NLLs saved by ``mlx-h2o ppl`` and prints, for
A = the candidate and B = the reference (both vs the baseline, same samples):
the two deltas in %, R = delta_A / delta_B with a delta-method standard error
and a bootstrap 95% interval (samples resampled together), and the paired
margin delta_A - target * delta_B (< 0 means the target "R <= target" holds)
with its standard error. The statistics live in ``mlx_h2o.eval.ppl.ratio_vs``.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from mlx_h2o.eval.ppl import ratio_vs  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results_dir", type=Path)
    p.add_argument("candidate")
    p.add_argument("reference")
    p.add_argument("--baseline", default=None, help="key (default: baseline-L<seq>)")
    p.add_argument("--target", type=float, default=1 / 3)
    p.add_argument("--boot", type=int, default=10000)
    args = p.parse_args(argv)

    def load(key):
        return json.loads((args.results_dir / f"{key}.json").read_text())

    cand, ref = load(args.candidate), load(args.reference)
    base = load(args.baseline or f"baseline-L{cand['seq_len']}")
    out = ratio_vs(cand, ref, base, target=args.target, boot=args.boot)
    for k, v in out.items():
        print(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
