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
from mlx_h2o.kernels import build, source
from mlx_h2o.kernels.group_fold import group_fold, group_fold_supported, layer_params

needs_gpu = pytest.mark.skipif(build.gpu_backend() is None,
                               reason="needs MLX with Metal or CUDA")


@pytest.mark.parametrize("n", [1, 2, 7])
def test_group_source_shares_the_body(n):
    _, cuda = build.group_source("cuda", n)
    _, metal = build.group_source("metal", n)
    assert "$" not in cuda and cuda.count("{") == cuda.count("}")
    assert cuda.replace(source.CUDA_IDS, "") == metal.replace(source.METAL_IDS, "")
    assert all(f"case {i}: v{i}[" in cuda for i in range(n))
    inputs, outputs = build.group_names(n)
    assert inputs[:2 * n] == [f"q{i}" for i in range(n)] + [f"k{i}" for i in range(n)]
    assert outputs[-1] == f"v{n - 1}"


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
@pytest.mark.parametrize("mode", ["accumulated", "normalized", "ema", "attention_ema"])
@pytest.mark.parametrize("dtype,D,Hq,Hk", [(mx.float16, 128, 32, 8), (mx.bfloat16, 64, 8, 8),
                                           (mx.float32, 256, 16, 2)])
def test_group_fold_matches_reference(mode, dtype, D, Hq, Hk):
    rng = np.random.default_rng(abs(hash((mode, D))) % 2**32)
    B, offset, sizes, caps = 2, 3000, (97, 256, 1025), (97, 300, 1025)
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
