"""Reproducible token windows for perplexity, and tokenizer helpers.

Works with Hugging Face tokenizers and mlx-lm's ``TokenizerWrapper``.
"""

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (HF tokenizer or mlx-lm wrapper)."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # tokenizers without the keyword
        return list(tokenizer.encode(text))


def special_prefix(tokenizer: Any) -> list[int]:
    """The tokens the tokenizer puts before any text by default (e.g. ``[BOS]``)."""
    try:
        full = list(tokenizer.encode("a"))
    except TypeError:
        return []
    bare = encode(tokenizer, "a")
    return (
        full[: len(full) - len(bare)] if full[len(full) - len(bare) :] == bare else []
    )


def _encode_batch(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # unwrap mlx-lm's TokenizerWrapper
    if callable(hf) and hasattr(hf, "batch_decode"):  # HF tokenizer: batched in Rust
        return list(hf(texts, add_special_tokens=False)["input_ids"])
    return [encode(tokenizer, t) for t in texts]


def _cut(tokens: np.ndarray, body: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Disjoint ``body``-token windows of ``tokens`` from a random offset."""
    offset = int(rng.integers(0, len(tokens) % body + 1))
    return [tokens[s : s + body] for s in range(offset, len(tokens) - body + 1, body)]


def _windows(
    tokenizer: Any,
    docs: Sequence[str],
    body: int,
    rng: np.random.Generator,
    want: int,
    sep: list[int],
) -> list[np.ndarray]:
    """Windows from long documents; short ones are joined (with ``sep``) into one
    stream. Documents are tokenized in a random order until ``want`` windows exist
    and ``want`` documents were seen (or all are)."""
    order, windows, stream, seen = rng.permutation(len(docs)), [], [], 0
    while seen < len(docs):
        batch = [docs[i] for i in order[seen : seen + 16]]
        seen += len(batch)
        for toks in _encode_batch(tokenizer, batch):
            if len(toks) >= body:
                windows += _cut(np.asarray(toks, np.int64), body, rng)
            elif toks:
                stream += (sep if stream else []) + toks
        if seen >= want and len(windows) + len(stream) // body >= want:
            break
    return windows + (_cut(np.asarray(stream, np.int64), body, rng) if stream else [])


def sample_token_windows(
    tokenizer: Any,
    corpus_docs: Sequence[str],
    n_samples: int,
    seq_len: int,
    seed: int,
    *,
    separator: str = "\n\n",
    bos: bool = False,
    oversample: float = 8.0,
) -> mx.array:
    """Draw ``n_samples`` disjoint windows of ``seq_len`` tokens, reproducibly.

    Documents with at least ``seq_len`` tokens give windows on their own; shorter
    ones are concatenated, ``separator`` between them, so no window holds
    padding. Documents are tokenized in a seeded random order until
    ``oversample * n_samples`` candidate windows (and as many documents) are
    available; the windows are then chosen at random among those.

    Args:
        bos: start every window with the tokenizer's special prefix (e.g. BOS),
            followed by ``seq_len - len(prefix)`` text tokens.

    Returns:
        int32 array of shape ``(n_samples, seq_len)``.
    """
    if n_samples < 1 or seq_len < 2:
        raise ValueError(
            f"need n_samples >= 1 and seq_len >= 2, got {n_samples}, {seq_len}"
        )
    rng = np.random.default_rng(seed)
    prefix = special_prefix(tokenizer) if bos else []
    body = seq_len - len(prefix)
    want = max(n_samples, int(np.ceil(oversample * n_samples)))
    windows = _windows(
        tokenizer, corpus_docs, body, rng, want, encode(tokenizer, separator)
    )
    if len(windows) < n_samples:
        raise ValueError(
            f"corpus gives only {len(windows)} windows of {seq_len} tokens, need {n_samples}"
        )
    picks = rng.choice(len(windows), size=n_samples, replace=False)
    rows = [np.concatenate([np.asarray(prefix, np.int64), windows[i]]) for i in picks]
    return mx.array(np.stack(rows).astype(np.int32))
