"""Every decode step a cache can be given computes what the reference does.

The steps (cache/decode/) are chosen once when a cache is made; on the CPU
the fused step falls back to the reference for what its kernels would do, so
here it checks the wiring (kernel-written metadata, victims picked ahead)
rather than the kernels (test_fused_wiring.py emulates those). Streams mix
prompt chunks past the budget, decode steps below and at the budget, a trim
and a masked step.
"""

import mlx.core as mx
import numpy as np
import pytest

from mlx_h2o import H2OConfig, H2OKVCache
from mlx_h2o.cache import QuantConfig, quantized_cache_type
from mlx_h2o.cache.decode import KINDS, decode_step
from mlx_h2o.scores import SCORE_MODES

pytestmark = pytest.mark.usefixtures("on_cpu")
D, HQ, HK, B = 32, 4, 2, 2
STREAM = [6] + [1] * 14 + [9] + [1] * 12 + ["trim"] + [1] * 6 + ["mask"] + [1] * 8


def make(storage, cfg, window):
    if storage == "dense":
        return H2OKVCache(cfg, window)
    return quantized_cache_type(QuantConfig(8, 32))(cfg, window)


def play(cache, seed):
    rng, outs = np.random.default_rng(seed), []
    for step in STREAM:
        if step == "trim":
            cache.trim(3)
            continue
        L = 1 if step == "mask" else step
        q, k, v = (mx.array(rng.standard_normal((B, h, L, D)).astype(np.float32))
                   for h in (HQ, HK, HK))
        mask = cache.make_mask(L)
        keys, values = cache.update_and_fetch(k * 2, v)
        if step == "mask":  # over the slots this step's update returned
            n = (keys[0] if isinstance(keys, tuple) else keys).shape[2]
            mask = mx.array(rng.standard_normal((1, 1, 1, n)) > -1.5)
        outs.append(np.array(cache.h2o_attention(q, keys, values, scale=0.5, mask=mask)))
    return outs


@pytest.mark.parametrize("storage", ["dense", "q8"])
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("evict_batch", [1, 3])
@pytest.mark.parametrize("mode", SCORE_MODES)
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "reference"])
def test_every_step_decides_as_the_reference(kind, mode, evict_batch, window, storage):
    cfg = H2OConfig(max_size=12, sink_size=2, heavy_budget=5, score=mode,
                    evict_batch=evict_batch, pinned=((4, 5),))
    got, want = make(storage, cfg, window), make(storage, cfg, window)
    got.set_decode(kind)
    # Between batch evictions, queued steps also attend the evicted slots not
    # yet overwritten (as RotatingKVCache would): the reference queues too.
    want.set_decode("reference", defer=0 if evict_batch == 1 else 128)
    a, b = play(got, 1), play(want, 1)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)
    assert (got.offset, got.evicted, got.size()) == (want.offset, want.evicted, want.size())
    assert got.evicted > 0
    n = want.size()
    np.testing.assert_array_equal(np.array(got.positions[..., :n]),
                                  np.array(want.positions[..., :n]))
    np.testing.assert_allclose(np.array(got.score[..., :n]), np.array(want.score[..., :n]),
                               rtol=1e-4, atol=1e-5)


def test_bad_choices_are_refused():
    cache = H2OKVCache(H2OConfig(max_size=8))
    with pytest.raises(ValueError, match="decode must be one of"):
        cache.set_decode("kernel")
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="defer must be an int >= 0"):
            decode_step(cache, "auto", bad)
    with pytest.raises(ValueError, match="decode must be one of"):
        H2OKVCache(H2OConfig(max_size=8), decode="gpu")
