"""The rows of BatchH2OKVCache: their counts and padding.

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

    def _seen_rows(self, extra: int = 0):
        """(B, 1, 1) int32 tokens seen per row (plus ``extra``)."""
        return mx.array([s + extra for s in self.seen], mx.int32)[:, None, None]

    def _row_mask(self, rows: List[int]) -> mx.array:
        """(B, 1, 1) True on ``rows``."""
        mask = [False] * len(self.seen)
        for b in rows:
            mask[b] = True
        return mx.array(mask)[:, None, None]
