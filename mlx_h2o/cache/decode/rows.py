"""The decode step of rows at different fill levels (BatchH2OKVCache).

Each row's token is already in its slot (``target``); the step writes its
metadata, attends, folds and picks each row's next slot: its victim where
the row is full, else its lowest empty slot. On a GPU that is the fused
step's kernels over per-row parameters (``kernels.h2o_rows_step``'s plan:
one or two launches a layer); elsewhere, and for what those kernels do not
take (a mask the model passed, a token's score from its keys, score modes
the kernels do not fold), ``ops_step.rows_step`` in one ``mx.compile`` call.
"""

from typing import NamedTuple, Optional, Tuple

import mlx.core as mx

from ...config import H2OConfig
from ...kernels import H2OStep, h2o_step_supported, make_plan, runs_on_gpu
from ...kernels.h2o_step import row_params_array
from ...policy import EMPTY
from ...scores import score_mode
from .. import first_use
from ..batch_rows import row_ints
from ..ops_step import compiled_rows_step, rows_step, written_input

# Kernel family of the Metal first-use check (cache/first_use.py).
ROWS_STEP = "fused step over rows"


class RowsDecode(NamedTuple):
    """One decode step of a batch, as the cache's update leaves it: per row
    (host values) what the kernels' parameters say (``row_params``), and the
    (B, 1, 1) arrays the ops step reads, made from them."""

    target: mx.array  # (B, Hk, 1) int32: the slot each row's token went to
    written: object  # the token's score (policy.written_score): 0.0 or an array
    seen: Tuple[int, ...]  # tokens seen per row, this step's included
    has: Tuple[bool, ...]  # rows with a token this step
    full: Tuple[bool, ...]  # rows whose next token takes their victim's slot

    @property
    def qpos(self) -> mx.array:
        """Each row's token position, EMPTY without one."""
        return row_ints(tuple(s - 1 if h else EMPTY for s, h in zip(self.seen, self.has)), 3)

    @property
    def rank_at(self) -> mx.array:
        """Tokens seen + 1: where the next victim is ranked."""
        return row_ints(tuple(s + 1 for s in self.seen), 3)

    @property
    def full_rows(self) -> mx.array:
        """``full`` as the ops step's (B, 1, 1) bool array."""
        return row_ints(self.full, 3, mx.bool_)


class RowsStep:
    """A batch cache's decode step: the fused kernels where they run, else
    the compiled ops step (the same decisions)."""

    def __init__(self, config: H2OConfig, window_size: Optional[int]):
        self.config, self.window_size = config, window_size
        self.kernel_mode = score_mode(config.score).kernel
        self.plan = self.plan_key = None
        self.unchecked = False  # the plan's first launch awaits its Metal check

    def __deepcopy__(self, memo):
        # Plans are made per device and shape: a copy (mlx-lm copies a
        # prompt batch when it splits one) makes its own.
        return RowsStep(self.config, self.window_size)

    def sync(self) -> None:
        """Nothing is held back: each step's metadata is the cache's."""

    def forget(self) -> None:
        """Nothing is decided ahead but the next victim, which the cache holds."""

    def __call__(self, cache, queries, keys, values, scale, mask, sinks, step: RowsDecode):
        """(out, positions, score, count, next target (B, Hk, 1) int32)."""
        meta = (cache.positions, cache.score, cache.count)
        plan = self.fused_plan(queries, keys, values, meta[0], scale, mask, sinks, step)
        if plan is not None:
            return self.fused(plan, queries, keys, values, meta, scale, sinks, step)
        args = (queries, keys, values, *meta, step.target, step.qpos, step.rank_at,
                step.full_rows)
        if mask is None and sinks is None:
            fn = compiled_rows_step(self.config, float(scale), self.window_size)
            return fn(*args, written_input(step.written))
        return rows_step(self.config, scale, *args, step.written, self.window_size,
                         mask=mask, sinks=sinks)

    def fused_plan(self, queries, keys, values, positions, scale, mask, sinks, step):
        """The kernels' StepPlan for this call, or None (the ops step).
        Whether they run is decided once per signature (device and shapes):
        decode is host bound on a GPU."""
        if (mask is not None or not self.kernel_mode or isinstance(step.written, mx.array)
                or step.written != 0.0):
            return None
        key = (mx.default_device(), queries.shape, queries.dtype, keys.dtype, keys.shape,
               values.dtype, values.shape, scale, None if sinks is None else sinks.shape)
        if key != self.plan_key:
            self.plan = self.make_plan(queries, keys, values, positions, scale, sinks)
            self.plan_key = key
            self.unchecked = first_use.needs_check(ROWS_STEP)
        return self.plan

    def make_plan(self, queries, keys, values, positions, scale, sinks):
        if not (runs_on_gpu() and first_use.passed(ROWS_STEP)
                and h2o_step_supported(queries, keys, values, positions, None, sinks)):
            return None
        cfg = self.config
        return make_plan(
            queries, keys, positions, None, sinks, mode=cfg.score, alpha=cfg.ema_alpha,
            scale=scale, sink_size=cfg.sink_size, recent_budget=cfg.recent_budget,
            pinned=cfg.pinned, window_size=self.window_size, rows=True)

    def fused(self, plan, queries, keys, values, meta, scale, sinks, step):
        prm = row_params_array(step.seen, step.has, step.full, tuple(plan.tail), keys.shape[2])

        def launch():
            return plan.run(queries, keys, values, *meta, step.target, prm, sinks=sinks)

        if not self.unchecked:
            res = launch()
        else:  # Metal's first: against the ops step
            self.unchecked, self.plan_key = False, None  # decided again, the check's outcome known
            res = first_use.checked(
                ROWS_STEP, launch, lambda: self.reference(queries, keys, values, meta, scale,
                                                          sinks, step),
                lambda got, want: first_use.step_differs(
                    self.config.score, *(x._replace(victim=x.victim[..., None])
                                         for x in (got, want))))
        return res.out, res.positions, res.score, res.count, res.victim

    def reference(self, queries, keys, values, meta, scale, sinks, step) -> H2OStep:
        out, p, s, c, nxt = rows_step(self.config, scale, queries, keys, values, *meta,
                                      step.target, step.qpos, step.rank_at, step.full_rows,
                                      step.written, self.window_size, sinks=sinks)
        return H2OStep(out, p, s, c, nxt, None, None)
