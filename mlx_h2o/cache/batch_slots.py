"""Per-row slot decisions of the batched H2O cache (pure functions on arrays).

Rows of a batch share one slot axis; a slot that holds no token of its row
(left or right padding, a token this row evicted, room another row needed)
has position ``EMPTY``. Empty slots are masked, never scored, never kept and
never counted. Every decision is ``mlx_h2o.policy``'s, made per (row, KV head)
at the row's own number of tokens seen.

Shapes: positions, score, count (B, n_kv_heads, N); keys, values
(B, n_kv_heads, N, D); ``seen`` (B, 1, 1) int32 tokens seen per row.
"""

from typing import Optional

import mlx.core as mx
import numpy as np

from .. import policy
from ..config import H2OConfig

EMPTY = policy.EMPTY


def forget(meta, keep):
    """(positions, score, count) with the slots outside ``keep`` emptied."""
    positions, score, count = meta
    return (mx.where(keep, positions, EMPTY), mx.where(keep, score, 0.0),
            mx.where(keep, count, 0.0))


def packed_order(positions, k: int):
    """(B, Hk, k) slots that hold each row's tokens in position order, then
    empty ones: a gather to ``k`` slots that keeps every held token when no
    row holds more than ``k``."""
    big = mx.array(2**30, positions.dtype)
    order = mx.argsort(mx.where(positions < 0, big, positions), axis=-1)
    return order[..., :k]


def take(arrays, slots):
    """Gather ``slots`` (B, Hk, k) of (keys, values, positions, score, count)."""
    K, V, *meta = arrays
    idx = slots[..., None]
    return (mx.take_along_axis(K, idx, axis=2), mx.take_along_axis(V, idx, axis=2),
            *(mx.take_along_axis(a, slots, axis=2) for a in meta))


def selected_columns(mode: str, logits, lse, select, n_kv_heads: int):
    """policy.call_columns of the queries ``select`` (B, L) bool marks
    (logits (B, n_heads, L, N)); the others see nothing."""
    sel = select[:, None, :]
    logits = mx.where(sel[..., None], logits, -mx.inf)
    lse = mx.where(sel & (lse > -mx.inf), lse, 0.0)
    return policy.call_columns(mode, logits, lse, n_kv_heads)


def fold_rows(config: H2OConfig, score, count, step, seen, positions,
              pooled: Optional[mx.array] = None, expected=None):
    """Fold a call's columns (step, seen: ``policy.call_columns`` of the
    queries each row folds: its own tokens; a chunk that overflows the
    budget, the last ``prefill_window`` of them) into the scores, row by row.

    ``pooled`` (B,) bool: rows whose scores are max-pooled over
    ``prefill_pool`` neighbours (``policy.chunk_fold``'s pool, as H2OKVCache
    folds them). ``expected``: (rows (B,) bool, logits (B, n_heads, 1, N),
    lse) for an expected-attention mode: those rows fold that row, weighted
    by ``prefill_window``, in place of their window (pooled too: one row
    stands for W > 1 queries). Empty slots keep zero scores."""
    args = (config.score, score, count, step, seen, config.ema_alpha)
    s, c = policy.fold_columns(*args)
    if pooled is not None:
        sp, cp = policy.fold_columns(*args, positions, config.prefill_pool)
        rows = pooled[:, None, None]
        s, c = mx.where(rows, sp, s), mx.where(rows, cp, c)
    if expected is not None:
        rows, e_logits, e_lse = expected
        e_step, e_seen = policy.call_columns(config.score, e_logits, e_lse, score.shape[1])
        se, ce = policy.fold_columns(config.score, score, count, e_step, e_seen,
                                     config.ema_alpha, positions, config.prefill_pool,
                                     config.prefill_window)
        rows = rows[:, None, None]
        s, c = mx.where(rows, se, s), mx.where(rows, ce, c)
    held = positions >= 0
    return mx.where(held, s, 0.0), mx.where(held, c, 0.0)


def expected_logits(queries, keys, scale, mask, sinks, window):
    """policy.expected_logits of each row's ``window`` (B, W) queries, each
    row's keys masked as its last window query's are (``mask``: the call's
    (B, Hk, L, N) bool or additive mask)."""
    q = take_queries(queries, window)  # (B, Hq, W, D)
    mask = take_mask_rows(mask, window[:, -1:])  # (B, Hk, 1, N)
    return policy.expected_logits(q, keys, scale, mask, sinks)


def fused_attention(queries, keys, values, scale, mask):
    """MLX's fused SDPA under a per-KV-head ``mask`` (B, Hk or 1, L, N): rows
    of one batch evict different slots per KV head, so a query head's mask
    is its KV head's; each KV head with its group of query heads is attended
    as its own sequence (B * Hk of them). Query rows that see nothing
    (padding) see every slot instead: their outputs are never used, and an
    all-masked row would give NaN. Returns (B, Hq, L, Dv)."""
    B, Hq, L, D = queries.shape
    Hk, N, Dv = keys.shape[1], keys.shape[2], values.shape[3]
    if mask.dtype == mx.bool_:
        mask = mask | ~mask.any(axis=-1, keepdims=True)
    if mask.shape[1] == 1 or Hk == 1:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                    mask=mask)
    G = Hq // Hk
    out = mx.fast.scaled_dot_product_attention(
        queries.reshape(B * Hk, G, L, D), keys.reshape(B * Hk, 1, N, D),
        values.reshape(B * Hk, 1, N, Dv), scale=scale, mask=mask.reshape(B * Hk, 1, L, N))
    return out.reshape(B, Hq, L, Dv)


def take_queries(queries, columns):
    """The (B, Hq, W, D) queries of each row's ``columns`` (B, W)."""
    B, Hq, _, D = queries.shape
    idx = mx.broadcast_to(columns[:, None, :, None], (B, Hq, columns.shape[1], D))
    return mx.take_along_axis(queries, idx, axis=2)


def take_mask_rows(mask, columns):
    """The (B, H, W, N) rows of ``mask`` (B, H, L, N) at each row's ``columns``."""
    B, H, _, N = mask.shape
    idx = mx.broadcast_to(columns[:, None, :, None], (B, H, columns.shape[1], N))
    return mx.take_along_axis(mask, idx, axis=2)


def stacked(states, sizes):
    """(keys, values, positions, score, count) of single-sequence states
    (one per row; () for an empty cache) with ``sizes`` slots in use: each
    row's slots first, then empty ones up to the largest."""
    K, V = next(s[:2] for s in states if s)
    B, N, Hk = len(states), max(sizes), K.shape[1]
    out = [mx.zeros((B, Hk, N, K.shape[3]), K.dtype),
           mx.zeros((B, Hk, N, V.shape[3]), V.dtype), mx.full((B, Hk, N), EMPTY, mx.int32), mx.zeros((B, Hk, N), mx.float32),
           mx.zeros((B, Hk, N), mx.float32)]
    for i, (s, n) in enumerate(zip(states, sizes)):
        for a, x in zip(out, s):
            a[i : i + 1, :, :n] = x[:, :, :n]
    return out


# --- which queries of a prompt chunk each row folds --------------------------------
def selection(W: int, spans, over, L: int):
    """(select, columns) of a chunk of L queries, rows' ``spans`` (first, count)
    of their own tokens, ``over`` the rows whose chunk overflows: (B, L) bool,
    the queries each row folds (an overflowing row: its last W =
    ``prefill_window``; 0: all), or, when no row folds more than W > 1 of them,
    (B, W) bool over ``columns`` (B, W), each row's last W query columns (the
    chunk's first W where a row ends before W)."""
    select = np.zeros((len(spans), L), bool)
    for b, (start, c) in enumerate(spans):
        first = start + c - W if over[b] and 0 < W < c else start
        select[b, first : start + c] = True
    if not 1 < W < L or select.sum(axis=1).max() > W:
        return mx.array(select), None
    columns = window_columns(W, spans)
    return mx.array(np.take_along_axis(select, columns, axis=1)), mx.array(columns)


def window_columns(W: int, spans) -> np.ndarray:
    """(B, W) int32: each row's last W query columns."""
    ends = np.array([max(start + c, W) for start, c in spans])
    return (ends[:, None] - W + np.arange(W)).astype(np.int32)


def expected_rows(config: H2OConfig, spans, plans):
    """(rows, window) for an expected-attention mode: rows (B,) whose chunk
    is scored by its window's expected attention (``policy.chunk_fold``),
    window (B, W) their last W queries (other rows: any); None if none."""
    rows = [p.expected for p in plans]
    if not any(rows):
        return None
    return mx.array(rows), mx.array(window_columns(config.prefill_window, spans))
