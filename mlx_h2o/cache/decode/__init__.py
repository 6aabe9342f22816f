"""Decode steps of an H2O cache, chosen once when the cache is made.

A decode step (base.DecodeStep) takes each decode token's update and
attention. ``decode_step`` builds a cache's from its storage, config and
backend:

- the step itself: ``reference`` (op by op, the specification), ``compiled``
  (one mx.compile call on the CPU) or ``fused`` (GPU kernels); ``auto`` is
  ``fused`` where a GPU backend runs the kernels, else ``compiled``;
- around it, in a StepGroup on a GPU (grouped.py: one fold launch a token
  for many layers; cache/group.py's make_groups joins it);
- around that, the score queue (deferred.py) while the cache is below its
  budget: summed score modes over plain K/V without a sliding window;
- outermost, bulk eviction (bulk.py) when ``evict_batch`` > 1 and the
  storage keeps its zones on eviction.

Each step falls back to the reference for what its kernels do not take
(masks, shapes, another device), so every choice computes the same decisions.
"""

from ...kernels import runs_on_gpu
from ...scores import score_mode
from .base import DecodeStep
from .bulk import BulkEviction
from .compiled import CompiledStep, MixedCompiledStep
from .deferred import DeferredFill
from .fused import FusedStep
from .grouped import GroupedStep
from .reference import ReferenceStep

KINDS = ("auto", "reference", "compiled", "fused")
DEFER_STEPS = 128  # decode queries a score queue holds before it folds


def decode_step(cache, kind: str = "auto", defer: int = DEFER_STEPS,
                group=None) -> DecodeStep:
    """The decode step of ``cache``: ``kind`` one of KINDS; ``defer`` the
    score queue's length (0: every step folds its own scores); ``group`` a
    StepGroup to fold with."""
    if kind not in KINDS:
        raise ValueError(f"decode must be one of {KINDS}, got {kind!r}")
    if not isinstance(defer, int) or isinstance(defer, bool) or defer < 0:
        raise ValueError(f"defer must be an int >= 0 (queued decode queries), got {defer!r}")
    if kind == "auto":
        kind = "fused" if runs_on_gpu() else "compiled"
    kv, cfg = cache.kv, cache.config
    mode = score_mode(cfg.score)
    sdpa = group is not None  # a group step attends its victim's token by SDPA
    if kind == "reference":
        step = ReferenceStep(cache, sdpa)
    elif kind == "compiled":
        step = (MixedCompiledStep if kv.moves_on_evict else CompiledStep)(cache, sdpa)
    else:  # a score mode without a kernel branch folds by the reference
        step = FusedStep(cache, fuse=kv.plain and mode.kernel,
                         fold_kernel=mode.kernel and not kv.moves_on_evict, sdpa_victims=sdpa)
    if group is not None:
        step = GroupedStep(step, group)
    if (defer and kv.plain and cache.window_size is None
            and mode.deferrable):
        step = DeferredFill(step, defer, cache.fold_phase)
    if cfg.evict_batch > 1 and not kv.moves_on_evict:
        step = BulkEviction(step)
    return step


__all__ = ["KINDS", "DecodeStep", "decode_step"]
