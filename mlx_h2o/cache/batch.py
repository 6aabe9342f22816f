"""Batched eviction (H2OConfig.evict_batch): the batch event as one compiled graph.

A full cache with ``evict_batch`` > 1 evicts that many tokens at once, then
appends decode tokens until it is full again. The event folds the queued decode
queries' scores (cache/deferred.py), ranks the slots (policy) and reorders K,
V and the metadata: kept slots first in position order, evicted ones after
them. Built op by op that is ~70 MLX ops per layer, each ~5-9 us of host time
on the H100's host (docs/GPU.md); ``mx.compile`` fuses the elementwise chains
and replays the graph, so the event costs a few kernel launches per layer.

Only arrays and values fixed in the steady state enter the graph: the token
count ``offset`` is an array input (a Python int would retrace every event).
"""

from functools import partial

import mlx.core as mx

from .. import policy


def _fold(queries, keys, score, count, n0: int, scale: float):
    """The queued queries' summed attention (deferred.batch_fold): queries
    (B, Hq, T, D), query t sees slots < n0 + t."""
    B, Hq, T, D = queries.shape
    Hk, n = keys.shape[1], keys.shape[2]
    visible = mx.arange(n)[None] < (n0 + mx.arange(T))[:, None]  # (T, n)
    q = queries.astype(mx.float32).reshape(B, Hk, (Hq // Hk) * T, D)
    logits = (q @ keys.astype(mx.float32).swapaxes(-1, -2)) * scale
    logits = logits.reshape(B, Hk, Hq // Hk, T, n) + mx.where(visible, 0.0, -mx.inf)
    step = mx.softmax(logits, axis=-1).sum(axis=(2, 3)) / (Hq // Hk)
    return score + step, count + visible.sum(axis=0).astype(mx.float32)


def _event(queries, keys, values, positions, score, count, offset, *, n0, scale, keep,
           mode, sink, recent, pinned):
    """(keys, values, positions, score, count) reordered: the ``keep`` best slots
    in position order, then the evicted ones; scores of the freed tail zeroed.
    ``queries`` None: no queued queries (scores already folded)."""
    n = positions.shape[-1]
    if queries is not None:
        queries = mx.concatenate(queries, axis=2)  # (B, Hq, T, D)
        T = queries.shape[2]
        # The queued tokens sit in the last T slots: positions offset - T ...
        slot = mx.arange(n)
        positions = mx.where(slot >= n - T, offset - n + slot, positions).astype(mx.int32)
        score, count = _fold(queries, keys, score, count, n0, scale)
    protect = policy.protected(positions, offset + 1, sink, recent, pinned)
    pri = policy.priority(policy.eviction_score(mode, score, count), protect, positions,
                          offset + 1)
    order = policy.keep_then_evict(pri, positions, keep)
    take = lambda a: mx.take_along_axis(a, order if a.ndim == 3 else order[..., None], 2)  # noqa
    fresh = mx.arange(n) < keep
    return (take(keys), take(values), take(positions),
            mx.where(fresh, take(score), 0.0), mx.where(fresh, take(count), 0.0))


@partial(mx.compile)
def _event_with_queue(queries, keys, values, positions, score, count, offset, **kw):
    return _event(queries, keys, values, positions, score, count, offset, **kw)


@partial(mx.compile)
def _event_folded(keys, values, positions, score, count, offset, **kw):
    return _event(None, keys, values, positions, score, count, offset, **kw)


def batch_event(queries, keys, values, positions, score, count, offset: int, *, n0: int,
                scale: float, keep: int, config):
    """One batch eviction over full buffers (B, Hk, n[, D]); ``queries``: the
    queue's T (B, Hq, 1, D) arrays, or None. ``offset``: tokens seen before the incoming one."""
    cfg = config
    kw = dict(n0=n0, scale=scale, keep=keep, mode=cfg.score, sink=cfg.sink_size,
              recent=cfg.recent_budget, pinned=cfg.pinned)
    off = mx.array(offset, dtype=mx.int32)
    if queries is None:
        return _event_folded(keys, values, positions, score, count, off, **kw)
    return _event_with_queue(queries, keys, values, positions, score, count, off, **kw)
