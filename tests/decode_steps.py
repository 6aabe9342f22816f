"""What tests read of a cache's decode step (cache/decode/)."""

from mlx_h2o.cache.decode.deferred import DeferredFill
from mlx_h2o.cache.decode.grouped import GroupedStep


def queue_of(cache):
    """The cache's score queue (cache/score_queue.py), or None."""
    step = cache.decode.find(DeferredFill)
    return None if step is None else step.queue


def queue_kernel_of(cache) -> bool:
    """Whether the cache's score queue folds with the GPU kernel."""
    return cache.decode.find(DeferredFill).kernel


def group_of(cache):
    """The StepGroup the cache's decode steps fold with, or None."""
    step = cache.decode.find(GroupedStep)
    return None if step is None else step.group


def members_of(group, stacked=False):
    """The caches of a StepGroup's members (``stacked``: those whose
    metadata it holds now)."""
    return [m.cache for m in (group._stacked if stacked else group.members)]
