"""Score-fold kernels on Metal, checked on their first real use.

The Metal kernels were never run on an Apple GPU (docs/GPU.md, "Metal: not
run"). kernels/selfcheck.py checks the attention kernels before any kernel
runs; the folds the caches run most are checked here, each on its first
real call: the group fold (a full cache's one launch a token) against the
per-layer policy ops, the queue fold (queued decode queries below the
budget) against the ops fold, on the same state. If a kernel fails or
disagrees (beyond near ties for victims), a warning says so, that call
takes the reference's result and the caches stay on the reference for that
family (the same decisions, slower). CUDA's kernels ran on GPUs here and
are not checked.
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

_PASSED = {}  # family, e.g. "group fold dense" -> whether its kernel passed


def needs_check(family: str) -> bool:
    """Whether the next kernel call of ``family`` must be checked first."""
    return device_backend() == "metal" and family not in _PASSED


def passed(family: str) -> bool:
    """False once ``family``'s kernel failed its check (then: the reference)."""
    return _PASSED.get(family, True)


def checked(family: str, kernel: Callable, reference: Callable, differs: Callable):
    """``kernel()``'s result if ``differs(got, want)`` finds none against
    ``reference()``'s, else the reference's; the outcome is kept for ``family``."""
    try:
        want = reference()
        mx.eval(want)
    except Exception:  # nothing to check against here (e.g. inside a transform)
        return kernel()  # unchecked: the next call tries again
    try:
        got = kernel()
        mx.eval(got)
        bad = differs(got, want)
    except Exception as e:  # a kernel that does not build or launch
        bad = f"{type(e).__name__}: {e}"
    _PASSED[family] = bad is None
    if bad is not None:
        warnings.warn(
            f"mlx-h2o: the Metal {family} failed its first-use check ({bad}); "
            "the caches use the policy ops for it (same decisions, slower)",
            RuntimeWarning,
            stacklevel=4,
        )
        return want
    return got


def queue_differs(got, want) -> Optional[str]:
    """None if two queue folds' (score, count) agree (counts exactly, scores
    within summation order); else what differed."""
    if not np.array_equal(np.array(got[1]), np.array(want[1])):
        return "counts differ"
    if not np.allclose(np.array(got[0]), np.array(want[0]), rtol=SCORE_RTOL, atol=1e-6):
        return "scores differ"
    return None


def step_differs(mode: str, got, want) -> Optional[str]:
    """None if two fused steps (H2OStep: the kernel's, the op-by-op one's)
    agree: outputs within their dtype's rounding, the metadata as for a
    group fold; else what differed."""
    out, ref = (np.array(x.out.astype(mx.float32)) for x in (got, want))
    eps = {mx.float16: 2.0 ** -10, mx.bfloat16: 2.0 ** -7}.get(got.out.dtype, 1e-5)
    if not np.allclose(out, ref, rtol=eps, atol=eps * np.abs(ref).max(initial=1.0)):
        return "outputs differ"
    return fold_differs(mode, got, want)


def fold_differs(mode: str, got, want) -> Optional[str]:
    """None if two fold-only steps (H2OFold) agree as group folds do."""
    return group_differs(mode, *((x.positions, x.score, x.count, None, [x.victim[..., :1]])
                                 for x in (got, want)))


def group_differs(mode: str, got, want) -> Optional[str]:
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
