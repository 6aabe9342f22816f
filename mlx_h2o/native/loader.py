"""Build ``replay.cpp`` once per machine and load it.

The module links the installed MLX's ``libmlx`` and is compiled against its
headers (both ship in MLX's wheels) with nanobind in MLX's nanobind domain,
so it takes and returns ``mx.array`` objects. It must use the nanobind
version MLX was built with (3.1.0 for mlx 0.32.4); ``load()`` checks that an
``mx.array`` round-trips and returns None otherwise, as it does where a C++
compiler, Python's headers or nanobind are missing. The build (~1 min on 2
cores) goes to ``cache_dir()`` under a digest of everything it depends on,
written atomically; later processes load it in milliseconds. Run on Linux
x86-64 (g++, CPU and CUDA MLX); the macOS link line was never run.
"""

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path
from typing import List, Optional

import mlx.core as mx

CACHE_ENV = "MLX_H2O_NATIVE_CACHE"  # a directory; "0" turns the native helper off
SOURCE = Path(__file__).with_name("replay.cpp")
MODULE = "_replay"


def build_cache(env: str, name: str) -> Optional[Path]:
    """Where artefacts built once per machine for this MLX version go:
    ``$env`` if set (``"0"``: None, the feature is off), else
    ``~/.cache/mlx_h2o/<name>``; then the MLX version."""
    value = os.environ.get(env)
    if value == "0":
        return None
    try:
        root = Path(value) if value else Path.home() / ".cache" / "mlx_h2o" / name
    except RuntimeError:  # no home directory to find
        return None
    return root / mx.__version__


def cache_dir() -> Optional[Path]:
    """Where built modules are kept (None: the native helper is off)."""
    return build_cache(CACHE_ENV, "native")


def _mlx_dir() -> Path:
    return Path(sys.modules["mlx.core"].__file__).parent


def _toolchain():
    """(compiler, nanobind dir, include dirs, libmlx path) or a reason string."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        return "no C++ compiler (set CXX)"
    try:
        import nanobind
    except ImportError:
        return "nanobind is not installed (pip install 'mlx-h2o[native]')"
    mlx_dir = _mlx_dir()
    libs = sorted((mlx_dir / "lib").glob("libmlx.*"))
    py_inc = sysconfig.get_paths()["include"]
    if not libs or not (mlx_dir / "include" / "mlx" / "array.h").exists():
        return f"MLX's headers or libmlx are not under {mlx_dir}"
    if not Path(py_inc, "Python.h").exists():
        return f"Python's headers are missing ({py_inc}/Python.h)"
    nb_dir = Path(nanobind.__file__).parent
    includes = [py_inc, str(nb_dir / "include"), str(nb_dir / "ext" / "robin_map" / "include"),
                str(mlx_dir / "include")]
    return cxx, nb_dir, includes, libs[0]


def _digest(cxx: str, nb_dir: Path, libmlx: Path) -> str:
    import nanobind

    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    stat = libmlx.stat()
    parts = [SOURCE.read_bytes().hex(), mx.__version__, str(libmlx), str(stat.st_size),
             str(int(stat.st_mtime)), sys.version, nanobind.__version__, version,
             importlib.machinery.EXTENSION_SUFFIXES[0]]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _compile(cxx: str, nb_dir: Path, includes: List[str], libmlx: Path, out: Path) -> None:
    """nanobind's documented build without CMake (src/nb_combined.cpp), the
    module in MLX's nanobind domain, linked to libmlx (rpath to its folder)."""
    flags = ["-std=c++20", "-fPIC", "-fvisibility=hidden", "-DNDEBUG", "-DNB_COMPACT_ASSERTIONS",
             "-DNB_DOMAIN=mlx"] + [f"-I{d}" for d in includes]
    work = out.parent
    nb_obj, mod_obj = work / "nanobind.o", work / "replay.o"
    jobs = [
        [cxx, str(nb_dir / "src" / "nb_combined.cpp"), *flags, "-O2", "-fno-strict-aliasing",
         "-ffunction-sections", "-fdata-sections", "-c", "-o", str(nb_obj)],
        [cxx, str(SOURCE), *flags, "-O2", "-c", "-o", str(mod_obj)],
    ]
    procs = [subprocess.Popen(j, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for j in jobs]
    logs = [p.communicate()[0].decode(errors="replace") for p in procs]
    for p, log in zip(procs, logs):
        if p.returncode != 0:
            raise RuntimeError(f"compile failed:\n{log[-2000:]}")
    link = [cxx, "-shared", str(mod_obj), str(nb_obj), "-o", str(out), str(libmlx),
            f"-Wl,-rpath,{libmlx.parent}"]
    # Python's symbols come from the interpreter that loads the module.
    link += ["-undefined", "dynamic_lookup"] if sys.platform == "darwin" else ["-Wl,--gc-sections"]
    res = subprocess.run(link, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"link failed:\n{res.stderr[-2000:]}")


def build(verbose: bool = False) -> Path:
    """The built module's path (building it if needed); raises on failure."""
    root = cache_dir()
    if root is None:
        raise RuntimeError(f"the native helper is off ({CACHE_ENV}=0)")
    tools = _toolchain()
    if isinstance(tools, str):
        raise RuntimeError(tools)
    cxx, nb_dir, includes, libmlx = tools
    path = root / _digest(cxx, nb_dir, libmlx) / (MODULE + importlib.machinery.EXTENSION_SUFFIXES[0])
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    if verbose:
        print(f"mlx_h2o: building the native replay helper once for this machine -> {path}",
              file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=path.parent) as work:
        tmp = Path(work) / path.name
        _compile(cxx, nb_dir, includes, libmlx, tmp)
        os.replace(tmp, path)  # atomic: a concurrent build wins or loses whole
    return path


@lru_cache(maxsize=1)
def load():
    """The ``_replay`` module, built if needed, or None: quietly where it is
    turned off or nanobind (the ``native`` extra) is not installed, with a
    warning saying why where a build or its self-test fails."""
    if cache_dir() is None or importlib.util.find_spec("nanobind") is None:
        return None
    try:
        path = build(verbose=True)
        spec = importlib.util.spec_from_file_location(MODULE, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _self_test(module)
    except Exception as e:  # any failure: callers keep mx.compile
        warnings.warn(f"mlx_h2o native replay unavailable, using mx.compile: {e}", stacklevel=2)
        return None
    return module


def _self_test(module) -> None:
    """An mx.array must cross into the module and back (same nanobind ABI)."""
    x = mx.array([1.0, 2.0])
    y = x * 2 + 1
    tape = module.record([x], [y])
    z = mx.array([3.0, 4.0])
    (got,) = tape(z)
    if not isinstance(got, mx.array) or got.tolist() != [7.0, 9.0]:
        raise RuntimeError(f"self-test replay gave {got!r}, want [7, 9]")
