"""The GPU backend the library's kernels run on, and the inputs its decode kernels take.

Above the kernels it checks: on Metal, whose kernels never ran before a
user's machine, ``gpu_backend()`` runs the first-use check
(kernels/selfcheck.py: decode attention against the reference) once.
"""

from functools import lru_cache
from typing import Optional

import mlx.core as mx

from . import selfcheck
from .build import device_backend
from .decode import DTYPES, Mask, mask_mode


@lru_cache(maxsize=1)
def gpu_backend() -> Optional[str]:
    """The backend whose kernels the library uses: ``device_backend()``, or
    None where there is none or its kernels failed their first-use check
    (Metal's, which never ran before a user's machine: kernels/selfcheck.py)."""
    backend = device_backend()
    if backend == "metal" and not selfcheck.kernels_pass():
        return None
    return backend


def runs_on_gpu() -> bool:
    """Our kernels' backend is there and work runs on its device (not on a
    CUDA or Metal machine's CPU device, where the CPU paths serve)."""
    return gpu_backend() is not None and mx.default_device() == mx.gpu


def supported(q, k, v, mask: Mask = None, sinks=None) -> bool:
    """Whether the GPU decode kernels take these inputs (else use the reference)."""
    if gpu_backend() is None or mx.default_device() != mx.gpu:
        return False
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return False
    B, Hq, L, D = q.shape
    Hk, N = k.shape[1], k.shape[2]
    if not (q.dtype == k.dtype == v.dtype and q.dtype in DTYPES):
        return False
    if L < 1 or L > 8 or N < 1 or Hk < 1 or Hq % Hk:
        return False
    if k.shape[0] != B or tuple(v.shape) != (B, Hk, N, D) or k.shape[3] != D:
        return False
    if D % 8 or D > 256:
        return False
    if sinks is not None and (sinks.ndim != 1 or sinks.shape[0] != Hq):
        return False
    return mask_mode(mask, B, Hq, Hk, L, N) is not None
