"""A chunk that overflows is attended by MLX's SDPA and scored by its window only.

Against the path that computes every row's logits with the reference
attention: same kept positions and scores, outputs within float rounding.
"""

import mlx.core as mx
import numpy as np
import pytest

from mlx_h2o import H2OConfig, H2OKVCache
from mlx_h2o.cache import MixedPrecisionH2OKVCache, QuantConfig, QuantizedH2OKVCache
from mlx_h2o.cache import chunk as chunk_module
from mlx_h2o.scores import SCORE_MODES, SCORES

# Modes whose overflowing chunks are scored by the window's own attention
# (expected attention's row: tests/test_expected_attention.py).
WINDOWED = [m for m in SCORE_MODES if SCORES[m].prefill == "window"]

D, HQ, HK = 8, 4, 2
# Storage kinds whose overflowing chunks are scored by their window, and
# their head dim (quantized groups need 32 values at least).
KINDS = {
    "dense": (H2OKVCache, D),
    "q8": (lambda cfg: QuantizedH2OKVCache(cfg, quant=QuantConfig(8, 32)), 64),
    "mixed": (lambda cfg: MixedPrecisionH2OKVCache(cfg, quant=QuantConfig(8, 32, 4)), 64),
}


def full_rows(cache):
    cache._scored_by_window = lambda L: False  # every row through the reference
    return cache


def feed(caches, lengths, seed, mask_fn=None, dim=D):
    rngs = [np.random.default_rng(seed) for _ in caches]
    outs = []
    for L in lengths:
        step = []
        for c, rng in zip(caches, rngs):
            q, k, v = (mx.array(rng.standard_normal((2, h, L, dim)).astype(np.float32))
                       for h in (HQ, HK, HK))
            mask = c.make_mask(L) if mask_fn is None else mask_fn(c, L)
            keys, values = c.update_and_fetch(k * 3, v)
            step.append(np.array(c.h2o_attention(q, keys, values, scale=0.5, mask=mask)))
        outs.append(step)
    return outs


def assert_same_state(a, b):
    assert (a.offset, a.evicted, a.size()) == (b.offset, b.evicted, b.size())
    n = a.size()
    np.testing.assert_array_equal(np.array(a.positions[..., :n]), np.array(b.positions[..., :n]))
    for x, y in ((a.score, b.score), (a.count, b.count)):
        np.testing.assert_allclose(np.array(x[..., :n]), np.array(y[..., :n]),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", WINDOWED)
@pytest.mark.parametrize("compact", ["chunk", "prompt"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_window_scoring_matches_full_rows(mode, compact, kind):
    cfg = H2OConfig(max_size=24, sink_size=2, heavy_budget=10, score=mode,
                    prefill_window=5, prefill_pool=3, prefill_compact=compact)
    make, dim = KINDS[kind]
    fast, slow = make(cfg), full_rows(make(cfg))
    for a, b in feed((fast, slow), [20, 17, 1, 1, 30, 1, 9, 1, 1], seed=3, dim=dim):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert_same_state(fast, slow)
    assert fast.evicted > 0


def test_window_scoring_with_an_array_mask():
    cfg = H2OConfig(max_size=16, sink_size=2, heavy_budget=6, prefill_window=4)
    fast, slow = H2OKVCache(cfg), full_rows(H2OKVCache(cfg))

    def padded(c, L):  # mlx-lm's array mask form: (B, 1, L, N), first slot masked out
        m = np.tril(np.ones((L, c.size() + L), bool), k=c.size())
        m = np.broadcast_to(m, (2, 1, L, c.size() + L)).copy()
        m[1, :, :, 0] = False
        return mx.array(m)

    for a, b in feed((fast, slow), [12, 10, 9], seed=4, mask_fn=padded):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert_same_state(fast, slow)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_only_the_window_gets_logits(monkeypatch, kind):
    make, dim = KINDS[kind]
    cache = make(H2OConfig(max_size=16, prefill_window=6))
    rows = {"storage": [], "window": []}

    def spy(real, key):
        def call(queries, *a, **k):
            rows[key].append(queries.shape[2])
            return real(queries, *a, **k)
        return call

    monkeypatch.setattr(cache.kv, "column_attention", spy(cache.kv.column_attention, "storage"))
    window = spy(chunk_module.scaled_dot_product_attention_with_scores, "window")
    monkeypatch.setattr(chunk_module, "scaled_dot_product_attention_with_scores", window)
    feed((cache,), [10, 40], seed=5, dim=dim)
    # within budget: every row (the storage's column sums); overflowing: SDPA
    # for the output, logits for the window's rows only
    assert rows == {"storage": [10], "window": [6]}


def test_window_layers_and_short_chunks_keep_every_row():
    cfg = H2OConfig(max_size=16, prefill_window=6)
    assert not H2OKVCache(cfg, window_size=8)._scored_by_window(40)
    cache = H2OKVCache(H2OConfig(max_size=16, prefill_window=6, prefill_compact="prompt"))
    feed((cache,), [20], seed=6)  # kept whole until the first decode step
    assert cache.size() == 20
    assert cache._scored_by_window(7) and not cache._scored_by_window(6)  # L == W: all rows
