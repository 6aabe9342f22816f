"""Decode below the budget must not pin one buffer per step.

Nothing reads a cache's metadata (positions, scores, counts) until an eviction
decision does. Left lazy, each decode step's update held its inputs: that
step's logits (per-step folds) or the whole K buffer (queued folds), so active
memory grew with every token (on the H100 a 16K-context decode of an 8B-shaped
model grew by ~5 GB per 128 tokens and ran out of memory). Growth is measured with MLX's own allocator counter.
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


def decoder(cache, rng):
    """``decode(steps, L=1)``: that many attention calls of L random tokens."""
    rand = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32))  # noqa: E731

    def decode(steps, L=1):
        for _ in range(steps):
            k = rand(B, HK, L, D)
            keys, values = cache.update_and_fetch(k, k)
            mask = cache.make_mask(L) if L > 1 else None
            mx.eval(cache.h2o_attention(rand(B, HQ, L, D), keys, values, scale=0.1, mask=mask))

    return decode


@pytest.mark.parametrize("case", list(CASES))
def test_decode_below_the_budget_does_not_grow_memory(case):
    cls, mode, window = CASES[case]
    cache = cls(H2OConfig(max_size=N + 512, score=mode), window)
    cache.set_decode(defer=4)
    cache.set_fold_phase(0)  # the queue with the new steps
    decode = decoder(cache, np.random.default_rng(11))
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


PAST_BUDGET = {
    "per-step": (H2OKVCache, "accumulated", None, 1),
    "per-step (ema)": (H2OKVCache, "ema", None, 1),
    "window layer": (H2OKVCache, "accumulated", 64, 1),
    "batched eviction": (H2OKVCache, "accumulated", None, 16),
    "batched eviction (ema)": (H2OKVCache, "ema", None, 16),
    "8-bit, batched eviction": (quantized_cache_type(QuantConfig(8, 64)), "accumulated", None, 16),
    "mixed precision": (quantized_cache_type(QuantConfig(8, 64, recent_bits=4)), "ema", None, 1),
}


@pytest.mark.parametrize("case", list(PAST_BUDGET))
def test_decode_past_the_budget_stays_flat(case):
    """A full cache decoding for many budgets' worth of evictions (batched
    events included) holds the same memory throughout."""
    cls, mode, window, batch = PAST_BUDGET[case]
    cache = cls(H2OConfig(max_size=256, score=mode, evict_batch=batch), window)
    decode = decoder(cache, np.random.default_rng(12))
    decode(1, L=300)
    decode(48)  # three batch events: every buffer at its steady size
    gc.collect()
    before = mx.get_active_memory()
    decode(192)  # twelve more events
    gc.collect()
    assert cache.evicted > 192
    # One event's metadata is 3 * 4 * 256 * 4 bytes (12 KB), its queue 16 queries.
    assert mx.get_active_memory() - before < 16 * 1024


def test_generate_step_with_batched_eviction_stays_flat():
    """The same through mlx-lm's generate_step on a tiny model."""
    from mlx_lm.generate import generate_step

    import mlx_h2o
    from mlx_h2o import make_h2o_cache
    from tiny_models import tiny_llama

    model = tiny_llama(num_hidden_layers=2)
    cache = make_h2o_cache(model, H2OConfig(max_size=64, evict_batch=16), layer_budget="uniform")
    marks = {}
    with mlx_h2o.patch():
        steps = generate_step(mx.array([1, 2, 3, 4]), model, prompt_cache=cache, max_tokens=720)
        for i, _ in enumerate(steps):
            if i in (160, 719):
                gc.collect()
                marks[i] = mx.get_active_memory()
    assert cache[0].evicted > 600
    # Each event left lazy held about 0.7 KB a layer: 35 events, 2 layers.
    assert marks[719] - marks[160] < 8 * 1024
