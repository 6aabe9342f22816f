"""KV caches with H2O eviction (hold state; policy lives in mlx_h2o.policy)."""

from .h2o import H2OKVCache

__all__ = ["H2OKVCache"]
