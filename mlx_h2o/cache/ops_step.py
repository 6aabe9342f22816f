"""An evicting decode step in MLX ops: attention, score fold, next victim.

What the fused GPU step (kernels.h2o_decode_step) computes, as the reference
ops. Op by op that is ~90 MLX primitives per layer and decode token, each
with its own scheduling cost (~7 us of CPU time on this project's 2-core
machine); without the GPU kernels the cache calls ``compiled_step``, whose
graph is traced once per shape and fuses the elementwise ops, and
``compiled_fill`` for the decode steps that append and fold at once.
"""

from functools import lru_cache, partial
from typing import Callable

import mlx.core as mx

from .. import policy
from ..config import H2OConfig
from ..kernels import reference
from ..kernels.quantized_reference import quantized_matmul_attention_with_scores


def in_window(positions, offset, window_size: int):
    """Slots the newest query (position ``offset - 1``) of a sliding-window
    layer still sees, as H2OKVCache._position_mask gives them for one query."""
    return positions > offset - 1 - window_size


def evict_step(config: H2OConfig, scale: float, queries, keys, values, positions, score,
               count, slot, offset, zones=None, window_size=None,
               attend=reference.scaled_dot_product_attention_with_scores, written=0.0):
    """One decode query whose token went into ``slot``: the slot gets position
    ``offset - 1`` and fresh scores (score ``written``: policy.written_score
    of the token), the query attends all N slots of
    ``keys`` / ``values`` (a sliding-window layer: those whose positions it
    still sees), its attention is folded in, and the next victim is ranked
    at ``offset + 1``.

    Shapes: queries (B, Hq, 1, D); keys, values (B, Hk, N, D), or what
    ``attend`` reads (see ``attention_for``); positions, score, count
    (B, Hk, N); slot (B, Hk, 1) or a victim (B, Hk, 1, ·); ``offset`` and
    ``zones`` as in policy.slot_priority.
    Returns (out, positions, score, count, victim (B, Hk, 1, 1) int32)."""
    p, s, c = _fresh_slot(positions, score, count, slot, offset - 1, written)
    seen = None if window_size is None else in_window(p, offset, window_size)[:, :, None]
    out, logits, lse = attend(queries, keys, values, scale=scale, mask=seen)
    return (out, *fold_and_pick(config, logits, lse, p, s, c, offset, zones, window_size))


def fold_and_pick(config: H2OConfig, logits, lse, positions, score, count, offset, zones=None,
                  window_size=None):
    """The step's attention folded into slots whose new token is already in
    (``positions`` / ``score`` / ``count``, N slots), and the next victim at
    ``offset + 1``: (positions, score, count, victim (B, Hk, 1, 1) int32)."""
    s, c = policy.fold_scores(config.score, score, count, logits, lse, config.ema_alpha)
    pri = policy.slot_priority(config, positions, s, c, offset + 1, window_size, zones)
    victim = policy.select_victim(pri, positions).astype(mx.int32)[..., None, None]
    return positions, s, c, victim


def fold_step(config: H2OConfig, logits, lse, positions, score, count, slot, offset,
              window_size=None):
    """What kernels.h2o_fold_step computes, in ops: the token in ``slot``
    (position ``offset - 1``, fresh scores), its attention (``logits`` /
    ``lse`` over the first N slots) folded in, the next victim; metadata of
    the buffers' length, slots >= N as they were."""
    N = logits.shape[-1]
    head = _fresh_slot(positions[..., :N], score[..., :N], count[..., :N], slot, offset - 1)
    *meta, victim = fold_and_pick(config, logits, lse, *head, offset, window_size=window_size)
    return (*with_tail(meta, (positions, score, count)), victim)


def with_tail(head, full):
    """Metadata of the first N slots (``head``) padded back to the buffers'
    length: slots >= N as they are in ``full``."""
    return [mx.concatenate([h, f[..., h.shape[-1]:]], axis=-1) for h, f in zip(head, full)]


def _fresh_slot(positions, score, count, slot, position, written=0.0, rows=None):
    """storage.fresh_slot as selects: under mx.compile they fuse with the
    fold's elementwise ops, where three scatters and their fills stayed five
    primitives (~4% of a CPU step at 256 slots). ``rows`` (B, 1, 1) bool:
    the rows that wrote a token (a batch's others keep their slots as they are)."""
    slot = slot[..., 0] if slot.ndim == 4 else slot
    hit = mx.arange(positions.shape[-1]) == slot  # (B, Hk, N)
    if rows is not None:
        hit = hit & rows
    return (mx.where(hit, position, positions), mx.where(hit, written, score),
            mx.where(hit, 0.0, count))


def attention_for(kind) -> Callable:
    """The attention with scores a compiled step runs over a storage's K/V:
    ``kind`` ("dense",) for arrays, or ("quantized", bits, group_size) for
    triples (bits one per precision segment for mixed zones), read by
    ``mx.quantized_matmul`` (never dequantized whole)."""
    if kind[0] == "quantized":
        return partial(quantized_matmul_attention_with_scores, bits=kind[1],
                       group_size=kind[2])
    return reference.scaled_dot_product_attention_with_scores


@lru_cache(maxsize=64)
def compiled_step(config: H2OConfig, scale: float, window_size=None,
                  kind=("dense",)) -> Callable:
    """``evict_step`` for one cache's settings through mx.compile:
    (queries, keys, values, positions, score, count, slot, offset, sink,
    recent, written) -> (out, positions, score, count, victim), the victim as the
    next token's K/V writes take it: repeated along D for dense K/V,
    (B, Hk, 1, 1) for quantized triples (``kind``: the storage's
    ``group_kind``). ``offset``, ``sink`` and ``recent`` are int32 scalar
    arrays: as Python ints they would be traced as constants, so every
    token (offset) and every layer size of a layer profile (zones) would
    get its own compiled code (on the CPU, its own C++ build, ~0.5 s each).
    ``written``: the token's score (``written_input``)."""
    attend = attention_for(kind)

    def step(queries, keys, values, positions, score, count, slot, offset, sink, recent,
             written):
        out, p, s, c, victim = evict_step(config, scale, queries, keys, values, positions,
                                          score, count, slot, offset, (sink, recent),
                                          window_size, attend, written)
        if kind[0] == "dense":
            victim = mx.broadcast_to(victim, (*victim.shape[:3], keys.shape[3]))
        return out, p, s, c, victim

    return mx.compile(step)


def fill_step(config: H2OConfig, scale: float, queries, keys, values, positions, score,
              count, n, offset, window_size=None,
              attend=reference.scaled_dot_product_attention_with_scores):
    """A decode query that appended its token (slot n - 1, metadata written)
    and folds its scores now (sliding-window layers, EMA modes: no deferral):
    attention over the first ``n`` slots of whole buffers (B, Hk, C, ·) with
    C >= n, so that shapes stay fixed while the cache fills; slots >= n are
    masked, which leaves their scores exactly as they were. ``n`` and
    ``offset`` are int32 scalar arrays. Returns (out, score, count)."""
    seen = mx.arange(positions.shape[-1]) < n  # (C,)
    if window_size is not None:
        seen = (seen & in_window(positions, offset, window_size))[:, :, None]  # (B, Hk, 1, C)
    out, logits, lse = attend(queries, keys, values, scale=scale, mask=seen)
    score, count = policy.fold_scores(config.score, score, count, logits, lse,
                                      config.ema_alpha)
    return out, score, count


@lru_cache(maxsize=64)
def compiled_fill(config: H2OConfig, scale: float, window_size=None,
                  kind=("dense",)) -> Callable:
    """``fill_step`` for one cache's settings through mx.compile:
    (queries, keys, values, positions, score, count, n, offset) -> (out, score, count)."""
    return mx.compile(partial(fill_step, config, scale, window_size=window_size,
                              attend=attention_for(kind)))


def rows_step(config: H2OConfig, scale: float, queries, keys, values, positions, score,
              count, target, qpos, rank_at, full, written=0.0, window_size=None,
              mask=None, sinks=None):
    """One decode step of rows at different fill levels (a batch of
    sequences): each row's token, already in ``target``, gets position
    ``qpos`` and fresh scores (score ``written``); each row's query attends
    the slots it holds (EMPTY ones and, on a sliding-window layer, those out
    of its window are masked), its attention is folded in, and the slot of
    the row's next token is picked: its victim ranked at ``rank_at`` where
    ``full``, else its lowest empty slot. A row without a token this step
    (``qpos`` EMPTY) sees nothing, keeps its scores and gets zeros out (as
    the fused kernels give it: ``kernels.h2o_rows_step``).

    Shapes: queries (B, Hq, 1, D); keys, values (B, Hk, N, D); positions,
    score, count (B, Hk, N); target (B, Hk, 1) int32; qpos, rank_at (B, 1, 1)
    int32; full (B, 1, 1) bool; written a float or (B, Hk, 1); ``mask`` a
    mask the model passed, ``sinks`` attention sinks (uncompiled calls).
    Returns (out, positions, score, count, next target (B, Hk, 1) int32)."""
    has = qpos >= 0
    p, s, c = _fresh_slot(positions, score, count, target, qpos, written, has)
    own = policy.position_mask(p, qpos[:, :, 0], window_size)  # (B, Hk, 1, N)
    out, logits, lse = reference.scaled_dot_product_attention_with_scores(
        queries, keys, values, scale=scale, mask=policy.combine_masks(own, mask),
        sinks=sinks)
    out = mx.where(has[..., None], out, 0.0)
    lse = mx.where(lse > -mx.inf, lse, 0.0)  # a row that sees nothing folds nothing
    s, c = policy.fold_scores(config.score, s, c, logits, lse, config.ema_alpha)
    pri = policy.slot_priority(config, p, s, c, rank_at, window_size)
    victim = policy.select_victim(pri, p)
    nxt = mx.where(full[..., 0], victim, policy.first_empty(p))
    return out, p, s, c, nxt.astype(mx.int32)[..., None]


@lru_cache(maxsize=64)
def compiled_rows_step(config: H2OConfig, scale: float, window_size=None) -> Callable:
    """``rows_step`` for one cache's settings through mx.compile: (queries,
    keys, values, positions, score, count, target, qpos, rank_at, full,
    written) -> (out, positions, score, count, next target); ``written`` an
    array (``written_input``)."""
    return mx.compile(partial(rows_step, config, scale, window_size=window_size))


@lru_cache(maxsize=512)
def int_array(value: int) -> mx.array:
    """A compiled step's int32 scalar input for a per-layer constant (made once)."""
    return mx.array(value, mx.int32)


@lru_cache(maxsize=8)
def _float_array(value: float) -> mx.array:
    return mx.array(value, mx.float32)


def written_input(written) -> mx.array:
    """compiled_step's ``written`` input: a token's policy.written_score, the
    attention modes' 0.0 as a scalar array made once."""
    return written if isinstance(written, mx.array) else _float_array(float(written))


def zone_arrays(sink_size: int, recent_budget: int):
    """compiled_step's (sink, recent) inputs for these sizes."""
    return int_array(sink_size), int_array(recent_budget)
