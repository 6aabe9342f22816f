"""SlotCache: the slot state of an H2O cache and how tokens enter and leave it.

Storage is slot based: preallocated (B, n_kv_heads, slots, D) buffers (the
storage object, ``kv``) with a token position, a score and a count per slot.
A decode step that evicts writes its token into the victim's slot (per
sequence and KV head), so slot order is not token order and masks come from
positions. This class holds that state and the moves on it: appends and
growth, the policy's victim, compaction past the budget, gathers, the op-by-op
score fold and masks.
H2OKVCache (cache/h2o.py) adds mlx-lm's cache contract on top; its decode
step (cache/decode/) decides when each move runs.
"""

from typing import Optional

import mlx.core as mx

from .. import policy
from ..config import H2OConfig, check_window_size
from ..kernels import scaled_dot_product_attention_with_scores
from ..scores import score_mode
from .storage import DenseKV, fresh_slot, resize_slots, take_slots


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


class SlotCache:
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
        self.offset = 0  # tokens seen
        self.evicted = 0  # tokens evicted per (sequence, KV head)
        self.slots_used = 0  # slots in use
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

    # --- appends ----------------------------------------------------------------
    def append(self, keys, values, meta=True):
        L, n = keys.shape[2], self.slots_used
        need = n + L
        if need > self.kv.capacity:
            self._grow(need, keys, values)
        self.kv.write(n, keys, values)
        self._note_written(keys)
        self.slots_used = need
        self.meta_pending = not meta
        if meta:
            self._write_append_meta(n, L, self.offset)

    def _write_append_meta(self, n, L, first):
        self.positions[..., n : n + L] = mx.arange(first, first + L)
        self.score[..., n : n + L] = self.new_score
        self.count[..., n : n + L] = 0.0

    @property
    def config(self) -> H2OConfig:
        return self._config

    @config.setter
    def config(self, config: H2OConfig):
        self._config = config
        # Decided once: only a key-norm mode scores the keys it writes.
        self.keys_scored = score_mode(config.score).from_keys

    def _note_written(self, keys):
        """Keep the score of the keys just written for their metadata write."""
        if self.keys_scored:
            self.new_score = policy.written_score(self.config.score, keys)

    def write_pending_meta(self):
        """The last decode token's position and scores, when no kernel wrote them."""
        if self.written_slot is None:
            self._write_append_meta(self.slots_used - 1, 1, self.offset - 1)
            self.meta_pending = False
        else:
            self._write_slot_meta(self.written_slot)

    def _grow(self, need, keys, values):
        n, size = self.slots_used, policy.grown_size(self.config, need)
        self.lingering = False
        self.kv.resize(n, size, keys, values)
        shape = (*keys.shape[:2], size)
        self.positions = resize_slots(self.positions, n, shape, mx.int32)
        self.score = resize_slots(self.score, n, shape, mx.float32)
        self.count = resize_slots(self.count, n, shape, mx.float32)

    # --- victims ----------------------------------------------------------------
    def priority(self, offset):
        n = self.slots_used
        pos = self.positions[..., :n]
        score, count = self.score[..., :n], self.count[..., :n]
        pri = policy.slot_priority(self.config, pos, score, count, offset, self.window_size)
        return pri, pos

    def write_into_victim(self, keys, values):
        """The policy's victim takes this decode token: its slot (B, Hk, 1)."""
        pri, pos = self.priority(self.offset + 1)
        # int32: a fused step may read it next (argmin gives uint32).
        slot = policy.select_victim(pri, pos).astype(mx.int32)[..., None]  # (B, Hk, 1)
        self.kv.write_slot(slot, keys, values)
        self._note_written(keys)
        self._write_slot_meta(slot, self.offset)
        self.evicted += 1
        return slot

    def into_victim(self) -> bool:
        """Whether this decode token goes straight into the victim the last
        step picked ahead: the full cache's steady state (a cache past its
        budget compacts first; after a trim or a bulk eviction none is held)."""
        return self.next_victim is not None and self.slots_used == self.max_size

    def write_picked_victim(self, keys, values, for_sdpa=False):
        """This decode token into the victim the last step picked ahead
        (``_victim``), its metadata left to the step's kernel or fold."""
        victim = self.next_victim
        self.kv.write_index(victim, keys, values, for_sdpa=for_sdpa)
        self._note_written(keys)
        self.written_slot, self.next_victim = victim, None
        self.meta_pending = True
        self.evicted += 1

    def decode_into_victim(self, keys, values, for_sdpa=False):
        """A decode token of the steady state (``into_victim``): written into
        the picked victim, counted; returns the K/V attention reads."""
        self.token_bytes = keys.nbytes + values.nbytes
        self.write_picked_victim(keys, values, for_sdpa)
        self.offset += 1
        self.pending = 1
        return self.kv.fetch(self.slots_used)

    def _write_slot_meta(self, slot, position=None):
        """Position of the token written into ``slot``, with fresh scores."""
        position = self.offset - 1 if position is None else position
        self.positions, self.score, self.count = fresh_slot(
            self.positions, self.score, self.count, slot, position, self.new_score)
        self.meta_pending = False

    # --- compaction -------------------------------------------------------------
    def compact_past_budget(self):
        """A prompt left past the budget (``prefill_compact="prompt"``) is
        compacted by the first decode step."""
        if self.slots_used > self.max_size:
            self._compact()

    def _compact(self):
        pri, pos = self.priority(self.offset)
        self.evicted += self.slots_used - self.max_size
        self.gather(policy.select_keep(pri, pos, self.max_size))

    def gather(self, slots):
        """Keep only ``slots`` (B, Hk, k), in that order."""
        self.next_victim, self.lingering = None, False
        n = self.slots_used
        self.kv.gather(slots, n)
        self.positions = take_slots(self.positions, slots, n)
        self.score = take_slots(self.score, slots, n)
        self.count = take_slots(self.count, slots, n)
        self.slots_used = slots.shape[-1]

    # --- scores -----------------------------------------------------------------
    def attention(self, queries, keys, values, scale, mask, sinks):
        """(out, logits, lse) of a decode token (the op-by-op reference step)."""
        return self.kv.attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    def chunk_attention(self, queries, keys, values, scale, mask, sinks):
        """A prompt chunk's (out, step, seen): ``policy.call_columns`` of the
        queries whose scores will be folded."""
        L, Hk, mode = queries.shape[2], self._positions.shape[1], self.config.score
        if self._scored_by_window(L):
            return self._window_attention(queries, keys, values, scale, mask, sinks)
        plan = policy.chunk_fold(self.config, L, self.slots_used - L, self.window_size)
        window = plan.scored if plan.scored < L else 0
        if score_mode(mode).magnitude == "abs_logit":
            out, logits, lse = self.attention(queries, keys, values, scale, mask, sinks)
            return (out, *policy.call_columns(mode, logits, lse, Hk, window))
        # Every query (or the overflowing chunk's last W) is scored: softmax
        # probabilities summed by a GEMM, no (L, N) logits left to fold.
        weights = None
        if window:
            weights = mx.broadcast_to(mx.arange(L) >= L - window, (queries.shape[0], L))
        out, step, seen = self.kv.column_attention(queries, keys, values, scale=scale,
                                                   mask=mask, sinks=sinks, weights=weights)
        return (out, *policy.cache_head_columns(step, seen, Hk))

    def _window_attention(self, queries, keys, values, scale, mask, sinks):
        """A chunk scored by its last ``prefill_window`` queries: MLX's SDPA
        attends the whole chunk, and logits come for the window alone (a 2K
        chunk's float32 logits were ~1 GB per layer for an 8B model)."""
        W, mode, Hk = self.config.prefill_window, self.config.score, self._positions.shape[1]
        keys, values = self.kv.dense(keys, values, queries.dtype)
        out = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if self._expected:  # one row of expected logits for the window's W rows
            logits, lse = policy.expected_logits(
                queries[:, :, -W:], keys, scale, _last_rows(mask, 1), sinks)
        else:
            _, logits, lse = scaled_dot_product_attention_with_scores(
                queries[:, :, -W:], keys, values, scale=scale, mask=_last_rows(mask, W),
                sinks=sinks)
        return (out, *policy.call_columns(mode, logits, lse, Hk))

    def _scored_by_window(self, L) -> bool:
        """A chunk that overflows is scored by its last ``prefill_window``
        queries (``policy.scored_by_window``; dense or quantized storage)."""
        return policy.scored_by_window(self.config, L, self.slots_used > self.max_size,
                                       self.window_size)

    @property
    def _expected(self) -> bool:
        """A chunk scored by its window is scored by the attention its
        window's queries lead to expect (scores.ScoreMode.prefill)."""
        return score_mode(self.config.score).prefill == "expected"

    def fold_ops(self, logits, lse):
        """Fold a decode step's scores op by op (``fold_columns`` for a chunk)."""
        Hk = self._positions.shape[1]
        self.fold_columns(*policy.call_columns(self.config.score, logits, lse, Hk), 1)

    def fold_columns(self, step, seen, L):
        """Fold a call's (step, seen), then compact a chunk that overflowed.

        ``L``: the call's query count (the columns may stand for its window)."""
        n, cfg = self.slots_used, self.config
        plan = policy.chunk_fold(cfg, L, n - L, self.window_size)
        score, count = self.score[..., :n], self.count[..., :n]
        if plan.replace:
            score, count = mx.zeros_like(score), mx.zeros_like(count)
        score, count = policy.fold_columns(cfg.score, score, count, step, seen, cfg.ema_alpha,
                                           self.positions[..., :n], plan.pool, plan.weight)
        self.score[..., :n] = score
        self.count[..., :n] = count
        self.pending = False
        if plan.compact:
            self._compact()  # "prompt" waits for the first decode step

    # --- masks ------------------------------------------------------------------
    def mask_for(self, L, mask):
        return policy.combine_masks(self._position_mask(L), mask)

    def _position_mask(self, L):
        if self.window_size is None or (L == 1 and self.offset <= self.window_size):
            return None if L == 1 else "causal"
        qpos = mx.arange(self.offset - L, self.offset)[None]  # (1, L)
        return policy.position_mask(self.positions[..., : self.slots_used], qpos, self.window_size)

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


def _last_rows(mask, W: int):
    """The mask of a call's last W queries (mlx-lm's "causal" is bottom-right aligned)."""
    if isinstance(mask, mx.array) and mask.ndim >= 2 and mask.shape[-2] > 1:
        return mask[..., -W:, :]
    return mask
