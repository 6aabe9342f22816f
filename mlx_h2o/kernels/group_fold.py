"""Many layers' H2O decode folds in one launch (the evicting steady state).

Each layer attends its decode query with MLX's SDPA after writing the token
into the victim slot; at the next token one launch folds every layer's query
into its scores and picks every layer's next victim. Per layer step that
leaves what mlx-lm's caches launch (two K/V writes + SDPA), plus a share of
this launch (docs/DESIGN.md, "One fold launch per token").
"""

from functools import lru_cache
from typing import List, NamedTuple, Optional, Sequence

import mlx.core as mx

from .replay import replay_after_first
from . import cubin
from .backend import gpu_backend
from .build import _make_group_kernel, mode_id
from .decode import DTYPES, NT
from .h2o_step import _pins, params_row
from .quantized_reference import BITS

# Metal binds at most METAL_BUFFERS (31) buffers per kernel, shape and
# stride arrays included: 19 + 2 per layer (a query, and a dense K buffer or
# a packed K/V one; tests/test_metal_check.py counts them).
MAX_LAYERS = {"cuda": 64, "metal": 6}


class GroupFold(NamedTuple):
    """Results of group_fold (new arrays; inputs are not modified)."""

    positions: mx.array  # (n * B, Hk, M) int32, each layer's token slot set
    score: mx.array  # (n * B, Hk, M) float32, the step folded in
    count: mx.array  # (n * B, Hk, M) float32
    victim: mx.array  # (n * B, Hk, 1, D) int32 (packed K/V: (n * B, Hk, 1, 1)):
    #                   every layer's next slot, stacked
    logits: mx.array  # (n * B, Hq, M) float32, slots < valid of each layer
    lay_i: mx.array  # (n, 8) int32: ``lay_i`` of the next token (offset + 1)
    victims: List[mx.array]  # n x (B, Hk, 1, D) int32 (packed: (B, Hk, 1, 1)):
    #                          row views of ``victim``, one per layer


def max_layers() -> int:
    """Layers one launch can take on this backend (0: no GPU backend)."""
    return MAX_LAYERS.get(gpu_backend(), 0)


def group_fold_supported(dtype, head_dim: int, n_heads: int, n_kv_heads: int,
                         bits: Optional[int] = None, group_size: int = 64) -> bool:
    """Whether group_fold runs here for layers of these shapes (``bits``: K as
    packed affine-quantized K/V of that width and ``group_size``)."""
    quant_ok = bits is None or (bits in BITS and group_size % 8 == 0
                                and head_dim % group_size == 0)
    return (max_layers() > 0 and mx.default_device() == mx.gpu and dtype in DTYPES
            and head_dim % 8 == 0 and 8 <= head_dim <= 256 and quant_ok
            and n_heads % n_kv_heads == 0 and n_heads // n_kv_heads <= 16)


def layer_params(offset: int, sink_size: int, recent_budget: int, valid: int, cap: int):
    """One layer's row of ``lay_i``: FOLD's prm_i (the token went to ``slot``,
    no window) and the K buffer's slots."""
    return params_row(offset, None, (0, sink_size, recent_budget), valid) + [cap, 0]


class GroupPlan:
    """The group fold for fixed shapes and settings. MLX's build is launched
    directly: with ~80 inputs and (then) ~40 outputs, mx.compile's replay
    cost more host time than the kernel call (H100). Ours
    (kernels/cubin.py) replays its first call's recording (``replay.replay_after_first``,
    mx.compile), which converts the cubin
    and the ~80 shape scalars once: launched directly it cost 0.03-0.08 ms a
    token more than MLX's build, compiled about the same (H200;
    `benchmarks/decode_matrix.py` splits a token's time into build, dispatch
    and wait)."""

    def __init__(self, n, B, Hq, Hk, D, dtype, M, mode, pinned, bits=None, group_size=64):
        self.n, self.B, self.Hq, self.Hk, self.D, self.M = n, B, Hq, Hk, D, M
        quantized = bits is not None
        self.kernel = _make_group_kernel(gpu_backend(), n, quantized)
        # Victims repeat along D for dense writes; packed ones take (B, Hk, 1, 1).
        self.VD = 1 if quantized else D
        self.template = [("T", dtype), ("D", D), ("G", Hq // Hk), ("HK", Hk), ("NB", B),
                         ("MODE", mode_id(mode)), ("VD", self.VD)]
        if quantized:
            self.template += [("BITS", bits), ("GS", group_size)]
        self.pins = _pins(pinned)
        precompiled = isinstance(self.kernel, cubin.PrecompiledKernel)
        if precompiled:
            replay_after_first(self, "_run", self._launch)
        else:
            self._run = self._launch

    def __call__(self, queries, keys, lay_i, lay_f, positions, score, count, slot) -> GroupFold:
        res = self._run(*queries, *keys, lay_i, lay_f, positions, score, count, slot)
        return GroupFold(*res[:6], list(res[6:]))

    def _launch(self, *arrays):
        n, B, Hq, Hk, M, VD = self.n, self.B, self.Hq, self.Hk, self.M, self.VD
        qs, keys, (lay_i, lay_f, pos, sc, cn, slot) = arrays[:n], arrays[n:2 * n], arrays[2 * n:]
        i32, f32 = mx.int32, mx.float32
        outs = self.kernel(
            inputs=[*qs, *keys, lay_i, lay_f, pos, sc, cn, slot, self.pins],
            template=self.template, grid=(n * B * Hk * NT, 1, 1), threadgroup=(NT, 1, 1),
            output_shapes=[(n * B, Hk, M)] * 3 + [(n * B, Hk, 1, VD), (n * B, Hq, M), (n, 8)],
            output_dtypes=[i32, f32, f32, i32, f32, i32],
        )
        # Each layer's victim as a view of the stacked one (rows: a slice node,
        # no copy, row-contiguous as the write kernels take it): a kernel
        # output per layer cost more host time, each output holding its own
        # copy of the ~80 inputs (docs/DESIGN.md).
        return (*outs, *(outs[3][i * B:(i + 1) * B] for i in range(n)))


@lru_cache(maxsize=16)
def group_plan(n, B, Hq, Hk, D, dtype, M, mode, pinned, bits=None, group_size=64) -> GroupPlan:
    mode_id(mode)  # ValueError if unknown
    return GroupPlan(n, B, Hq, Hk, D, dtype, M, mode, pinned, bits, group_size)


def group_fold(queries: Sequence[mx.array], keys: Sequence, lay_i, lay_f, positions,
               score, count, slot, *, mode: str, pinned=(), bits: Optional[int] = None,
               group_size: int = 64) -> GroupFold:
    """Fold one decode query per layer into its scores and pick its next victim.

    Shapes (n layers, same B / heads / D / dtype):
        queries: n decode queries (B, Hq, 1, D), one per layer (separate
            inputs: stacking them cost one copy kernel per layer).
        keys: n whole K buffers (B, Hk, cap_l, D), the token already written;
            with ``bits``: n packed K/V buffers (kernels/packed.py) of
            mx.quantize along D (``group_size``) instead.
        lay_i: (n, 8) int32 rows of ``layer_params``; lay_f: (n, 4) float32
            rows (scale, EMA alpha, 1 - alpha, 0).
        positions (int32), score, count (float32): (n * B, Hk, M), layer l's
            rows l * B .. (l + 1) * B, slots >= its valid count copied through.
        slot: (n * B, Hk, 1[, D]) int32, where each layer's token went.
    Per layer as h2o_fold_step with logits ``scale * q @ k[:valid]`` (no mask).
    """
    plan = group_fold_plan(queries, keys, positions, mode=mode, pinned=pinned, bits=bits,
                           group_size=group_size)
    return plan(queries, keys, lay_i, lay_f, positions, score, count, slot)


def group_fold_plan(queries: Sequence[mx.array], keys: Sequence, positions, *, mode: str,
                    pinned=(), bits: Optional[int] = None, group_size: int = 64) -> "GroupPlan":
    """group_fold's checks and its GroupPlan for these shapes: a caller that
    folds the same shapes every token keeps it and calls it directly
    (``plan(queries, keys, lay_i, lay_f, positions, score, count, slot)``)."""
    n, q = len(keys), queries[0]
    B, Hq, _, D = q.shape
    Hk, M = positions.shape[1], positions.shape[2]
    if (not group_fold_supported(q.dtype, D, Hq, Hk, bits, group_size)
            or not 0 < n <= max_layers() or len(queries) != n):
        raise ValueError(f"group_fold: not supported here for {len(queries)} queries and "
                         f"{n} K buffers of {q.dtype} queries {q.shape} "
                         f"(backend={gpu_backend()})")
    return group_plan(n, B, Hq, Hk, D, q.dtype, M, mode, tuple(tuple(p) for p in pinned),
                      bits, group_size)
