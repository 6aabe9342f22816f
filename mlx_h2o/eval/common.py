"""Helpers shared by the evaluation commands: model loading, progress, stats."""

import math
import sys
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

def load_any(name: str) -> tuple[Any, Any]:
    """A packaged model name (``smollm2-135m``, ``gemma3-270m``) or any mlx-lm path."""
    try:
        from ..models import load_model
    except ImportError:  # the packaged-model layer is optional here
        from mlx_lm import load as load_model
    return load_model(name)


def progress(iterable=None, total=None, desc="", enabled=True):
    """tqdm on stderr when it is a terminal or asked for; a plain iterator otherwise."""
    if enabled:
        try:
            from tqdm import tqdm

            return tqdm(iterable, total=total, desc=desc, leave=False, file=sys.stderr)
        except ImportError:
            pass
    return _Quiet(iterable)


class _Quiet:
    def __init__(self, iterable):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)

    def update(self, n=1):
        pass

    def close(self):
        pass


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and its standard error (sample std / sqrt(n); 0 for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def eval_cache(logits: mx.array, cache: list[Any]) -> None:
    """Evaluate a step's output with every cache array (keeps graphs short)."""
    arrays = [logits]
    for c in cache:
        state = c.state
        arrays.extend(state if isinstance(state, (list, tuple)) else [state])
    mx.eval(arrays)


def fmt_table(rows: list[dict[str, Any]], cols: Sequence[str]) -> str:
    """A markdown table of ``rows`` with the given columns."""

    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(cell(r.get(c)) for c in cols) + " |")
    return "\n".join(lines)
