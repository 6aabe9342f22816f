"""The fused GPU decode step: one launch attends, folds and picks the next victim.

Over plain K/V buffers (dense storage) without an array mask the step is
``kernels.h2o_decode_step``, planned once per signature (device, shapes,
dtypes, scale): decode is host bound on the GPU, so a step costs one dict
lookup, not a support check. Attention the kernel does not take (quantized
storage, array masks, unsupported shapes) runs as the reference's, and its
fold and next victim as one ``kernels.h2o_fold_step`` launch. On Metal each
kernel family's first launch is checked against the ops (cache/first_use.py).
"""

import mlx.core as mx

from ...kernels import (H2OFold, H2OStep, fold_step_supported, h2o_fold_step,
                        h2o_step_supported, make_plan, runs_on_gpu)
from .. import first_use
from ..ops_step import evict_step, fold_step, with_tail
from ..storage import deepcopy_attrs
from .reference import ReferenceStep

# Kernel families of the Metal first-use check (cache/first_use.py).
FUSED_STEP = "fused step"
FOLD_STEP = "fold-only step"


def _token_slot(slot, positions, n: int):
    """Where this step's token went: its victim slot, or slot n - 1 when
    appending (``slot`` None), as a (B, Hk, 1) index."""
    return mx.full((*positions.shape[:2], 1), n - 1, mx.int32) if slot is None else slot


def _none():
    return None


class FusedStep(ReferenceStep):
    """``fuse``: the storage's K/V are plain arrays the fused kernel reads;
    ``fold_kernel``: the fold launch may run (an eviction that moves tokens
    between storage zones folds op by op)."""

    kind = "fused"
    kernel_writes_meta = True

    def __init__(self, cache, fuse: bool = True, fold_kernel: bool = True,
                 sdpa_victims: bool = False):
        super().__init__(cache, sdpa_victims)
        self.fuse, self.fold_kernel = fuse, fold_kernel
        self.plan = self.plan_key = None

    def forget(self) -> None:
        self.plan = self.plan_key = None

    def __deepcopy__(self, memo):
        # The plan is made per shape and device: the copy makes its own.
        return deepcopy_attrs(self, memo, fresh={"plan": _none, "plan_key": _none})

    def attend(self, queries, keys, values, scale, mask, sinks):
        plan = self.fused_plan(queries, keys, values, scale, mask, sinks)
        if plan is not None:
            return self.fused(plan, queries, keys, values, scale, mask, sinks)
        return super().attend(queries, keys, values, scale, mask, sinks)

    def fold(self, out, logits, lse):
        if (self.fold_kernel and runs_on_gpu() and first_use.passed(FOLD_STEP)
                and fold_step_supported(logits, lse, self.cache.positions)):
            return self.fold_launch(out, logits, lse)  # the kernel writes the metadata
        return super().fold(out, logits, lse)

    # --- the fused step ---------------------------------------------------------
    def fused_plan(self, queries, keys, values, scale, mask, sinks):
        """The fused step's StepPlan for this call, or None (reference attention)."""
        if (not self.fuse or isinstance(mask, str) or not runs_on_gpu()
                or not first_use.passed(FUSED_STEP)):
            return None
        c = self.cache
        if mask is not None:  # array masks: checked and planned per call
            if not h2o_step_supported(queries, keys, values, c.positions, mask, sinks):
                return None
            return self.make_plan(queries, keys, scale, mask, sinks)
        # Unmasked: support and plan depend on the device and shapes only (the
        # buffers' capacity included): decided once per signature.
        key = (mx.default_device(), queries.shape, queries.dtype, keys.dtype, values.dtype,
               values.shape[3], c.slot_metadata()[0].shape, scale,
               None if sinks is None else sinks.shape)
        if key != self.plan_key:
            ok = h2o_step_supported(queries, keys, values, c.slot_metadata()[0], None, sinks)
            self.plan = self.make_plan(queries, keys, scale, None, sinks) if ok else None
            self.plan_key = key
        return self.plan

    def make_plan(self, queries, keys, scale, mask, sinks):
        c = self.cache
        cfg = c.config
        return make_plan(
            queries, keys, c.positions, mask, sinks, mode=cfg.score, alpha=cfg.ema_alpha,
            scale=scale, sink_size=cfg.sink_size, recent_budget=cfg.recent_budget,
            pinned=cfg.pinned, window_size=c.window_size,
        )

    def fused(self, plan, queries, keys, values, scale, mask, sinks):
        c = self.cache
        slot, n = c.written_slot, c.slots_used
        if mask is None:
            # Whole buffers + a valid count: shapes only change when the buffers
            # grow, so the plan's compiled launch replays on every other step.
            keys, values = c.kv.keys, c.kv.values

        def launch():
            return plan(
                queries, keys, values, *c.slot_metadata(),
                slot, n - 1 if slot is None else None, c.offset, mask, sinks, valid=n,
            )

        if mask is None and sinks is None and first_use.needs_check(FUSED_STEP):
            res = first_use.checked(  # Metal's first: against the op-by-op step
                FUSED_STEP, launch,
                lambda: self.reference(queries, keys, values, scale, slot, n),
                lambda got, want: first_use.step_differs(c.config.score, got, want))
        else:
            res = launch()
        self.take(res)
        return res.out

    def reference(self, queries, keys, values, scale, slot, n):
        """The fused step's result by the ops (ops_step.evict_step) over the
        first ``n`` slots, as an H2OStep without logits: metadata padded back
        to the buffers' length, the victim repeated along D as the kernel's."""
        c = self.cache
        full = c.slot_metadata()
        out, *meta, victim = evict_step(
            c.config, float(scale), queries, keys[..., :n, :], values[..., :n, :],
            *(a[..., :n] for a in full), _token_slot(slot, full[0], n), c.offset,
            window_size=c.window_size)
        victim = mx.broadcast_to(victim, (*victim.shape[:3], keys.shape[3]))
        return H2OStep(out, *with_tail(meta, full), victim, None, None)

    # --- the fold launch ----------------------------------------------------------
    def fold_launch(self, out, logits, lse):
        c = self.cache
        cfg, slot, n = c.config, c.written_slot, c.slots_used
        positions, score, count = c.positions, c.score, c.count

        def launch():
            return h2o_fold_step(
                logits, lse, positions, score, count, slot=slot,
                append_slot=n - 1 if slot is None else None, offset=c.offset,
                mode=cfg.score, alpha=cfg.ema_alpha, sink_size=cfg.sink_size,
                recent_budget=cfg.recent_budget, pinned=cfg.pinned,
                window_size=c.window_size,
            )

        def reference():
            return H2OFold(*fold_step(cfg, logits, lse, positions, score, count,
                                      _token_slot(slot, positions, n), c.offset,
                                      c.window_size))

        if first_use.needs_check(FOLD_STEP):  # Metal's first: against the ops
            res = first_use.checked(FOLD_STEP, launch, reference,
                                    lambda got, want: first_use.fold_differs(cfg.score, got, want))
        else:
            res = launch()
        self.take(res)
        return c.with_metadata(out)
