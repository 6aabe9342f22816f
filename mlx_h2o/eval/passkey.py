"""Passkey retrieval through bounded KV caches.

A random number is stated once at a given depth inside long filler text and
asked for at the end (``passkey_data.make_passkey_prompt``). The prompt is
prefilled in chunks of ``prefill_step`` tokens (mlx-lm's generate uses 2048),
so eviction happens while the prompt streams in; then a few tokens are decoded
greedily. A trial is correct when the answer's digits appear in the output.
Prompts of equal length run as one batch.
"""

import time
from typing import Any

import mlx.core as mx

from ..integration.preview import preview_prompt
from ..integration.routing import patch
from .common import eval_cache, progress
from .strategies import Strategy


def prefill(model, tokens: mx.array, cache, step: int) -> mx.array:
    """Feed (B, L) tokens in chunks of ``step``; the last position's logits (B, V).

    Only the last token goes through the LM head: logits for every prompt
    position would take B * step * vocab floats (2 GB per sample for Gemma 3).
    """
    body = getattr(model, "model", None)
    L = tokens.shape[1]
    for s in range(0, L, step):
        chunk = tokens[:, s : min(s + step, L)]
        if body is not None:
            if s + step >= L and chunk.shape[1] > 1:
                eval_cache(body(chunk[:, :-1], cache=cache), cache)
                chunk = chunk[:, -1:]
            elif s + step < L:
                eval_cache(body(chunk, cache=cache), cache)
                continue
        logits = model(chunk, cache=cache)[:, -1]
        eval_cache(logits, cache)
    return logits


def greedy(model, logits: mx.array, cache, n: int) -> mx.array:
    """(B, n) greedy continuation from ``logits`` (B, V)."""
    out = []
    for i in range(n):
        tok = mx.argmax(logits, axis=-1)
        out.append(tok)
        if i + 1 < n:
            logits = model(tok[:, None], cache=cache)[:, -1]
            eval_cache(logits, cache)
    return mx.stack(out, axis=1)


def digits(text: str) -> str:
    return "".join(ch for ch in text if ch.isdigit())


def is_correct(output: str, answer: str) -> bool:
    """The answer's digits appear, in order and adjacent, in the output's digits."""
    want = digits(str(answer))
    return bool(want) and want in digits(output)


def run_batch(model, tokenizer, prompts, strategy: Strategy, max_kv: int,
              prefill_step: int, new_tokens: int) -> list[dict[str, Any]]:
    """Trials whose prompts have one length, as one batch; one dict per trial."""
    tokens = mx.array([list(map(int, p["tokens"])) for p in prompts])
    cache = strategy.make_cache(model, max_kv)
    preview_prompt(model, cache, tokens, prefill_step)
    with patch():
        logits = prefill(model, tokens, cache, prefill_step)
        out = greedy(model, logits, cache, new_tokens).tolist()
    return [score_trial(p, tokenizer.decode(ids)) for p, ids in zip(prompts, out)]


def score_trial(p: dict[str, Any], text: str) -> dict[str, Any]:
    """One trial's row: a passkey (``answer``: its digits) or a retrieval task
    (``answers``: every one must appear, ``retrieval_data.score_output``)."""
    row = {"context": p["context"], "depth": p["depth"], "seed": p["seed"], "output": text}
    if "answers" not in p:
        return row | {"answer": str(p["answer"]), "correct": is_correct(text, p["answer"])}
    from .retrieval_data import score_output

    stop = p.get("stop")  # the end of the model's turn: later text is not its answer
    correct, recall = score_output(text.split(stop)[0] if stop else text, p["answers"])
    return row | {"task": p["task"], "answers": list(p["answers"]), "correct": correct,
                  "recall": recall}


def run_strategy(model, tokenizer, prompts, strategy: Strategy, max_kv: int,
                 prefill_step: int = 2048, new_tokens: int = 8, batch_size: int = 0,
                 show: bool = False) -> dict[str, Any]:
    """All trials for one strategy at one budget, batched by prompt length."""
    strategy = strategy.for_model(model)
    groups: dict[int, list] = {}
    for p in prompts:
        groups.setdefault(len(p["tokens"]), []).append(p)
    batches = []
    for group in groups.values():
        step = batch_size if 0 < batch_size < len(group) else len(group)
        batches += [group[i : i + step] for i in range(0, len(group), step)]
    tic, rows = time.perf_counter(), []
    desc = f"{strategy.name} " + (f"kv={max_kv}" if strategy.bounded else "(unbounded)")
    for batch in progress(batches, desc=desc, enabled=show):
        rows += run_batch(model, tokenizer, batch, strategy, max_kv, prefill_step,
                          new_tokens)
    acc = sum(r["correct"] for r in rows) / len(rows)
    result = strategy.describe(max_kv)
    result.update(accuracy=acc, trials=rows, seconds=time.perf_counter() - tic,
                  prefill_step=prefill_step)
    return result


def make_prompts(tokenizer, contexts, depths, trials: int, seed: int = 0):
    """The grid of prompts: every context length x depth x trial."""
    from .passkey_data import make_passkey_prompt

    prompts = []
    for ctx in contexts:
        for depth in depths:
            for t in range(trials):
                s = seed + 1000 * t + int(depth * 100) + ctx
                tokens, answer = make_passkey_prompt(tokenizer, ctx, depth, s)
                if isinstance(tokens, mx.array):
                    tokens = tokens.reshape(-1).tolist()
                prompts.append({"context": ctx, "depth": depth, "seed": s,
                                "tokens": list(tokens), "answer": answer})
    return prompts


def accuracy_grid(result: dict[str, Any]) -> dict[tuple, float]:
    """{(context, depth): accuracy} of one strategy's trials."""
    hits: dict[tuple, list] = {}
    for r in result["trials"]:
        hits.setdefault((r["context"], r["depth"]), []).append(r["correct"])
    return {k: sum(v) / len(v) for k, v in hits.items()}


def budget_tokens(budget: float, context: int) -> int:
    """A budget <= 1 is a fraction of the context; larger values are tokens."""
    return int(round(budget * context)) if budget <= 1 else int(budget)
