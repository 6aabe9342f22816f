"""Batched eviction (H2OConfig.evict_batch): a float64 simulation of the policy,
invariants over random streams, round trips, config errors, a tiny model."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache

import mlx_h2o
from mlx_h2o import H2OConfig, H2OKVCache, make_h2o_cache
from mlx_h2o.cache import QuantConfig, quantized_cache_type
from mlx_h2o.config import config_from_dict, config_to_dict, with_max_size
from mlx_h2o.scores import SCORE_MODES

from test_cache import check_kept
from tiny_models import VOCAB, tiny_llama, tiny_qwen3

D, HQ, HK = 8, 4, 2


def simulate(cfg, qs, ks):
    """Batched accumulated H2O in float64 for one KV head: kept positions after
    each decode token. qs (T, G, D) the head's group of queries, ks (T, D).
    A full cache keeps its ``max_size - evict_batch`` best slots (sinks and
    the recent window counting the incoming token are protected), then appends."""
    kept, score, out = [], {}, []
    for t in range(len(qs)):
        if len(kept) >= cfg.max_size:
            safe = [p for p in kept if p < cfg.sink_size or p >= t + 1 - cfg.recent_budget]
            rest = sorted((p for p in kept if p not in safe), key=lambda p: (score[p], p))
            kept = sorted(safe + rest[cfg.evict_batch:])
        kept.append(t)
        score[t] = 0.0
        logits = qs[t] @ np.stack([ks[p] for p in kept]).T  # (G, n)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p = (p / p.sum(-1, keepdims=True)).mean(0)  # mean over the group
        for j, pos in enumerate(kept):
            score[pos] += p[j]
        out.append(list(kept))
    return out


@pytest.mark.parametrize("seed, max_size, sink, heavy, batch",
                         [(0, 16, 2, 8, 4), (1, 23, 1, 12, 7), (2, 12, 0, 6, 6), (3, 9, 3, 2, 2)])
def test_matches_float64_simulation(seed, max_size, sink, heavy, batch):
    """Same kept positions at every step as the float64 policy, per KV head."""
    cfg = H2OConfig(max_size=max_size, sink_size=sink, heavy_budget=heavy, evict_batch=batch)
    rng = np.random.default_rng(seed)
    T, G = 5 * max_size, HQ // HK
    qs = rng.standard_normal((T, HQ, D))
    ks = rng.standard_normal((T, HK, D)) * 2
    cache = H2OKVCache(cfg)
    got = []
    for t in range(T):
        k = mx.array(ks[t][None, :, None].astype(np.float32))
        keys, values = cache.update_and_fetch(k, k)
        q = mx.array(qs[t][None, :, None].astype(np.float32))
        mx.eval(cache.h2o_attention(q, keys, values, scale=1.0, mask=None))
        got.append(np.sort(np.array(cache.positions[0, :, : cache.size()]), -1))
    for h in range(HK):
        want = simulate(cfg, qs[:, h * G:(h + 1) * G], ks[:, h])
        for t in range(T):
            assert got[t][h].tolist() == want[t], f"head {h}, step {t}"


def test_decode_attends_lingering_slots():
    """After a batch eviction, decode steps attend the kept tokens, the new ones
    and the evicted tokens not yet overwritten (float64 reference); a masked
    step attends only the kept and new ones."""
    cfg = H2OConfig(max_size=12, sink_size=1, heavy_budget=6, evict_batch=5)
    rng = np.random.default_rng(3)
    ks, vs = rng.standard_normal((2, 16, HK, D))
    qs = rng.standard_normal((16, HQ, D))
    cache = H2OKVCache(cfg)
    for t in range(16):
        keys, values = cache.update_and_fetch(*(mx.array(a[t][None, :, None].astype(np.float32))
                                                for a in (ks, vs)))
        q = mx.array(qs[t][None, :, None].astype(np.float32))
        mask = mx.ones((1, 1, 1, cache.size()), mx.bool_) if t == 15 else None
        out = np.array(cache.h2o_attention(q, keys, values, scale=1.0, mask=mask))[0, :, 0]
        lingering = 12 <= t < 15  # the eviction came at token 12; t = 15 is masked
        seen = np.array(cache.positions[0])[:, : 12 if lingering else cache.size()]
        if t >= 12:  # after the eviction at token 12: 5 - (t - 11) lingering slots
            assert cache.size() == 7 + t - 11 and seen.shape[-1] == (12 if t < 15 else 11)
        for h in range(HK):
            k, v = ks[seen[h], h], vs[seen[h], h]  # (n, D)
            g = qs[t, h * 2:(h + 1) * 2] @ k.T
            p = np.exp(g - g.max(-1, keepdims=True))
            want = (p / p.sum(-1, keepdims=True)) @ v
            np.testing.assert_allclose(out[h * 2:(h + 1) * 2], want, rtol=1e-4, atol=1e-5)


def check_invariants(cache, seen, cfg):
    """test_cache's invariants, with the size between two batch events."""
    low = cfg.max_size - cfg.evict_batch + 1 if seen > cfg.max_size else seen
    assert low <= cache.size() <= cfg.max_size
    check_kept(cache, seen, cfg)


configs = st.builds(
    lambda m, s, h, k, mode: H2OConfig(
        max_size=m, sink_size=s, heavy_budget=min(h, m - s - 1), score=mode,
        evict_batch=max(1, min(k, h, m - s - 1))),
    st.integers(8, 24), st.integers(0, 3), st.integers(1, 12), st.integers(2, 8),
    st.sampled_from(SCORE_MODES),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, prompt=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
@example(cfg=H2OConfig(max_size=12, sink_size=2, heavy_budget=5, score="key_norm",
                       evict_batch=3), prompt=17, seed=0)
@example(cfg=H2OConfig(max_size=12, sink_size=2, heavy_budget=5, prefill_window=4,
                       score="expected_attention", evict_batch=3), prompt=17, seed=0)
def test_invariants_over_random_streams(cfg, prompt, seed):
    """A prompt chunk (compacted to max_size if it overflows), then decode tokens."""
    rng, cache, seen = np.random.default_rng(seed), H2OKVCache(cfg), 0
    for L in [prompt] + [1] * 30:
        q, k, v = (mx.array(rng.standard_normal((2, h, L, D)).astype(np.float32))
                   for h in (HQ, HK, HK))
        mask = cache.make_mask(L)
        keys, values = cache.update_and_fetch(k * 3, v)
        mx.eval(cache.h2o_attention(q, keys, values, scale=1.0, mask=mask))
        seen += L
        check_invariants(cache, seen, cfg)


def decode(cache, rng, steps):
    for _ in range(steps):
        q, k, v = (mx.array(rng.standard_normal((1, h, 1, D)).astype(np.float32))
                   for h in (HQ, HK, HK))
        keys, values = cache.update_and_fetch(k, v)
        mx.eval(cache.h2o_attention(q, keys, values, scale=1.0, mask=None))


def test_state_round_trip_mid_batch():
    """A cache restored between two batch evictions goes on as the original."""
    cfg = H2OConfig(max_size=12, sink_size=2, heavy_budget=6, evict_batch=4)
    a = H2OKVCache(cfg)
    decode(a, np.random.default_rng(0), 18)  # evicted once, 2 of 4 free slots used
    b = H2OKVCache.from_state(a.state, a.meta_state)
    assert b.config.evict_batch == 4 and b.size() == a.size() == 10
    for c in (a, b):
        decode(c, np.random.default_rng(1), 9)
    np.testing.assert_array_equal(np.array(a.positions), np.array(b.positions))
    np.testing.assert_allclose(np.array(a.score), np.array(b.score), rtol=1e-5, atol=1e-6)


def test_trim_after_batch_eviction():
    cfg = H2OConfig(max_size=12, sink_size=2, heavy_budget=6, evict_batch=4)
    cache = H2OKVCache(cfg)
    decode(cache, np.random.default_rng(0), 20)
    n = cache.size()
    assert cache.trim(3) == 3 and cache.size() == n - 3 and cache.offset == 17
    decode(cache, np.random.default_rng(1), 10)
    check_invariants(cache, 27, cfg)


def test_quantized_cache_evicts_in_batches():
    cfg = H2OConfig(max_size=24, sink_size=2, heavy_budget=12, evict_batch=8)
    cls = quantized_cache_type(QuantConfig(bits=8, group_size=32))
    cache, rng, seen = cls(cfg), np.random.default_rng(0), 0
    for L in [30] + [1] * 20:
        q = mx.array(rng.standard_normal((1, 4, L, 64)).astype(np.float32))
        k, v = (mx.array(rng.standard_normal((1, 2, L, 64)).astype(np.float32)) for _ in "kv")
        mask = cache.make_mask(L)
        keys, values = cache.update_and_fetch(k, v)
        mx.eval(cache.h2o_attention(q, keys, values, scale=0.125, mask=mask))
        seen += L
        check_invariants(cache, seen, cfg)
    assert cache.size() < cfg.max_size  # 20 decode tokens: two batches evicted


def test_mixed_precision_keeps_per_step_eviction():
    cfg = H2OConfig(max_size=24, sink_size=2, heavy_budget=12, evict_batch=8)
    cls = quantized_cache_type(QuantConfig(bits=8, group_size=32, recent_bits=4))
    cache, rng = cls(cfg), np.random.default_rng(0)
    for L in [30] + [1] * 5:
        q = mx.array(rng.standard_normal((1, 4, L, 64)).astype(np.float32))
        k, v = (mx.array(rng.standard_normal((1, 2, L, 64)).astype(np.float32)) for _ in "kv")
        keys, values = cache.update_and_fetch(k, v)
        mx.eval(cache.h2o_attention(q, keys, values, scale=0.125, mask=cache.make_mask(L)))
        assert cache.size() == cfg.max_size


def test_equals_kvcache_within_budget():
    """Nothing evicted: the same logits as mlx-lm's KVCache, batch or not."""
    model = tiny_llama()
    # ids must stay below VOCAB: an out-of-range id reads past the embedding
    tokens = mx.array(np.random.default_rng(0).integers(0, VOCAB, (1, 40)))
    ref = [KVCache() for _ in model.layers]
    want = [model(tokens[:, :24], cache=ref)] + [model(tokens[:, t:t + 1], cache=ref)
                                                  for t in range(24, 40)]
    cache = make_h2o_cache(model, H2OConfig(max_size=64, evict_batch=16),
                           layer_budget="uniform")
    with mlx_h2o.patch():
        got = [model(tokens[:, :24], cache=cache)] + [model(tokens[:, t:t + 1], cache=cache)
                                                      for t in range(24, 40)]
    for w, g in zip(want, got):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-4, atol=1e-4)


def test_tiny_model_decodes_past_the_budget():
    model = tiny_qwen3()
    cfg = H2OConfig(max_size=32, sink_size=4, heavy_budget=16, evict_batch=8)
    cache = make_h2o_cache(model, cfg, layer_budget="uniform")
    y = mx.array([[1, 2, 3, 4, 5]])
    with mlx_h2o.patch():
        for _ in range(60):
            y = model(y, cache=cache)[:, -1:].argmax(-1)
            mx.eval(y)
    for c in cache:
        check_invariants(c, 64, cfg)


def test_config_validation_and_dict():
    with pytest.raises(ValueError, match="evict_batch"):
        H2OConfig(max_size=16, sink_size=2, heavy_budget=4, evict_batch=5)
    with pytest.raises(ValueError, match="evict_batch"):
        H2OConfig(max_size=16, sink_size=2, heavy_budget=6, pinned=((0, 3),), evict_batch=4)
    with pytest.raises(ValueError, match="evict_batch"):
        H2OConfig(max_size=16, evict_batch=0)
    with pytest.raises(TypeError, match="evict_batch"):
        H2OConfig(max_size=16, evict_batch=2.0)
    assert "evict_batch" not in config_to_dict(H2OConfig(max_size=16))
    cfg = H2OConfig(max_size=64, heavy_budget=32, evict_batch=16)
    assert config_from_dict(config_to_dict(cfg)) == cfg
    small = with_max_size(cfg, 20)  # heavy 9: evicts at most 9 at once
    assert small.evict_batch == small.heavy_budget == 9


@pytest.mark.parametrize("through", ["state", "file"])
def test_round_trip_at_any_step_continues_exactly(tmp_path, through):
    """Saved and restored at each step of a batch-eviction cycle, a tiny
    model's cache goes on exactly as without the round trip: the restored
    cache still attends the evicted slots not yet overwritten."""
    from mlx_h2o.files import load_prompt_cache, save_prompt_cache

    model = tiny_llama()
    cfg = H2OConfig(max_size=16, sink_size=2, heavy_budget=6, evict_batch=5)
    tokens = mx.array(np.random.default_rng(8).integers(0, VOCAB, (1, 40)))

    def run(cache, start, stop):
        with mlx_h2o.patch():
            return [model(tokens[:, t : t + 1], cache=cache) for t in range(start, stop)]

    base = make_h2o_cache(model, cfg, layer_budget="uniform")
    run(base, 0, 17)  # full at 16: the first event at token 16
    for k in range(6):  # every step of one cycle, and the next event
        cache = make_h2o_cache(model, cfg, layer_budget="uniform")
        run(cache, 0, 17 + k)
        _ = [c.state for c in cache]  # reading folds the queue, as saving does
        if through == "file":
            save_prompt_cache(str(tmp_path / "c.safetensors"), cache)
            restored = load_prompt_cache(str(tmp_path / "c.safetensors"))
        else:
            restored = [type(c).from_state(c.state, c.meta_state) for c in cache]
        for a, b in zip(run(cache, 17 + k, 26), run(restored, 17 + k, 26)):
            np.testing.assert_array_equal(np.array(a), np.array(b))
