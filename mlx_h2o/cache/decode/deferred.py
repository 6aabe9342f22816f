"""The score queue around a decode step: below the budget, scores fold later.

While a cache is below ``max_size`` (or appends over the slots a bulk
eviction freed) no decision reads its scores: the token is appended, MLX's
own SDPA attends (no score export, no custom launch, no metadata writes) and
the query waits in a ScoreQueue (cache/score_queue.py). Every ``steps``
queries, or as soon as anything reads the slot metadata, the queue is folded
in one pass: kernels/queued.py on a GPU, the ops elsewhere. Only the summed
score modes (``scores.DEFERRABLE``) over plain K/V without a sliding window
take it (decode_step decides); every other step goes to the inner step.
"""

import mlx.core as mx

from ...kernels import queue_fold, queue_fold_supported
from .. import first_use
from ..score_queue import ScoreQueue, fold_queue, queued_queries
from .base import Wrapper

QUEUE_FOLD = "queue fold"  # its kernel's family for the Metal first-use check


class DeferredFill(Wrapper):
    """``steps``: queries queued before a fold; ``phase`` staggers the
    first fold (ScoreQueue)."""

    def __init__(self, inner, steps: int = 128, phase: int = 0):
        super().__init__(inner)
        self.queue = ScoreQueue(steps, phase)
        self.lazy = False  # this token's scores go to the queue
        self.kernel = False  # the queue is folded by kernels/queued.py
        self.event_lazy = False  # a bulk eviction's metadata is not evaluated yet

    def stagger(self, phase: int) -> None:
        self.queue = ScoreQueue(self.queue.steps, phase)

    def update(self, keys, values):
        c = self.cache
        if not (c.slots_used < c.max_size or (c.lingering and c.slots_used < c.kv.capacity)):
            return self.inner.update(keys, values)
        c.token_bytes = keys.nbytes + values.nbytes
        c.written_slot = c.next_victim = None
        c.append(keys, values, meta=False)
        c.offset += 1
        c.pending = 1
        self.lazy = True
        # After a bulk eviction the whole buffer, as RotatingKVCache returns
        # it (no slice nodes): the evicted slots not yet overwritten too.
        return c.kv.fetch(c.kv.capacity if c.lingering else c.slots_used)

    def attend(self, queries, keys, values, scale, mask, sinks):
        lazy, self.lazy = self.lazy, False
        if lazy and mask is None and sinks is None:
            return self.queue_attend(queries, keys, values, scale)
        c = self.cache
        if c.lingering and keys.shape[2] > c.slots_used:  # only unmasked steps see them
            keys, values = keys[..., : c.slots_used, :], values[..., : c.slots_used, :]
            if isinstance(mask, mx.array) and mask.shape[-1] > c.slots_used:
                mask = mask[..., : c.slots_used]
        if self.queue.items:
            self.fold()
        return self.inner.attend(queries, keys, values, scale, mask, sinks)

    def sync(self) -> None:
        if self.queue.items:
            self.fold()
        self.inner.sync()

    def forget(self) -> None:
        self.queue.take()
        self.lazy = False
        self.inner.forget()

    def queue_attend(self, queries, keys, values, scale):
        c = self.cache
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale)
        if not self.queue.items:  # decided once per fold, not per step
            self.kernel = (first_use.passed(QUEUE_FOLD)
                           and queue_fold_supported(  # the kernel takes a full queue
                               queries, keys, queued=self.queue.steps))
            self.queue.start(queries, c.slots_used, None if self.kernel else self.width(c.slots_used))
        due = self.queue.push(queries, c.slots_used, c.offset - 1, scale)
        c.meta_pending = c.pending = False  # the queue owns them now
        if due:
            self.fold()
        if due or self.event_lazy:
            # A bulk event's metadata held its queue and K buffer; each event
            # left lazy chained onto the last (memory grew every event).
            self.event_lazy = False
            out = c.with_metadata(out)
        return out

    def fold(self):
        """Fold the queued queries' scores and write their tokens' metadata."""
        c = self.cache
        items = self.queue.take()
        first, n = items[0].n - 1, items[-1].n
        # Queued tokens are consecutive (anything else folds the queue first);
        # their slots' scores are zero (fresh buffer, or zeroed by trim).
        positions, score, count = c.slot_metadata()
        positions[..., first:n] = mx.arange(items[0].position, items[0].position + n - first)
        keys = c.kv.dense_keys(c.kv.capacity)
        # Checked again: a read of the metadata can fold under another default
        # device than the first push saw (e.g. a CPU stream); the ops fold runs there.
        if self.kernel and queue_fold_supported(items[0].queries, keys, len(items)):
            def kernel():
                return queue_fold(queued_queries(items), keys, [it.n for it in items],
                                  items[0].scale, score, count)
            if first_use.needs_check(QUEUE_FOLD):  # Metal's first: against the ops
                score, count = first_use.checked(
                    QUEUE_FOLD, kernel, lambda: self.ops_fold(items, n, score, count),
                    first_use.queue_differs)
                self.kernel = first_use.passed(QUEUE_FOLD)
            else:
                score, count = kernel()
        else:
            score, count = self.ops_fold(items, n, score, count)
        c.set_slot_metadata(positions, score, count)

    def ops_fold(self, items, n, score, count):
        """The queue's fold in mx ops: the new (score, count)."""
        w = self.width(n)
        step, seen = fold_queue(items, self.cache.kv.dense_keys(w))
        if w == score.shape[-1]:
            return score + step, count + seen
        score, count = mx.array(score), mx.array(count)  # new arrays
        score[..., :w] = score[..., :w] + step
        count[..., :w] = count[..., :w] + seen
        return score, count

    def width(self, n: int) -> int:
        """Slots a fold of the queue reads: ``n`` rounded up to ``config.step``
        (or the whole buffer). Slots a query does not see add exact zeros, and
        the fold's shapes repeat for up to ``step`` tokens instead of changing
        every token (H100, 16K context without eviction: 0.840 of KVCache's
        tok/s against 0.792 with folds of exactly ``n``; docs/DESIGN.md)."""
        c = self.cache
        # After a prompt compaction the metadata can be shorter than the buffer.
        cap = min(c.kv.capacity, c.slot_metadata()[1].shape[-1])
        return min(cap, -(-n // c.config.step) * c.config.step)
