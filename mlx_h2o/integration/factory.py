"""Build H2O caches for an mlx-lm model."""

import os
import sys
from typing import Any, List, Optional, Sequence, Union

import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache

from .. import budgets
from ..cache import H2OKVCache
from ..cache.group import link_layers
from ..config import H2OConfig, with_max_size
from ..profiles import LayerProfile, load_profile, packaged_name, shipped_profile

LayerBudget = Union[str, os.PathLike, LayerProfile]


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
    layer_budget: LayerBudget = "auto",
) -> List[Any]:
    """The model's prompt cache with every attention cache replaced by an H2O one.

    Full-attention layers (``KVCache``) get ``cache_type(config)``; sliding
    window layers (``RotatingKVCache``) get one that respects the window.
    Other caches (SSM state, ...) are kept as the model made them.

    How ``config.max_size`` is shared between the attention layers:
    ``layer_budget="auto"`` (default): the shipped layer profile when the model
    is a packaged one loaded by ``mlx_h2o.models.load_model``, else uniform;
    ``"uniform"``: ``config.max_size`` in every layer; a path (or a
    ``LayerProfile``): that profile (``mlx-h2o calibrate`` writes one). A
    profile's sizes come from ``budgets.layer_sizes`` (the memory of the
    uniform budget). ``layer_sizes``: one ``max_size`` per attention layer,
    in layer order (only with ``layer_budget="auto"``; anything else is a
    conflict). Each layer gets ``with_max_size(config, size)``: sink kept,
    heavy / recent scaled in proportion.
    """
    if not isinstance(config, H2OConfig):
        raise TypeError(f"config must be an H2OConfig, got {type(config).__name__}")
    check_supported(model)
    caches = _model_caches(model)
    name = model_name(model)
    layers = [i for i, c in enumerate(caches) if type(c) in (KVCache, RotatingKVCache)]
    if not layers:
        raise ValueError(f"model {name!r} has no attention KV cache to replace")
    windows = tuple(_window(caches[i]) for i in layers)
    origin = "layer_sizes"
    if layer_sizes is not None and not _is_auto(layer_budget):
        raise ValueError(
            f"layer_sizes and layer_budget={layer_budget!r} both set the per-layer "
            "sizes: pass one (layer_sizes with the default layer_budget='auto')"
        )
    if layer_sizes is None:
        profile = resolve_layer_profile(model, layer_budget, windows)
        if profile is not None:
            layer_sizes = profile_layer_sizes(profile, config, windows)
            origin = f"layer profile {profile.name}"
    cfgs = layer_configs(config, layer_sizes, len(layers), origin)
    for i, cfg, window in zip(layers, cfgs, windows):
        caches[i] = cache_type(cfg, window_size=window)
        caches[i].model_name = name
    link_layers([caches[i] for i in layers])  # folds apart; GPU: one fold launch a token
    return caches


def _model_caches(model) -> List[Any]:
    if hasattr(model, "make_cache"):
        return model.make_cache()
    return [KVCache() for _ in model.layers]


def _window(cache) -> Optional[int]:
    return cache.max_size if type(cache) is RotatingKVCache else None


def _is_auto(layer_budget) -> bool:
    return isinstance(layer_budget, str) and layer_budget == "auto"


def attention_windows(model: nn.Module) -> tuple:
    """Per attention layer of ``model``: its sliding window or None (full attention)."""
    return tuple(_window(c) for c in _model_caches(model)
                 if type(c) in (KVCache, RotatingKVCache))


def resolve_layer_profile(
    model: nn.Module, layer_budget: LayerBudget, windows: Optional[tuple] = None
) -> Optional[LayerProfile]:
    """The profile ``layer_budget`` selects for ``model`` (None: uniform).

    ``"auto"``: the shipped profile of the packaged model ``load_model`` loaded
    (checked against the model's attention layers), else None; ``"uniform"``:
    None; a path or ``LayerProfile``: that profile, checked against the model.
    """
    windows = attention_windows(model) if windows is None else windows
    if isinstance(layer_budget, LayerProfile):
        profile = layer_budget
    elif isinstance(layer_budget, str) and layer_budget in ("auto", "uniform"):
        name = packaged_name(model) if layer_budget == "auto" else None
        profile = shipped_profile(name) if name else None
        if profile is None:
            return None
    elif isinstance(layer_budget, (str, os.PathLike)):
        profile = load_profile(layer_budget)
    else:
        raise TypeError(
            "layer_budget must be 'auto', 'uniform', a profile path or a LayerProfile, "
            f"got {type(layer_budget).__name__}"
        )
    profile.check_model(model_name(model), windows)
    return profile


def profile_layer_sizes(profile: LayerProfile, config: H2OConfig, windows) -> List[int]:
    """Per-layer max_size from ``profile`` at ``config``'s budget and sink."""
    return budgets.layer_sizes(profile.weights, windows, config.max_size, config.sink_size)


def layer_configs(config: H2OConfig, layer_sizes, n_layers: int,
                  origin: str = "layer_sizes") -> List[H2OConfig]:
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
            if origin == "layer_sizes":
                raise type(e)(f"layer_sizes[{j}]={size!r}: {e}") from None
            raise type(e)(f"{origin} gives layer {j} max_size={size}: {e}; "
                          "or use layer_budget='uniform'") from None
    return out
