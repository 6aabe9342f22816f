"""The key-norm score mode (Devoto et al. 2024) against a float64 NumPy reference.

A slot's score is ``-||k||_2`` of its key, set when the key is written and
never changed by attention, so the kept set has a closed form: once a cache
holds ``max_size`` tokens it keeps the sinks, the recent window and the
``heavy_budget`` lowest-norm keys of the rest (equal norms: the newer one).
Every storage, decode step and the batch cache must keep exactly that set.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import mlx_h2o
from mlx_h2o import H2OConfig, H2OKVCache, make_h2o_cache, policy
from mlx_h2o.cache import QuantConfig, quantized_cache_type
from mlx_h2o.cache.batch_cache import BatchH2OKVCache
from mlx_h2o.cache.decode import KINDS
from mlx_h2o.cache.decode.deferred import DeferredFill
from mlx_h2o.cli import ppl
from mlx_h2o.cli.common import strategies_or_fail
from tiny_models import VOCAB, tiny_llama

pytestmark = pytest.mark.usefixtures("on_cpu")
B, HQ, HK, D = 2, 6, 2, 64  # GQA: 3 query heads a KV head; two 32-value groups (q8)
# Odd chunk lengths: an overflowing prompt, decode past the budget, another
# overflowing chunk, more decode.
STREAM = [37] + [1] * 6 + [13] + [1] * 21 + [7] + [1] * 9


def reference_kept(keys: np.ndarray, cfg: H2OConfig) -> list:
    """Per (row, KV head), the sorted positions a key-norm cache keeps after
    the T tokens of ``keys`` (B, Hk, T, D) float64: all of them while T <=
    max_size; else sinks, the recent window and the heavy_budget lowest norms
    of the rest, the newer key first among equal norms."""
    T = keys.shape[2]
    norm = np.sqrt((keys**2).sum(-1))  # (B, Hk, T)
    out = []
    for row in norm.reshape(-1, T):
        if T <= cfg.max_size:
            out.append(list(range(T)))
            continue
        safe = set(range(cfg.sink_size)) | set(range(T - cfg.recent_budget, T))
        rest = sorted((p for p in range(T) if p not in safe), key=lambda p: (row[p], -p))
        out.append(sorted(safe | set(rest[: cfg.heavy_budget])))
    return out


def stream_keys(T: int, ties: bool, seed: int) -> np.ndarray:
    """(B, Hk, T, D) float32 keys. Distinct: random directions whose norms are
    a permutation of 1, 1.05, 1.1, ... per row (every row its own order).
    Ties: signed one-hot keys of norm 1, 1.25, 1.5 or 1.75, exact in float32."""
    rng = np.random.default_rng(seed)
    if ties:
        keys = np.zeros((B, HK, T, D), np.float32)
        hot = rng.integers(0, D, (B, HK, T))
        norms = 1 + 0.25 * rng.integers(0, 4, (B, HK, T))
        signed = norms * rng.choice([-1, 1], norms.shape)
        np.put_along_axis(keys, hot[..., None], signed[..., None], -1)
        return keys
    direction = rng.standard_normal((B, HK, T, D))
    direction /= np.linalg.norm(direction, axis=-1, keepdims=True)
    norms = 1 + 0.05 * np.stack([rng.permutation(T) for _ in range(B * HK)])
    norms = norms.reshape(B, HK, T)
    return (direction * norms[..., None]).astype(np.float32)


def make_cache(storage: str, cfg: H2OConfig, kind: str = "auto"):
    quant = {"dense": None, "q8": QuantConfig(8, 32),
             "mixed": QuantConfig(8, 32, recent_bits=4)}[storage]
    return quantized_cache_type(quant)(cfg, decode=kind)


def held(cache) -> list:
    pos = np.array(cache.positions[..., : cache.size()])
    return [sorted(r.tolist()) for r in pos.reshape(-1, pos.shape[-1])]


def play(cache, keys, seed=0, check=None):
    """Feed STREAM with ``keys`` (random queries and values); ``check(T)``
    after every call, T the tokens seen."""
    rng, start = np.random.default_rng(seed + 1), 0
    for L in STREAM:
        q, v = (mx.array(rng.standard_normal((B, h, L, D)).astype(np.float32))
                for h in (HQ, HK))
        mask = cache.make_mask(L)
        k, vv = cache.update_and_fetch(mx.array(keys[:, :, start : start + L]), v)
        mx.eval(cache.h2o_attention(q, k, vv, scale=D**-0.5, mask=mask))
        start += L
        if check is not None:
            check(start, L)


CONFIG = dict(max_size=23, sink_size=3, heavy_budget=9, score="key_norm",
              prefill_window=4, prefill_pool=3)  # neither applies to key_norm


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("compact", ["chunk", "prompt"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("storage", ["dense", "q8", "mixed"])
def test_kept_slots_match_float64_reference(storage, kind, compact, ties):
    cfg = H2OConfig(**CONFIG, prefill_compact=compact)
    keys = stream_keys(sum(STREAM), ties, seed=3)
    cache = make_cache(storage, cfg, kind)
    offsets = []

    def check(T, L):
        offsets.append(cache.offset)
        if compact == "prompt" and L > 1 and T > cfg.max_size:
            return  # held whole until the first decode step compacts it
        assert cache.size() == min(T, cfg.max_size)
        want = reference_kept(keys[:, :, :T].astype(np.float64), cfg)
        assert held(cache) == want, f"T={T}"
        # The scores are the kept keys' -||k||, set at write and never folded.
        pos = np.array(cache.positions[..., : cache.size()])
        norm = np.linalg.norm(keys.astype(np.float64), axis=-1)  # (B, Hk, T)
        want = -np.take_along_axis(norm, pos, axis=-1)
        np.testing.assert_allclose(np.array(cache.score[..., : cache.size()]), want,
                                   rtol=1e-6)

    play(cache, keys, check=check)
    assert offsets == list(np.cumsum(STREAM))
    assert cache.evicted == cache.offset - cfg.max_size
    if not ties:  # the rows (and KV heads) kept different tokens
        assert len({tuple(r) for r in held(cache)}) == B * HK


def simulate_batched(cfg: H2OConfig, norm: np.ndarray) -> list:
    """Batched eviction in float64 for one row of decode tokens with key norms
    ``norm`` (T,): kept positions after each token. A full cache keeps its
    ``max_size - evict_batch`` best slots (sinks and the recent window counting
    the incoming token protected; the largest norm, then the older, goes first)."""
    kept, out = [], []
    for t in range(len(norm)):
        if len(kept) >= cfg.max_size:
            safe = [p for p in kept
                    if p < cfg.sink_size or p >= t + 1 - cfg.recent_budget]
            rest = sorted((p for p in kept if p not in safe), key=lambda p: (-norm[p], p))
            kept = sorted(safe + rest[cfg.evict_batch:])
        kept.append(t)
        out.append(list(kept))
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("storage", ["dense", "q8"])
def test_batched_eviction_matches_float64_simulation(storage, kind):
    cfg = H2OConfig(max_size=17, sink_size=2, heavy_budget=8, score="key_norm",
                    evict_batch=4)
    T = 61
    keys = stream_keys(T, False, seed=7)
    norm = np.linalg.norm(keys.astype(np.float64), axis=-1).reshape(B * HK, T)
    want = [simulate_batched(cfg, row) for row in norm]
    cache, rng = make_cache(storage, cfg, kind), np.random.default_rng(8)
    for t in range(T):
        q, v = (mx.array(rng.standard_normal((B, h, 1, D)).astype(np.float32))
                for h in (HQ, HK))
        k, vv = cache.update_and_fetch(mx.array(keys[:, :, t : t + 1]), v)
        mx.eval(cache.h2o_attention(q, k, vv, scale=D**-0.5, mask=None))
        assert held(cache) == [w[t] for w in want], f"token {t}"


def test_batch_cache_rows_match_float64_reference():
    """BatchH2OKVCache: each row keeps its own keys' reference set."""
    cfg = H2OConfig(**CONFIG)
    keys = stream_keys(sum(STREAM), False, seed=4)
    batch = BatchH2OKVCache(cfg, B)

    def check(T, L):
        pos = np.array(batch.positions[..., : batch.size()])
        rows = [sorted(p[p >= 0].tolist()) for p in pos.reshape(-1, pos.shape[-1])]
        assert rows == reference_kept(keys[:, :, :T].astype(np.float64), cfg), f"T={T}"
        assert batch.kept == [min(T, cfg.max_size)] * B

    play(batch, keys, check=check)


def test_score_is_the_incoming_float_key_norm():
    """float16 keys whose squares overflow float16; 0.0 for attention modes."""
    k = (np.random.default_rng(5).standard_normal((1, 2, 3, 64)) * 300).astype(np.float16)
    got = policy.written_score("key_norm", mx.array(k))
    want = -np.linalg.norm(k.astype(np.float64), axis=-1)
    assert got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), want, rtol=1e-6)
    assert policy.written_score("accumulated", mx.array(k)) == 0.0


def test_decode_steps_take_the_op_by_op_fold():
    """No kernel folds key norms: a GPU cache ("fused") attends with the
    kernel where it can and folds by the reference; no score queue, no group."""
    cfg = H2OConfig(max_size=16, score="key_norm")
    for storage in ("dense", "q8"):
        cache = make_cache(storage, cfg, "fused")
        assert (cache.decode.fuse, cache.decode.fold_kernel) == (False, False)
        assert cache.decode.find(DeferredFill) is None and not cache.groupable()


def _recording(cache, log):
    """``cache`` whose update_and_fetch also logs the keys it is given."""
    update = cache.update_and_fetch

    def record(keys, values):
        log.append(np.array(keys.astype(mx.float32)))
        return update(keys, values)

    cache.update_and_fetch = record
    return cache


def test_tiny_llama_decodes_through_generate_step():
    """mlx-lm's generate_step with key-norm caches: bounded, evicting, and each
    layer keeps the reference set of the keys the model handed its cache
    (after RoPE)."""
    model = tiny_llama()
    cfg = H2OConfig(max_size=16, sink_size=2, heavy_budget=6, score="key_norm")
    logs = [[] for _ in model.layers]
    cache = [_recording(c, log)
             for c, log in zip(make_h2o_cache(model, cfg, layer_budget="uniform"), logs)]
    prompt = mx.array(np.random.default_rng(6).integers(0, VOCAB, 29))
    with mlx_h2o.patch():
        tokens = [t for (t, _), _ in zip(generate_step(prompt, model, prompt_cache=cache),
                                         range(12))]
    assert len(tokens) == 12
    for c, log in zip(cache, logs):
        keys = np.concatenate(log, axis=2).astype(np.float64)
        assert c.offset == keys.shape[2] and c.size() == cfg.max_size
        norm = np.linalg.norm(keys, axis=-1).reshape(-1, keys.shape[2])
        for row, got, want in zip(norm, held(c), reference_kept(keys, cfg)):
            # RoPE keeps norms, so a repeated token's keys tie up to float32
            # rounding (~1e-7): such keys may swap at the boundary, no others.
            heavy = [p for p in want if cfg.sink_size <= p < len(row) - cfg.recent_budget]
            edge = max(row[p] for p in heavy)
            swapped = set(got) ^ set(want)
            assert all(abs(row[p] - edge) <= 1e-6 * edge for p in swapped), swapped


def test_strategy_name_parses_on_the_command_line():
    parser = ppl.setup_arg_parser()
    args = parser.parse_args(["--strategies", "h2o-heavy-knorm", "h2o-knorm:sink=2"])
    strategies = strategies_or_fail(parser, args.strategies)
    assert [s.h2o_config(256).score for s in strategies] == ["key_norm", "key_norm"]
    assert strategies[0].h2o_config(256).heavy_budget == 128
