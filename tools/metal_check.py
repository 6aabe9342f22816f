"""Type-check every Metal kernel variant with clang on a machine without Metal.

No Apple GPU or Metal compiler is here, so the Metal twins were never built
(docs/GUIDE.md, "Backends: CPU, CUDA, Metal"). This script wraps each Metal variant as MLX
0.32's ``mx.fast.metal_kernel`` does (mlx/backend/metal/custom_kernel.cpp,
write_signature: template parameters, ``const device T*`` inputs (``constant``
below 8 elements), their ``_shape`` / ``_strides`` / ``_ndim``, ``device``
outputs, the thread-position attributes the body names; then one explicit
instantiation with the launch code's template constants) and type-checks it
as C++17 with clang after a small prelude of stand-ins for the Metal standard
library. Metal's address spaces become clang address spaces, so a pointer
passed between ``device``, ``constant`` and ``threadgroup`` memory is an
error here as it is in Metal.

What it catches: syntax, undeclared names, type and template errors, address
space mismatches, in the shared body as the Metal prelude expands it. What it
cannot: Metal-only rules the stand-ins do not model (they model which types
the SIMD shuffles take, not every builtin's), code generation, and anything
at run time.

    .venv/bin/python tools/metal_check.py [--only SUBSTRING] [--dtypes float16,...]
        [--shape D,G,HK,L] [--dump FILE] [--cxx clang++]

Exit 1 if any variant fails, 2 if no clang++ (version >= 17) is found.
"""

import argparse
import bisect
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from functools import lru_cache
from typing import List

sys.path.insert(0, os.path.dirname(__file__))

import nvrtc_check as nv  # noqa: E402  (the variant lists and their names)

# Metal value types and as_type, also tests/metal_emu.py's.
MSL_VALUES = r"""
struct uint3 { uint x, y, z; };
// A built-in vector type (any address space) that float4(a, b, c, d) builds.
typedef float float4 __attribute__((ext_vector_type(4)));
inline float4 h2o_float4(float a, float b, float c, float d) {
  float4 v = {a, b, c, d};
  return v;
}
#define float4(...) h2o_float4(__VA_ARGS__)
template <typename T, typename U>
T as_type(U u) {
  static_assert(sizeof(T) == sizeof(U), "as_type between sizes");
  T t;
  std::memcpy(&t, &u, sizeof(T));
  return t;
}
"""

# Stand-ins for what the kernels use of the Metal standard library and of
# MLX's Metal utils header (which metal_kernel puts first).
PRELUDE = r"""
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#define __METAL_VERSION__ 310
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup static __attribute__((address_space(3)))
#define thread
typedef unsigned int uint;
typedef unsigned short ushort;
typedef _Float16 half;
typedef half float16_t;
typedef __bf16 bfloat16_t;
""" + MSL_VALUES + r"""namespace metal {
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };
inline mem_flags operator|(mem_flags a, mem_flags b) {
  return mem_flags(int(a) | int(b));
}
void threadgroup_barrier(mem_flags);
// metal::simd_shuffle(_xor), as the kernels call them (namespace-qualified,
// so MLX's global-namespace helpers for 64-bit and bool shuffle_down do not
// apply): Metal's own overloads take 8- to 32-bit integers, half and float,
// and MLX's bf16_math.h adds bfloat16_t in namespace metal. No bool, no
// 64-bit type. Scalars only here (stricter than Metal, whose vectors shuffle
// too; no kernel shuffles one).
template <typename T> struct shuffles : std::false_type {};
template <> struct shuffles<float> : std::true_type {};
template <> struct shuffles<half> : std::true_type {};
template <> struct shuffles<bfloat16_t> : std::true_type {};
template <> struct shuffles<int> : std::true_type {};
template <> struct shuffles<uint> : std::true_type {};
template <> struct shuffles<short> : std::true_type {};
template <> struct shuffles<ushort> : std::true_type {};
template <> struct shuffles<char> : std::true_type {};
template <> struct shuffles<signed char> : std::true_type {};
template <> struct shuffles<unsigned char> : std::true_type {};
template <typename T, typename = std::enable_if_t<shuffles<T>::value>>
T simd_shuffle_xor(T x, ushort mask);
template <typename T, typename = std::enable_if_t<shuffles<T>::value>>
T simd_shuffle(T x, ushort lane);
template <typename T> T min(T a, T b);
template <typename T> T max(T a, T b);
float fabs(float x);
float fmax(float a, float b);
float fmin(float a, float b);
float round(float x);
float floor(float x);
namespace precise {
float exp(float x);
float log(float x);
float divide(float a, float b);
}  // namespace precise
}  // namespace metal
using metal::threadgroup_barrier;
"""

METAL_TYPES = {"__half": "float16_t", "__nv_bfloat16": "bfloat16_t", "float": "float",
               "int32_t": "int32_t", "uint32_t": "uint32_t", "bool": "bool"}
# metal_kernel passes inputs of fewer than 8 elements as `constant` (the
# kernels' scalar parameter arrays), the rest as `device`.
CONSTANT_INPUTS = ("prm_f", "prm_i")
# The attributes metal_kernel adds when the body names them (uint3 or uint).
ATTRIBUTES = {"thread_position_in_grid": "uint3", "thread_position_in_threadgroup": "uint3",
              "threadgroup_position_in_grid": "uint3", "threadgroups_per_grid": "uint3",
              "threads_per_threadgroup": "uint3", "thread_index_in_simdgroup": "uint",
              "simdgroup_index_in_threadgroup": "uint", "thread_index_in_threadgroup": "uint",
              "threads_per_simdgroup": "uint", "simdgroups_per_threadgroup": "uint"}


def kernels(D: int, G: int, HK: int, L: int) -> List[nv.Kernel]:
    """Every Metal variant nvrtc_check.py knows for CUDA (the tensor-core pass
    1 has no Metal twin), with its names and template constants."""
    return (nv.build_kernels(D, G, HK, L, "metal") + nv.quantized_kernels(D, G, "metal")
            + nv.write_kernels(D, "metal") + nv.queue_fold_kernels(D, G, "metal"))


def template_value(value, dtype: str) -> str:
    if isinstance(value, str):  # a dtype name: the template's T
        return METAL_TYPES[nv.CUDA_TYPES[value]]
    return str(int(value)) if not isinstance(value, bool) else str(value).lower()


def buffer_args(kernel: nv.Kernel, dtype: str = "float16") -> List[str]:
    """The arguments metal_kernel binds as buffers, in order: inputs, their
    ``_shape`` / ``_strides`` / ``_ndim`` that the body names, outputs."""
    args = [f"  const {'constant' if n in CONSTANT_INPUTS else 'device'} "
            f"{METAL_TYPES[nv.ctype(n, kernel, dtype)]}* {n}" for n in kernel.inputs]
    for n in kernel.inputs:
        for suffix, t in (("shape", "const constant int*"), ("strides", "const constant int64_t*"),
                          ("ndim", "const constant int&")):
            if f"{n}_{suffix}" in kernel.body:
                args.append(f"  {t} {n}_{suffix}")
    return args + [f"  device {METAL_TYPES[nv.ctype(n, kernel, dtype)]}* {n}"
                   for n in kernel.outputs]


def wrap(kernel: nv.Kernel, dtype: str, func: str) -> str:
    """One variant as metal_kernel writes it, in a namespace of its own."""
    tmpl = kernel.template(dtype)
    params = ", ".join(("typename " if isinstance(v, str) else
                        "bool " if isinstance(v, bool) else "int ") + n for n, v in tmpl)
    args = buffer_args(kernel, dtype)
    args += [f"  {t} {a} [[{a}]]" for a, t in ATTRIBUTES.items() if a in kernel.body]
    values = ", ".join(template_value(v, dtype) for _, v in tmpl)
    return (f"namespace {func} {{\n{kernel.header}\n"
            + (f"template <{params}>\n" if tmpl else "")
            + f"[[kernel]] void {func}(\n" + ",\n".join(args) + ") {\n"
            + kernel.body + "\n}\n"
            + (f"template decltype({func}<{values}>) {func}<{values}>;\n" if tmpl else "")
            + f"}}  // namespace {func}\n")


MIN_CLANG = 17  # __bf16 and _Float16 arithmetic on x86-64


@lru_cache(maxsize=None)
def find_cxx(preferred: str = "") -> str:
    """A clang++ of at least MIN_CLANG (``preferred`` first), or ''."""
    for name in filter(None, (preferred, "clang++", "/opt/swift/usr/bin/clang++")):
        path = shutil.which(name) or (name if os.path.exists(name) else None)
        if path and clang_major(path) >= MIN_CLANG:
            return path
    return ""


def clang_major(cxx: str) -> int:
    """clang's major version, 0 if ``cxx`` is not clang."""
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return 0
    m = re.search(r"clang version (\d+)", out)
    return int(m[1]) if m else 0


def check(cxx: str, programs: List[tuple]) -> List[tuple]:
    """(tag, its error lines) of each program clang rejects: one file for all
    of them, errors traced to a program by their line numbers."""
    text = PRELUDE + "".join(src for _, src in programs)
    with tempfile.NamedTemporaryFile("w", suffix=".cpp", delete=False) as f:
        f.write(text)
    try:
        res = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-ferror-limit=0",
                              "-Wno-unknown-attributes", "-Wno-macro-redefined", f.name],
                             capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if res.returncode == 0:
        return []
    starts, line = [], PRELUDE.count("\n") + 1
    for _, src in programs:
        starts.append(line)
        line += src.count("\n")
    errors = {}
    for m in re.finditer(r"^.*?:(\d+):\d+: (?:fatal )?error: .*$", res.stderr, re.M):
        k = bisect.bisect_right(starts, int(m[1])) - 1
        tag = programs[k][0] if k >= 0 else "the prelude"
        errors.setdefault(tag, []).append(m[0].replace(f.name, "<metal>"))
    if not errors:  # clang failed without a located error: report its output
        return [("all variants together", res.stderr.replace(f.name, "<metal>")[:4000])]
    return [(tag, "\n".join(lines[:10])) for tag, lines in errors.items()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    nv.add_variant_args(p, "check")
    p.add_argument("--dump", help="write the combined program to this file")
    p.add_argument("--cxx", default="", help="clang++ to use (default: on PATH)")
    args = p.parse_args()
    cxx = find_cxx(args.cxx)
    if not cxx:
        print(f"no clang++ of version >= {MIN_CLANG} found (pass --cxx)", file=sys.stderr)
        return 2
    D, G, HK, L = (int(x) for x in args.shape.split(","))
    programs = []
    for kernel in kernels(D, G, HK, L):
        if args.only not in kernel.label:
            continue
        for dtype in args.dtypes.split(","):
            func = f"h2o_metal_{len(programs)}"
            programs.append((f"{kernel.label} T={dtype}", wrap(kernel, dtype, func)))
    if not programs:
        print(f"no variant label contains {args.only!r}", file=sys.stderr)
        return 1
    if args.dump:
        with open(args.dump, "w") as f:
            f.write(PRELUDE + "".join(src for _, src in programs))
    t0 = time.time()
    failed = check(cxx, programs)
    for tag, err in failed:
        print(f"FAIL  {tag}\n{err}")
    print(f"{len(programs)} Metal variants (D,G,HK,L={args.shape}), {cxx}: "
          f"{len(programs) - len(failed)} OK, {len(failed)} failed ({time.time() - t0:.0f}s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
