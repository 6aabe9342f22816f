import os, sys

sys.path.insert(0, os.path.dirname(__file__))
# Tests compare float32 paths with references: on CUDA, MLX runs float32
# matmuls as TF32 by default (our reference attention's q @ k included, not
# its fused SDPA), a ~1e-3 relative error. Full float32 unless asked otherwise.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
