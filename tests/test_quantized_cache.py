"""Quantized and mixed-precision H2O caches vs the dense cache."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import tiny_gemma3, tiny_llama

from mlx_h2o import H2OConfig, H2OKVCache, make_h2o_cache, patch
from mlx_h2o.cache import (
    MixedPrecisionH2OKVCache,
    QuantConfig,
    QuantizedH2OKVCache,
    quantized_cache_type,
)
from mlx_h2o.files import load_prompt_cache, save_prompt_cache
from mlx_h2o.cache.group import link_layers
from mlx_h2o.cache.mixed_storage import MixedKV
from make_swift_vectors import scripted_columns

D, HQ, HK, GS = 64, 4, 2, 32
STREAM = [5, 1, 1, 20, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 3, 1, 1, 1, 1, 30] + [1] * 12


def fake_quant(x, bits):
    """What a quantized cache stores, as dense values (float32 scales)."""
    return mx.dequantize(
        *mx.quantize(x, group_size=GS, bits=bits), group_size=GS, bits=bits
    )


def qkv(rng, L, B=2, dtype=np.float32):
    return [
        mx.array(rng.standard_normal((B, h, L, D)).astype(dtype)) for h in (HQ, HK, HK)
    ]


def attend(cache, q, k, v):
    L = k.shape[2]
    mask = cache.make_mask(L)
    keys, values = cache.update_and_fetch(k, v)
    return cache.h2o_attention(q, keys, values, scale=D**-0.5, mask=mask)


def kept(cache):
    return np.sort(np.array(cache.positions[..., : cache.size()]), axis=-1)


def mixed_with_equal_widths(cfg, bits, window=None):
    """A mixed cache whose two zones share one width: its promotions and
    gathers must then reproduce the uniform cache exactly."""
    cache = MixedPrecisionH2OKVCache(cfg, window, QuantConfig(8, GS, 4))
    split = cfg.max_size - cfg.recent_budget
    cache.storage_cls = lambda: MixedKV(bits, bits, GS, split)
    cache.kv = cache.storage_cls()
    return cache


CONFIGS = [
    H2OConfig(max_size=16, sink_size=2, heavy_budget=6),
    H2OConfig(max_size=9, sink_size=0, heavy_budget=8, score="accumulated"),
    H2OConfig(
        max_size=12, sink_size=1, heavy_budget=4, score="normalized", pinned=((3, 5),)
    ),
]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize(
    "bits,kind", [(8, "uniform"), (4, "uniform"), (2, "uniform"), (4, "mixed")]
)
def test_equals_dense_cache_on_dequantized_values(cfg, window, bits, kind):
    """Same values in, same decisions and outputs (float32 rounding) out."""
    rng = np.random.default_rng(0)
    if kind == "uniform":
        cache = QuantizedH2OKVCache(cfg, window, QuantConfig(bits, GS))
    else:
        cache = mixed_with_equal_widths(cfg, bits, window)
    dense = H2OKVCache(cfg, window)
    for L in STREAM:
        q, k, v = qkv(rng, L)
        out = attend(cache, q, k, v)
        ref = attend(dense, q, fake_quant(k, bits), fake_quant(v, bits))
        np.testing.assert_array_equal(kept(cache), kept(dense))
        np.testing.assert_allclose(np.array(out), np.array(ref), atol=1e-5, rtol=1e-5)
        assert cache.offset == dense.offset and cache.evicted == dense.evicted
    assert cache.trim(3) == dense.trim(3) == 3
    for L in (1, 1, 4, 1):
        q, k, v = qkv(rng, L)
        out = attend(cache, q, k, v)
        ref = attend(dense, q, fake_quant(k, bits), fake_quant(v, bits))
        np.testing.assert_array_equal(kept(cache), kept(dense))
        np.testing.assert_allclose(np.array(out), np.array(ref), atol=1e-5, rtol=1e-5)


def scripted_attention(cache, table):
    """Replace the storage's attention by logits that depend on (position,
    query position) only: every cache then sees the same scores."""

    def attention(queries, keys, values, *, scale, mask, sinks):
        B, Hq, L = queries.shape[:3]
        n = cache.size()
        pos = np.array(cache.positions[..., :n])  # (B, Hk, n)
        qpos = cache.offset - L + np.arange(L)
        lg = table[
            pos[:, :, None, None, :], qpos[None, None, None, :, None]
        ]  # (B,Hk,1,L,n)
        lg = np.broadcast_to(lg, (B, HK, HQ // HK, L, n)).reshape(B, Hq, L, n)
        lg = np.where(
            pos.repeat(HQ // HK, 1)[:, :, None, :] <= qpos[None, None, :, None],
            lg,
            -np.inf,
        )
        lse = np.log(np.exp(lg).sum(-1))
        out = mx.zeros((B, Hq, L, D))
        return out, mx.array(lg.astype(np.float32)), mx.array(lse.astype(np.float32))

    def column_attention(queries, keys, values, *, scale, mask, sinks, weights):
        out, lg, lse = attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        return (out, *scripted_columns(lg, lse, weights, HK))

    cache.kv.attention = attention
    cache.kv.column_attention = column_attention


@pytest.mark.parametrize("cfg", CONFIGS)
def test_same_scores_same_evictions(cfg):
    rng = np.random.default_rng(5)
    table = rng.standard_normal((200, 200)) * 3
    caches = [
        H2OKVCache(cfg),
        QuantizedH2OKVCache(cfg, quant=QuantConfig(4, GS)),
        MixedPrecisionH2OKVCache(cfg, quant=QuantConfig(8, GS, 4)),
    ]
    for c in caches:
        # Decode steps must use the scripted attention: the reference step (a
        # compiled or fused step attends by itself, not through kv.attention;
        # the scripted logits read positions, which a GPU fold writes after
        # the attention), no score queue (the quantized caches have none).
        c.set_decode("reference", defer=0)
        scripted_attention(c, table)
    for L in STREAM:
        _, k, v = qkv(rng, L)
        for c in caches:
            c.update_and_fetch(k, v)
            c.h2o_attention(
                mx.zeros((2, HQ, L, D)), None, None, scale=1.0, mask=c.make_mask(L)
            )
        for c in caches[1:]:
            np.testing.assert_array_equal(kept(c), kept(caches[0]))


def attention_error_bound(q, k, v, kq, vq, scale):
    """|out_q - out| <= eps_v + (exp(2 delta) - 1) max|v|, where
    delta = scale * |q|_1 * eps_k bounds each logit's change."""
    eps_k = np.abs(np.array(k - kq)).max()
    eps_v = np.abs(np.array(v - vq)).max()
    delta = scale * np.abs(np.array(q)).sum(-1).max() * eps_k
    return eps_v + np.expm1(2 * delta) * np.abs(np.array(v)).max()


@pytest.mark.parametrize("bits", [8, 4])
def test_output_within_measured_quantization_error(bits):
    cfg = H2OConfig(max_size=64, sink_size=4, heavy_budget=20)
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, 40)
    cache, dense = (
        QuantizedH2OKVCache(cfg, quant=QuantConfig(bits, GS)),
        H2OKVCache(cfg),
    )
    err = np.abs(np.array(attend(cache, q, k, v) - attend(dense, q, k, v))).max()
    bound = attention_error_bound(
        q, k, v, fake_quant(k, bits), fake_quant(v, bits), D**-0.5
    )
    assert err <= bound
    assert err > 0


def test_mixed_zones_and_values_never_change():
    """Recent window in the 4-bit zone, the rest in the 8-bit zone; a token's
    dequantized values stay what they were when it was first written."""
    cfg = H2OConfig(max_size=16, sink_size=2, heavy_budget=6)
    cache = MixedPrecisionH2OKVCache(cfg, quant=QuantConfig(8, GS, 4))
    rng, first, split = np.random.default_rng(7), {}, 8
    for L in STREAM:
        q, k, v = qkv(rng, L)
        mask = cache.make_mask(L)
        keys, values = cache.update_and_fetch(k, v)
        deq = np.concatenate(
            [np.array(fake_from(t, b)) for t, b in zip(keys, (8, 4))], axis=2
        )
        # The fetched slot layout: a chunk's before its compaction; a decode
        # token's after its attention (a fused GPU step writes the token's
        # position in its kernel, not in update_and_fetch).
        pos = np.array(cache.positions[..., : cache.size()])
        cache.h2o_attention(q, keys, values, scale=D**-0.5, mask=mask)
        if L == 1:
            pos = np.array(cache.positions[..., : cache.size()])
        if cache.size() == cfg.max_size and L == 1:
            recent = set(range(cache.offset - cfg.recent_budget, cache.offset))
            assert all(
                set(row.tolist()) == recent for row in pos[..., split:].reshape(-1, 8)
            )
        for b in range(2):
            for h in range(HK):
                for s, p in enumerate(pos[b, h]):
                    if (b, h, p) in first:
                        np.testing.assert_allclose(
                            deq[b, h, s], first[(b, h, p)], rtol=0, atol=1e-5
                        )
                    first.setdefault((b, h, p), deq[b, h, s])


def fake_from(t, bits):
    return mx.dequantize(*t, group_size=GS, bits=bits)


def check_invariants(cache, seen, cfg):
    pos = kept(cache)
    assert (
        cache.offset == seen
        and cache.size() == min(seen, cfg.max_size) == pos.shape[-1]
    )
    must = set(range(min(cfg.sink_size, seen))) | set(
        range(max(0, seen - cfg.recent_budget), seen)
    )
    for row in pos.reshape(-1, pos.shape[-1]):
        assert len(set(row.tolist())) == len(row) and must <= set(row.tolist())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    m=st.integers(3, 20),
    s=st.integers(0, 3),
    h=st.integers(0, 10),
    lengths=st.lists(st.integers(1, 25), min_size=1, max_size=25),
    mixed=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_invariants_over_random_streams(m, s, h, lengths, mixed, seed):
    s = min(s, m - 2)
    cfg = H2OConfig(max_size=m, sink_size=s, heavy_budget=min(h, m - s - 1))
    quant = QuantConfig(8, GS, 4) if mixed else QuantConfig(4, GS)
    cache, rng, seen, last = (
        quantized_cache_type(quant)(cfg),
        np.random.default_rng(seed),
        0,
        0,
    )
    for L in lengths:
        attend(cache, *qkv(rng, L))
        seen += L
        check_invariants(cache, seen, cfg)
        assert cache.offset >= last
        last = cache.offset


@pytest.mark.parametrize("quant", [QuantConfig(4, GS), QuantConfig(8, 64, 4)])
@pytest.mark.parametrize("stream", [[3], [3, 1, 20, 1, 1]])
def test_save_load_round_trip(tmp_path, quant, stream):
    cfg = H2OConfig(max_size=16, sink_size=2, heavy_budget=6)
    rng = np.random.default_rng(4)
    cache = [
        quantized_cache_type(quant)(cfg),
        quantized_cache_type(quant)(cfg, window_size=6),
    ]
    # Linked as make_h2o_cache and the loader link them: on a GPU both lists
    # then decode through the same step groups (the same arithmetic).
    link_layers(cache)
    for L in stream:
        for c in cache:
            attend(c, *qkv(rng, L, dtype=np.float16))
    path = str(tmp_path / "q.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    for a, b in zip(cache, loaded):
        assert (
            type(a) is type(b) and a.quant == b.quant and a.window_size == b.window_size
        )
        assert (a.offset, a.evicted, a.config, a.size()) == (
            b.offset,
            b.evicted,
            b.config,
            b.size(),
        )
        for x, y in zip(a.state, b.state):
            np.testing.assert_array_equal(np.array(x), np.array(y))
        q, k, v = qkv(np.random.default_rng(9), 1, dtype=np.float16)
        np.testing.assert_array_equal(
            np.array(attend(a, q, k, v)), np.array(attend(b, q, k, v))
        )


def test_trim_and_contract():
    cfg = H2OConfig(max_size=10, sink_size=2, heavy_budget=4)
    for quant in (QuantConfig(4, GS), QuantConfig(8, GS, 4)):
        cache, rng = quantized_cache_type(quant)(cfg), np.random.default_rng(3)
        assert cache.empty() and cache.nbytes == 0 and cache.is_trimmable()
        for L in [20] + [1] * 5:
            attend(cache, *qkv(rng, L))
        assert cache.trim(10) == 10 and cache.offset == 15
        assert kept(cache).max() < 15  # the trimmed tokens are gone, held ones below stay
        size = cache.size()
        attend(cache, *qkv(rng, 1))
        assert kept(cache).max() == 15 and cache.size() == size + 1


def test_nbytes_is_the_packed_layout():
    cfg = H2OConfig(max_size=256, sink_size=4, heavy_budget=128)
    for quant, per_slot in [
        (QuantConfig(8, 64), 2 * (64 + 2 * 2 * 1)),
        (QuantConfig(4, 32), 2 * (32 + 2 * 2 * 2)),
    ]:
        cache = quantized_cache_type(quant)(cfg)
        attend(cache, *qkv(np.random.default_rng(0), 300, B=1, dtype=np.float16))
        meta = 3 * 4  # position int32, score and count float32
        assert cache.nbytes == HK * 256 * (per_slot + meta)


def test_bad_input():
    cfg = H2OConfig(max_size=8)
    for kw in [
        {"bits": 3},
        {"bits": 5},
        {"bits": 4, "group_size": 16},
        {"bits": 8, "recent_bits": 8},
        {"bits": 4, "recent_bits": 8},
        {"bits": 8, "recent_bits": 3},
    ]:
        with pytest.raises(ValueError):
            QuantConfig(**kw)
    with pytest.raises(ValueError, match="group_size"):
        QuantizedH2OKVCache(cfg, quant=QuantConfig(4, 64)).update_and_fetch(
            mx.zeros((1, 1, 1, 48)), mx.zeros((1, 1, 1, 48))
        )
    with pytest.raises(TypeError):
        QuantizedH2OKVCache(cfg, quant={"bits": 4})
    with pytest.raises(ValueError, match="MixedPrecision"):
        QuantizedH2OKVCache(cfg, quant=QuantConfig(8, 64, 4))
    with pytest.raises(ValueError, match="recent_bits"):
        MixedPrecisionH2OKVCache(cfg, quant=QuantConfig(8, 64))
    assert QuantConfig.from_flags(None) is None
    assert QuantConfig.from_flags(4, 32) == QuantConfig(4, 32)
    assert QuantConfig.from_flags(None, 64, mixed=True) == QuantConfig(8, 64, 4)
    with pytest.raises(ValueError, match="mixed"):
        QuantConfig.from_flags(4, 64, mixed=True)


class FakeQuantCache(H2OKVCache):
    """Dense H2O cache fed what a quantized cache would store."""

    bits = None

    def update_and_fetch(self, keys, values):
        q = lambda x: mx.dequantize(
            *mx.quantize(x, group_size=GS, bits=self.bits),
            group_size=GS,
            bits=self.bits,
        ).astype(x.dtype)
        return super().update_and_fetch(q(keys), q(values))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3])
def test_model_matches_dense_cache_on_dequantized_values(bits, build):
    """Through a whole model (Gemma 3: sliding-window layers too): the quantized
    cache equals a dense H2O cache fed dequantized K/V, to float32 rounding
    carried through the layers (2e-5 of the largest logit, ~170 eps)."""
    model = build(head_dim=32, hidden_size=128)
    cfg = H2OConfig(max_size=24, sink_size=2, heavy_budget=10)
    tokens = mx.array(np.random.default_rng(0).integers(0, 97, (2, 60)))
    fake = type("Fake", (FakeQuantCache,), {"bits": bits})
    outs = []
    for cache_type in (quantized_cache_type(QuantConfig(bits, GS)), fake):
        cache = make_h2o_cache(model, cfg, cache_type=cache_type)
        with patch():
            logits = [model(tokens[:, :20], cache=cache)[:, -1]]
            logits += [
                model(tokens[:, t : t + 1], cache=cache)[:, -1] for t in range(20, 60)
            ]
        outs.append(np.array(mx.stack(logits, 1)))
        assert all(c.size() == cfg.max_size for c in cache)
    atol = 2e-5 * np.abs(outs[1]).max()
    np.testing.assert_allclose(outs[0], outs[1], atol=atol, rtol=0)


def test_mixed_without_high_zone_is_uniform_low_bits(tmp_path):
    """sink = heavy = 0: every slot is recent, so mixed 8/4 is plain 4-bit."""
    cfg = H2OConfig(max_size=6, sink_size=0, heavy_budget=0)
    cache = MixedPrecisionH2OKVCache(cfg, quant=QuantConfig(8, GS, 4))
    dense, rng = H2OKVCache(cfg), np.random.default_rng(2)
    for L in [4, 1, 9, 1, 1]:
        q, k, v = qkv(rng, L)
        out = attend(cache, q, k, v)
        ref = attend(dense, q, fake_quant(k, 4), fake_quant(v, 4))
        np.testing.assert_array_equal(kept(cache), kept(dense))
        np.testing.assert_allclose(np.array(out), np.array(ref), atol=1e-5, rtol=1e-5)
    path = str(tmp_path / "m.safetensors")
    save_prompt_cache(path, [cache])
    (loaded,) = load_prompt_cache(path)
    q, k, v = qkv(rng, 1)
    np.testing.assert_array_equal(
        np.array(attend(cache, q, k, v)), np.array(attend(loaded, q, k, v))
    )
