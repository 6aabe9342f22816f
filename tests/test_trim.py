"""trim(n) forgets exactly the n newest tokens, at any point, in every layer.

mlx-lm ignores the count trim() returns (its server's LRU prompt cache and
speculative decoding trim and go on), so a cache that trims less than asked
silently keeps tokens of another sequence. Scenarios run through mlx-lm itself.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import speculative_generate_step
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

import mlx_h2o
from mlx_h2o import H2OConfig, H2OKVCache, make_h2o_cache

from test_cache import check_kept
from tiny_models import VOCAB, tiny_llama, tiny_qwen3

D, HQ, HK = 8, 4, 2


def decode(cache, rng, steps, B=1, L=1, dim=D):
    for _ in range(steps):
        q, k, v = (mx.array(rng.standard_normal((B, h, L, dim)).astype(np.float32))
                   for h in (HQ, HK, HK))
        mask = cache.make_mask(L)
        keys, values = cache.update_and_fetch(k * 3, v)
        mx.eval(cache.h2o_attention(q, keys, values, scale=1.0, mask=mask))


def held(cache):
    """Sorted kept positions per (sequence, KV head) row."""
    pos = np.array(cache.positions[..., : cache.size()])
    return [sorted(row.tolist()) for row in pos.reshape(pos.shape[0] * pos.shape[1], -1)]


def check_trim(cache, n, cfg):
    """trim(n): offset drops by n, every row keeps its held tokens below the
    cut and, where rows differ, its best ones; nothing else changes."""
    before, offset = held(cache), cache.offset
    assert cache.is_trimmable()
    assert cache.trim(n) == min(n, offset)
    cut = offset - min(n, offset)
    after = held(cache)
    assert cache.offset == cut and cache.evicted == cut - cache.size()
    lows = [[p for p in row if p < cut] for row in before]
    assert cache.size() == min(len(low) for low in lows)
    for row, low in zip(after, lows):
        assert set(row) <= set(low) and len(set(row)) == len(row)
        assert [p for p in low if p < cfg.sink_size] == [p for p in row if p < cfg.sink_size]


def test_repeated_trims_keep_what_is_below_the_cut():
    """The audit's reproduction: trims after an earlier trim removed sinks."""
    cfg = H2OConfig(max_size=8, sink_size=2, heavy_budget=2, recent_budget=4)
    cache, rng = H2OKVCache(cfg), np.random.default_rng(0)
    decode(cache, rng, 20)
    for n in (2, 4, 4, 3):
        check_trim(cache, n, cfg)
    assert cache.offset == 7 and all(row[:2] == [0, 1] for row in held(cache))
    decode(cache, rng, 12)  # fills up and evicts again from there
    check_kept(cache, 19, cfg)


@pytest.mark.parametrize("evict_batch", [1, 3])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("seed", range(4))
def test_trims_at_random_points_stay_exact(seed, window, evict_batch):
    """Random decode streams (B=2, rows evict differently) with trims of
    random sizes, past the recent window and the budget."""
    cfg = H2OConfig(max_size=10, sink_size=1, heavy_budget=5, evict_batch=evict_batch)
    cache, rng = H2OKVCache(cfg, window), np.random.default_rng(seed)
    for _ in range(8):
        decode(cache, rng, int(rng.integers(1, 12)), B=2)
        check_trim(cache, int(rng.integers(0, 14)), cfg)
    decode(cache, rng, 3, B=2)
    assert len({p for row in held(cache) for p in row if p >= cache.offset}) == 0


def test_trim_of_a_quantized_cache():
    from mlx_h2o.cache import QuantConfig, quantized_cache_type

    cfg = H2OConfig(max_size=10, sink_size=2, heavy_budget=4)
    for quant in (QuantConfig(8, 32), QuantConfig(8, 32, recent_bits=4)):
        cache, rng = quantized_cache_type(quant)(cfg), np.random.default_rng(1)
        decode(cache, rng, 1, L=20, dim=32)
        decode(cache, rng, 5, dim=32)
        check_trim(cache, 10, cfg)
        check_trim(cache, 3, cfg)
        decode(cache, rng, 6, dim=32)
        assert max(max(row) for row in held(cache)) == cache.offset - 1


def test_layers_with_their_own_budgets_trim_alike():
    """Per-layer sizes: every layer forgets the same tokens (offsets agree)."""
    model = tiny_llama(num_hidden_layers=3)
    cache = make_h2o_cache(model, H2OConfig(max_size=12, sink_size=2),
                           layer_sizes=[6, 12, 24])
    tokens = mx.array(np.random.default_rng(2).integers(0, VOCAB, (1, 40)))
    with mlx_h2o.patch():
        model(tokens[:, :30], cache=cache)
        for t in range(30, 40):
            model(tokens[:, t : t + 1], cache=cache)
    assert [c.trim(20) for c in cache] == [20, 20, 20]
    assert {c.offset for c in cache} == {20}
    assert all(max(max(row) for row in held(c)) < 20 for c in cache)


def greedy(model, cache, prompt, steps):
    """Greedy tokens after a prompt, one decode step each."""
    out = []
    with mlx_h2o.patch():
        logits = model(prompt[None], cache=cache)
        for _ in range(steps):
            y = mx.argmax(logits[0, -1]).item()
            out.append(y)
            logits = model(mx.array([[y]]), cache=cache)
    return out


def test_lru_prompt_cache_reuse_holds_only_the_new_prompt():
    """mlx-lm's server LRU: a re-sent prompt reuses the cache of prompt +
    answer, trimmed to the prompt; it must hold none of the answer's tokens."""
    model = tiny_qwen3()
    cfg = H2OConfig(max_size=24, sink_size=2, heavy_budget=8)
    prompt = mx.array(np.random.default_rng(3).integers(0, VOCAB, 40))
    cache = make_h2o_cache(model, cfg, layer_budget="uniform")
    answer = greedy(model, cache, prompt, 16)
    lru = LRUPromptCache(max_size=4)
    lru.insert_cache("m", prompt.tolist() + answer, cache)
    reused, rest = lru.fetch_nearest_cache("m", prompt.tolist())
    assert rest == prompt.tolist()[-1:]  # mlx-lm keeps the last prompt token to feed
    for c in reused:
        assert c.offset == len(prompt) - 1
        assert max(max(row) for row in held(c)) < len(prompt) - 1
    again = greedy(model, reused, mx.array(rest), 4)
    assert [c.offset for c in reused] == [len(prompt) + 4] * len(reused)
    assert len(again) == 4


def test_lru_reuse_within_the_budget_equals_kvcache():
    model = tiny_llama()
    prompt = mx.array(np.random.default_rng(4).integers(0, VOCAB, 20))
    runs = []
    for make in (lambda: make_prompt_cache(model),
                 lambda: make_h2o_cache(model, H2OConfig(max_size=64))):
        lru = LRUPromptCache(max_size=4)
        cache = make()
        lru.insert_cache("m", prompt.tolist() + greedy(model, cache, prompt, 8), cache)
        reused, rest = lru.fetch_nearest_cache("m", prompt.tolist()[:15])
        runs.append(greedy(model, reused, mx.array(rest), 8))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("num_draft", [2, 6])
def test_speculative_decoding_keeps_offsets_with_the_sequence(num_draft):
    """num_draft above the recent window: every rejected draft token is
    trimmed in every layer, so offsets (RoPE positions) follow the sequence."""
    model, draft = tiny_qwen3(seed=0), tiny_qwen3(seed=1)
    cfg = H2OConfig(max_size=16, sink_size=2, heavy_budget=10)  # recent 4
    cache = make_h2o_cache(model, cfg) + make_h2o_cache(draft, cfg)
    prompt = mx.array(np.random.default_rng(5).integers(0, VOCAB, 30))
    with mlx_h2o.patch():
        tokens = [t for t, _, _ in speculative_generate_step(
            prompt, model, draft, prompt_cache=cache, num_draft_tokens=num_draft,
            max_tokens=24)]
    assert len(tokens) == 24
    main = cache[: len(model.layers)]
    # mlx-lm's loop has fed every token but the last one it yielded.
    assert {c.offset for c in main} == {len(prompt) + len(tokens) - 1}
    for c in main:
        rows = held(c)
        assert max(max(row) for row in rows) == c.offset - 1
        assert all(row[:2] == [0, 1] and len(set(row)) == len(row) for row in rows)


def test_speculative_decoding_within_the_budget_equals_kvcache():
    model, draft = tiny_llama(seed=0), tiny_llama(seed=1)
    prompt = mx.array(np.random.default_rng(6).integers(0, VOCAB, 12))
    runs = []
    for make in (make_prompt_cache, lambda m: make_h2o_cache(m, H2OConfig(max_size=64))):
        cache = make(model) + make(draft)
        with mlx_h2o.patch():
            runs.append([t for t, _, _ in speculative_generate_step(
                prompt, model, draft, prompt_cache=cache, num_draft_tokens=3,
                max_tokens=16)])
    assert runs[0] == runs[1]
