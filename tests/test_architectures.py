"""Every mlx-lm architecture: accepted or refused by make_h2o_cache as the table
says, and where accepted, H2O logits equal mlx-lm's KVCache logits.

Support is decided by what a model calls (check_supported's traced forward),
so a wrapper such as gemma3 (around gemma3_text) or smollm3 (llama's classes)
is accepted although its own module never imports the routed SDPA.
"""

import pkgutil

import mlx.core as mx
import mlx_lm.models
import pytest
from mlx_lm.models.cache import CacheList, KVCache, RotatingKVCache, make_prompt_cache
from tiny_architectures import HELPERS, NEEDS_METAL, NOT_BUILT, module_of, tiny_model
from tiny_models import teacher_forced

from mlx_h2o import H2OConfig, H2OKVCache, cache_stats, make_h2o_cache

# Tiny models' logits reach |13|. The reference's own float32 error (mlx-lm's
# KVCache decode against one full forward pass over the same tokens) reaches
# 9e-6 on these models and H2O's difference from the KVCache run 6e-6 (it
# attends with its own kernel in another order); 1e-4 is ~10x both. A wrong
# mask, window or dropped token moves logits by 1e-2 or more.
ATOL = 1e-4
PROMPT, DECODE = 10, 4  # 10 > the sliding windows of 8: windows mask old tokens

NO_SDPA = r"never attends it through mlx_lm\.models\.base\.scaled_dot_product_attention"
SHARED = r"KV shared between layers"
NO_KV = r"has no attention KV cache to replace"

# Refused, with the reason the error must give.
REFUSED = {
    "afm7": SHARED,  # KV-reuse layers attend the last layer's cache
    "deepseek_v32": NO_SDPA,  # sparse (DSA) attention picks keys with an indexer
    "deepseek_v41": NO_KV,  # its own LayerCache (compressed KV + window)
    "gemma2": NO_SDPA,  # soft-capped attention computed in the module
    "gemma3n": "attends KV cache 0 .* times for .* writes",  # KV-shared layers
    "gemma4_text+kv_shared": SHARED,
    "glm_moe_dsa": NO_SDPA,  # DSA indexer, as deepseek_v32
    "iquestloopcoder": "attends KV cache 2 .* times for .* writes",  # looped layers
    "mamba": NO_KV,
    "mamba2": NO_KV,
    "minimax_m3_vl": NO_SDPA,  # the sparse layers' block indexer cache
    "phi3small": NO_SDPA,  # block-sparse attention computed in the module
    "plamo2": NO_SDPA,  # mx.fast SDPA called directly
    "rwkv7": NO_KV,
}
ACCEPTED = """
    Klear afmoe apertus baichuan_m1 bailing_hybrid bailing_moe bailing_moe_linear
    bailing_moe_v3 bitnet cohere cohere2 dbrx deepseek deepseek_v2 deepseek_v3 dots1
    ernie4_5 ernie4_5_moe exaone exaone4 exaone_moe falcon_h1 gear gemma gemma3
    gemma3_text gemma4 gemma4_text glm glm4 glm4_moe glm4_moe_lite gpt2 gpt_bigcode
    gpt_neox gpt_oss gptj granite granitemoe granitemoehybrid helium hunyuan hunyuan+cla
    hunyuan_v1_dense internlm2 internlm3 jamba kimi_k25 kimi_k3 kimi_linear kimi_vl
    laguna lfm2 lfm2-vl lfm2_moe lille-130m llama llama4 llama4_text longcat_flash
    longcat_flash_ngram mellum mimo mimo_v2_flash minicpm minicpm3 minimax ministral3
    mistral3 mistral4 mixtral muse_glimmer muse_spark nanbeige nanochat nemotron
    nemotron-nas nemotron_h olmo2 olmo3 olmo_hybrid olmoe openelm phi phi3 phimoe
    phixtral pixtral plamo plamo3 qwen qwen2 qwen2_moe qwen2_vl qwen3 qwen3_5
    qwen3_5_moe qwen3_moe qwen3_next qwen3_vl qwen3_vl_moe recurrent_gemma seed_oss
    smollm3 solar_open spark2_5 stablelm starcoder2 step3p5 talkie telechat3 youtu_llm
""".split()
CASES = sorted(ACCEPTED) + sorted(REFUSED)


def _case(case):
    if case in NEEDS_METAL:
        reason = "its layers call Metal-only kernels"
        return pytest.param(case, marks=pytest.mark.skipif(
            not mx.metal.is_available(), reason=reason))
    return case


def _attention_cache(c) -> bool:
    return type(c) in (KVCache, RotatingKVCache)


def _members(caches):
    """Every cache, with a hybrid layer's CacheList members in its place."""
    return [m for c in caches for m in (c.caches if type(c) is CacheList else (c,))]


def test_every_architecture_is_classified():
    modules = {m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__)}
    cases = {module_of(c) for c in CASES}
    assert not set(REFUSED) & set(ACCEPTED)
    assert not (cases | HELPERS) & set(NOT_BUILT)
    # A new mlx-lm architecture fails here until it is built and classified.
    assert modules - HELPERS - set(NOT_BUILT) == cases, "classify these"
    assert HELPERS <= modules


@pytest.mark.parametrize("case", [_case(c) for c in CASES])
def test_architecture(case):
    model = tiny_model(case)
    config = H2OConfig(max_size=256)  # above the 14 tokens: nothing is evicted
    if case in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[case]) as err:
            make_h2o_cache(model, config)
        assert module_of(case) in str(err.value)  # names the model
        return
    tokens = mx.random.randint(0, 64, (1, PROMPT + DECODE), key=mx.random.key(1))
    h2o = make_h2o_cache(model, config)
    plain = make_prompt_cache(model)
    assert len(_members(h2o)) == len(_members(plain))
    for a, b in zip(_members(plain), _members(h2o)):  # SSM state etc. kept as made
        assert type(b) is (H2OKVCache if _attention_cache(a) else type(a)), (a, b)
    assert any(type(c) is H2OKVCache for c in _members(h2o))
    want = teacher_forced(model, plain, tokens, PROMPT)
    got = teacher_forced(model, h2o, tokens, PROMPT)
    assert mx.abs(want).max().item() > 0.5  # logits large enough to compare
    err = mx.abs(got - want).max().item()
    assert err <= ATOL, f"{case}: max |H2O - KVCache| logits = {err:.2e}"


@pytest.mark.parametrize("case", ["smollm3", "gemma3"])
def test_wrapper_models_are_accepted(case):
    """smollm3 runs llama's attention classes and gemma3 wraps gemma3_text: their
    own modules never import the routed SDPA, their attention calls it."""
    model = tiny_model(case)
    caches = make_h2o_cache(model, H2OConfig(max_size=64))
    assert caches and all(type(c) is H2OKVCache for c in caches)


def test_refusal_names_model_reason_and_fix():
    with pytest.raises(ValueError) as err:
        make_h2o_cache(tiny_model("gemma2"), H2OConfig(max_size=64))
    msg = str(err.value)
    assert "model 'gemma2' (mlx_lm.models.gemma2)" in msg  # the model
    assert "never attends it through" in msg  # why
    assert "use a model whose attention layers each call" in msg  # what to do


def test_hybrid_cache_list_keeps_its_state_cache():
    """falcon_h1 keeps SSM state and KV cache of a layer in one CacheList: the
    KV member becomes an H2O cache (evicting here), the state stays."""
    model = tiny_model("falcon_h1")
    caches = make_h2o_cache(model, H2OConfig(max_size=8, sink_size=2, heavy_budget=3))
    plain = make_prompt_cache(model)
    for c, p in zip(caches, plain):
        assert [type(m) for m in c.caches] == [type(p.caches[0]), H2OKVCache]
    tokens = mx.random.randint(0, 64, (1, 16), key=mx.random.key(2))
    teacher_forced(model, caches, tokens, 12)
    stats = cache_stats(caches)
    assert (stats.layers, stats.tokens_seen, stats.tokens_kept) == (2, 16, 8)
