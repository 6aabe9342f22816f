"""Use Debian's OpenBLAS under the mlx-cpu wheel (which links reference BLAS).

Measured on a 2-core x86-64 CPU: float32 matmul ~30x faster, Gemma 3 270M
prefill 11 -> 300 tok/s and decode 4 -> 10 tok/s. The CLI re-executes itself
once with LD_PRELOAD; the library never does this on import. A Python program
cannot swap its BLAS once running, so the library says how, once, when it first
loads a model or makes a cache on the slow path (``warn_if_reference_blas``).
"""

import functools
import os
import re
import sys
import warnings
from typing import Optional

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
_FLAG = "MLX_H2O_BLAS_REEXEC"
# The reference BLAS bundled with the Linux mlx-cpu wheel (auditwheel's folder).
_WHEEL_BLAS = re.compile(r"mlx_cpu\.libs/libblas[^/\s]*\.so")


class ReferenceBLASWarning(RuntimeWarning):
    """MLX's CPU matmuls run on the reference BLAS of the Linux mlx-cpu wheel."""


def openblas_path():
    """The OpenBLAS library to preload, or None where it does not apply."""
    if not sys.platform.startswith("linux") or not os.path.exists(OPENBLAS):
        return None
    return OPENBLAS


def openblas_active() -> bool:
    return OPENBLAS in os.environ.get("LD_PRELOAD", "")


def reexec_with_openblas() -> None:
    """Re-exec this process once with OpenBLAS preloaded (no-op if not applicable)."""
    lib = openblas_path()
    if lib is None or openblas_active() or os.environ.get(_FLAG):
        return
    env = dict(os.environ, **{_FLAG: "1"})
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD")) if p)
    argv = [sys.executable, "-m", "mlx_h2o", *sys.argv[1:]]
    try:
        os.execve(sys.executable, argv, env)
    except OSError:
        return  # keep running with reference BLAS


def reference_blas_in_use(maps: Optional[str] = None, preload: Optional[str] = None) -> bool:
    """Whether this process's MLX CPU matmuls go to the wheel's reference BLAS:
    it is mapped (``maps``: /proc/self/maps) and LD_PRELOAD (``preload``) puts
    no other BLAS in front of it. False off Linux or when it cannot tell."""
    if maps is None:
        if not sys.platform.startswith("linux"):
            return False
        try:
            with open("/proc/self/maps") as fh:
                maps = fh.read()
        except OSError:
            return False
    preload = os.environ.get("LD_PRELOAD", "") if preload is None else preload
    fast = [p for p in re.split(r"[:\s]+", preload) if re.search(r"blas|mkl|blis", p, re.I)]
    return bool(_WHEEL_BLAS.search(maps)) and not fast


def reference_blas_message() -> str:
    how = (f"start Python with LD_PRELOAD={OPENBLAS}" if os.path.exists(OPENBLAS) else
           "install OpenBLAS (Debian / Ubuntu: apt-get install libopenblas0-pthread) and "
           f"start Python with LD_PRELOAD={OPENBLAS}")
    return ("MLX's CPU matmuls are running on the reference BLAS that the Linux mlx-cpu "
            f"wheel links, ~30x slower than OpenBLAS: {how} (the mlx-h2o command does "
            "this itself)")


@functools.cache
def warn_if_reference_blas() -> bool:
    """Warn (once a process) when the CPU runs MLX on the reference BLAS; True if it did."""
    import mlx.core as mx

    if mx.default_device() != mx.cpu or not reference_blas_in_use():
        return False
    warnings.warn(reference_blas_message(), ReferenceBLASWarning, stacklevel=3)
    return True
