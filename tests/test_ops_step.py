"""The CPU's compiled evicting step (cache/ops_step.py) against the op-by-op path.

Both run on the CPU: the compiled step attends, folds and picks the next
victim in one mx.compile call, which the next token writes into (the fused
GPU step's flow); the op-by-op path picks the victim at the next token. Kept
positions, their slots and the scores must come out the same.
"""

import mlx.core as mx
import numpy as np
import pytest

from mlx_h2o import H2OConfig, H2OKVCache
from mlx_h2o.cache import (
    MixedPrecisionH2OKVCache,
    QuantConfig,
    QuantizedH2OKVCache,
    ops_step,
)
from mlx_h2o.cache.decode import compiled as compiled_module
from mlx_h2o.scores import SCORE_MODES

# On a GPU machine the op-by-op side would take the fused kernel step (which
# carries a victim too): both sides run on the CPU device.
pytestmark = pytest.mark.usefixtures("on_cpu")
D, HQ, HK = 16, 6, 2
STREAM = [7] + [1] * 40 + [9] + [1] * 30


def pair(cfg, window=None, make=H2OKVCache):
    compiled, plain = make(cfg, window), make(cfg, window)
    # Decode steps below the budget take the same path: no score queue.
    compiled.set_decode("compiled", defer=0)
    plain.set_decode("reference", defer=0)
    return compiled, plain


def step(cache, L, rng, B=2, dim=D):
    q, k, v = (mx.array(rng.standard_normal((B, h, L, dim)).astype(np.float32))
               for h in (HQ, HK, HK))
    keys, values = cache.update_and_fetch(k, v)
    return cache.h2o_attention(q, keys, values, scale=D ** -0.5, mask=cache.make_mask(L))


def assert_same(a, b):
    assert (a.offset, a.evicted, a.size()) == (b.offset, b.evicted, b.size())
    np.testing.assert_array_equal(np.array(a.positions), np.array(b.positions))
    np.testing.assert_allclose(np.array(a.score), np.array(b.score), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.array(a.count), np.array(b.count))
    for x, y in zip(a.kv.state(a.size()), b.kv.state(b.size())):  # K/V (triples)
        np.testing.assert_array_equal(np.array(x), np.array(y))


def same_over_stream(caches, seed, dim=D):
    """Feed STREAM to (compiled, plain): outputs and state equal after every
    step. Returns the steps after which the compiled cache carried a victim
    (only a compiled evicting step leaves one)."""
    rngs, taken = [np.random.default_rng(seed), np.random.default_rng(seed)], 0
    for L in STREAM:
        outs = [step(c, L, r, dim=dim) for c, r in zip(caches, rngs)]
        np.testing.assert_allclose(np.array(outs[0]), np.array(outs[1]), rtol=1e-5, atol=1e-6)
        taken += caches[0].next_victim is not None
        assert caches[1].next_victim is None
        assert_same(*caches)
    return taken


@pytest.mark.parametrize("mode", SCORE_MODES)
@pytest.mark.parametrize("window", [None, 17, 40])
def test_compiled_step_equals_op_by_op(mode, window):
    cfg = H2OConfig(max_size=24, sink_size=2, heavy_budget=9, score=mode, pinned=((5, 7),))
    caches = pair(cfg, window)
    taken = same_over_stream(caches, seed=3)
    assert taken >= 50 and caches[0].evicted > 50  # most decode steps evicted


@pytest.mark.parametrize("mode", SCORE_MODES)
@pytest.mark.parametrize("window", [None, 17])
@pytest.mark.parametrize("bits", [8, 4])
def test_compiled_quantized_step_equals_op_by_op(mode, window, bits):
    """QuantizedH2OKVCache's steps compile too: the attention reads the
    triples through mx.quantized_matmul, the victim is written by scatters."""
    cfg = H2OConfig(max_size=24, sink_size=2, heavy_budget=9, score=mode, pinned=((5, 7),))

    def make(config, window_size):
        return QuantizedH2OKVCache(config, window_size, quant=QuantConfig(bits, 32))

    caches = pair(cfg, window, make)
    taken = same_over_stream(caches, seed=4, dim=64)
    assert taken >= 50 and caches[0].evicted > 50
    assert caches[0].next_victim.shape == (2, HK, 1, 1)  # what the triples' scatters take


@pytest.mark.parametrize("mode", SCORE_MODES)
@pytest.mark.parametrize("window", [None, 17])
def test_compiled_mixed_steps_equal_op_by_op(monkeypatch, mode, window):
    """A full mixed-precision cache's eviction (a token moves between zones)
    and its attention + fold each run as one compiled call."""
    cfg = H2OConfig(max_size=24, sink_size=2, heavy_budget=9, score=mode, pinned=((5, 7),))

    def make(config, window_size):
        return MixedPrecisionH2OKVCache(config, window_size, quant=QuantConfig(8, 32, 4))

    caches = pair(cfg, window, make)
    calls = {"fill": 0, "evict": 0}
    fill = caches[0].decode.fill
    caches[0].decode.fill = lambda *a: calls.update(fill=calls["fill"] + 1) or fill(*a)
    evict = compiled_module.compiled_mixed_evict

    def counting(*a):
        calls["evict"] += 1
        return evict(*a)

    monkeypatch.setattr(compiled_module, "compiled_mixed_evict", counting)
    same_over_stream(caches, seed=6, dim=64)
    assert calls["fill"] >= 50 and calls["evict"] >= 50 and caches[0].evicted > 50


def test_compiled_step_through_trim_and_state():
    cfg = H2OConfig(max_size=16, sink_size=1, heavy_budget=6)
    caches, rngs = pair(cfg), [np.random.default_rng(9), np.random.default_rng(9)]
    for L in [5] + [1] * 25:
        for c, r in zip(caches, rngs):
            step(c, L, r)
    assert [c.trim(3) for c in caches] == [3, 3]
    assert_same(*caches)
    restored = H2OKVCache.from_state(caches[0].state, caches[0].meta_state)
    caches = (restored, caches[1])
    for L in [1] * 20:
        outs = [step(c, L, r) for c, r in zip(caches, rngs)]
        np.testing.assert_allclose(np.array(outs[0]), np.array(outs[1]), rtol=1e-5, atol=1e-6)
    assert restored.next_victim is not None
    assert_same(*caches)


def test_compiled_steps_trace_once_per_shape(monkeypatch):
    """offset and n go in as arrays: a decode stream does not retrace per token."""
    cfg = H2OConfig(max_size=12, sink_size=1, heavy_budget=4, score="ema")  # folds every step
    cache, rng = H2OKVCache(cfg, 9), np.random.default_rng(1)
    calls = {"evict_step": 0, "fill_step": 0}
    for name in calls:
        def counting(*args, _fn=getattr(ops_step, name), _name=name, **kw):
            calls[_name] += 1
            return _fn(*args, **kw)
        monkeypatch.setattr(ops_step, name, counting)
    for fn in (ops_step.compiled_step, ops_step.compiled_fill):
        fn.cache_clear()
    for L in [3] + [1] * 40:  # 9 appending steps, then 31 evicting ones
        step(cache, L, rng)
    for fn in (ops_step.compiled_step, ops_step.compiled_fill):
        fn.cache_clear()
    # evict: the first step's (B, Hk, 1) slot, then a carried victim (B, Hk, 1, D)
    assert calls == {"evict_step": 2, "fill_step": 1} and cache.evicted == 31


def test_batched_eviction_keeps_the_op_path():
    cache = H2OKVCache(H2OConfig(max_size=12, heavy_budget=4, evict_batch=4))
    rng = np.random.default_rng(2)
    for L in [12] + [1] * 10:
        step(cache, L, rng)
        assert cache.next_victim is None
