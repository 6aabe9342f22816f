"""Quantized attention with scores: reference vs float64, CPU fast path, GPU kernel."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_h2o.cache.quantized_storage import convert
from mlx_h2o.kernels.quantized import quantized_attention
from mlx_h2o.kernels.quantized_reference import (
    check_quantization,
    quantized_matmul_attention_with_scores,
)
from mlx_h2o.kernels.quantized_reference import (
    quantized_scaled_dot_product_attention_with_scores as reference,
)

EPS32 = np.finfo(np.float32).eps


def dequantize_np(t, bits, group_size):
    """Independent NumPy unpacking of an MLX affine triple, in float64."""
    w, s, b = (np.array(x.astype(mx.float32) if x.dtype != mx.uint32 else x) for x in t)
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    codes = (w[..., None] >> shifts) & ((1 << bits) - 1)
    codes = codes.reshape(*w.shape[:-1], -1).astype(np.float64)
    scale = np.repeat(s.astype(np.float64), group_size, axis=-1)
    bias = np.repeat(b.astype(np.float64), group_size, axis=-1)
    return scale * codes + bias


def attention_f64(q, k, v, scale, mask=None, sinks=None):
    """float64 attention; mask bool/additive broadcast to (B, Hq, L, N)."""
    B, Hq, L, _ = q.shape
    G = Hq // k.shape[1]
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    logits = np.einsum("bhld,bhnd->bhln", q, k) * scale
    if mask is not None:
        logits = (
            np.where(mask, logits, -np.inf) if mask.dtype == bool else logits + mask
        )
    full = logits
    if sinks is not None:
        col = np.broadcast_to(sinks.reshape(1, Hq, 1, 1), (B, Hq, L, 1))
        full = np.concatenate([logits, col], axis=-1)
    m = full.max(-1, keepdims=True)
    m = np.where(np.isinf(m), 0.0, m)
    lse = (np.log(np.exp(full - m).sum(-1, keepdims=True)) + m)[..., 0]
    probs = np.nan_to_num(np.exp(logits - lse[..., None]))
    return probs @ v, logits, lse, np.abs(q) @ np.swapaxes(np.abs(k), -1, -2)


def make(B, Hq, Hk, L, N, D, bits, gs, dtype, rng, segments=1):
    q = mx.array(rng.standard_normal((B, Hq, L, D)).astype(np.float32)).astype(dtype)
    if N < segments:  # every segment holds at least one slot (caches never fetch empty ones)
        segments, bits = 1, bits[:1]
    cuts = np.sort(rng.choice(np.arange(1, N), segments - 1, replace=False)).tolist()
    bounds = list(zip([0] + cuts, cuts + [N]))
    x = {
        n: mx.array(rng.standard_normal((B, Hk, N, D)).astype(np.float32)).astype(dtype)
        for n in "kv"
    }
    seg = {
        n: tuple(
            mx.quantize(x[n][:, :, a:b], group_size=gs, bits=bb)
            for (a, b), bb in zip(bounds, bits)
        )
        for n in "kv"
    }
    deq = {
        n: np.concatenate(
            [dequantize_np(t, bb, gs) for t, bb in zip(seg[n], bits)], axis=2
        )
        for n in "kv"
    }
    return q, seg["k"], seg["v"], deq["k"], deq["v"]


def check(result, q, k64, v64, scale, dtype, mask=None, sinks=None, extra=0.0):
    """Logits/lse within float32 accumulation error of float64; out within
    that plus the rounding of out to ``dtype`` (eps/2 relative)."""
    out, logits, lse = result
    qn = np.array(q.astype(mx.float32), dtype=np.float64)
    ro, rl, rlse, mag = attention_f64(qn, k64, v64, scale, mask, sinks)
    D = qn.shape[-1]
    bound = (D + 2) * EPS32 * scale * mag + 1e-30 + extra
    lg = np.array(logits, dtype=np.float64)
    fin = np.isfinite(rl)
    assert (np.isfinite(lg) == fin).all(), "masked entries are -inf, others finite"
    assert (np.abs(lg[fin] - rl[fin]) <= bound[fin]).all()
    lse_tol = 4 * bound.max() + 8 * EPS32 * np.abs(rlse[np.isfinite(rlse)]).max(
        initial=1.0
    )
    np.testing.assert_allclose(np.array(lse), rlse, atol=lse_tol, rtol=0)
    out_eps = {mx.float32: EPS32, mx.float16: 2**-11, mx.bfloat16: 2**-8}[dtype]
    vmax = np.abs(v64).max()
    tol = (lse_tol * 2 + out_eps) * vmax + 1e-6
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), ro, atol=tol, rtol=0)


@pytest.mark.parametrize("N", [1, 97, 257])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize(
    "bits,gs,dtype", [(4, 64, mx.float16), (8, 32, mx.bfloat16), (2, 128, mx.float32)]
)
@pytest.mark.parametrize("path", ["reference", "quantized_matmul"])
def test_paths_match_float64(N, heads, bits, gs, dtype, path):
    rng = np.random.default_rng()
    Hq, Hk = heads
    q, k, v, k64, v64 = make(
        2, Hq, Hk, 1 if N == 1 else 3, N, 128, (bits,), gs, dtype, rng
    )
    fn = reference if path == "reference" else quantized_matmul_attention_with_scores
    result = fn(q, k[0], v[0], scale=128**-0.5, bits=bits, group_size=gs)
    assert result[0].dtype == dtype and result[1].dtype == mx.float32 == result[2].dtype
    check(result, q, k64, v64, 128**-0.5, dtype)


@pytest.mark.parametrize("kind", ["causal", "bool_kv", "additive", "sinks"])
def test_masks_and_sinks(kind):
    rng = np.random.default_rng()
    B, Hq, Hk, L, N, D = 2, 8, 2, 5, 97, 64
    q, k, v, k64, v64 = make(B, Hq, Hk, L, N, D, (4,), 32, mx.float32, rng)
    mask = sinks = None
    mask_np = sinks_np = None
    if kind == "causal":
        mask, mask_np = "causal", np.arange(N - L, N)[:, None] >= np.arange(N)[None]
    elif kind == "bool_kv":
        m = rng.random((B, Hk, L, N)) > 0.3
        mask, mask_np = mx.array(m), np.repeat(m, Hq // Hk, axis=1)
    elif kind == "additive":
        m = rng.standard_normal((1, 1, L, N)).astype(np.float32)
        mask, mask_np = mx.array(m), m.astype(np.float64)
    else:
        s = rng.standard_normal(Hq).astype(np.float32)
        sinks, sinks_np = mx.array(s), s.astype(np.float64)
    for fn in (reference, quantized_matmul_attention_with_scores):
        res = fn(
            q, k[0], v[0], scale=0.125, bits=4, group_size=32, mask=mask, sinks=sinks
        )
        check(res, q, k64, v64, 0.125, mx.float32, mask_np, sinks_np)


def test_fully_masked_rows_give_zero_and_minus_inf():
    rng = np.random.default_rng(0)
    q, k, v, _, _ = make(1, 2, 1, 1, 9, 64, (8,), 64, mx.float32, rng)
    out, logits, lse = reference(
        q,
        k[0],
        v[0],
        scale=0.1,
        bits=8,
        group_size=64,
        mask=mx.zeros((1, 1, 1, 9), dtype=mx.bool_),
    )
    assert (np.array(out) == 0).all() and np.isneginf(np.array(lse)).all()
    assert np.isneginf(np.array(logits)).all()


@pytest.mark.parametrize("bits", [(8, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("L", [1, 3])
def test_quantized_matmul_over_segments(bits, L):
    """The CPU path reads each precision segment with its own matmuls."""
    rng = np.random.default_rng()
    B, Hq, Hk, N = 2, 6, 2, 61
    q, k, v, k64, v64 = make(B, Hq, Hk, L, N, 64, bits, 32, mx.float32, rng, segments=2)
    m = rng.random((B, Hk, L, N)) > 0.3
    res = quantized_matmul_attention_with_scores(
        q, k, v, scale=0.11, bits=bits, group_size=32, mask=mx.array(m))
    check(res, q, k64, v64, 0.11, mx.float32, np.repeat(m, Hq // Hk, axis=1))


@pytest.mark.parametrize("bits", [(8, 4), (4, 2), (8, 2)])
def test_segments_of_two_widths(bits):
    rng = np.random.default_rng()
    q, k, v, k64, v64 = make(1, 4, 2, 1, 97, 128, bits, 64, mx.float16, rng, segments=2)
    check(
        reference(q, k, v, scale=0.09, bits=bits, group_size=64),
        q,
        k64,
        v64,
        0.09,
        mx.float16,
    )
    check(
        quantized_attention(q, k, v, scale=0.09, bits=bits, group_size=64),
        q,
        k64,
        v64,
        0.09,
        mx.float16,
    )


def test_dispatcher_cpu_paths_and_forced_kernel():
    rng = np.random.default_rng(1)
    q, k, v, k64, v64 = make(1, 4, 1, 1, 33, 64, (4,), 64, mx.float32, rng)
    check(
        quantized_attention(q, k[0], v[0], scale=0.125, bits=4, group_size=64),
        q,
        k64,
        v64,
        0.125,
        mx.float32,
    )
    gpu = mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available())
    if not gpu:
        with pytest.raises(ValueError, match="CUDA or Metal"):
            quantized_attention(
                q, k[0], v[0], scale=0.125, bits=4, group_size=64, use_kernel=True
            )


@pytest.mark.parametrize("src,dst", [(4, 8), (2, 4), (2, 8)])
def test_widening_is_exact_and_narrowing_inverts_it(src, dst):
    x = mx.random.normal((2, 3, 5, 128))
    t = mx.quantize(x, group_size=32, bits=src)
    wide = convert(t, src, dst)
    a, b = dequantize_np(t, src, 32), dequantize_np(wide, dst, 32)
    # scale / f is rounded once in float32: relative 2^-24 of |scale| * max code.
    np.testing.assert_allclose(b, a, rtol=0, atol=4 * EPS32 * np.abs(a).max())
    back = convert(wide, dst, src)
    np.testing.assert_array_equal(np.array(back[0]), np.array(t[0]))


def test_narrowing_error_is_half_a_step_plus_source_error():
    x = mx.random.normal((1, 2, 64, 64))
    t8 = mx.quantize(x, group_size=64, bits=8)
    t4 = convert(t8, 8, 4)
    step4 = np.repeat(np.abs(np.array(t4[1])), 64, axis=-1)
    err = np.abs(dequantize_np(t4, 4, 64) - dequantize_np(t8, 8, 64))
    assert (err <= step4 / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize(
    "bits,gs,dim",
    [
        (3, 64, None),
        (5, 64, None),
        (16, 64, None),
        (4, 16, None),
        (4, 48, None),
        (4, 64, 96),
        (8, 128, 64),
    ],
)
def test_bad_layouts_raise(bits, gs, dim):
    with pytest.raises(ValueError):
        check_quantization(bits, gs, dim)


GPU = mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available())


@pytest.mark.skipif(not GPU, reason="needs a CUDA or Metal backend")
@pytest.mark.parametrize("N", [1, 97, 257, 1025])
@pytest.mark.parametrize("bits", [(8,), (4,), (2,), (8, 4)])
def test_gpu_kernel_matches_reference(N, bits):
    rng = np.random.default_rng()
    q, k, v, k64, v64 = make(
        2, 8, 2, 1, N, 128, bits, 64, mx.float16, rng, segments=len(bits)
    )
    bits = bits[: len(k)]  # N=1 holds one segment
    res = quantized_attention(
        q, k, v, scale=0.088, bits=bits, group_size=64, use_kernel=True
    )
    check(res, q, k64, v64, 0.088, mx.float16)


@pytest.mark.parametrize("backend", ["cuda", "metal"])
def test_kernel_sources_assemble(backend):
    """Every flag set fills its template (runs without a GPU: text only)."""
    pytest.importorskip("mlx_h2o.kernels.source", reason="shared GPU prelude not present")
    from mlx_h2o.kernels.quantized_gpu import MASK_APPLY, kernel_source, merge_source

    for mask in MASK_APPLY:
        for sinks in (False, True):
            for two in (False, True):
                for split in (False, True):
                    header, body, inputs, outputs = kernel_source(
                        backend, mask, sinks, two, split
                    )
                    assert "$" not in body and "h2o_qdot" in header
                    assert ("mask" in inputs) == (mask in ("bool", "add"))
                    assert ("k1w" in inputs) == two
                    assert ("sinks" in inputs) == (sinks and not split)
                    assert ("part_o" in outputs) == split
                    for name in inputs + outputs:
                        assert name in body, f"{name} unused"
    for sinks in (False, True):
        header, body, inputs, outputs = merge_source(backend, sinks)
        assert "$" not in body and ("sinks" in inputs) == sinks
