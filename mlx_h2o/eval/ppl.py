"""Perplexity through bounded KV caches.

Two protocols, both on a batch of B equal-length samples run as one batch:

- ``decode`` (the H2O-in-MLX paper): prefill the first P tokens, then feed the
  rest one token at a time (teacher forcing) through the cache; the PPL is over
  the L - P decoded targets (positions P..L-1; the first one is predicted by
  the prefill's last logits, so every strategy sees the same prompt). The
  prefill is one chunk, or chunks of ``prefill_step`` tokens as mlx-lm's
  generate feeds a long prompt (where ``prefill_compact`` modes differ).
- ``chunked`` (full sequence): feed the sample in chunks of C tokens through
  the cache; the PPL is over every target 1..L-1. Eviction happens between
  chunks, the way a long prompt is prefilled.

PPL = exp(mean NLL over all scored tokens). Its standard error is taken over
samples (per-sample mean NLL, delta method), and the change vs the baseline
uses the paired per-sample NLL differences, which cancels most sample noise.
"""

import math
import time
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

from ..integration.preview import preview_prompt
from ..integration.routing import patch
from .common import eval_cache, mean_se, progress
from .strategies import Strategy


def _nll(logits: mx.array, targets: mx.array) -> mx.array:
    return nn.losses.cross_entropy(logits.astype(mx.float32), targets, reduction="none")


def decode_nll(model, tokens: mx.array, cache, prefill: int, show=False,
               prefill_step: int = 0) -> mx.array:
    """(B, L - prefill) NLL of tokens[:, prefill:], decoding one token at a
    time after a prefill in chunks of ``prefill_step`` tokens (0: one chunk)."""
    B, L = tokens.shape
    if not 0 < prefill < L:
        raise ValueError(f"prefill={prefill} must be in [1, {L - 1}] for L={L}")
    step = prefill_step if prefill_step > 0 else prefill
    steps = []
    bar = progress(total=L - prefill, desc="decode", enabled=show)
    preview_prompt(model, cache, tokens[:, :prefill], step)
    with patch():
        for s in range(0, prefill - step, step):  # every chunk but the last
            eval_cache(model(tokens[:, s : s + step], cache=cache), cache)
        last = (prefill - 1) // step * step
        logits = model(tokens[:, last:prefill], cache=cache)[:, -1]
        for t in range(prefill, L):
            nll = _nll(logits, tokens[:, t])
            eval_cache(nll, cache)
            steps.append(nll)
            bar.update()
            if t + 1 < L:
                logits = model(tokens[:, t : t + 1], cache=cache)[:, -1]
    bar.close()
    return mx.stack(steps, axis=1)


def chunked_nll(model, tokens: mx.array, cache, chunk: int, show=False) -> mx.array:
    """(B, L - 1) NLL of tokens[:, 1:], feeding chunks of ``chunk`` tokens."""
    B, L = tokens.shape
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    parts = []
    starts = list(range(0, L - 1, chunk))
    with patch():
        for s in progress(starts, desc="chunks", enabled=show):
            e = min(s + chunk, L - 1)
            logits = model(tokens[:, s:e], cache=cache)
            nll = _nll(logits, tokens[:, s + 1 : e + 1])
            eval_cache(nll, cache)
            parts.append(nll)
    return mx.concatenate(parts, axis=1)


def summarize(nll: mx.array) -> dict[str, Any]:
    """PPL, its standard error over samples, and the per-sample mean NLL."""
    per_sample = nll.astype(mx.float32).mean(axis=1).tolist()
    mean, se = mean_se(per_sample)
    ppl = math.exp(mean)
    return {"ppl": ppl, "ppl_se": ppl * se, "nll": mean, "nll_per_sample": per_sample,
            "tokens": int(nll.size)}


def compare(result: dict[str, Any], base: dict[str, Any]) -> dict[str, float]:
    """Change vs the baseline in %, with a paired standard error."""
    diffs = [a - b for a, b in zip(result["nll_per_sample"], base["nll_per_sample"])]
    mean, se = mean_se(diffs)
    ratio = math.exp(mean)
    return {"delta_pct": 100 * (ratio - 1), "delta_se_pct": 100 * ratio * se}


def ratio_vs(
    cand: dict[str, Any], ref: dict[str, Any], base: dict[str, Any],
    target: float = 1 / 3, boot: int = 10000, seed: int = 0,
) -> dict[str, Any]:
    """R = delta_cand / delta_ref (both in % vs ``base``, paired per sample).

    Returns both deltas, R with a delta-method standard error (the covariance
    of the two paired differences included) and a bootstrap 95% interval
    (samples resampled jointly), and the margin delta_cand - target * delta_ref
    with its standard error (negative: R <= target).
    """
    b = np.asarray(base["nll_per_sample"])
    d = np.stack([np.asarray(cand["nll_per_sample"]) - b,
                  np.asarray(ref["nll_per_sample"]) - b])  # (2, n) paired diffs
    n = d.shape[1]
    if n < 2:
        raise ValueError("need at least 2 samples")
    cov = np.cov(d) / n  # (2, 2) covariance of the two mean differences

    def stats(m):
        ea, eb = np.exp(m[0]) - 1, np.exp(m[1]) - 1
        return ea, eb, ea / eb, ea - target * eb

    m = d.mean(axis=1)
    ea, eb, r, margin = stats(m)
    g_r = np.array([np.exp(m[0]) / eb, -ea * np.exp(m[1]) / eb**2])
    g_m = np.array([np.exp(m[0]), -target * np.exp(m[1])])
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(boot, n))
    rb = np.array([stats(d[:, i].mean(axis=1))[2] for i in idx])
    return {
        "n": n, "delta_cand_pct": float(100 * ea), "delta_ref_pct": float(100 * eb),
        "ratio": float(r),
        "ratio_se": float(np.sqrt(g_r @ cov @ g_r)),
        "ratio_ci95": [float(np.quantile(rb, 0.025)), float(np.quantile(rb, 0.975))],
        "target": target, "margin_pct": float(100 * margin),
        "margin_se_pct": float(100 * np.sqrt(g_m @ cov @ g_m)),
    }


def run_ppl(
    model,
    tokens: mx.array,
    strategy: Strategy,
    max_kv: int,
    mode: str = "decode",
    prefill: int = 32,
    chunk: int = 64,
    show: bool = False,
    batch_size: int = 0,
    prefill_step: int = 0,
) -> dict[str, Any]:
    """One strategy at one budget on (B, L) samples, ``batch_size`` at a time (0: all)."""
    if mode not in ("decode", "chunked"):
        raise ValueError(f"unknown mode {mode!r}: use 'decode' or 'chunked'")
    strategy = strategy.for_model(model)
    mx.reset_peak_memory()
    tic = time.perf_counter()
    B = tokens.shape[0]
    step = batch_size if 0 < batch_size < B else B
    parts = []
    for s in range(0, B, step):
        cache = strategy.make_cache(model, max_kv)
        batch = tokens[s : s + step]
        if mode == "decode":
            parts.append(decode_nll(model, batch, cache, prefill, show, prefill_step))
        else:
            parts.append(chunked_nll(model, batch, cache, chunk, show))
    result = summarize(mx.concatenate(parts, axis=0))
    result.update(strategy.describe(max_kv))
    result.update(
        seq_len=int(tokens.shape[1]), samples=int(tokens.shape[0]), mode=mode,
        seconds=time.perf_counter() - tic, peak_memory_gb=mx.get_peak_memory() / 1e9,
    )
    return result


def sweep(
    model,
    data: dict[int, mx.array],
    strategies: list[Strategy],
    max_kvs: list[int],
    rdir=None,
    log=print,
    **kw,
) -> list[dict[str, Any]]:
    """Every (seq_len, strategy, max_kv); the baseline once per seq_len.

    ``data`` maps seq_len -> (B, seq_len) tokens. Finished units found in
    ``rdir`` (a ResultsDir) are loaded instead of run. Rows get the change vs
    the baseline when one ran.
    """
    rows = []
    for seq_len, tokens in data.items():
        base = None
        for strategy in strategies:
            for max_kv in max_kvs if strategy.bounded else [None]:
                row = _unit(model, tokens, strategy, max_kv, rdir, log, **kw)
                if not strategy.bounded:
                    base = row
                rows.append(row)
        for row in rows:
            if base is not None and row["seq_len"] == seq_len:
                row.update(compare(row, base))
    return rows


def _unit(model, tokens, strategy, max_kv, rdir, log, **kw):
    L = tokens.shape[1]
    strategy = strategy.for_model(model)
    name = strategy.key(max_kv)
    key = f"{name}-kv{max_kv}-L{L}" if max_kv else f"{name}-L{L}"
    row = rdir.load(key) if rdir is not None else None
    if row is None:
        row = run_ppl(model, tokens, strategy, max_kv or L, **kw)
        if not strategy.bounded:
            row["max_kv"] = None
        if rdir is not None:
            rdir.save(key, row)
        log(f"{key}: ppl={row['ppl']:.4f} se={row['ppl_se']:.4f} "
            f"time={row['seconds']:.1f}s")
    else:
        log(f"{key}: ppl={row['ppl']:.4f} (finished earlier, skipped)")
        # Same key = same config and layer sizes; label it as asked this time.
        row["strategy"] = strategy.name
    return row


def pivot(rows: list[dict[str, Any]], by: str) -> dict[str, Any] | None:
    """{strategy: {x: row}} with x = rows[by] (max_kv or seq_len)."""
    table: dict[str, dict[Any, Any]] = {}
    for r in rows:
        table.setdefault(r["strategy"], {})[r[by]] = r
    return table
