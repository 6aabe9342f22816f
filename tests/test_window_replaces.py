"""A later prompt chunk's window replaces the scores (policy.window_replaces).

Under either ``prefill_compact`` mode, a chunk of L >= ``prefill_window``
that overflows a cache already holding ``max_size`` tokens leaves every slot
scored by its own window alone; a shorter chunk, the first chunk to overflow
and key-norm scores add as before. Checked against a float64 reference on
random inputs (dense, 8-bit, mixed storage, the batch cache).
"""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cache import check_invariants

from mlx_h2o import H2OConfig, H2OKVCache, policy
from mlx_h2o.cache import MixedPrecisionH2OKVCache, QuantConfig, QuantizedH2OKVCache
from mlx_h2o.cache.batch_cache import BatchH2OKVCache
from mlx_h2o.scores import SCORE_MODES

HQ, HK, B = 4, 2, 2  # GQA: two query heads per KV head


# --- reference ------------------------------------------------------------------------
def window_fold(q, keys, kpos, qpos, scale, window, pool):
    """float64 SnapKV fold of one chunk: (step, seen), each (B, Hk, N).

    Shapes: q (B, Hq, L, D); keys (B, Hk, N, D) as attention reads them;
    kpos (B, Hk, N) slot positions; qpos (L,) query positions. The last
    ``window`` queries' softmax attention (keys at positions <= the query's),
    GQA heads averaged, summed over the window, then max-pooled over held
    slots within ``pool // 2`` positions; ``seen``: window queries seeing a slot."""
    q = np.asarray(q, np.float64)[:, :, -window:]
    Bq, Hq, W, _ = q.shape
    Hk, N, G = keys.shape[1], keys.shape[2], Hq // keys.shape[1]
    k = np.repeat(np.asarray(keys, np.float64), G, axis=1)  # (B, Hq, N, D)
    kp = np.repeat(kpos, G, axis=1)[:, :, None, :]
    visible = (kp >= 0) & (kp <= qpos[-window:, None])  # (B, Hq, W, N); -1: empty slot
    logits = np.where(visible, scale * q @ k.swapaxes(-1, -2), -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    step = p.reshape(Bq, Hk, G, W, N).mean(axis=2).sum(axis=2)
    seen = visible.reshape(Bq, Hk, G, W, N)[:, :, 0].sum(axis=2).astype(np.float64)
    if pool > 1:
        # (B, Hk, N, N): slot j's neighbours within pool // 2 positions
        near = np.abs(kpos[..., :, None] - kpos[..., None, :]) <= pool // 2
        step = np.where(near, step[..., None, :], 0.0).max(axis=-1)
    return step, seen


def by_position(positions, values):
    """{(b, h, position): value} of every held slot (position >= 0)."""
    pos = np.asarray(positions)
    slots = zip(np.ndindex(pos.shape), pos.ravel(), np.asarray(values).ravel())
    return {(b, h, int(p)): float(v) for (b, h, _), p, v in slots if p >= 0}


def added(before, step):
    """``step`` added to the scores held ``before`` (new slots start at 0)."""
    return {k: before.get(k, 0.0) + v for k, v in step.items()}


def held(cache):
    n = cache.size()
    return (by_position(cache.positions[..., :n], cache.score[..., :n]),
            by_position(cache.positions[..., :n], cache.count[..., :n]))


def assert_scores(cache, want_score, want_count):
    """Every held slot's score / count against {(b, h, position): value}.
    The cache's float32 softmax sums (~60 keys, up to 8 queries, pooled)
    differ from float64 by at most 7.4e-7 relative on these inputs (~6 ulp):
    1e-5 leaves a margin of 10; counts are exact."""
    score, count = held(cache)
    for key, s in score.items():
        assert s == pytest.approx(want_score[key], rel=1e-5, abs=1e-6), key
        assert count[key] == want_count[key], key


# --- driving a cache ------------------------------------------------------------------
KINDS = {  # storage, head dim (quantized groups take 32 values)
    "dense": (H2OKVCache, 16),
    "q8": (lambda cfg: QuantizedH2OKVCache(cfg, quant=QuantConfig(8, 32)), 64),
    "mixed": (lambda cfg: MixedPrecisionH2OKVCache(cfg, quant=QuantConfig(8, 32, 4)),
              64),
}


def qkv(rng, L, dim, rows=B):
    return tuple(mx.array(rng.standard_normal((rows, h, L, dim)).astype(np.float32))
                 for h in (HQ, HK, HK))


def call(cache, L, rng, dim):
    """One attention call as an mlx-lm layer makes it; returns what the
    reference needs: (queries, keys as attended, slot positions, query positions)."""
    q, k, v = qkv(rng, L, dim)
    mask = cache.make_mask(L)
    keys, values = cache.update_and_fetch(k * 3, v)
    n = cache.size()
    dense = np.array(cache.kv.dense(keys, values, mx.float32)[0])[..., :n, :]
    kpos = np.array(cache.positions[..., :n])
    cache.h2o_attention(q, keys, values, scale=dim**-0.5, mask=mask)
    return np.array(q), dense, kpos, np.arange(cache.offset - L, cache.offset)


def prefill_then_decode(cache, rng, dim):
    """A first overflowing chunk, then decode steps: the cache holds max_size."""
    call(cache, 33, rng, dim)
    for _ in range(2):
        call(cache, 1, rng, dim)
    assert cache.size() == cache.max_size


def config(**kw):
    base = dict(max_size=24, sink_size=2, heavy_budget=10, prefill_window=8,
                prefill_pool=5)
    return H2OConfig(**{**base, **kw})


def assert_kept_by(cache, score, kpos, cfg):
    """The kept positions are the sinks, the recent window and the top heavy
    hitters of ``score`` (B, Hk, N), equal scores keeping the newer position
    (pooling copies one value to its neighbours); no near ties at the boundary."""
    off = cache.offset
    for (b, h), _ in np.ndenumerate(kpos[..., 0]):
        pos, s = kpos[b, h], score[b, h]
        free = (pos >= cfg.sink_size) & (pos < off - cfg.recent_budget)
        order = np.lexsort((-pos[free], -s[free]))
        gap = s[free][order[cfg.heavy_budget - 1]] - s[free][order[cfg.heavy_budget]]
        assert gap == 0 or gap > 1e-4 * s[free].max(), "near tie: change the seed"
        heavy = pos[free][order[: cfg.heavy_budget]]
        want = set(pos[~free].tolist()) | set(heavy.tolist())
        n = cache.size()
        assert set(np.array(cache.positions[b, h, :n]).tolist()) == want


# --- (a) a later chunk of L >= W on a full cache: its window alone --------------------
@pytest.mark.parametrize("compact", ["chunk", "prompt"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_later_chunk_on_a_full_cache_is_scored_by_its_window_alone(kind, compact):
    make, dim = KINDS[kind]
    cfg = config(prefill_compact=compact)
    cache, rng = make(cfg), np.random.default_rng(1)
    prefill_then_decode(cache, rng, dim)  # "prompt": compacted by the first decode step
    q, keys, kpos, qpos = call(cache, 37, rng, dim)  # odd: partial tiles, pooling edges
    step, seen = window_fold(q, keys, kpos, qpos, dim**-0.5, 8, 5)
    if compact == "chunk":
        assert cache.size() == cfg.max_size
        assert_kept_by(cache, step, kpos, cfg)
    else:  # kept whole until the next decode step (before == max_size: replaced too)
        assert cache.size() == cfg.max_size + 37
    assert_scores(cache, by_position(kpos, step), by_position(kpos, seen))


# --- (b) a shorter chunk adds ---------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_chunk_shorter_than_its_window_adds(kind):
    make, dim = KINDS[kind]
    cache, rng = make(config()), np.random.default_rng(2)
    prefill_then_decode(cache, rng, dim)
    score0, count0 = held(cache)
    # 5 < prefill_window: every query scores it, pooled
    q, keys, kpos, qpos = call(cache, 5, rng, dim)
    step, seen = window_fold(q, keys, kpos, qpos, dim**-0.5, 5, 5)
    assert cache.size() == cache.max_size
    assert_scores(cache, added(score0, by_position(kpos, step)),
                  added(count0, by_position(kpos, seen)))


@pytest.mark.parametrize("decode, replaces", [(4, True), (6, False)])
def test_batch_eviction_counts_held_tokens_only(decode, replaces):
    """evict_batch=4: after 4 decode steps the cache holds max_size again;
    after 6 it holds max_size - 2 and two evicted slots linger past them
    (still attended by decode steps, never scored): not held, so it adds."""
    make, dim = KINDS["dense"]
    cache, rng = make(config(evict_batch=4)), np.random.default_rng(7)
    call(cache, 33, rng, dim)
    for _ in range(decode):
        call(cache, 1, rng, dim)
    assert cache.size() == (24 if replaces else 22)
    score0, count0 = held(cache)
    q, keys, kpos, qpos = call(cache, 37, rng, dim)
    step, seen = window_fold(q, keys, kpos, qpos, dim**-0.5, 8, 5)
    step, seen = by_position(kpos, step), by_position(kpos, seen)
    if not replaces:
        step, seen = added(score0, step), added(count0, seen)
    assert cache.size() == 24
    assert_scores(cache, step, seen)


# --- (c) key-norm scores are the keys' own --------------------------------------------
@pytest.mark.parametrize("compact", ["chunk", "prompt"])
def test_key_norm_scores_are_never_replaced(compact):
    cfg = config(score="key_norm", prefill_compact=compact)
    cache, rng = H2OKVCache(cfg), np.random.default_rng(3)
    prefill_then_decode(cache, rng, 16)
    assert not policy.window_replaces(cfg, 37, cache.size())
    score0, count0 = held(cache)
    q, keys, kpos, qpos = call(cache, 37, rng, 16)
    _, seen = window_fold(q, keys, kpos, qpos, 0.25, 8, 0)
    norms = by_position(kpos, -np.sqrt((keys.astype(np.float64) ** 2).sum(-1)))
    assert_scores(cache, norms, added(count0, by_position(kpos, seen)))
    score1, _ = held(cache)
    assert all(score1[k] == score0[k] for k in score1 if k in score0)  # untouched


# --- (d) the batch cache, row by row --------------------------------------------------
def test_batch_rows_replace_or_add_each_by_its_own_fill():
    cfg = config(max_size=12, heavy_budget=4, prefill_window=4, prefill_pool=3)
    rng, dim = np.random.default_rng(4), 16
    singles = [H2OKVCache(cfg) for _ in range(2)]
    for c, L in zip(singles, (20, 6)):  # row 0 holds max_size, row 1 fewer
        q, k, v = qkv(rng, L, dim, rows=1)
        keys, values = c.update_and_fetch(k * 3, v)
        c.h2o_attention(q, keys, values, scale=0.25, mask="causal")
    batch = BatchH2OKVCache.merge(singles)
    before = [held(c) for c in singles]
    q, k, v = qkv(rng, 9, dim)  # both rows overflow: 21 and 15 tokens
    keys, values = batch.update_and_fetch(k * 3, v)
    kpos = np.array(batch.positions[..., : batch.size()])
    batch.h2o_attention(q, keys, values, scale=0.25, mask=batch.make_mask(9))
    for b, c in enumerate(singles):
        r = slice(b, b + 1)
        step, seen = window_fold(np.array(q[r]), np.array(keys[r]), kpos[r],
                                 np.arange(c.offset, c.offset + 9), 0.25, 4, 3)
        step, seen = by_position(kpos[r], step), by_position(kpos[r], seen)
        if b == 0:  # held max_size: its window alone
            want = step, seen
        else:  # the first chunk to overflow adds
            want = added(before[b][0], step), added(before[b][1], seen)
        ck = c.update_and_fetch(k[r] * 3, v[r])
        c.h2o_attention(q[r], *ck, scale=0.25, mask="causal")
        for cache in (batch.extract(b), c):
            assert cache.size() == cfg.max_size
            assert_scores(cache, *want)


# --- (e) the first chunk to overflow adds; one-chunk prompts as before ----------------
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_first_chunk_to_overflow_adds(kind):
    make, dim = KINDS[kind]
    cache, rng = make(config()), np.random.default_rng(5)
    call(cache, 10, rng, dim)  # fits: every query scores it
    score0, count0 = held(cache)
    q, keys, kpos, qpos = call(cache, 23, rng, dim)  # 33 > max_size, 10 held before
    step, seen = window_fold(q, keys, kpos, qpos, dim**-0.5, 8, 5)
    assert_scores(cache, added(score0, by_position(kpos, step)),
                  added(count0, by_position(kpos, seen)))


@pytest.mark.parametrize("compact", ["chunk", "prompt"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_one_chunk_prompts_are_kept_as_by_adding_windows(monkeypatch, kind, compact):
    make, dim = KINDS[kind]
    cfg = config(prefill_compact=compact)
    new, adding = make(cfg), make(cfg)
    for c, replaces in ((new, policy.window_replaces), (adding, lambda *a: False)):
        monkeypatch.setattr(policy, "window_replaces", replaces)
        rng = np.random.default_rng(6)
        for L in (57, 1, 1, 1, 1):
            call(c, L, rng, dim)
    for x, y in zip(new.state, adding.state):
        np.testing.assert_array_equal(np.array(x), np.array(y))


# --- (f) invariants on random streams where windows replace ---------------------------
window_configs = st.builds(
    lambda m, s, h, w, pool, mode: H2OConfig(
        max_size=m, sink_size=min(s, m - 2), heavy_budget=min(h, m - min(s, m - 2) - 1),
        score=mode, prefill_window=w, prefill_pool=pool),
    st.integers(3, 24), st.integers(0, 4), st.integers(0, 12), st.integers(1, 8),
    st.sampled_from([0, 3, 5]), st.sampled_from(SCORE_MODES),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=window_configs,
       lengths=st.lists(st.integers(1, 30), min_size=1, max_size=25),
       kind=st.sampled_from(sorted(KINDS)), seed=st.integers(0, 2**31 - 1))
def test_invariants_hold_while_windows_replace(cfg, lengths, kind, seed):
    make, dim = KINDS[kind]
    cache, rng, seen = make(cfg), np.random.default_rng(seed), 0
    for L in lengths:
        call(cache, L, rng, dim)
        seen += L
        check_invariants(cache, seen, cfg)  # size, sinks, recent window, offset, unique
