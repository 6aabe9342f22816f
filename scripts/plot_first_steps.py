"""Plot the decode pauses of first use: seconds above the median step, per run.

    python scripts/plot_first_steps.py OUT.png GROUP,SERIES,LOG,STRATEGY[,K] ... [--title T]

Each ``gpu_step_times.py`` run prints ``STRATEGY ... steps=S median M ms,
total T s``; its pause time is T - S * M (the steps' time above the median,
nearly all of it kernel builds at the first steps). An entry picks the K-th
(default 0) run of STRATEGY in LOG; entries with the same GROUP and SERIES are
averaged (their values are printed). One bar per (group, series).
"""

import argparse
import re
import statistics
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HEADER = re.compile(r"^(\S+) context=\d+ steps=(\d+) median ([\d.]+) ms, total ([\d.]+) s")


def pauses(path: str, strategy: str) -> list:
    """Seconds above the median step of each run of ``strategy`` in the log."""
    out = []
    with open(path) as f:
        for line in f:
            m = HEADER.match(line)
            if m and m.group(1) == strategy:
                steps, median_ms, total_s = int(m.group(2)), float(m.group(3)), float(m.group(4))
                out.append(total_s - steps * median_ms / 1e3)
    return out


def parse_entry(text: str):
    parts = text.split(",")
    if len(parts) not in (4, 5):
        raise ValueError(f"entry {text!r}: want GROUP,SERIES,LOG,STRATEGY[,K]")
    group, series, log, strategy = parts[:4]
    return group, series, log, strategy, int(parts[4]) if len(parts) == 5 else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("entries", nargs="+")
    p.add_argument("--title", default="Pauses at first use, decode (s above the median step)")
    args = p.parse_args()
    values = defaultdict(list)
    for text in args.entries:
        group, series, log, strategy, k = parse_entry(text)
        runs = pauses(log, strategy)
        if k >= len(runs):
            raise SystemExit(f"{log}: {len(runs)} runs of {strategy}, no run {k}")
        values[(group, series)].append(runs[k])
    groups = list(dict.fromkeys(g for g, _ in values))
    series = list(dict.fromkeys(s for _, s in values))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(2.2 + 1.8 * len(groups), 4))
    for j, s in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i, g in enumerate(groups)
              if (g, s) in values]
        ys = [statistics.mean(values[(g, s)]) for g in groups if (g, s) in values]
        bars = ax.bar(xs, ys, width, label=s)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    for (g, s), v in values.items():
        print(f"{g} | {s}: " + ", ".join(f"{x:.3f}" for x in v) + " s")
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title(args.title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
