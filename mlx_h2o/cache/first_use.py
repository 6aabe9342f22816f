"""The caches' Metal kernels, each checked on its first real use.

The Metal kernels were never run on an Apple GPU (docs/GUIDE.md,
"Backends: CPU, CUDA, Metal"). kernels/selfcheck.py checks the attention kernels before any kernel
runs; every other kernel family the caches run is checked here, on its
first real call against the op path on the same state: the group fold (a full
cache's one launch a token) against the per-layer policy ops, the queue
fold (queued decode queries below the budget) against the ops fold, the
fused and fold-only steps against ``ops_step``, the K/V writes against
``mx.quantize`` and scatters, the quantized attention against dequantized
K/V and the reference. If a kernel fails or disagrees (beyond near ties),
a warning says so, that call takes the reference's result and the caches
stay on the reference for that family (the same decisions, slower). CUDA's
kernels ran on GPUs here and are not checked.
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
# A quantized token's values may sit one step apart where x / scale is a tie
# (MLX's CPU quantize rounds ties to even, its GPU one and the kernels away
# from zero): allowed for this fraction of the written values at most.
MAX_TIED = 0.1
# float32 logits and lse: only the summation order differs (~1e-6).
ATTENTION_RTOL = 1e-4
EPS = {mx.float16: 2.0 ** -10, mx.bfloat16: 2.0 ** -7, mx.float32: 1e-5}

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


def launch(family: str, kernel: Callable, args, reference: Callable, differs: Callable):
    """``kernel(*args)``; where ``family`` needs its check (``needs_check``),
    ``checked`` against ``reference(*args)`` by ``differs(args, got, want)``.
    No closures unless checked: decode is host bound."""
    if needs_check(family):
        return checked(family, lambda: kernel(*args), lambda: reference(*args),
                       lambda got, want: differs(args, got, want))
    return kernel(*args)


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
    eps = EPS.get(got.out.dtype, 1e-5)
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


def attention_differs(got, want) -> Optional[str]:
    """None if two (out, logits, lse) agree: the same masked (-inf) entries,
    out within its dtype's rounding and the float32 ones within summation
    order (relative norms); else what differed."""
    eps = EPS.get(got[0].dtype, 1e-5)
    for name, g, w, tol in zip(("out", "logits", "lse"), got, want,
                               (eps, ATTENTION_RTOL, ATTENTION_RTOL)):
        g, w = (np.array(x.astype(mx.float32), np.float64) for x in (g, w))
        fin = np.isfinite(w)
        if g.shape != w.shape or not np.array_equal(np.isfinite(g), fin) or not np.array_equal(
                g[~fin], w[~fin]):
            return f"{name} differs (shape or masked entries)"
        size = np.linalg.norm(w[fin])
        if np.linalg.norm(g[fin] - w[fin]) > tol * max(size, 1e-30):
            return f"{name} differs"
    return None


def written(index: mx.array, capacity: int) -> np.ndarray:
    """(B, Hk, capacity, 1) bool: the slots a write's ``index`` (B, Hk, 1, W)
    names in its first column."""
    idx = np.array(index)[..., 0, 0]
    rows = np.zeros(idx.shape + (capacity, 1), bool)
    np.put_along_axis(rows, idx[..., None, None], True, axis=2)
    return rows


def quantized_write_differs(bits: int, group_size: int, rows: np.ndarray, got, want,
                            dense=None) -> Optional[str]:
    """None if two quantized writes agree; else what differed. ``got`` /
    ``want``: (keys, values) triples after the write; ``rows``: the written
    slots (``written``); ``dense``: the dense (keys, values) the kernel also
    gave, to match its own triples. Slots not written must be equal bit for
    bit; the written token within one quantization step of the reference,
    off at most at ``MAX_TIED`` of its values (ties)."""
    for i, (name, g, w) in enumerate(zip(("keys", "values"), got, want)):
        gn, wn = ([np.array(a.astype(mx.float32)) if a.dtype != mx.uint32 else np.array(a)
                   for a in t] for t in (g, w))
        keep = ~rows[..., 0]
        if not all(np.array_equal(a[keep], b[keep]) for a, b in zip(gn, wn)):
            return f"{name} outside the written slots differ"
        gv, wv = (_dequantized(t, bits, group_size) for t in (gn, wn))
        step = np.abs(np.repeat(wn[1], group_size, axis=-1))
        d = np.abs(gv - wv)[rows[..., 0]]
        if not np.all(d <= 1.01 * step[rows[..., 0]] + 1e-6):
            return f"written {name} differ"
        if np.count_nonzero(d > 1e-6 * np.abs(wv[rows[..., 0]])) > MAX_TIED * d.size:
            return f"written {name} differ (more than ties)"
        if dense is not None:
            x = np.array(dense[i].astype(mx.float32))
            eps = EPS.get(dense[i].dtype, 1e-5)
            if not np.allclose(x, gv, rtol=eps, atol=eps * np.abs(gv).max(initial=1.0)):
                return f"dense {name} differ from the written ones"
    return None


def _dequantized(triple, bits: int, group_size: int) -> np.ndarray:
    """float32 scale * code + bias of a numpy (codes, scales, biases) triple."""
    words, scales, biases = triple
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    codes = (words[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    codes = codes.reshape(*words.shape[:-1], -1).astype(np.float32)
    return (codes * np.repeat(scales, group_size, axis=-1)
            + np.repeat(biases, group_size, axis=-1))
