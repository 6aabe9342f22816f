"""Precompiled CUDA kernels (kernels/cubin.py): programs, the on-disk cache, fallback.

The program text, the cache's atomic write / read-back and the fallback to
MLX's own build run everywhere with stand-ins for NVRTC; compiling runs
where this process has NVRTC loaded (MLX's CUDA backend); the launches run
where CUDA is, against MLX's build of the same kernel.
"""

import copy
import warnings

import mlx.core as mx
import numpy as np
import pytest

from mlx_h2o.kernels import cubin, queued
from mlx_h2o.kernels.build import _kernel, group_names, group_source
from mlx_h2o.kernels.group_fold import group_plan, layer_params
from mlx_h2o.kernels.h2o_step import step_params, step_plan
from mlx_h2o.kernels.packed import pack

needs_cuda = pytest.mark.skipif(not cubin.available(), reason="needs CUDA with NVRTC")


def _program(kind="fold", dtype=mx.float16):
    names = queued.pass_names(kind)
    header, body = queued.pass_source("cuda", kind)
    ndim = {"q": 4, "k": 4, "vis": 1, "prm_f": 1, "lse_in": 2, "score_in": 3,
            "count_in": 3, "part": 4}
    types = {"q": dtype, "k": dtype, "vis": mx.int32}
    inputs = [(n, types.get(n, mx.float32), ndim[n]) for n in names[0]]
    return cubin.program(header, body, inputs, [(n, mx.float32) for n in names[1]],
                         [("T", dtype), ("D", 128), ("G", 4)])


def test_program_signature_passes_read_shapes_after_the_outputs():
    src = _program()
    start = src.index("H2O_PRECOMPILED_FUNC(")
    head = src[start:src.index(") {", start)]
    params = [p.strip() for p in head.split("(", 1)[1].split(",")]
    assert params[:4] == ["const __half* q", "const __half* k", "const int* vis",
                          "const float* prm_f"]
    assert params[7:9] == ["float* score_out", "float* count_out"]
    # The shapes the body reads, in input order, ndim ints each: q, k, score_in.
    assert params[9:] == [f"int {n}_shape{i}" for n, nd in (("q", 4), ("k", 4), ("score_in", 3))
                          for i in range(nd)]
    assert "const int q_shape[4] = {q_shape0, q_shape1, q_shape2, q_shape3};" in src
    assert "constexpr int D = 128;" in src and "using T = __half;" in src
    assert src.count("{") == src.count("}")


def test_strides_of_row_contiguous_inputs_follow_from_shapes():
    body = "o[0] = k[k_strides[0] + k_ndim] + p[p_shape[0]];"
    src = cubin.program("", body, [("k", mx.float32, 3), ("p", mx.int32, 1)],
                        [("o", mx.float32)], [])
    assert "const long long k_strides[3] = {k_strides0, k_strides1, k_strides2};" in src
    assert "constexpr int k_ndim = 3;" in src and "int p_shape0" in src
    ints = cubin.scalars(cubin.reads(body, ["k", "p"]), ["k", "p"],
                         [mx.zeros((2, 5, 7)), mx.zeros((4,), mx.int32)])
    assert ints == [35, 7, 1, 4]  # k's strides, then p's shape: the parameters' order


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    """NVRTC and the driver replaced: compile_program records its calls."""
    calls = []

    class Lib:
        def nvrtcVersion(self, major, minor):
            major._obj.value, minor._obj.value = 13, 0
            return 0

    monkeypatch.setenv(cubin.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(cubin, "_nvrtc", lambda: Lib())
    monkeypatch.setattr(cubin, "_arch", lambda: "sm_90")
    monkeypatch.setattr(cubin, "compile_program",
                        lambda src, func, arch: calls.append(func) or f"{func}:{arch}".encode())
    return calls, tmp_path


def test_cubin_is_compiled_once_and_read_back(stand_in):
    calls, root = stand_in
    first = cubin.cached_cubin("program A", "f_a")
    assert first == b"f_a:sm_90" and calls == ["f_a"]
    assert cubin.cached_cubin("program A", "f_a") == first and calls == ["f_a"]
    cubin.cached_cubin("program B", "f_a")  # other text: another file
    assert calls == ["f_a", "f_a"]
    files = sorted(p.name for p in (root / mx.__version__).iterdir())
    assert len(files) == 2 and all(f.startswith("f_a.") and f.endswith(".cubin") for f in files)


def test_unwritable_cache_still_returns_the_build(stand_in, monkeypatch):
    calls, root = stand_in
    monkeypatch.setattr(cubin.os, "replace", lambda a, b: (_ for _ in ()).throw(OSError("ro")))
    assert cubin.cached_cubin("program C", "f_c") == b"f_c:sm_90"
    assert not list(root.rglob("*.tmp")) and not list(root.rglob("*.cubin"))  # no leftovers


def test_cache_off():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cubin.CACHE_ENV, "0")
        assert cubin.cache_dir() is None and not cubin.available()


def test_failed_build_warns_and_falls_back(stand_in, monkeypatch):
    def broken(src, func, arch):
        raise RuntimeError("no CUDA headers")

    monkeypatch.setattr(cubin, "compile_program", broken)
    seen = []
    kern = cubin.PrecompiledKernel("h2o_x", ["a"], ["b"], "", "b[0] = a[a_shape[0] - 1];",
                                   fallback=lambda **kw: seen.append(kw) or ["ok"])
    a = mx.zeros((3,))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = kern(inputs=[a], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
                   output_dtypes=[mx.float32])
    assert out == ["ok"] and "no CUDA headers" in str(w[0].message)
    assert seen[0]["output_shapes"] == [(1,)] and seen[0]["inputs"][0] is a
    kern(inputs=[a], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
         output_dtypes=[mx.float32])
    assert len(seen) == 2  # decided once per variant


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_queue_fold_precompiled_equals_mlx_build(dtype, tmp_path, monkeypatch):
    monkeypatch.setenv(cubin.CACHE_ENV, str(tmp_path))
    rng = np.random.default_rng(7)
    B, Hq, Hk, T, D, cap, M = 2, 8, 2, 5, 128, 700, 650
    q = mx.array(rng.standard_normal((B, Hq, T, D)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((B, Hk, cap, D)).astype(np.float32)).astype(dtype)
    inputs = [q, k, mx.array([600, 610, 620, 630, 640], mx.int32), mx.array([0.09, 0, 0])]
    names, (header, body) = queued.pass_names("partials"), queued.pass_source("cuda", "partials")
    mlx_built = _kernel("cuda", "h2o_test_qfold", names, header, body, contiguous=True)
    ours = cubin.PrecompiledKernel("h2o_test_qfold", *names, header, body, fallback=None)
    grid = (B * Hk * 128, -(-M // 128), 1)
    args = dict(inputs=inputs, template=[("T", dtype), ("D", D), ("G", Hq // Hk)], grid=grid,
                threadgroup=(128, 1, 1), output_shapes=[(B * Hk, grid[1], 4 * T, 2)],
                output_dtypes=[mx.float32], init_value=float("nan"))
    want, got = mlx_built(**args)[0], ours(**args)[0]
    assert mx.array_equal(got, want, equal_nan=True).item()
    assert list(tmp_path.rglob("*.cubin"))  # kept for the next process


@needs_cuda
@pytest.mark.parametrize("bits", [None, 8])
def test_group_fold_precompiled_equals_mlx_build(bits, tmp_path, monkeypatch):
    """Two chained folds (the first slot as StepGroup stacks it, the next one the
    kernel's victims): MLX's build and ours agree bit for bit, in one build."""
    monkeypatch.setenv(cubin.CACHE_ENV, str(tmp_path))
    rng = np.random.default_rng(3)
    n, B, Hq, Hk, D, M, offset = 3, 2, 8, 2, 128, 96, 500

    def normal(shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.bfloat16)

    qs, keys = [normal((B, Hq, 1, D)) for _ in range(n)], [normal((B, Hk, M, D)) for _ in range(n)]
    if bits is not None:
        keys = [pack(*[mx.quantize(k, group_size=64, bits=bits)] * 2) for k in keys]
    pos = mx.broadcast_to(mx.arange(offset - 1 - M, offset - 1, dtype=mx.int32), (n * B, Hk, M))
    meta = [pos + 0, mx.array(rng.uniform(size=pos.shape).astype(np.float32)), mx.ones(pos.shape)]
    lay_i = mx.array([layer_params(offset, 4, M // 2, M, M)] * n, dtype=mx.int32)
    lay_f = mx.array([[D ** -0.5, 0.95, 0.05, 0.0]] * n, mx.float32)
    plan = group_plan(n, B, Hq, Hk, D, mx.bfloat16, M, "accumulated", (), bits, 64)
    assert isinstance(plan.kernel, cubin.PrecompiledKernel)
    ours, mlx_built = copy.copy(plan), copy.copy(plan)
    ours.kernel = cubin.PrecompiledKernel(plan.kernel.name, *group_names(n, bits is not None),
                                          *group_source("cuda", n, bits is not None),
                                          fallback=None)
    ours._run = mx.compile(ours._launch)
    mlx_built.kernel = plan.kernel.fallback
    slot = mx.zeros((n * B, Hk, 1, 1), mx.int32)
    for _ in range(2):
        want = mlx_built._launch(*qs, *keys, lay_i, lay_f, *meta, slot)
        got = ours._run(*qs, *keys, lay_i, lay_f, *meta, slot)
        for a, b in zip(got, want):
            assert mx.array_equal(a, b).item()
        meta, slot, lay_i = list(got[:3]), got[3], got[5]
    # The victim, D wide for dense K (1 for packed), reads as the next slot
    # (both 4-d: one build).
    assert slot.shape == (n * B, Hk, 1, plan.VD) and len(ours.kernel._built) == 1


@needs_cuda
@pytest.mark.parametrize("cap", [40, 5000])  # one pass / split over the keys
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_fused_step_precompiled_equals_mlx_build(cap, dtype, tmp_path, monkeypatch):
    """A StepPlan's steady launch (whole buffers) runs our cubins: the same
    outputs as MLX's build of the same kernels, bit for bit."""
    monkeypatch.setenv(cubin.CACHE_ENV, str(tmp_path))
    rng = np.random.default_rng(5)
    B, Hq, Hk, D = 2, 8, 2, 64
    plan = step_plan(B, Hq, Hk, D, dtype, cap, "none", 0, "accumulated", 0.95, D ** -0.5,
                     2, 8, ((3, 5),), None, False)
    assert all(isinstance(k, cubin.PrecompiledKernel) for k in plan.steady_kernels)
    assert (plan.splits(cap) > 1) == (cap > 1000)

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    positions = mx.broadcast_to(mx.arange(cap, dtype=mx.int32), (B, Hk, cap)) + 0
    score = mx.array(rng.uniform(size=(B, Hk, cap)).astype(np.float32))
    arrays = (normal(B, Hq, 1, D), normal(B, Hk, cap, D), normal(B, Hk, cap, D), positions,
              score, mx.ones((B, Hk, cap)), mx.zeros((B, Hk, 1, D), mx.int32),
              step_params(cap + 1, None, plan.tail, cap))
    got, want = plan._steady(*arrays), plan._launch(*arrays)
    for a, b in zip(got, want):
        assert mx.array_equal(a, b).item()
