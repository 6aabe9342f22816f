"""Reference attention with scores vs a float64 NumPy reference."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_h2o.kernels import scaled_dot_product_attention_with_scores as sdpa_scores


def attention_f64(q, k, v, scale, mask=None, sinks=None):
    """NumPy float64 attention. mask: bool or additive, broadcast to (B, Hq, L, N)."""
    B, Hq, L, D = q.shape
    G = Hq // k.shape[1]
    k = np.repeat(k, G, axis=1)
    v = np.repeat(v, G, axis=1)
    logits = np.einsum("bhld,bhnd->bhln", q, k) * scale
    if mask is not None:
        logits = np.where(mask, logits, -np.inf) if mask.dtype == bool else logits + mask
    cols = [logits]
    if sinks is not None:
        cols.append(np.broadcast_to(sinks.reshape(1, Hq, 1, 1), (B, Hq, L, 1)))
    full = np.concatenate(cols, axis=-1)
    m = full.max(-1, keepdims=True)
    m = np.where(np.isinf(m), 0.0, m)
    e = np.exp(full - m)
    denom = e.sum(-1, keepdims=True)
    lse = (np.log(denom) + m)[..., 0]
    probs = np.exp(logits - lse[..., None])
    probs = np.nan_to_num(probs)
    return probs @ v, logits, lse


def to_np(x):
    return np.array(x.astype(mx.float32), dtype=np.float64)


def rand(shape, dtype, rng):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


# Tolerances: the reference computes in float32 from inputs rounded to dtype,
# so the only error vs float64 (on the same rounded inputs) is float32
# accumulation; the output is then rounded to the input dtype (eps/2 relative).
OUT_TOL = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("N", [1, 97, 257])
@pytest.mark.parametrize("L", [1, 5])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
def test_matches_float64(dtype, N, L, heads):
    rng = np.random.default_rng()
    Hq, Hk = heads
    B, D = 2, 64
    q, k, v = (rand(s, dtype, rng) for s in [(B, Hq, L, D), (B, Hk, N, D), (B, Hk, N, D)])
    scale = D**-0.5
    out, logits, lse = sdpa_scores(q, k, v, scale=scale)
    ro, rl, rlse = attention_f64(to_np(q), to_np(k), to_np(v), scale)
    assert out.dtype == dtype and logits.dtype == mx.float32 and lse.dtype == mx.float32
    np.testing.assert_allclose(to_np(logits), rl, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(to_np(lse), rlse, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(to_np(out), ro, atol=OUT_TOL[dtype], rtol=OUT_TOL[dtype])


def _masks(B, Hq, Hk, L, N, rng):
    bool_full = rng.random((B, Hq, L, N)) > 0.3
    bool_kv = rng.random((B, Hk, L, N)) > 0.3
    additive = rng.standard_normal((1, 1, L, N)).astype(np.float32)
    return {
        "bool_per_head": (mx.array(bool_full), bool_full),
        "bool_per_kv_head": (mx.array(bool_kv), np.repeat(bool_kv, Hq // Hk, axis=1)),
        "additive": (mx.array(additive), additive.astype(np.float64)),
        "causal": ("causal", np.arange(N - L, N)[:, None] >= np.arange(N)[None]),
    }


@pytest.mark.parametrize("kind", ["bool_per_head", "bool_per_kv_head", "additive", "causal"])
def test_masks(kind):
    rng = np.random.default_rng()
    B, Hq, Hk, L, N, D = 2, 8, 2, 7, 97, 32
    q, k, v = (rand(s, mx.float32, rng) for s in [(B, Hq, L, D), (B, Hk, N, D), (B, Hk, N, D)])
    mask, np_mask = _masks(B, Hq, Hk, L, N, rng)[kind]
    out, logits, lse = sdpa_scores(q, k, v, scale=0.2, mask=mask)
    ro, rl, rlse = attention_f64(to_np(q), to_np(k), to_np(v), 0.2, np_mask)
    np.testing.assert_array_equal(np.isinf(to_np(logits)), np.isinf(rl))
    finite = np.isfinite(rl)
    np.testing.assert_allclose(to_np(logits)[finite], rl[finite], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(to_np(lse), rlse, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(to_np(out), ro, atol=2e-5, rtol=2e-5)


def test_matches_mlx_fast_sdpa_with_sinks():
    rng = np.random.default_rng()
    q, k, v = (rand(s, mx.float32, rng) for s in [(1, 8, 3, 64), (1, 2, 33, 64), (1, 2, 33, 64)])
    sinks = rand((8,), mx.float32, rng)
    out, _, lse = sdpa_scores(q, k, v, scale=0.125, mask="causal", sinks=sinks)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal", sinks=sinks)
    np.testing.assert_allclose(np.array(out), np.array(ref), atol=1e-5)
    np_mask = np.arange(30, 33)[:, None] >= np.arange(33)[None]
    _, _, rlse = attention_f64(to_np(q), to_np(k), to_np(v), 0.125, np_mask, to_np(sinks))
    np.testing.assert_allclose(to_np(lse), rlse, atol=2e-5, rtol=2e-5)


def test_fully_masked_row_gives_zero_and_minus_inf():
    q, k, v = mx.ones((1, 1, 2, 8)), mx.ones((1, 1, 4, 8)), mx.ones((1, 1, 4, 8))
    mask = mx.array([[False] * 4, [True] * 4])
    out, logits, lse = sdpa_scores(q, k, v, scale=1.0, mask=mask)
    assert np.all(np.array(out[0, 0, 0]) == 0) and np.isneginf(np.array(lse[0, 0, 0]))
    assert np.all(np.isfinite(np.array(out)))


def test_bad_inputs():
    q, k = mx.ones((1, 3, 1, 8)), mx.ones((1, 2, 4, 8))
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        sdpa_scores(q, k, k, scale=1.0)
    q = mx.ones((1, 4, 1, 8))
    with pytest.raises(ValueError, match="head axis"):
        sdpa_scores(q, k, k, scale=1.0, mask=mx.ones((1, 3, 1, 4), dtype=mx.bool_))
    with pytest.raises(ValueError, match="unknown mask"):
        sdpa_scores(q, k, k, scale=1.0, mask="sliding")


@pytest.mark.parametrize("which", ["queries", "keys", "values"])
def test_integer_inputs_are_refused(which):
    args = {"queries": mx.ones((1, 2, 1, 8)), "keys": mx.ones((1, 2, 4, 8)),
            "values": mx.ones((1, 2, 4, 8))}
    args[which] = args[which].astype(mx.int32)
    with pytest.raises(TypeError, match=f"{which} must be float16, bfloat16 or float32"):
        sdpa_scores(args["queries"], args["keys"], args["values"], scale=1.0)
