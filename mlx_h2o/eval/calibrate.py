"""Per-layer budget weights from attention statistics on calibration text.

The statistics come from ``profile_model`` (one full forward pass) over windows
drawn with their own seed (``CALIBRATION``), not the evaluation windows, so
sizes are fixed before any evaluation sample is seen. Weights per statistic:

- ``entropy``: exp(mean entropy) = the effective number of keys a query attends.
- ``topk``: 1 - share of the accumulated attention held by the top 10% of keys.
- ``invtopk``: that share itself: concentrated layers get more slots (the
  opposite of PyramidKV's rule; measured better on SmolLM2, docs/RESULTS.md,
  "What was tried" item 9).
"""

import math
from typing import Any

from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from ..budgets import allocate_layer_sizes
from .profile import profile_model

CALIBRATION = {"corpus": "austen", "num_samples": 4, "seq_len": 512, "seed": 1234}
WEIGHTS = {
    "entropy": lambda row: math.exp(row["entropy"]),
    "topk": lambda row: 1.0 - row["topk_share"],
    "invtopk": lambda row: 1.0 - round(1.0 - row["topk_share"], 6),  # as first run
}
_ROWS: dict[tuple, list[dict[str, Any]]] = {}  # calibration profiles by (model id, ...)


def layer_weights(model, tokenizer, stat: str) -> tuple[float, ...]:
    """One weight per attention layer from the calibration profile (memoised per model)."""
    if stat not in WEIGHTS:
        raise ValueError(f"layer_budget={stat!r}: use one of {sorted(WEIGHTS)}")
    key = (id(model),) + tuple(CALIBRATION.values())
    if key not in _ROWS:
        from .corpora import load_corpus, sample_token_windows

        c = CALIBRATION
        tokens = sample_token_windows(tokenizer, load_corpus(c["corpus"]),
                                      c["num_samples"], c["seq_len"], c["seed"], bos=True)
        _ROWS[key] = profile_model(model, tokens)
    return tuple(round(WEIGHTS[stat](r), 6) for r in _ROWS[key])


def layer_windows(model) -> tuple:
    """Per attention layer: its sliding window (``RotatingKVCache``) or None."""
    caches = make_prompt_cache(model)
    return tuple(c.max_size if type(c) is RotatingKVCache else None
                 for c in caches if type(c) in (KVCache, RotatingKVCache))


def layer_sizes(weights, windows, max_kv: int, sink: int, spread: float = 4.0) -> list[int]:
    """Sizes with the memory of a uniform ``max_kv`` budget, within
    [max_kv / spread, max_kv * spread]; a sliding-window layer at most its window
    (or max_kv if larger)."""
    if len(windows) != len(weights):
        raise ValueError(f"{len(weights)} layer weights for {len(windows)} attention layers")
    top = int(max_kv * spread)
    hi = [top if w is None else min(top, max(w, max_kv)) for w in windows]
    lo = max(int(max_kv / spread), sink + 2)
    return allocate_layer_sizes(weights, max_kv * len(hi), lo, hi)
