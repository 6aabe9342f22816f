"""GGUF `gemma3` architecture (text only) -> mlx-lm `gemma3_text` model.

Gemma's RMSNorm scales by (1 + w). llama.cpp's converter stores every
`*norm.weight` as 1 + w so its kernels can multiply by the weight directly;
mlx-lm's gemma3_text RMSNorm adds the 1 itself, so we subtract it back. Gemma
uses the "rotate half" RoPE layout in both, so Q/K rows are not reordered.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .gguf_convert import meta_value, rename

ARCH = "gemma3"

_TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _rope_scaling(meta: Mapping[str, Any]) -> dict[str, Any] | None:
    kind = meta_value(meta, f"{ARCH}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":  # Gemma 3 4B+ scale the global layers' RoPE linearly
        factor = meta_value(meta, f"{ARCH}.rope.scaling.factor")
        return {"rope_type": "linear", "factor": factor}
    raise ValueError(f"unsupported rope scaling {kind!r} in a gemma3 GGUF")


def make_config(meta: Mapping[str, Any], names: set[str]) -> dict[str, Any]:
    """config.json contents for mlx-lm's `gemma3_text` model.

    `rope_local_base_freq`, `query_pre_attn_scalar` and `sliding_window_pattern`
    are not in the metadata of llama.cpp's gemma3 GGUFs (the package spec gives
    them); a `sliding_window_pattern` key is used when present.
    """
    p = ARCH
    tokens = meta_value(meta, "tokenizer.ggml.tokens", ())
    config = {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": meta_value(meta, f"{p}.embedding_length"),
        "num_hidden_layers": meta_value(meta, f"{p}.block_count"),
        "intermediate_size": meta_value(meta, f"{p}.feed_forward_length"),
        "num_attention_heads": meta_value(meta, f"{p}.attention.head_count"),
        "num_key_value_heads": meta_value(meta, f"{p}.attention.head_count_kv"),
        "head_dim": meta_value(meta, f"{p}.attention.key_length"),
        "rms_norm_eps": meta_value(meta, f"{p}.attention.layer_norm_rms_epsilon"),
        "vocab_size": meta_value(meta, f"{p}.vocab_size", len(tokens)),
        "rope_theta": meta_value(meta, f"{p}.rope.freq_base"),
        "rope_scaling": _rope_scaling(meta),
        "sliding_window": meta_value(meta, f"{p}.attention.sliding_window"),
        "max_position_embeddings": meta_value(meta, f"{p}.context_length"),
        "tie_word_embeddings": "output.weight" not in names,
    }
    pattern = meta_value(meta, f"{p}.attention.sliding_window_pattern", None)
    if isinstance(pattern, int):
        config["sliding_window_pattern"] = pattern
    return config


def convert_tensor(
    name: str, array: np.ndarray, config: Mapping[str, Any]
) -> tuple[str, np.ndarray]:
    """(mlx-lm name, array) for one dequantized GGUF tensor."""
    if name.endswith("norm.weight"):
        array = array - np.float32(1.0)
    return rename(name, _TOP, _BLOCK), array
