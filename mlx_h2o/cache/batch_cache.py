"""BatchH2OKVCache: H2O eviction under mlx-lm's batched generation.

mlx-lm's ``BatchGenerator`` (``batch_generate``, ``mlx_lm.server``) merges the
caches of single sequences into one batch cache, pads prompts, lets rows join
(``extend``) and leave (``filter``) while others decode, and takes a finished
row's cache back out (``extract``) for its prompt cache. This is that batch
contract (``BatchKVCache``'s) for H2O caches, a face of the slot core
(cache/core.py) that ``H2OKVCache`` is the other face of: each row, and each
KV head of it, keeps what an ``H2OKVCache`` fed that row alone keeps (the
same moves, at the row's own counts).

Rows share one slot axis; a slot that holds no token of its row (padding,
an evicted token, room another row needed) has position ``policy.EMPTY``.
Outside a prefill chunk the slots never exceed ``max_size`` (a chunk that
overflows is attended in full, then compacted, as H2OKVCache does).

Speed paths (docs/DESIGN.md): a prompt chunk whose rows are scored by their
last ``prefill_window`` queries is attended by MLX's fused SDPA, and only
those queries' logits are computed (cache/chunk.py); a decode step writes
each row's token metadata, attends, folds and picks each row's next slot in
the fused GPU kernels, or in one compiled call of MLX ops (decode/rows.py).
"""

import json
from typing import List, Optional

import mlx.core as mx
import numpy as np

from .. import policy
from ..config import H2OConfig, config_from_dict, config_to_dict
from . import chunk
from .batch_rows import BatchRows, row_ints
from .chunk import chunk_call
from .core import EMPTY, SlotCore
from .decode.rows import RowsDecode, RowsStep
from .h2o import H2OKVCache


class BatchH2OKVCache(BatchRows, SlotCore):
    """A batch of H2O caches (mlx-lm's batch cache contract).

    ``offset`` (B,) int32 is each row's RoPE position of its next token
    (negative while left padding is pending). Per row, ``seen`` tokens were
    fed, ``kept`` are held (``evicted = seen - kept``). Build one with
    ``merge`` (from ``H2OKVCache``s) or ``BatchH2OKVCache(config, B)``.
    ``next_victim`` (B, Hk, 1) is the slot each row's next decode token
    takes, picked by the last decode step.
    """

    def __init__(self, config: H2OConfig, batch_size: int = 0,
                 window_size: Optional[int] = None, left_padding=None):
        SlotCore.__init__(self, config, window_size)
        if config.evict_batch != 1:
            raise ValueError(
                f"evict_batch={config.evict_batch}: the batched H2O cache evicts every "
                "step; use evict_batch=1")
        self.decode = RowsStep(config, self.window_size)
        self.model_name = ""
        self._call = None  # what the last update tells its attention
        self.token_bytes = 0
        self._set_rows([0] * batch_size, [0] * batch_size,
                       list(left_padding or [0] * batch_size), None)

    # --- mlx-lm cache contract -------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self._call is not None:
            raise RuntimeError(
                "BatchH2OKVCache.update_and_fetch was called again before the attention "
                "of the previous call: wrap the forward pass in `with mlx_h2o.patch():`")
        B, _, L, _ = keys.shape
        if B != len(self.seen):
            raise ValueError(f"keys hold {B} rows but the batch cache has {len(self.seen)}")
        self.token_bytes = (keys.nbytes + values.nbytes) // L
        spans = self._take_spans(L)
        if L == 1:
            self._decode(keys, values, spans)
        else:
            self._chunk(keys, values, spans)
        self._sync_offset()
        return self.kv.fetch(self.slots_used)

    def h2o_attention(self, queries, keys, values, *, scale, mask=None, sinks=None):
        """Attention over the rows' held slots (masks from positions), its
        scores folded row by row, then the compaction of overflowing rows."""
        call, self._call = self._call, None
        if call is None:
            raise RuntimeError("h2o_attention without a preceding update_and_fetch")
        if isinstance(call, RowsDecode):
            return self._attend_decode(queries, keys, values, scale, mask, sinks, call)
        # Until a row evicts, every KV head holds the same positions: one
        # (B, 1, L, N) mask serves all of them, as BatchKVCache's does.
        heads = 1 if self.seen == self.kept else None
        mask = self.mask_for(call.length, mask, call.qpos, heads)
        out, exact, expected, windowed = self.chunk_attention(queries, keys, values, scale,
                                                              mask, sinks, call)
        exact = self._with_previews(call, exact, keys, values, scale, sinks)
        self.fold_chunk(call, exact, expected)
        self._compact([b for b, p in enumerate(call.plans) if p.compact])
        self._pack()
        if not windowed:
            # A chunk's logits are large: finish this layer before the next.
            mx.eval(out, *self.slot_metadata())
            return out
        # The next layer waits for this one's slots: left to the end of the
        # forward pass, every layer's chunk K/V and mask would be alive at once
        # (a prefill peak above BatchKVCache's).
        return mx.depends(out, [*self.kv.fetch(self.slots_used), *self.slot_metadata()])

    def _with_previews(self, call, exact, keys, values, scale, sinks):
        """``exact`` plus, on the rows whose chunk is compacted before their
        previewed end arrives, their preview's columns (H2OKVCache's rule);
        a row whose end has arrived forgets its preview."""
        self.previews = [None if p is None or s > p[1] else p
                         for p, s in zip(self.previews, self.seen)]
        rows = [b for b, (p, plan) in enumerate(zip(self.previews, call.plans))
                if p is not None and plan.compact]
        if not rows or exact is None:
            return exact
        blank = mx.zeros_like(self.previews[rows[0]][0])
        q = mx.concatenate([p[0] if b in rows else blank
                            for b, p in enumerate(self.previews)], axis=0)
        n, W = self.slots_used, q.shape[2]
        held = self.positions[..., :n] >= 0  # (B, Hk, N): empty slots hidden
        mask = mx.broadcast_to(held[:, :, None, :], (*held.shape[:2], W, n))
        step, seen = chunk.with_preview(self.kv, self.config.score, self._positions.shape[1],
                                        exact, q, keys, values, scale, sinks, mask)
        on = self._row_mask(rows)
        return (None if step is None else mx.where(on, step, exact[0]),
                mx.where(on, seen, exact[1]))

    def _attend_decode(self, queries, keys, values, scale, mask, sinks, step):
        """One token per row: the fused kernels on a GPU, else the compiled
        ops step (decode/rows.py)."""
        run = self.decode
        if (run.config, run.window_size) != (self.config, self.window_size):
            run = self.decode = RowsStep(self.config, self.window_size)
        out, *meta, nxt = run(self, queries, keys, values, scale, mask, sinks, step)
        self.set_slot_metadata(*meta)
        self.next_victim = nxt
        # Evaluated with the output: left lazy, each step's graph would hold
        # the last one's buffers.
        return mx.depends(out, [*meta, nxt])

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        # Masks come from slot positions in h2o_attention (padding included).
        return None if N == 1 else "causal"

    def empty(self) -> bool:
        return self._positions is None

    @property
    def nbytes(self) -> int:
        if self.empty():
            return 0
        return self.kv.nbytes + sum(a.nbytes for a in self.slot_metadata())

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget the ``n`` newest tokens of every row, as H2OKVCache.trim does
        for one sequence (exact: ``offset`` drops by n, each row keeps its best
        held tokens below it). ``n`` is capped at the fewest tokens a row has."""
        n = max(0, min(int(n), min(self.seen, default=0)))
        self.previews = [None] * len(self.seen)  # for prompts the trim abandons
        if n == 0 or self.empty():
            return 0
        keep, k = self.trim_keep(self._seen_rows(-n), per_row=True)
        self.forget(keep)
        self.kept = k
        self.seen = [s - n for s in self.seen]
        self._sync_offset()
        return n

    # --- state -------------------------------------------------------------------
    @property
    def state(self):
        if self.empty():
            return []
        n = self.slots_used
        return (*self.kv.state(n), *(a[:, :, :n] for a in self.slot_metadata()))

    @state.setter
    def state(self, v):
        self._call = self.next_victim = None
        if not v:
            self.kv = self.storage_cls()
            self.set_slot_metadata(None, None, None)
            self.slots_used = 0
            return
        *kv, positions, score, count = (mx.array(a) for a in v)
        self.kv.set_state(kv)
        self.set_slot_metadata(positions, score, count)
        self.slots_used = positions.shape[2]

    @property
    def meta_state(self):
        rows = {"seen": self.seen, "kept": self.kept, "left": self.left,
                "valid": self.valid}
        window = "" if self.window_size is None else str(self.window_size)
        return (json.dumps(config_to_dict(self.config)), window, self.model_name,
                json.dumps(rows))

    @meta_state.setter
    def meta_state(self, v):
        config, window, self.model_name, rows = v
        self.config = config_from_dict(json.loads(config))
        self.window_size = int(window) if window else None
        r = json.loads(rows)
        self._set_rows(r["seen"], r["kept"], r["left"], r["valid"])

    @classmethod
    def from_state(cls, state, meta_state) -> "BatchH2OKVCache":
        obj = cls(config_from_dict(json.loads(meta_state[0])))
        obj.meta_state = meta_state
        obj.state = state
        return obj

    # --- updates -----------------------------------------------------------------
    def _decode(self, keys, values, spans):
        """One token per row: into the row's victim when it is full, else into
        an empty slot (more slots only when a row with a token has none)."""
        cfg, has = self.config, [c == 1 for _, c in spans]
        # A prompt left whole (prefill_compact="prompt") is compacted first.
        whole = [b for b, h in enumerate(has) if h and self.kept[b] > cfg.max_size]
        if whole:
            self._compact(whole)
            self._pack()
        self.reserve(1, keys, values)
        self.slots_used = self.kv.capacity  # decode reads whole buffers (EMPTY slots masked)
        full = [h and k >= cfg.max_size for h, k in zip(has, self.kept)]
        if any(h and not f and k >= self.slots_used for h, f, k in zip(has, full, self.kept)):
            self.reserve(self.slots_used + 1, keys, values)
            self.slots_used = self.kv.capacity
        target = self.next_victim
        if target is None:
            target = self.victims(self._seen_rows(), row_ints(tuple(full), 2, mx.bool_))
        self.kv.write_slot(target, keys, values,
                           None if all(has) else row_ints(tuple(has), 1, mx.bool_))
        self.kept = [k + (h and not f) for k, h, f in zip(self.kept, has, full)]
        self.seen = [s + h for s, h in zip(self.seen, has)]
        written = policy.written_score(cfg.score, keys) if self.keys_scored else 0.0
        self._call = RowsDecode(target, written, tuple(self.seen), tuple(has),
                                tuple(k >= cfg.max_size for k in self.kept))

    def _chunk(self, keys, values, spans):
        """L > 1 tokens: appended as new slots (padding at position EMPTY). A
        row with one token of its own takes H2OKVCache's decode path (its
        victim goes first); one whose chunk overflows is scored by its last
        ``prefill_window`` queries and compacted after the attention."""
        cfg, L = self.config, keys.shape[2]
        ones = [b for b, (_, c) in enumerate(spans) if c == 1]
        self._compact([b for b in ones if self.kept[b] > cfg.max_size])
        self._evict_one([b for b in ones if self.kept[b] >= cfg.max_size])
        qpos = np.full((len(spans), L), EMPTY, np.int32)
        for b, (start, c) in enumerate(spans):
            qpos[b, start : start + c] = np.arange(self.seen[b], self.seen[b] + c)
        qpos = mx.array(qpos)
        self.append(keys, values, qpos)
        self.kept = [k + c for k, (_, c) in zip(self.kept, spans)]
        self.seen = [s + c for s, (_, c) in zip(self.seen, spans)]
        self._call = chunk_call(cfg, spans, self.kept, L, self.window_size, qpos)

    def _evict_one(self, rows: List[int]):
        """``rows`` evict their victim (ranked for one more token) to make
        room for a token appended elsewhere (H2OKVCache's decode eviction)."""
        if not rows:
            return
        victim = self.victims(self._seen_rows())
        hit = mx.arange(self.slots_used) == victim
        self.forget(~(hit & self._row_mask(rows)))
        for b in rows:
            self.kept[b] -= 1

    def _compact(self, rows: List[int]):
        """``rows`` keep their ``max_size`` best tokens (H2OKVCache._compact)."""
        if not rows:
            return
        self.compact(self._seen_rows(), self._row_mask(rows))
        for b in rows:
            self.kept[b] = self.config.max_size

    def _pack(self):
        """Drop the slots no row needs: ``max(kept)`` slots, tokens in
        position order (the slots in use then never exceed max_size)."""
        k = max(self.kept, default=0)
        if not self.empty() and k < self.slots_used:
            self.pack(k)


# mlx-lm merges through the single caches' class: ``caches[0].merge(caches)``.
H2OKVCache.batch_class = BatchH2OKVCache
