"""The victim-slot write kernels (kernels/kv_write.py) against their references.

Source assembly runs everywhere; the numeric checks run only where MLX has a
GPU backend. References: ``mx.quantize`` + ``put_along_axis`` for the stored
triples (bit-exact: the kernel quantizes as mlx does), and float64
``scale * code + bias`` of the stored triples for the dense outputs (within
one rounding to the dtype). Fresh random inputs every case, odd slot counts,
one or several sequences and KV heads, outputs poisoned before the launch.
"""

import mlx.core as mx
import numpy as np
import pytest

from mlx_h2o.kernels import backend, kv_write, source
from mlx_h2o.kernels.packed import pack, unpack

needs_gpu = pytest.mark.skipif(backend.gpu_backend() is None,
                               reason="needs MLX with Metal or CUDA")
POISON = 12345.0  # what an unwritten element reads (uint32 codes too)
MANTISSA = {mx.float16: 10, mx.bfloat16: 7, mx.float32: 23}


@pytest.mark.parametrize("dense_out,packed", [(True, False), (False, False), (True, True)])
def test_write_source_shares_the_body(dense_out, packed):
    _, cuda = kv_write.source("cuda", dense_out, packed)
    _, metal = kv_write.source("metal", dense_out, packed)
    assert "$" not in cuda and cuda.count("{") == cuda.count("}")
    assert cuda.replace(source.CUDA_IDS, "") == metal.replace(source.METAL_IDS, "")
    inputs, outputs = kv_write.names(dense_out, packed)
    assert all(n in cuda for n in inputs + outputs)
    assert ("kd" in outputs) == dense_out
    if packed:  # one stored input and output instead of six
        assert inputs[3:] == ["kv"] and outputs == ["kv_out", "kd", "vd"]


def test_write_not_supported_without_gpu_device():
    k = mx.zeros((1, 2, 1, 64))
    idx = mx.zeros((1, 2, 1, 1), mx.int32)
    with mx.stream(mx.cpu):
        assert not kv_write.write_supported(k, k, idx, 8, 64)
        with pytest.raises(ValueError, match="not supported"):
            kv_write.quantized_write(k, k, idx, None, None, bits=8, group_size=64)


def _np(a):
    """numpy copy; float16 / bfloat16 go through float32 (exactly)."""
    return np.array(a.astype(mx.float32) if a.dtype in (mx.float16, mx.bfloat16) else a)


def _rand(rng, shape, dtype, scale=1.0):
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def _victims(rng, B, Hk, cap, width):
    v = rng.integers(0, cap, (B, Hk, 1, 1)).astype(np.int32)
    return mx.array(np.broadcast_to(v, (B, Hk, 1, width)).copy())


def _stored(rng, B, Hk, cap, D, dtype, bits, gs):
    """A random stored triple (what earlier writes left)."""
    return mx.quantize(_rand(rng, (B, Hk, cap, D), dtype, 2.0), group_size=gs, bits=bits)


def _launch(plan, *arrays):
    """One uncompiled launch with every output poisoned."""
    return plan._launch(*arrays, poison=POISON)


def _dense_ref64(t, bits, gs):
    """float64 scale * code + bias of a stored triple."""
    w, s, b = (_np(a) for a in t)
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    codes = ((w[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*w.shape[:-1], -1)
    s64 = np.repeat(s.astype(np.float64), gs, axis=-1)
    b64 = np.repeat(b.astype(np.float64), gs, axis=-1)
    return s64 * codes + b64


def _assert_one_rounding(got, ref64, dtype):
    """|got - ref| <= one unit in the last place of ``dtype`` at ref's magnitude."""
    got = np.array(got.astype(mx.float32)).astype(np.float64)
    mag = np.maximum(np.abs(ref64), 2.0 ** -14)
    ulp = 2.0 ** (np.floor(np.log2(mag)) - MANTISSA[dtype])
    bad = np.abs(got - ref64) > ulp
    assert not bad.any(), f"{bad.sum()} of {bad.size} dense values off by more than 1 ulp"


QUANT_CASES = [  # (dtype, D, bits, group_size)
    (mx.bfloat16, 128, 8, 64), (mx.float16, 128, 4, 64), (mx.float32, 128, 8, 32),
    (mx.bfloat16, 64, 4, 32), (mx.float16, 96, 8, 32), (mx.bfloat16, 256, 4, 128),
    (mx.float16, 128, 2, 64), (mx.float32, 64, 2, 64), (mx.bfloat16, 128, 8, 128),
]


@needs_gpu
@pytest.mark.parametrize("dtype,D,bits,gs", QUANT_CASES)
@pytest.mark.parametrize("dense_out", [True, False])
def test_quantized_write_matches_mx_quantize(dtype, D, bits, gs, dense_out):
    rng = np.random.default_rng(hash((str(dtype), D, bits, gs, dense_out)) % 2**32)
    for B, Hk, cap in ((1, 8, 257), (2, 1, 1), (2, 3, 97)):
        kn, vn = _rand(rng, (B, Hk, 1, D), dtype), _rand(rng, (B, Hk, 1, D), dtype, 0.3)
        idx = _victims(rng, B, Hk, cap, 1)
        ks, vs = (_stored(rng, B, Hk, cap, D, dtype, bits, gs) for _ in range(2))
        plan = kv_write.write_plan(dtype, D, bits, gs, dense_out)
        got = _launch(plan, kn, vn, idx, *ks, *vs)
        for new, stored, out in ((kn, ks, got[:3]), (vn, vs, got[3:6])):
            q = mx.quantize(new, group_size=gs, bits=bits)
            want = [mx.put_along_axis(a, idx, x, axis=2) for a, x in zip(stored, q)]
            for g, w in zip(out, want):
                assert g.dtype == w.dtype and g.shape == w.shape
                np.testing.assert_array_equal(_np(g), _np(w))
        if dense_out:
            for t, d in ((got[:3], got[6]), (got[3:6], got[7])):
                assert d.shape == (B, Hk, cap, D) and d.dtype == dtype
                _assert_one_rounding(d, _dense_ref64(t, bits, gs), dtype)
        # The compiled (steady-state) call gives the same arrays.
        again = plan(kn, vn, idx, *ks, *vs)
        for g, a in zip(got, again):
            np.testing.assert_array_equal(_np(g), _np(a))


@needs_gpu
def test_quantized_write_handles_sliced_inputs():
    """Non-contiguous stored triples (a state set from slices) are copied, not misread."""
    rng = np.random.default_rng(7)
    dtype, D, bits, gs, B, Hk = mx.bfloat16, 128, 8, 64, 1, 4
    big = _stored(rng, B, Hk, 300, D, dtype, bits, gs)
    ks = tuple(a[:, :, :100] for a in big)
    vs = _stored(rng, B, Hk, 100, D, dtype, bits, gs)
    kn, vn = _rand(rng, (B, Hk, 1, D), dtype), _rand(rng, (B, Hk, 1, D), dtype)
    idx = _victims(rng, B, Hk, 100, 1)
    res = kv_write.quantized_write(kn, vn, idx, ks, vs, bits=bits, group_size=gs)
    q = mx.quantize(kn, group_size=gs, bits=bits)
    for g, a, x in zip(res.keys, ks, q):
        np.testing.assert_array_equal(_np(g), _np(mx.put_along_axis(a, idx, x, axis=2)))


@needs_gpu
@pytest.mark.parametrize("dtype,D,bits,gs", QUANT_CASES)
def test_packed_write_matches_mx_quantize(dtype, D, bits, gs):
    """The packed buffer after the write is pack() of the triples that
    mx.quantize + put_along_axis give; the dense outputs are its values."""
    rng = np.random.default_rng(hash((str(dtype), D, bits, gs, "packed")) % 2**32)
    for B, Hk, cap in ((1, 8, 257), (2, 1, 1), (2, 3, 97)):
        kn, vn = _rand(rng, (B, Hk, 1, D), dtype), _rand(rng, (B, Hk, 1, D), dtype, 0.3)
        idx = _victims(rng, B, Hk, cap, 1)
        ks, vs = (_stored(rng, B, Hk, cap, D, dtype, bits, gs) for _ in range(2))
        plan = kv_write.write_plan(dtype, D, bits, gs, True, True)
        got, kd, vd = _launch(plan, kn, vn, idx, pack(ks, vs))
        want = [tuple(mx.put_along_axis(a, idx, x, axis=2)
                      for a, x in zip(stored, mx.quantize(new, group_size=gs, bits=bits)))
                for new, stored in ((kn, ks), (vn, vs))]
        assert got.dtype == mx.uint32
        np.testing.assert_array_equal(np.array(got), np.array(pack(*want)))
        for t, d in zip(unpack(got, D, bits, gs, dtype), (kd, vd)):
            assert d.shape == (B, Hk, cap, D) and d.dtype == dtype
            _assert_one_rounding(d, _dense_ref64(t, bits, gs), dtype)
        again = kv_write.packed_write(kn, vn, idx, pack(ks, vs), bits=bits, group_size=gs)
        for g, a in zip((got, kd, vd), again):
            np.testing.assert_array_equal(_np(g), _np(a))


@needs_gpu
def test_packed_write_rejects_a_triple_sized_buffer():
    rng = np.random.default_rng(3)
    kn = _rand(rng, (1, 2, 1, 64), mx.float16)
    ks = _stored(rng, 1, 2, 5, 64, mx.float16, 8, 64)
    with pytest.raises(ValueError, match="not a packed buffer"):
        kv_write.packed_write(kn, kn, _victims(rng, 1, 2, 5, 1), ks[0], bits=8, group_size=64)
