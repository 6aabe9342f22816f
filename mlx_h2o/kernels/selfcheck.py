"""A first-use check of GPU kernels that never ran on their backend (Metal).

The Metal twins share the CUDA kernels' body but were never built by
Apple's compiler or run on an Apple GPU, only type-checked and run on a CPU
emulator (docs/GUIDE.md, "Backends: CPU, CUDA, Metal"). Before the library uses them, one small
decode attention, through pass 1 alone and through key splits + merge, is
compared with the reference on the CPU; if it fails to build or disagrees,
``gpu_backend()`` (kernels/backend.py, which runs this check) reports no
backend, the library warns once and stays on the reference paths (the same
results, slower).
"""

import warnings
from typing import Callable, Optional

import mlx.core as mx

from . import reference
from .decode import decode_attention

# float32 in and out: only summation order differs from the reference (~1e-6).
TOL = 1e-4


def kernels_pass(attend: Callable = decode_attention, device=mx.gpu) -> bool:
    """Whether ``attend`` (``decode_attention``'s signature) builds and
    matches the reference on ``device``; warns when it does not."""
    try:
        bad = check_attention(attend, device)
    except Exception as e:  # a kernel that does not build or launch
        bad = f"{type(e).__name__}: {e}"
    if bad is not None:
        warnings.warn(
            f"mlx-h2o: the GPU kernels failed their first-use check ({bad}); "
            "using the reference paths (same results, slower)",
            RuntimeWarning,
            stacklevel=3,
        )
    return bad is None


def check_attention(attend: Callable, device=mx.gpu) -> Optional[str]:
    """None if ``attend`` matches the reference on a small GQA case with a
    bool mask and sinks, with one split and with three; else what differed."""
    keys = mx.random.split(mx.random.key(7), 5)
    B, Hq, Hk, N, D = 1, 8, 2, 301, 128
    q = mx.random.normal((B, Hq, 1, D), key=keys[0])
    k = mx.random.normal((B, Hk, N, D), key=keys[1])
    v = mx.random.normal((B, Hk, N, D), key=keys[2])
    mask = mx.random.uniform(shape=(B, 1, 1, N), key=keys[3]) > 0.2
    sinks = mx.random.normal((Hq,), key=keys[4])
    scale = D**-0.5
    with mx.stream(mx.cpu):
        want = reference.scaled_dot_product_attention_with_scores(
            q, k, v, scale=scale, mask=mask, sinks=sinks
        )
        mx.eval(want)
    for splits in (1, 3):
        with mx.stream(device):
            got = attend(q, k, v, scale=scale, mask=mask, sinks=sinks, num_splits=splits)
            mx.eval(got)
        for name, g, w in zip(("out", "logits", "lse"), got, want):
            if not _rel_err(g, w) <= TOL:
                return f"{name} differs from the reference with {splits} split(s)"
    return None


def _rel_err(got: mx.array, want: mx.array) -> float:
    """``tools/kernel_refs.rel_err`` in mx ops (at run time the kernels import
    mlx only): ||got - want|| / ||want|| over the finite reference entries;
    inf if the shapes or the non-finite entries (-inf, NaN) differ."""
    with mx.stream(mx.cpu):
        got = got.astype(mx.float32)
        if got.shape != want.shape:
            return float("inf")
        fin = mx.isfinite(want)
        same = mx.array_equal(fin, mx.isfinite(got)) & mx.array_equal(
            mx.where(fin, 0.0, got), mx.where(fin, 0.0, want))
        if not same.item():
            return float("inf")
        d = mx.linalg.norm(mx.where(fin, got - want, 0.0)).item()
        n = mx.linalg.norm(mx.where(fin, want, 0.0)).item()
        return d / n if n > 0 else d
