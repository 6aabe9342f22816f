"""A Hugging Face tokenizer built from a GGUF file's metadata.

transformers' `AutoTokenizer.from_pretrained(gguf_file=...)` reads the file with
torch; its converter (`convert_gguf_tokenizer`) does not, so we read the
metadata with the `gguf` package and hand it the same dictionary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from tokenizers import pre_tokenizers

from .gguf_convert import meta_value

# tokenizer.ggml.<key> -> the key transformers' converter expects
_TOKENIZER_KEYS = {
    "model": "tokenizer_type",
    "pre": "pre_tokenizer_type",
    "tokens": "tokens",
    "scores": "scores",
    "token_type": "token_type",
    "merges": "merges",
}
_SPECIAL_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}
# Tokens that end a document or a turn; generation also stops at these.
_END_TOKENS = ("<|endoftext|>", "<|im_end|>", "<end_of_turn>", "<eos>")


def _smollm_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    # SmolLM2's tokenizer.json (and llama.cpp's "smollm" pre-tokenizer): single
    # digits, then GPT-2's byte-level split. transformers has no entry for it.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


_PRE_TOKENIZERS = {"smollm": _smollm_pre_tokenizer}


def _tokenizer_dict(meta: Mapping[str, Any]) -> dict[str, Any]:
    return {
        name: meta[f"tokenizer.ggml.{key}"]
        for key, name in _TOKENIZER_KEYS.items()
        if f"tokenizer.ggml.{key}" in meta
    }


def _token(meta: Mapping[str, Any], key: str) -> str | None:
    token_id = meta.get(f"tokenizer.ggml.{key}")
    tokens = meta["tokenizer.ggml.tokens"]
    return tokens[token_id] if token_id is not None and token_id < len(tokens) else None


def _config_kwargs(meta: Mapping[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {k: _token(meta, v) for k, v in _SPECIAL_IDS.items()}
    # Older sentencepiece files have no flag; llama.cpp then adds BOS.
    default_bos = meta.get("tokenizer.ggml.model") == "llama"
    kwargs["add_bos_token"] = bool(
        meta.get("tokenizer.ggml.add_bos_token", default_bos)
    )
    kwargs["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if meta.get("tokenizer.chat_template"):
        kwargs["chat_template"] = meta["tokenizer.chat_template"]
    return {k: v for k, v in kwargs.items() if v is not None}


def _gguf_converter():
    """transformers' GGUF tokenizer converter (in integrations/gguf from 5.18;
    before that in integrations/ggml, with another tokenizer layout)."""
    import transformers

    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
        )
    except ImportError as e:
        raise ImportError(
            f"mlx-h2o builds tokenizers from GGUF with transformers >= 5.18, found "
            f"transformers {transformers.__version__} ({e}): "
            "pip install -U 'transformers>=5.18'"
        ) from e
    return convert_gguf_tokenizer


def build_tokenizer(meta: Mapping[str, Any]) -> Any:
    """A `PreTrainedTokenizerFast` for the vocabulary in GGUF metadata `meta`."""
    from transformers import PreTrainedTokenizerFast

    convert_gguf_tokenizer = _gguf_converter()
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError("the GGUF file has no tokenizer (tokenizer.ggml.tokens)")
    tok_dict = _tokenizer_dict(meta)
    backend, _ = convert_gguf_tokenizer(
        meta_value(meta, "general.architecture"), tok_dict
    )
    pre = _PRE_TOKENIZERS.get(tok_dict.get("pre_tokenizer_type"))
    if pre is not None:
        backend.pre_tokenizer = pre()
    return PreTrainedTokenizerFast(tokenizer_object=backend, **_config_kwargs(meta))


def special_token_ids(meta: Mapping[str, Any]) -> dict[str, Any]:
    """`bos_token_id`, `eos_token_id` (a list: the file's EOS first, then the
    vocabulary's other end tokens) and `pad_token_id`, for config.json."""
    tokens = meta.get("tokenizer.ggml.tokens", [])
    index = {t: i for i, t in enumerate(tokens) if t in _END_TOKENS}
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = ([eos] if eos is not None else []) + sorted(set(index.values()) - {eos})
    ids = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids or None,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    return {k: v for k, v in ids.items() if v is not None}


def save_tokenizer(meta: Mapping[str, Any], out_dir: str | Path) -> None:
    """Write tokenizer.json, tokenizer_config.json (and chat_template.jinja when
    the file has a chat template) to `out_dir`."""
    build_tokenizer(meta).save_pretrained(str(out_dir))
