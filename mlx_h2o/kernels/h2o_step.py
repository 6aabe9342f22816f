"""Fused H2O decode step: attention + score fold + next victim in one or two launches."""

from functools import lru_cache
from typing import NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx

from .replay import replay_after_first
from . import decode
from .backend import gpu_backend, supported
from .build import (
    _make_fold_kernel, _make_pass1_kernel, _make_pass1_precompiled, _make_pass2_kernel,
    _make_pass2_precompiled, device_backend, mode_id,
)
from .decode import NT, MAX_SPLITS, Mask, choose_splits, layout, mask_mode
from .decode import params_f

# The fold reads one logits row per group head (L == 1) and keeps the whole
# group in one block, so the one-launch form needs G <= 8.
FUSED_MAX_GROUP = 8


class H2OStep(NamedTuple):
    """Results of one fused decode step (new arrays; inputs are not modified)."""

    out: mx.array  # (B, n_heads, 1, D), queries' dtype
    positions: mx.array  # (B, n_kv_heads, cap) int32, slot w holds `offset - 1`
    score: mx.array  # (B, n_kv_heads, cap) float32, this step folded in
    count: mx.array  # (B, n_kv_heads, cap) float32
    victim: mx.array  # (B, n_kv_heads, 1, D) int32: slot to overwrite next step,
    #                   repeated along D so it indexes the K/V writes as is
    logits: mx.array  # (B, n_heads, 1, N) float32
    lse: mx.array  # (B, n_heads, 1) float32


@lru_cache(maxsize=64)
def _pins(pinned: Tuple[Tuple[int, int], ...]) -> mx.array:
    # An empty range stands in for "no pins": the kernel reads at least one row.
    return mx.array(list(pinned) or [(0, 0)], dtype=mx.int32)


@lru_cache(maxsize=1)
def _no_slot() -> mx.array:
    out = mx.zeros((1, 1), dtype=mx.int32)
    mx.eval(out)  # cached: not a lazy op of the thread that made it first
    return out


# Flags of a row's parameters (source.FUSED_SETUP): no token this step, its
# next slot is its lowest empty one, it holds empty slots.
NO_TOKEN, FILLING, HOLES = 1, 2, 4


def row_params(offsets, has, full, tail, valid) -> list:
    """The rows kernels' prm_i, 8 ints a row: rows at different fill levels
    (a batch). Row b has seen ``offsets[b]`` tokens, its token of this step
    (when ``has[b]``) at position ``offsets[b] - 1`` already in its slot; its
    next slot is its victim ranked at ``offsets[b] + 1`` where ``full[b]``,
    else its lowest empty slot. ``tail`` and ``valid`` as params_row."""
    out = []
    for off, h, f in zip(offsets, has, full):
        flags = HOLES | (0 if h else NO_TOKEN) | (0 if f else FILLING)
        out += [off, -1, *tail, valid, flags, 0]
    return out


@lru_cache(maxsize=256)
def row_params_array(offsets: tuple, has: tuple, full: tuple, tail: tuple,
                     valid: int) -> mx.array:
    """``row_params`` as the (B, 8) int32 array the rows kernels read, made
    once per step's values and shared by every layer with the same window.
    Evaluated here: a cached lazy array is bound to the stream of the thread
    that made it, and a server's generation thread may read it."""
    out = mx.array(row_params(offsets, has, full, tail, valid), mx.int32).reshape(
        len(offsets), 8)
    mx.eval(out)
    return out


def params_row(offset, append_slot, tail, valid) -> list:
    """The kernels' prm_i: offset, append slot (-1: the token went to ``slot``),
    then ``tail`` = (window or 0, sink_size, recent_budget), then the valid count."""
    return [offset, -1 if append_slot is None else append_slot, *tail, valid]


def step_params(offset, append_slot, tail, valid) -> mx.array:
    """``params_row`` as the int32 array the kernels read."""
    return mx.array(params_row(offset, append_slot, tail, valid), mx.int32)


def _check_step_args(mode, slot, append_slot):
    mode_id(mode)  # ValueError if unknown
    if (slot is None) == (append_slot is None):
        raise ValueError("pass exactly one of slot and append_slot")


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


class StepPlan:
    """What a fused step needs that does not change from one decode step to the next.

    Built once per (shapes, dtype, mask kind, config) and reused by every layer,
    so a decode step only makes the small offset array and launches.
    """

    def __init__(self, B, Hq, Hk, D, dtype, cap, kind, mh, mode, alpha, scale,
                 sink_size, recent_budget, pinned, window_size, has_sinks, rows=False):
        G = Hq // Hk
        # Lanes a key row as decode_attention's (16 at D=128 on CUDA), or the
        # launch setting: checked fused on an H200, a layer step timed the
        # same as with 32 lanes (docs/DESIGN.md).
        cfg = decode.settings()
        tpk = cfg.lanes_per_key or decode.lanes_per_key(D, cap)
        lay = layout(D, dtype.size, G, 1, cfg.keys_per_lane_group, tpk)
        self.shape = (B, Hq, Hk, D, G)
        self.lay, self.units, self.kind, self.has_sinks = lay, B * Hk * lay.RT, kind, has_sinks
        mode_i = mode_id(mode)
        self.tmpl1 = lay.template(dtype, D, 1, G, Hk) + [("MH", mh), ("MODE", mode_i)]
        self.tmpl2 = lay.template(dtype, D, 1, G, Hk) + [("MODE", mode_i)]
        self.prm = params_f(float(scale), float(alpha))
        self.pins = _pins(tuple(pinned))
        self.tail = [window_size or 0, sink_size, recent_budget]
        f32, i32 = mx.float32, mx.int32
        # ``rows``: per-row parameters (row_params); the victim a (B, Hk, 1)
        # slot index, as the batch cache's next targets.
        self.rows = rows
        self.state_shapes = [(B, Hk, cap)] * 3 + [(B, Hk, 1) if rows else (B, Hk, 1, D)]
        self.state_dtypes = [i32, f32, f32, i32]
        self.out_dtype = dtype
        self.kernels = (_make_pass1_kernel(kind, has_sinks, False, True, rows),
                        _make_pass1_kernel(kind, has_sinks, True, True, rows),
                        _make_pass2_kernel(has_sinks, True, rows))
        self.cap = cap
        self._splits = {}
        # On Metal the one-pass kernel with an array mask binds 32-33 buffers,
        # past the 31 of a kernel's argument table (tests/test_metal_check.py):
        # such steps take the two passes, which fit.
        self.min_splits = 2 if kind in ("bool", "add") and device_backend() == "metal" else 1
        # A full cache (N == cap) calls with the same shapes every step: a
        # recorded launch replays its graph instead of rebuilding the kernel
        # call (~35 us of host time per call on the H100, docs/DESIGN.md). Its
        # inputs are whole buffers, row-contiguous: on CUDA it runs kernels
        # built once per machine, not MLX's builds of every process (~1.5-2.5 s
        # at a process's first decode step, docs/DESIGN.md).
        whole = (_make_pass1_precompiled(kind, has_sinks, False, True, rows),
                 _make_pass1_precompiled(kind, has_sinks, True, True, rows),
                 _make_pass2_precompiled(has_sinks, True, rows))
        self.steady_kernels = whole if all(whole) else self.kernels

        def steady(*arrays):
            return self._launch(*arrays, kernels=self.steady_kernels)

        replay_after_first(self, "_steady", steady)

    def splits(self, N: int) -> int:
        S = self._splits.get(N)
        if S is None:
            S = choose_splits(N, self.units, self.lay.tile, self.shape[3])
            if self.shape[4] > FUSED_MAX_GROUP:
                S = max(S, 2)  # the fold then runs in pass 2, which loops over row tiles
            S = self._splits[N] = max(self.min_splits, min(S, MAX_SPLITS))
        return S

    def __call__(self, q, k, v, positions, score, count, slot, append_slot, offset,
                 mask=None, sinks=None, num_splits=None, poison=None, valid=None) -> H2OStep:
        """``valid``: attend the first ``valid`` slots of k / v (default all): the
        cache passes its whole buffers, so shapes stay fixed and the compiled
        launch replays while the cache fills too."""
        valid = k.shape[2] if valid is None else valid
        prm_i = step_params(offset, append_slot, self.tail, valid)
        slot = _no_slot() if slot is None else slot
        return self.run(q, k, v, positions, score, count, slot, prm_i, mask, sinks,
                        num_splits, poison)

    def run(self, q, k, v, positions, score, count, slot, prm_i, mask=None, sinks=None,
            num_splits=None, poison=None) -> H2OStep:
        """The launch for ready parameters: ``prm_i`` of ``step_params``, or of
        ``row_params`` (an int32 (B, 8) array) on a ``rows`` plan, whose
        ``slot`` (B, n_kv_heads, 1) is where each row's token went."""
        arrays = (q, k, v, positions, score, count, slot, prm_i)
        arrays += () if sinks is None else (sinks,)
        if mask is None and poison is None and not num_splits and k.shape[2] == self.cap:
            return H2OStep(*self._steady(*arrays))
        return H2OStep(*self._launch(*arrays, mask=mask, num_splits=num_splits, poison=poison))

    def _launch(self, q, k, v, positions, score, count, slot, prm_i, sinks=None, *,
                mask=None, num_splits=None, poison=None, kernels=None):
        """The kernel launches: (out, positions, score, count, victim, logits,
        lse); ``kernels``: (single, split, merge), default MLX's builds."""
        B, Hq, Hk, D, G = self.shape
        single, split, merge = kernels or self.kernels
        N = k.shape[2]
        S = (min(max(num_splits, self.min_splits), MAX_SPLITS) if num_splits
             else self.splits(N))
        head = [q, k, v, self.prm]
        head += [mask] if self.kind in ("bool", "add") else []
        f32, lay, NT_ = mx.float32, self.lay, NT
        if S == 1:
            res = single(
                inputs=head + ([sinks] if self.has_sinks else [])
                + [positions, slot, prm_i, score, count, self.pins],
                template=self.tmpl1, grid=(self.units * NT_, 1, 1), threadgroup=(NT_, 1, 1),
                output_shapes=[(B, Hq, 1, D), (B, Hq, 1, N), (B, Hq, 1)] + self.state_shapes,
                output_dtypes=[self.out_dtype, f32, f32] + self.state_dtypes,
                init_value=poison,
            )
            out, logits, lse, pos, sc, cn, victim = res
            return out, pos, sc, cn, victim, logits, lse
        logits, part_o, part_ml = split(
            inputs=head + [positions, slot, prm_i], template=self.tmpl1,
            grid=(self.units * NT_, S, 1), threadgroup=(NT_, 1, 1),
            output_shapes=[(B, Hq, 1, N), (self.units, S, lay.R, D), (self.units, S, lay.R, 2)],
            output_dtypes=[f32, f32, f32], init_value=poison,
        )
        res = merge(
            inputs=[part_o, part_ml] + ([sinks] if self.has_sinks else [])
            + [logits, positions, score, count, slot, prm_i, self.prm, self.pins],
            template=self.tmpl2, grid=(B * Hk * NT_, 1, 1), threadgroup=(NT_, 1, 1),
            output_shapes=[(B, Hq, 1, D), (B, Hq, 1)] + self.state_shapes,
            output_dtypes=[self.out_dtype, f32] + self.state_dtypes, init_value=poison,
        )
        out, lse, pos, sc, cn, victim = res
        return out, pos, sc, cn, victim, logits, lse


@lru_cache(maxsize=64)
def step_plan(B, Hq, Hk, D, dtype, cap, kind, mh, mode, alpha, scale, sink_size,
              recent_budget, pinned, window_size, has_sinks, rows=False) -> StepPlan:
    """The StepPlan for these static parameters (built once, then shared)."""
    mode_id(mode)  # ValueError if unknown
    return StepPlan(B, Hq, Hk, D, dtype, cap, kind, mh, mode, alpha, scale, sink_size,
                    recent_budget, pinned, window_size, has_sinks, rows)


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
    """One H2O decode step on the GPU (Lq == 1); see docs/DESIGN.md for the contract.

    Shapes:
        queries: (B, n_heads, 1, D); keys, values: (B, n_kv_heads, N, D), the
            first N slots of the cache buffers (views are read in place), the
            new token already written into its slot.
        positions (int32), score, count (float32): (B, n_kv_heads, cap) whole
            buffers, cap >= N, as they were before this token.
        slot: int32 (B, n_kv_heads), (B, n_kv_heads, 1) or (B, n_kv_heads, 1, D)
            (the previous step's ``victim`` as is): where the new token went;
            or None with ``append_slot`` (same slot for every row, e.g. N - 1
            while the cache fills).
        offset: tokens seen including the new one (the new token's position
            is offset - 1).
    The step sets the new token's position/score/count, masks positions a
    sliding window hides, folds this step's attention into the scores
    (policy.fold_scores) and returns the slot each (sequence, KV head) should
    evict next, ranked as policy.priority / select_victim would at offset + 1.
    ``num_splits`` overrides the split count; ``poison`` (tests) fills the
    outputs before the kernels run. The H2O cache calls ``step_plan`` directly
    to skip these checks on every step.
    """
    _check_step_args(mode, slot, append_slot)
    if not h2o_step_supported(queries, keys, values, positions, mask, sinks):
        raise ValueError("h2o_decode_step: inputs not supported on this backend")
    if slot is not None and (slot.dtype != mx.int32 or slot.size != keys.shape[0] * keys.shape[1]
                             * (keys.shape[3] if slot.ndim == 4 else 1)):
        raise ValueError(
            f"slot must be int32 of shape (B, n_kv_heads[, 1[, D]]), got {slot.dtype} {slot.shape}"
        )
    plan = make_plan(queries, keys, positions, mask, sinks, mode=mode, alpha=alpha,
                     scale=scale, sink_size=sink_size, recent_budget=recent_budget,
                     pinned=pinned, window_size=window_size)
    return plan(queries, keys, values, positions, score, count, slot, append_slot, offset,
                mask, sinks, num_splits, poison)


def make_plan(queries, keys, positions, mask, sinks, *, mode, alpha, scale, sink_size,
              recent_budget, pinned, window_size, rows=False) -> StepPlan:
    """step_plan for these inputs (shapes, dtype, mask kind) and H2O settings;
    ``rows``: the plan of rows at different fill levels (``h2o_rows_step``)."""
    B, Hq, _, D = queries.shape
    Hk, N = keys.shape[1], keys.shape[2]
    kind, mh = mask_mode(mask, B, Hq, Hk, 1, N)
    return step_plan(B, Hq, Hk, D, queries.dtype, positions.shape[2], kind, mh, mode,
                     float(alpha), float(scale), sink_size, recent_budget,
                     tuple(tuple(p) for p in pinned), window_size, sinks is not None, rows)


def h2o_rows_step(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    positions: mx.array,
    score: mx.array,
    count: mx.array,
    *,
    target: mx.array,
    offsets: Sequence[int],
    has: Sequence[bool],
    full: Sequence[bool],
    scale: float,
    mode: str = "ema",
    alpha: float = 0.95,
    sink_size: int = 0,
    recent_budget: int = 1,
    pinned: Sequence[Tuple[int, int]] = (),
    window_size: Optional[int] = None,
    sinks: Optional[mx.array] = None,
    num_splits: Optional[int] = None,
    poison: Optional[float] = None,
) -> H2OStep:
    """One decode step of rows at different fill levels on the GPU: what
    ``cache.ops_step.rows_step`` computes, in the fused step's launches.

    Shapes as h2o_decode_step, with whole buffers (N == cap); ``target``
    int32 (B, n_kv_heads, 1): the slot each row's token went to. Per row b
    (host values): ``offsets[b]`` tokens seen, the token of this step, if
    ``has[b]``, at position ``offsets[b] - 1``; a row without one sees
    nothing and keeps its scores. Slots at position ``policy.EMPTY`` hold no
    token: masked, never scored nor a victim. ``full[b]``: the row's next
    slot is its victim ranked at ``offsets[b] + 1``, else its lowest empty
    slot; that next slot comes back as ``victim``, (B, n_kv_heads, 1) int32.
    A row without a token attends nothing: its ``out`` is zeros.
    """
    B = queries.shape[0]
    if not (len(offsets) == len(has) == len(full) == B):
        raise ValueError(f"offsets, has and full need one value per row ({B}), got "
                         f"{len(offsets)}, {len(has)}, {len(full)}")
    if not h2o_step_supported(queries, keys, values, positions, None, sinks):
        raise ValueError("h2o_rows_step: inputs not supported on this backend")
    if target.dtype != mx.int32 or target.size != B * keys.shape[1]:
        raise ValueError(f"target must be int32 of shape (B, n_kv_heads, 1), got "
                         f"{target.dtype} {target.shape}")
    mode_id(mode)  # ValueError if unknown
    plan = make_plan(queries, keys, positions, None, sinks, mode=mode, alpha=alpha,
                     scale=scale, sink_size=sink_size, recent_budget=recent_budget,
                     pinned=pinned, window_size=window_size, rows=True)
    prm = row_params_array(tuple(offsets), tuple(has), tuple(full), tuple(plan.tail),
                           keys.shape[2])
    return plan.run(queries, keys, values, positions, score, count, target, prm,
                    sinks=sinks, num_splits=num_splits, poison=poison)


class H2OFold(NamedTuple):
    """Results of h2o_fold_step (new arrays)."""

    positions: mx.array  # (B, n_kv_heads, cap) int32
    score: mx.array  # (B, n_kv_heads, cap) float32
    count: mx.array  # (B, n_kv_heads, cap) float32
    victim: mx.array  # (B, n_kv_heads, 1, 1) int32: slot to overwrite next step


def fold_step_supported(logits, lse, positions) -> bool:
    """Whether h2o_fold_step runs here: a GPU, one query (L == 1), GQA shapes."""
    if gpu_backend() is None or mx.default_device() != mx.gpu:
        return False
    if logits.ndim != 4 or logits.shape[2] != 1 or positions.ndim != 3:
        return False
    B, Hq, _, N = logits.shape
    Hk = positions.shape[1]
    return (positions.shape[0] == B and Hq % Hk == 0 and Hq // Hk <= 128
            and N <= positions.shape[2] and tuple(lse.shape) == (B, Hq, 1))


def h2o_fold_step(
    logits: mx.array,
    lse: mx.array,
    positions: mx.array,
    score: mx.array,
    count: mx.array,
    *,
    slot: Optional[mx.array],
    append_slot: Optional[int] = None,
    offset: int,
    mode: str = "ema",
    alpha: float = 0.95,
    sink_size: int = 0,
    recent_budget: int = 1,
    pinned: Sequence[Tuple[int, int]] = (),
    window_size: Optional[int] = None,
) -> H2OFold:
    """The fused step's second half alone: fold one decode step's attention
    (logits (B, n_heads, 1, N) float32 and lse (B, n_heads, 1), from any
    attention that exports them) into the scores and pick the next victim, in
    one launch. Arguments as h2o_decode_step; the token's slot gets position
    ``offset - 1`` and fresh scores before the fold. For caches whose
    attention cannot fold a GQA group itself (the quantized kernel)."""
    _check_step_args(mode, slot, append_slot)
    if not fold_step_supported(logits, lse, positions):
        raise ValueError("h2o_fold_step: inputs not supported on this backend")
    B, Hq, _, N = logits.shape
    Hk, cap = positions.shape[1], positions.shape[2]
    prm_i = step_params(offset, append_slot, (window_size or 0, sink_size, recent_budget), N)
    f32, i32 = mx.float32, mx.int32
    pos, sc, cn, victim = _make_fold_kernel(gpu_backend())(
        inputs=[logits, lse, positions, score, count, _no_slot() if slot is None else slot,
                prm_i, params_f(1.0, float(alpha)), _pins(tuple(tuple(p) for p in pinned))],
        template=[("G", Hq // Hk), ("HK", Hk), ("D", 1), ("MODE", mode_id(mode))],
        grid=(B * Hk * NT, 1, 1), threadgroup=(NT, 1, 1),
        output_shapes=[(B, Hk, cap)] * 3 + [(B, Hk, 1, 1)],
        output_dtypes=[i32, f32, f32, i32],
    )
    return H2OFold(pos, sc, cn, victim)
