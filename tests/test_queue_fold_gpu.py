"""The queue-fold kernels (kernels/queued.py) against a float64 reference.

Source assembly runs everywhere; the numeric checks run only where MLX has a
GPU backend: fresh random queries and K buffers longer than the visible
slots, score arrays shorter than the buffer (after a prompt compaction),
GQA ratios 1 / 2 / 4 / 8 / 16, every head dim and dtype, visible counts at
partial tiles, outputs poisoned with NaN. The cache-level check compares a
cache folding with the kernel and one folding with ops over a few hundred
decode steps.
"""

from contextlib import contextmanager

import mlx.core as mx
import numpy as np
import pytest

from mlx_h2o import H2OConfig, H2OKVCache
import mlx_h2o.cache.decode.deferred as deferred_step
from mlx_h2o.cache.score_queue import QueuedQuery, fold_queue
from mlx_h2o.kernels import backend, queued, source
from mlx_h2o.kernels.queued import queue_fold, queue_fold_supported
from kernel_refs import queue_fold_ref64, to_np
from mlx_h2o.scores import DEFERRABLE
from decode_steps import queue_kernel_of

needs_gpu = pytest.mark.skipif(backend.gpu_backend() is None,
                               reason="needs MLX with Metal or CUDA")


def case(rng, dtype, B, Hq, Hk, D, cap, M, visible):
    q = mx.array(rng.standard_normal((B, Hq, len(visible), D)).astype(np.float32)).astype(dtype)
    k = mx.array((2 * rng.standard_normal((B, Hk, cap, D))).astype(np.float32)).astype(dtype)
    score = mx.array(rng.random((B, Hk, M)).astype(np.float32))
    count = mx.array(rng.integers(0, 50, (B, Hk, M)).astype(np.float32))
    return q, k, score, count


@pytest.mark.parametrize("tile", queued.TILES)
def test_source_shares_the_body(tile):
    for kind in queued.KINDS:
        _, cuda = queued.pass_source("cuda", kind, tile)
        _, metal = queued.pass_source("metal", kind, tile)
        assert "$" not in cuda and cuda.count("{") == cuda.count("}")
        assert cuda.replace(source.CUDA_IDS, "") == metal.replace(source.METAL_IDS, "")
        inputs, outputs = queued.pass_names(kind)
        assert all(n in cuda for n in inputs + outputs)


def test_not_supported_without_gpu_or_for_odd_shapes():
    q, k = mx.zeros((1, 8, 4, 64)), mx.zeros((1, 2, 16, 64))
    if backend.gpu_backend() is None:
        assert not queue_fold_supported(q, k)
    assert not queue_fold_supported(mx.zeros((1, 8, 4, 60)), mx.zeros((1, 2, 16, 60)))
    assert not queue_fold_supported(mx.zeros((1, 32, 200, 64)), mx.zeros((1, 2, 16, 64)))
    # 16 query heads per KV head: a queue of 128 is 2048 rows, of 129 too many
    one = mx.zeros((1, 32, 1, 64))
    assert not queue_fold_supported(one, mx.zeros((1, 2, 16, 64)), queued=129)


def test_reference_equals_the_ops_fold():
    """The float64 reference is what the cache's ops fold computes."""
    rng = np.random.default_rng(11)
    visible = [40, 41, 42, 17]
    q, k, score, count = case(rng, mx.float32, 2, 8, 2, 16, 45, 44, visible)
    items = [QueuedQuery(q[:, :, t:t + 1], v, 0, 0.4) for t, v in enumerate(visible)]
    step, seen = fold_queue(items, k[..., :44, :])
    want_s, want_c = queue_fold_ref64(to_np(q), to_np(k), visible, 0.4, to_np(score),
                                      to_np(count))
    np.testing.assert_allclose(np.array(score + step), want_s, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.array(count + seen), want_c)


@needs_gpu
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize("D,Hq,Hk", [(64, 8, 8), (80, 16, 8), (96, 8, 2), (128, 32, 8),
                                     (256, 16, 2), (128, 32, 2)])
@pytest.mark.parametrize("n,T", [(1, 1), (97, 7), (257, 32), (1025, 3), (4097, 128)])
def test_queue_fold_matches_float64(dtype, D, Hq, Hk, n, T):
    rng = np.random.default_rng(abs(hash((str(dtype), D, Hq, n, T))) % 2**32)
    if (Hq // Hk) * T > queued.MAX_ROWS:
        pytest.skip("more rows than one fold takes")
    B = 2 if n < 4097 else 1
    visible = [max(1, n - T + 1 + t) for t in range(T)]  # consecutive tokens, as queued
    cap, M = n + 37, n + (0 if n % 2 else 5)  # M < cap: metadata after a compaction
    q, k, score, count = case(rng, dtype, B, Hq, Hk, D, cap, M, visible)
    got_s, got_c = queue_fold(q, k, visible, 0.3, score, count, poison=float("nan"))
    want_s, want_c = queue_fold_ref64(to_np(q), to_np(k), visible, 0.3, to_np(score), to_np(count))
    np.testing.assert_array_equal(np.array(got_c), want_c)
    np.testing.assert_allclose(np.array(got_s), want_s, rtol=2e-5, atol=2e-5)


@needs_gpu
@pytest.mark.parametrize("tile", queued.TILES)
def test_queue_fold_any_visible_counts(tile):
    rng = np.random.default_rng(7)
    visible = [300, 5, 129, 1, 300, 77, 131, 2, 250]  # not consecutive, repeated, 1 slot
    q, k, score, count = case(rng, mx.float32, 1, 8, 4, 64, 300, 300, visible)
    got_s, got_c = queue_fold(q, k, visible, 0.5, score, count, poison=float("nan"), tile=tile)
    want_s, want_c = queue_fold_ref64(to_np(q), to_np(k), visible, 0.5, to_np(score), to_np(count))
    np.testing.assert_array_equal(np.array(got_c), want_c)
    np.testing.assert_allclose(np.array(got_s), want_s, rtol=2e-5, atol=2e-5)
    items = [QueuedQuery(q[:, :, t:t + 1], v, 0, 0.5) for t, v in enumerate(visible)]
    step, seen = fold_queue(items, k)  # the ops fold the cache falls back to
    np.testing.assert_allclose(np.array(score + step), np.array(got_s), rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.array(count + seen), np.array(got_c))


@needs_gpu
@pytest.mark.parametrize("bad", ["empty", "too_many", "zero", "dtype", "tile"])
def test_queue_fold_rejects_bad_input(bad):
    q, k = mx.zeros((1, 4, 2, 64), mx.float16), mx.zeros((1, 2, 16, 64), mx.float16)
    score = count = mx.zeros((1, 2, 16))
    visible = {"empty": [], "too_many": [3, 17], "zero": [0, 3]}.get(bad, [3, 4])
    if bad == "dtype":
        k = k.astype(mx.float32)
    tile = (16, 8) if bad == "tile" else queued.TILE
    with pytest.raises(ValueError, match="queue_fold"):
        queue_fold(q, k, visible, 0.1, score, count, tile=tile)


@contextmanager
def ops_queue_fold():
    """A context in which score queues decide for the ops fold."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(deferred_step, "queue_fold_supported", lambda *a, **k: False)
        yield


@needs_gpu
def test_cache_keeps_the_ops_fold_when_a_queue_has_too_many_rows():
    """32 query heads per KV head: a full queue (128) is more rows than the
    kernel takes, so the cache keeps the ops fold and its memory bound."""
    cache = H2OKVCache(H2OConfig(max_size=512))
    q = mx.zeros((1, 64, 1, 16))
    for L in (5, 1, 1):
        keys, values = cache.update_and_fetch(mx.ones((1, 2, L, 16)), mx.ones((1, 2, L, 16)))
        cache.h2o_attention(q if L == 1 else mx.zeros((1, 64, L, 16)), keys, values,
                            scale=0.25, mask=cache.make_mask(L))
    assert queue_fold_supported(q, keys) and not queue_kernel_of(cache)


@needs_gpu
@pytest.mark.parametrize("mode", DEFERRABLE)
def test_cache_kernel_fold_equals_ops_fold(mode):
    """Kernel and ops folds over 300 decode steps, then eviction: same kept
    positions, scores equal up to float summation order."""
    cfg = H2OConfig(max_size=256, sink_size=4, heavy_budget=100, score=mode)
    caches = [H2OKVCache(cfg), H2OKVCache(cfg)]
    for c in caches:
        c.set_decode(defer=32)
    B, Hq, Hk, D = 1, 8, 2, 64

    def stream(c):
        rng, outs = np.random.default_rng(5), []
        for L in [40] + [1] * 300:
            q, k, v = (mx.array(rng.standard_normal((B, h, L, D)).astype(np.float32))
                       .astype(mx.bfloat16) for h in (Hq, Hk, Hk))
            keys, values = c.update_and_fetch(k, v)
            outs.append(to_np(c.h2o_attention(q, keys, values, scale=0.125,
                                              mask=c.make_mask(L))))
        return outs

    kernel = stream(caches[0])
    with ops_queue_fold():
        ops = stream(caches[1])
    for x, y in zip(kernel, ops):
        np.testing.assert_allclose(x, y, rtol=1e-2, atol=1e-2)
    a, b = caches
    assert queue_kernel_of(a) and not queue_kernel_of(b)
    assert a.evicted == b.evicted > 0
    np.testing.assert_array_equal(np.array(a.positions), np.array(b.positions))
    np.testing.assert_allclose(np.array(a.score), np.array(b.score), rtol=1e-4, atol=1e-5)
