"""Plot kernel microbenchmark runs: time per call / MLX SDPA's, before vs after.

    python benchmarks/plot_bench_kernels.py BEFORE.log AFTER.log OUT.png [--title T]
        [--before-variant KNOBS] [--after-variant KNOBS]

Reads the final JSON line of every ``bench_kernels.py`` run in each log (a
log may hold several runs, e.g. a base commit's and a change's, alternated),
takes the median ratio per (D, N) over the runs, and draws one panel per head
dim: ratio vs N, before and after, with the target 1.0 dashed. Older logs
hold a row per launch variant ('MMA=0,MAX_ROWS=2'): the ``--*-variant``
options pick one ('' the defaults, and rows without a variant).
"""

import argparse
import json
import statistics
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def knobs(text: str) -> dict:
    """'MMA=0,MAX_ROWS=2' -> {'MMA': 0, 'MAX_ROWS': 2} (as bench_kernels.py)."""
    out = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if not value.lstrip("-").isdigit():
            raise ValueError(f"{item!r}: want NAME=INT")
        out[name] = int(value)
    return out


def ratios(path: str, variant: str = "") -> dict:
    """{(D, N): median of ours / MLX over the log's runs}, rows of ``variant``."""
    want = knobs(variant)
    by_cell = defaultdict(list)
    with open(path) as f:
        for line in f:
            if line.startswith("{"):
                for row in json.loads(line)["attention"]:
                    if row.get("variant", {}) == want:
                        by_cell[(row["D"], row["N"])].append(row["ratio"])
    if not by_cell:
        raise ValueError(f"{path}: no bench_kernels.py JSON row of variant {variant!r}")
    return {cell: statistics.median(rs) for cell, rs in by_cell.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("out")
    p.add_argument("--title", default="")
    p.add_argument("--before-variant", default="", help="the before rows' knobs")
    p.add_argument("--after-variant", default="", help="the after rows' knobs")
    args = p.parse_args()
    before = ratios(args.before, args.before_variant)
    after = ratios(args.after, args.after_variant)
    dims = sorted({d for d, _ in after})
    fig, axes = plt.subplots(1, len(dims), figsize=(4 * len(dims), 3.4), sharey=True)
    for ax, D in zip(axes if len(dims) > 1 else [axes], dims):
        for label, data, style in (("before", before, "o--"), ("after", after, "o-")):
            ns = sorted(n for d, n in data if d == D)
            ax.plot(ns, [data[(D, n)] for n in ns], style, label=label)
        ax.axhline(1.0, color="k", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_title(f"head dim {D}", fontsize=10)
        ax.set_xlabel("keys N")
    axes_list = axes if len(dims) > 1 else [axes]
    axes_list[0].set_ylabel("time / MLX SDPA (no scores)")
    axes_list[0].legend(fontsize=8)
    fig.suptitle(args.title, fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
