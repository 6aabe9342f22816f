"""Attention with per-key column sums (what a prompt chunk's score fold
reads) vs a float64 NumPy reference: the output, the weighted sums of
group-mean probabilities and the weighted visible-query counts, on odd
lengths, GQA, every mask kind, sinks, and queries that see no key."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_h2o import policy
from mlx_h2o.kernels import attention_with_column_sums
from mlx_h2o.kernels import scaled_dot_product_attention_with_scores as sdpa_scores
from test_reference_kernel import OUT_TOL, attention_f64, rand, to_np


def columns_f64(q, k, v, scale, mask, sinks, weights, Hk):
    """(out, probs, seen) in float64: ``weights`` (B, L) per query; visibility
    from each group's first head; a query that sees nothing adds nothing."""
    with np.errstate(divide="ignore", invalid="ignore"):  # rows that see nothing
        out, logits, lse = attention_f64(q, k, v, scale, mask, sinks)
        probs = np.nan_to_num(np.exp(logits - lse[..., None]))
    B, Hq, L, N = logits.shape
    G = Hq // Hk
    w = weights[:, None, :, None]  # (B, 1, L, 1)
    summed = (probs * w).sum(axis=2).reshape(B, Hk, G, N).mean(axis=2)
    visible = np.isfinite(logits).reshape(B, Hk, G, L, N)[:, :, 0]
    seen = (visible * w).sum(axis=2)
    return out, summed, seen


def _mask(kind, B, Hq, Hk, L, N, rng):
    """(mx mask, its float64 / bool NumPy form broadcast to (B, Hq, L, N))."""
    if kind is None:
        return None, None
    if kind == "causal":
        causal = np.arange(N - L, N)[:, None] >= np.arange(N)
        return "causal", np.broadcast_to(causal, (B, Hq, L, N))
    if kind == "bool_per_kv_head":
        m = rng.random((B, Hk, L, N)) > 0.4
        m[0, :, 1] = False  # a query that sees nothing (a padding row)
        return mx.array(m), np.repeat(m, Hq // Hk, axis=1)
    if kind == "bool_per_head":
        m = rng.random((B, Hq, L, N)) > 0.4
        return mx.array(m), m
    m = np.where(rng.random((B, 1, L, N)) > 0.3, rng.standard_normal((B, 1, L, N)), -np.inf)
    m[-1, 0, 0] = -np.inf  # additive: a query that sees nothing
    return mx.array(m.astype(np.float32)), np.broadcast_to(m, (B, Hq, L, N))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("kind", [None, "causal", "bool_per_kv_head", "bool_per_head",
                                  "additive"])
@pytest.mark.parametrize("shape", [(9, 3, 37, 97), (4, 1, 5, 13), (8, 8, 17, 17),
                                   (6, 2, 33, 257)])
def test_matches_float64(dtype, kind, shape):
    rng = np.random.default_rng()
    Hq, Hk, L, N = shape
    B, D = 2, 32
    q, k, v = (rand(s, dtype, rng) for s in [(B, Hq, L, D), (B, Hk, N, D), (B, Hk, N, D)])
    mask, np_mask = _mask(kind, B, Hq, Hk, L, N, rng)
    sinks = rand((Hq,), mx.float32, rng) if kind == "causal" else None
    weights = (rng.random((B, L)) > 0.3).astype(np.float32) * rng.integers(1, 4, (B, L))
    out, summed, seen = attention_with_column_sums(
        q, k, v, scale=D**-0.5, mask=mask, sinks=sinks, weights=mx.array(weights))
    ro, rs, rseen = columns_f64(to_np(q), to_np(k), to_np(v), D**-0.5, np_mask,
                                None if sinks is None else to_np(sinks), weights, Hk)
    assert out.dtype == dtype and summed.dtype == seen.dtype == mx.float32
    assert summed.shape == seen.shape == (B, Hk, N)
    np.testing.assert_allclose(to_np(out), ro, atol=OUT_TOL[dtype], rtol=OUT_TOL[dtype])
    # Sums of up to L weighted probabilities, each exact to float32 rounding.
    np.testing.assert_allclose(to_np(summed), rs, atol=2e-5 * L, rtol=2e-5)
    np.testing.assert_array_equal(to_np(seen), rseen)


def test_same_fold_as_the_logits():
    """Folded by policy.fold_columns, the column sums give what the logits'
    fold (policy.fold_scores) gives, for every mode that sums probabilities."""
    rng = np.random.default_rng()
    B, Hq, Hk, L, N, D = 2, 6, 2, 23, 23, 16
    q, k, v = (rand(s, mx.float32, rng) for s in [(B, Hq, L, D), (B, Hk, N, D), (B, Hk, N, D)])
    _, logits, lse = sdpa_scores(q, k, v, scale=0.25, mask="causal")
    _, summed, seen = attention_with_column_sums(q, k, v, scale=0.25, mask="causal")
    score = mx.array(rng.random((B, Hk, N)).astype(np.float32))
    count = mx.array(rng.integers(0, 5, (B, Hk, N)).astype(np.float32))
    for mode in ("accumulated", "normalized", "attention_ema", "tova"):
        want = policy.fold_scores(mode, score, count, logits, lse)
        got = policy.fold_columns(mode, score, count, summed, seen)
        for w, g in zip(want, got):
            np.testing.assert_allclose(to_np(g), to_np(w), atol=1e-5, rtol=1e-5)


def test_repeated_kv_heads_fold_per_cache_head():
    """A model that repeats its KV heads after the cache: the columns per
    attended head, regrouped per cache head, equal those of the cache's heads."""
    rng = np.random.default_rng()
    B, Hq, Hk, r, L, D = 1, 8, 1, 4, 11, 16
    q, k, v = (rand(s, mx.float32, rng) for s in [(B, Hq, L, D), (B, Hk, L, D), (B, Hk, L, D)])
    _, s1, c1 = attention_with_column_sums(q, k, v, scale=0.25, mask="causal")
    _, sr, cr = attention_with_column_sums(q, mx.repeat(k, r, axis=1), mx.repeat(v, r, axis=1),
                                           scale=0.25, mask="causal")
    s2, c2 = policy.cache_head_columns(sr, cr, Hk)
    np.testing.assert_allclose(to_np(s2), to_np(s1), atol=1e-6, rtol=1e-5)
    np.testing.assert_array_equal(to_np(c2), to_np(c1))


def test_bad_heads():
    q, k = mx.zeros((1, 5, 3, 8)), mx.zeros((1, 2, 3, 8))
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        attention_with_column_sums(q, k, k, scale=1.0)
