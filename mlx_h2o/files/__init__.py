"""Prompt cache files: checked, atomic save and load of H2O caches.

Above the caches (it rebuilds a model's caches through
``integration.make_h2o_cache`` to check a file against the model), so
nothing in ``mlx_h2o.cache`` imports it.
"""

from .io import load_prompt_cache, register_cache_class, save_prompt_cache

__all__ = ["load_prompt_cache", "register_cache_class", "save_prompt_cache"]
