"""Slot storage for K/V: preallocated buffers with the slot on axis 2.

The cache owns the bookkeeping (positions, scores); a storage owns the tensors
and knows how to attend over them. A quantized storage swaps in packed
triples and its own attention with the same interface.
"""

import copy
from typing import Callable, Dict, Iterable

import mlx.core as mx

from ..kernels import attention_with_column_sums, scaled_dot_product_attention_with_scores


def deepcopy_attrs(obj, memo, shared: Iterable[str] = (),
                   fresh: Dict[str, Callable] = None):
    """A deep copy of ``obj`` (``copy.deepcopy``'s ``__deepcopy__``): attributes
    in ``shared`` are immutable values the copy shares (they may hold MLX
    dtypes, which cannot be copied), those in ``fresh`` are made anew by their
    factory (decisions cached per shape and device)."""
    new = obj.__class__.__new__(obj.__class__)
    memo[id(obj)] = new
    fresh = fresh or {}
    for name, value in obj.__dict__.items():
        if name in fresh:
            value = fresh[name]()
        elif name not in shared:
            value = copy.deepcopy(value, memo)
        new.__dict__[name] = value
    return new


def resize_slots(old, n: int, shape, dtype, fill=0):
    """A buffer of ``shape`` holding the first n slots of ``old``, ``fill``
    in the others."""
    new = mx.full(shape, fill, dtype) if fill else mx.zeros(shape, dtype)
    if old is not None:
        new[:, :, :n] = old[:, :, :n]
    return new


def take_slots(a, slots, n: int):
    """Gather slots (B, Hk, k) along axis 2 of the first n slots of ``a``."""
    idx = slots if a.ndim == 3 else slots[..., None]
    a = a if n == a.shape[2] else a[:, :, :n]  # a full buffer: no slice node
    return mx.take_along_axis(a, idx, axis=2)


def put_slot(a, slot, value):
    """Write value (B, Hk, 1[, D]) into slot (B, Hk, 1) along axis 2."""
    idx = slot if a.ndim == 3 else slot[..., None]
    return mx.put_along_axis(a, idx, value, axis=2)


def fresh_slot(positions, score, count, slot, position, written=0.0):
    """(positions, score, count) with ``slot`` (B, Hk, 1), or a fused step's
    (B, Hk, 1, ·) victim, holding ``position`` (an int, or an int32 scalar
    array under mx.compile), a zero count and the score ``written``
    (policy.written_score: 0.0, or the token's (B, Hk, 1) key-norm score)."""
    slot = slot[..., 0] if slot.ndim == 4 else slot
    zero = mx.zeros(slot.shape, mx.float32)
    start = zero if isinstance(written, float) else written
    return (put_slot(positions, slot, mx.full(slot.shape, position, mx.int32)),
            put_slot(score, slot, start), put_slot(count, slot, zero))


class DenseKV:
    """Keys and values as plain (B, n_kv_heads, slots, D) arrays."""

    # What a StepGroup's fold and the compiled steps read (cache/group.py,
    # cache/ops_step.py); layers of one kind fold together.
    group_kind = ("dense",)
    plain = True  # K/V are plain arrays: fused steps, score queue, batch events
    moves_on_evict = False  # an eviction moves no token between zones

    def __init__(self):
        self.keys = self.values = None

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def resize(self, n: int, size: int, keys: mx.array, values: mx.array):
        B, Hk = keys.shape[:2]
        self.keys = resize_slots(self.keys, n, (B, Hk, size, keys.shape[3]), keys.dtype)
        self.values = resize_slots(
            self.values, n, (B, Hk, size, values.shape[3]), values.dtype
        )

    def write(self, start: int, keys: mx.array, values: mx.array):
        end = start + keys.shape[2]
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values

    def write_slot(self, slot: mx.array, keys: mx.array, values: mx.array, rows=None):
        """One token per row into ``slot`` (B, Hk, 1); ``rows`` (B,) bool:
        where False (a batch row without a token) the slot keeps what it holds."""
        if rows is not None:
            idx, rows = slot[..., None], rows[:, None, None, None]
            keys = mx.where(rows, keys, mx.take_along_axis(self.keys, idx, axis=2))
            values = mx.where(rows, values, mx.take_along_axis(self.values, idx, axis=2))
        self.keys = put_slot(self.keys, slot, keys)
        self.values = put_slot(self.values, slot, values)

    def take_rows(self, rows: mx.array):
        """Keep the batch rows ``rows`` (int32 indices), in that order."""
        self.keys, self.values = self.keys[rows], self.values[rows]

    def write_index(self, index: mx.array, keys: mx.array, values: mx.array,
                    for_sdpa: bool = False):
        """Write one token per row at ``index`` (B, Hk, 1, D), already broadcast."""
        self.keys = mx.put_along_axis(self.keys, index, keys, axis=2)
        self.values = mx.put_along_axis(self.values, index, values, axis=2)

    def gather(self, slots: mx.array, n: int):
        self.keys = take_slots(self.keys, slots, n)
        self.values = take_slots(self.values, slots, n)

    def fetch(self, n: int):
        if n == self.keys.shape[2]:
            # A full buffer as is: two slice nodes less per decode step (the
            # evicting steady state), same values.
            return self.keys, self.values
        return self.keys[..., :n, :], self.values[..., :n, :]

    def attention(self, queries, keys, values, *, scale, mask, sinks):
        return scaled_dot_product_attention_with_scores(
            queries, keys, values, scale=scale, mask=mask, sinks=sinks
        )

    def column_attention(self, queries, keys, values, *, scale, mask, sinks, weights):
        """A prompt chunk's (out, probs, seen): kernels.attention_with_column_sums."""
        return attention_with_column_sums(queries, keys, values, scale=scale, mask=mask,
                                          sinks=sinks, weights=weights)

    def sdpa(self, queries, keys, values, *, scale):
        """Attention without scores (a group step's): MLX's fused SDPA."""
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale)

    def dense(self, keys, values, dtype):
        """Fetched K / V as arrays (a window-scored prompt chunk attends them
        with MLX's SDPA): already are."""
        return keys, values

    def dense_keys(self, n: int) -> mx.array:
        # A full buffer as is (no slice node), as fetch returns it.
        return self.keys if n == self.keys.shape[2] else self.keys[..., :n, :]

    @property
    def group_keys(self) -> mx.array:
        """What the group fold reads: the K buffer."""
        return self.keys

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def state(self, n: int):
        return self.fetch(n)

    def set_state(self, arrays):
        self.keys, self.values = arrays
