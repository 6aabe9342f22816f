"""GGUF `qwen2` architecture -> mlx-lm `qwen2` model.

Unlike its `llama` converter, llama.cpp writes Qwen2's Q and K projections
unpermuted (its qwen2 kernels use the "rotate half" RoPE layout, as mlx-lm
does), so every tensor is only renamed. Q, K and V carry biases; mlx-lm's
qwen2 derives the head dimension as hidden_size / heads.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .gguf_convert import meta_value, rename

ARCH = "qwen2"

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
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _rope_scaling(meta: Mapping[str, Any]) -> dict[str, Any] | None:
    kind = meta_value(meta, f"{ARCH}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        factor = meta_value(meta, f"{ARCH}.rope.scaling.factor")
        return {"type": "linear", "factor": factor}
    raise ValueError(f"unsupported rope scaling {kind!r} in a qwen2 GGUF")


def make_config(meta: Mapping[str, Any], names: set[str]) -> dict[str, Any]:
    """config.json contents for mlx-lm's `qwen2` model."""
    p = ARCH
    hidden = meta_value(meta, f"{p}.embedding_length")
    n_head = meta_value(meta, f"{p}.attention.head_count")
    head_dim = meta_value(meta, f"{p}.attention.key_length", hidden // n_head)
    if head_dim * n_head != hidden:
        raise ValueError(f"qwen2 GGUF with head_dim {head_dim} x {n_head} heads != "
                         f"hidden size {hidden}: mlx-lm's qwen2 cannot hold it")
    if "blk.0.attn_q.bias" not in names:
        raise ValueError("qwen2 GGUF without Q/K/V biases: mlx-lm's qwen2 expects them")
    tokens = meta_value(meta, "tokenizer.ggml.tokens", ())
    return {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": meta_value(meta, f"{p}.block_count"),
        "intermediate_size": meta_value(meta, f"{p}.feed_forward_length"),
        "num_attention_heads": n_head,
        "num_key_value_heads": meta_value(meta, f"{p}.attention.head_count_kv", n_head),
        "rms_norm_eps": meta_value(meta, f"{p}.attention.layer_norm_rms_epsilon"),
        "vocab_size": meta_value(meta, f"{p}.vocab_size", len(tokens)),
        "rope_theta": meta_value(meta, f"{p}.rope.freq_base", 1_000_000.0),
        "rope_scaling": _rope_scaling(meta),
        "max_position_embeddings": meta_value(meta, f"{p}.context_length", 32768),
        "tie_word_embeddings": "output.weight" not in names,
    }


def convert_tensor(
    name: str, array: np.ndarray, config: Mapping[str, Any]
) -> tuple[str, np.ndarray]:
    """(mlx-lm name, array) for one dequantized GGUF tensor."""
    return rename(name, _TOP, _BLOCK), array
