"""Packed quantized K/V (kernels/packed.py) and QuantizedKV's two forms.

Group steps keep a quantized layer's K and V in one uint32 buffer (the write
kernel's host cost grows with its outputs); every other use unpacks. Checked
here on the CPU: pack / unpack are exact inverses for every width, group size
and dtype; a storage gives the same triples, state, nbytes and capacity in
both forms; and grouped quantized caches whose victim writes go through the
packed path (a reference of the GPU kernel: mx.quantize + put_along_axis on
the unpacked buffer) decide as per-layer caches do.
"""

import mlx.core as mx
import numpy as np
import pytest

from mlx_h2o.cache import QuantConfig, quantized_cache_type
from mlx_h2o.cache.group import make_groups
from mlx_h2o.cache.quantized_storage import QuantizedKV
from mlx_h2o.kernels.packed import pack, row_words, unpack
from test_step_group import configs, quantized_runs_agree

CASES = [(8, 64, mx.bfloat16, 128), (4, 32, mx.float16, 64), (2, 128, mx.float32, 128),
         (8, 32, mx.float32, 96), (4, 128, mx.bfloat16, 256), (8, 128, mx.float16, 128)]


def triples(rng, shape, dtype, bits, gs):
    x = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    return mx.quantize(x, group_size=gs, bits=bits)


def same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.array(a.astype(mx.float32) if a.dtype != mx.uint32 else a),
                                  np.array(b.astype(mx.float32) if b.dtype != mx.uint32 else b))


@pytest.mark.parametrize("bits,gs,dtype,D", CASES)
def test_pack_unpack_round_trip(bits, gs, dtype, D):
    rng = np.random.default_rng(bits * D + gs)
    k, v = (triples(rng, (2, 3, 7, D), dtype, bits, gs) for _ in range(2))
    packed = pack(k, v)
    assert packed.dtype == mx.uint32 and packed.shape == (2, 3, 7, row_words(D, bits, gs, dtype))
    # Bytes: exactly the six arrays (no padding).
    assert packed.nbytes == sum(a.nbytes for a in (*k, *v))
    for got, want in zip(unpack(packed, D, bits, gs, dtype), (k, v)):
        for g, w in zip(got, want):
            same(g, w)


def filled_storage(rng, bits, gs, dtype, D, cap=9, n=9):
    kv = QuantizedKV(bits, gs)
    x = [mx.array(rng.standard_normal((1, 2, n, D)).astype(np.float32)).astype(dtype)
         for _ in range(2)]
    kv.resize(0, cap, *x)
    kv.write(0, *x)
    return kv


@pytest.mark.parametrize("bits,gs,dtype,D", CASES[:3])
def test_storage_forms_hold_the_same_values(bits, gs, dtype, D):
    rng = np.random.default_rng(5)
    kv = filled_storage(rng, bits, gs, dtype, D)
    keys, values = kv.keys, kv.values
    state, nbytes, cap = kv.state(9), kv.nbytes, kv.capacity
    packed = kv.group_keys  # packs
    assert kv._keys is None and kv.group_keys is packed  # packed once
    assert (kv.nbytes, kv.capacity) == (nbytes, cap)
    for g, w in zip(kv.state(9), state):  # unpacks
        same(g, w)
    assert kv._packed is None
    for got, want in ((kv.keys, keys), (kv.values, values)):
        for g, w in zip(got, want):
            same(g, w)


def test_fetch_after_a_packed_write_hands_out_dense_kv():
    """A packed write's dense K/V go to the SDPA that follows; ``attention``
    handed them instead attends over the stored triples."""
    rng = np.random.default_rng(9)
    bits, gs, D = 8, 32, 64
    kv = filled_storage(rng, bits, gs, mx.float32, D)
    kv._writes.get = lambda *a, dense_out=True, packed=False: (
        reference_packed_plan(bits, gs) if packed else None)
    new = [mx.array(rng.standard_normal((1, 2, 1, D)).astype(np.float32)) for _ in range(2)]
    index = mx.array(np.array([3, 7]).reshape(1, 2, 1, 1).astype(np.int32))
    kv.write_index(index, *new, for_sdpa=True)
    keys, values = kv.fetch(9)
    assert not isinstance(keys, tuple) and keys.shape == (1, 2, 9, D)
    q = mx.array(rng.standard_normal((1, 4, 1, D)).astype(np.float32))
    out, logits, _ = kv.attention(q, keys, values, scale=0.5, mask=None, sinks=None)
    triple_k, triple_v = kv.fetch(9)  # no fresh write: the stored triples
    assert isinstance(triple_k, tuple)
    want, want_logits, _ = kv.attention(q, triple_k, triple_v, scale=0.5, mask=None, sinks=None)
    np.testing.assert_array_equal(np.array(out), np.array(want))
    np.testing.assert_array_equal(np.array(logits), np.array(want_logits))
    # The token went where told, as mx.quantize writes it.
    q_new = mx.quantize(new[0], group_size=gs, bits=bits)
    got = np.array(kv.keys[0])
    np.testing.assert_array_equal(got[0, 0, 3], np.array(q_new[0])[0, 0, 0])
    np.testing.assert_array_equal(got[0, 1, 7], np.array(q_new[0])[0, 1, 0])


def reference_packed_plan(bits, gs):
    """What the packed write kernel computes, by ops (CPU stand-in)."""
    def plan(keys, values, index, packed):
        kt, vt = unpack(packed, keys.shape[-1], bits, gs, keys.dtype)
        new = [tuple(mx.put_along_axis(a, index, x, axis=2)
                     for a, x in zip(t, mx.quantize(n, group_size=gs, bits=bits)))
               for t, n in ((kt, keys), (vt, values))]
        return (pack(*new), *(mx.dequantize(*t, group_size=gs, bits=bits) for t in new))
    return plan


@pytest.mark.parametrize("bits", [8, 4])
def test_grouped_caches_writing_packed_equal_per_layer(bits):
    """Group steps with the packed write (reference plan) vs per-layer caches:
    same kept positions and evictions, outputs within quantization rounding."""
    qt = quantized_cache_type(QuantConfig(bits, 32))
    cfgs = configs(sizes=(24, 40))
    plain, grouped = [qt(c) for c in cfgs], [qt(c) for c in cfgs]
    make_groups(grouped, size=2, use_kernel=False)
    writes = []

    def get(*a, dense_out=True, packed=False):
        writes.append(packed)
        return reference_packed_plan(bits, 32) if packed else None

    for c in grouped:
        c.kv._writes.get = get
    quantized_runs_agree(plain, grouped)
    assert sum(writes) > 40  # the packed path ran
    for p, g in zip(plain, grouped):
        for x, y in zip(p.state[:6], g.state[:6]):
            same(x, y)  # stored triples: the same codes, scales and biases


@pytest.mark.parametrize("fused", [True, False])
def test_packed_write_by_ops_stays_packed(fused):
    """Without a write kernel (CPU, or ``fused_write = False``) a storage the
    group fold packed writes by ops and stays packed (no unpack / pack per
    token); values as mx.quantize + put_along_axis on the triples."""
    rng = np.random.default_rng(11)
    bits, gs, D = 4, 32, 64
    kv = filled_storage(rng, bits, gs, mx.float16, D)
    kv.fused_write = fused  # no kernel on the CPU either way
    want_k, want_v = kv.keys, kv.values
    packed = kv.group_keys
    new = [mx.array(rng.standard_normal((1, 2, 1, D)).astype(np.float32)).astype(mx.float16)
           for _ in range(2)]
    index = mx.array(np.array([0, 8]).reshape(1, 2, 1, 1).astype(np.int32))
    kv.write_index(index, *new, for_sdpa=True)
    assert kv._packed is not None and kv._packed is not packed and kv._keys is None
    want = [tuple(mx.put_along_axis(a, index, q, axis=2)
                  for a, q in zip(t, mx.quantize(x, group_size=gs, bits=bits)))
            for t, x in ((want_k, new[0]), (want_v, new[1]))]
    for d, t in zip(kv.fetch(9), want):
        same(d, mx.dequantize(*t, group_size=gs, bits=bits))
    for g, w in zip(kv.state(9), (*want[0], *want[1])):
        same(g, w)
