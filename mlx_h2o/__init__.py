"""mlx-h2o: H2O (Heavy-Hitter Oracle) KV-cache eviction for mlx-lm.

Nothing is patched at import: use ``with mlx_h2o.patch():`` (or ``generate``).
Names load on first use, so ``mlx-h2o --help`` does not import MLX or mlx-lm.
"""

from importlib import import_module

# public name -> the module that defines it (relative to this package)
_EXPORTS = {
    "H2OConfig": ".config",
    "H2OKVCache": ".cache",
    "SCORE_MODES": ".config",
    "cache_stats": ".integration.stats",
    "disable": ".integration.routing",
    "enable": ".integration.routing",
    "generate": ".integration.generate",
    "is_enabled": ".integration.routing",
    "load_prompt_cache": ".files",
    "make_h2o_cache": ".integration.factory",
    "patch": ".integration.routing",
    "preview_prompt": ".integration.preview",
    "recover_prompt_cache": ".cache",
    "register_cache_class": ".files",
    "save_prompt_cache": ".files",
    "stream_generate": ".integration.generate",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name], __name__), name)
    else:
        try:  # a subpackage, as after an eager import (mlx_h2o.cache, ...)
            value = import_module(f".{name}", __name__)
        except ModuleNotFoundError:
            raise AttributeError(f"module 'mlx_h2o' has no attribute {name!r}") from None
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
