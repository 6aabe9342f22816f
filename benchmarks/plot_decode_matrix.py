"""Plot the decode matrix: paired tok/s ratios against their targets.

    python benchmarks/plot_decode_matrix.py OUT.png LABEL=GLOB ... [--title T]

Each GLOB names ``decode_matrix.py`` logs (one context / budget each; their last
line is the run's JSON). A panel per target: H2O without eviction against
KVCache (>= 0.99), H2O evicting every step and in batches of 64 against
RotatingKVCache (>= 0.97); a bar per (context / budget, LABEL). A ratio is
the median over rounds of the base's wall time over the strategy's, as
``decode_matrix.py`` prints it ("tok/s vs").
"""

import argparse
import glob
import json
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (strategy, base, target, panel title)
PANELS = [
    ("h2o_no_evict", "kvcache", 0.99, "H2O, no eviction / KVCache"),
    ("h2o", "rotating", 0.97, "H2O, evicting every step / Rotating"),
    ("h2o_batch64", "rotating", 0.97, "H2O, evict_batch=64 / Rotating"),
]


def ratios(path: str) -> tuple:
    """((context, budget), {strategy: tok/s ratio to its base}) of one log."""
    with open(path) as f:
        lines = f.read().strip().splitlines()
    try:
        run = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise SystemExit(f"{path}: no final JSON line (a decode_matrix.py run cut short?)")
    rows = run["rows"]
    out = {s: statistics.median(b["wall"] / x["wall"] for x, b in zip(rows[s], rows[base]))
           for s, base, _, _ in PANELS if s in rows and base in rows}
    return (run["context"], run["budget"]), out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("series", nargs="+", help="LABEL=GLOB")
    p.add_argument("--title", default="Decode tok/s ratios (paired medians)")
    args = p.parse_args(argv)
    data = {}  # label -> {(context, budget): ratios}
    for entry in args.series:
        label, sep, pattern = entry.partition("=")
        paths = sorted(glob.glob(pattern))
        if not sep or not paths:
            print(f"{entry!r}: want LABEL=GLOB matching decode_matrix.py logs", file=sys.stderr)
            return 2
        data[label] = dict(ratios(path) for path in paths)
    figure(data, args.title).savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


def figure(data: dict, title: str):
    """A panel per target, a bar per (context / budget, label); prints the values."""
    cells = sorted({cell for runs in data.values() for cell in runs})
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4), sharey=True)
    width = 0.8 / len(data)
    for ax, (strategy, _, target, panel) in zip(axes, PANELS):
        for i, (label, runs) in enumerate(data.items()):
            xs = [j + i * width for j, cell in enumerate(cells) if strategy in runs.get(cell, {})]
            ys = [runs[cell][strategy] for cell in cells if strategy in runs.get(cell, {})]
            ax.bar(xs, ys, width, label=label)
            for x, y in zip(xs, ys):
                print(f"{panel}: {label} {cells[round(x - i * width)]} {y:.3f}")
        ax.axhline(target, color="k", linestyle="--", linewidth=1)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cells))])
        ax.set_xticklabels([f"{c // 1024 or c}{'K' if c >= 1024 else ''} / {b}"
                            for c, b in cells], rotation=30)
        ax.set_title(panel, fontsize=10)
        ax.set_ylim(0.7, 1.2)
    axes[0].set_ylabel("tok/s ratio (dashed: target)")
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    sys.exit(main())
