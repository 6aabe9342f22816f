"""How an H2O decode step folds its scores without the op-by-op path.

A mixin of H2OKVCache (cache/h2o.py), which owns the state: on a GPU, a fused
launch per layer (kernels.h2o_decode_step / h2o_fold_step) or one launch per
token for a group of layers (cache/group.py); on the CPU, one compiled call
(cache/ops_step.py). Each leaves the next token's victim in ``_victim``.
"""

import mlx.core as mx

from ..kernels import (H2OFold, H2OStep, h2o_fold_step, h2o_step_supported, make_plan,
                       runs_on_gpu)
from . import first_use
from .ops_step import (compiled_fill, compiled_step, evict_step, fold_step, with_tail,
                       zone_arrays)
from .quantized_storage import QuantizedKV
from .storage import DenseKV


# Kernel families of the Metal first-use check (cache/first_use.py).
FUSED_STEP = "fused step"
FOLD_STEP = "fold-only step"


def _token_slot(slot, positions, n: int):
    """Where this step's token went: its victim slot, or slot n - 1 when
    appending (``slot`` None), as a (B, Hk, 1) index."""
    return mx.full((*positions.shape[:2], 1), n - 1, mx.int32) if slot is None else slot


class DecodeSteps:
    """The fused GPU, group and compiled CPU decode steps of H2OKVCache."""

    # GPU decode: one fused launch attends, folds scores and picks the next
    # victim (kernels.h2o_decode_step); False keeps the op-by-op path.
    use_fused_step = True
    # Decode steps that take the op-by-op attention (quantized storage, masks)
    # fold their scores and pick the next victim in one GPU launch
    # (kernels.h2o_fold_step); subclasses that move tokens on eviction opt out.
    fold_on_gpu = True
    # On the CPU, an evicting decode step's attention, fold and next victim
    # run as one compiled function (cache/ops_step.py) instead of ~90 ops.
    compile_ops_step = True
    # Evicting decode steps folded with other layers' in one launch per token
    # (cache/group.py): make_h2o_cache sets the group on a GPU backend.
    _group = None
    _group_scale = None  # the scale of the query this cache last pushed
    group_steps = True  # False: never join a group (per-layer steps only)

    # --- group steps (cache/group.py) -------------------------------------------
    def groupable(self) -> bool:
        """Whether this cache's evicting decode steps can join a StepGroup."""
        return (self.group_steps and self.window_size is None and self.use_fused_step
                and not self._batched() and getattr(self.kv, "group_kind", None) is not None)

    def _group_step(self, queries, mask, sinks) -> bool:
        # The evicting steady state: the token went into a victim slot of a
        # full cache, nothing masks the step. group_steps = False on a member
        # takes it out at its next step.
        return (self._slot is not None and mask is None and sinks is None and self.group_steps
                and self.use_fused_step and self._n == self.config.max_size
                and self.window_size is None and self._group.takes(self, queries))

    def _leave_group(self):
        """Take this cache's metadata back from its group (it folds what is pending)."""
        if self._group is not None and self._group.holds(self):
            self._group.release()

    # --- fused GPU decode step ---------------------------------------------------
    def _may_fold(self) -> bool:
        return self.fold_on_gpu and runs_on_gpu() and first_use.passed(FOLD_STEP)

    def _may_fuse(self) -> bool:
        return (self.use_fused_step and type(self.kv) is DenseKV and runs_on_gpu()
                and first_use.passed(FUSED_STEP))

    def _fused_plan(self, queries, keys, values, scale, mask, sinks):
        """The fused step's StepPlan for this call, or None (op-by-op path)."""
        if queries.shape[2] != 1 or not self._may_fuse() or isinstance(mask, str):
            return None
        if mask is not None:  # array masks: checked and planned per call
            if not h2o_step_supported(queries, keys, values, self.positions, mask, sinks):
                return None
            return self._make_plan(queries, keys, scale, mask, sinks)
        # Unmasked: support and plan depend on the device and shapes only (the
        # buffers' capacity included): decided once per signature, one lookup
        # per step (host time is what a decode step costs, docs/DESIGN.md).
        key = (mx.default_device(), queries.shape, queries.dtype, keys.dtype, values.dtype,
               values.shape[3], self._positions.shape, scale,
               None if sinks is None else sinks.shape)
        if key != self._plan_key:
            ok = h2o_step_supported(queries, keys, values, self._positions, None, sinks)
            self._plan = self._make_plan(queries, keys, scale, None, sinks) if ok else None
            self._plan_key = key
        return self._plan

    def _make_plan(self, queries, keys, scale, mask, sinks):
        cfg = self.config
        return make_plan(
            queries, keys, self.positions, mask, sinks, mode=cfg.score, alpha=cfg.ema_alpha,
            scale=scale, sink_size=cfg.sink_size, recent_budget=cfg.recent_budget,
            pinned=cfg.pinned, window_size=self.window_size,
        )

    def _fused_step(self, plan, queries, keys, values, scale, mask, sinks):
        slot, n = self._slot, self._n
        if mask is None:
            # Whole buffers + a valid count: shapes only change when the buffers
            # grow, so the plan's compiled launch replays on every other step.
            keys, values = self.kv.keys, self.kv.values

        def launch():
            return plan(
                queries, keys, values, self._positions, self._score, self._count,
                slot, n - 1 if slot is None else None, self.offset, mask, sinks, valid=n,
            )

        if mask is None and sinks is None and first_use.needs_check(FUSED_STEP):
            res = first_use.checked(  # Metal's first: against the op-by-op step
                FUSED_STEP, launch,
                lambda: self._step_reference(queries, keys, values, scale, slot, n),
                lambda got, want: first_use.step_differs(self.config.score, got, want))
        else:
            res = launch()
        self._take_step(res)
        return res.out

    def _step_reference(self, queries, keys, values, scale, slot, n):
        """The fused step's result by the ops (ops_step.evict_step) over the
        first ``n`` slots, as an H2OStep without logits: metadata padded back
        to the buffers' length, the victim repeated along D as the kernel's."""
        full = (self._positions, self._score, self._count)
        out, *meta, victim = evict_step(
            self.config, float(scale), queries, keys[..., :n, :], values[..., :n, :],
            *(a[..., :n] for a in full), _token_slot(slot, full[0], n), self.offset,
            window_size=self.window_size)
        victim = mx.broadcast_to(victim, (*victim.shape[:3], keys.shape[3]))
        return H2OStep(out, *with_tail(meta, full), victim, None, None)

    def _fold_step(self, out, logits, lse):
        cfg, slot, n = self.config, self._slot, self._n
        positions, score, count = self.positions, self.score, self.count

        def launch():
            return h2o_fold_step(
                logits, lse, positions, score, count, slot=slot,
                append_slot=n - 1 if slot is None else None, offset=self.offset,
                mode=cfg.score, alpha=cfg.ema_alpha, sink_size=cfg.sink_size,
                recent_budget=cfg.recent_budget, pinned=cfg.pinned,
                window_size=self.window_size,
            )

        def reference():
            return H2OFold(*fold_step(cfg, logits, lse, positions, score, count,
                                      _token_slot(slot, positions, n), self.offset,
                                      self.window_size))

        if first_use.needs_check(FOLD_STEP):  # Metal's first: against the ops
            res = first_use.checked(FOLD_STEP, launch, reference,
                                    lambda got, want: first_use.fold_differs(cfg.score, got, want))
        else:
            res = launch()
        self._take_step(res)
        return self._with_metadata(out)

    def _take_step(self, res):
        """A fused GPU or compiled CPU step's results (H2OStep or H2OFold): the
        state it wrote, and the victim the next decode token goes to once the
        cache is full."""
        self._positions, self._score, self._count = res.positions, res.score, res.count
        self._victim = res.victim if self._n >= self.max_size else None
        self._slot, self._meta_pending, self._pending = None, False, False

    # --- compiled CPU steps (cache/ops_step.py) ---------------------------------
    def _compiles_here(self, queries, mask, sinks) -> bool:
        """One query, no mask but the layer's own window, on the CPU, over
        dense or uniformly quantized buffers whose metadata is as long as they
        are. Exact storage types: a subclass may attend its own way."""
        return (self.compile_ops_step and queries.shape[2] == 1 and mask is None
                and sinks is None and mx.default_device() == mx.cpu
                and self._compiled_kind() is not None
                and self.kv.capacity == self._positions.shape[2])

    def _compiled_kind(self):
        """What the compiled steps attend (ops_step.attention_for): the
        storage's group kind, for the exact dense and quantized storages."""
        return self.kv.group_kind if type(self.kv) in (DenseKV, QuantizedKV) else None

    def _steps_compiled(self, queries, mask, sinks) -> bool:
        """An evicting decode step of a full cache (this token went into a victim slot)."""
        return (self._slot is not None and not self._batched()
                and self._n == self.kv.capacity and self._compiles_here(queries, mask, sinks))

    def _compiled_step(self, queries, keys, values, scale):
        """The step in one compiled call; it picks the next token's victim, which
        update_and_fetch then writes into (as after a fused GPU step)."""
        cfg, kind = self.config, self._compiled_kind()
        if kind[0] == "quantized":
            keys, values = self.kv._as_triples(keys, values)
        step = compiled_step(cfg, float(scale), self.window_size, kind)
        out, *state = step(
            queries, keys, values, self._positions, self._score, self._count, self._slot,
            mx.array(self.offset, mx.int32), *zone_arrays(cfg.sink_size, cfg.recent_budget))
        self._take_step(H2OFold(*state))
        return self._with_metadata(out)

    def _fills_compiled(self, queries, mask, sinks) -> bool:
        """A decode step that appended (metadata written) and folds now: a
        window layer or an EMA mode below the budget."""
        return (self._slot is None and not self._meta_pending and not self._lingering
                and self._n <= self.max_size and self._compiles_here(queries, mask, sinks))

    def _compiled_fill(self, queries, scale):
        fill = compiled_fill(self.config, float(scale), self.window_size, self._compiled_kind())
        keys, values = self._fill_inputs()
        out, self._score, self._count = fill(
            queries, keys, values, self._positions, self._score, self._count,
            mx.array(self._n, mx.int32), mx.array(self.offset, mx.int32))
        self._pending = False
        return self._with_metadata(out)

    def _fill_inputs(self):
        """K / V as the compiled fill step reads them: the whole buffers."""
        return self.kv.keys, self.kv.values
