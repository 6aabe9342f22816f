"""CUDA kernels built once per machine: cubins on disk, launched precompiled.

MLX 0.32.4 builds every ``mx.fast.cuda_kernel`` with NVRTC in every process
(its PTX disk cache holds only MLX's own kernels): ~1.2-1.5 s a kernel at
first use, e.g. a ~4 s pause at a process's first queue fold (docs/RESULTS.md).
``PrecompiledKernel`` takes the same arguments as such a
kernel object. It compiles the kernel's whole program (header, template
constants as ``constexpr``, body) with the NVRTC library MLX loaded, for
this GPU, keeps the cubin under ``cache_dir()`` named by a digest of the
program, the architecture and NVRTC's version (written atomically), and
launches it with ``mx.fast.precompiled_cuda_kernel``. That launch passes
pointers and scalars only: the shapes and strides a body reads
(``x_shape[i]``, ``x_strides[i]``) come as int scalars, so only kernels
whose inputs are made row-contiguous qualify (strides follow from
shapes). NVRTC compiles these programs in ~0.1 s each (no MLX device
headers). ``available()`` is False where NVRTC, the CUDA headers or the
driver are not found; callers then keep MLX's build.
"""

import ctypes
import hashlib
import math
import os
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path
from typing import List, Optional, Sequence

import mlx.core as mx


CACHE_ENV = "MLX_H2O_CUBIN_CACHE"  # a directory; "0" turns precompiled kernels off
CTYPES = {mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float",
          mx.int32: "int", mx.uint32: "unsigned int", mx.bool_: "bool"}
INT32_MAX = 2**31 - 1


def cache_dir() -> Optional[Path]:
    """Where cubins are kept (None: precompiled kernels are off): ``$CACHE_ENV``
    if set (``"0"``: off), else ``~/.cache/mlx_h2o/cubin``; then the MLX version."""
    value = os.environ.get(CACHE_ENV)
    if value == "0":
        return None
    try:
        root = Path(value) if value else Path.home() / ".cache" / "mlx_h2o" / "cubin"
    except RuntimeError:  # no home directory to find
        return None
    return root / mx.__version__


def _loaded(fragment: str) -> Optional[str]:
    """Path of a shared library this process has loaded (MLX loads NVRTC)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if fragment in os.path.basename(path) and os.path.isfile(path):
                    return path
    except OSError:
        pass
    return None


@lru_cache(maxsize=1)
def _nvrtc():
    path = _loaded("libnvrtc.so")
    if path is None:
        return None
    lib = ctypes.CDLL(path)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


@lru_cache(maxsize=1)
def _arch() -> Optional[str]:
    """``sm_XY`` of GPU 0 from the driver (cuDeviceGetAttribute 75 / 76)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if (cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(dev), 0)
            or cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)
            or cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)):
        return None
    return f"sm_{major.value}{minor.value}"


@lru_cache(maxsize=1)
def _includes() -> List[str]:
    """MLX's JIT include paths (jit_module.cpp): its CCCL and the CUDA headers."""
    paths = []
    libmlx = _loaded("libmlx.so")
    if libmlx:
        paths.append(os.path.join(os.path.dirname(libmlx), "..", "include", "cccl"))
    nvrtc = _loaded("libnvrtc.so")  # pip's nvidia/cu13/{lib,include}
    homes = (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda",
             nvrtc and os.path.join(os.path.dirname(nvrtc), ".."))
    for home in homes:
        if home and os.path.isfile(os.path.join(home, "include", "cuda_fp16.h")):
            paths.append(os.path.join(home, "include"))
            break
    return [p for p in paths if os.path.isdir(p)]


def available() -> bool:
    """Whether kernels can be built here (CUDA backend, NVRTC, headers, driver)."""
    return (cache_dir() is not None and mx.cuda.is_available() and _nvrtc() is not None
            and _arch() is not None and any(
                os.path.isfile(os.path.join(p, "cuda_fp16.h")) for p in _includes()))


def compile_program(source: str, func: str, arch: str) -> bytes:
    """The cubin of ``source`` (its ``extern "C"`` kernel ``func``); RuntimeError
    with NVRTC's log if it does not compile."""
    lib, prog = _nvrtc(), ctypes.c_void_p()
    opts = [f"--gpu-architecture={arch}"] + [f"--include-path={p}" for p in _includes()]
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{func}.cu".encode(),
                              0, None, None):
        raise RuntimeError(f"nvrtcCreateProgram failed for {func}")
    try:
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(
            *[o.encode() for o in opts]))
        if rc:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"{func} did not compile ({lib.nvrtcGetErrorString(rc)}):\n"
                               f"{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        out = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, out)
        return out.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def cached_cubin(source: str, func: str) -> bytes:
    """``compile_program`` once per machine: read from ``cache_dir()``, else
    compiled and written there atomically (a partial file is never read; an
    unwritable cache only costs the next process a build)."""
    arch = _arch()
    major, minor = ctypes.c_int(), ctypes.c_int()
    _nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    key = hashlib.sha256(f"{arch}\0{major.value}.{minor.value}\0{source}".encode())
    path = cache_dir() / f"{func}.{key.hexdigest()[:16]}.cubin"
    if path.is_file():
        return path.read_bytes()
    data = compile_program(source, func, arch)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
    return data


def reads(body: str, names: Sequence[str]) -> dict:
    """Input name -> whether the body reads its (shape, strides, ndim)."""
    return {n: tuple(f"{n}_{part}" in body for part in ("shape", "strides", "ndim"))
            for n in names}


def program(header: str, body: str, inputs, outputs, template) -> str:
    """The whole program of one kernel variant, function ``H2O_PRECOMPILED_FUNC``.

    ``inputs``: (name, dtype, ndim); ``outputs``: (name, dtype); ``template``:
    (name, int | bool | Dtype) as ``mx.fast.cuda_kernel`` takes them. Each
    input whose shape / strides the body reads adds ndim int parameters for
    each (after the outputs, as the precompiled launch passes scalars; the
    launch makes inputs row-contiguous, so strides follow from the shape);
    its ndim is a constant of the variant."""
    params = [f"const {CTYPES[d]}* {n}" for n, d, _ in inputs]
    params += [f"{CTYPES[d]}* {n}" for n, d in outputs]
    read, lines = reads(body, [n for n, _, _ in inputs]), []
    for n, _, nd in inputs:
        for part, ctype, used in zip(("shape", "strides"), ("int", "long long"), read[n]):
            if used:
                dims = [f"{n}_{part}{i}" for i in range(nd)]
                params += [f"int {d}" for d in dims]
                lines.append(f"  const {ctype} {n}_{part}[{nd}] = {{{', '.join(dims)}}};")
        if read[n][2]:
            lines.append(f"  constexpr int {n}_ndim = {nd};")
    lines += constants(template)
    return ("#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n" + header
            + '\nextern "C" __global__ void H2O_PRECOMPILED_FUNC(\n    ' + ",\n    ".join(params)
            + ") {\n" + "\n".join(lines) + "\n" + body + "\n}\n")


def constants(template, type_name=CTYPES.__getitem__) -> List[str]:
    """Template arguments as the lines MLX's kernel builder writes for them."""
    lines = []
    for n, v in template:
        if isinstance(v, bool):
            lines.append(f"  constexpr bool {n} = {str(v).lower()};")
        elif isinstance(v, int):
            lines.append(f"  constexpr int {n} = {v};")
        else:
            lines.append(f"  using {n} = {type_name(v)};")
    return lines


def scalars(read: dict, names: Sequence[str], inputs) -> List[int]:
    """The int parameters ``program`` adds, in its order, for these inputs
    (``read``: ``reads`` of the body)."""
    out = []
    for n, a in zip(names, inputs):
        shape, strides, _ = read[n]
        if shape:
            out += a.shape
        if strides:
            out += [math.prod(a.shape[i + 1:]) for i in range(a.ndim)]
    return out


class PrecompiledKernel:
    """Stands in for an ``mx.fast.cuda_kernel`` object built with
    ``ensure_row_contiguous=True``: each variant (template, input dtypes and
    ndims) is built once per machine (``cached_cubin``). If a build fails, a
    warning says why and MLX builds that kernel instead (``fallback``)."""

    def __init__(self, name: str, input_names: Sequence[str], output_names: Sequence[str],
                 header: str, body: str, fallback):
        self.name, self.input_names, self.output_names = name, input_names, output_names
        self.header, self.body, self.fallback = header, body, fallback
        self._reads = reads(body, input_names)  # searched once, not per launch
        self._built = {}  # variant -> (function name, cubin) or None (MLX builds it)

    def __call__(self, *, inputs, grid, threadgroup, output_shapes, output_dtypes,
                 template=(), init_value=None):
        variant = (tuple(template), tuple((a.dtype, a.ndim) for a in inputs),
                   tuple(output_dtypes))
        if variant not in self._built:
            self._built[variant] = self._build(inputs, template, output_dtypes)
        built = self._built[variant]
        if built is None:
            return self.fallback(inputs=inputs, template=list(template), grid=grid,
                                 threadgroup=threadgroup, output_shapes=output_shapes,
                                 output_dtypes=output_dtypes, init_value=init_value)
        ints = scalars(self._reads, self.input_names, inputs)
        if max(ints, default=0) > INT32_MAX:
            raise ValueError(f"{self.name}: a shape or stride above {INT32_MAX} does not "
                             f"fit an int scalar (set {CACHE_ENV}=0 to let MLX build it)")
        func, data = built
        return mx.fast.precompiled_cuda_kernel(
            name=func, compiled_source=data, inputs=inputs, output_shapes=output_shapes,
            output_dtypes=output_dtypes, scalars=ints, grid=grid, threadgroup=threadgroup,
            init_value=init_value, ensure_row_contiguous=True)

    def _build(self, inputs, template, output_dtypes):
        source = program(self.header, self.body,
                         [(n, a.dtype, a.ndim) for n, a in zip(self.input_names, inputs)],
                         list(zip(self.output_names, output_dtypes)), template)
        func = f"{self.name}_{hashlib.sha1(source.encode()).hexdigest()[:12]}"
        try:
            return func, cached_cubin(source.replace("H2O_PRECOMPILED_FUNC", func, 1), func)
        except (OSError, RuntimeError) as e:
            warnings.warn(f"{self.name}: precompiled build failed, MLX builds it in "
                          f"this process instead: {e}", RuntimeWarning, stacklevel=3)
            return None
