"""Markdown rows for a knob screen: each strategy's PPL increase vs the
baseline, its ratio to a reference (Rotating), and its paired difference to a
default H2O strategy, all from the per-sample NLLs ``mlx-h2o ppl`` saved.

    python benchmarks/eval/screen_table.py <results dir> [<dir> ...] \
        --default h2o-heavy-<hash>-kv256-L512 --ref rotating-kv256-L512 --keys <key> ...

Several dirs (disjoint sample sets of the same setup) are pooled by
concatenating their samples. Statistics: ``mlx_h2o.eval.ppl.ratio_vs``.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from mlx_h2o.eval.ppl import ratio_vs  # noqa: E402


def load(dirs, key):
    parts = [json.loads((d / f"{key}.json").read_text()) for d in dirs]
    out = dict(parts[0])
    out["nll_per_sample"] = [x for p in parts for x in p["nll_per_sample"]]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dirs", type=Path, nargs="+")
    p.add_argument("--default", required=True)
    p.add_argument("--ref", default="rotating-kv256-L512")
    p.add_argument("--baseline", default="baseline-L512")
    p.add_argument("--keys", nargs="+", required=True)
    p.add_argument("--boot", type=int, default=10000)
    a = p.parse_args(argv)
    base, ref, dflt = (load(a.dirs, k) for k in (a.baseline, a.ref, a.default))
    print("| strategy | Δ vs baseline | ratio to Rotating ± se (bootstrap 95%) "
          "| margin Δ − Δ_Rot/3 | Δ(cand − default) |")
    print("|---|---|---|---|---|")
    for key in [a.default] + [k for k in a.keys if k != a.default]:
        c = load(a.dirs, key)
        r = ratio_vs(c, ref, base, boot=a.boot)
        se_b = ratio_vs(c, c, base, target=0.0, boot=2)["margin_se_pct"]
        d = ratio_vs(c, dflt, base, target=1.0, boot=2)
        diff = "—" if key == a.default else f"{d['margin_pct']:+.2f} ± {d['margin_se_pct']:.2f}"
        lo, hi = r["ratio_ci95"]
        print(f"| {c['strategy']} | {r['delta_cand_pct']:+.2f}% ± {se_b:.2f} "
              f"| {r['ratio']:.2f} ± {r['ratio_se']:.2f} ({lo:.2f} .. {hi:.2f}) "
              f"| {r['margin_pct']:+.2f} ± {r['margin_se_pct']:.2f} | {diff} |")
    print(f"\nn={r['n']}, Rotating Δ {r['delta_ref_pct']:+.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
