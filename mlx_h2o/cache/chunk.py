"""A prompt chunk's attention, scores and fold, for one sequence or a batch
of rows at different fill levels (SlotCore.chunk_attention / fold_chunk).

Each row's decisions are ``policy.chunk_fold``'s at the row's own counts:
which of its queries are scored (an overflowing chunk: its last
``prefill_window``), pooled, weighted as expected attention, whether they
replace the held scores. Where every row folds the chunk's last queries (a
single sequence, a batch without padding) they are slices; elsewhere (B, L)
selections. A chunk whose rows fold at most W > 1 queries each is attended
by MLX's fused SDPA and only those queries' logits are computed.

Shapes: queries (B, Hq, L, D); keys, values (B, Hk, N, D); masks None,
"causal" or (B or 1, 1 or Hk, L, N).
"""

from typing import NamedTuple, Optional, Tuple

import mlx.core as mx
import numpy as np

from .. import policy
from ..kernels import scaled_dot_product_attention_with_scores
from ..policy import ChunkFold
from ..scores import score_mode


class ChunkCall(NamedTuple):
    """How a prompt chunk's rows are attended, scored and folded (``chunk_call``)."""

    length: int  # L, the chunk's queries
    qpos: Optional[mx.array]  # (B, L) query positions, EMPTY for padding; None: one sequence's
    plans: Tuple[ChunkFold, ...]  # each row's (one: every row's)
    last: int  # without ``select``: every row folds the chunk's last ``last`` queries (0: all)
    select: Optional[mx.array]  # (B, L) bool the queries each row folds, or (B, W) of ``columns``
    columns: Optional[mx.array]  # (B, W) int32 each row's window columns
    window: int  # W when no row folds more than W > 1 queries (its window may be scored alone)
    expected_window: Optional[mx.array]  # (B, W) each row's last W columns; None: the chunk's


def chunk_call(config, spans, kept, L: int, window_size=None, qpos=None) -> ChunkCall:
    """The call of a chunk of L queries: rows' ``spans`` (first, count) of
    their own tokens, ``kept`` the tokens each row holds with them."""
    plans = tuple(policy.chunk_fold(config, c, k - c, window_size)
                  for (_, c), k in zip(spans, kept))
    W, scored = config.prefill_window, {p.scored for p in plans}
    window = W if 1 < W < L and max(scored) <= W else 0
    if {s + c for s, c in spans} == {L} and len(scored) == 1 and min(scored) > 0:
        last = scored.pop()
        return ChunkCall(L, qpos, plans, 0 if last >= L else last, None, None, window, None)
    select = np.zeros((len(spans), L), bool)
    for b, ((start, c), p) in enumerate(zip(spans, plans)):
        select[b, start + c - p.scored : start + c] = True
    expected = any(p.expected for p in plans)
    if not (window or expected):
        return ChunkCall(L, qpos, plans, 0, mx.array(select), None, 0, None)
    columns = window_columns(W, spans)
    expected = mx.array(columns) if expected else None
    if not window:
        return ChunkCall(L, qpos, plans, 0, mx.array(select), None, 0, expected)
    return ChunkCall(L, qpos, plans, 0, mx.array(np.take_along_axis(select, columns, axis=1)),
                     mx.array(columns), window, expected)


def window_columns(W: int, spans) -> np.ndarray:
    """(B, W) int32: each row's last W query columns (the chunk's first W
    where a row ends before W)."""
    ends = np.array([max(start + c, W) for start, c in spans])
    return (ends[:, None] - W + np.arange(W)).astype(np.int32)


def windowed(call: ChunkCall, mask, sinks) -> bool:
    """Whether the chunk is attended by MLX's SDPA and scored by its window
    alone: rows fold at most W > 1 queries each, and a per-KV-head mask
    (batch rows evict different slots per head) comes without sinks."""
    return call.window > 0 and (sinks is None or not _per_head(mask))


def attention(kv, mode: str, n_kv_heads: int, queries, keys, values, scale, mask, sinks,
              call: ChunkCall, by_window: bool):
    """(out, exact, expected): the chunk's attention, ``policy.call_columns``
    of the queries each row folds (None when every row folds expected
    attention) and of the expected rows' window (None without)."""
    plans, Hk = call.plans, n_kv_heads
    dense = None
    if by_window:
        dense = kv.dense(keys, values, queries.dtype)
        out = fused_attention(queries, *dense, scale, mask, sinks)
        exact = None
        if not all(p.expected for p in plans):
            q, m = _window_queries(queries, mask, call)
            _, logits, lse = scaled_dot_product_attention_with_scores(
                q, *dense, scale=scale, mask=m, sinks=sinks)
            exact = selected_columns(mode, logits, lse, call.select, Hk)
    elif score_mode(mode).magnitude == "abs_logit":
        out, logits, lse = kv.attention(queries, keys, values, scale=scale, mask=mask,
                                        sinks=sinks)
        select = None if call.select is None else full_select(call)
        exact = selected_columns(mode, logits, lse, select, Hk, call.last)
    else:  # probabilities summed by a GEMM: no (L, N) logits left to fold
        select = full_select(call)
        if select is not None:
            select = mx.broadcast_to(select, (queries.shape[0], queries.shape[2]))
        out, step, seen = kv.column_attention(queries, keys, values, scale=scale, mask=mask,
                                              sinks=sinks, weights=select)
        exact = policy.cache_head_columns(step, seen, Hk)
    expected = None
    if any(p.expected for p in plans):
        dense = dense or kv.dense(keys, values, queries.dtype)
        expected = _expected_columns(mode, Hk, queries, dense[0], scale, mask, sinks, call)
    return out, exact, expected


def fold(config, call: ChunkCall, score, count, positions, exact, expected):
    """(score, count) with the chunk's columns folded, row by row: each row
    by its plan (plain, max-pooled over ``prefill_pool`` neighbours, or its
    window's expected attention weighted by ``prefill_window``); a row whose
    window replaces the held scores starts from zero. A batch's empty slots
    keep zero scores."""
    plans = call.plans
    replace = [p.replace for p in plans]
    if all(replace):
        score, count = mx.zeros_like(score), mx.zeros_like(count)
    elif any(replace):
        rows = _rows(replace)
        score, count = mx.where(rows, 0.0, score), mx.where(rows, 0.0, count)
    kinds = sorted({(p.expected, p.pool, p.weight) for p in plans})
    out = None
    for kind in kinds:
        e, pool, weight = kind
        s, c = policy.fold_columns(config.score, score, count, *(expected if e else exact),
                                   config.ema_alpha, positions, pool, weight)
        if out is None:
            out = (s, c)
        else:
            rows = _rows([(p.expected, p.pool, p.weight) == kind for p in plans])
            out = (mx.where(rows, s, out[0]), mx.where(rows, c, out[1]))
    score, count = out
    if call.qpos is not None:
        held = positions >= 0
        score, count = mx.where(held, score, 0.0), mx.where(held, count, 0.0)
    return score, count


def with_preview(kv, mode: str, n_kv_heads: int, exact, preview, keys, values, scale,
                 sinks, mask=None):
    """``exact`` (step, seen) plus the columns of ``preview`` (B, Hq, W, D):
    queries of positions after every fetched slot (``keys``, ``values`` as
    the storage ``kv`` fetched them, attended by its own attention), which
    they all see but the slots ``mask`` (B, Hk, W, N) hides (a batch's empty
    ones; H2OKVCache.set_preview)."""
    _, logits, lse = kv.attention(preview, keys, values, scale=scale, mask=mask, sinks=sinks)
    step, seen = policy.call_columns(mode, logits, lse, n_kv_heads)
    return (None if step is None else exact[0] + step), exact[1] + seen


def full_select(call: ChunkCall):
    """(B or 1, L) bool: the queries each row folds; None: all of them."""
    if call.select is None:
        if not call.last:
            return None
        return (mx.arange(call.length) >= call.length - call.last)[None]
    if call.columns is None:
        return call.select
    full = mx.zeros((call.select.shape[0], call.length), mx.bool_)
    return mx.put_along_axis(full, call.columns, call.select, axis=1)


def selected_columns(mode: str, logits, lse, select, n_kv_heads: int, last: int = 0):
    """policy.call_columns of the queries ``select`` (B, L) bool marks
    (logits (B, n_heads, L, N)); the others see nothing. ``select`` None:
    the last ``last`` queries (0: every one)."""
    if select is None:
        return policy.call_columns(mode, logits, lse, n_kv_heads, last)
    sel = select[:, None, :]
    logits = mx.where(sel[..., None], logits, -mx.inf)
    lse = mx.where(sel & (lse > -mx.inf), lse, 0.0)
    return policy.call_columns(mode, logits, lse, n_kv_heads)


def fused_attention(queries, keys, values, scale, mask, sinks=None):
    """MLX's fused SDPA under the chunk's mask. A per-KV-head mask (B, Hk,
    L, N): each KV head with its group of query heads is attended as its
    own sequence (B * Hk of them). Query rows that see nothing (a batch's
    padding) see every slot instead: their outputs are never used, and an
    all-masked row would give NaN. Returns (B, Hq, L, Dv)."""
    if isinstance(mask, mx.array) and mask.dtype == mx.bool_:
        mask = mask | ~mask.any(axis=-1, keepdims=True)
    if not _per_head(mask) or keys.shape[1] == 1:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                    mask=mask, sinks=sinks)
    B, Hq, L, D = queries.shape
    Hk, N, Dv = keys.shape[1], keys.shape[2], values.shape[3]
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


def last_rows(mask, W: int):
    """The mask of a call's last W queries (mlx-lm's "causal" is bottom-right aligned)."""
    if isinstance(mask, mx.array) and mask.ndim >= 2 and mask.shape[-2] > 1:
        return mask[..., -W:, :]
    return mask


def _window_queries(queries, mask, call: ChunkCall):
    """(queries, mask) of the window's queries."""
    if call.columns is None:
        return queries[:, :, -call.last :], last_rows(mask, call.last)
    return take_queries(queries, call.columns), take_mask_rows(mask, call.columns)


def _expected_columns(mode, n_kv_heads, queries, keys, scale, mask, sinks, call):
    """``policy.call_columns`` of each row's window's expected attention
    (policy.expected_logits), its keys masked as its last query's."""
    if call.expected_window is None:
        W = max(p.weight for p in call.plans)  # an expected row's: prefill_window
        q, m = queries[:, :, -W:], last_rows(mask, 1)
    else:
        q = take_queries(queries, call.expected_window)
        m = take_mask_rows(mask, call.expected_window[:, -1:])
    logits, lse = policy.expected_logits(q, keys, scale, m, sinks)
    return policy.call_columns(mode, logits, lse, n_kv_heads)


def _per_head(mask) -> bool:
    return isinstance(mask, mx.array) and mask.ndim == 4 and mask.shape[1] > 1


def _rows(flags) -> mx.array:
    """(B, 1, 1) bool of per-row flags."""
    return mx.array(flags)[:, None, None]
