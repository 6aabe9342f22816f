"""Build H2O caches for an mlx-lm model."""

import sys
from typing import Any, List

import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ..cache import H2OKVCache
from ..config import H2OConfig


def model_name(model: nn.Module) -> str:
    args = getattr(model, "args", None)
    return getattr(args, "model_type", None) or type(model).__module__


def check_supported(model: nn.Module) -> None:
    """H2O needs the model's attention to go through mlx-lm's routed SDPA."""
    module = sys.modules.get(type(model).__module__)
    if module is None or not hasattr(module, "scaled_dot_product_attention"):
        raise ValueError(
            f"model {model_name(model)!r} computes attention without "
            "mlx_lm.models.base.scaled_dot_product_attention, so H2O cannot read "
            "its attention scores; use a model whose mlx-lm module imports it "
            "(llama, qwen3, gemma3_text, mistral, ...)"
        )


def make_h2o_cache(model: nn.Module, config: H2OConfig, cache_type=H2OKVCache) -> List[Any]:
    """The model's prompt cache with every attention cache replaced by an H2O one.

    Full-attention layers (``KVCache``) get ``cache_type(config)``; sliding
    window layers (``RotatingKVCache``) get one that respects the window.
    Other caches (SSM state, ...) are kept as the model made them.
    """
    if not isinstance(config, H2OConfig):
        raise TypeError(f"config must be an H2OConfig, got {type(config).__name__}")
    check_supported(model)
    if hasattr(model, "make_cache"):
        caches = model.make_cache()
    else:
        caches = [KVCache() for _ in model.layers]
    name, replaced = model_name(model), 0
    for i, c in enumerate(caches):
        if type(c) is KVCache:
            caches[i] = cache_type(config)
        elif type(c) is RotatingKVCache:
            caches[i] = cache_type(config, window_size=c.max_size)
        else:
            continue
        caches[i].model_name = name
        replaced += 1
    if replaced == 0:
        raise ValueError(f"model {name!r} has no attention KV cache to replace")
    return caches
