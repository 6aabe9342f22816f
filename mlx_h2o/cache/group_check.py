"""The group fold's first use on Metal, checked on its first real token.

The Metal kernels were never run on an Apple GPU (docs/GPU.md, "Metal: not
run"). kernels/selfcheck.py checks the attention kernels before any kernel
runs; the group fold, a full cache's one launch a token, is checked here on
the first token a group folds with it: the kernel's result against the
per-layer policy ops on the same state. If the kernel fails or disagrees
beyond near ties, a warning says so, that token takes the reference's
result and every group stays on the reference (the same decisions,
slower). CUDA's kernels ran on GPUs here and are not checked.
"""

import warnings
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from .. import policy
from ..kernels.build import device_backend

# Scores are float32 sums taken in another order by the kernel: ~1e-6 apart.
SCORE_RTOL = 1e-4
# Two victims whose eviction scores are this close are a near tie, either is right.
TIE_RTOL = 1e-5

_PASSED = {}  # group kind ("dense" / "quantized") -> whether its kernel passed


def needs_check(kind) -> bool:
    """Whether the next kernel fold of this kind must be checked first."""
    return device_backend() == "metal" and kind[0] not in _PASSED


def passed(kind) -> bool:
    """False once this kind's kernel failed its check (then: the reference)."""
    return _PASSED.get(kind[0], True)


def checked_fold(kind, mode: str, kernel: Callable, reference: Callable):
    """``kernel()``'s fold if it matches ``reference()``'s, else the
    reference's; the outcome is kept for ``kind``. Both return (positions,
    score, count, victim, victims) as StepGroup's folds do."""
    want = reference()
    mx.eval(want)
    try:
        got = kernel()
        mx.eval(got)
        bad = differs(mode, got, want)
    except Exception as e:  # a kernel that does not build or launch
        bad = f"{type(e).__name__}: {e}"
    _PASSED[kind[0]] = bad is None
    if bad is not None:
        warnings.warn(
            f"mlx-h2o: the Metal group fold failed its first-use check ({bad}); "
            "H2O groups use the per-layer policy ops (same decisions, slower)",
            RuntimeWarning,
            stacklevel=4,
        )
        return want
    return got


def differs(mode: str, got, want) -> Optional[str]:
    """None if the folds agree: equal positions and counts, scores within
    summation order, equal victims or near-tied ones; else what differed."""
    pos, score, count = (np.array(a) for a in want[:3])
    if not np.array_equal(np.array(got[0]), pos):
        return "positions differ"
    if not np.array_equal(np.array(got[2]), count):
        return "counts differ"
    if not np.allclose(np.array(got[1]), score, rtol=SCORE_RTOL, atol=1e-6):
        return "scores differ"
    ranked = np.array(policy.eviction_score(mode, mx.array(score), mx.array(count)))
    B = pos.shape[0] // len(want[4])
    for layer, (g, w) in enumerate(zip(got[4], want[4])):
        g, w = np.array(g)[..., 0, 0], np.array(w)[..., 0, 0]  # (B, Hk) slots
        rows = ranked[layer * B:(layer + 1) * B]
        a = np.take_along_axis(rows, g[..., None], -1)[..., 0]
        b = np.take_along_axis(rows, w[..., None], -1)[..., 0]
        tie = np.abs(a - b) <= TIE_RTOL * np.maximum(np.abs(a), np.abs(b)) + 1e-7
        if not np.all((g == w) | tie):
            return f"layer {layer}'s victims differ"
    return None
