"""Every cache mlx-lm builds is an H2O one: batched generation and the server.

mlx-lm builds caches through ``make_prompt_cache``, imported by name into
``mlx_lm.generate`` (``generate_step``, ``BatchGenerator.insert``) and
``mlx_lm.server`` (and ``model.make_cache`` behind it). ``use_h2o_caches``
swaps that name in every loaded ``mlx_lm`` module for one that returns
``make_h2o_cache(model, config)`` (``H2OKVCache.merge`` batches them:
cache/batch_cache.py) and routes attention, for the duration of a ``with``
block. Import ``mlx_lm.server`` before entering it to serve.
"""

import sys
import threading
from contextlib import contextmanager
from typing import Any, List, Optional

import mlx_lm.models.cache as mlx_cache

from ..config import H2OConfig
from . import routing
from .factory import LayerBudget, make_h2o_cache

_ORIGINAL = mlx_cache.make_prompt_cache
_lock = threading.Lock()


def _swap(old, new) -> None:
    for name, module in list(sys.modules.items()):
        if (name == "mlx_lm" or name.startswith("mlx_lm.")) and module is not None:
            if getattr(module, "make_prompt_cache", None) is old:
                module.make_prompt_cache = new


def h2o_prompt_cache(config: H2OConfig, layer_budget: LayerBudget = "uniform"):
    """A ``make_prompt_cache(model, max_kv_size=None)`` that builds H2O caches."""

    def make_prompt_cache(model, max_kv_size: Optional[int] = None) -> List[Any]:
        if max_kv_size is not None:
            raise ValueError(
                f"max_kv_size={max_kv_size} asks for mlx-lm's rotating cache, but H2O "
                f"caches are in use (budget {config.max_size}): leave max_kv_size unset")
        return make_h2o_cache(model, config, layer_budget=layer_budget)

    return make_prompt_cache


@contextmanager
def use_h2o_caches(config: H2OConfig, layer_budget: LayerBudget = "uniform"):
    """``with use_h2o_caches(H2OConfig(max_size=256)): mlx_lm.batch_generate(...)``.

    Not nestable; routing (``mlx_h2o.enable``) is on inside."""
    if not isinstance(config, H2OConfig):
        raise TypeError(f"config must be an H2OConfig, got {type(config).__name__}")
    if not _lock.acquire(blocking=False):
        raise RuntimeError("use_h2o_caches is already active")
    new = h2o_prompt_cache(config, layer_budget)
    try:
        _swap(_ORIGINAL, new)
        with routing.patch():
            yield new
    finally:
        _swap(new, _ORIGINAL)
        _lock.release()
