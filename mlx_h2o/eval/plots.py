"""PNG plots of the evaluation results (matplotlib, headless)."""

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# What each `mlx-h2o profile` statistic means (eval/profile.py), for panel titles.
PROFILE_LABELS = {
    "entropy": "attention entropy (nats)",
    "entropy_norm": "entropy / log(visible keys)\n(1 = uniform attention)",
    "topk_share": "share of attention held by\nthe top {topk:.0%} of keys (sum score)",
    "topk_share_norm": "the same for the normalised\nscore (sum / queries that saw it)",
    "score_cv": "spread of the normalised score\n(std / mean over keys)",
    "sink_share": "attention on the first\n{sink} positions (sinks)",
}


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
    ticks = sorted({r[x] for r in rows if r.get(x) is not None})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("KV budget per layer (max_kv, tokens)" if x == "max_kv"
                  else "sequence length (tokens)")
    ax.set_ylabel("perplexity (± standard error)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_ppl_bars(rows: list[dict[str, Any]], path, title: str = "") -> Path:
    """One bar per bounded strategy and budget: its PPL change vs the baseline
    in % (± standard error of the paired difference); PPL itself without one."""
    plt = _plt()
    base = next((r for r in rows if r.get("max_kv") is None), None)
    bounded = [r for r in rows if r.get("max_kv") is not None]
    names = list(dict.fromkeys(r["strategy"] for r in bounded))
    budgets = sorted({r["max_kv"] for r in bounded})
    key, err = ("delta_pct", "delta_se_pct") if base else ("ppl", "ppl_se")
    fig, ax = plt.subplots(figsize=(max(4.8, 1.1 * len(names) * len(budgets) + 2), 4.2))
    width = 0.8 / max(len(budgets), 1)
    for j, kv in enumerate(budgets):
        by = {r["strategy"]: r for r in bounded if r["max_kv"] == kv}
        xs = [i + (j - (len(budgets) - 1) / 2) * width for i, n in enumerate(names)
              if n in by]
        ys = [by[n].get(key) or 0.0 for n in names if n in by]
        es = [by[n].get(err) or 0.0 for n in names if n in by]
        ax.bar(xs, ys, width, yerr=es, capsize=3, label=f"max_kv={kv}")
        for xi, y, e in zip(xs, ys, es):  # above the error bar, not under it
            ax.annotate(f"{y:.2f}", (xi, y + e if y >= 0 else y - e), ha="center",
                        va="bottom" if y >= 0 else "top", fontsize=7,
                        xytext=(0, 2 if y >= 0 else -2), textcoords="offset points")
    ax.set_xticks(range(len(names)), names, fontsize=8, rotation=15)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_ylabel("PPL change vs baseline (%)" if base else "perplexity")
    sub = f"baseline (unbounded KVCache) PPL {base['ppl']:.3f}" if base else "no baseline"
    ax.set_title(f"{title}\n{sub}; bars: ± standard error", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.margins(y=0.12)  # room for the labels above the error bars
    if len(budgets) > 1:
        ax.legend(fontsize=8)
    elif budgets:
        ax.set_xlabel(f"strategy at max_kv={budgets[0]} (KV budget per layer)", fontsize=8)
    return _save(fig, path)


def _tick(value) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def plot_heatmaps(acc: dict[str, dict], rows: Sequence, cols: Sequence, path,
                  row_label="context (tokens)", col_label="passkey depth (0 = start)",
                  title="") -> Path:
    """One accuracy heatmap per strategy: acc[strategy][(row, col)] in [0, 1]."""
    plt = _plt()
    names = list(acc)
    width = max(2.8, 0.5 * len(cols) + 0.8)  # a panel: wide enough for its cells
    fig, axes = plt.subplots(1, len(names), figsize=(width * len(names) + 2.4,
                                                     max(3.4, 0.45 * len(rows) + 2.0)),
                             squeeze=False, layout="constrained")
    for ax, name in zip(axes[0], names):
        grid = [[acc[name].get((r, c), float("nan")) for c in cols] for r in rows]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_title(name, fontsize=9)
        ax.set_xticks(range(len(cols)), [_tick(c) for c in cols], fontsize=7,
                      rotation=0 if all(isinstance(c, (int, float)) for c in cols) else 45)
        ax.set_yticks(range(len(rows)), [str(r) for r in rows], fontsize=7)
        ax.set_xlabel(col_label, fontsize=8)
        for i, line in enumerate(grid):
            for j, v in enumerate(line):
                if v == v:  # a cell not measured (NaN) stays blank
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
    axes[0][0].set_ylabel(row_label, fontsize=8)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
    _suptitle(fig, title, fontsize=9)
    return _save(fig, path, tight=False)


def plot_profile(layers: list[dict[str, Any]], keys: Sequence[str], path,
                 title: str = "", topk: float = 0.1, sink: int = 4) -> Path:
    """One panel per statistic vs layer index, three panels a row."""
    plt = _plt()
    ncols = min(3, len(keys))
    nrows = -(-len(keys) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.0 * nrows + 0.6),
                             squeeze=False, sharex=True, layout="constrained")
    from matplotlib.ticker import MaxNLocator

    xs = [r["layer"] for r in layers]
    windowed = [r for r in layers if r.get("kind") == "RotatingKVCache"]
    for i, (ax, key) in enumerate(zip(axes.flat, keys)):
        ax.plot(xs, [r[key] for r in layers], marker="o", ms=3)
        if windowed:  # Gemma 3's local layers: hollow markers
            ax.plot([r["layer"] for r in windowed], [r[key] for r in windowed], "o", ms=6,
                    mfc="none", color="C1", label="sliding-window layer")
            if i == 0:
                ax.legend(fontsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        label = PROFILE_LABELS.get(key, key).format(topk=topk, sink=sink)
        ax.set_title(f"{key}: {label}", fontsize=8)
        if i >= len(keys) - ncols:
            ax.set_xlabel("layer", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    _suptitle(fig, title, fontsize=10)
    return _save(fig, path, tight=False)


def _suptitle(fig, title: str, fontsize: float) -> None:
    """The figure's title, wrapped to its width: a centred line wider than the
    figure loses both ends."""
    text = fig.suptitle(title, fontsize=fontsize)
    room = 0.96 * fig.get_figwidth() * fig.dpi
    wide = text.get_window_extent(fig.canvas.get_renderer()).width
    if wide > room:
        longest = max(len(line) for line in title.splitlines())
        chars = max(16, int(longest * room / wide))
        text.set_text("\n".join(w for line in title.splitlines()
                                for w in textwrap.wrap(line, chars) or [""]))


def _save(fig, path, tight=True) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    return path
