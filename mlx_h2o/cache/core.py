"""SlotCore: the slot state of H2O caches and the moves on it.

One core serves one sequence (H2OKVCache, cache/h2o.py) and a batch of rows
at different fill levels (BatchH2OKVCache, cache/batch_cache.py): K/V in
preallocated (B, n_kv_heads, slots, D) buffers (the storage object, ``kv``)
with a token position, a score and a count per slot. A decode step that
evicts writes its token into the victim's slot (per row and KV head), so
slot order is not token order and masks come from positions. A slot that
holds no token of its row (batch padding, a token the row evicted, room
another row needed, room not yet used) has position ``EMPTY``: masked,
never scored, kept or counted; a single sequence's slots in use never do.

Every move takes the rows' counts where rows differ (``seen``: an int, or
(B, 1, 1) tokens seen per row) and every decision is ``mlx_h2o.policy``'s:
growth, the victim (or a row's first empty slot), the k best slots to keep,
their packing, a trim, a prompt chunk's scoring and fold (``chunk.py``),
masks. The faces hold mlx-lm's two contracts and the counts; their decode
steps (cache/decode/) decide when each move runs.
"""

from typing import Optional

import mlx.core as mx

from .. import policy
from ..config import H2OConfig, check_window_size
from ..scores import score_mode
from . import chunk
from .storage import DenseKV, fresh_slot, resize_slots, take_slots

EMPTY = policy.EMPTY


def _synced(name):
    """Slot metadata read through this property is up to date: the decode
    step folds what it holds back first (queued scores, a group's stack)."""
    attr = "_" + name

    def get(self):
        self.decode.sync()
        return getattr(self, attr)

    def put(self, value):
        self.decode.sync()
        setattr(self, attr, value)

    return property(get, put)


class SlotCore:
    """Slots, their metadata and the moves on them."""

    storage_cls = DenseKV

    positions = _synced("positions")  # (B, Hk, cap) int32 token position per slot
    score = _synced("score")  # (B, Hk, cap) float32 accumulated score
    count = _synced("count")  # (B, Hk, cap) float32 queries that saw the slot

    def __init__(self, config: H2OConfig, window_size: Optional[int] = None):
        if not isinstance(config, H2OConfig):
            raise TypeError(f"config must be an H2OConfig, got {type(config).__name__}")
        self.config = config
        self.window_size = check_window_size(window_size)
        self.kv = self.storage_cls()
        self._positions = self._score = self._count = None
        self.slots_used = 0  # slots in use (shared by a batch's rows)
        self.pending = False  # tokens whose attention has not run yet
        # Slots n..capacity hold tokens a bulk eviction dropped (evict_batch):
        # deferred decode steps attend them until new tokens overwrite them.
        self.lingering = False
        self.written_slot = None  # (B, Hk, 1[, D]) slot this step's token overwrote
        self.meta_pending = False  # this step's token has no position / scores yet
        self.next_victim = None  # (B, Hk, 1, ·) slot of the next decode token, picked ahead
        # The score the last written token(s) start with (policy.written_score:
        # -||k|| for a key-norm mode, else 0.0), until their metadata is written.
        self.new_score = 0.0

    @property
    def max_size(self) -> int:
        return self.config.max_size

    @property
    def config(self) -> H2OConfig:
        return self._config

    @config.setter
    def config(self, config: H2OConfig):
        self._config = config
        # Decided once: only a key-norm mode scores the keys it writes.
        self.keys_scored = score_mode(config.score).from_keys

    # --- appends ----------------------------------------------------------------
    def append(self, keys, values, first=None, meta=True):
        """Write L tokens per row at slots n..n+L: positions ``first`` ..
        ``first + L`` (an int), or ``first`` (B, L) per row (EMPTY: padding)."""
        L, n = keys.shape[2], self.slots_used
        self.reserve(n + L, keys, values)
        self.kv.write(n, keys, values)
        self._note_written(keys)
        self.slots_used = n + L
        self.meta_pending = not meta
        if meta:
            self._write_append_meta(n, L, first)

    def _write_append_meta(self, n, L, first):
        if isinstance(first, mx.array):
            first = mx.broadcast_to(first[:, None], (*self._positions.shape[:2], L))
        else:
            first = mx.arange(first, first + L)
        self.positions[..., n : n + L] = first
        self.score[..., n : n + L] = self.new_score
        self.count[..., n : n + L] = 0.0

    def _note_written(self, keys):
        """Keep the score of the keys just written for their metadata write."""
        if self.keys_scored:
            self.new_score = policy.written_score(self.config.score, keys)

    def _grow(self, need, keys, values):
        """Room for ``need`` slots (policy.grown_size); new slots are empty."""
        n, size = self.slots_used, policy.grown_size(self.config, need)
        self.lingering = False
        self.kv.resize(n, size, keys, values)
        shape = (*keys.shape[:2], size)
        self.positions = resize_slots(self.positions, n, shape, mx.int32, EMPTY)
        self.score = resize_slots(self.score, n, shape, mx.float32)
        self.count = resize_slots(self.count, n, shape, mx.float32)

    def reserve(self, need, keys, values):
        """At least ``need`` slots of room, the slots in use unchanged."""
        if need > self.kv.capacity:
            self._grow(need, keys, values)

    # --- victims ----------------------------------------------------------------
    def priority(self, seen):
        """(priority, positions) of the slots in use, ranked at ``seen``."""
        n = self.slots_used
        pos = self.positions[..., :n]
        score, count = self.score[..., :n], self.count[..., :n]
        pri = policy.slot_priority(self.config, pos, score, count, seen, self.window_size)
        return pri, pos

    def victims(self, seen, full=None) -> mx.array:
        """(B, Hk, 1) int32: the slot each row's next token takes: its victim,
        ranked for one more token than ``seen``; where ``full`` (B, 1) is
        False, the row's lowest empty slot instead."""
        pri, pos = self.priority(seen + 1)
        slot = policy.select_victim(pri, pos)
        if full is not None:
            slot = mx.where(full, slot, policy.first_empty(pos))
        # int32: a fused step may read it next (argmin gives uint32).
        return slot.astype(mx.int32)[..., None]

    def write_token(self, slot, keys, values, position):
        """One token per row into ``slot`` (B, Hk, 1) at ``position``, with
        fresh metadata."""
        self.kv.write_slot(slot, keys, values)
        self._note_written(keys)
        self._write_slot_meta(slot, position)

    def _write_slot_meta(self, slot, position):
        """Position of the token written into ``slot``, with fresh scores."""
        self.positions, self.score, self.count = fresh_slot(
            self.positions, self.score, self.count, slot, position, self.new_score)
        self.meta_pending = False

    # --- keeping ------------------------------------------------------------------
    def keep_best(self, seen, k, drop=None, sinks_first=False) -> mx.array:
        """(B, Hk, n) True on each row's ``k`` (an int, or (B, 1, 1)) best
        held slots ranked at ``seen`` (policy.keep_mask); ``drop``: slots
        that rank below every held one; ``sinks_first``: the protected
        zones give way to the sinks (a trim may keep fewer than they hold)."""
        pri, pos = self.priority(seen)
        if sinks_first:
            pri = policy.sinks_first(pri, pos, self.config.sink_size)
        return policy.keep_mask(pri, pos, k, drop)

    def compact(self, seen, rows=None):
        """Rows keep their ``max_size`` best tokens: every row (then ``max_size``
        slots remain), or those of ``rows`` (B, 1, 1) bool, the others' slots
        untouched (``pack`` drops what no row needs)."""
        keep = self.keep_best(seen, self.max_size)
        if rows is None:
            self.keep_only(keep, self.max_size)
        else:
            self.forget(keep | ~rows)

    def forget(self, keep):
        """Empty the slots in use outside ``keep`` (B, Hk, n)."""
        n = self.slots_used
        self.next_victim = None
        self.positions[..., :n] = mx.where(keep, self.positions[..., :n], EMPTY)
        self.score[..., :n] = mx.where(keep, self.score[..., :n], 0.0)
        self.count[..., :n] = mx.where(keep, self.count[..., :n], 0.0)

    def keep_only(self, keep, k: int):
        """``k`` slots: each row's slots in ``keep`` in position order, then empty ones."""
        pos = self.positions[..., : self.slots_used]
        self.gather(policy.packed_order(mx.where(keep, pos, EMPTY), k))

    def pack(self, k: int):
        """``k`` slots: each row's held tokens in position order, then empty
        ones (no row may hold more than ``k``)."""
        self.gather(policy.packed_order(self.positions[..., : self.slots_used], k))

    def gather(self, slots):
        """Keep only ``slots`` (B, Hk, k), in that order."""
        self.next_victim, self.lingering = None, False
        n = self.slots_used
        self.kv.gather(slots, n)
        self.positions = take_slots(self.positions, slots, n)
        self.score = take_slots(self.score, slots, n)
        self.count = take_slots(self.count, slots, n)
        self.slots_used = slots.shape[-1]

    def trim_keep(self, cut, per_row: bool):
        """(keep, k) of a trim to ``cut`` tokens seen (an int or (B, 1, 1)):
        every held token below it that fits, k the fewest any KV head holds
        below it (per row: (B,) a list; else an int, the fewest of all)."""
        pos = self.positions[..., : self.slots_used]
        gone = pos >= cut
        left = ((pos >= 0) & ~gone).sum(axis=-1)  # (B, Hk)
        if per_row:
            k = left.min(axis=-1).tolist()
            k_arr = mx.array(k, mx.int32)[:, None, None]
        else:
            k = k_arr = int(left.min())
        return self.keep_best(cut, k_arr, drop=gone, sinks_first=True), k

    # --- prompt chunks --------------------------------------------------------------
    def chunk_attention(self, queries, keys, values, scale, mask, sinks, call):
        """(out, exact, expected, windowed): a prompt chunk's attention and
        what its rows fold (chunk.py); ``windowed``: MLX's SDPA attended it."""
        windowed = self._windowed(call, queries.shape[2], mask, sinks)
        return (*chunk.attention(self.kv, self.config.score, self._positions.shape[1],
                                 queries, keys, values, scale, mask, sinks, call,
                                 windowed), windowed)

    def _windowed(self, call, L, mask, sinks) -> bool:
        """Whether MLX's fused SDPA attends the chunk and only its window's
        queries are scored (chunk.windowed)."""
        return chunk.windowed(call, mask, sinks)

    def fold_chunk(self, call, exact, expected):
        """Fold a chunk's columns into its rows' scores (chunk.fold)."""
        n = self.slots_used
        score, count = chunk.fold(self.config, call, self.score[..., :n], self.count[..., :n],
                                  self.positions[..., :n], exact, expected)
        self.score[..., :n] = score
        self.count[..., :n] = count
        self.pending = False

    # --- decode scores --------------------------------------------------------------
    def attention(self, queries, keys, values, scale, mask, sinks):
        """(out, logits, lse) of a decode token (the op-by-op reference step)."""
        return self.kv.attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    def fold_ops(self, logits, lse):
        """Fold a decode step's scores op by op."""
        n, cfg = self.slots_used, self.config
        step, seen = policy.call_columns(cfg.score, logits, lse, self._positions.shape[1])
        score, count = policy.fold_columns(cfg.score, self.score[..., :n],
                                           self.count[..., :n], step, seen, cfg.ema_alpha)
        self.score[..., :n] = score
        self.count[..., :n] = count
        self.pending = False

    # --- masks ------------------------------------------------------------------
    def mask_for(self, L, mask, qpos=None, heads=None):
        """The model's ``mask`` with the slots' own: what queries at ``qpos``
        ((1 or B, L); None: a single sequence's L newest tokens below its
        ``offset``, whose own mask is "causal" without a sliding window) see
        of the slots in use; ``heads`` 1 when every KV head holds the same
        positions."""
        if qpos is None:
            offset = self.offset
            if self.window_size is None or (L == 1 and offset <= self.window_size):
                return policy.combine_masks(None if L == 1 else "causal", mask)
            qpos = mx.arange(offset - L, offset)[None]
        pos = self.positions[:, :heads, : self.slots_used]
        return policy.combine_masks(policy.position_mask(pos, qpos, self.window_size), mask)

    # --- what decode steps share --------------------------------------------------
    def slot_metadata(self):
        """(positions, score, count) as held, whatever the decode step holds
        back (a StepGroup stacks them: cache/group.py)."""
        return self._positions, self._score, self._count

    def set_slot_metadata(self, positions, score, count) -> None:
        self._positions, self._score, self._count = positions, score, count

    def size(self) -> int:
        return self.slots_used

    def with_metadata(self, out):
        """``out``, evaluated together with the metadata a decode step updated.
        Nothing else reads it until a decision does; left lazy, each update's
        graph held that step's K buffer or logits (an H100 decode at 16K
        context grew by ~5 GB per 128 tokens and ran out of memory,
        docs/DESIGN.md)."""
        return mx.depends(out, [self._positions, self._score, self._count])
