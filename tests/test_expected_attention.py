"""The expected-attention score mode (Devoto et al. 2025) against float64 NumPy.

A prompt chunk of L > W > 1 tokens (W = prefill_window) that overflows the
budget adds ``W * p`` to each slot's score: ``p`` the group-mean softmax of
``z = s mu.k + s^2 / 2 k^T Sigma k`` (mu, Sigma: the mean and covariance of
the chunk's last W queries per query head) over the keys its last query
sees, max-pooled over ``prefill_pool`` positions; everything else is
``accumulated``. The reference below builds Sigma explicitly, in float64.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache

import mlx_h2o
from mlx_h2o import H2OConfig, H2OKVCache, make_h2o_cache, policy
from mlx_h2o.cache import QuantConfig, quantized_cache_type
from mlx_h2o.cache.batch_cache import BatchH2OKVCache
from mlx_h2o.cache.decode import KINDS
from mlx_h2o.cli import ppl
from mlx_h2o.cli.common import strategies_or_fail
from mlx_h2o.config import config_to_dict
from mlx_h2o.kernels import scaled_dot_product_attention_with_scores
from tiny_models import VOCAB, tiny_llama

pytestmark = pytest.mark.usefixtures("on_cpu")
B, HQ, HK, D = 2, 6, 2, 64  # GQA: 3 query heads a KV head; two 32-value groups (q8)
# float32 dot products of D ~ 64 unit-scale terms against float64: ~1e-6
# relative; logits, scores and probabilities here are O(1) to O(10).
TOL = dict(rtol=2e-5, atol=2e-6)


# --- float64 references ------------------------------------------------------------
def ref_expected(q, k, scale, mask=None, sinks=None):
    """(z (B, Hq, 1, N), lse (B, Hq, 1)) in float64, Sigma as a (D, D) matrix."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    W, g = q.shape[2], q.shape[1] // k.shape[1]
    kk = np.repeat(k, g, axis=1)  # (B, Hq, N, D)
    mu = q.mean(axis=2)
    c = q - mu[:, :, None]
    sigma = np.einsum("bhwi,bhwj->bhij", c, c) / W
    z = (scale * np.einsum("bhd,bhnd->bhn", mu, kk)
         + 0.5 * scale**2 * np.einsum("bhni,bhij,bhnj->bhn", kk, sigma, kk))[:, :, None]
    if mask is not None:
        m = np.asarray(mask)
        if m.shape[1] not in (1, z.shape[1]):  # one mask per KV head
            m = np.repeat(m, g, axis=1)
        z = np.where(m, z, -np.inf) if m.dtype == bool else z + m
    cols = [z]
    if sinks is not None:
        cols.append(np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None],
                                    (*z.shape[:3], 1)))
    return z, np.logaddexp.reduce(np.concatenate(cols, axis=-1), axis=-1)


def ref_pool(x, positions, radius):
    """Max of x over slots within ``radius`` positions (policy.pool_neighbours)."""
    near = np.abs(positions[..., :, None] - positions[..., None, :]) <= radius
    return np.where(near, x[..., None, :], 0.0).max(axis=-1)


def ref_fold(cfg, q, k, scale, positions, score, count, mask=None, sinks=None):
    """Scores and counts after an overflowing chunk: + W * group-mean p (pooled)."""
    W, g = cfg.prefill_window, q.shape[1] // k.shape[1]
    z, lse = ref_expected(q[:, :, -W:], k, scale, mask, sinks)
    p = np.exp(z - lse[..., None])[:, :, 0]  # (B, Hq, N)
    step = W * p.reshape(*score.shape[:2], g, -1).mean(axis=2)
    step = ref_pool(step, positions, cfg.prefill_pool // 2)
    seen = np.isfinite(z[:, ::g, 0])  # visibility: the group's first head
    return score + step, count + W * seen


def ref_keep(cfg, positions, score, T):
    """Per (row, KV head): the slots a compaction keeps (policy.select_keep)."""
    keep = (positions < cfg.sink_size) | (positions >= T - cfg.recent_budget)
    pri = np.where(keep, np.inf, score)
    order = np.lexsort((positions, pri), axis=-1)  # ascending (priority, position)
    return np.sort(order[..., -cfg.max_size:], axis=-1)


# --- helpers -------------------------------------------------------------------------
def make_cache(storage, cfg, kind="auto"):
    quant = {"dense": None, "q8": QuantConfig(8, 32),
             "mixed": QuantConfig(8, 32, recent_bits=4)}[storage]
    return quantized_cache_type(quant)(cfg, decode=kind)


def slot_state(cache):
    """(positions, score, count) of the held slots, in slot order."""
    n = cache.size()
    return tuple(np.array(a[..., :n])
                 for a in (cache.positions, cache.score, cache.count))


def in_position_order(pos, *arrays):
    order = np.argsort(pos, axis=-1)
    return tuple(np.take_along_axis(a, order, axis=-1) for a in (pos, *arrays))


def by_position(cache):
    """(positions, score, count) of the held slots, each row in position order."""
    return in_position_order(*slot_state(cache))


def inputs(rng, L):
    """Random (queries, keys, values) of L tokens."""
    return [mx.array(rng.standard_normal((B, h, L, D)).astype(np.float32))
            for h in (HQ, HK, HK)]


def config(**kw):
    return H2OConfig(**{**dict(max_size=23, sink_size=3, heavy_budget=9,
                               score="expected_attention", prefill_window=6,
                               prefill_pool=3), **kw})


# --- tests ---------------------------------------------------------------------------
@pytest.mark.parametrize("dim,W,N", [(64, 6, 97), (33, 31, 257), (64, 1, 5)])
@pytest.mark.parametrize("masking", ["none", "causal", "padded", "additive",
                                     "per_kv_head", "sinks"])
def test_expected_logits_match_float64(dim, W, N, masking):
    rng = np.random.default_rng(dim + W + N)
    q = rng.standard_normal((B, HQ, W, dim)).astype(np.float32)
    k = (rng.standard_normal((B, HK, N, dim)) * 1.5).astype(np.float32)
    mask, ref_mask, sinks, scale = None, None, None, dim**-0.5
    if masking == "causal":  # one row, bottom-right aligned: every key
        mask = "causal"
    elif masking == "padded":  # left padding of row 1
        ref_mask = np.ones((B, 1, 1, N), bool)
        ref_mask[1, ..., :3] = False
    elif masking == "additive":
        ref_mask = (rng.standard_normal((B, 1, 1, N)) * 2).astype(np.float32)
    elif masking == "per_kv_head":
        ref_mask = rng.random((B, HK, 1, N)) < 0.7
        ref_mask[..., -1] = True
    elif masking == "sinks":
        sinks = rng.standard_normal(HQ).astype(np.float32) * 3
    if ref_mask is not None:
        mask = mx.array(ref_mask)
    got = policy.expected_logits(mx.array(q), mx.array(k), scale, mask,
                                 None if sinks is None else mx.array(sinks))
    z, lse = ref_expected(q, k, scale, ref_mask, sinks)
    assert got[0].shape == (B, HQ, 1, N) and got[1].shape == (B, HQ, 1)
    assert got[0].dtype == mx.float32
    np.testing.assert_array_equal(np.isinf(np.array(got[0])), np.isinf(z))
    np.testing.assert_allclose(np.array(got[0]), z, **TOL)
    np.testing.assert_allclose(np.array(got[1]), lse, **TOL)
    if W == 1:  # Sigma = 0: a one-query window expects that query's attention
        _, logits, own_lse = scaled_dot_product_attention_with_scores(
            mx.array(q), mx.array(k), mx.array(k), scale=scale, mask=mask,
            sinks=None if sinks is None else mx.array(sinks))
        np.testing.assert_allclose(np.array(got[0]), np.array(logits), **TOL)
        np.testing.assert_allclose(np.array(got[1]), np.array(own_lse), **TOL)


STREAM = [37, 13, 1, 1, 1, 12, 4, 1]  # overflowing chunks, decode, a chunk <= W


@pytest.mark.parametrize("compact", ["chunk", "prompt"])
@pytest.mark.parametrize("storage", ["dense", "q8", "mixed"])
def test_chunk_scores_match_float64_reference(storage, compact):
    """Exported slot scores and counts after every overflowing chunk (kept set
    and scores after a chunk compaction, every slot under prompt compaction;
    a later chunk on a full cache replaces them by its own window's,
    policy.window_replaces), against ref_fold / ref_keep."""
    cfg = config(prefill_compact=compact)
    cache, rng = make_cache(storage, cfg), np.random.default_rng(1)
    W = cfg.prefill_window
    checked = 0
    for L in STREAM:
        q, k, v = inputs(rng, L)
        before = None if cache.empty() else slot_state(cache)
        n0 = cache.size()
        keys, values = cache.update_and_fetch(k, v)
        scored = L > W and cache.size() > cfg.max_size
        if scored:  # the keys attention reads, as the cache's storage holds them
            dense = np.array(cache.kv.dense(keys, values, mx.float32)[0])
            pos = np.array(cache.positions[..., : cache.size()])
            score = np.zeros(pos.shape)
            count = np.zeros(pos.shape)
            if before is not None and not policy.window_replaces(cfg, L, n0):
                assert (pos[..., :n0] == before[0]).all()  # the chunk is appended
                score[..., :n0], count[..., :n0] = before[1], before[2]
            score, count = ref_fold(cfg, np.array(q), dense, 0.125, pos, score, count)
        cache.h2o_attention(q, keys, values, scale=0.125, mask="causal")
        if not scored:
            continue
        checked += 1
        if compact == "chunk":
            kept = ref_keep(cfg, pos, score, cache.offset)
            pos, score, count = (np.take_along_axis(a, kept, -1)
                                 for a in (pos, score, count))
        got = by_position(cache)
        pos, score, count = in_position_order(pos, score, count)
        np.testing.assert_array_equal(got[0], pos)
        np.testing.assert_allclose(got[1], score, **TOL)
        np.testing.assert_allclose(got[2], count, **TOL)
    assert checked == 3 and cache.offset == sum(STREAM)
    assert cache.size() <= cfg.max_size or compact == "prompt"


def test_array_mask_and_sinks_take_the_last_row():
    """A model's (B, 1, L, N) bool mask (row 1's first slots padding) and
    attention sinks: z over what the chunk's last query sees, sinks a column."""
    cfg = config(max_size=16, prefill_compact="prompt")
    cache, rng = H2OKVCache(cfg), np.random.default_rng(2)
    q, k, v = inputs(rng, 30)
    mask = np.tril(np.ones((30, 30), bool))[None, None].repeat(B, 0)
    mask[1, :, :, :4] = False
    sinks = rng.standard_normal(HQ).astype(np.float32)
    keys, values = cache.update_and_fetch(k, v)
    cache.h2o_attention(q, keys, values, scale=0.125, mask=mx.array(mask),
                        sinks=mx.array(sinks))
    pos = np.array(cache.positions[..., :30])
    zero = np.zeros(pos.shape)
    score, count = ref_fold(cfg, np.array(q), np.array(k), 0.125, pos, zero, zero,
                            mask[:, :, -1:], sinks)
    np.testing.assert_allclose(np.array(cache.score[..., :30]), score, **TOL)
    np.testing.assert_allclose(np.array(cache.count[..., :30]), count, **TOL)
    # Padding draws nothing (slot 3 takes slot 4's pooled score: prefill_pool=3).
    assert (np.array(cache.score[1, :, :3]) == 0).all()


def transplant(cache, storage, kind, score):
    """A cache of another score mode holding ``cache``'s state."""
    cfg = H2OConfig(**{**config_to_dict(cache.config), "score": score})
    other = make_cache(storage, cfg, kind)
    meta = list(cache.meta_state)
    meta[4] = json.dumps(config_to_dict(cfg))
    other.meta_state = meta
    other.state = cache.state
    return other


@pytest.mark.parametrize("compact", ["chunk", "prompt"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("storage", ["dense", "q8", "mixed"])
def test_decode_steps_after_a_chunk_are_accumulated(storage, kind, compact):
    """From the state an overflowing chunk left, decode steps and a short
    chunk fold exactly as accumulated's."""
    cfg = config(prefill_compact=compact)
    cache, rng = make_cache(storage, cfg, kind), np.random.default_rng(3)
    q, k, v = inputs(rng, 37)
    cache.h2o_attention(q, *cache.update_and_fetch(k, v), scale=0.125, mask="causal")
    acc = transplant(cache, storage, kind, "accumulated")
    for L in [1] * 9 + [5] + [1] * 6:
        q, k, v = inputs(rng, L)
        outs = [np.array(c.h2o_attention(q, *c.update_and_fetch(k, v), scale=0.125,
                                         mask=c.make_mask(L)))
                for c in (cache, acc)]
        np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6)
        a, b = by_position(cache), by_position(acc)
        np.testing.assert_array_equal(a[0], b[0])
        for x, y in zip(a[1:], b[1:]):
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    assert cache.offset == acc.offset and cache.evicted == acc.evicted > 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("storage", ["dense", "q8", "mixed"])
def test_invariants_over_a_stream(storage, kind):
    """Size bound, sinks and recent window kept, offset monotone, positions unique."""
    cfg = config()
    cache, rng, seen = make_cache(storage, cfg, kind), np.random.default_rng(4), 0
    for L in [29, 1, 1, 17, 1, 3, 1, 1, 40, 1, 1, 1, 8, 1]:
        q, k, v = inputs(rng, L)
        offset = cache.offset
        cache.h2o_attention(q, *cache.update_and_fetch(k, v), scale=0.125,
                            mask=cache.make_mask(L))
        seen += L
        assert cache.offset == seen > offset
        assert cache.size() == min(seen, cfg.max_size)
        pos = by_position(cache)[0].reshape(-1, cache.size())
        for row in pos:
            assert len(set(row.tolist())) == len(row)
            assert set(range(min(cfg.sink_size, seen))) <= set(row.tolist())
            recent = range(max(seen - cfg.recent_budget, 0), seen)
            assert set(recent) <= set(row.tolist())


@pytest.mark.parametrize("padding", ["left", "right"])
def test_batch_cache_rows_match_single_caches(padding):
    """BatchH2OKVCache (B=2, one row padded): each row keeps what an
    H2OKVCache fed that row alone keeps, with the same scores."""
    cfg = config()
    rng, lengths = np.random.default_rng(5), [[37, 1, 1, 13, 1], [30, 1, 1, 13, 1]]
    batch = BatchH2OKVCache(cfg, B, left_padding=[0, 7] if padding == "left" else None)
    singles = [H2OKVCache(cfg) for _ in range(B)]
    for step, (l0, l1) in enumerate(zip(*lengths)):
        L = max(l0, l1)
        q, k, v = inputs(rng, L)
        if padding == "right" and l0 != l1:
            batch.prepare(lengths=[l0, l1], right_padding=[L - l0, L - l1])
        batch.h2o_attention(q, *batch.update_and_fetch(k, v), scale=0.125,
                            mask="causal")
        if padding == "right" and l0 != l1:
            batch.finalize()
        for b, (c, n) in enumerate(zip(singles, (l0, l1))):
            lo = L - n if padding == "left" else 0
            sl = (slice(b, b + 1), slice(None), slice(lo, lo + n))
            c.h2o_attention(q[sl], *c.update_and_fetch(k[sl], v[sl]), scale=0.125,
                            mask=c.make_mask(n))
        pos, score, count = (np.array(a[..., : batch.size()])
                             for a in (batch.positions, batch.score, batch.count))
        for b, c in enumerate(singles):
            want = by_position(c)
            for h in range(HK):
                held = pos[b, h] >= 0
                got = in_position_order(pos[b, h][held], score[b, h][held],
                                        count[b, h][held])
                np.testing.assert_array_equal(got[0], want[0][0, h])
                for x, y in zip(got[1:], want[1:]):
                    np.testing.assert_allclose(x, y[0, h], **TOL)
    assert batch.kept == [cfg.max_size] * B


@pytest.mark.parametrize("chunk", [None, 7])
def test_outputs_equal_kvcache_within_budget(chunk):
    """Never past the budget: logits as mlx-lm's KVCache gives them (up to
    the reference attention's float32 rounding, as test_integration)."""
    model = tiny_llama()
    tokens = mx.random.randint(0, VOCAB, (2, 40), key=mx.random.key(6))

    def run(cache):
        outs, step = [], chunk or 23
        with mlx_h2o.patch():
            for s in range(0, 23, step):
                outs.append(model(tokens[:, s : min(s + step, 23)], cache=cache))
            for t in range(23, 40):
                outs.append(model(tokens[:, t : t + 1], cache=cache))
        return mx.concatenate(outs, axis=1)

    ref = run([KVCache() for _ in model.layers])
    got = run(make_h2o_cache(model, config(max_size=40, prefill_window=4)))
    np.testing.assert_allclose(np.array(got), np.array(ref), atol=2e-4, rtol=1e-4)
    assert mx.array_equal(got.argmax(-1), ref.argmax(-1))


def _recording(cache, log):
    """``cache`` whose h2o_attention also logs (queries, keys, held state)."""
    attend = cache.h2o_attention

    def record(queries, keys, values, **kw):
        out = attend(queries, keys, values, **kw)
        if queries.shape[2] > 1:
            log.append((np.array(queries), np.array(keys), by_position(cache)))
        return out

    cache.h2o_attention = record
    return cache


def test_tiny_llama_decodes_through_generate_step():
    """mlx-lm's generate_step: the prompt chunk is scored by its window's
    expected attention (post-RoPE queries, as the model hands them) and
    compacted; decoding stays bounded."""
    model = tiny_llama()
    cfg = H2OConfig(max_size=16, sink_size=2, heavy_budget=6, prefill_window=8,
                    prefill_pool=3, score="expected_attention")
    logs = [[] for _ in model.layers]
    caches = make_h2o_cache(model, cfg, layer_budget="uniform")
    cache = [_recording(c, log) for c, log in zip(caches, logs)]
    prompt = mx.array(np.random.default_rng(7).integers(0, VOCAB, 29))
    with mlx_h2o.patch():
        steps = generate_step(prompt, model, prompt_cache=cache)
        tokens = [t for (t, _), _ in zip(steps, range(12))]
    assert len(tokens) == 12
    scale = model.layers[0].self_attn.scale
    for c, log in zip(cache, logs):
        (q, k, got), = log  # one prompt chunk of 28 (the 29th token: the first step)
        pos = np.broadcast_to(np.arange(k.shape[2]), k.shape[:3])
        zero = np.zeros(pos.shape)
        score, count = ref_fold(cfg, q, k, scale, pos, zero, zero)
        kept = ref_keep(cfg, pos, score, k.shape[2])
        np.testing.assert_array_equal(got[0], np.take_along_axis(pos, kept, -1))
        np.testing.assert_allclose(got[1], np.take_along_axis(score, kept, -1), **TOL)
        # generate_step computes a token ahead of the one it yields
        assert c.offset >= 29 + 11 and c.size() == cfg.max_size and c.evicted > 0


def test_strategy_name_parses_on_the_command_line():
    parser = ppl.setup_arg_parser()
    args = parser.parse_args(["--strategies", "h2o-heavy-ea", "h2o-ea:sink=2"])
    strategies = strategies_or_fail(parser, args.strategies)
    assert [s.h2o_config(256).score for s in strategies] == ["expected_attention"] * 2
    assert strategies[0].h2o_config(256).heavy_budget == 128
