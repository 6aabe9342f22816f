"""Run Metal kernel text on the CPU: a small SIMT emulator for tests.

No Apple GPU is here, so the Metal twins never ran (docs/GUIDE.md,
"Backends: CPU, CUDA, Metal"). ``EmulatedKernel`` stands in for ``mx.fast.metal_kernel``: it wraps
the kernel's header and body as MLX's metal_kernel does (template
parameters, inputs with ``_shape`` / ``_strides`` / ``_ndim``, outputs, the
thread attributes the body names), compiles that as C++20 with clang into a
shared library, and runs every threadgroup with one fiber (ucontext) per
Metal thread on one OS thread: ``threadgroup`` memory is shared by the
group, ``threadgroup_barrier`` waits for the group, and ``simd_shuffle(_xor)``
exchanges values among the 32 threads of a SIMD group through a barrier.
A thread runs until it waits at a barrier or returns; threadgroups run one
after another. A launch fails when every live thread waits at a barrier
that cannot complete, or when a SIMD shuffle runs without every lane of its
group (divergent control flow).

So the Metal prelude and the shared body run as Metal would run them, up to
what the emulator does not model: Metal's own arithmetic (``precise::exp``
is ``std::exp``; half is clang's ``_Float16``, bfloat16 a round-to-nearest-
even struct), memory ordering and races beyond barrier points, and speed.

Inputs that a kernel reads with their strides (``ensure_row_contiguous`` off
and ``NAME_strides`` in the body) are handed over in the layout ``layout``
names: row-contiguous, rows padded with NaN (the row strides must be used),
or the last axis transposed (the element-by-element path).
"""

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))

from metal_check import ATTRIBUTES, MSL_VALUES, find_cxx  # noqa: E402
from mlx_h2o.kernels.build import METAL_BUFFERS  # noqa: E402

PRELUDE = r"""
#if defined(__APPLE__)
#define _XOPEN_SOURCE 700  // macOS keeps the ucontext calls behind it (not run there)
#endif
#include <ucontext.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <vector>
#define __METAL_VERSION__ 310
typedef unsigned int uint;
typedef unsigned short ushort;
typedef _Float16 half;
typedef half float16_t;
// bfloat16 as bits with float conversions (round to nearest even), as MLX's
// Metal headers define it where Metal has no bfloat type.
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    bits = (u & 0x7fffffffu) > 0x7f800000u ? uint16_t((u >> 16) | 0x40u)
                                           : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  operator float() const {
    const uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
""" + MSL_VALUES + r"""

// 1: a barrier some live thread can never reach (every live thread waits);
// 2: a SIMD shuffle without every lane of its SIMD group.
static int h2o_failed = 0;
static long h2o_progress = 0;  // barriers completed and threads finished
void h2o_yield();

// A barrier of cooperative threads; a returned thread no longer counts.
// ``simd``: every lane must take part (a SIMD shuffle), else failure 2.
struct H2OBarrier {
  int expected;
  const int full;
  const bool simd;
  int arrived = 0;
  long gen = 0;
  H2OBarrier(int n, bool simd_) : expected(n), full(n), simd(simd_) {}
  void wait() {
    if (h2o_failed) return;
    if (simd && expected < full) {
      h2o_failed = 2;
      return;
    }
    const long g = gen;
    if (++arrived >= expected) {
      arrived = 0;
      ++gen;
      ++h2o_progress;
      return;
    }
    while (gen == g && !h2o_failed) h2o_yield();
  }
  void drop() {
    --expected;
    if (simd && arrived > 0) {
      h2o_failed = 2;
    } else if (arrived > 0 && arrived >= expected) {
      arrived = 0;
      ++gen;
      ++h2o_progress;
    }
  }
};

struct H2OSimd {
  H2OBarrier bar;
  alignas(16) unsigned char slot[32][16];
  explicit H2OSimd(int lanes) : bar(lanes, true) {}
};

struct H2OGroup {
  H2OBarrier bar;
  std::deque<H2OSimd> simd;
  explicit H2OGroup(int n) : bar(n, false) {
    for (int w = 0; w < (n + 31) / 32; ++w) simd.emplace_back(n - 32 * w < 32 ? n - 32 * w : 32);
  }
};

// Metal threads as fibers of one OS thread: each runs until it waits at a
// barrier or returns; the scheduler resumes them in turn.
static H2OGroup* h2o_group;
static int h2o_lane;
static int h2o_warp;
static int h2o_cur;
static ucontext_t h2o_main;
static std::vector<ucontext_t> h2o_ctx;

void h2o_yield() {
  const int me = h2o_cur;
  swapcontext(&h2o_ctx[me], &h2o_main);
}

namespace metal {
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
inline void threadgroup_barrier(mem_flags) { h2o_group->bar.wait(); }
template <typename T>
T simd_shuffle(T x, ushort src) {
  static_assert(sizeof(T) <= 16, "simd_shuffle of a wide type");
  H2OSimd& s = h2o_group->simd[h2o_warp];
  std::memcpy(s.slot[h2o_lane], &x, sizeof(T));
  s.bar.wait();
  T y;
  std::memcpy(&y, s.slot[src & 31], sizeof(T));
  s.bar.wait();
  return y;
}
template <typename T>
T simd_shuffle_xor(T x, ushort mask) { return simd_shuffle(x, ushort(h2o_lane ^ mask)); }
template <typename T> T min(T a, T b) { return a < b ? a : b; }
template <typename T> T max(T a, T b) { return a > b ? a : b; }
inline float fabs(float x) { return std::fabs(x); }
inline float fmax(float a, float b) { return std::fmax(a, b); }
inline float fmin(float a, float b) { return std::fmin(a, b); }
inline float round(float x) { return std::round(x); }
inline float floor(float x) { return std::floor(x); }
namespace precise {
inline float exp(float x) { return std::exp(x); }
inline float log(float x) { return std::log(x); }
inline float divide(float a, float b) { return a / b; }
}  // namespace precise
}  // namespace metal
using metal::threadgroup_barrier;

struct H2OIds {
  uint3 thread_position_in_grid, thread_position_in_threadgroup,
      threadgroup_position_in_grid, threadgroups_per_grid, threads_per_threadgroup;
  uint thread_index_in_simdgroup, simdgroup_index_in_threadgroup,
      thread_index_in_threadgroup, threads_per_simdgroup, simdgroups_per_threadgroup;
};

// Every threadgroup of the grid (grid counts threads, as metal_kernel's does),
// one after another.
static const std::function<void(const H2OIds&)>* h2o_fn;
static uint3 h2o_size, h2o_groups, h2o_at;
static std::vector<char> h2o_done;

static void h2o_entry() {
  const int t = h2o_cur;
  H2OIds id;
  const uint3 size = h2o_size;
  id.thread_position_in_threadgroup = {uint(t) % size.x, uint(t) / size.x % size.y,
                                       uint(t) / (size.x * size.y)};
  id.threadgroup_position_in_grid = h2o_at;
  id.threadgroups_per_grid = h2o_groups;
  id.threads_per_threadgroup = size;
  id.thread_position_in_grid = {h2o_at.x * size.x + id.thread_position_in_threadgroup.x,
                                h2o_at.y * size.y + id.thread_position_in_threadgroup.y,
                                h2o_at.z * size.z + id.thread_position_in_threadgroup.z};
  id.thread_index_in_simdgroup = uint(t % 32);
  id.simdgroup_index_in_threadgroup = uint(t / 32);
  id.thread_index_in_threadgroup = uint(t);
  id.threads_per_simdgroup = 32;
  id.simdgroups_per_threadgroup = uint(h2o_group->simd.size());
  (*h2o_fn)(id);
  h2o_group->bar.drop();
  h2o_group->simd[t / 32].bar.drop();
  h2o_done[t] = 1;
  ++h2o_progress;
}  // returns to h2o_main (uc_link)

static int h2o_run(const int* grid, const int* tg, const std::function<void(const H2OIds&)>& fn) {
  constexpr size_t STACK = 256 * 1024;
  h2o_failed = 0;
  h2o_fn = &fn;
  h2o_size = {uint(tg[0]), uint(tg[1]), uint(tg[2])};
  h2o_groups = {uint((grid[0] + tg[0] - 1) / tg[0]), uint((grid[1] + tg[1] - 1) / tg[1]),
                uint((grid[2] + tg[2] - 1) / tg[2])};
  const int n = tg[0] * tg[1] * tg[2];
  std::vector<char> stacks(STACK * n);
  h2o_ctx.assign(n, ucontext_t{});
  h2o_done.assign(n, 0);
  for (uint gz = 0; gz < h2o_groups.z && !h2o_failed; ++gz)
    for (uint gy = 0; gy < h2o_groups.y && !h2o_failed; ++gy)
      for (uint gx = 0; gx < h2o_groups.x && !h2o_failed; ++gx) {
        H2OGroup group(n);
        h2o_group = &group;
        h2o_at = {gx, gy, gz};
        for (int t = 0; t < n; ++t) {
          getcontext(&h2o_ctx[t]);
          h2o_ctx[t].uc_stack.ss_sp = stacks.data() + STACK * t;
          h2o_ctx[t].uc_stack.ss_size = STACK;
          h2o_ctx[t].uc_link = &h2o_main;
          makecontext(&h2o_ctx[t], h2o_entry, 0);
          h2o_done[t] = 0;
        }
        int live = n;
        while (live > 0 && !h2o_failed) {
          const long before = h2o_progress;
          for (int t = 0; t < n && !h2o_failed; ++t) {
            if (h2o_done[t]) continue;
            h2o_cur = t;
            h2o_lane = t % 32;
            h2o_warp = t / 32;
            swapcontext(&h2o_main, &h2o_ctx[t]);
            live -= h2o_done[t];
          }
          if (h2o_progress == before && live > 0 && !h2o_failed) h2o_failed = 1;
        }
      }
  return h2o_failed;
}

// Metal's address spaces last (after the C++ headers): one address space here;
// threadgroup arrays are shared by the threads of the group running now.
#define device
#define constant
#define thread
#define threadgroup static
"""

# Apple GPUs' threadgroup memory a threadgroup may use (MTLDevice
# maxThreadgroupMemoryLength): a kernel over it would not launch there.
METAL_THREADGROUP_BYTES = 32 * 1024

C_TYPES = {mx.float16: "float16_t", mx.bfloat16: "bfloat16_t", mx.float32: "float",
           mx.int32: "int32_t", mx.uint32: "uint32_t", mx.bool_: "bool"}
NP_TYPES = {mx.float16: np.float16, mx.bfloat16: np.uint16, mx.float32: np.float32,
            mx.int32: np.int32, mx.uint32: np.uint32, mx.bool_: np.bool_}
LAYOUTS = ("contiguous", "padded", "transposed")


def _to_np(x: mx.array, layout: str) -> np.ndarray:
    """``x`` as numpy (bfloat16 as its uint16 bits), stored as ``layout`` says."""
    a = np.array(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x)
    if a.ndim < 2 or layout == "contiguous":
        return np.ascontiguousarray(a)
    if layout == "padded":  # rows of the last axis 8 elements longer, NaN there
        big = np.zeros(a.shape[:-1] + (a.shape[-1] + 8,), a.dtype)
        if a.dtype.kind == "f":
            big[...] = np.nan
        elif a.dtype == np.uint16:  # bfloat16 NaN
            big[...] = 0x7FC0
        big[..., : a.shape[-1]] = a
        return big[..., : a.shape[-1]]
    return np.ascontiguousarray(np.swapaxes(a, -1, -2)).swapaxes(-1, -2)  # transposed


def _threadgroup_bytes(so: str) -> Optional[int]:
    """The kernel's threadgroup memory: its ``threadgroup`` arrays are static
    locals of h2o_kernel here (nm's sizes); None without nm."""
    nm = shutil.which("nm") or shutil.which("llvm-nm")
    if nm is None:
        return None
    res = subprocess.run([nm, "-S", "-C", so], capture_output=True, text=True)
    total = 0
    for line in res.stdout.splitlines():
        parts = line.split(maxsplit=3)
        if len(parts) == 4 and parts[3].startswith(("h2o_kernel<", "h2o_kernel(")) \
                and ")::" in parts[3]:
            total += int(parts[1], 16)
    return total


class EmulatedKernel:
    """A stand-in for ``mx.fast.metal_kernel(...)`` that runs on the CPU."""

    _libs: Dict[str, ctypes.CDLL] = {}

    def __init__(self, name: str, input_names: List[str], output_names: List[str],
                 source: str, header: str = "", ensure_row_contiguous: bool = True,
                 atomic_outputs: bool = False, layout: str = "contiguous"):
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r}: use one of {LAYOUTS}")
        self.name, self.inputs, self.outputs = name, list(input_names), list(output_names)
        self.source, self.header = source, header
        self.layout = "contiguous" if ensure_row_contiguous else layout
        self.attrs = [a for a in ATTRIBUTES if a in source]

    def _program(self, template, in_dtypes, out_dtypes) -> str:
        params, values = [], []
        for n, v in template:
            if isinstance(v, mx.Dtype):
                params.append(f"typename {n}")
                values.append(C_TYPES[v])
            else:
                params.append(f"{'bool' if isinstance(v, bool) else 'int'} {n}")
                values.append(str(v).lower() if isinstance(v, bool) else str(int(v)))
        args, calls, i = [], [], 0
        for n, dt in zip(self.inputs, in_dtypes):
            args.append(f"const {C_TYPES[dt]}* {n}")
            calls.append(f"(const {C_TYPES[dt]}*)a[{i}]")
            for k, (suffix, t) in enumerate((("shape", "const int*"),
                                             ("strides", "const int64_t*"))):
                if f"{n}_{suffix}" in self.source:
                    args.append(f"{t} {n}_{suffix}")
                    calls.append(f"({t})a[{i + 1 + k}]")
            if f"{n}_ndim" in self.source:
                args.append(f"const int& {n}_ndim")
                calls.append(f"*(const int*)a[{i + 3}]")
            i += 4
        for n, dt in zip(self.outputs, out_dtypes):
            args.append(f"{C_TYPES[dt]}* {n}")
            calls.append(f"({C_TYPES[dt]}*)a[{i}]")
            i += 1
        args += [f"{ATTRIBUTES[a]} {a}" for a in self.attrs]
        calls += [f"id.{a}" for a in self.attrs]
        tmpl = f"template <{', '.join(params)}>\n" if params else ""
        inst = f"<{', '.join(values)}>" if params else ""
        return (PRELUDE + self.header + "\n" + tmpl + "void h2o_kernel(\n  "
                + ",\n  ".join(args) + ") {\n" + self.source + "\n}\n"
                + 'extern "C" int h2o_launch(void** a, const int* grid, const int* tg) {\n'
                + "  return h2o_run(grid, tg, [&](const H2OIds& id) {\n"
                + f"    h2o_kernel{inst}(" + ", ".join(calls) + ");\n  });\n}\n")

    def _library(self, program: str) -> ctypes.CDLL:
        key = hashlib.sha1(program.encode()).hexdigest()[:16]
        lib = self._libs.get(key)
        if lib is None:
            cxx = find_cxx()
            if not cxx:
                raise RuntimeError("no clang++ to build the Metal emulation")
            with tempfile.TemporaryDirectory(prefix="h2o_metal_emu_") as d:
                src, so = os.path.join(d, "k.cpp"), os.path.join(d, "k.so")
                with open(src, "w") as f:
                    f.write(program)
                res = subprocess.run([cxx, "-std=c++20", "-O1", "-shared", "-fPIC",
                                      "-Wno-unknown-attributes", "-o", so, src],
                                     capture_output=True, text=True)
                if res.returncode:
                    raise RuntimeError(f"{self.name}: the emulated Metal kernel did not "
                                       "build:\n" + res.stderr[:4000])
                lib = ctypes.CDLL(so)  # mapped: the file may go with the directory
                lib.h2o_launch.restype = ctypes.c_int
                lib.threadgroup_bytes = _threadgroup_bytes(so)
            self._libs[key] = lib
        return lib

    def buffers(self, inputs, n_outputs: int) -> int:
        """Buffer indices metal_kernel binds for this launch: each input, its
        ``_shape`` / ``_strides`` / ``_ndim`` the body names (not for 0-d
        inputs), each output (mlx/backend/metal/custom_kernel.cpp)."""
        extra = sum(f"{n}_{s}" in self.source for n, x in zip(self.inputs, inputs)
                    if x.ndim > 0 for s in ("shape", "strides", "ndim"))
        return len(inputs) + extra + n_outputs

    def __call__(self, inputs, template=(), grid=(1, 1, 1), threadgroup=(1, 1, 1),
                 output_shapes=(), output_dtypes=(), init_value: Optional[float] = None,
                 verbose: bool = False, stream=None) -> List[mx.array]:
        if len(inputs) != len(self.inputs):
            raise ValueError(f"{self.name}: {len(inputs)} inputs for {self.inputs}")
        keep, ptrs = [], []
        for name, x in zip(self.inputs, inputs):
            # Only inputs whose strides the kernel reads may come strided (a
            # launch's fresh outputs, read as contiguous, always are).
            strided = x.ndim >= 2 and f"{name}_strides" in self.source
            a = _to_np(x, self.layout if strided else "contiguous")
            shape = np.array(a.shape, np.int32)
            strides = np.array([s // a.itemsize for s in a.strides], np.int64)
            ndim = np.array([a.ndim], np.int32)
            keep += [a, shape, strides, ndim]
            ptrs += [a.ctypes.data, shape.ctypes.data, strides.ctypes.data, ndim.ctypes.data]
        outs = []
        for shape, dt in zip(output_shapes, output_dtypes):
            o = np.zeros(shape, NP_TYPES[dt])
            if init_value is not None:
                fill = mx.array([init_value]).astype(dt)  # as MLX converts it
                o[...] = np.array(fill.view(mx.uint16) if dt == mx.bfloat16 else fill)[0]
            outs.append(o)
            ptrs.append(o.ctypes.data)
        buffers = self.buffers(inputs, len(output_dtypes))
        if buffers > METAL_BUFFERS:
            raise RuntimeError(f"{self.name}: binds {buffers} buffers, more than Metal's "
                               f"{METAL_BUFFERS} (its argument table)")
        program = self._program(template, [x.dtype for x in inputs], list(output_dtypes))
        lib = self._library(program)
        if lib.threadgroup_bytes is not None and lib.threadgroup_bytes > METAL_THREADGROUP_BYTES:
            raise RuntimeError(f"{self.name}: {lib.threadgroup_bytes} bytes of threadgroup memory, "
                               f"more than Metal's {METAL_THREADGROUP_BYTES}")
        argv = (ctypes.c_void_p * len(ptrs))(*ptrs)
        dims = [(ctypes.c_int * 3)(*v) for v in (grid, threadgroup)]
        failed = lib.h2o_launch(argv, dims[0], dims[1])
        if failed:
            what = ("a SIMD shuffle without every lane of its SIMD group" if failed == 2 else
                    "every live thread waits at a barrier that cannot complete")
            raise RuntimeError(f"{self.name}: {what} (divergent control flow)")
        return [mx.array(o).view(mx.bfloat16) if dt == mx.bfloat16 else mx.array(o)
                for o, dt in zip(outs, output_dtypes)]
