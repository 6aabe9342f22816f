"""Per-layer attention profile: how concentrated is attention, layer by layer?

A full forward pass over (B, L) samples with every cache wrapped so its
attention also returns the scores (the reference kernel). Per layer, averaged
over samples and heads:

- ``entropy``: mean over queries of -sum p log p (nats); ``entropy_norm``
  divides by log(visible keys), 1 = uniform.
- ``topk_share``: share of the accumulated attention (original H2O score, sum
  over queries) held by the top ``topk`` fraction of keys; ``topk_share_norm``
  the same for the normalised score (accumulated / queries that saw the key).
- ``score_cv``: coefficient of variation (std / mean) of the normalised score
  over keys: 0 when every key gets the same attention.
- ``sink_share``: mean attention mass on the first ``sink`` positions.
"""

import math

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..integration.routing import patch
from ..kernels import scaled_dot_product_attention_with_scores

STATS = ("entropy", "entropy_norm", "topk_share", "topk_share_norm", "score_cv",
         "sink_share")


class RecordingCache:
    """Wraps an mlx-lm cache; its attention computes and records score statistics."""

    def __init__(self, cache, layer: int, topk: float, sink: int):
        self._cache, self.layer, self.topk, self.sink = cache, layer, topk, sink
        self.records: list[dict[str, float]] = []

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def h2o_attention(self, queries, keys, values, *, scale, mask=None, sinks=None):
        out, logits, lse = scaled_dot_product_attention_with_scores(
            queries, keys, values, scale=scale, mask=mask, sinks=sinks
        )
        self.records.append(attention_stats(logits, lse, self.topk, self.sink))
        return out


def attention_stats(logits: mx.array, lse: mx.array, topk: float, sink: int) -> dict:
    """Statistics of one attention call. Shapes: logits (B, H, L, N), lse (B, H, L)."""
    B, H, L, N = logits.shape
    visible = logits > -mx.inf
    p = mx.where(visible, mx.exp(logits - lse[..., None]), 0.0)
    logp = mx.where(visible, logits - lse[..., None], 0.0)
    ent = -(p * logp).sum(-1)  # (B, H, L)
    n_vis = visible.sum(-1).astype(mx.float32)
    ent_norm = mx.where(n_vis > 1, ent / mx.log(mx.maximum(n_vis, 2.0)), 1.0)
    acc = p.sum(2)  # (B, H, N): accumulated attention per key
    seen = visible.sum(2).astype(mx.float32)
    norm = acc / mx.maximum(seen, 1.0)
    k = max(1, int(math.ceil(topk * N)))
    stats = {
        "entropy": ent.mean(), "entropy_norm": ent_norm.mean(),
        "topk_share": _top_share(acc, k), "topk_share_norm": _top_share(norm, k),
        "score_cv": (norm.std(-1) / mx.maximum(norm.mean(-1), 1e-12)).mean(),
        "sink_share": p[..., : min(sink, N)].sum(-1).mean(),
    }
    mx.eval(stats)
    return {name: v.item() for name, v in stats.items()}


def _top_share(score: mx.array, k: int) -> mx.array:
    top = mx.sort(score, axis=-1)[..., -k:].sum(-1)
    return (top / mx.maximum(score.sum(-1), 1e-12)).mean()


def profile_model(model, tokens: mx.array, topk: float = 0.1, sink: int = 4):
    """One row of STATS per attention layer over (B, L) tokens (one forward pass)."""
    caches = [RecordingCache(c, i, topk, sink) for i, c in enumerate(make_prompt_cache(model))]
    with patch():
        mx.eval(model(tokens, cache=caches))
    rows = []
    for c in caches:
        if not c.records:
            continue
        row = {"layer": c.layer, "kind": type(c._cache).__name__}
        for name in STATS:
            row[name] = sum(r[name] for r in c.records) / len(c.records)
        rows.append(row)
    return rows
