"""The group-fold kernel (kernels/group_fold.py) against its reference.

Source assembly runs everywhere; the numeric checks run only where MLX has a
GPU backend: fresh random stacked state (unique positions, scores, counts),
layers of different sizes and buffer capacities, every score mode, GQA
ratios 1 / 4 / 8, head dims 64 / 128 / 256, three dtypes, outputs poisoned.
The reference is ``cache.group.fold_layer``: the per-layer policy ops.
"""

import mlx.core as mx
import numpy as np
import pytest

from mlx_h2o import H2OConfig
from mlx_h2o.cache.group import fold_layer
from mlx_h2o.config import with_max_size
from mlx_h2o.kernels import backend, build, source
from mlx_h2o.kernels.packed import pack
from mlx_h2o.kernels.quantized_reference import dequantize
from mlx_h2o.kernels.group_fold import group_fold, group_fold_supported, layer_params
from mlx_h2o.scores import KERNEL_MODES
from decode_steps import group_of

needs_gpu = pytest.mark.skipif(backend.gpu_backend() is None,
                               reason="needs MLX with Metal or CUDA")


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("n", [1, 2, 7])
def test_group_source_shares_the_body(n, quantized):
    _, cuda = build.group_source("cuda", n, quantized)
    _, metal = build.group_source("metal", n, quantized)
    assert "$" not in cuda and cuda.count("{") == cuda.count("}")
    assert cuda.replace(source.CUDA_IDS, "") == metal.replace(source.METAL_IDS, "")
    assert "v0[" not in cuda  # each layer's victim is a view of ``victim`` (no output)
    inputs, outputs = build.group_names(n, quantized)
    ks = [f"k{i}" for i in range(n)]  # dense K or packed K/V: one input per layer
    assert inputs[:n] == [f"q{i}" for i in range(n)] and inputs[n:n + len(ks)] == ks
    assert all(k in cuda for k in ks) and outputs[3] == "victim" and len(outputs) == 6


def layer_state(rng, B, Hk, cap, n, M, offset):
    """Stacked-row metadata of one layer: unique positions < offset - 1."""
    pos = np.zeros((B, Hk, M), np.int32)
    for b in range(B):
        for h in range(Hk):
            pos[b, h, :n] = rng.choice(offset - 1, n, replace=False)
    score = rng.random((B, Hk, M)).astype(np.float32)
    count = rng.integers(0, 50, (B, Hk, M)).astype(np.float32)
    slot = rng.integers(0, n, (B, Hk, 1)).astype(np.int32)
    return pos, score, count, slot


@needs_gpu
@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize("dtype,D,Hq,Hk", [(mx.float16, 128, 32, 8), (mx.bfloat16, 64, 8, 8),
                                           (mx.float32, 256, 16, 2)])
def test_group_fold_matches_reference(mode, dtype, D, Hq, Hk):
    check_group_fold(mode, dtype, D, Hq, Hk)


def check_group_fold(mode, dtype, D, Hq, Hk, B=2, sizes=(97, 256, 1025), caps=(97, 300, 1025),
                     offset=3000):
    """The group fold over layers of ``sizes`` keys in buffers of ``caps``
    slots against ``fold_layer`` (also run on tests/metal_emu.py's emulator)."""
    rng = np.random.default_rng(abs(hash((mode, D))) % 2**32)
    base = H2OConfig(max_size=256, sink_size=4, heavy_budget=128, score=mode,
                     pinned=((100, 120),))
    cfgs = [with_max_size(base, s) for s in sizes]
    M = max(caps)
    qs = [mx.array(rng.standard_normal((B, Hq, 1, D)).astype(np.float32)).astype(dtype)
          for _ in sizes]
    keys, state = [], []
    for n, cap in zip(sizes, caps):
        keys.append(mx.array(rng.standard_normal((B, Hk, cap, D)).astype(np.float32)).astype(dtype))
        state.append(layer_state(rng, B, Hk, cap, n, M, offset))
    pos, score, count, slot = (mx.array(np.concatenate(x, axis=0)) for x in zip(*state))
    scale = D ** -0.5
    lay_i = mx.array([layer_params(offset, c.sink_size, c.recent_budget, n, cap)
                      for c, n, cap in zip(cfgs, sizes, caps)], dtype=mx.int32)
    lay_f = mx.array([[scale, c.ema_alpha, 1.0 - c.ema_alpha, 0.0] for c in cfgs], mx.float32)
    assert group_fold_supported(dtype, D, Hq, Hk)
    res = group_fold(qs, keys, lay_i, lay_f, pos, score, count, slot, mode=mode,
                     pinned=base.pinned)
    mx.eval(res)
    for i, (c, n, k) in enumerate(zip(cfgs, sizes, keys)):
        rows = slice(i * B, (i + 1) * B)
        with mx.stream(mx.cpu):
            want = fold_layer(c, qs[i], k, n, scale, offset, pos[rows], score[rows],
                              count[rows], slot[rows])
            want = [np.array(x) for x in want]
        got = [np.array(x[rows]) for x in (res.positions, res.score, res.count, res.victim)]
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_allclose(got[1], want[1], rtol=2e-5, atol=1e-6)
        np.testing.assert_array_equal(got[2], want[2])
        np.testing.assert_array_equal(got[3], want[3])
        np.testing.assert_array_equal(np.array(res.victims[i]), want[3])
    want_lay = np.array(lay_i)
    want_lay[:, 0] += 1
    np.testing.assert_array_equal(np.array(res.lay_i), want_lay)


@needs_gpu
@pytest.mark.parametrize("bits,gs", [(8, 64), (4, 32), (4, 128), (2, 64)])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_group_fold_quantized_matches_reference(bits, gs, dtype):
    check_group_fold_quantized(bits, gs, dtype)


def check_group_fold_quantized(bits, gs, dtype, D=128, Hq=32, Hk=8, sizes=(256, 97)):
    """K in packed K/V buffers (kernels/packed.py): the kernel dequantizes
    in registers; the reference folds the mx.dequantize'd keys."""
    rng = np.random.default_rng(bits * 1000 + gs)
    B, offset = 1, 2000
    base = H2OConfig(max_size=256, sink_size=4, heavy_budget=128)
    cfgs = [with_max_size(base, s) for s in sizes]
    M = max(sizes)
    qs = [mx.array(rng.standard_normal((B, Hq, 1, D)).astype(np.float32)).astype(dtype)
          for _ in sizes]
    triples, packed, state = [], [], []
    for n in sizes:
        k, v = (mx.array(rng.standard_normal((B, Hk, n, D)).astype(np.float32)).astype(dtype)
                for _ in range(2))
        triples.append(mx.quantize(k, group_size=gs, bits=bits))
        packed.append(pack(triples[-1], mx.quantize(v, group_size=gs, bits=bits)))
        state.append(layer_state(rng, B, Hk, n, n, M, offset))
    pos, score, count, slot = (mx.array(np.concatenate(x, axis=0)) for x in zip(*state))
    lay_i = mx.array([layer_params(offset, c.sink_size, c.recent_budget, n, n)
                      for c, n in zip(cfgs, sizes)], dtype=mx.int32)
    lay_f = mx.array([[D ** -0.5, c.ema_alpha, 1.0 - c.ema_alpha, 0.0] for c in cfgs],
                     mx.float32)
    assert group_fold_supported(dtype, D, Hq, Hk, bits, gs)
    res = group_fold(qs, packed, lay_i, lay_f, pos, score, count, slot, mode="accumulated",
                     bits=bits, group_size=gs)
    mx.eval(res)
    for i, (c, n, t) in enumerate(zip(cfgs, sizes, triples)):
        rows = slice(i * B, (i + 1) * B)
        with mx.stream(mx.cpu):
            dense = dequantize(t, bits=bits, group_size=gs)  # float32, as the kernel
            want = [np.array(x) for x in fold_layer(
                c, qs[i], dense, n, D ** -0.5, offset, pos[rows], score[rows], count[rows],
                slot[rows], width=1)]
        np.testing.assert_array_equal(np.array(res.positions[rows]), want[0])
        np.testing.assert_allclose(np.array(res.score[rows]), want[1], rtol=2e-5, atol=1e-6)
        np.testing.assert_array_equal(np.array(res.count[rows]), want[2])
        np.testing.assert_array_equal(np.array(res.victims[i]), want[3])
        assert res.victims[i].shape == (B, Hk, 1, 1)
    # One column: each layer's rows are a row-contiguous view (the packed write
    # kernel would copy a strided index every token).
    assert res.victim.shape == (len(cfgs) * B, Hk, 1, 1)


@needs_gpu
@pytest.mark.parametrize("quant", [None, (8, 32), (4, 64)])
def test_grouped_caches_match_per_layer_on_gpu(quant):
    """Caches grouped with the real kernel vs per-layer caches (the fused step,
    or the fold kernel for triples), over fills and evictions: same kept
    positions, scores within float summation order."""
    from mlx_h2o.cache import H2OKVCache, QuantConfig, quantized_cache_type
    from mlx_h2o.cache.group import make_groups
    from test_step_group import configs, run

    cls = H2OKVCache if quant is None else quantized_cache_type(QuantConfig(*quant))
    cfgs = configs(sizes=(24, 40, 31))
    plain, grouped = [cls(c) for c in cfgs], [cls(c) for c in cfgs]
    make_groups(grouped, size=3, use_kernel=True)
    a = run(plain, 5, [5] + [1] * 70, d=64)
    b = run(grouped, 5, [5] + [1] * 70, d=64)
    assert group_of(grouped[0])._stacked is not None  # the kernel path was taken
    for x, y in zip(a[-1], b[-1]):
        np.testing.assert_allclose(x, y, rtol=2e-3, atol=2e-3)
    for p, g in zip(plain, grouped):
        n = p.size()
        assert (p.offset, p.evicted, n) == (g.offset, g.evicted, g.size()) and p.evicted > 0
        np.testing.assert_array_equal(np.array(g.positions[..., :n]),
                                      np.array(p.positions[..., :n]))
        np.testing.assert_allclose(np.array(g.score[..., :n]), np.array(p.score[..., :n]),
                                   rtol=1e-4, atol=1e-5)


@needs_gpu
@pytest.mark.parametrize("quant", [(8, 64), (4, 32)])
def test_fused_write_matches_scatters_on_gpu(quant):
    """Grouped caches whose evicting steps write through kernels/kv_write.py vs
    the same caches writing with mx.quantize + put_along_axis: same kept
    positions at the end, stored K/V equal, outputs within one dtype rounding."""
    from mlx_h2o.cache import QuantConfig, quantized_cache_type
    from mlx_h2o.cache.group import make_groups
    from test_step_group import configs, run

    cls = quantized_cache_type(QuantConfig(*quant))
    cfgs = configs(sizes=(24, 40, 31))
    sets = [[cls(c) for c in cfgs] for _ in range(2)]
    for fused, caches in zip((False, True), sets):
        make_groups(caches, size=3, use_kernel=True)
        for c in caches:
            c.kv.fused_write = fused
    a = run(sets[0], 5, [5] + [1] * 70, d=64)
    b = run(sets[1], 5, [5] + [1] * 70, d=64)
    assert all(c.kv._writes.plan is not None for c in sets[1])  # the kernel wrote
    assert all(c.kv._writes.plan is None for c in sets[0])
    for step_a, step_b in zip(a, b):
        for x, y in zip(step_a, step_b):
            np.testing.assert_allclose(x, y, rtol=1e-2, atol=1e-2)
    for p, g in zip(*sets):
        n = p.size()
        assert (p.offset, p.evicted, n) == (g.offset, g.evicted, g.size()) and p.evicted > 0
        np.testing.assert_array_equal(np.array(g.positions[..., :n]),
                                      np.array(p.positions[..., :n]))
        for x, y in zip(p.kv.state(n), g.kv.state(n)):
            if x.dtype in (mx.float16, mx.bfloat16):
                x, y = x.astype(mx.float32), y.astype(mx.float32)
            np.testing.assert_array_equal(np.array(x), np.array(y))
