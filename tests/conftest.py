import os, sys

sys.path.insert(0, os.path.dirname(__file__))
# The tools the tests share (GPU checks, the float64 kernel references).
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
# Tests compare float32 paths with references: on CUDA, MLX runs float32
# matmuls as TF32 by default (our reference attention's q @ k included, not
# its fused SDPA), a ~1e-3 relative error. Full float32 unless asked otherwise.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def on_cpu():
    """Runs a test on the CPU device: for modules that test the CPU's paths
    (or emulate the GPU kernels), which a GPU machine would otherwise send
    through the real kernels (pytestmark = pytest.mark.usefixtures("on_cpu"))."""
    old = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(old)
