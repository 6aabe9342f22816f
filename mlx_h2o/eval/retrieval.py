"""The retrieval suite: RULER-style tasks (``retrieval_data``) run as passkey
trials are (``passkey.run_strategy``: chunked prefill, greedy answer)."""

from typing import Any, Sequence

from .passkey_data import DEFAULT_FILLER
from .retrieval_data import TASKS, make_retrieval_prompt

HAYSTACK_CHARS = 400_000  # enough text for 8K-token contexts without repeats


def haystack_text(name: str) -> str:
    """``noise`` (the passkey filler: the same five sentences over and over) or
    a corpus (``corpora.load_corpus``): its documents joined, the first
    ``HAYSTACK_CHARS`` characters."""
    if name == "noise":
        return DEFAULT_FILLER
    from .corpora import load_corpus

    text, docs = "", load_corpus(name)
    for d in docs:
        text += d + "\n\n"
        if len(text) >= HAYSTACK_CHARS:
            break
    return text[:HAYSTACK_CHARS]


def make_prompts(tokenizer, tasks: Sequence[str], contexts: Sequence[int],
                 depths: Sequence[float], seed: int = 0, haystack: str = DEFAULT_FILLER,
                 chat: bool = True) -> list[dict[str, Any]]:
    """Every context x task x depth, one prompt each (seeds differ per cell).
    An answer is scored up to the tokenizer's end-of-sequence text, if any."""
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise ValueError(f"unknown retrieval tasks {bad}; use some of {TASKS}")
    prompts, stop = [], getattr(tokenizer, "eos_token", None)
    for ctx in contexts:
        for ti, task in enumerate(tasks):
            for di, depth in enumerate(depths):
                s = seed + 100_000 * TASKS.index(task) + 1000 * di + ctx
                p = make_retrieval_prompt(tokenizer, task, ctx, depth, s, haystack, chat)
                prompts.append(p | {"context": ctx, "stop": stop})
    return prompts


def task_accuracy(result: dict[str, Any]) -> dict[str, float]:
    """{task: accuracy} of one strategy's trials, plus ``"mean"`` over tasks."""
    hits: dict[str, list] = {}
    for r in result["trials"]:
        hits.setdefault(r["task"], []).append(r["correct"])
    acc = {t: sum(v) / len(v) for t, v in hits.items()}
    acc["mean"] = sum(acc.values()) / len(acc)
    return acc


def _prompt_id(trial: dict[str, Any]) -> tuple:
    return trial["context"], trial["task"], trial["depth"]


def answers_kept(result: dict[str, Any], baseline: dict[str, Any]) -> tuple[int, int]:
    """(kept, answered): of the prompts the unbounded baseline answered, how
    many this strategy answered too. A prompt the model misses with every
    token kept says nothing about a cache, so this is the suite's score of
    an eviction policy; ``ValueError`` if the two ran different prompts."""
    full = {_prompt_id(t): t["correct"] for t in baseline["trials"]}
    mine = {_prompt_id(t): t["correct"] for t in result["trials"]}
    if set(full) != set(mine):
        raise ValueError("answers_kept: the result and the baseline ran different prompts")
    answered = [k for k, ok in full.items() if ok]
    return sum(mine[k] for k in answered), len(answered)


def kept_columns(result: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """A summary row's ``kept`` ("k/n", ``answers_kept``) and ``kept_frac``
    (k / n; None when the baseline answered nothing)."""
    k, n = answers_kept(result, baseline)
    return {"kept": f"{k}/{n}", "kept_frac": k / n if n else None}
