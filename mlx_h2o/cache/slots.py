"""How H2OKVCache places tokens in its slots and takes them out.

A mixin of H2OKVCache (cache/h2o.py), which owns the state: appends and
growth, the per-step victim chosen by the op-by-op path, compaction of a
prompt past the budget, batched eviction (``evict_batch``) and the
attention masks that slot order (not token order) needs.
"""

import mlx.core as mx

from .. import policy
from .batch import batch_event
from .ops_step import slot_priority
from .storage import DenseKV, fresh_slot, resize_slots, take_slots


class Slots:
    """Slot bookkeeping of H2OKVCache: appends, victims, compaction, masks."""

    # config.evict_batch > 1 applies (subclasses that move tokens between
    # storage zones on eviction opt out).
    batch_eviction = True

    def _append(self, keys, values, meta=True):
        L, n = keys.shape[2], self._n
        need = n + L
        if need > self.kv.capacity:
            self._grow(need, keys, values)
        self.kv.write(n, keys, values)
        self._n = need
        if meta:
            self._write_append_meta(n, L, self.offset)

    def _write_append_meta(self, n, L, first):
        self.positions[..., n : n + L] = mx.arange(first, first + L)
        self.score[..., n : n + L] = 0.0
        self.count[..., n : n + L] = 0.0

    def _write_pending_meta(self):
        """The last decode token's position and scores, when no fused step wrote them."""
        if self._slot is None:
            self._write_append_meta(self._n - 1, 1, self.offset - 1)
            self._meta_pending = False
        else:
            self._write_slot_meta(self._slot)

    def _grow(self, need, keys, values):
        step, cap, n = self.config.step, self.max_size, self._n
        # Grow in steps up to max_size; a chunk past the budget gets exact room.
        size = min(-(-need // step) * step, cap) if need <= cap else need
        self._lingering = False
        self.kv.resize(n, size, keys, values)
        shape = (*keys.shape[:2], size)
        self.positions = resize_slots(self.positions, n, shape, mx.int32)
        self.score = resize_slots(self.score, n, shape, mx.float32)
        self.count = resize_slots(self.count, n, shape, mx.float32)

    def _priority(self, offset):
        n = self._n
        pos = self.positions[..., :n]
        score, count = self.score[..., :n], self.count[..., :n]
        return slot_priority(self.config, pos, score, count, offset, self.window_size), pos

    def _write_into_victim(self, keys, values):
        pri, pos = self._priority(self.offset + 1)
        # int32: a fused step may read it next (argmin gives uint32).
        slot = policy.select_victim(pri, pos).astype(mx.int32)[..., None]  # (B, Hk, 1)
        self.kv.write_slot(slot, keys, values)
        self._write_slot_meta(slot, self.offset)
        self.evicted += 1
        return slot

    def _into_victim(self, keys) -> bool:
        """Whether this decode token goes straight into the victim that a fused
        step, a compiled step or the group picked (``_victim``, checked by the
        caller): the full cache's steady state, where the general path of
        update_and_fetch would neither append, compact nor evict a batch. (A
        group member still waiting for its fold has no victim yet, and a
        cache lingers only after a batch eviction.)"""
        cfg = self.config
        return (keys.shape[2] == 1 and self._n == cfg.max_size
                and (cfg.evict_batch == 1 or not self.batch_eviction))

    def _write_decode_victim(self, keys, values):
        """What the general path does for that token, without its checks:
        every layer of an evicting decode runs it every token, and decode is
        host bound on the GPU (docs/DESIGN.md)."""
        victim = self._victim
        self.token_bytes = keys.nbytes + values.nbytes
        self.kv.write_index(victim, keys, values, for_sdpa=self._group is not None)
        self._slot, self._victim = victim, None
        self._meta_pending = self._pending = True
        self.evicted += 1
        self.offset += 1
        return self.kv.fetch(self._n)

    def _write_slot_meta(self, slot, position=None):
        """Position of the token written into ``slot``, with fresh scores."""
        position = self.offset - 1 if position is None else position
        self.positions, self.score, self.count = fresh_slot(
            self.positions, self.score, self.count, slot, position)
        self._meta_pending = False

    # --- batched eviction (config.evict_batch > 1) -------------------------------
    def _batched(self) -> bool:
        return self.batch_eviction and self.config.evict_batch > 1

    def _evict_batch(self):
        """Evict ``evict_batch`` tokens of a full cache at once: the kept ones go
        first (best first), the evicted ones after them, and the next
        decode tokens append (slice updates) over the evicted ones, which
        decode steps still attend until then (the whole buffer, as
        RotatingKVCache: no slice per step)."""
        self._leave_group()
        n = self._n
        keep = n - self.config.evict_batch
        if type(self.kv) is DenseKV and self.window_size is None and n == self.kv.capacity:
            self._batch_event(keep)  # one pass (cache/batch.py)
        else:
            # As the per-step victim choice; reading the metadata folds the queue.
            pri, pos = self._priority(self.offset + 1)
            self._gather(policy.keep_then_evict(pri, pos, keep))
            self._score[..., keep:] = 0.0  # appended tokens start unscored
            self._count[..., keep:] = 0.0
        self._n = keep
        self.evicted += n - keep
        self._lingering = self._may_defer() and n == self.kv.capacity
        self._event_lazy = True

    def _batch_event(self, keep):
        items, kv = self._queue.take(), self.kv
        queries = [it.queries for it in items] if items else None
        kv.keys, kv.values, self._positions, self._score, self._count = batch_event(
            queries, kv.keys, kv.values, self._positions, self._score, self._count,
            self.offset, n0=items[0].n if items else 0,
            scale=items[0].scale if items else 1.0, keep=keep, config=self.config)
        self._victim = None

    def _compact(self):
        pri, pos = self._priority(self.offset)
        self.evicted += self._n - self.max_size
        self._gather(policy.select_keep(pri, pos, self.max_size))

    def _gather(self, slots):
        """Keep only ``slots`` (B, Hk, k), in that order."""
        self._victim, self._lingering = None, False
        n = self._n
        self.kv.gather(slots, n)
        self.positions = take_slots(self.positions, slots, n)
        self.score = take_slots(self.score, slots, n)
        self.count = take_slots(self.count, slots, n)
        self._n = slots.shape[-1]

    # --- masks ----------------------------------------------------------------
    def _mask(self, L, mask):
        own = self._position_mask(L)
        if not isinstance(mask, mx.array):
            return own
        if own is None or isinstance(own, str):
            return mask  # a slot-layout array mask already encodes causality
        if mask.dtype == mx.bool_:
            return own & mask
        return mx.where(own, mask, -mx.inf)

    def _position_mask(self, L):
        if self.window_size is None or (L == 1 and self.offset <= self.window_size):
            return None if L == 1 else "causal"
        q = mx.arange(self.offset - L, self.offset)[:, None]  # (L, 1)
        k = self.positions[..., None, : self._n]  # (B, Hk, 1, n)
        return (k <= q) & (k > q - self.window_size)  # (B, Hk, L, n)
