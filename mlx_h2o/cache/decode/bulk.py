"""Bulk eviction around a decode step (``H2OConfig.evict_batch`` > 1).

A full cache evicts ``evict_batch`` tokens at once: the kept slots go first
(best first), the evicted ones after them, and the next decode tokens append
over the evicted ones, which the score queue's steps still attend until then
(the whole buffer, as RotatingKVCache returns it: no slice per step). Plain
K/V without a sliding window reorder in one pass with the queue's scores
folded in (cache/bulk_evict.py); other storages as the per-step victim choice.
"""

from ... import policy
from ..bulk_evict import bulk_event
from .base import Wrapper
from .deferred import DeferredFill


class BulkEviction(Wrapper):
    def __init__(self, inner):
        super().__init__(inner)
        # The score queue inside, whose queries a bulk event folds.
        self.deferred = inner.find(DeferredFill)

    def update(self, keys, values):
        c = self.cache
        c.compact_past_budget()
        if c.slots_used >= c.max_size:
            self.evict()  # room for the next evict_batch decode tokens
        return self.inner.update(keys, values)

    def evict(self):
        c = self.cache
        n = c.slots_used
        keep = n - c.config.evict_batch
        if c.kv.plain and c.window_size is None and n == c.kv.capacity:
            self.event(keep)  # one pass (cache/bulk_evict.py)
        else:
            # As the per-step victim choice; reading the metadata folds the queue.
            pri, pos = c.priority(c.offset + 1)
            c.gather(policy.keep_then_evict(pri, pos, keep))
            _, score, count = c.slot_metadata()
            score[..., keep:] = 0.0  # appended tokens start unscored
            count[..., keep:] = 0.0
        c.slots_used = keep
        c.evicted += n - keep
        c.lingering = self.deferred is not None and n == c.kv.capacity
        if self.deferred is not None:
            self.deferred.event_lazy = True

    def event(self, keep):
        c, kv = self.cache, self.cache.kv
        items = self.deferred.queue.take() if self.deferred is not None else []
        queries = [it.queries for it in items] if items else None
        kv.keys, kv.values, *meta = bulk_event(
            queries, kv.keys, kv.values, *c.slot_metadata(), c.offset,
            n0=items[0].n if items else 0, scale=items[0].scale if items else 1.0,
            keep=keep, config=c.config)
        c.set_slot_metadata(*meta)
        c.next_victim = None
