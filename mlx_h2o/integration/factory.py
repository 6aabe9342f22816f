"""Build H2O caches for an mlx-lm model."""

import os
from typing import Any, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList, KVCache, RotatingKVCache

from .. import budgets
from ..blas import warn_if_reference_blas
from ..cache import H2OKVCache
from ..cache.group import link_layers
from ..config import H2OConfig, with_max_size
from ..profiles import LayerProfile, load_profile, packaged_name, shipped_profile
from . import routing

LayerBudget = Union[str, os.PathLike, LayerProfile]


def model_name(model: nn.Module) -> str:
    args = getattr(model, "args", None)
    return getattr(args, "model_type", None) or type(model).__module__


class _Probe:
    """A model's own KV cache, counting its writes and the attention calls that
    reach it through the routed SDPA (``check_supported``'s traced forward)."""

    writes = routed = 0
    shared = writing = False

    def update_and_fetch(self, keys, values):
        self.writes += 1
        self.writing = True
        try:
            return super().update_and_fetch(keys, values)
        finally:
            self.writing = False

    def h2o_attention(self, queries, keys, values, *, scale, mask=None, sinks=None):
        self.routed += 1
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask, sinks=sinks
        )

    def keys_and_values(self):
        # Read from outside its own write: another layer attends these keys.
        self.shared = self.shared or not self.writing
        return super().keys_and_values()


class _ProbeKV(_Probe, KVCache):
    pass


class _ProbeRotating(_Probe, RotatingKVCache):
    pass


_PROBES = {KVCache: _ProbeKV, RotatingKVCache: _ProbeRotating}


def check_supported(model: nn.Module) -> None:
    """Raise ValueError unless every attention KV cache of ``model`` is attended
    through mlx-lm's routed SDPA, once per write (what H2O reads scores from).

    Decided by what the model calls, not by what its modules import: a forward
    pass over 2 tokens and then 1 (prefill and decode paths) with the model's
    own caches counting writes, routed calls and reads by other layers. MLX is
    lazy and the logits are never evaluated, so the pass costs graph building
    only (~50 ms for an 8B llama on a CPU core; a model that reads values inside
    its forward, as dbrx's expert routing does, evaluates those parts).
    """
    name = model_name(model)
    caches = _model_caches(model)
    probes = [_get(caches, s) for s in _attention_slots(caches)]
    if not probes:
        kinds = sorted({type(c).__name__ for c in caches})
        raise ValueError(
            f"model {name!r} has no attention KV cache to replace (its caches: "
            f"{', '.join(kinds)}); H2O replaces mlx-lm's KVCache / RotatingKVCache"
        )
    for p in probes:
        p.__class__ = _PROBES[type(p)]
    try:
        with routing.trace_unrouted() as unrouted:
            for n in (2, 1):
                model(mx.zeros((1, n), dtype=mx.int32), cache=caches)
    except Exception as e:
        raise ValueError(
            f"model {name!r} failed a probe forward pass with its own caches "
            f"({type(e).__name__}: {e}), so mlx-h2o cannot tell which caches its "
            "attention reads; H2O needs an mlx-lm model that runs "
            "model(tokens, cache=...)"
        ) from e
    why = _why_not(probes, unrouted)
    if why:
        raise ValueError(
            f"model {name!r} ({type(model).__module__}) {why}, so H2O cannot read "
            "or keep its attention scores; use a model whose attention layers each "
            "call mlx_lm.models.base.scaled_dot_product_attention on their own "
            "KVCache (README, Supported models)"
        )


def _why_not(probes, unrouted) -> Optional[str]:
    """What the traced forward pass saw that H2O cannot work with, or None."""
    n = len(probes)
    for k, p in enumerate(probes):
        if p.writes and not p.routed:
            return (f"writes KV cache {k} (of {n}) but never attends it through "
                    "mlx_lm.models.base.scaled_dot_product_attention(cache=that cache)")
        if p.writes != p.routed:
            return (f"attends KV cache {k} (of {n}) {p.routed} times for {p.writes} "
                    "writes (a cache shared between layers or looped layers)")
        if p.shared:
            return (f"lets other layers read KV cache {k} (of {n}) "
                    "(KV shared between layers)")
        if not p.writes:
            return f"never writes KV cache {k} (of {n})"
    if any(c is None for c in unrouted):
        return "attends keys held in no cache (KV shared between layers)"
    return None


def make_h2o_cache(
    model: nn.Module,
    config: H2OConfig,
    cache_type=H2OKVCache,
    layer_sizes: Optional[Sequence[int]] = None,
    layer_budget: LayerBudget = "uniform",
    decode: str = "auto",
) -> List[Any]:
    """The model's prompt cache with every attention cache replaced by an H2O one.

    Full-attention layers (``KVCache``) get ``cache_type(config)``; sliding
    window layers (``RotatingKVCache``) get one that respects the window; the
    same inside a hybrid layer's ``CacheList``. Other caches (SSM state, ...)
    are kept as the model made them. A model whose attention does not go
    through mlx-lm's routed SDPA is refused (``check_supported``).

    What ``config.max_size`` (N) bounds: ``layer_budget="uniform"`` (the
    default): every attention layer holds at most N tokens, so nothing is
    evicted, and greedy output equals mlx-lm's ``KVCache``, while the sequence
    has at most N tokens. A layer profile keeps the memory of N tokens a layer
    (N x layers) but shares it unevenly, each layer between N/4 and 4N
    (``budgets.layer_sizes``): layers below N start evicting before the
    sequence reaches N tokens. ``"auto"``: the shipped profile when the model
    is a packaged one loaded by ``mlx_h2o.models.load_model``, else uniform; a
    path (or a ``LayerProfile``): that profile (``mlx-h2o calibrate`` writes
    one). ``layer_sizes``: one ``max_size`` per attention layer, in layer
    order (only with the default ``layer_budget``). Each layer gets
    ``with_max_size(config, size)``: sink kept, heavy / recent scaled in
    proportion.

    ``decode``: the caches' decode step, ``"auto"`` (the backend's fastest)
    or ``"reference"`` / ``"compiled"`` / ``"fused"`` (``H2OKVCache``).
    """
    if not isinstance(config, H2OConfig):
        raise TypeError(f"config must be an H2OConfig, got {type(config).__name__}")
    warn_if_reference_blas()
    check_supported(model)
    caches = _model_caches(model)
    name = model_name(model)
    layers = _attention_slots(caches)
    windows = tuple(_window(_get(caches, s)) for s in layers)
    origin = "layer_sizes"
    if layer_sizes is not None and not _is_uniform(layer_budget):
        raise ValueError(
            f"layer_sizes and layer_budget={layer_budget!r} both set the per-layer "
            "sizes: pass one (layer_sizes with the default layer_budget='uniform')"
        )
    if layer_sizes is None:
        profile = resolve_layer_profile(model, layer_budget, windows)
        if profile is not None:
            layer_sizes = profile_layer_sizes(profile, config, windows)
            origin = f"layer profile {profile.name}"
    cfgs = layer_configs(config, layer_sizes, len(layers), origin)
    h2o = []
    for slot, cfg, window in zip(layers, cfgs, windows):
        h2o.append(cache_type(cfg, window_size=window))
        h2o[-1].model_name = name
        if decode != "auto":
            h2o[-1].set_decode(decode)
        _put(caches, slot, h2o[-1])
    link_layers(h2o)  # folds apart; GPU: one fold launch a token
    return caches


def _model_caches(model) -> List[Any]:
    if hasattr(model, "make_cache"):
        return model.make_cache()
    return [KVCache() for _ in model.layers]


Slot = Tuple[int, Optional[int]]


def _attention_slots(caches) -> List[Slot]:
    """(layer, member) of every attention KV cache, in layer order; member is
    None for a cache of its own, else its index in the layer's CacheList
    (hybrid layers: SSM state and KV cache side by side)."""
    slots = []
    for i, c in enumerate(caches):
        if type(c) in _PROBES:
            slots.append((i, None))
        elif type(c) is CacheList:
            slots += [(i, j) for j, m in enumerate(c.caches) if type(m) in _PROBES]
    return slots


def _get(caches, slot: Slot):
    i, j = slot
    return caches[i] if j is None else caches[i].caches[j]


def _put(caches, slot: Slot, cache) -> None:
    i, j = slot
    if j is None:
        caches[i] = cache
    else:
        members = list(caches[i].caches)
        members[j] = cache
        caches[i].caches = tuple(members)


def _window(cache) -> Optional[int]:
    return cache.max_size if type(cache) is RotatingKVCache else None


def _is_uniform(layer_budget) -> bool:
    return isinstance(layer_budget, str) and layer_budget == "uniform"


def attention_windows(model: nn.Module) -> tuple:
    """Per attention layer of ``model``: its sliding window or None (full attention)."""
    caches = _model_caches(model)
    return tuple(_window(_get(caches, s)) for s in _attention_slots(caches))


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
