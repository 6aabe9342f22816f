"""The rows of BatchH2OKVCache: their counts, padding, and rows joining
(``merge``, ``extend``) and leaving (``filter``, ``extract``).

A mixin of BatchH2OKVCache (cache/batch_cache.py); the slots are the core's
(cache/core.py).
Per row the host keeps ``seen`` (tokens fed), ``kept`` (tokens held),
``left`` (left padding still to come) and, between ``prepare(right_padding=)``
and ``finalize()``, ``valid`` (the row's tokens still to come before its
right padding): decisions about growth and packing never wait for the device.
"""

from functools import lru_cache
from typing import List, Optional

import mlx.core as mx

from .. import policy
from .core import EMPTY
from .h2o import H2OKVCache
from .storage import take_slots


@lru_cache(maxsize=256)
def row_ints(values: tuple, ndim: int = 1, dtype=mx.int32) -> mx.array:
    """One value per row as a (B,) array, or (B, 1[, 1]) for ``ndim`` 2 or
    3; made once per value and shared by every layer's cache (each decode
    step of a batch needs the same ones in every layer). Evaluated here: a
    lazy array is bound to its thread's stream, and a server's generation
    thread may read one that another thread made."""
    out = mx.array(values, dtype).reshape((len(values),) + (1,) * (ndim - 1))
    mx.eval(out)
    return out


class BatchRows:
    """Row bookkeeping of BatchH2OKVCache."""

    def _set_rows(self, seen, kept, left, valid: Optional[List[int]], previews=None):
        self.seen, self.kept, self.left = list(seen), list(kept), list(left)
        self.valid = None if valid is None else list(valid)
        # Each row's (queries, first position) of its prompt's end, seen ahead.
        self.previews = [None] * len(self.seen) if previews is None else list(previews)
        self._sync_offset()

    def _sync_offset(self):
        # The RoPE position of each row's next token (BatchKVCache's offset).
        self.offset = row_ints(tuple(s - p for s, p in zip(self.seen, self.left)))

    @property
    def evicted(self) -> List[int]:
        """Tokens evicted per row (per KV head)."""
        return [s - k for s, k in zip(self.seen, self.kept)]

    def _take_spans(self, L: int):
        """Per row, (first, count) of its own tokens among the next L."""
        spans = []
        for b in range(len(self.seen)):
            start = min(self.left[b], L)
            self.left[b] -= start
            count = L - start
            if self.valid is not None:
                count = min(count, self.valid[b])
                self.valid[b] -= count
            spans.append((start, count))
        return spans

    # --- padding (PromptProcessingBatch) ----------------------------------------
    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        """The next tokens hold padding: ``left_padding`` tokens before each
        row's own, or (``right_padding``) each row's ``lengths`` tokens first,
        padding after them until ``finalize()``."""
        if left_padding is not None:
            self.left = [p + int(q) for p, q in zip(self.left, left_padding)]
        if right_padding is not None and max(right_padding) > 0:
            self.valid = [int(n) for n in lengths]
        self._sync_offset()

    def finalize(self):
        """Right padding is over (its slots hold position -1: nothing to move)."""
        self.valid = None
        self._sync_offset()

    def _seen_rows(self, extra: int = 0):
        """(B, 1, 1) int32 tokens seen per row (plus ``extra``)."""
        return row_ints(tuple(s + extra for s in self.seen), 3)

    def _row_mask(self, rows: List[int]) -> mx.array:
        """(B, 1, 1) True on ``rows``."""
        return row_ints(tuple(b in rows for b in range(len(self.seen))), 3, mx.bool_)

    # --- rows joining and leaving ----------------------------------------------------
    def filter(self, batch_indices):
        """Keep the rows ``batch_indices`` (in that order)."""
        idx = [int(i) for i in batch_indices]
        if not self.empty():
            rows = mx.array(idx, mx.int32)
            self.kv.take_rows(rows)
            self.set_slot_metadata(*(a[rows] for a in self.slot_metadata()))
        self.next_victim = None
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        self._set_rows(pick(self.seen), pick(self.kept), pick(self.left),
                       None if self.valid is None else pick(self.valid), pick(self.previews))
        self._pack()

    def extend(self, other):
        """Append the rows of ``other`` (a BatchH2OKVCache of the same layer)."""
        if (other.config, other.window_size) != (self.config, self.window_size):
            raise ValueError("cannot extend a batch cache with one of another budget "
                             f"or window: {other.config} vs {self.config}")
        if not (self.empty() and other.empty()):
            N = max(self.slots_used, other.slots_used)
            like = other if self.empty() else self
            parts = [_padded(c, N, like) for c in (self, other)]
            self.state = tuple(mx.concatenate(p, axis=0) for p in zip(*parts))
        valid = None
        if self.valid is not None or other.valid is not None:
            valid = ((self.valid or [0] * len(self.seen))
                     + (other.valid or [0] * len(other.seen)))
        self._set_rows(self.seen + other.seen, self.kept + other.kept,
                       self.left + other.left, valid, self.previews + other.previews)
        self.token_bytes = self.token_bytes or other.token_bytes

    # --- merging single caches --------------------------------------------------------
    @classmethod
    def merge(cls, caches) -> "BatchH2OKVCache":
        """One batch from single-sequence H2OKVCaches of one layer (mlx-lm
        calls ``caches[0].merge(caches)``): each row holds its cache's slots,
        scores and offset; rows with fewer slots get empty ones."""
        first = caches[0]
        for c in caches:
            if type(c) is not H2OKVCache:
                raise ValueError(
                    f"{type(c).__name__} cannot join a batch: batched generation "
                    "(mlx-lm's BatchGenerator, `mlx-h2o serve`) takes dense H2OKVCache "
                    "caches only")
            if (c.config, c.window_size) != (first.config, first.window_size):
                raise ValueError("caches of one layer with different budgets or windows "
                                 f"cannot form a batch: {c.config} vs {first.config}")
        batch = cls(first.config, len(caches), first.window_size)
        batch.model_name = first.model_name
        states = [c.state for c in caches]  # reading the state folds queued scores
        sizes = [c.size() for c in caches]
        if max(sizes, default=0):
            batch.state = _stacked(states, sizes)
        batch._set_rows([c.offset for c in caches], sizes, [0] * len(caches), None,
                        [None if c.preview is None else (c.preview, c.preview_from)
                         for c in caches])
        batch.token_bytes = max(c.token_bytes for c in caches) * len(caches)
        return batch

    def extract(self, idx: int) -> H2OKVCache:
        """Row ``idx`` as a single-sequence H2OKVCache (its held tokens in
        position order, their scores): what the row alone would hold."""
        k, seen = self.kept[idx], self.seen[idx]
        template = H2OKVCache(self.config, self.window_size)
        template.model_name = self.model_name
        template.offset, template.evicted = seen, seen - k
        if not (self.empty() or k == 0):
            row = [a[idx : idx + 1] for a in self.state]
            slots = policy.packed_order(row[2], k)
            state = [take_slots(a, slots, self.slots_used) for a in row]
            template = H2OKVCache.from_state(state, template.meta_state)
        if self.previews[idx] is not None:
            template.set_preview(*self.previews[idx])
        return template


def _stacked(states, sizes):
    """(keys, values, positions, score, count) of single-sequence states
    (one per row; () for an empty cache) with ``sizes`` slots in use: each
    row's slots first, then empty ones up to the largest."""
    K, V = next(s[:2] for s in states if s)
    out = _empty_state(len(states), max(sizes), K, V)
    for i, (s, n) in enumerate(zip(states, sizes)):
        for a, x in zip(out, s):
            a[i : i + 1, :, :n] = x[:, :, :n]
    return out


def _padded(cache, N: int, like):
    """``cache``'s state with N slots (empty ones added); a cache without
    K/V yet gets all-empty rows shaped as ``like``'s."""
    B = len(cache.seen)
    if cache.empty():
        return _empty_state(B, N, *like.state[:2])
    pad = N - cache.slots_used
    out = []
    for a, fill in zip(cache.state, (0, 0, EMPTY, 0.0, 0.0)):
        widths = [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 3)
        out.append(mx.pad(a, widths, constant_values=fill) if pad else a)
    return tuple(out)


def _empty_state(B: int, N: int, K, V):
    """(keys, values, positions, score, count) of B rows of N empty slots,
    K / V shaped and typed as ``K`` / ``V`` (B', Hk, ·, D)."""
    shape = (B, K.shape[1], N)
    return [mx.zeros((*shape, K.shape[3]), K.dtype), mx.zeros((*shape, V.shape[3]), V.dtype),
            mx.full(shape, EMPTY, mx.int32), mx.zeros(shape, mx.float32),
            mx.zeros(shape, mx.float32)]
