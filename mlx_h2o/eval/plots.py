"""PNG plots of the evaluation results (matplotlib, headless)."""

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_ppl(rows: list[dict[str, Any]], x: str, path, title: str = "") -> Path:
    """PPL (with standard-error bars) vs ``x`` (max_kv or seq_len), one line per strategy.

    Rows without a budget (the baseline) are drawn as a dashed line per x
    value of the other rows (seq_len) or a horizontal line (max_kv).
    """
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    lines: dict[str, list] = {}
    for r in rows:
        lines.setdefault(r["strategy"], []).append(r)
    for name, rs in lines.items():
        pts = sorted((r[x], r["ppl"], r["ppl_se"]) for r in rs if r.get(x) is not None)
        if not pts and x == "max_kv":
            for r in rs:
                ax.axhline(r["ppl"], ls="--", color="k", lw=1, label=f"{name}")
            continue
        xs, ys, es = zip(*pts)
        style = dict(ls="--", color="k") if name == "baseline" else {}
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=name, **style)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(x)
    ax.set_ylabel("perplexity")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_heatmaps(acc: dict[str, dict], rows: Sequence, cols: Sequence, path,
                  row_label="context", col_label="depth", title="") -> Path:
    """One accuracy heatmap per strategy: acc[strategy][(row, col)] in [0, 1]."""
    plt = _plt()
    names = list(acc)
    fig, axes = plt.subplots(1, len(names), figsize=(2.6 * len(names) + 1, 2.8),
                             squeeze=False)
    for ax, name in zip(axes[0], names):
        grid = [[acc[name].get((r, c), float("nan")) for c in cols] for r in rows]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_title(name, fontsize=9)
        ax.set_xticks(range(len(cols)), [f"{c:g}" for c in cols], fontsize=7)
        ax.set_yticks(range(len(rows)), [str(r) for r in rows], fontsize=7)
        ax.set_xlabel(col_label, fontsize=8)
        for i, line in enumerate(grid):
            for j, v in enumerate(line):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
    axes[0][0].set_ylabel(row_label, fontsize=8)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    fig.suptitle(title, fontsize=9)
    return _save(fig, path, tight=False)


def plot_profile(layers: list[dict[str, Any]], keys: Sequence[str], path,
                 title: str = "") -> Path:
    """One panel per statistic, vs layer index."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(keys), figsize=(3.6 * len(keys), 3.2), squeeze=False)
    xs = [r["layer"] for r in layers]
    for ax, key in zip(axes[0], keys):
        ax.plot(xs, [r[key] for r in layers], marker="o", ms=3)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("layer", fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def _save(fig, path, tight=True) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    return path
