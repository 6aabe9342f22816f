"""Bulk eviction (H2OConfig.evict_batch): the bulk event of a dense cache.

A full cache with ``evict_batch`` > 1 evicts that many tokens at once, then
appends decode tokens until it is full again. The event folds the queued decode
queries' scores (cache/score_queue.py's fold_step), ranks the slots (policy) and reorders
K, V and the metadata in one pass: kept slots first (best first), evicted
ones after them (worst first: the next appends overwrite those first;
decode steps attend the rest until then).

Not compiled: ``mx.compile`` of this graph measured no faster on the H100
(decode 0.945 / 0.952 of RotatingKVCache vs 1.028 op by op, within that host's
noise) and its first event JIT-compiled fused kernels for 12-25 s
(docs/DESIGN.md).
"""

from functools import lru_cache

import mlx.core as mx

from .. import policy
from .score_queue import fold_step


@lru_cache(maxsize=32)
def _layout(n: int, T: int, n0: int, keep: int):
    """Index arrays of an event's shape (the same every event in the steady
    state: built once, not ~12 ops per layer and event). Query t of the queue
    sees slots < n0 + t; the queued tokens sit in the last T slots."""
    slot = mx.arange(n)
    visible = slot[None] < (n0 + mx.arange(T))[:, None]  # (T, n)
    arrays = (mx.where(visible, 0.0, -mx.inf),  # additive mask of the logits
              visible.sum(axis=0).astype(mx.float32),  # queries that saw each slot
              slot >= n - T,  # the queued tokens' slots
              (slot - n).astype(mx.int32),  # their position - offset
              slot < keep)  # slots that stay
    mx.eval(arrays)
    return arrays


def bulk_event(queries, keys, values, positions, score, count, offset: int, *, n0: int,
                scale: float, keep: int, config):
    """One bulk eviction over full buffers (B, Hk, n[, D]): (keys, values,
    positions, score, count) with the ``keep`` best slots first, best first,
    then the evicted ones, worst first; the freed tail's scores zeroed.

    ``queries``: the queue's T (B, Hq, 1, D) arrays (query t sees slots
    < n0 + t; their tokens sit in the last T slots), or None when the scores
    are folded already. ``offset``: tokens seen before the incoming one."""
    cfg, n = config, positions.shape[-1]
    T = 0 if queries is None else len(queries)
    bias, seen, queued, rel, fresh = _layout(n, T, n0, keep)
    if queries is not None:
        positions = mx.where(queued, rel + offset, positions)
        step = fold_step(mx.concatenate(queries, axis=2), keys, scale, bias)
        score, count = score + step, count + seen
    protect = policy.protected(positions, offset + 1, cfg.sink_size, cfg.recent_budget,
                               cfg.pinned)
    pri = policy.priority(policy.eviction_score(cfg.score, score, count), protect, positions,
                          offset + 1)
    order = policy.keep_then_evict(pri, positions, keep)
    take = lambda a: mx.take_along_axis(a, order if a.ndim == 3 else order[..., None], 2)  # noqa
    return (take(keys), take(values), take(positions),
            mx.where(fresh, take(score), 0.0), mx.where(fresh, take(count), 0.0))
