"""The rows of BatchH2OKVCache: padding, slot storage, rows joining and leaving.

A mixin of BatchH2OKVCache (cache/batch_cache.py), which owns the state.
Per row the host keeps ``seen`` (tokens fed), ``kept`` (tokens held),
``left`` (left padding still to come) and, between ``prepare(right_padding=)``
and ``finalize()``, ``valid`` (the row's tokens still to come before its
right padding): decisions about growth and packing never wait for the device.
"""

from functools import lru_cache
from typing import List, Optional

import mlx.core as mx

from .. import policy
from . import batch_slots as bs


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
    """Row bookkeeping and slot storage of BatchH2OKVCache."""

    def _set_rows(self, seen, kept, left, valid: Optional[List[int]]):
        self.seen, self.kept, self.left = list(seen), list(kept), list(left)
        self.valid = None if valid is None else list(valid)
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

    # --- slot storage --------------------------------------------------------------
    def _arrays(self):
        return (self.keys, self.values, self.positions, self.score, self.count)

    def _set_arrays(self, arrays):
        self.keys, self.values, self.positions, self.score, self.count = arrays
        self._target = None  # the slots moved: the next decode step picks again

    def _row(self, idx: int):
        """Row ``idx``'s (keys, values, positions, score, count), slots in use."""
        n = self._n
        return tuple(a[idx : idx + 1, :, :n] for a in self._arrays())

    def _reserve(self, need: int, keys, values):
        """Room for ``need`` slots (decode grows by config.step up to max_size)."""
        cap = 0 if self.keys is None else self.keys.shape[2]
        if need <= cap:
            return
        size = policy.grown_size(self.config, need)
        B, Hk = keys.shape[:2]
        grow = (B, Hk, size - self._n)
        fresh = (mx.zeros((*grow, keys.shape[3]), keys.dtype),
                 mx.zeros((*grow, values.shape[3]), values.dtype),
                 mx.full(grow, bs.EMPTY, mx.int32), mx.zeros(grow, mx.float32),
                 mx.zeros(grow, mx.float32))
        if self.keys is None:
            self._set_arrays(fresh)
            return
        n = self._n
        self._set_arrays(tuple(mx.concatenate([a[:, :, :n], f], axis=2)
                               for a, f in zip(self._arrays(), fresh)))

    def _append(self, keys, values, qpos):
        """Write a chunk at slots n..n+L; ``qpos`` (B, L) its positions."""
        L, n = keys.shape[2], self._n
        self._reserve(n + L, keys, values)
        self.keys[..., n : n + L, :] = keys
        self.values[..., n : n + L, :] = values
        self.positions[..., n : n + L] = mx.broadcast_to(
            qpos[:, None], (*keys.shape[:2], L))
        self.score[..., n : n + L] = policy.written_score(self.config.score, keys)
        self.count[..., n : n + L] = 0.0
        self._n = n + L

    def _put(self, target, keys, values, has: List[bool]):
        """One decode token per row into ``target`` (B, Hk, 1); rows without a
        token (``has`` False) keep what the slot holds."""
        idx = target[..., None]  # (B, Hk, 1, 1)
        if not all(has):
            rows = mx.array(has)[:, None, None, None]
            keys = mx.where(rows, keys, mx.take_along_axis(self.keys, idx, axis=2))
            values = mx.where(rows, values, mx.take_along_axis(self.values, idx, axis=2))
        self.keys = mx.put_along_axis(self.keys, idx, keys, axis=2)
        self.values = mx.put_along_axis(self.values, idx, values, axis=2)

    def _meta(self):
        n = self._n
        return self.positions[..., :n], self.score[..., :n], self.count[..., :n]

    def _seen_rows(self, extra: int = 0):
        return mx.array([s + extra for s in self.seen], mx.int32)[:, None, None]

    def _forget(self, keep):
        """Empty the slots in use outside ``keep`` (B, Hk, n)."""
        n = self._n
        pos, score, count = bs.forget(self._meta(), keep)
        self._target = None
        self.positions[..., :n] = pos
        self.score[..., :n] = score
        self.count[..., :n] = count

    def _evict_one(self, rows: List[int]):
        """``rows`` evict their victim (ranked for one more token) to make
        room for a token appended elsewhere (H2OKVCache's decode eviction)."""
        if not rows:
            return
        pri = policy.slot_priority(self.config, *self._meta(), self._seen_rows(1),
                                   self.window_size)
        victim = policy.select_victim(pri, self.positions[..., : self._n])
        hit = mx.arange(self._n) == victim[..., None]
        self._forget(~(hit & _row_mask(rows, len(self.seen))))
        for b in rows:
            self.kept[b] -= 1

    def _compact(self, rows: List[int]):
        """``rows`` keep their ``max_size`` best tokens (SlotCache._compact)."""
        if not rows:
            return
        pos, score, count = self._meta()
        pri = policy.slot_priority(self.config, pos, score, count, self._seen_rows(),
                                   self.window_size)
        keep = policy.keep_mask(pri, pos, self.config.max_size)
        self._forget(keep | ~_row_mask(rows, len(self.seen)))
        for b in rows:
            self.kept[b] = self.config.max_size

    def _pack(self):
        """Drop the slots no row needs: ``max(kept)`` slots, tokens in
        position order (the slots in use then never exceed max_size)."""
        k = max(self.kept, default=0)
        if self.keys is None or k >= self._n:
            return
        n = self._n
        slots = bs.packed_order(self.positions[..., :n], k)
        self._set_arrays(bs.take(tuple(a[:, :, :n] for a in self._arrays()), slots))
        self._n = k

    def _trim_rows(self, n: int):
        """Every row forgets its ``n`` newest tokens (see trim)."""
        cut = self._seen_rows(-n)
        pos, score, count = self._meta()
        gone = pos >= cut
        # (B,) the fewest tokens any KV head of a row still holds below the cut
        k = ((pos >= 0) & ~gone).sum(axis=-1).min(axis=-1).tolist()
        pri = policy.slot_priority(self.config, pos, score, count, cut, self.window_size)
        pri = policy.sinks_first(pri, pos, self.config.sink_size)
        keep = policy.keep_mask(pri, pos, mx.array(k, mx.int32)[:, None, None], drop=gone)
        self._forget(keep)
        self.kept = [int(x) for x in k]
        self.seen = [s - n for s in self.seen]

    # --- rows joining and leaving ----------------------------------------------------
    def filter(self, batch_indices):
        """Keep the rows ``batch_indices`` (in that order)."""
        idx = [int(i) for i in batch_indices]
        if self.keys is not None:
            rows = mx.array(idx, mx.int32)
            self._set_arrays(tuple(a[rows] for a in self._arrays()))
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        self._set_rows(pick(self.seen), pick(self.kept), pick(self.left),
                       None if self.valid is None else pick(self.valid))
        self._pack()

    def extend(self, other):
        """Append the rows of ``other`` (a BatchH2OKVCache of the same layer)."""
        if (other.config, other.window_size) != (self.config, self.window_size):
            raise ValueError("cannot extend a batch cache with one of another budget "
                             f"or window: {other.config} vs {self.config}")
        if self.keys is not None or other.keys is not None:
            N = max(self._n, other._n)
            like = self if self.keys is not None else other
            parts = [_padded(c, N, like) for c in (self, other)]
            self._set_arrays(tuple(mx.concatenate(p, axis=0) for p in zip(*parts)))
            self._n = N
        valid = None
        if self.valid is not None or other.valid is not None:
            valid = ((self.valid or [0] * len(self.seen))
                     + (other.valid or [0] * len(other.seen)))
        self._set_rows(self.seen + other.seen, self.kept + other.kept,
                       self.left + other.left, valid)
        self.token_bytes = self.token_bytes or other.token_bytes


def _row_mask(rows: List[int], B: int) -> mx.array:
    """(B, 1, 1) True on ``rows``."""
    mask = [False] * B
    for b in rows:
        mask[b] = True
    return mx.array(mask)[:, None, None]


def _padded(cache, N: int, like):
    """``cache``'s arrays with N slots (empty ones added); a cache without
    K/V yet gets all-empty rows shaped as ``like``'s."""
    B = len(cache.seen)
    if cache.keys is None:
        _, Hk, _, D = like.keys.shape
        Dv, dt = like.values.shape[3], like.keys.dtype
        return (mx.zeros((B, Hk, N, D), dt), mx.zeros((B, Hk, N, Dv), dt),
                mx.full((B, Hk, N), bs.EMPTY, mx.int32), mx.zeros((B, Hk, N), mx.float32),
                mx.zeros((B, Hk, N), mx.float32))
    n, pad = cache._n, N - cache._n
    out = []
    for a, fill in zip(cache._arrays(), (0, 0, bs.EMPTY, 0.0, 0.0)):
        a = a[:, :, :n]
        widths = [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 3)
        out.append(mx.pad(a, widths, constant_values=fill) if pad else a)
    return tuple(out)
