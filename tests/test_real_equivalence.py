"""H2O on the real SmolLM2-135M: exact equivalence within budget, bounded beyond it."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_h2o import H2OConfig, cache_stats, make_h2o_cache
from mlx_h2o.budgets import layer_sizes
from mlx_h2o.models import load_model
from mlx_h2o.profiles import shipped_profile
from test_integration import run

PROSE = Path(__file__).parent / "data" / "python_docs_prose.txt"


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = load_model("smollm2-135m")
    tokens = mx.array(tokenizer.encode(PROSE.read_text())[:160])[None]
    return model, tokens


@pytest.mark.real_model
def test_smollm2_matches_kvcache_within_budget(smollm2):
    model, tokens = smollm2
    ref = run(model, make_prompt_cache(model), tokens, 128, chunk=48)
    for budget, max_size in (("uniform", 256), ("auto", 384)):
        # "auto" = the shipped profile: its smallest layer at 384 is 194 >= 160 tokens.
        cache = make_h2o_cache(model, H2OConfig(max_size=max_size), layer_budget=budget)
        assert min(c.max_size for c in cache) >= tokens.shape[1]
        out = run(model, cache, tokens, 128, chunk=48)
        # float32 through 30 layers; the SDPA paths differ only in rounding (measured 6.6e-5).
        np.testing.assert_allclose(np.array(out), np.array(ref), atol=5e-4, rtol=1e-4)
        assert mx.array_equal(out.argmax(-1), ref.argmax(-1))
        assert all(c.evicted == 0 for c in cache)


@pytest.mark.real_model
def test_smollm2_evicting_stays_bounded_and_close(smollm2):
    model, tokens = smollm2
    ref = run(model, make_prompt_cache(model), tokens, 128, chunk=48)
    cache = make_h2o_cache(model, H2OConfig(max_size=96, heavy_budget=44),
                           layer_budget="uniform")
    out = run(model, cache, tokens, 128, chunk=48)
    stats = cache_stats(cache)
    assert (stats.tokens_seen, stats.tokens_kept) == (160, 96)
    # Eviction changes the numbers but keeps most greedy predictions (measured 0.97).
    agree = (out.argmax(-1) == ref.argmax(-1)).astype(mx.float32).mean().item()
    assert agree > 0.8, agree


@pytest.mark.real_model
def test_smollm2_auto_uses_the_shipped_profile(smollm2):
    model, _ = smollm2
    p = shipped_profile("smollm2-135m")
    cache = make_h2o_cache(model, H2OConfig(max_size=256), layer_budget="auto")
    sizes = [c.max_size for c in cache]
    assert sizes == layer_sizes(p.weights, p.windows, 256, 4) and sum(sizes) == 256 * 30
    assert len(set(sizes)) > 1
    # The default is uniform, profile or not: max_size in every layer.
    assert {c.max_size for c in make_h2o_cache(model, H2OConfig(max_size=256))} == {256}


@pytest.mark.real_model
@pytest.mark.parametrize("question", ["Hello!", "Tell me a joke."])
def test_generate_equals_mlx_lm_while_the_chat_fits_the_budget(question):
    """The promise of a budget of N tokens: a chat whose prompt and answer are
    fewer than N tokens gets mlx-lm's greedy answer, here on the packaged
    model, which ships a layer profile. (Under that profile, which gives
    layers 16..88 slots at N = 64, "Tell me a joke." is answered otherwise.)"""
    import mlx_lm

    from mlx_h2o import generate

    model, tokenizer = load_model("smollm2-135m")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                           add_generation_prompt=True)
    cache = make_h2o_cache(model, H2OConfig(max_size=64))
    n = 64 - 1 - len(prompt)  # the cache holds the prompt and every answer token
    want = mlx_lm.generate(model, tokenizer, prompt, max_tokens=n)
    assert generate(model, tokenizer, prompt, max_tokens=n, prompt_cache=cache) == want
    assert generate(model, tokenizer, prompt, max_tokens=n,
                    h2o_config=H2OConfig(max_size=64)) == want
    stats = cache_stats(cache)
    assert stats.tokens_evicted == 0 and stats.tokens_seen <= 63 and len(want) > 20
