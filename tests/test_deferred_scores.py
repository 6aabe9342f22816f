"""Deferred score folding (cache/decode/deferred.py, cache/score_queue.py) against the per-step fold.

A cache below its budget attends decode steps with MLX's SDPA and folds the
queued queries' scores in batches; every decision it then makes must be the
per-step cache's: same kept positions, same outputs, scores equal up to float
summation order.
"""

import mlx.core as mx
import numpy as np
import pytest

import mlx_h2o
import mlx_h2o.cache.score_queue as deferred
from mlx_h2o import H2OConfig, H2OKVCache, make_h2o_cache, policy
from mlx_h2o.cache.score_queue import ScoreQueue, fold_queue, queue_logits
from mlx_h2o.kernels.reference import scaled_dot_product_attention_with_scores
from mlx_h2o.scores import DEFERRABLE, SCORE_MODES
from tiny_models import tiny_llama
from decode_steps import queue_of
from mlx_h2o.cache.decode.deferred import DeferredFill

NOT_DEFERRABLE = [m for m in SCORE_MODES if m not in DEFERRABLE]  # the EMA modes

D, HQ, HK = 8, 4, 2


def step(cache, L, rng, B=2, mask=None):
    q, k, v = (mx.array(rng.standard_normal((B, h, L, D)).astype(np.float32))
               for h in (HQ, HK, HK))
    mask = cache.make_mask(L) if mask is None else mask
    keys, values = cache.update_and_fetch(k * 3, v)
    return cache.h2o_attention(q, keys, values, scale=0.7, mask=mask)


def pair(cfg, window=None):
    lazy, eager = H2OKVCache(cfg, window), H2OKVCache(cfg, window)
    eager.set_decode(defer=0)
    return lazy, eager


def feed(caches, seed, lengths, **kw):
    """The same random stream into each cache; the last step's outputs."""
    rngs = [np.random.default_rng(seed) for _ in caches]
    for L in lengths:
        outs = [np.array(step(c, L, rng, **kw)) for c, rng in zip(caches, rngs)]
    return outs


def assert_same(lazy, eager):
    assert (lazy.offset, lazy.evicted, lazy.size()) == (eager.offset, eager.evicted, eager.size())
    n = eager.size()
    np.testing.assert_array_equal(np.array(lazy.positions[..., :n]),
                                  np.array(eager.positions[..., :n]))
    for a, b in ((lazy.score, eager.score), (lazy.count, eager.count)):
        np.testing.assert_allclose(np.array(a[..., :n]), np.array(b[..., :n]),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", DEFERRABLE)
@pytest.mark.parametrize("steps", [1, 3, 32])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("grow", [256, 8])
def test_deferred_equals_per_step_fold(mode, steps, seed, grow):
    # grow 8: folds read n rounded up to 8 slots of a larger buffer
    cfg = H2OConfig(max_size=40, sink_size=2, heavy_budget=15, score=mode, pinned=((5, 7),),
                    step=grow)
    lazy, eager = pair(cfg)
    lazy.set_fold_phase(seed)
    lazy.set_decode(defer=steps)
    rng_a, rng_b = np.random.default_rng(seed), np.random.default_rng(seed)
    # Fill by decode steps, a chunk in between, past the budget, then evict.
    lengths = [3] + [1] * 20 + [5] + [1] * 30
    for i, L in enumerate(lengths):
        a, b = step(lazy, L, rng_a), step(eager, L, rng_b)
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-5)
        if i % 7 == 0:
            assert_same(lazy, eager)  # reading mid-queue folds it
    assert_same(lazy, eager)
    assert lazy.evicted > 0


def test_queue_fills_then_folds_in_batches():
    cache = H2OKVCache(H2OConfig(max_size=64))
    cache.set_decode(defer=8)
    rng = np.random.default_rng(3)
    step(cache, 4, rng)
    sizes = []
    for _ in range(20):
        step(cache, 1, rng)
        sizes.append(len(queue_of(cache)))
    assert sizes == [1, 2, 3, 4, 5, 6, 7, 0] * 2 + [1, 2, 3, 4]
    assert cache._score is not None
    cache.score  # a read folds what is queued
    assert len(queue_of(cache)) == 0


def test_phase_staggers_the_first_fold():
    model = tiny_llama(num_hidden_layers=4)
    caches = make_h2o_cache(model, H2OConfig(max_size=64))
    rng = np.random.default_rng(0)
    for c in caches:
        c.set_decode(defer=4)  # the layer's fold phase stays
    firsts = []
    for c in caches:
        step(c, 2, rng)
        for i in range(1, 9):
            step(c, 1, rng)
            if len(queue_of(c)) == 0:
                firsts.append(i)
                break
    assert len(set(firsts)) > 1


def test_fold_width_repeats_for_a_step_of_tokens():
    cache = H2OKVCache(H2OConfig(max_size=64, step=16))
    rng = np.random.default_rng(2)
    step(cache, 3, rng)
    widths = []
    for _ in range(30):
        step(cache, 1, rng)
        widths.append(cache.decode.find(DeferredFill).width(cache.size()))
    assert widths == [16] * 13 + [32] * 16 + [48]  # n = 4 .. 33
    assert all(w <= cache.kv.capacity for w in widths)


def test_memory_bound_folds_sooner(monkeypatch):
    """The ops fold's logits grow with the queue: past MAX_LOGITS it folds
    sooner. The GPU fold kernel's memory does not grow with the queue, so
    there the query stays queued for its steps."""
    monkeypatch.setattr(deferred, "MAX_LOGITS", 2 * HQ * 20)  # B=2, 20 slots: 1 query
    cache = H2OKVCache(H2OConfig(max_size=64))
    rng = np.random.default_rng(1)
    step(cache, 19, rng)
    step(cache, 1, rng)
    kernel = cache.decode.find(DeferredFill).kernel
    assert len(queue_of(cache)) == (1 if kernel else 0)


@pytest.mark.parametrize("mode,window", [(m, None) for m in NOT_DEFERRABLE]
                         + [(DEFERRABLE[0], 9)])
def test_not_deferred_where_not_a_sum(mode, window):
    lazy, eager = pair(H2OConfig(max_size=30, score=mode), window)
    rngs = [np.random.default_rng(2), np.random.default_rng(2)]
    for L in [4] + [1] * 40:
        a, b = (np.array(step(c, L, r)) for c, r in zip((lazy, eager), rngs))
        np.testing.assert_array_equal(a, b)
        assert not queue_of(lazy)  # none, or empty
    assert_same(lazy, eager)


def test_array_mask_step_folds_the_queue_first():
    lazy, eager = pair(H2OConfig(max_size=30))
    feed((lazy, eager), 4, [4] + [1] * 5)
    assert len(queue_of(lazy)) == 5
    mask = mx.array(np.ones((1, 1, 1, 10), bool))  # a decode step with an array mask
    a, b = feed((lazy, eager), 5, [1], mask=mask)
    assert len(queue_of(lazy)) == 0
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert_same(lazy, eager)


def test_trim_and_state_round_trip_fold_first():
    lazy, eager = pair(H2OConfig(max_size=30))
    feed((lazy, eager), 6, [4] + [1] * 9)
    assert lazy.trim(3) == eager.trim(3) == 3
    assert_same(lazy, eager)
    feed((lazy, eager), 7, [1] * 6)
    state = lazy.state  # folds, then saves
    restored = H2OKVCache.from_state(state, lazy.meta_state)
    assert_same(restored, eager)
    a, b = feed((restored, eager), 8, [1] * 30)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert restored.evicted > 0
    assert_same(restored, eager)


def test_queue_logits_match_the_reference_per_step():
    rng = np.random.default_rng(7)
    n0, T = 11, 5
    keys = mx.array(rng.standard_normal((2, HK, n0 + T, D)).astype(np.float32))
    queue = ScoreQueue(steps=T)
    qs = [mx.array(rng.standard_normal((2, HQ, 1, D)).astype(np.float32)) for _ in range(T)]
    for t, q in enumerate(qs):
        queue.push(q, n0 + t + 1, n0 + t, 0.3)
    logits, lse = queue_logits(queue.take(), keys)
    for t, q in enumerate(qs):
        n = n0 + t + 1
        _, ref, ref_lse = scaled_dot_product_attention_with_scores(
            q, keys[..., :n, :], keys[..., :n, :], scale=0.3)
        np.testing.assert_allclose(np.array(logits[:, :, t, :n]), np.array(ref[:, :, 0]),
                                   rtol=1e-5, atol=1e-5)
        assert np.all(np.isneginf(np.array(logits[:, :, t, n:])))
        np.testing.assert_allclose(np.array(lse[:, :, t]), np.array(ref_lse[:, :, 0]),
                                   rtol=1e-5, atol=1e-5)
    # Folding the batch equals folding step by step.
    z = mx.zeros((2, HK, n0 + T))
    sb, cb = policy.fold_scores("accumulated", z, z, logits, lse)
    ss, cs = z, z
    for t in range(T):
        ss, cs = policy.fold_scores("accumulated", ss, cs, logits[:, :, t:t + 1], lse[:, :, t:t + 1])
    np.testing.assert_allclose(np.array(sb), np.array(ss), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.array(cb), np.array(cs))
    # fold_queue: the same sums without the (B, n_heads, T, n) probabilities kept.
    for t, q in enumerate(qs):
        queue.push(q, n0 + t + 1, n0 + t, 0.3)
    step, seen = fold_queue(queue.take(), keys)
    np.testing.assert_allclose(np.array(step), np.array(ss), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.array(z + seen), np.array(cs))


def test_queue_bound_is_set_per_fold(monkeypatch):
    monkeypatch.setattr(deferred, "MAX_LOGITS", 2 * HQ * 40)  # B=2: 40 slots x 1 query
    q = mx.zeros((2, HQ, 1, D))
    queue = ScoreQueue(steps=8)
    queue.start(q, 30, width=16)  # the ops fold may read 30 + 8 slots: one query
    assert queue.push(q, 30, 29, 0.3)
    queue.take()
    queue.start(q, 30, width=None)  # the fold kernel: only steps bounds the queue
    assert not any(queue.push(q, 30 + t, 29 + t, 0.3) for t in range(7))
    assert queue.push(q, 37, 36, 0.3)
    assert len(queue.take()) == 8
    assert not queue.push(q, 38, 37, 0.3)  # take() restores the steps bound


def test_queue_rejects_bad_steps():
    with pytest.raises(ValueError, match="steps must be >= 1"):
        ScoreQueue(0)


def test_model_generation_same_with_and_without_deferral():
    model = tiny_llama(num_hidden_layers=2)
    tokens = mx.array(np.random.default_rng(0).integers(0, 90, (1, 12)))
    cfg = H2OConfig(max_size=24, sink_size=2, heavy_budget=8)
    outs = []
    for defer in (True, False):
        caches = make_h2o_cache(model, cfg)
        for c in caches:
            c.set_decode(defer=128 if defer else 0)
        with mlx_h2o.patch():
            logits = model(tokens, cache=caches)
            seq = []
            for _ in range(40):  # fills 12 -> 24, then evicts every step
                tok = mx.argmax(logits[:, -1:], axis=-1)
                seq.append(int(tok.item()))
                logits = model(tok, cache=caches)
        outs.append((seq, np.array(logits), [np.array(c.positions[..., :c.size()]) for c in caches]))
    assert outs[0][0] == outs[1][0]
    np.testing.assert_allclose(outs[0][1], outs[1][1], rtol=1e-4, atol=1e-4)
    for a, b in zip(outs[0][2], outs[1][2]):
        np.testing.assert_array_equal(a, b)

