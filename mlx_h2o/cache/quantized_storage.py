"""Quantized K/V slot storage: MLX affine triples (two precisions: cache/mixed_storage.py).

Quantization is per token (groups run along head_dim), so every slot
operation (write a token, gather kept slots, write into a victim's slot)
moves whole triples: nothing is dequantized and requantized. Each token is
quantized once, when written.
"""

import mlx.core as mx

from ..kernels import attention_with_column_sums
from ..kernels.kv_write import write_plan, write_supported
from ..kernels.packed import pack, unpack
from ..kernels.quantized import quantized_attention, uses_kernel
from ..kernels.quantized_reference import dequantize
from . import first_use
from .storage import deepcopy_attrs, resize_slots, take_slots

Triple = tuple[mx.array, mx.array, mx.array]

# Kernel families of the Metal first-use check (cache/first_use.py).
QUANTIZED_WRITE = "K/V write quantized"
PACKED_WRITE = "K/V write packed"
QUANTIZED_ATTENTION = "quantized attention"


def attend(queries, keys, values, **kwargs):
    """``quantized_attention``; on Metal, the fused kernel's first call is
    checked against dequantized K/V and the reference (cache/first_use.py)."""
    if not first_use.passed(QUANTIZED_ATTENTION):
        return quantized_attention(queries, keys, values, use_kernel=False, **kwargs)
    if first_use.needs_check(QUANTIZED_ATTENTION) and uses_kernel(queries, keys, values,
                                                                  **kwargs):
        return first_use.checked(
            QUANTIZED_ATTENTION,
            lambda: quantized_attention(queries, keys, values, use_kernel=True, **kwargs),
            lambda: quantized_attention(queries, keys, values, use_kernel=False, **kwargs),
            first_use.attention_differs)
    return quantized_attention(queries, keys, values, **kwargs)


def _unpack(w: mx.array, bits: int) -> mx.array:
    """(…, W) uint32 -> (…, W * 32 / bits) uint32 codes."""
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    codes = (w[..., None] >> shifts) & ((1 << bits) - 1)  # (…, W, 32 / bits)
    return codes.reshape(*w.shape[:-1], -1)


def _pack(codes: mx.array, bits: int) -> mx.array:
    """Inverse of ``_unpack``: the fields are disjoint, so a sum is an OR."""
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    fields = codes.reshape(*codes.shape[:-1], -1, 32 // bits) << shifts
    return fields.sum(axis=-1).astype(mx.uint32)


def convert(t: Triple, src_bits: int, dst_bits: int) -> Triple:
    """Re-express a triple at another width, in the integer domain.

    Widening (dst > src) is exact: code * f, scale / f with f = (2**dst - 1) /
    (2**src - 1) an integer (17 for 4 -> 8). Narrowing rounds codes to the
    nearest multiple of f: at most half a dst step plus the src error.
    """
    if src_bits == dst_bits:
        return t
    w, s, b = t
    lo, hi = sorted((src_bits, dst_bits))
    f = ((1 << hi) - 1) // ((1 << lo) - 1)
    codes = _unpack(w, src_bits)
    if dst_bits > src_bits:
        return _pack(codes * f, dst_bits), s / f, b
    return _pack((codes + f // 2) // f, dst_bits), s * f, b


def _unpacked(name):
    """K or V as triples; a packed buffer is unpacked first (read or set)."""
    attr = "_" + name

    def get(self):
        self._unpack()
        return getattr(self, attr)

    def put(self, value):
        self._unpack()
        setattr(self, attr, value)

    return property(get, put)


class WritePlans:
    """The kv_write plan for a storage's decode writes, or None where the kernel
    does not run; decided once per signature (decode is host bound)."""

    def __init__(self):
        self.sig = self.plan = None

    def get(self, keys, values, index, bits, group_size=64, dense_out=True,
            packed=False):
        sig = (keys.shape, keys.dtype, values.shape, index.shape, index.dtype,
               mx.default_device(), dense_out, packed)
        if sig != self.sig:
            ok = write_supported(keys, values, index, bits, group_size)
            self.plan = (write_plan(keys.dtype, keys.shape[3], bits, group_size, dense_out,
                                    packed) if ok else None)
            self.sig = sig
        return self.plan


class QuantizedKV:
    """Keys and values as (B, n_kv_heads, slots, ·) affine-quantized triples.

    While a StepGroup runs its steps, K and V live in one packed buffer
    (kernels/packed.py): the write kernel then has one stored input and output
    instead of six (each output costs ~3 us of host time per launch). Any
    other use of ``keys`` / ``values`` unpacks them once; ``group_keys``
    packs them once.
    """

    # On a GPU, a decode token goes into its victim slot in one launch that
    # also hands the group step's SDPA the dequantized K/V (kernels/kv_write.py);
    # False: mx.quantize + six scatters (+ two mx.dequantize in ``sdpa``).
    fused_write = True
    plain = False  # triples: no fused step, score queue or batch event
    moves_on_evict = False

    def __init__(self, bits: int = 8, group_size: int = 64):
        self.bits, self.group_size = bits, group_size
        self._keys: Triple | None = None
        self._values: Triple | None = None
        self._packed: mx.array | None = None  # K and V packed, instead of the triples
        self._layout = None  # (head_dim, scales' dtype) of the packed buffer, to unpack
        self.group_kind = ("quantized", bits, group_size)  # cache/group.py
        self._writes = WritePlans()
        # (packed buffer, dense K, dense V) of the last packed write, for the
        # SDPA that follows; stale once the buffer is not the stored one.
        self._dense = None

    def __deepcopy__(self, memo):
        # The write plans are per shape and device; the layout holds a dtype.
        return deepcopy_attrs(self, memo, shared=("_layout",), fresh={"_writes": WritePlans})

    keys = _unpacked("keys")  # Triple | None
    values = _unpacked("values")  # Triple | None

    @property
    def group_keys(self) -> mx.array:
        """What the group fold reads: K and V packed (kernels/packed.py)."""
        if self._packed is None:
            self._layout = (self._keys[0].shape[-1] * 32 // self.bits, self._keys[1].dtype)
            self._packed = pack(self._keys, self._values)
            self._keys = self._values = None
        return self._packed

    def _views(self, packed=None):
        """The packed buffer's (keys, values) triples, as views."""
        D, dtype = self._layout
        return unpack(self._packed if packed is None else packed, D, self.bits,
                      self.group_size, dtype)

    def _unpack(self):
        if self._packed is None:
            return
        # Contiguous copies: the triples' readers (scatters, kernels) then use them as is.
        self._keys, self._values = (tuple(mx.contiguous(a) for a in t) for t in self._views())
        self._packed = None

    @property
    def capacity(self) -> int:
        if self._packed is not None:
            return self._packed.shape[2]
        return 0 if self._keys is None else self._keys[0].shape[2]

    def quantize(self, x: mx.array) -> Triple:
        return mx.quantize(x, group_size=self.group_size, bits=self.bits)

    def resize(self, n: int, size: int, keys: mx.array, values: mx.array):
        self.keys = self._resize(self.keys, n, size, keys)
        self.values = self._resize(self.values, n, size, values)

    def _resize(self, old, n, size, x):
        B, Hk, _, D = x.shape
        old = old or (None, None, None)
        shapes = [(B, Hk, size, D * self.bits // 32)]
        shapes += [(B, Hk, size, D // self.group_size)] * 2
        dtypes = (mx.uint32, x.dtype, x.dtype)
        return tuple(resize_slots(o, n, s, d) for o, s, d in zip(old, shapes, dtypes))

    def write(self, start: int, keys: mx.array, values: mx.array):
        end = start + keys.shape[2]
        for stored, new in (
            (self.keys, self.quantize(keys)),
            (self.values, self.quantize(values)),
        ):
            for a, x in zip(stored, new):
                a[..., start:end, :] = x

    def write_slot(self, slot: mx.array, keys: mx.array, values: mx.array):
        self.put(slot, self.quantize(keys), self.quantize(values))

    def write_index(self, index: mx.array, keys: mx.array, values: mx.array,
                    for_sdpa: bool = False):
        """Write one token per row at ``index`` (B, Hk, 1, 1): a fold step's victim,
        used as is by every scatter (no per-array index reshapes: decode is
        host-bound, every graph node counts). ``for_sdpa``: ``sdpa`` attends
        next (a group step): on a GPU the write kernel keeps K/V packed for the
        group fold and also gives the dense K/V."""
        plan = None
        family = PACKED_WRITE if for_sdpa else QUANTIZED_WRITE
        if self.fused_write and first_use.passed(family):
            plan = self._writes.get(keys, values, index, self.bits, self.group_size,
                                    dense_out=for_sdpa, packed=for_sdpa)
        if plan is not None and for_sdpa:
            self._packed, kd, vd = first_use.launch(
                family, plan, (keys, values, index, self.group_keys), self._packed_ops,
                self._write_differs)
            self._dense = (self._packed, kd, vd)
        elif plan is not None:
            res = first_use.launch(family, plan, (keys, values, index, *self.keys,
                                                  *self.values),
                                   self._scatter_ops, self._write_differs)
            self.keys, self.values = tuple(res[:3]), tuple(res[3:6])
        elif for_sdpa and self._packed is not None:
            self._packed, kd, vd = self._packed_ops(keys, values, index, self._packed)
            self._dense = (self._packed, kd, vd)
        else:
            self._put_index(index, self.quantize(keys), self.quantize(values))

    def _packed_ops(self, keys, values, index, stored):
        """The write kernel's work by ops (``fused_write = False`` while the group
        fold kernel keeps K/V packed): quantize, one scatter, dequantize.
        Returns (packed buffer, dense keys, dense values)."""
        token = pack(self.quantize(keys), self.quantize(values))
        packed = mx.put_along_axis(stored, index, token, axis=2)
        return (packed, *(mx.dequantize(*t, group_size=self.group_size, bits=self.bits)
                          for t in self._views(packed)))

    def _scatter_ops(self, keys, values, index, *stored):
        """The triples' write kernel's work by ops: quantize, six scatters."""
        new = (*self.quantize(keys), *self.quantize(values))
        return tuple(mx.put_along_axis(a, index, x, axis=2) for a, x in zip(stored, new))

    def _write_differs(self, args, got, want):
        """first_use's verdict on a write of ``args`` (keys, values, index,
        stored...): ``got`` / ``want`` as the packed write returns them
        (buffer, dense K, dense V) or the six triples' arrays."""
        index = args[2]
        if len(got) == 3:
            triples = [self._views(x[0]) for x in (got, want)]
            dense = got[1:]
        else:
            triples = [(tuple(x[:3]), tuple(x[3:6])) for x in (got, want)]
            dense = None
        rows = first_use.written(index, triples[1][0][0].shape[2])
        return first_use.quantized_write_differs(self.bits, self.group_size, rows,
                                                 *triples, dense=dense)

    def put(self, slot: mx.array, keys: Triple, values: Triple):
        """Write already-quantized (B, Hk, 1, ·) triples into slot (B, Hk, 1)."""
        self._put_index(slot[..., None], keys, values)

    def _put_index(self, index: mx.array, keys: Triple, values: Triple):
        """Scatter triples at ``index`` (B, Hk, 1, 1), broadcast along the last axis."""
        self.keys = tuple(mx.put_along_axis(a, index, x, axis=2) for a, x in zip(self.keys, keys))
        self.values = tuple(
            mx.put_along_axis(a, index, x, axis=2) for a, x in zip(self.values, values)
        )

    def take(self, slots: mx.array, n: int) -> tuple[Triple, Triple]:
        """Triples of ``slots`` (B, Hk, k) among the first n slots."""
        return (
            tuple(take_slots(a, slots, n) for a in self.keys),
            tuple(take_slots(a, slots, n) for a in self.values),
        )

    def gather(self, slots: mx.array, n: int):
        self.keys, self.values = self.take(slots, n)

    def fetch(self, n: int):
        """The triples of the first n slots; after a packed write, its dense K/V
        (what the group step's SDPA reads; ``attention`` / ``sdpa`` fall back
        to the triples when handed them otherwise)."""
        dense = self._dense
        if dense is not None and dense[0] is self._packed:
            if n != dense[1].shape[2]:
                self._dense = dense = (dense[0], *(a[..., :n, :] for a in dense[1:]))
            return dense[1:]
        return self._triples(n)

    def _triples(self, n: int):
        if n == self.capacity:
            return self.keys, self.values  # full: six slice nodes less per step
        return tuple(a[..., :n, :] for a in self.keys), tuple(
            a[..., :n, :] for a in self.values
        )

    def triples(self, keys, values):
        """``fetch``'s result as triples (a packed write's dense K/V: the stored ones)."""
        if isinstance(keys, tuple):
            return keys, values
        self._dense = None
        return self._triples(keys.shape[2])

    def attention(self, queries, keys, values, *, scale, mask, sinks):
        keys, values = self.triples(keys, values)
        return attend(
            queries,
            keys,
            values,
            scale=scale,
            bits=self.bits,
            group_size=self.group_size,
            mask=mask,
            sinks=sinks,
        )

    def column_attention(self, queries, keys, values, *, scale, mask, sinks, weights):
        """A prompt chunk's (out, probs, seen) over K / V dequantized in float32
        (kernels.attention_with_column_sums)."""
        return attention_with_column_sums(queries, *self.dense(keys, values, mx.float32),
                                          scale=scale, mask=mask, sinks=sinks, weights=weights)

    def sdpa(self, queries, keys, values, *, scale):
        """Attention without scores (a group step's). On a GPU: K and V
        dequantized, then MLX's fused SDPA (three built-in ops: cheaper to
        encode than a custom kernel, and MLX 0.32's CUDA ``quantized_matmul``
        has no kernel for most cache shapes, e.g. 24 or 4097 keys). On the CPU:
        the ops mlx-lm's QuantizedKVCache decodes with, not its function: that
        scales the caller's queries in place, and the group folds the same
        query later."""
        gs, bits = self.group_size, self.bits
        dense, self._dense = self._dense, None
        if dense is not None and dense[0] is self._packed and dense[1] is keys:
            # the packed write's K/V
            return mx.fast.scaled_dot_product_attention(queries, *dense[1:], scale=scale)
        keys, values = self.triples(keys, values)
        if mx.default_device() == mx.gpu:
            k, v = (mx.dequantize(*t, group_size=gs, bits=bits) for t in (keys, values))
            return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale)
        B, Hq, L, D = queries.shape
        Hk = keys[0].shape[1]
        q = (queries * scale).reshape(B, Hk, Hq // Hk, L, D)
        k, v = ([mx.expand_dims(a, 2) for a in t] for t in (keys, values))
        s = mx.quantized_matmul(q, *k, transpose=True, group_size=gs, bits=bits)
        s = mx.softmax(s, axis=-1, precise=True)
        out = mx.quantized_matmul(s, *v, transpose=False, group_size=gs, bits=bits)
        return out.reshape(B, Hq, L, D)

    def dense(self, keys, values, dtype):
        """Fetched K / V dequantized in ``dtype`` (a window-scored prompt chunk
        attends them with MLX's SDPA instead of computing every row's logits)."""
        keys, values = self.triples(keys, values)
        return tuple(dequantize(t, bits=self.bits, group_size=self.group_size, dtype=dtype)
                     for t in (keys, values))

    def dense_keys(self, n: int) -> mx.array:
        """The first n keys dequantized in float32 (as the kernels compute them)."""
        t = tuple(a[..., :n, :] for a in self.keys)
        return dequantize(t, bits=self.bits, group_size=self.group_size)

    @property
    def nbytes(self) -> int:
        if self._packed is not None:
            return self._packed.nbytes
        if self._keys is None:
            return 0
        return sum(a.nbytes for a in (*self._keys, *self._values))

    def state(self, n: int) -> list[mx.array]:
        keys, values = self._triples(n)
        return [*keys, *values]

    def set_state(self, arrays):
        arrays = list(arrays)
        self._packed = self._dense = None
        self.keys, self.values = tuple(arrays[:3]), tuple(arrays[3:6])
