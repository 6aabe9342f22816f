"""Build H2O caches for an mlx-lm model."""

import sys
from typing import Any, List, Optional, Sequence

import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ..cache import H2OKVCache
from ..config import H2OConfig, with_max_size


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


def make_h2o_cache(
    model: nn.Module,
    config: H2OConfig,
    cache_type=H2OKVCache,
    layer_sizes: Optional[Sequence[int]] = None,
) -> List[Any]:
    """The model's prompt cache with every attention cache replaced by an H2O one.

    Full-attention layers (``KVCache``) get ``cache_type(config)``; sliding
    window layers (``RotatingKVCache``) get one that respects the window.
    Other caches (SSM state, ...) are kept as the model made them.
    ``layer_sizes``: one ``max_size`` per replaced (attention) layer, in layer
    order; each layer gets ``with_max_size(config, size)`` (sink kept, heavy /
    recent scaled in proportion). None: ``config.max_size`` everywhere.
    """
    if not isinstance(config, H2OConfig):
        raise TypeError(f"config must be an H2OConfig, got {type(config).__name__}")
    check_supported(model)
    if hasattr(model, "make_cache"):
        caches = model.make_cache()
    else:
        caches = [KVCache() for _ in model.layers]
    name = model_name(model)
    layers = [i for i, c in enumerate(caches) if type(c) in (KVCache, RotatingKVCache)]
    if not layers:
        raise ValueError(f"model {name!r} has no attention KV cache to replace")
    for i, cfg in zip(layers, layer_configs(config, layer_sizes, len(layers))):
        window = caches[i].max_size if type(caches[i]) is RotatingKVCache else None
        caches[i] = cache_type(cfg, window_size=window)
        caches[i].model_name = name
        caches[i].set_fold_phase(len(layers) - 1 - layers.index(i))  # layers fold apart
    return caches


def layer_configs(config: H2OConfig, layer_sizes, n_layers: int) -> List[H2OConfig]:
    if layer_sizes is None:
        return [config] * n_layers
    sizes = list(layer_sizes)
    if len(sizes) != n_layers:
        raise ValueError(
            f"layer_sizes has {len(sizes)} entries but the model has {n_layers} "
            "attention layers to replace"
        )
    out = []
    for j, size in enumerate(sizes):
        try:
            out.append(with_max_size(config, size))
        except (TypeError, ValueError) as e:
            raise type(e)(f"layer_sizes[{j}]={size!r}: {e}") from None
    return out
