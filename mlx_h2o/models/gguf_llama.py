"""GGUF `llama` architecture -> mlx-lm `llama` model.

llama.cpp's converter reorders the rows of the Q and K projections (its
`permute`, in convert_hf_to_gguf.py) from the Hugging Face "rotate half" RoPE
layout to the interleaved-pairs layout that its kernels use. mlx-lm's llama
uses the Hugging Face layout (`traditional=False`), so we undo it.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .gguf_convert import meta_value, rename, split_block_name

ARCH = "llama"

TOP_NAMES = {  # GGUF -> mlx-lm names outside the blocks (qwen2's too)
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
BLOCK_NAMES = {  # GGUF -> mlx-lm names inside a block (qwen2's too)
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


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's row reordering of a Q (n_head) or K (n_kv_heads) projection.

    Within each head, rows (first half, second half) become interleaved pairs.
    """
    # (n_head, 2, head_dim // 2, ...) -> (n_head, head_dim // 2, 2, ...)
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama_cpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `llama_cpp_permute`: interleaved pairs back to halves."""
    # (n_head, head_dim // 2, 2, ...) -> (n_head, 2, head_dim // 2, ...)
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def rope_scaling(meta: Mapping[str, Any], p: str) -> dict[str, Any] | None:
    """mlx-lm's rope_scaling of architecture ``p``'s GGUF metadata (linear or none)."""
    kind = meta_value(meta, f"{p}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {
            "type": "linear",
            "factor": meta_value(meta, f"{p}.rope.scaling.factor"),
        }
    raise ValueError(f"unsupported rope scaling {kind!r} in a {p} GGUF")


def make_config(meta: Mapping[str, Any], names: set[str]) -> dict[str, Any]:
    """config.json contents for mlx-lm's `llama` model."""
    p = ARCH
    hidden = meta_value(meta, f"{p}.embedding_length")
    n_head = meta_value(meta, f"{p}.attention.head_count")
    head_dim = meta_value(meta, f"{p}.attention.key_length", hidden // n_head)
    if meta_value(meta, f"{p}.rope.dimension_count", head_dim) != head_dim:
        raise ValueError("partial rotary embeddings are not supported for llama GGUFs")
    if "rope_freqs.weight" in names:
        raise ValueError("llama GGUFs with rope_freqs (llama-3 rope) are not supported")
    tokens = meta_value(meta, "tokenizer.ggml.tokens", ())
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": meta_value(meta, f"{p}.block_count"),
        "intermediate_size": meta_value(meta, f"{p}.feed_forward_length"),
        "num_attention_heads": n_head,
        "num_key_value_heads": meta_value(meta, f"{p}.attention.head_count_kv", n_head),
        "head_dim": head_dim,
        "rms_norm_eps": meta_value(meta, f"{p}.attention.layer_norm_rms_epsilon"),
        "vocab_size": meta_value(meta, f"{p}.vocab_size", len(tokens)),
        "rope_theta": meta_value(meta, f"{p}.rope.freq_base", 10_000.0),
        "rope_scaling": rope_scaling(meta, p),
        "max_position_embeddings": meta_value(meta, f"{p}.context_length", None),
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "tie_word_embeddings": "output.weight" not in names,
    }


def convert_tensor(
    name: str, array: np.ndarray, config: Mapping[str, Any]
) -> tuple[str, np.ndarray]:
    """(mlx-lm name, array) for one dequantized GGUF tensor."""
    _, rest = split_block_name(name)
    if rest.startswith("attn_q."):
        array = llama_cpp_unpermute(array, config["num_attention_heads"])
    elif rest.startswith("attn_k."):
        array = llama_cpp_unpermute(array, config["num_key_value_heads"])
    return rename(name, TOP_NAMES, BLOCK_NAMES), array
