"""H2OKVCache invariants over random streams, trim, save/load, bad input."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mlx_h2o import H2OConfig, H2OKVCache
from mlx_h2o.files import load_prompt_cache, save_prompt_cache
from mlx_h2o.scores import SCORE_MODES

D, HQ, HK = 8, 4, 2


def step(cache, L, rng, B=2):
    """One attention call the way an mlx-lm layer makes it."""
    q, k, v = (mx.array(rng.standard_normal((B, h, L, D)).astype(np.float32)) for h in (HQ, HK, HK))
    mask = cache.make_mask(L)
    keys, values = cache.update_and_fetch(k * 3, v)
    return cache.h2o_attention(q, keys, values, scale=1.0, mask=mask)


def kept_positions(cache):
    return np.array(cache.positions[..., : cache.size()])


def check_invariants(cache, seen, cfg):
    assert cache.size() == min(seen, cfg.max_size)
    check_kept(cache, seen, cfg)


def check_kept(cache, seen, cfg):
    """offset, unique positions in range, sinks / recent window / pinned kept."""
    pos = kept_positions(cache)
    assert cache.offset == seen and cache.size() == pos.shape[-1]
    must = set(range(min(cfg.sink_size, seen))) | set(range(max(0, seen - cfg.recent_budget), seen))
    for s, e in cfg.pinned:
        must |= set(range(s, min(e, seen)))
    for row in pos.reshape(-1, pos.shape[-1]):
        assert len(set(row.tolist())) == len(row), "positions are unique"
        assert row.min() >= 0 and row.max() < seen
        assert must <= set(row.tolist()), "sinks, recent window and pinned are kept"
    assert cache.evicted == seen - cache.size()


configs = st.builds(
    lambda m, s, h, mode: H2OConfig(max_size=m, sink_size=min(s, m - 2), heavy_budget=min(h, m - min(s, m - 2) - 1), score=mode),
    st.integers(3, 24), st.integers(0, 4), st.integers(0, 12),
    st.sampled_from(SCORE_MODES),
)
chunks = st.lists(st.one_of(st.just(1), st.integers(1, 30)), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, lengths=chunks, seed=st.integers(0, 2**31 - 1))
# Every mode at least once, whatever the draw (key_norm scores at write, not by folds).
@example(cfg=H2OConfig(max_size=12, sink_size=2, heavy_budget=5, score="key_norm"),
         lengths=[13, 1, 1, 29, 1, 1, 1, 3, 1], seed=0)
@example(cfg=H2OConfig(max_size=12, sink_size=2, heavy_budget=5, prefill_window=4,
                       prefill_pool=3, score="expected_attention"),
         lengths=[13, 1, 1, 29, 1, 1, 1, 3, 1], seed=0)
def test_invariants_over_random_streams(cfg, lengths, seed):
    rng, cache, seen = np.random.default_rng(seed), H2OKVCache(cfg), 0
    for L in lengths:
        step(cache, L, rng)
        seen += L
        check_invariants(cache, seen, cfg)


def test_pinned_ranges_survive():
    cfg = H2OConfig(max_size=12, sink_size=2, heavy_budget=5, pinned=((20, 23),))
    rng, cache = np.random.default_rng(0), H2OKVCache(cfg)
    for L in [30] + [1] * 40:
        step(cache, L, rng)
    check_invariants(cache, 70, cfg)


def test_sequences_evict_independently():
    cfg = H2OConfig(max_size=10, sink_size=2, heavy_budget=4, score="accumulated")
    lengths = [13] + [1] * 25
    both = H2OKVCache(cfg)
    singles = [H2OKVCache(cfg), H2OKVCache(cfg)]
    rng = np.random.default_rng(1)
    for L in lengths:
        q, k, v = (rng.standard_normal((2, h, L, D)).astype(np.float32) * 3 for h in (HQ, HK, HK))
        for cache, sl in [(both, slice(0, 2))] + [(c, slice(b, b + 1)) for b, c in enumerate(singles)]:
            keys, values = cache.update_and_fetch(mx.array(k[sl]), mx.array(v[sl]))
            cache.h2o_attention(mx.array(q[sl]), keys, values, scale=1.0, mask=cache.make_mask(L))
    joint = kept_positions(both)
    for b, c in enumerate(singles):
        np.testing.assert_array_equal(np.sort(joint[b], -1), np.sort(kept_positions(c)[0], -1))
    assert not np.array_equal(np.sort(joint[0], -1), np.sort(joint[1], -1)), "sequences differ"


def test_window_layer_drops_invisible_tokens_first():
    cfg = H2OConfig(max_size=12, sink_size=4, heavy_budget=4)
    rng, cache = np.random.default_rng(2), H2OKVCache(cfg, window_size=8)
    for L in [20] + [1] * 10:
        step(cache, L, rng)
    pos = kept_positions(cache)
    # 12 slots but only 8 visible positions: all 8 visible ones are kept.
    for row in pos.reshape(-1, 12):
        assert set(range(22, 30)) <= set(row.tolist())


def test_trim_recent_tokens():
    # The scoring this test's random stream was written for (the old defaults).
    cfg = H2OConfig(
        max_size=10, sink_size=2, heavy_budget=4, score="ema", prefill_window=0,
        prefill_pool=0,
    )
    rng, cache = np.random.default_rng(3), H2OKVCache(cfg)
    for L in [6, 1, 1]:
        step(cache, L, rng)
    assert cache.trim(3) == 3 and cache.offset == 5 and cache.size() == 5  # no eviction yet
    for L in [20] + [1] * 5:
        step(cache, L, rng)
    assert cache.offset == 30
    before = kept_positions(cache)
    assert cache.trim(10) == 10  # past the recent window: the held ones below 20 stay
    assert cache.offset == 20 and kept_positions(cache).max() < 20
    fewest = min(int((row < 20).sum()) for row in before.reshape(-1, 10))
    assert cache.size() == fewest == cache.offset - cache.evicted
    step(cache, 1, rng)
    assert kept_positions(cache).max() == 20 and cache.offset == 21


def test_trim_on_window_layer_smaller_than_recent_window():
    cfg = H2OConfig(max_size=12, sink_size=2, heavy_budget=2)  # recent 8 > window 5
    rng, cache = np.random.default_rng(5), H2OKVCache(cfg, window_size=5)
    for L in [20] + [1] * 6:
        step(cache, L, rng)
    before = kept_positions(cache)
    assert cache.trim(8) == 8 and cache.offset == 18
    after = kept_positions(cache)
    rows = after.reshape(before.shape[0] * before.shape[1], -1)
    for row_before, row_after in zip(before.reshape(-1, 12), rows):
        assert set(row_after.tolist()) <= {p for p in row_before.tolist() if p < 18}


def test_save_load_round_trip(tmp_path):
    cfg = H2OConfig(max_size=10, sink_size=2, heavy_budget=4, score="normalized")
    rng, cache = np.random.default_rng(4), [H2OKVCache(cfg), H2OKVCache(cfg, window_size=6)]
    for L in [15, 1, 1, 1]:
        for c in cache:
            step(c, L, rng)
    path = str(tmp_path / "prompt.safetensors")
    save_prompt_cache(path, cache, {"model": "test"})
    loaded, meta = load_prompt_cache(path, return_metadata=True)
    assert meta == {"model": "test"} and [c.window_size for c in loaded] == [None, 6]
    for a, b in zip(cache, loaded):
        assert (a.offset, a.evicted, a.config, a.size()) == (b.offset, b.evicted, b.config, b.size())
        for x, y in zip(a.state, b.state):
            np.testing.assert_array_equal(np.array(x), np.array(y))
    outs = [step(c, 1, np.random.default_rng(9)) for c in (cache[0], loaded[0])]
    np.testing.assert_array_equal(kept_positions(cache[0]), kept_positions(loaded[0]))
    # A GPU steps loaded caches in a StepGroup (MLX's SDPA), these built ones
    # per layer (the fused kernel): float32 rounding apart (H200, 1e-5).
    tol = 0 if mx.default_device() == mx.cpu else 1e-4
    np.testing.assert_allclose(np.array(outs[0]), np.array(outs[1]), rtol=tol, atol=tol)
    assert not list(tmp_path.glob(".tmp-*")), "no temporary file left behind"


def test_corrupt_or_foreign_file(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="not a readable cache file"):
        load_prompt_cache(str(path))
    mx.save_safetensors(str(path), {"a": mx.zeros(2)})
    with pytest.raises(ValueError, match="not an mlx-h2o cache file"):
        load_prompt_cache(str(path))
    with pytest.raises(ValueError, match="must end with .safetensors"):
        save_prompt_cache(str(tmp_path / "x.bin"), [])


def test_missing_scores_raise_clear_error():
    cache = H2OKVCache(H2OConfig(max_size=8))
    k = mx.zeros((1, HK, 1, D))
    cache.update_and_fetch(k, k)
    with pytest.raises(RuntimeError, match="mlx_h2o.patch"):
        cache.update_and_fetch(k, k)


def test_bad_constructor_input():
    with pytest.raises(TypeError, match="H2OConfig"):
        H2OKVCache({"max_size": 8})
    with pytest.raises(ValueError, match="window_size"):
        H2OKVCache(H2OConfig(max_size=8), window_size=0)
    for window in ("8", 2.5, True):
        with pytest.raises(TypeError, match="window_size"):
            H2OKVCache(H2OConfig(max_size=8), window_size=window)


@pytest.mark.parametrize("keys, values", [
    ((1, HK, D), (1, HK, D)),  # 3-D: no length axis
    ((1, HK, 0, D), (1, HK, 0, D)),  # no tokens
    ((1, HK, 2, D), (1, 1, 2, D)),  # fewer value heads than key heads
    ((2, HK, 2, D), (1, HK, 2, D)),  # another batch size
    ((1, HK, 2, D), (1, HK, 3, D)),  # another length
])
def test_bad_update_is_refused_with_the_layout(keys, values):
    cache = H2OKVCache(H2OConfig(max_size=8))
    step(cache, 3, np.random.default_rng(0), B=1)
    with pytest.raises(ValueError, match=r"\(B, n_kv_heads, L, head_dim\)"):
        cache.update_and_fetch(mx.zeros(keys), mx.zeros(values))
    assert cache.offset == 3 and cache.size() == 3  # nothing half-written
    step(cache, 1, np.random.default_rng(1), B=1)
