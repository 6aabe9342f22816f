"""Policy: score folding per mode, kept set, victim order, config validation."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_h2o import policy
from mlx_h2o.config import H2OConfig, config_from_dict, config_to_dict
from mlx_h2o.scores import SCORE_MODES, SCORES


def _logits(B, Hq, L, N, rng, mask_p=0.3):
    lg = rng.standard_normal((B, Hq, L, N)).astype(np.float32)
    Hk = 2
    mask = np.repeat(rng.random((B, Hk, L, N)) > mask_p, Hq // Hk, axis=1)
    mask[..., 0] = True  # no empty rows
    lg = np.where(mask, lg, -np.inf)
    lse = np.log(np.exp(lg.astype(np.float64)).sum(-1))
    return lg, lse, mask


@pytest.mark.parametrize("mode", SCORE_MODES)
def test_fold_scores_matches_numpy(mode):
    spec = SCORES[mode]
    rng = np.random.default_rng()
    B, Hq, Hk, L, N = 2, 6, 2, 5, 11
    lg, lse, mask = _logits(B, Hq, L, N, rng)
    score = rng.random((B, Hk, N)).astype(np.float32)
    count = rng.integers(0, 3, (B, Hk, N)).astype(np.float32)
    s, c = policy.fold_scores(
        mode, mx.array(score), mx.array(count), mx.array(lg), mx.array(lse, dtype=mx.float32), 0.9
    )
    G = Hq // Hk
    vis = mask.reshape(B, Hk, G, L, N)[:, :, 0]
    seen = vis.sum(axis=2)
    if spec.magnitude == "abs_logit":
        mag = np.where(mask, np.abs(lg), 0)
    else:  # probability
        mag = np.exp(lg - lse[..., None])
    step = mag.reshape(B, Hk, G, L, N).mean(2).sum(2)
    if spec.fold == "ema":
        step = step / np.maximum(seen, 1)
        ema = np.where(count > 0, 0.9 * score + 0.1 * step, step)
        want = np.where(seen > 0, ema, score)
    elif spec.fold == "last":  # this call's mean over the queries that saw the key
        want = np.where(seen > 0, step / np.maximum(seen, 1), score)
    elif spec.fold == "fixed":  # set when the key was written; attention leaves it
        want = score
    else:  # sum
        want = score + step
    np.testing.assert_allclose(np.array(s), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.array(c), count + seen)
    ev = np.array(policy.eviction_score(mode, s, c))
    expect = want / np.maximum(count + seen, 1) if spec.rank == "per_query" else want
    np.testing.assert_allclose(ev, expect, rtol=1e-5, atol=1e-6)


def _kept_bruteforce(score, pos, offset, cfg):
    """Sinks + recent + pinned, then top-h by score (ties: newer position wins)."""
    prot = (pos < cfg.sink_size) | (pos >= offset - cfg.recent_budget)
    for s, e in cfg.pinned:
        prot |= (pos >= s) & (pos < e)
    rest = sorted(np.flatnonzero(~prot), key=lambda i: (score[i], pos[i]))
    n_heavy = cfg.max_size - prot.sum()
    return set(pos[prot].tolist()) | set(pos[rest[len(rest) - n_heavy :]].tolist())


@pytest.mark.parametrize("seed", range(20))
def test_select_keep_is_sinks_recent_pinned_top_h(seed):
    rng = np.random.default_rng(seed)
    cfg = H2OConfig(max_size=16, sink_size=3, heavy_budget=7, pinned=((10, 12),))
    N, offset = 40, 40
    pos = rng.permutation(N).astype(np.int32)
    # Coarse scores so ties happen and the tie-break is exercised.
    score = rng.integers(0, 4, N).astype(np.float32)
    keep = policy.protected(mx.array(pos), offset, cfg.sink_size, cfg.recent_budget, cfg.pinned)
    pri = policy.priority(mx.array(score), keep, mx.array(pos), offset)
    slots = np.array(policy.select_keep(pri[None, None], mx.array(pos)[None, None], 16))[0, 0]
    kept = pos[slots]
    assert list(kept) == sorted(kept), "kept slots come back in position order"
    assert set(kept.tolist()) == _kept_bruteforce(score, pos, offset, cfg)


def test_victim_is_lowest_score_then_oldest():
    score = mx.array([[[3.0, 1.0, 1.0, 5.0, 1.0]]])
    pos = mx.array([[[10, 7, 4, 2, 9]]])
    keep = mx.array([[[False, False, False, False, True]]])
    pri = policy.priority(score, keep, pos, offset=20)
    assert policy.select_victim(pri, pos).item() == 2  # score 1.0 at position 4
    # A sliding window makes invisible tokens the first victims, whatever their score.
    pri = policy.priority(score, keep, pos, offset=20, window_size=12)
    assert policy.select_victim(pri, pos).item() == 3  # position 2 <= 20 - 1 - 12


def test_config_derives_and_validates():
    c = H2OConfig(max_size=256)
    assert (c.sink_size, c.heavy_budget, c.recent_budget) == (4, 126, 126)
    assert H2OConfig(max_size=256, heavy_budget=128).recent_budget == 124
    assert H2OConfig(max_size=256, recent_budget=220).heavy_budget == 32
    assert config_from_dict(config_to_dict(c)) == c
    bad = [
        (dict(max_size=10, heavy_budget=5, recent_budget=5), "must equal max_size"),
        (dict(max_size=4, sink_size=4), "no room"),
        (dict(max_size=10, sink_size=2, heavy_budget=8), "recent_budget must be >= 1"),
        (dict(max_size=10, score="magic"), "score mode"),
        (dict(max_size=10, ema_alpha=1.0), "ema_alpha"),
        (dict(max_size=10, heavy_budget=2, pinned=((0, 5),)), "exceed heavy_budget"),
        (dict(max_size=10, pinned=((5, 3),)), "start < end"),
        (dict(max_size=20, pinned=((1, 5), (4, 6))), "overlap"),
        (dict(max_size=0), ">= 1"),
    ]
    for kwargs, msg in bad:
        with pytest.raises(ValueError, match=msg):
            H2OConfig(**kwargs)
    with pytest.raises(TypeError):
        H2OConfig(max_size=10.5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_keep_then_evict_splits_as_select_keep(seed):
    """Every slot once; the first k are select_keep's slots (ties in score
    broken by position, as there), best first; then the evicted, worst first."""
    rng = np.random.default_rng(seed)
    n, k = 37, 20
    score = rng.integers(0, 6, (2, 3, n)).astype(np.float32)  # many ties
    score[..., :3] = np.inf  # protected
    pos = np.stack([rng.permutation(100)[:n] for _ in range(6)]).reshape(2, 3, n)
    pri, p = mx.array(score), mx.array(pos.astype(np.int32))
    order = np.array(policy.keep_then_evict(pri, p, k))
    keep = np.array(policy.select_keep(pri, p, k))
    for b in range(2):
        for h in range(3):
            assert sorted(order[b, h]) == list(range(n))
            assert set(order[b, h, :k]) == set(keep[b, h])
            rank = [(score[b, h, s], pos[b, h, s]) for s in order[b, h]]
            assert rank[:k] == sorted(rank[:k], reverse=True)
            assert rank[k:] == sorted(rank[k:]) and rank[k] < rank[k - 1]


def test_chunk_fold_decides_a_chunks_scoring_once():
    """policy.chunk_fold, the one place both caches read a prompt chunk's
    decisions from: a chunk that fits is scored by every query and neither
    pooled nor compacted; one that overflows is scored by its window,
    pooled only when more than one query row stands behind its scores, and
    compacted under "chunk" alone."""
    cfg = H2OConfig(max_size=64, prefill_window=8, prefill_pool=5)
    fits = policy.chunk_fold(cfg, 40, 20)
    assert (fits.over, fits.scored, fits.pool, fits.replace, fits.compact) == (
        False, 40, 0, False, False)
    first = policy.chunk_fold(cfg, 40, 30)  # overflows while below the budget
    assert (first.over, first.scored, first.pool, first.replace, first.compact) == (
        True, 8, 5, False, True)
    later = policy.chunk_fold(cfg, 40, 64)  # the budget was full: its window decides
    assert later.replace and later.scored == 8
    one = policy.chunk_fold(H2OConfig(max_size=64, prefill_window=1, prefill_pool=5), 40, 30)
    assert (one.scored, one.pool) == (1, 0)
    prompt = policy.chunk_fold(H2OConfig(max_size=64, prefill_compact="prompt"), 40, 30)
    assert prompt.over and not prompt.compact
    ea = H2OConfig(max_size=64, prefill_window=8, score="expected_attention")
    assert policy.chunk_fold(ea, 40, 30).expected and policy.chunk_fold(ea, 40, 30).weight == 8
    assert not policy.chunk_fold(ea, 40, 30, window_size=16).expected  # sliding layer
    assert policy.chunk_fold(cfg, 1, 64).over is False  # a decode token is no chunk
