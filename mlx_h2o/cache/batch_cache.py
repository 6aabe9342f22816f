"""BatchH2OKVCache: H2O eviction under mlx-lm's batched generation.

mlx-lm's ``BatchGenerator`` (``batch_generate``, ``mlx_lm.server``) merges the
caches of single sequences into one batch cache, pads prompts, lets rows join
(``extend``) and leave (``filter``) while others decode, and takes a finished
row's cache back out (``extract``) for its prompt cache. This is that batch
contract (``BatchKVCache``'s) for H2O caches: each row, and each KV head of
it, keeps what an ``H2OKVCache`` fed that row alone keeps (same policy, same
decisions, at the row's own offset), on the reference attention path.

Rows share one slot axis; a slot that holds no token of its row (padding,
an evicted token, room another row needed) has position -1: masked, never
scored, kept or counted (cache/batch_slots.py). Outside a prefill chunk the
slots in use never exceed ``max_size`` (a chunk that overflows is attended
in full, then compacted, as H2OKVCache does).
"""

import json
from typing import List, NamedTuple, Optional, Tuple

import mlx.core as mx
import numpy as np

from .. import policy
from ..config import H2OConfig, check_window_size, config_from_dict, config_to_dict
from ..kernels import scaled_dot_product_attention_with_scores
from ..scores import score_mode
from . import batch_slots as bs
from .batch_rows import BatchRows


class _Call(NamedTuple):
    """What an update tells the attention call that follows it."""

    qpos: mx.array  # (B, L) query positions, -1 for padding
    select: mx.array  # (B, L) queries each row folds
    pooled: Optional[mx.array]  # (B,) rows whose chunk overflowed (pooled scores)
    compact: List[int]  # rows to compact to max_size after the fold
    # (B,) rows scored by expected attention, (B, W) their window's queries
    expected: Optional[Tuple[mx.array, mx.array]] = None


class BatchH2OKVCache(BatchRows):
    """A batch of H2O caches (mlx-lm's batch cache contract).

    ``offset`` (B,) int32 is each row's RoPE position of its next token
    (negative while left padding is pending). Per row, ``seen`` tokens were
    fed, ``kept`` are held (``evicted = seen - kept``). Build one with
    ``merge`` (from ``H2OKVCache``s) or ``BatchH2OKVCache(config, B)``.
    """

    def __init__(self, config: H2OConfig, batch_size: int = 0,
                 window_size: Optional[int] = None, left_padding=None):
        if not isinstance(config, H2OConfig):
            raise TypeError(f"config must be an H2OConfig, got {type(config).__name__}")
        if config.evict_batch != 1:
            raise ValueError(
                f"evict_batch={config.evict_batch}: the batched H2O cache evicts every "
                "step; use evict_batch=1")
        self.config = config
        self.window_size = check_window_size(window_size)
        self.model_name = ""
        self.keys = self.values = self.positions = self.score = self.count = None
        self._n = 0  # slots in use (shared by the rows)
        self._call = None
        self.token_bytes = 0
        self._set_rows([0] * batch_size, [0] * batch_size,
                       list(left_padding or [0] * batch_size), None)

    @property
    def max_size(self) -> int:
        return self.config.max_size

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
        n = self._n
        return self.keys[..., :n, :], self.values[..., :n, :]

    def h2o_attention(self, queries, keys, values, *, scale, mask=None, sinks=None):
        """Attention over the rows' held slots (masks from positions), its
        scores folded row by row, then the compaction of overflowing rows."""
        call, self._call = self._call, None
        if call is None:
            raise RuntimeError("h2o_attention without a preceding update_and_fetch")
        n = self._n
        own = policy.position_mask(self.positions[..., :n], call.qpos, self.window_size)
        mask = _combine(own, mask)
        out, logits, lse = scaled_dot_product_attention_with_scores(
            queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        meta = (self.positions[..., :n], self.score[..., :n], self.count[..., :n])
        expected = None
        if call.expected is not None:
            rows, window = call.expected
            row = bs.expected_logits(queries, keys, scale, mask, sinks, window)
            expected = (rows, *row)
        score, count = bs.fold_rows(self.config, meta[1], meta[2], logits, lse, meta[0],
                                    call.select, call.pooled, expected)
        self.score[..., :n] = score
        self.count[..., :n] = count
        if call.compact:
            self._compact(call.compact)
        if queries.shape[2] > 1:
            self._pack()
            # A chunk's logits are large: finish this layer before the next.
            mx.eval(out, self.positions, self.score, self.count)
        return out

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        # Masks come from slot positions in h2o_attention (padding included).
        return None if N == 1 else "causal"

    def size(self) -> int:
        return self._n

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        arrays = (self.keys, self.values, self.positions, self.score, self.count)
        return sum(a.nbytes for a in arrays if a is not None)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget the ``n`` newest tokens of every row, as H2OKVCache.trim does
        for one sequence (exact: ``offset`` drops by n, each row keeps its best
        held tokens below it). ``n`` is capped at the fewest tokens a row has."""
        n = max(0, min(int(n), min(self.seen, default=0)))
        if n == 0 or self.keys is None:
            return 0
        self._trim_rows(n)
        self._sync_offset()
        return n

    # --- state -------------------------------------------------------------------
    @property
    def state(self):
        if self.keys is None:
            return []
        n = self._n
        return (self.keys[..., :n, :], self.values[..., :n, :], self.positions[..., :n],
                self.score[..., :n], self.count[..., :n])

    @state.setter
    def state(self, v):
        self._call = None
        if not v:
            self.keys = self.values = self.positions = self.score = self.count = None
            self._n = 0
            return
        self.keys, self.values, self.positions, self.score, self.count = (
            mx.array(a) for a in v)
        self._n = self.keys.shape[2]

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
        an empty slot (one more slot only when some such row has none)."""
        cfg, counts = self.config, [c for _, c in spans]
        # A prompt left whole (prefill_compact="prompt") is compacted first.
        whole = [b for b, c in enumerate(counts) if c and self.kept[b] > cfg.max_size]
        if whole:
            self._compact(whole)
            self._pack()
        full = [c == 1 and k >= cfg.max_size for c, k in zip(counts, self.kept)]
        if any(k >= self._n and not f for k, f in zip(self.kept, full)):
            self._reserve(self._n + 1, keys, values)
            self._n += 1
        slot = policy.first_empty(self.positions[..., : self._n])
        if any(full):
            pri = policy.slot_priority(cfg, *self._meta(), self._seen_rows(1),
                                       self.window_size)
            victim = policy.select_victim(pri, self.positions[..., : self._n])
            slot = mx.where(mx.array(full)[:, None], victim, slot)
        position = _rows(s if c else bs.EMPTY for s, c in zip(self.seen, counts))
        self._put(slot, keys, values, position)
        qpos = position[:, :, 0]  # (B, 1)
        self.kept = [k if f else k + c for k, c, f in zip(self.kept, counts, full)]
        self.seen = [s + c for s, c in zip(self.seen, counts)]
        self._call = _Call(qpos, qpos >= 0, None, [])

    def _chunk(self, keys, values, spans):
        """L > 1 tokens: appended as new slots (padding at position -1). A row
        with one token of its own takes H2OKVCache's decode path (its victim
        goes first); one whose chunk overflows is scored by its last
        ``prefill_window`` queries and compacted after the attention."""
        cfg, L = self.config, keys.shape[2]
        ones = [b for b, (_, c) in enumerate(spans) if c == 1]
        self._compact([b for b in ones if self.kept[b] > cfg.max_size])
        self._evict_one([b for b in ones if self.kept[b] >= cfg.max_size])
        qpos = np.full((len(spans), L), bs.EMPTY, np.int32)
        for b, (start, c) in enumerate(spans):
            qpos[b, start : start + c] = np.arange(self.seen[b], self.seen[b] + c)
        self._append(keys, values, mx.array(qpos))
        self.kept = [k + c for k, (_, c) in zip(self.kept, spans)]
        self.seen = [s + c for s, (_, c) in zip(self.seen, spans)]
        over = [c > 1 and k > cfg.max_size for (_, c), k in zip(spans, self.kept)]
        select = self._selection(spans, over, L)
        replace = [o and policy.window_replaces(cfg, c, k - c)
                   for o, (_, c), k in zip(over, spans, self.kept)]
        if any(replace):  # a later chunk on a full row: its window alone decides
            rows = mx.array(replace)[:, None, None]
            self.score = mx.where(rows, 0.0, self.score)
            self.count = mx.where(rows, 0.0, self.count)
        compact = [b for b, o in enumerate(over) if o and cfg.prefill_compact == "chunk"]
        self._call = _Call(mx.array(qpos), mx.array(select),
                           mx.array(over) if any(over) else None, compact,
                           self._expected_rows(spans, over))

    def _selection(self, spans, over, L):
        """(B, L) bool: each row's own queries; an overflowing row's last
        ``prefill_window`` of them (0: all)."""
        W = self.config.prefill_window
        select = np.zeros((len(spans), L), bool)
        for b, (start, c) in enumerate(spans):
            first = start + c - W if over[b] and 0 < W < c else start
            select[b, first : start + c] = True
        return select

    def _expected_rows(self, spans, over):
        """(rows, window) for an expected-attention mode: rows (B,) whose chunk
        is scored by its window (``policy.scored_by_window``), window (B, W)
        their last W queries (other rows: any)."""
        W = self.config.prefill_window
        rows = [policy.scored_by_window(self.config, c, o, self.window_size)
                for o, (_, c) in zip(over, spans)]
        if score_mode(self.config.score).prefill != "expected" or not any(rows):
            return None
        ends = np.array([max(start + c, W) for start, c in spans])
        return mx.array(rows), mx.array(ends[:, None] - W + np.arange(W), mx.int32)


def _rows(values) -> mx.array:
    """(B, 1, 1) int32 from one value per row."""
    return mx.array(list(values), mx.int32)[:, None, None]


def _combine(own, mask):
    """The slot-position mask with a mask the model passed as an array."""
    if not isinstance(mask, mx.array):
        return own  # None / "causal": the positions say it all
    if mask.dtype == mx.bool_:
        return own & mask
    return mx.where(own, mask, -mx.inf)


def _merge(cls, caches) -> BatchH2OKVCache:
    """One BatchH2OKVCache from single-sequence H2OKVCaches of one layer (mlx-lm
    calls ``caches[0].merge(caches)``): each row holds its cache's slots,
    scores and offset; rows with fewer slots get empty ones."""
    from .h2o import H2OKVCache  # h2o.py imports this module lazily (merge)

    first = caches[0]
    for c in caches:
        if type(c) is not H2OKVCache:
            raise ValueError(
                f"{type(c).__name__} cannot join a batch: batched generation (mlx-lm's "
                "BatchGenerator, `mlx-h2o serve`) takes dense H2OKVCache caches only")
        if (c.config, c.window_size) != (first.config, first.window_size):
            raise ValueError("caches of one layer with different budgets or windows "
                             f"cannot form a batch: {c.config} vs {first.config}")
    batch = BatchH2OKVCache(first.config, len(caches), first.window_size)
    batch.model_name = first.model_name
    states = [c.state for c in caches]  # reading the state folds queued scores
    sizes = [c.size() for c in caches]
    if max(sizes, default=0):
        batch.state = bs.stacked(states, sizes)
    batch._set_rows([c.offset for c in caches], sizes, [0] * len(caches), None)
    batch.token_bytes = max(c.token_bytes for c in caches) * len(caches)
    return batch


BatchH2OKVCache.merge = classmethod(_merge)
