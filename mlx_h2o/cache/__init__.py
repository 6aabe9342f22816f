"""KV caches with H2O eviction (hold state; policy lives in mlx_h2o.policy)."""

from .batch_cache import BatchH2OKVCache
from .h2o import H2OKVCache
from .io import load_prompt_cache, register_cache_class, save_prompt_cache
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
    "load_prompt_cache",
    "quantized_cache_type",
    "recover_prompt_cache",
    "register_cache_class",
    "save_prompt_cache",
]
