"""Compile every CUDA kernel variant with NVRTC on a machine without a GPU.

Catches compile errors before GPU time is spent. Each (label, header, body) of
mlx_h2o.kernels.build.all_sources("cuda") (and any other build.*_sources),
each quantized attention kernel of kernels/quantized_gpu.py and the three
kernels of kernels/queued.py (these, the folds, the K/V writes and the fused
step's passes also as kernels/cubin.py builds them to run precompiled), is wrapped as MLX
0.32.4's CUDA custom kernel builder does (mlx/backend/cuda/custom_kernel.cpp,
build_kernel), with the template constants and dtypes the launch code passes,
and compiled for sm_90 as MLX's JIT does (jit_module.cpp): MLX's device
headers, which libmlx.so embeds, handed to nvrtcCreateProgram; its CCCL and the
CUDA headers as include paths.

One-time setup (PyPI only; paths below are the defaults):
    python3 -m venv /tmp/nv && /tmp/nv/bin/pip install "nvidia-cuda-nvrtc==13.*" \\
        "nvidia-cuda-runtime==13.*" "nvidia-cuda-cccl==13.*" "nvidia-cuda-crt==13.*"
    cat .gpu/part1/mlx_cuda_13-*.whl.aa .gpu/part2/mlx_cuda_13-*.whl.ab \\
        > /tmp/mlx_cuda.whl && unzip -q -o /tmp/mlx_cuda.whl -d /tmp/mlx_cuda

Run (exit 1 if any variant fails, 2 if the toolchain is missing):
    .venv/bin/python tools/nvrtc_check.py [--only SUBSTRING] [--dtypes float16]
        [--shape D,G,HK,L] [--dump DIR] [--cubin DIR] [-v] [-j JOBS]
        [--nvrtc-lib PATH] [--libmlx PATH] [--include DIR ...]
The paths default to the setup above, or to $NVRTC_LIB, $MLX_LIB, $MLX_CCCL_DIR
and $CUDA_INCLUDE. Each compile takes ~1.5 s; NVRTC serialises compiles within
a process, so they run in -j processes (default: one per core).
"""

import argparse
import ctypes
import glob
import math
import os
import re
import struct
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Dict, List

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mlx_h2o.kernels import build, cubin, kv_write, quantized_gpu, queued  # noqa: E402
from mlx_h2o.kernels.decode import layout  # noqa: E402

_NV = next(iter(glob.glob("/tmp/nv/lib/python3*/site-packages/nvidia/cu13")),
           "/tmp/nv/cu13")
DEFAULT_NVRTC = os.environ.get("NVRTC_LIB", f"{_NV}/lib/libnvrtc.so.13")
DEFAULT_LIBMLX = os.environ.get("MLX_LIB", "/tmp/mlx_cuda/mlx/lib/libmlx.so")
DEFAULT_INCLUDES = [  # MLX's own CCCL first, as its JIT passes them
    os.environ.get("MLX_CCCL_DIR", "/tmp/mlx_cuda/mlx/include/cccl"),
    os.environ.get("CUDA_INCLUDE", f"{_NV}/include"),
]

# custom_kernel.cpp's default_header.
DEFAULT_HEADER = """
#include "mlx/backend/cuda/device/utils.cuh"

#include <cooperative_groups.h>

#define inf cuda::std::numeric_limits<float>::infinity()

"""
CUDA_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float",
              "int32": "int32_t", "uint32": "uint32_t", "bool": "bool"}
# Array dtypes by name, as the launch code passes them; any other array is T.
FLOAT32 = {"prm_f", "lay_f", "score_in", "count_in", "score_out", "count_out", "logits",
           "lse", "part_o", "part_ml", "part_lse"}
INT32 = {"prm_i", "lay_i", "slot", "pos_in", "pin", "pos_out", "victim"}
UINT32 = {"k0w", "v0w", "k1w", "v1w"}  # packed quantized words
KNOWN_KINDS = ("pass1", "pass2", "fold", "group", "pass1mma")


@dataclass
class Kernel:
    label: str
    header: str
    body: str
    inputs: List[str]
    outputs: List[str]
    template: Callable  # dtype name -> [(name, int | bool | dtype name)]
    types: Dict[str, str] = field(default_factory=dict)  # name -> C type overrides


def ctype(name: str, kernel: Kernel, dtype: str) -> str:
    if name in kernel.types:
        return kernel.types[name]
    if name in FLOAT32:
        return "float"
    if name in INT32:
        return "int32_t"
    return "uint32_t" if name in UINT32 else CUDA_TYPES[dtype]


def wrap(kernel: Kernel, dtype: str, func: str) -> str:
    """The full program text, as custom_kernel.cpp build_kernel writes it."""
    src = [DEFAULT_HEADER, kernel.header,
           "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n",
           f"__global__ void {func}(\n"]
    for n in kernel.inputs:
        src.append(f"    const {ctype(n, kernel, dtype)}* {n},\n")
        for suffix, t in (("shape", "Shape"), ("strides", "Strides"), ("ndim", "int")):
            if f"{n}_{suffix}" in kernel.body:
                src.append(f"    const __grid_constant__ {t} {n}_{suffix},\n")
    outs = (f"    {ctype(n, kernel, dtype)}* {n}" for n in kernel.outputs)
    src.append(",\n".join(outs))
    src.append(") {\n")
    src += [line + "\n" for line in cubin.constants(kernel.template(dtype),
                                                     CUDA_TYPES.__getitem__)]
    src += ["\n", kernel.body, "\n}\n\n} // namespace mlx::core::cu\n"]
    return "".join(src)


# --- the variants -------------------------------------------------------------
def _flags(label: str):
    """'pass1 mask=none sinks=False' -> ('pass1', {'mask': 'none', 'sinks': False})."""
    kind, *rest = label.split()
    conv = {"True": True, "False": False}
    kw = {}
    for item in rest:
        k, v = item.split("=", 1)
        kw[k] = conv.get(v, int(v) if v.lstrip("-").isdigit() else v)
    return kind, kw


def constants(kind: str, kw: dict, dtype: str, D: int, G: int, HK: int, L: int):
    """Template constants as decode.py / h2o_step.py / group_fold.py pass them
    (MODE 0: every MODE branch compiles anyway; NB 1). A kind this script does
    not know gets all of them (the run prints a note)."""
    if kind == "fold":  # h2o_fold_step
        return [("G", G), ("HK", HK), ("D", 1), ("MODE", 0)]
    if kind == "group":  # group_fold.GroupPlan (quantized: 4-bit codes, groups of 64)
        q = kw.get("quantized", False)
        t = [("T", dtype), ("D", D), ("G", G), ("HK", HK), ("NB", 1), ("MODE", 0),
             ("VD", 1 if q else D)]
        return t + ([("BITS", 4), ("GS", 64)] if q else [])
    fused = kw.get("fused", kind not in ("pass1", "pass2", "pass1mma"))
    L = 1 if fused else L  # the fused step has one query
    lay = layout(D, 4 if dtype == "float32" else 2, G, L)  # the automatic U and TPK
    t = [(k, dtype if k == "T" else v) for k, v in lay.template(None, D, L, G, HK)]
    if kind != "pass2":
        t.append(("MH", 1 if kw.get("mask") in ("bool", "add") else 0))
    t += [("MODE", 0)] if fused else []
    return t + ([("NB", 1)] if kind not in ("pass1", "pass2", "pass1mma") else [])


def build_kernels(D: int, G: int, HK: int, L: int, backend: str = "cuda") -> List[Kernel]:
    """Every (label, header, body) of build.*_sources(backend), with its names
    from build.KIND_names(*the label's values, in order)."""
    seen, out = set(), []
    for fname in sorted(n for n in dir(build) if n.endswith("_sources")):
        for label, header, body in getattr(build, fname)(backend):
            if label in seen:
                continue
            seen.add(label)
            kind, kw = _flags(label)
            names = getattr(build, f"{kind}_names", None)
            if names is None:
                raise SystemExit(f"{label}: no build.{kind}_names() to give its inputs")
            inputs, outputs = names(*kw.values())
            types = {"mask": "bool"} if kw.get("mask") == "bool" else {}
            if kind == "group" and kw.get("quantized"):  # packed K/V k0, k1, ...
                types.update({n: "uint32_t" for n in inputs
                              if n.startswith("k") and n[1:].isdigit()})
            if kind not in KNOWN_KINDS:
                label += " (constants guessed)"
            template = partial(constants, kind, kw, D=D, G=G, HK=HK, L=L)
            out.append(Kernel(label, header, body, inputs, outputs, template, types))
    return out


def quantized_kernels(D: int, G: int, backend: str = "cuda") -> List[Kernel]:
    """quantized_gpu's pass 1 for every flag set and its merge (4/8-bit, GS 64)."""
    scale = struct.unpack("<i", struct.pack("<f", 1 / math.sqrt(D)))[0]
    out = []
    for mask in ("none", "causal", "bool", "add"):
        mh = 1 if mask in ("bool", "add") else 0
        for sinks in (False, True):
            for two in (False, True):
                for split in (False, True):
                    src = quantized_gpu.kernel_source(backend, mask, sinks, two, split)
                    tmpl = [("D", D), ("GS", 64), ("G", G), ("B0", 4),
                            ("B1", 8 if two else 4), ("MH", mh), ("SCALE_BITS", scale)]
                    label = f"qattn mask={mask} sinks={sinks} two={two} split={split}"
                    out.append(Kernel(label, *src, lambda dt, t=tmpl: [("T", dt)] + t,
                                      {"mask": "bool"} if mask == "bool" else {}))
    for sinks in (False, True):
        src = quantized_gpu.merge_source(backend, sinks)
        out.append(Kernel(f"qmerge sinks={sinks}", *src,
                          lambda dt: [("T", dt), ("D", D)]))
    return out


def write_kernels(D: int, backend: str = "cuda") -> List[Kernel]:
    """kv_write's kernels: quantized triples (4/8-bit, GS 64) with and without
    dense outputs, packed K/V with them (IDXW 1: the quantized index)."""
    out = []
    for dense_out, packed in ((True, False), (False, False), (True, True)):
        inputs, outputs = kv_write.names(dense_out, packed)
        src = kv_write.source(backend, dense_out, packed)
        types = {"idx": "int32_t"}
        types.update({n: "uint32_t" for n in inputs + outputs
                      if n.startswith(("kw", "vw", "kv"))})
        for bits in (4, 8):
            def tmpl(dt, bits=bits):
                return [("T", dt), ("D", D), ("BITS", bits), ("GS", 64), ("IDXW", 1)]
            label = f"kvwrite dense_out={dense_out} packed={packed} bits={bits}"
            out.append(Kernel(label, *src, inputs, outputs, tmpl, types))
    return out


def queue_fold_kernels(D: int, G: int, backend: str = "cuda") -> List[Kernel]:
    """queued.py's three kernels for every tile (the merge takes no template constants)."""
    types = {"vis": "int32_t", "part": "float", "lse": "float", "lse_in": "float"}
    return [Kernel(f"qfold kind={kind} tile={nt}x{kpt}",
                   *queued.pass_source(backend, kind, (nt, kpt)), *queued.pass_names(kind),
                   (lambda dt: []) if kind == "merge" else
                   (lambda dt: [("T", dt), ("D", D), ("G", G)]), types)
            for kind in queued.KINDS for nt, kpt in queued.TILES]


# Input ndims of the kernels that run precompiled (kernels/cubin.py: build._built_once,
# and the fused step's steady launch); the group fold's per-layer queries q0.. and K
# buffers k0.. are 4-d.
def runs_precompiled(label: str) -> bool:
    return (label.startswith(("qfold", "group", "fold", "kvwrite"))
            or (label.startswith(("pass1", "pass2")) and "fused=True" in label))


PRECOMPILED_NDIM = {"q": 4, "k": 4, "v": 4, "vis": 1, "prm_f": 1, "prm_i": 1, "part": 4,
                    "lse_in": 2, "score_in": 3, "count_in": 3, "lay_i": 2, "lay_f": 2,
                    "pos_in": 3, "slot": 4, "pin": 2, "logits": 4, "lse": 3, "mask": 4,
                    "sinks": 1, "part_o": 4, "part_ml": 4,
                    **dict.fromkeys(("kn", "vn", "idx", "kw", "ks", "kb", "vw", "vs", "vb",
                                     "kv"), 4)}
MX_TYPES = {"float": "float32", "int32_t": "int32", "uint32_t": "uint32", "__half": "float16",
            "__nv_bfloat16": "bfloat16", "bool": "bool_"}


def precompiled(kernel: Kernel, dtype: str, func: str) -> str:
    """The program cubin.PrecompiledKernel builds for ``kernel`` (no MLX headers)."""
    import mlx.core as mx

    def mx_type(name):
        return getattr(mx, MX_TYPES[ctype(name, kernel, dtype)])

    tmpl = [(n, getattr(mx, v) if isinstance(v, str) else v) for n, v in kernel.template(dtype)]
    src = cubin.program(kernel.header, kernel.body,
                        [(n, mx_type(n), PRECOMPILED_NDIM[n.rstrip("0123456789")])
                         for n in kernel.inputs],
                        [(n, mx_type(n)) for n in kernel.outputs], tmpl)
    return src.replace("H2O_PRECOMPILED_FUNC", func, 1)


# --- MLX's JIT headers ----------------------------------------------------------
def mlx_jit_headers(libmlx: str) -> dict:
    """{include name: text} of the device headers libmlx.so hands to NVRTC
    (jit_module.cpp g_include_names / g_headers: two arrays of string pointers,
    found through their R_X86_64_RELATIVE relocations)."""
    data = open(libmlx, "rb").read()
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    secs = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
            for i in range(shnum)]

    def cstr(vaddr):
        for _, typ, _, addr, off, size in secs:
            if typ != 8 and addr and addr <= vaddr < addr + size:  # not NOBITS
                o = vaddr - addr + off
                return data[o:data.index(b"\0", o)]
        return b""

    relocs = sorted(
        struct.unpack_from("<QQq", data, o)[::2]
        for _, typ, _, _, off, size in secs if typ == 4  # SHT_RELA
        for o in range(off, off + size, 24)
        if struct.unpack_from("<Q", data, o + 8)[0] & 0xFFFFFFFF == 8)
    prefix = b"mlx/backend/cuda/device/"
    first = next(i for i, (_, a) in enumerate(relocs) if cstr(a).startswith(prefix))
    n = 0
    while (first + n < len(relocs) and cstr(relocs[first + n][1]).startswith(prefix)
           and relocs[first + n][0] == relocs[first][0] + 8 * n):
        n += 1
    texts = relocs[first - n:first]  # g_headers sits just before g_include_names
    if any(texts[i][0] != texts[0][0] + 8 * i for i in range(n)):
        raise ValueError("header text array not found")
    return {cstr(relocs[first + i][1]).decode(): cstr(texts[i][1]) for i in range(n)}


# --- NVRTC through ctypes ----------------------------------------------------------
class NVRTC:
    def __init__(self, path: str, headers: dict, options: List[str]):
        self.lib = ctypes.CDLL(path)
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        self.names = list(headers)
        self.texts = [headers[n] for n in self.names]
        self.options = options

    def version(self) -> str:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        return f"{major.value}.{minor.value}"

    def _check(self, rc, what):
        if rc:
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(rc).decode()}")

    def compile(self, source: str, name: str, kernel: str):
        """(ok, log, cubin) of one program; `kernel` must name its __global__
        function."""
        def arr(items):
            return (ctypes.c_char_p * len(items))(*[
                s if isinstance(s, bytes) else s.encode() for s in items])
        lib, prog = self.lib, ctypes.c_void_p()
        self._check(lib.nvrtcCreateProgram(
            ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), len(self.names),
            arr(self.texts), arr(self.names)), "nvrtcCreateProgram")
        try:
            lib.nvrtcAddNameExpression(prog, kernel.encode())
            rc = lib.nvrtcCompileProgram(prog, len(self.options), arr(self.options))
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            lib.nvrtcGetProgramLog(prog, log)
            if rc:
                return False, log.value.decode(errors="replace"), b""
            lowered = ctypes.c_char_p()
            rc = lib.nvrtcGetLoweredName(prog, kernel.encode(), ctypes.byref(lowered))
            self._check(rc, "nvrtcGetLoweredName")
            rc = lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
            self._check(rc, "nvrtcGetCUBINSize")
            cubin = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            return True, log.value.decode(errors="replace"), cubin.raw
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def errors(log: str) -> str:
    """The error messages of a compile log (its warnings left out)."""
    blocks = log.strip().split("\n\n")
    return "\n\n".join(b for b in blocks if "error" in b)


def ptxas_summary(log: str) -> str:
    """'regs=N stack=F spill=S/L smem=B' from ptxas -v lines, or ''."""
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                      r"(\d+) bytes spill loads", log)
    smem = re.search(r"(\d+) bytes smem", log)
    parts = [f"regs={regs[1]}"] if regs else []
    parts += [f"stack={spill[1]} spill={spill[2]}/{spill[3]}"] if spill else []
    parts += [f"smem={smem[1]}"] if smem else []
    return " ".join(parts)


# --- main ----------------------------------------------------------------------
_nvrtc = None  # one per worker process: NVRTC serialises compiles within a process


def _init_worker(lib: str, libmlx: str, options: List[str]):
    global _nvrtc
    _nvrtc = NVRTC(lib, mlx_jit_headers(libmlx), options)


def _compile(program):
    func, source, expr = program
    t0 = time.time()
    ok, log, cubin = _nvrtc.compile(source, func, expr)
    return ok, log, time.time() - t0, cubin


def programs(args) -> List[tuple]:
    """(tag, function name, source, name expression) of every program to compile."""
    D, G, HK, L = (int(x) for x in args.shape.split(","))
    kernels = build_kernels(D, G, HK, L) + quantized_kernels(D, G) + write_kernels(D)
    kernels += queue_fold_kernels(D, G)
    jobs = [(k, dt) for k in kernels if args.only in k.label
            for dt in args.dtypes.split(",")
            if not (k.label.startswith("pass1mma") and dt == "float32")]  # fp16 / bf16 MMA only
    out = []
    for i, (kernel, dtype) in enumerate(jobs):
        func = f"custom_kernel_h2o_check_{i}"
        out.append((f"{kernel.label} T={dtype}", func, wrap(kernel, dtype, func),
                    f"mlx::core::cu::{func}"))
        if runs_precompiled(kernel.label):  # also as it runs: precompiled
            pre = f"h2o_check_precompiled_{i}"
            out.append((f"{kernel.label} T={dtype} precompiled", pre,
                        precompiled(kernel, dtype, pre), pre))
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        for tag, func, source, _ in out:
            with open(os.path.join(args.dump, f"{func}.cu"), "w") as f:
                f.write(f"// {tag}\n{source}")
    return out


def add_variant_args(p: argparse.ArgumentParser, verb: str) -> None:
    """Which variants to check: label filter, dtypes, shape (also metal_check.py's)."""
    p.add_argument("--only", default="", help=f"{verb} only labels containing this")
    p.add_argument("--dtypes", default="float16,bfloat16,float32")
    p.add_argument("--shape", default="128,4,8,1", help="D,G,HK,L (fused kernels: L=1)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_variant_args(p, "compile")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--nvrtc-lib", default=DEFAULT_NVRTC)
    p.add_argument("--libmlx", default=DEFAULT_LIBMLX,
                   help="libmlx.so of the CUDA wheel")
    p.add_argument("--include", action="append", help="include dirs (default: MLX's "
                   "CCCL, then the CUDA headers)")
    p.add_argument("--dump", help="write each generated .cu file into this dir")
    p.add_argument("--cubin", help="write each compiled program's CUBIN into this dir "
                   "(for cuobjdump -sass)")
    p.add_argument("-v", "--verbose", action="store_true", help="print whole logs")
    p.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    args.include = args.include or DEFAULT_INCLUDES
    paths = [args.nvrtc_lib, args.libmlx, *args.include]
    missing = [x for x in paths if not os.path.exists(x)]
    if missing:
        print("missing: " + ", ".join(missing) + "\n(set up as in this script's "
              "docstring, or pass --nvrtc-lib / --libmlx / --include)", file=sys.stderr)
        return 2
    options = [f"--gpu-architecture={args.arch}", "--std=c++17", "--ptxas-options=-v"]
    options += [f"--include-path={d}" for d in args.include]
    init = (args.nvrtc_lib, args.libmlx, options)
    _init_worker(*init)
    progs = programs(args)
    if not progs:
        print(f"no variant label contains {args.only!r}", file=sys.stderr)
        return 1
    print(f"NVRTC {_nvrtc.version()}, {args.arch}, D,G,HK,L={args.shape}: "
          f"{len(progs)} programs", flush=True)

    t0, failed = time.time(), 0
    with ProcessPoolExecutor(max(1, args.jobs), initializer=_init_worker,
                             initargs=init) as pool:
        results = pool.map(_compile, [prog[1:] for prog in progs])
        for (tag, func, *_), (ok, log, dt, cubin) in zip(progs, results):
            failed += not ok
            if ok and args.cubin:  # SASS: cuobjdump -sass DIR/FUNC.cubin
                os.makedirs(args.cubin, exist_ok=True)
                with open(os.path.join(args.cubin, f"{func}.cubin"), "wb") as f:
                    f.write(cubin)
            print(f"OK    {tag}  {ptxas_summary(log)} {dt:.1f}s" if ok
                  else f"FAIL  {tag}  ({func}.cu)", flush=True)
            if args.verbose or not ok:
                print(log.rstrip() if args.verbose else errors(log), flush=True)
    print(f"{len(progs)} programs: {len(progs) - failed} OK, {failed} failed "
          f"({time.time() - t0:.0f}s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
