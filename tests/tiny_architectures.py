"""Tiny random-weight models of every mlx-lm architecture (tests/test_architectures.py).

A case is a module of ``mlx_lm.models`` (``"llama"``) or a variant of one
(``"gemma4_text+kv_shared"``). Its config is ``TINY`` (the fields its
``ModelArgs`` has), then ``CONFIGS[module]``, then ``CONFIGS[case]``; a
wrapper's ``text_config`` is built the same way from ``TEXT_MODEL_TYPE`` and the
``".text"`` entries.
"""

import copy
import importlib
import inspect

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

# Modules of mlx_lm.models that are building blocks, not architectures.
HELPERS = {
    "activations", "base", "bitlinear_layers", "cache", "gated_delta", "mla",
    "pipeline", "rope_utils", "ssm", "switch_layers",
}

# Architectures not built here, and why.
NOT_BUILT = {
    "olmo": "its module imports hf_olmo (pip install ai2-olmo) and exits without it",
    "prism_hadamard_qwen35": "a 2-bit Hadamard-rotated weight pack (128-wide packed layers "
    "and a module manifest); its text model is qwen3_5's, built here",
}

# Built only where Metal runs: their layers call Metal-only kernels.
NEEDS_METAL = {"bitnet", "muse_spark"}

TINY = dict(
    hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, vocab_size=64, rms_norm_eps=1e-5,
    layer_norm_eps=1e-5, layer_norm_epsilon=1e-5, norm_eps=1e-5, rope_theta=10000.0,
    max_position_embeddings=256, attention_bias=False, mlp_bias=False, use_bias=False,
    tie_word_embeddings=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    n_shared_experts=1, n_routed_experts=4, num_shared_experts=1,
    shared_expert_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], first_k_dense_replace=1, routed_scaling_factor=1.0, n_group=1,
    topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
    v_head_dim=8, partial_rotary_factor=0.5, sliding_window=8, sliding_window_pattern=2,
)

SLIDING_FULL = ["sliding_attention", "full_attention"]
ROPE_PER_TYPE = {t: dict(rope_theta=10000.0) for t in SLIDING_FULL}
LLAMA4_ROPE = dict(rope_theta=10000.0, rope_type="default", llama_4_scaling_beta=0.1,
                   original_max_position_embeddings=256)
MUP = dict(logits_scaling=1.0, attention_multiplier=0.125, embedding_multiplier=1.0,
           residual_multiplier=1.0)
MLA_LONGCAT = dict(ffn_hidden_size=64, moe_topk=2, expert_ffn_hidden_size=32, zero_expert_num=1,
                   num_layers=2, mla_scale_q_lora=True, mla_scale_kv_lora=True)
LINEAR_ATTN = dict(linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                   linear_value_head_dim=8, linear_conv_kernel_dim=4)
KDA = dict(kda_layers=[1], num_heads=4, head_dim=8, short_conv_kernel_size=4)

CONFIGS = {
    "afm7": dict(hidden_dim=32, num_layers=3, num_kv_reuse_layers=1, num_heads=4, num_kv_heads=2),
    "afmoe": dict(layer_types=SLIDING_FULL, num_dense_layers=1),
    "apertus": dict(post_norm=False, qk_norm=True),
    "baichuan_m1": dict(sliding_window_layers=[0], conv_window=2, tie_word_embeddings=False),
    "bailing_hybrid": dict(layer_group_size=2, group_norm_size=1),
    "bailing_moe_linear": dict(layer_group_size=2, group_norm_size=1),
    "cohere": dict(logit_scale=1.0),
    "cohere2": dict(logit_scale=1.0),
    "dbrx": dict(d_model=32, n_layers=2, n_heads=4,
                 ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2),
                 attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0)),
    "deepseek_v2": dict(rope_scaling=dict(factor=1.0, original_max_position_embeddings=256,
                                          beta_fast=32, beta_slow=1, mscale=1, mscale_all_dim=0)),
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2),
    "exaone": dict(num_layers=2),
    "exaone4": dict(rope_scaling=None, sliding_window_pattern="LG"),
    "exaone_moe": dict(layer_types=SLIDING_FULL, is_moe_layer=[False, True]),
    "falcon_h1": dict(lm_head_multiplier=1.0, embedding_multiplier=1.0),
    "gear": dict(layer_types=SLIDING_FULL),
    # As the released Gemma 3n checkpoints: the last layers reuse earlier layers' KV.
    "gemma3n.text": dict(
        num_hidden_layers=4, num_kv_shared_layers=2, vocab_size_per_layer_input=64,
        rope_local_base_freq=10000.0, final_logit_softcapping=30.0, layer_types=SLIDING_FULL * 2,
        activation_sparsity_pattern=[0.0] * 4, hidden_size_per_layer_input=8, altup_num_inputs=2,
        altup_coef_clip=120.0, altup_correct_scale=True, altup_active_idx=0, laurel_rank=4),
    "gemma4_text": dict(num_kv_shared_layers=0, global_head_dim=16, hidden_size_per_layer_input=8,
                        vocab_size_per_layer_input=64),
    "gemma4_text+kv_shared": dict(num_hidden_layers=4, num_kv_shared_layers=2),
    "glm4_moe": dict(rope_scaling=None, use_qk_norm=True),
    "glm_moe_dsa": dict(index_head_dim=16, index_n_heads=2, index_topk=4, topk_method="noaux_tc",
                        scoring_func="sigmoid", moe_layer_freq=1,
                        rope_parameters=dict(rope_theta=10000.0, rope_type="default")),
    "gpt2": dict(n_ctx=256, n_embd=32, n_head=4, n_layer=2, n_positions=256),
    "gpt_bigcode": dict(n_embd=32, n_layer=2, n_inner=64, n_head=4, n_positions=256),
    "gpt_neox": dict(rotary_emb_base=10000, rotary_pct=0.5),
    "gptj": dict(n_embd=32, n_head=4, rotary_dim=4, n_layer=2, n_positions=256),
    "granite": MUP,
    "granitemoe": dict(MUP, num_local_experts=4),
    "granitemoehybrid": dict(
        MUP, layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=8,
        mamba_proj_bias=False, mamba_d_state=8, mamba_d_conv=4, mamba_n_groups=1,
        mamba_conv_bias=True, shared_intermediate_size=64),
    "hunyuan": dict(moe_topk=2, num_shared_expert=1, use_mixed_mlp_moe=True, use_qk_norm=True,
                    use_cla=False, cla_share_factor=2,
                    rope_scaling=dict(alpha=1.0, factor=1.0, type="dynamic")),
    # Cross-layer attention shares K/V projections, each layer keeps its own cache.
    "hunyuan+cla": dict(use_cla=True),
    "jamba": dict(attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1,
                  expert_layer_period=2, mamba_d_conv=4, mamba_d_state=8, mamba_expand=2),
    "kimi_k3.text": dict(linear_attn_config=KDA, num_experts_per_token=2, mla_use_nope=True),
    "kimi_linear": dict(linear_attn_config=KDA, model_max_length=256, mla_use_nope=True),
    "lfm2": dict(conv_bias=False, conv_L_cache=3, block_dim=32, block_multiple_of=16,
                 block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
                 layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(use_expert_bias=True, num_dense_layers=1, conv_bias=False, conv_L_cache=3,
                     layer_types=["conv", "full_attention"]),
    "lille-130m": dict(block_size=256, n_embd=64, n_head=4, n_kv_heads=2, n_layer=2),
    "llama4.text": dict(attention_chunk_size=8, interleave_moe_layer_step=2, num_hidden_layers=4,
                        num_local_experts=4, num_experts_per_tok=1, rope_scaling=None),
    "llama4_text": dict(intermediate_size_mlp=64, no_rope_layers=[1, 0], use_qk_norm=True),
    "longcat_flash": dict(MLA_LONGCAT, attention_method="MLA", zero_expert_type="identity"),
    "longcat_flash_ngram": dict(MLA_LONGCAT, ngram_vocab_size_ratio=2),
    "mamba": dict(state_size=8, conv_kernel=4, use_conv_bias=True, time_step_rank=4),
    "mamba2": dict(num_heads=4, state_size=8, conv_kernel=4, n_groups=1, use_conv_bias=True,
                   time_step_limit=(0.0, float("inf")), time_step_rank=4),
    "mellum": dict(layer_types=SLIDING_FULL, rope_parameters=ROPE_PER_TYPE),
    "mimo_v2_flash": dict(
        hybrid_layer_pattern=[1, 0], moe_layer_freq=[0, 1], add_swa_attention_sink_bias=True,
        add_full_attention_sink_bias=False, sliding_window_size=8, topk_method="noaux_tc",
        scoring_func="sigmoid", layernorm_epsilon=1e-5, swa_rope_theta=10000.0,
        swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, swa_v_head_dim=8),
    "minicpm": dict(dim_model_base=32, scale_depth=1.4, scale_emb=1.0, tie_word_embeddings=False),
    "minicpm3": dict(dim_model_base=32, scale_depth=1.4, scale_emb=1.0, tie_word_embeddings=False,
                     rope_scaling=dict(original_max_position_embeddings=256)),
    "minimax": dict(num_local_experts=4, shared_intermediate_size=32, rotary_dim=4),
    "minimax_m3_vl.text": dict(
        dense_intermediate_size=64, shared_intermediate_size=32, num_local_experts=4,
        index_n_heads=2, index_head_dim=8, index_block_size=4, index_topk_blocks=2,
        layer_types=["full_attention", "sparse_attention"]),
    "ministral3": dict(rope_parameters=LLAMA4_ROPE),
    "mistral4": dict(rope_parameters=LLAMA4_ROPE),
    "muse_spark.text": dict(
        post_norm_eps=1e-5, rope_parameters=dict(rope_theta=10000.0),
        layer_rope_theta=[10000.0, 0], layer_types=SLIDING_FULL, final_logit_softcapping=30.0,
        output_multiplier=1.0, num_local_experts=4, moe_hidden_size=32, num_shared_experts=0),
    "nemotron": dict(hidden_act="relu2"),
    "nemotron-nas": dict(block_configs=[
        dict(attention=dict(n_heads_in_group=2), ffn=dict(ffn_mult=1.0)),
        dict(attention=dict(no_op=True), ffn=dict(ffn_mult=1.0))]),
    "nemotron_h": dict(mamba_num_heads=4, mamba_head_dim=8, mamba_proj_bias=False,
                       ssm_state_size=8, conv_kernel=4, n_groups=1, use_conv_bias=True,
                       hybrid_override_pattern=["M", "*", "-"], num_hidden_layers=3),
    "olmo3": dict(layer_types=SLIDING_FULL),
    "olmo_hybrid": dict(LINEAR_ATTN, linear_allow_neg_eigval=True,
                        layer_types=["linear_attention", "full_attention"]),
    "openelm": dict(num_transformer_layers=2, model_dim=32, ffn_dim_divisor=16,
                    num_query_heads=[4, 4], num_kv_heads=[2, 2], ffn_multipliers=[1.0, 1.0]),
    # Refused, so only traced: evaluating its block-sparse attention at these
    # sizes corrupts memory on MLX 0.32.4's CPU backend (plain mlx-lm too).
    "phi3small": dict(dense_attention_every_n_layers=2, ff_intermediate_size=64,
                      gegelu_limit=20.0),
    "phixtral": dict(num_vocab=64, model_dim=32, num_heads=4, num_layers=2, rotary_dim=4),
    "plamo": dict(n_shared_head=2),
    "plamo2": dict(hidden_size_per_head=8, attention_window_size=8, full_attention_idx=[1],
                   mamba_d_state=8, mamba_num_heads=4, mamba_chunk_size=8),
    # Its prompt mask spans window + 1 tokens, its RotatingKVCache (and H2O's
    # window) keep `window`: the same only while the sequence fits the window.
    "plamo3": dict(sliding_window=16),
    "qwen": dict(kv_channels=8),
    "qwen3_5.text": dict(LINEAR_ATTN, full_attention_interval=2, rope_parameters=dict(
        type="default", mrope_section=[1, 1, 0], rope_theta=10000.0, partial_rotary_factor=0.5)),
    "qwen3_next": dict(LINEAR_ATTN, full_attention_interval=2),
    "recurrent_gemma": dict(conv1d_width=4, logits_soft_cap=30.0, attention_window_size=8,
                            block_types=["recurrent", "attention"]),
    "rwkv7": dict(a_low_rank_dim=8, v_low_rank_dim=8, gate_low_rank_dim=8, decay_low_rank_dim=8),
    "spark2_5": dict(rope_parameters=ROPE_PER_TYPE, layer_types=SLIDING_FULL),
    "stablelm": dict(use_qkv_bias=False),
    "step3p5": dict(num_attention_groups=2, moe_num_experts=4, moe_top_k=2, share_expert_dim=32,
                    layer_types=SLIDING_FULL),
}

# model_type of a wrapper's text_config (default: the wrapper's own).
TEXT_MODEL_TYPE = {
    "gemma3": "gemma3_text", "gemma4": "gemma4_text", "kimi_k25": "deepseek_v3",
    "kimi_vl": "deepseek_v3", "lfm2-vl": "lfm2", "llama4": "llama4_text",
    "mistral3": "ministral3", "pixtral": "llama", "qwen2_vl": "qwen2", "qwen3_5_moe": "qwen3_5",
    "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe",
}


def module_of(case: str) -> str:
    return case.split("+")[0]


def tiny_config(case: str) -> dict:
    name = module_of(case)
    fields = inspect.signature(_module(name).ModelArgs).parameters
    cfg = {**TINY, "model_type": name, **CONFIGS.get(name, {}), **CONFIGS.get(case, {})}
    if "text_config" in fields and "text_config" not in cfg:
        text = TEXT_MODEL_TYPE.get(name, name)
        cfg["text_config"] = {**TINY, "model_type": text, **CONFIGS.get(text, {})}
        for key in (text + ".text", name + ".text", case + ".text"):
            cfg["text_config"].update(CONFIGS.get(key, {}))
    return copy.deepcopy(cfg)  # ModelArgs may edit the dicts they get


def tiny_model(case: str, seed: int = 0):
    """The case's model with random weights: N(0, 0.3) matrices (peaky
    attention), norm weights at their default +- 0.1 (logits of order 1-10)."""
    module = _module(module_of(case))
    model = module.Model(module.ModelArgs.from_dict(tiny_config(case)))
    mx.random.seed(seed)
    params = [(k, _random_like(k, v)) for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def _random_like(name, v):
    if not mx.issubdtype(v.dtype, mx.floating):
        return v
    if "norm" in name:
        return v + 0.1 * mx.random.normal(v.shape, dtype=v.dtype)
    return 0.3 * mx.random.normal(v.shape, dtype=v.dtype)


def _module(name):
    return importlib.import_module(f"mlx_lm.models.{name}")
