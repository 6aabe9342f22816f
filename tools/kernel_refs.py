"""Float64 NumPy references of the kernels and random attention cases.

What the GPU checks measure the kernels against: shared by tools/gpu_check.py
and the tests (test_kernels_gpu.py, test_queue_fold_gpu.py, the Metal
emulator's tests); the package never imports it.
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

# ||out - ref|| / ||ref|| bounds. out is rounded to its dtype once (relative
# error up to 2^-11 for float16, 2^-8 for bfloat16), so the norm-wise error of
# a correct kernel is about half that; float32 sums of <= 32K terms stay near
# 1e-6. logits/lse are float32 dot products of exactly representable inputs.
OUT_TOL = {"float16": 1e-3, "bfloat16": 8e-3, "float32": 2e-5}
LOGIT_TOL = 2e-5
LSE_TOL = 2e-5


def to_np(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32) if x.dtype == mx.bfloat16 else x).astype(
        np.float64
    )


def ref64(q, k, v, scale, mask=None, sinks=None):
    """float64 attention with scores; numpy arrays in, (out, logits, lse) out."""
    B, Hq, L, D = q.shape
    Hk, N = k.shape[1], k.shape[2]
    G = Hq // Hk
    qg = q.reshape(B, Hk, G, L, D)
    logits = (qg @ k[:, :, None].swapaxes(-1, -2)) * scale  # (B, Hk, G, L, N), BLAS
    if isinstance(mask, str):
        allowed = np.arange(N)[None] <= (N - L + np.arange(L))[:, None]
        logits = np.where(allowed, logits, -np.inf)
    elif mask is not None:
        m = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        if m.shape[1] == Hq:
            m = m.reshape(m.shape[0], Hk, G, *m.shape[2:])
        else:
            m = m[:, :, None]
        logits = np.where(m, logits, -np.inf) if m.dtype == bool else logits + m
    row_max = logits.max(-1, keepdims=True)
    if sinks is not None:
        sink = sinks.reshape(1, Hk, G, 1, 1)
        row_max = np.maximum(row_max, sink)
    shift = np.where(np.isinf(row_max), 0.0, row_max)
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.exp(logits - shift)
        denom = e.sum(-1, keepdims=True)
        if sinks is not None:
            denom = denom + np.exp(sink - shift)
        lse = np.log(denom) + shift
    out = (e / np.where(denom > 0, denom, 1.0)) @ v[:, :, None]
    return (
        out.reshape(B, Hq, L, -1),
        logits.reshape(B, Hq, L, N),
        lse.reshape(B, Hq, L),
    )


@dataclass
class Case:
    B: int = 1
    Hq: int = 8
    Hk: int = 2
    L: int = 1
    N: int = 97
    D: int = 128
    dtype: str = "float16"
    mask: Optional[str] = None  # None, causal, bool_kv, bool_q, add_q, add_bcast, bool_row
    sinks: bool = False
    view: Optional[str] = None  # None, slice (cache buffer view), strided (last axis)
    splits: Optional[int] = None

    def label(self) -> str:
        extra = "".join(
            f" {k}={v}" for k, v in (("mask", self.mask), ("sinks", self.sinks or None),
                                     ("view", self.view), ("S", self.splits)) if v
        )
        return (f"B={self.B} H={self.Hq}/{self.Hk} L={self.L} N={self.N} D={self.D} "
                f"{self.dtype}{extra}")


def _kv(case: Case, rng):
    dt = getattr(mx, case.dtype)
    shape = (case.B, case.Hk, case.N, case.D)
    if case.view == "slice":  # the cache case: first N slots of a bigger buffer
        big = mx.array(rng.standard_normal((case.B, case.Hk, case.N + 37, case.D)))
        return big.astype(dt)[:, :, : case.N, :]
    if case.view == "strided":  # last axis not contiguous: the scalar path
        t = mx.array(rng.standard_normal((case.B, case.Hk, case.D, case.N)))
        return t.astype(dt).swapaxes(-1, -2)
    return mx.array(rng.standard_normal(shape)).astype(dt)


def _mask(case: Case, rng):
    B, Hq, Hk, L, N = case.B, case.Hq, case.Hk, case.L, case.N
    kind = case.mask
    if kind is None or kind == "causal":
        return kind
    if kind == "bool_kv":
        return mx.array(rng.random((B, Hk, L, N)) > 0.3)
    if kind == "bool_q":
        return mx.array(rng.random((1, Hq, L, N)) > 0.3)
    if kind == "bool_row":  # one fully masked query row per head: out 0, lse -inf
        m = rng.random((B, 1, L, N)) > 0.5
        m[:, :, 0] = False
        return mx.array(m)
    if kind == "add_q":
        return mx.array(rng.standard_normal((B, Hq, L, N))).astype(getattr(mx, case.dtype))
    if kind == "add_bcast":
        return mx.array(-3.0 * rng.random((L, N))).astype(getattr(mx, case.dtype))
    raise ValueError(kind)


def make_inputs(case: Case, seed: int):
    rng = np.random.default_rng(seed)
    dt = getattr(mx, case.dtype)
    q = mx.array(rng.standard_normal((case.B, case.Hq, case.L, case.D))).astype(dt)
    k, v = _kv(case, rng), _kv(case, rng)
    sinks = mx.array(rng.standard_normal(case.Hq)).astype(dt) if case.sinks else None
    return q, k, v, _mask(case, rng), sinks


def rel_err(x: np.ndarray, ref: np.ndarray) -> float:
    """||x - ref|| / ||ref|| over finite reference entries; inf if patterns differ."""
    fin = np.isfinite(ref)
    if not np.array_equal(fin, np.isfinite(x)) or not np.array_equal(x[~fin], ref[~fin]):
        return float("inf")
    d = np.linalg.norm(x[fin] - ref[fin])
    n = np.linalg.norm(ref[fin])
    return float(d / n) if n > 0 else float(d)


def check_case(case: Case, seed: int, fn):
    """Run fn(q, k, v, scale, mask, sinks) -> (out, logits, lse); return errors."""
    q, k, v, mask, sinks = make_inputs(case, seed)
    scale = case.D ** -0.5
    out, logits, lse = fn(q, k, v, scale, mask, sinks)
    mx.eval(out, logits, lse)
    np_mask = None if mask is None or isinstance(mask, str) else to_np(mask)
    if np_mask is not None and mask.dtype == mx.bool_:
        np_mask = np.array(mask)
    ro, rl, rs = ref64(to_np(q), to_np(k), to_np(v), scale,
                       mask if isinstance(mask, str) else np_mask,
                       None if sinks is None else to_np(sinks))
    errs = {"out": rel_err(to_np(out), ro), "logits": rel_err(to_np(logits), rl),
            "lse": rel_err(to_np(lse), rs)}
    tol = {"out": OUT_TOL[case.dtype], "logits": LOGIT_TOL, "lse": LSE_TOL}
    ok = all(errs[n] <= tol[n] for n in errs) and out.dtype == q.dtype
    return ok, errs


def queue_fold_ref64(q, k, visible, scale, score, count):
    """float64 (score, count) after kernels/queued.queue_fold: the queued
    queries' softmax over the slots each sees, averaged over each GQA group
    and summed over the queries, and how many queries saw each slot. numpy
    arrays in and out; ``k`` is the whole buffer (B, Hk, cap, D)."""
    B, Hq, T, D = q.shape
    Hk, cap, M = k.shape[1], k.shape[2], score.shape[-1]
    G = Hq // Hk
    logits = (q.reshape(B, Hk, G * T, D) @ k.swapaxes(-1, -2)) * scale  # (B, Hk, G*T, cap)
    vis = np.arange(cap)[None] < np.tile(np.asarray(visible), G)[:, None]  # rows g * T + t
    logits = np.where(vis, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    m = min(M, cap)
    step, seen = np.zeros((B, Hk, M)), np.zeros(M)
    step[..., :m] = p.sum(2)[..., :m] / G
    seen[:m] = vis[:T].sum(0)[:m]
    return score + step, count + seen
