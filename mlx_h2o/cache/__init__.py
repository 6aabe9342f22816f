"""KV caches with H2O eviction (hold state; policy lives in mlx_h2o.policy;
saving and loading in mlx_h2o.files)."""

from .batch_cache import BatchH2OKVCache
from .h2o import H2OKVCache
from .quantized import (
    MixedPrecisionH2OKVCache,
    QuantConfig,
    QuantizedH2OKVCache,
    quantized_cache_type,
)
from .recover import recover_prompt_cache

__all__ = [
    "BatchH2OKVCache",
    "H2OKVCache",
    "MixedPrecisionH2OKVCache",
    "QuantConfig",
    "QuantizedH2OKVCache",
    "quantized_cache_type",
    "recover_prompt_cache",
]
