"""mlx-lm integration: exact equivalence with KVCache, RoPE, routing, generate."""

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

import mlx_h2o
from mlx_h2o import H2OConfig, H2OKVCache, make_h2o_cache
from mlx_h2o.integration import routing
from mlx_h2o.integration.generate import generate, stream_generate
from mlx_h2o.integration.stats import cache_stats
from mlx_h2o.scores import SCORE_MODES
from tiny_models import BUILDERS, VOCAB, tiny_llama


def run(model, cache, tokens, prefill, chunk=None):
    """Chunked prefill then token-by-token decode; returns all step logits."""
    outs, chunk = [], chunk or prefill
    with mlx_h2o.patch():
        for s in range(0, prefill, chunk):
            outs.append(model(tokens[:, s : min(s + chunk, prefill)], cache=cache))
        for t in range(prefill, tokens.shape[1]):
            outs.append(model(tokens[:, t : t + 1], cache=cache))
    return mx.concatenate(outs, axis=1)


@pytest.mark.parametrize("score", SCORE_MODES)
@pytest.mark.parametrize("arch", sorted(BUILDERS))
@pytest.mark.parametrize("chunk", [None, 7])
def test_exact_equivalence_within_budget(arch, chunk, score):
    model = BUILDERS[arch]()
    tokens = mx.random.randint(0, VOCAB, (2, 40))
    ref = run(model, make_prompt_cache(model), tokens, 23, chunk)
    cache = make_h2o_cache(model, H2OConfig(max_size=40, score=score))
    out = run(model, cache, tokens, 23, chunk)
    np.testing.assert_allclose(np.array(out), np.array(ref), atol=2e-4, rtol=1e-4)
    assert mx.array_equal(out.argmax(-1), ref.argmax(-1))
    assert all(c.evicted == 0 for c in cache if isinstance(c, H2OKVCache))


def test_gemma3_sliding_layers_get_windows():
    model = BUILDERS["gemma3_text"]()
    cache = make_h2o_cache(model, H2OConfig(max_size=64))
    windows = [c.window_size for c in cache]
    assert windows == [16, 16, None]
    # Past the window, H2O with a large budget must still match mlx-lm's caches.
    tokens = mx.random.randint(0, VOCAB, (1, 50))
    ref = run(model, make_prompt_cache(model), tokens, 30)
    out = run(model, cache, tokens, 30)
    np.testing.assert_allclose(np.array(out), np.array(ref), atol=2e-4, rtol=1e-4)


def test_rope_offset_counts_tokens_after_eviction():
    """Kept keys must equal the full cache's keys at their true positions."""
    model = tiny_llama(num_hidden_layers=1)
    tokens = mx.random.randint(0, VOCAB, (2, 60))
    full = make_prompt_cache(model)
    h2o = make_h2o_cache(model, H2OConfig(max_size=16, sink_size=2, heavy_budget=6))
    run(model, full, tokens, 20)
    run(model, h2o, tokens, 20)
    c = h2o[0]
    assert c.offset == 60 and c.size() == 16 and c.evicted == 44
    keys = np.array(c.kv.keys[..., : c.size(), :])
    pos = np.array(c.positions[..., : c.size()])
    ref = np.array(full[0].keys[..., :60, :])
    want = np.take_along_axis(ref, pos[..., None], axis=2)
    np.testing.assert_allclose(keys, want, atol=1e-5)


def test_evicting_run_differs_but_stays_bounded():
    model = tiny_llama()  # 2 layers, 2 KV heads of 16 float32s: K+V 256 bytes a token
    tokens = mx.random.randint(0, VOCAB, (1, 80))
    cache = make_h2o_cache(model, H2OConfig(max_size=24, heavy_budget=10))
    run(model, cache, tokens, 40, chunk=16)
    stats = cache_stats(cache)
    assert (stats.layers, stats.tokens_seen, stats.tokens_kept, stats.tokens_evicted) == (
        2, 80, 24, 56)
    # 24 slots a layer of K+V and 12 bytes of position and scores a KV head;
    # mlx-lm's KVCache: the 80 tokens, allocated as one 256-token step.
    assert stats.kv_bytes == 2 * 24 * (256 + 2 * 12) == 13440
    assert (stats.kvcache_bytes, stats.kvcache_allocated_bytes) == (2 * 80 * 256, 2 * 256 * 256)
    assert stats.summary() == (
        "H2O cache (tokens a layer, mean over 2 layers): seen 80 = kept 24 + evicted 56; "
        "budget 24 a layer | KV 13.1 KiB (3.05x less); mlx-lm's KVCache: 40.0 KiB for "
        "the 80 tokens (128.0 KiB allocated in 256-token steps)")
    assert stats.usage() == {
        "layers": 2, "tokens_seen": 80, "tokens_kept": 24, "tokens_evicted": 56,
        "max_kv_size": 24, "layer_max_size": [24, 24], "kv_bytes": 13440,
        "kvcache_bytes": 40960, "kvcache_allocated_bytes": 131072}


def test_summary_of_a_cache_below_its_budget_has_no_ratio():
    """Nothing evicted: the cache holds what KVCache would (its buffers grow in
    256-slot steps too), so no "x less" / "x more"."""
    model = tiny_llama()
    cache = make_h2o_cache(model, H2OConfig(max_size=512, heavy_budget=200))
    run(model, cache, mx.random.randint(0, VOCAB, (1, 20)), 4)
    stats = cache_stats(cache)
    assert (stats.tokens_seen, stats.tokens_kept, stats.tokens_evicted) == (20, 20, 0)
    assert (stats.kv_bytes, stats.kvcache_bytes, stats.kvcache_allocated_bytes) == (
        2 * 256 * (256 + 2 * 12), 2 * 20 * 256, 2 * 256 * 256)
    assert stats.memory() == ("KV 140.0 KiB, nothing evicted; mlx-lm's KVCache: 10.0 KiB "
                              "for the 20 tokens (128.0 KiB allocated in 256-token steps)")


def test_routing_is_reversible():
    import mlx_lm.models.base as base
    import mlx_lm.models.llama as llama

    original = base.scaled_dot_product_attention
    assert not mlx_h2o.is_enabled()
    with mlx_h2o.patch():
        with mlx_h2o.patch():
            assert llama.scaled_dot_product_attention is routing.scaled_dot_product_attention
        assert mlx_h2o.is_enabled()
    assert base.scaled_dot_product_attention is original
    assert llama.scaled_dot_product_attention is original
    with pytest.raises(RuntimeError, match="not enabled"):
        mlx_h2o.disable()


def test_routing_leaves_other_caches_alone():
    model = tiny_llama()
    tokens = mx.random.randint(0, VOCAB, (1, 12))
    ref = model(tokens, cache=make_prompt_cache(model))
    with mlx_h2o.patch():
        out = model(tokens, cache=make_prompt_cache(model))
    assert mx.array_equal(ref, out)


def test_unsupported_model_is_named(monkeypatch):
    from mlx_lm.models import llama

    model = tiny_llama()
    # Attention that calls mx.fast's SDPA itself (as gemma2's does): refused up front.
    fast = lambda q, k, v, cache, scale, mask: mx.fast.scaled_dot_product_attention(  # noqa: E731
        q, k, v, scale=scale, mask=mask)
    with monkeypatch.context() as m:
        m.setattr(llama, "scaled_dot_product_attention", fast)
        with pytest.raises(ValueError, match="'llama' .* never attends it through"):
            make_h2o_cache(model, H2OConfig(max_size=8))
    # A model that bypasses the routed function at run time fails on the next call.
    cache = make_h2o_cache(model, H2OConfig(max_size=8))
    model(mx.array([[1, 2, 3]]), cache=cache)  # not patched: no scores reported
    with pytest.raises(RuntimeError, match="model: llama"):
        model(mx.array([[4]]), cache=cache)


def test_factory_keeps_non_attention_caches():
    model = tiny_llama()
    model.make_cache = lambda: [KVCache(), RotatingKVCache(max_size=8), "ssm-state"]
    cache = make_h2o_cache(model, H2OConfig(max_size=32))
    assert isinstance(cache[0], H2OKVCache) and cache[0].window_size is None
    assert cache[1].window_size == 8 and cache[2] == "ssm-state"
    assert cache[0].model_name == "llama"
    with pytest.raises(TypeError, match="H2OConfig"):
        make_h2o_cache(model, 32)


def word_tokenizer():
    """An offline word-level tokenizer over VOCAB words ("w2", "w3", ...)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    return TokenizerWrapper(fast)


def test_generate_matches_mlx_lm_within_budget():
    model, tok = tiny_llama(), word_tokenizer()
    prompt = " ".join(f"w{i}" for i in range(5, 30))
    ref = mlx_lm.generate(model, tok, prompt, max_tokens=12)
    out = generate(model, tok, prompt, max_tokens=12, h2o_config=H2OConfig(max_size=64))
    assert out == ref and not mlx_h2o.is_enabled()
    cache = make_h2o_cache(model, H2OConfig(max_size=16, heavy_budget=6))
    texts = [r.text for r in stream_generate(model, tok, prompt * 2, max_tokens=20, prompt_cache=cache)]
    assert len(texts) == 20 and cache[0].size() == 16 and cache[0].offset == 50 + 19
    with pytest.raises(ValueError, match="max_kv_size"):
        generate(model, tok, prompt, h2o_config=H2OConfig(max_size=8), max_kv_size=8)
