"""Fused H2O decode step: attention + score fold + next victim in one or two launches."""

from functools import lru_cache
from typing import NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx

from .build import SCORE_MODES, _make_pass1_kernel, _make_pass2_kernel
from . import decode
from .decode import NT, MAX_SPLITS, Mask, choose_splits, layout, mask_mode
from .decode import params_f, supported

# The fold reads one logits row per group head (L == 1) and keeps the whole
# group in one block, so the one-launch form needs G <= 8.
FUSED_MAX_GROUP = 8


class H2OStep(NamedTuple):
    """Results of one fused decode step (new arrays; inputs are not modified)."""

    out: mx.array  # (B, n_heads, 1, D), queries' dtype
    positions: mx.array  # (B, n_kv_heads, cap) int32, slot w holds `offset - 1`
    score: mx.array  # (B, n_kv_heads, cap) float32, this step folded in
    count: mx.array  # (B, n_kv_heads, cap) float32
    victim: mx.array  # (B, n_kv_heads) int32: slot to overwrite next step
    logits: mx.array  # (B, n_heads, 1, N) float32
    lse: mx.array  # (B, n_heads, 1) float32


@lru_cache(maxsize=64)
def _pins(pinned: Tuple[Tuple[int, int], ...]) -> mx.array:
    # An empty range stands in for "no pins": the kernel reads at least one row.
    return mx.array(list(pinned) or [(0, 0)], dtype=mx.int32)


@lru_cache(maxsize=1)
def _no_slot() -> mx.array:
    return mx.zeros((1, 1), dtype=mx.int32)


def h2o_step_supported(q, k, v, positions, mask: Mask = None, sinks=None) -> bool:
    """Whether h2o_decode_step runs on this backend for these inputs."""
    if not supported(q, k, v, mask, sinks) or q.shape[2] != 1:
        return False
    B, Hk, N = k.shape[0], k.shape[1], k.shape[2]
    return (
        positions.ndim == 3
        and tuple(positions.shape[:2]) == (B, Hk)
        and positions.shape[2] >= N
    )


def h2o_decode_step(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    positions: mx.array,
    score: mx.array,
    count: mx.array,
    *,
    slot: Optional[mx.array],
    append_slot: Optional[int] = None,
    offset: int,
    scale: float,
    mode: str = "ema",
    alpha: float = 0.95,
    sink_size: int = 0,
    recent_budget: int = 1,
    pinned: Sequence[Tuple[int, int]] = (),
    window_size: Optional[int] = None,
    mask: Mask = None,
    sinks: Optional[mx.array] = None,
    num_splits: Optional[int] = None,
    poison: Optional[float] = None,
) -> H2OStep:
    """One H2O decode step on the GPU (Lq == 1); see docs/GPU.md for the contract.

    Shapes:
        queries: (B, n_heads, 1, D); keys, values: (B, n_kv_heads, N, D), the
            first N slots of the cache buffers (views are read in place), the
            new token already written into its slot.
        positions (int32), score, count (float32): (B, n_kv_heads, cap) whole
            buffers, cap >= N, as they were before this token.
        slot: (B, n_kv_heads) int32, where the new token went (the victim the
            previous step returned), or None with ``append_slot`` (same slot for
            every row, e.g. N - 1 while the cache fills).
        offset: tokens seen including the new one (the new token's position
            is offset - 1).
    The step sets the new token's position/score/count, masks positions a
    sliding window hides, folds this step's attention into the scores
    (policy.fold_scores) and returns the slot each (sequence, KV head) should
    evict next, ranked as policy.priority / select_victim would at offset + 1.
    ``num_splits`` overrides the split count; ``poison`` (tests) fills the
    outputs before the kernels run.
    """
    if mode not in SCORE_MODES:
        raise ValueError(f"unknown score mode {mode!r}; use one of {SCORE_MODES}")
    if not h2o_step_supported(queries, keys, values, positions, mask, sinks):
        raise ValueError("h2o_decode_step: inputs not supported on this backend")
    if (slot is None) == (append_slot is None):
        raise ValueError("pass exactly one of slot and append_slot")
    B, Hq, L, D = queries.shape
    Hk, N = keys.shape[1], keys.shape[2]
    G = Hq // Hk
    cap = positions.shape[2]
    lay = layout(D, queries.dtype.size, G, 1, decode.KEYS_PER_LANE_GROUP)
    kind, mh = mask_mode(mask, B, Hq, Hk, 1, N)
    units = B * Hk * lay.RT
    S = num_splits or choose_splits(N, units, lay.tile)
    if G > FUSED_MAX_GROUP:
        S = max(S, 2)  # the fold then runs in pass 2, which loops over row tiles
    S = max(1, min(S, MAX_SPLITS))
    prm_i = mx.array(
        [offset, -1 if append_slot is None else append_slot, window_size or 0,
         sink_size, recent_budget],
        dtype=mx.int32,
    )
    slot = _no_slot() if slot is None else slot
    prm = params_f(float(scale), float(alpha))
    head = [queries, keys, values, prm]
    head += [mask] if kind in ("bool", "add") else []
    head += [sinks] if (sinks is not None and S == 1) else []
    tmpl = lay.template(queries.dtype, D, 1, G, Hk) + [
        ("MH", mh), ("MODE", SCORE_MODES.index(mode))
    ]
    f32, i32 = mx.float32, mx.int32
    state_shapes = [(B, Hk, cap)] * 3 + [(B, Hk)]
    state_dtypes = [i32, f32, f32, i32]
    has_sinks = sinks is not None
    if S == 1:
        k1 = _make_pass1_kernel(kind, has_sinks, False, True)
        res = k1(
            inputs=head + [positions, slot, prm_i, score, count, _pins(tuple(pinned))],
            template=tmpl, grid=(units * NT, 1, 1), threadgroup=(NT, 1, 1),
            output_shapes=[(B, Hq, 1, D), (B, Hq, 1, N), (B, Hq, 1)] + state_shapes,
            output_dtypes=[queries.dtype, f32, f32] + state_dtypes, init_value=poison,
        )
        out, logits, lse, pos, sc, cn, victim = res
        return H2OStep(out, pos, sc, cn, victim, logits, lse)
    k1 = _make_pass1_kernel(kind, has_sinks, True, True)
    logits, part_o, part_ml = k1(
        inputs=head + [positions, slot, prm_i], template=tmpl,
        grid=(units * NT, S, 1), threadgroup=(NT, 1, 1),
        output_shapes=[(B, Hq, 1, N), (units, S, lay.R, D), (units, S, lay.R, 2)],
        output_dtypes=[f32, f32, f32], init_value=poison,
    )
    k2 = _make_pass2_kernel(has_sinks, True)
    res = k2(
        inputs=[part_o, part_ml] + ([sinks] if has_sinks else [])
        + [logits, positions, score, count, slot, prm_i, prm, _pins(tuple(pinned))],
        template=lay.template(queries.dtype, D, 1, G, Hk) + [("MODE", SCORE_MODES.index(mode))],
        grid=(B * Hk * NT, 1, 1), threadgroup=(NT, 1, 1),
        output_shapes=[(B, Hq, 1, D), (B, Hq, 1)] + state_shapes,
        output_dtypes=[queries.dtype, f32] + state_dtypes, init_value=poison,
    )
    out, lse, pos, sc, cn, victim = res
    return H2OStep(out, pos, sc, cn, victim, logits, lse)
