"""Per-layer KV budgets at a fixed total (PyramidKV / Ada-KV-style allocation).

Layers whose attention is spread over many keys lose more when keys are
evicted; layers that attend to a few heavy hitters can keep fewer. Given one
non-negative weight per layer (e.g. exp(entropy) = the effective number of
attended keys, or 1 - top-k share), ``allocate_layer_sizes`` gives each layer
a size proportional to its weight, clipped to [lo, hi], with the sum exactly
``total`` (the memory of a uniform budget: max_kv x layers). ``layer_sizes``
sets those bounds and that total for a model's attention layers at a budget.
Pure functions: no mlx, no model.
"""

import math
from typing import Optional, Sequence, Union

Bound = Union[int, Sequence[int]]
SPREAD = 4.0  # a layer gets between max_kv / SPREAD and max_kv * SPREAD slots


def layer_sizes(
    weights: Sequence[float],
    windows: Sequence[Optional[int]],
    max_kv: int,
    sink: int,
    spread: float = SPREAD,
) -> list[int]:
    """Per-layer max_size in proportion to ``weights``, at the memory a uniform
    ``max_kv`` budget can use.

    ``windows``: per attention layer, its sliding window (Gemma 3 local layers)
    or None. A uniform budget holds at most ``min(max_kv, window)`` visible
    tokens in a window layer, so the total is ``sum(min(max_kv, window_i))``
    (``max_kv`` x layers when no window is smaller than max_kv) and a window
    layer never gets more than its window. Every layer gets within
    [max_kv / spread, max_kv * spread] (and at least ``sink + 2``: sinks plus
    one heavy and one recent slot). Equal weights give the uniform budget.
    """
    if len(windows) != len(weights):
        raise ValueError(f"{len(weights)} layer weights for {len(windows)} attention layers")
    if max_kv < sink + 2:
        raise ValueError(
            f"max_kv={max_kv} is below sink + 2 = {sink + 2}: a layer needs its sinks "
            "plus one heavy and one recent slot; raise max_kv or lower the sink"
        )
    caps = [None if w is None else max(int(w), sink + 2) for w in windows]
    top = int(max_kv * spread)
    hi = [top if c is None else min(top, c) for c in caps]
    total = sum(max_kv if c is None else min(max_kv, c) for c in caps)
    lo = max(int(max_kv / spread), sink + 2)
    return allocate_layer_sizes(weights, total, [min(lo, h) for h in hi], hi)


def allocate_layer_sizes(
    weights: Sequence[float], total: int, lo: Bound, hi: Bound
) -> list[int]:
    """Integer sizes ``s_i = clip(c * w_i, lo_i, hi_i)``, rounded, ``sum(s) == total``.

    ``c`` is found by bisection (the clipped sum is monotone in c); rounding
    floors every size and hands the remaining units to the largest fractional
    parts (ties: larger weight first), so sizes are non-decreasing in the
    weight among layers with the same bounds. ``lo`` / ``hi`` are ints or one
    per layer. Raises ValueError when ``total`` cannot be met within the bounds.
    """
    n = len(weights)
    lo_, hi_ = _per_layer(lo, n, "lo"), _per_layer(hi, n, "hi")
    if n == 0:
        raise ValueError("weights is empty: need one weight per layer")
    if any(not math.isfinite(w) or w < 0 for w in weights) or not sum(weights) > 0:
        raise ValueError(f"weights must be finite, >= 0, not all 0; got {list(weights)}")
    if any(a > b for a, b in zip(lo_, hi_)):
        raise ValueError(f"lower bounds {lo_} exceed upper bounds {hi_}")
    if not sum(lo_) <= total <= sum(hi_):
        raise ValueError(
            f"total={total} is outside [sum(lo), sum(hi)] = [{sum(lo_)}, {sum(hi_)}]"
        )

    def clipped(c):
        return [min(max(c * w, a), b) for w, a, b in zip(weights, lo_, hi_)]

    lo_c, hi_c = 0.0, 1.0
    while sum(clipped(hi_c)) < total and hi_c < 1e300:
        hi_c *= 2
    for _ in range(200):
        mid = (lo_c + hi_c) / 2
        lo_c, hi_c = (mid, hi_c) if sum(clipped(mid)) < total else (lo_c, mid)
    x = clipped(hi_c)
    sizes = [min(math.floor(v), b) for v, b in zip(x, hi_)]
    order = sorted(range(n), key=lambda i: (x[i] - sizes[i], weights[i]), reverse=True)
    short = total - sum(sizes)  # < n: the floors lose less than 1 per layer
    for i in order:
        if short > 0 and sizes[i] < hi_[i]:
            sizes[i], short = sizes[i] + 1, short - 1
    if short != 0:
        raise ValueError(f"could not round to total={total} (left {short})")
    return sizes


def _per_layer(bound: Bound, n: int, name: str) -> list[int]:
    if isinstance(bound, int):
        return [bound] * n
    bound = [int(b) for b in bound]
    if len(bound) != n:
        raise ValueError(f"{name} has {len(bound)} entries for {n} layers")
    return bound
