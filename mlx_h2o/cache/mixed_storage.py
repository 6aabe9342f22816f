"""MixedKV: quantized K/V slots in two precisions.

Slots [0, split) are at ``hi_bits`` (sinks, pinned, heavy hitters) and slots
[split, ...) at ``lo_bits`` (the recent window). A token that moves from the
low zone to the high zone is *widened* exactly: codes times
(2**hi - 1) / (2**lo - 1), scales divided by the same factor, biases kept, so
it represents the same values it was written with.
"""

from functools import lru_cache

import mlx.core as mx

from .. import policy
from ..kernels import attention_with_column_sums
from ..kernels.quantized_reference import dequantize_segments
from .quantized_storage import QuantizedKV, Triple, attend, convert
from .storage import fresh_slot, put_slot, take_slots


class MixedKV:
    """Slots [0, split) at ``hi_bits``, slots [split, ...) at ``lo_bits``.

    The high zone carries one scratch slot at index ``split`` (never fetched):
    a decode step that evicts from the low zone sends its no-op promotion
    there instead of branching per head.
    """

    group_kind = None  # an eviction moves tokens between zones: no group steps
    plain = False
    moves_on_evict = True

    def __init__(self, hi_bits: int, lo_bits: int, group_size: int, split: int):
        self.hi = QuantizedKV(hi_bits, group_size)
        self.lo = QuantizedKV(lo_bits, group_size)
        self.split = split
        self._cap = 0

    @property
    def capacity(self) -> int:
        return self._cap

    def resize(self, n: int, size: int, keys: mx.array, values: mx.array):
        A = self.split
        self.hi.resize(min(n, A), min(size, A) + (size > A), keys, values)
        if size > A:
            self.lo.resize(max(n - A, 0), size - A, keys, values)
        self._cap = size

    def write(self, start: int, keys: mx.array, values: mx.array):
        L, A = keys.shape[2], self.split
        cut = min(max(A - start, 0), L)
        if cut:
            self.hi.write(start, keys[..., :cut, :], values[..., :cut, :])
        if cut < L:
            self.lo.write(start + cut - A, keys[..., cut:, :], values[..., cut:, :])

    def write_slot(self, slot: mx.array, keys: mx.array, values: mx.array, split=None):
        """Write a new token into low-zone slot (B, Hk, 1) (logical index).
        ``split``: the zone boundary as an int32 array (see ``promote``)."""
        self.lo.write_slot(slot - (self.split if split is None else split), keys, values)

    def promote(self, victim: mx.array, positions: mx.array, split=None) -> mx.array:
        """Make room in the low zone for a new token; returns its slot.

        A victim in the low zone frees its own slot. A victim in the high zone
        takes the oldest low-zone token (widened), whose slot is returned.
        Shapes: victim (B, Hk, 1) logical slots; positions (B, Hk, n).
        ``split``: the zone boundary as an int32 scalar array, for callers
        under mx.compile (as a constant, every layer size of a layer profile
        compiled its own CPU code: a 30-layer model's first run took 36 s).
        """
        A, victim = self.split, victim.astype(mx.int32)
        S = A if split is None else split
        oldest = mx.argmin(positions[..., A:], axis=-1, keepdims=True).astype(mx.int32)
        in_hi = victim < S  # (B, Hk, 1)
        keys, values = self.lo.take(oldest, self.lo.capacity)
        self.hi.put(
            mx.where(in_hi, victim, S),
            convert(keys, self.lo.bits, self.hi.bits),
            convert(values, self.lo.bits, self.hi.bits),
        )
        return mx.where(in_hi, oldest + S, victim)

    def gather(self, slots: mx.array, n: int):
        A, k = self.split, slots.shape[-1]
        if A:  # without sinks or heavy hitters the high zone is the scratch slot
            hi = self._collect(slots[..., :A], n, self.hi.bits)
            self.hi.keys, self.hi.values = self._with_scratch(*hi) if k > A else hi
        lo = self._collect(slots[..., A:], n, self.lo.bits) if k > A else (None, None)
        self.lo.keys, self.lo.values = lo
        self._cap = k

    def _collect(self, slots, n, bits):
        """Triples of logical ``slots`` from both zones, expressed at ``bits``."""
        A, slots = self.split, slots.astype(mx.int32)  # argsort/argmin give uint32
        if A:
            hk, hv = self.hi.take(mx.minimum(slots, A - 1), min(n, A))
            hk, hv = convert(hk, self.hi.bits, bits), convert(hv, self.hi.bits, bits)
        if n <= A:
            return hk, hv
        lk, lv = self.lo.take(mx.maximum(slots - A, 0), n - A)
        lk, lv = convert(lk, self.lo.bits, bits), convert(lv, self.lo.bits, bits)
        if not A:
            return lk, lv
        cond = (slots < A)[..., None]
        return _select(cond, hk, lk), _select(cond, hv, lv)

    @staticmethod
    def _with_scratch(keys, values):
        def pad(a):
            return mx.concatenate([a, mx.zeros_like(a[..., :1, :])], axis=2)

        return tuple(map(pad, keys)), tuple(map(pad, values))

    def _zones(self, n: int):
        """(store, slots) of the non-empty zones among the first n slots."""
        A = self.split
        return [(z, m) for z, m in ((self.hi, min(n, A)), (self.lo, n - A)) if m > 0]

    def fetch(self, n: int):
        parts = [zone.fetch(m) for zone, m in self._zones(n)]
        return tuple(k for k, _ in parts), tuple(v for _, v in parts)

    def segment_bits(self, n: int) -> tuple:
        """The widths of what ``fetch(n)`` returns, one per non-empty zone."""
        return tuple(zone.bits for zone, _ in self._zones(n))

    def _fetched_bits(self, keys) -> tuple:
        """``segment_bits`` of fetched zones' key triples."""
        return self.segment_bits(sum(k[0].shape[2] for k in keys))

    def dense(self, keys, values, dtype):
        """Fetched zones' K / V dequantized in ``dtype`` and joined (see
        QuantizedKV.dense)."""
        bits, gs = self._fetched_bits(keys), self.hi.group_size
        return tuple(dequantize_segments(t, bits, gs, dtype) for t in (keys, values))

    def attention(self, queries, keys, values, *, scale, mask, sinks):
        return attend(
            queries,
            keys,
            values,
            scale=scale,
            bits=self._fetched_bits(keys),
            group_size=self.hi.group_size,
            mask=mask,
            sinks=sinks,
        )

    def column_attention(self, queries, keys, values, *, scale, mask, sinks, weights):
        """A prompt chunk's (out, probs, seen) over K / V dequantized in float32
        (kernels.attention_with_column_sums)."""
        return attention_with_column_sums(queries, *self.dense(keys, values, mx.float32),
                                          scale=scale, mask=mask, sinks=sinks, weights=weights)

    @property
    def nbytes(self) -> int:
        return self.hi.nbytes + self.lo.nbytes

    def state(self, n: int) -> list[mx.array]:
        keys, values = self.fetch(n)
        return [a for k, v in zip(keys, values) for a in (*k, *v)]

    def set_state(self, arrays):
        """Arrays of ``state``: the high zone's six, then the low zone's six."""
        arrays = list(arrays)
        if self.split == 0:  # only a low zone; the high zone is its scratch slot
            arrays = [None] * 6 + arrays
        else:
            self.hi.set_state(arrays[:6])
        n = sum(a.shape[2] for a in arrays[0:12:6] if a is not None)
        if len(arrays) > 6:
            self.lo.set_state(arrays[6:12])
            if self.split == 0:
                self.hi.resize(0, 1, *self._dense_like(self.lo))
            else:
                self.hi.keys, self.hi.values = self._with_scratch(
                    self.hi.keys, self.hi.values
                )
        self._cap = n

    @staticmethod
    def _dense_like(zone):
        """Zero (B, Hk, 1, D) keys/values with the zone's head dims and dtype."""
        out = []
        for w, s, _ in (zone.keys, zone.values):
            D = w.shape[-1] * 32 // zone.bits
            out.append(mx.zeros((*w.shape[:2], 1, D), s.dtype))
        return out


def _select(cond: mx.array, a: Triple, b: Triple) -> Triple:
    return tuple(mx.where(cond, x, y) for x, y in zip(a, b))


def mixed_evict(config, window_size, kv, positions, score, count, n, keys, values, offset,
                zones=None, split=None):
    """A full mixed-precision cache's eviction for the token at ``offset``:
    the policy's victim; a high-zone victim's slot takes the oldest recent
    token (widened, ``MixedKV.promote``); the new token goes into the freed
    recent slot with fresh metadata. Writes ``kv``'s arrays; returns
    (positions, score, count, target slot (B, Hk, 1)). ``offset``, ``zones``
    and ``split`` (``kv.split``) may be int32 scalar arrays
    (``compiled_mixed_evict``)."""
    pos = positions[..., :n]
    pri = policy.slot_priority(config, pos, score[..., :n], count[..., :n], offset + 1,
                               window_size, zones)
    victim = policy.select_victim(pri, pos)[..., None]  # (B, Hk, 1)
    target = kv.promote(victim, pos, split)
    # The oldest recent token's metadata moves with it; its slot starts afresh.
    moved = (put_slot(a, victim, take_slots(a, target, n)) for a in (positions, score, count))
    meta = fresh_slot(*moved, target, offset, policy.written_score(config.score, keys))
    kv.write_slot(target, keys, values, split)
    return (*meta, target)


@lru_cache(maxsize=64)
def compiled_mixed_evict(config, window_size, hi_bits, lo_bits, group_size, split):
    """``mixed_evict`` through mx.compile (its elementwise ops fuse; its
    scatters and gathers stay): (hi K, hi V, lo K, lo V triples, positions,
    score, count, keys, values, offset, sink, recent, split) -> the 12 zone
    arrays, positions, score, count, target. The int32 scalar inputs keep
    every token and layer size on one build of the CPU code."""

    def step(hi_k, hi_v, lo_k, lo_v, positions, score, count, keys, values, offset, sink,
             recent, split_array):
        kv = MixedKV(hi_bits, lo_bits, group_size, split)
        kv.hi.keys, kv.hi.values, kv.lo.keys, kv.lo.values = hi_k, hi_v, lo_k, lo_v
        *meta, target = mixed_evict(config, window_size, kv, positions, score, count,
                                    positions.shape[2], keys, values, offset, (sink, recent),
                                    split_array)
        return (*kv.hi.keys, *kv.hi.values, *kv.lo.keys, *kv.lo.values, *meta, target)

    return mx.compile(step)
