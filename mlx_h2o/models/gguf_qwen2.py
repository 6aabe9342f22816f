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
from .gguf_llama import BLOCK_NAMES, TOP_NAMES, rope_scaling

ARCH = "qwen2"


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
        "rope_scaling": rope_scaling(meta, p),
        "max_position_embeddings": meta_value(meta, f"{p}.context_length", 32768),
        "tie_word_embeddings": "output.weight" not in names,
    }


def convert_tensor(
    name: str, array: np.ndarray, config: Mapping[str, Any]
) -> tuple[str, np.ndarray]:
    """(mlx-lm name, array) for one dequantized GGUF tensor."""
    return rename(name, TOP_NAMES, BLOCK_NAMES), array
