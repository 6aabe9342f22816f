"""Decode below the budget must not pin one buffer per step.

Nothing reads a cache's metadata (positions, scores, counts) until an eviction
decision does. Left lazy, each decode step's update held its inputs: that
step's logits (per-step folds) or the whole K buffer (queued folds), so active
memory grew with every token (on the H100 a 16K-context decode of an 8B-shaped
model grew by ~5 GB per 128 tokens and ran out of memory; docs/GPU.md,
session 11). Growth is measured with MLX's own allocator counter.
"""

import gc

import mlx.core as mx
import numpy as np
import pytest

from mlx_h2o import H2OConfig, H2OKVCache
from mlx_h2o.cache import QuantConfig, quantized_cache_type

B, HQ, HK, D, N = 1, 8, 4, 64, 1024

CASES = {
    "queued folds": (H2OKVCache, "accumulated", None),
    "per-step folds (ema)": (H2OKVCache, "ema", None),
    "window layer": (H2OKVCache, "accumulated", 256),
    "8-bit": (quantized_cache_type(QuantConfig(8, 64)), "attention_ema", None),
    "mixed precision": (quantized_cache_type(QuantConfig(8, 64, recent_bits=4)), "ema", None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_decode_below_the_budget_does_not_grow_memory(case):
    cls, mode, window = CASES[case]
    cache = cls(H2OConfig(max_size=N + 512, score=mode), window)
    cache.defer_steps = 4
    cache.set_fold_phase(0)  # the queue with the new steps
    rng = np.random.default_rng(11)
    rand = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32))  # noqa: E731

    def decode(steps, L=1):
        for _ in range(steps):
            k = rand(B, HK, L, D)
            keys, values = cache.update_and_fetch(k, k)
            mask = cache.make_mask(L) if L > 1 else None
            mx.eval(cache.h2o_attention(rand(B, HQ, L, D), keys, values, scale=0.1, mask=mask))

    decode(1, L=N)
    decode(4)
    gc.collect()
    before = mx.get_active_memory()
    decode(24)
    gc.collect()
    assert cache.evicted == 0 or window is not None
    # One step's logits are 8 * 1050 * 4 bytes (~34 KB), a K buffer ~1 MB:
    # 24 steps pinned at least 0.8 MB.
    assert mx.get_active_memory() - before < 256 * 1024
