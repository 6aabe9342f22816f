"""The Metal kernel text type-checked by clang (tools/metal_check.py).

No Metal compiler runs here: every Metal variant is wrapped as MLX's
metal_kernel writes it and type-checked as C++ with Metal's address spaces
modelled, for several head dims, GQA ratios and query counts. The checker
itself must reject a wrong kernel (an address-space mix-up, a dependent type
error, a SIMD shuffle of a type Metal does not shuffle), or a pass would
mean nothing.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))

import metal_check  # noqa: E402
import nvrtc_check  # noqa: E402

CXX = metal_check.find_cxx()
needs_clang = pytest.mark.skipif(not CXX, reason="no clang++ >= 17 for Metal text")


@needs_clang
@pytest.mark.parametrize("shape", ["128,4,8,1", "64,8,1,2", "80,2,8,1", "256,1,8,8"])
def test_every_metal_variant_type_checks(shape):
    D, G, HK, L = (int(x) for x in shape.split(","))
    programs = [(f"{k.label} T={dt}", metal_check.wrap(k, dt, f"h2o_metal_{i}_{dt}"))
                for i, k in enumerate(metal_check.kernels(D, G, HK, L))
                for dt in ("float16", "bfloat16", "float32")]
    assert len(programs) > 200  # every family: passes, folds, quantized, writes, queue fold
    assert metal_check.check(CXX, programs) == []


def _kernel(body: str) -> nvrtc_check.Kernel:
    from mlx_h2o.kernels import source

    return nvrtc_check.Kernel("probe", source.METAL_HEADER, source.METAL_IDS + body,
                              ["q", "prm_f"], ["out"], lambda dt: [("T", dt), ("D", 128)])


@needs_clang
def test_checker_rejects_wrong_kernels():
    ok = _kernel("  out[tid] = q[tid] * static_cast<T>(prm_f[0]);")
    # prm_f is passed in constant memory: a device pointer may not point at it.
    space = _kernel("  const device float* p = prm_f;\n  out[tid] = static_cast<T>(p[0]);")
    # Only wrong once T is known: the instantiation is checked too.
    dependent = _kernel("  typename T::missing x;\n  out[tid] = q[tid];")
    # metal::simd_shuffle(_xor) take no bool and no 64-bit type (T: half,
    # and bfloat16_t by MLX's bf16_math.h, are fine).
    shuffles = _kernel("  float x = H2O_SHFL_XOR(float(q[tid]), 1);\n"
                       "  uint u = H2O_SHFL(uint(tid), 0);\n  out[tid] = static_cast<T>(x + u);")
    shuffled_bool = _kernel("  bool b = H2O_SHFL_XOR(q[tid] > T(0), 1);\n"
                            "  out[tid] = static_cast<T>(b);")
    shuffled_long = _kernel("  int64_t i = H2O_SHFL(int64_t(tid), 0);\n"
                            "  out[tid] = static_cast<T>(i);")
    shuffled_t = _kernel("  out[tid] = H2O_SHFL_XOR(q[tid], 1);")
    progs = [("ok", metal_check.wrap(ok, "float16", "h2o_metal_0")),
             ("space", metal_check.wrap(space, "float16", "h2o_metal_1")),
             ("dependent", metal_check.wrap(dependent, "bfloat16", "h2o_metal_2")),
             ("shuffles", metal_check.wrap(shuffles, "float16", "h2o_metal_3")),
             ("bool", metal_check.wrap(shuffled_bool, "float32", "h2o_metal_4")),
             ("long", metal_check.wrap(shuffled_long, "float32", "h2o_metal_5")),
             ("half", metal_check.wrap(shuffled_t, "float16", "h2o_metal_6")),
             ("bfloat", metal_check.wrap(shuffled_t, "bfloat16", "h2o_metal_7"))]
    failed = dict(metal_check.check(CXX, progs))
    assert set(failed) == {"space", "dependent", "bool", "long"}
    assert all("no matching function" in failed[k] for k in ("bool", "long"))
    assert "'constant float const *'" in failed["space"]
    assert "'__bf16' cannot be used prior to '::'" in failed["dependent"]


@pytest.mark.parametrize("quantized", [False, True])
def test_group_fold_fits_metals_buffer_table(quantized):
    """Metal binds at most 31 buffers a kernel: the group fold over
    MAX_LAYERS["metal"] layers fits, one layer more would not (the bound is
    as large as it can be)."""
    from mlx_h2o.kernels import build
    from mlx_h2o.kernels.build import METAL_BUFFERS
    from mlx_h2o.kernels.group_fold import MAX_LAYERS

    def buffers(n):
        inputs, outputs = build.group_names(n, quantized)
        header, body = build.group_source("metal", n, quantized)
        kernel = nvrtc_check.Kernel("group", header, body, inputs, outputs, lambda dt: [], {})
        return len(metal_check.buffer_args(kernel))

    n = MAX_LAYERS["metal"]
    assert buffers(n) <= METAL_BUFFERS < buffers(n + 1)


def _avoided_on_metal(label: str) -> bool:
    """Variants the launch code never picks on Metal: the fused one-pass step
    with an array mask (kernels/h2o_step.py takes two passes there) and
    two-segment quantized attention (quantized_gpu.MAX_SEGMENTS)."""
    fused_masked = (label.startswith("pass1 ") and "fused=True" in label
                    and "split=False" in label and ("mask=bool" in label or "mask=add" in label))
    return fused_masked or (label.startswith("qattn ") and "two=True" in label)


@pytest.mark.parametrize("shape", [(128, 4, 8, 1), (64, 8, 1, 2), (256, 1, 8, 8)])
def test_metal_variants_fit_metals_buffer_table(shape):
    """Every Metal variant the launch code may pick binds at most 31 buffers
    (inputs, the shapes / strides its body reads, outputs), and each one it
    avoids on Metal would not fit: the rules are exact, not conservative."""
    from mlx_h2o.kernels import quantized_gpu
    from mlx_h2o.kernels.build import METAL_BUFFERS

    kernels = metal_check.kernels(*shape)
    assert len(kernels) > 50
    for k in kernels:
        n = len(metal_check.buffer_args(k))
        assert (n > METAL_BUFFERS) == _avoided_on_metal(k.label), (k.label, n)
    assert quantized_gpu.MAX_SEGMENTS["metal"] == 1


def _shared_depths(text: str):
    """Brace depth of each ``H2O_SHARED`` (threadgroup) declaration in ``text``."""
    import re

    depth, out = 0, []
    for m in re.finditer(r"[{}]|\bH2O_SHARED\b(?!\s+threadgroup)", re.sub(r"//[^\n]*", "", text)):
        if m.group(0) == "{":
            depth += 1
        elif m.group(0) == "}":
            depth -= 1
        else:
            out.append(depth)
    return out


def test_threadgroup_memory_is_declared_at_kernel_scope():
    """Metal takes threadgroup variables in a kernel function, not at program
    scope or in helper functions: every Metal variant declares them in its
    body's outermost scope, none in its header (which only defines the macro)."""
    kernels = metal_check.kernels(128, 4, 8, 1)
    assert sum(len(_shared_depths(k.body)) for k in kernels) > 100
    for k in kernels:
        assert set(_shared_depths(k.body)) <= {0}, k.label
        assert _shared_depths(k.header) == [], k.label
    assert _shared_depths("{ H2O_SHARED float x[4]; }") == [1]  # the check can fail
