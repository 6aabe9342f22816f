"""The Metal kernels, run on the CPU by a SIMT emulator (tests/metal_emu.py).

``mx.fast.metal_kernel`` is replaced by the emulator and the backend is
reported as Metal, so the library's own launch code builds and launches the
Metal text (the Metal prelude and the body CUDA shares), and the results are
checked against the float64 reference, outputs poisoned with NaN first. What
the emulator does not model (Metal's arithmetic and memory model, speed) is
in its docstring.
"""

import pytest

import metal_emu
from mlx_h2o.kernels import build, decode
from mlx_h2o.kernels.testing import Case, check_case

needs_clang = pytest.mark.skipif(not metal_emu.find_cxx(), reason="no clang++ for the emulator")


def _clear_kernels():
    for make in (build._make_pass1_kernel, build._make_pass2_kernel):
        make.cache_clear()


@pytest.fixture
def metal(monkeypatch):
    """Kernels built for Metal and run by the emulator; ``metal(layout)`` sets
    how strided inputs are handed over."""
    layout = {"value": "contiguous"}

    def make(**kw):
        return metal_emu.EmulatedKernel(**kw, layout=layout["value"])

    monkeypatch.setattr(build.mx.fast, "metal_kernel", make)
    monkeypatch.setattr(build, "device_backend", lambda: "metal")
    monkeypatch.setattr(decode, "device_backend", lambda: "metal")
    _clear_kernels()
    yield lambda value: layout.__setitem__("value", value)
    _clear_kernels()


ATTENTION_CASES = [
    Case(N=97),
    Case(N=301, mask="bool_kv", sinks=True, splits=3),
    Case(N=257, D=64, Hq=6, Hk=2, L=2, mask="causal"),
    Case(N=130, D=80, Hq=4, Hk=4, dtype="bfloat16", mask="add_q", splits=2),
    Case(N=200, D=96, Hq=16, Hk=2, mask="bool_q", splits=4),
    Case(N=64, D=256, dtype="float32", sinks=True),
    Case(N=77, B=2, mask="bool_row", splits=2),
    Case(N=150, D=64, L=8, Hq=2, Hk=1, mask="causal", sinks=True, splits=3),
    Case(N=45, D=128, Hq=8, Hk=8, L=3, mask="add_bcast", dtype="bfloat16"),
]


@needs_clang
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: c.label())
def test_metal_attention_matches_float64(metal, case):
    def fn(q, k, v, scale, mask, sinks):
        return decode.decode_attention(q, k, v, scale=scale, mask=mask, sinks=sinks,
                                       num_splits=case.splits, poison=float("nan"))

    ok, errs = check_case(case, 11, fn)
    assert ok, errs


@needs_clang
@pytest.mark.parametrize("layout", ["padded", "transposed"])
def test_metal_attention_reads_strided_buffers(metal, layout):
    """K / V (and the mask) handed over with padded rows (NaN in the padding)
    or a transposed last axis: the kernels must follow the strides."""
    metal(layout)
    case = Case(N=203, D=64, Hq=8, Hk=2, mask="bool_kv", splits=2)

    def fn(q, k, v, scale, mask, sinks):
        return decode.decode_attention(q, k, v, scale=scale, mask=mask, sinks=sinks,
                                       num_splits=case.splits, poison=float("nan"))

    ok, errs = check_case(case, 5, fn)
    assert ok, errs


@needs_clang
def test_emulator_catches_divergent_shuffles(metal):
    """A shuffle that only some threads of a SIMD group reach fails the
    launch instead of returning made-up values."""
    import mlx.core as mx

    from mlx_h2o.kernels import source

    body = source.METAL_IDS + """
  float x = float(tid);
  if (lane < 16) x = H2O_SHFL_XOR(x, 1);
  out[tid] = x;
"""
    kernel = metal_emu.EmulatedKernel("divergent", ["q"], ["out"], body, source.METAL_HEADER,
                                      timeout_s=2)
    with pytest.raises(RuntimeError, match="SIMD shuffle without every lane"):
        kernel(inputs=[mx.zeros((4,))], grid=(32, 1, 1), threadgroup=(32, 1, 1),
               output_shapes=[(32,)], output_dtypes=[mx.float32])
