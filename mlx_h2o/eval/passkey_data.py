"""Passkey retrieval prompts: a 5-digit key hidden at a chosen depth in filler.

Prompt layout (each piece tokenized on its own, so lengths are exact):
    [special prefix] INTRO, filler sentences, NEEDLE, filler sentences, QUESTION
The needle goes at the sentence boundary nearest to ``depth`` of the filler;
a few newline tokens after INTRO make the length exact.
"""

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from .windows import encode, special_prefix

DEFAULT_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. "
    "Here we go. There and back again."
)
INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there."
)
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
MAX_NEWLINE_PAD = 16  # longer gaps are filled with a cut sentence instead


@dataclass
class PasskeyLayout:
    """Where things are in a passkey prompt (token indices)."""

    needle_start: int
    needle_end: int
    filler_start: int
    filler_end: int


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text`` with whitespace collapsed (split after . ! ?)."""
    parts = re.split(r"(?<=[.!?])\s+", " ".join(text.split()))
    return [p for p in parts if p]


def _filler_tokens(tokenizer, sentences: list[str], n_tokens: int, start: int):
    """Whole sentences (each with a leading space), cycled from index ``start``,
    as many as fit in ``n_tokens``. The gap left is closed with newline tokens
    (returned as ``pad``, to follow INTRO) when short, else with the head of the
    next sentence, so the count is exact. Returns (pad, tokens, boundaries)."""
    tokens, bounds, i, cache = [], [0], start, {}
    while True:
        idx = i % len(sentences)
        if idx not in cache:
            cache[idx] = encode(tokenizer, " " + sentences[idx])
        if not cache[idx]:
            raise ValueError("filler sentences encode to no tokens")
        if len(tokens) + len(cache[idx]) > n_tokens:
            break
        tokens += cache[idx]
        bounds.append(len(tokens))
        i += 1
    gap, newline = n_tokens - len(tokens), encode(tokenizer, "\n")
    if gap <= MAX_NEWLINE_PAD and len(newline) == 1:
        return newline * gap, tokens, bounds
    return [], tokens + cache[idx][:gap], bounds + [n_tokens]


def make_passkey_prompt_with_layout(
    tokenizer: Any,
    context_len: int,
    depth: float,
    seed: int,
    filler: str = DEFAULT_FILLER,
) -> tuple[list[int], str, PasskeyLayout]:
    """Like ``make_passkey_prompt``, also returning where needle and filler lie."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = np.random.default_rng(seed)
    key = str(int(rng.integers(10_000, 100_000)))
    sentences = split_sentences(filler)
    if not sentences:
        raise ValueError("filler text is empty")
    head = special_prefix(tokenizer) + encode(tokenizer, INTRO)
    needle = encode(tokenizer, NEEDLE.format(key=key))
    question = encode(tokenizer, QUESTION)
    fixed = len(head) + len(needle) + len(question)
    if context_len < fixed:
        raise ValueError(
            f"context_len={context_len} is shorter than the prompt's fixed parts: "
            f"intro, passkey and question take {fixed} tokens; use a longer context "
            "(filler text brings it to its length)"
        )
    n_filler = context_len - fixed
    start = int(rng.integers(len(sentences)))
    pad, tokens, bounds = _filler_tokens(tokenizer, sentences, n_filler, start)
    head += pad
    cut = min(bounds, key=lambda b: abs(b - depth * len(tokens)))
    prompt = head + tokens[:cut] + needle + tokens[cut:] + question
    layout = PasskeyLayout(
        needle_start=len(head) + cut,
        needle_end=len(head) + cut + len(needle),
        filler_start=len(head),
        filler_end=len(prompt) - len(question),
    )
    return prompt, key, layout


def make_passkey_prompt(
    tokenizer: Any,
    context_len: int,
    depth: float,
    seed: int,
    filler: str = DEFAULT_FILLER,
) -> tuple[list[int], str]:
    """A passkey retrieval prompt of exactly ``context_len`` tokens.

    A random 5-digit key (from ``seed``) is stated once ("The pass key is 71432.
    Remember it. 71432 is the pass key.") at relative ``depth`` (0 = start,
    1 = end of the filler), inside filler text cycled sentence by sentence
    (``DEFAULT_FILLER``, or any text such as a corpus document, entered at a
    seeded random sentence). The prompt ends with "What is the pass key? The
    pass key is"; the expected continuation is the key.

    Returns:
        (tokens, answer): token ids including the tokenizer's special prefix
        (e.g. BOS), and the key as a string such as ``"71432"``.
    """
    tokens, key, _ = make_passkey_prompt_with_layout(
        tokenizer, context_len, depth, seed, filler
    )
    return tokens, key
