"""Plot GPU time per call by kernel from ``bench_kernels.py --trace`` logs.

    python scripts/plot_kernel_trace.py [LABEL=]LOG... OUT.png [--title T]

Reads each (D, N) row and the ``trace NAME: T us a call: KERNEL t, ...``
lines after it (one per variant, then MLX's), and draws per (D, N) one
stacked bar per traced variant: its first kernel (pass 1; cuDNN's flash
kernel for MLX) and the rest (the merge; cuDNN's reduction). Several logs
(e.g. a base commit's and this one's) go side by side, their variants
named ``LABEL: variant``.
"""

import argparse
import re
import sys
from collections import OrderedDict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+[\d.]+\s+[\d.]+")
TRACE = re.compile(r"^\s+trace (.+?): ([\d.]+) us a call: (.*)$")
KERNEL = re.compile(r"(.+?) ([\d.]+)(?:, |$)")


def label(name: str) -> str:
    """A trace line's variant as a legend label ("{'MMA': 0}" or "MMA=0" -> MMA=0)."""
    if name == "mlx":
        return "MLX (cuDNN)"
    knobs = re.findall(r"'?(\w+)'?\s*[:=]\s*(-?\d+)", name)
    return ",".join(f"{k}={v}" for k, v in knobs) or "defaults"


def traces(path: str) -> "OrderedDict":
    """{(D, N): {variant: [us of each kernel, largest first]}} in log order."""
    out, cell = OrderedDict(), None
    with open(path) as f:
        for line in f:
            trace = TRACE.match(line)
            if trace:
                if cell is None:
                    raise ValueError(f"{path}: a trace line before any (D, N) row: {line!r}")
                kernels = [float(t) for _, t in KERNEL.findall(trace[3])]
                out.setdefault(cell, OrderedDict())[label(trace[1])] = kernels
                continue
            row = ROW.match(line)
            if row:
                cell = (int(row[1]), int(row[2]))
    if not out:
        raise ValueError(f"{path}: no trace lines (run bench_kernels.py with --trace)")
    return out


def merged(specs) -> "OrderedDict":
    """traces() of each ``[LABEL=]PATH``, cells in first-seen order; with
    more than one log each variant is named ``LABEL: variant``."""
    out = OrderedDict()
    for i, spec in enumerate(specs):
        tag, _, path = spec.rpartition("=") if "=" in spec else (f"log {i + 1}", "", spec)
        for cell, per in traces(path).items():
            for name, kernels in per.items():
                key = f"{tag}: {name}" if len(specs) > 1 else name
                out.setdefault(cell, OrderedDict())[key] = kernels
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+", metavar="[LABEL=]LOG")
    p.add_argument("out")
    p.add_argument("--title", default="")
    args = p.parse_args()
    data = merged(args.logs)
    names = list(OrderedDict.fromkeys(v for per in data.values() for v in per))
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * len(data) + 1), 3.6))
    for j, name in enumerate(names):
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(data))]
        first = [per.get(name, [0.0])[0] for per in data.values()]
        rest = [sum(per.get(name, [0.0])[1:]) for per in data.values()]
        bars = ax.bar(xs, first, width, label=f"{name}: main kernel")
        ax.bar(xs, rest, width, bottom=first, color=bars[0].get_facecolor(), alpha=0.45,
               label=f"{name}: merge / reduction")
    ax.set_xticks(range(len(data)))
    ax.set_xticklabels([f"D={d}\nN={n}" for d, n in data], fontsize=8)
    ax.set_ylabel("GPU us a call (CUPTI)")
    ax.legend(fontsize=7, ncol=min(3, len(names)))
    fig.suptitle(args.title, fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
