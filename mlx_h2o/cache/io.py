"""Save and load prompt caches that hold H2O caches.

mlx-lm's ``load_prompt_cache`` resolves classes inside ``mlx_lm.models.cache``
and cannot see ours, so we keep our own safetensors layout: arrays under
``"<cache>.<item>"`` and JSON metadata (classes, scalars, meta states).
"""

import json
import os
import tempfile
from typing import Any, Dict, List, Optional

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from .group import link_layers
from .h2o import H2OKVCache

FORMAT = "mlx-h2o-cache/1"
CACHE_CLASSES: Dict[str, type] = {"H2OKVCache": H2OKVCache}


def register_cache_class(cls: type) -> type:
    """Make a cache class loadable by ``load_prompt_cache`` (by its name)."""
    CACHE_CLASSES[cls.__name__] = cls
    return cls


def save_prompt_cache(
    file: str, cache: List[Any], metadata: Optional[Dict[str, str]] = None
) -> None:
    """Write ``cache`` atomically to a ``.safetensors`` file."""
    if not str(file).endswith(".safetensors"):
        raise ValueError(f"cache file must end with .safetensors, got {file!r}")
    arrays, scalars, metas = {}, {}, []
    for i, c in enumerate(cache):
        for j, item in enumerate(c.state):
            if isinstance(item, mx.array):
                arrays[f"{i}.{j}"] = item
            else:
                scalars[f"{i}.{j}"] = item
        meta = getattr(c, "meta_state", None)
        metas.append(list(meta) if isinstance(meta, (tuple, list)) else None)
    header = {
        "format": FORMAT,
        "classes": json.dumps([type(c).__name__ for c in cache]),
        "lengths": json.dumps([len(c.state) for c in cache]),
        "scalars": json.dumps(scalars),
        "meta_states": json.dumps(metas),
        "metadata": json.dumps(metadata or {}),
    }
    folder = os.path.dirname(os.path.abspath(file))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".safetensors")
    os.close(fd)
    try:
        mx.save_safetensors(tmp, arrays, header)
        os.replace(tmp, file)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_prompt_cache(file: str, return_metadata: bool = False):
    """Read a cache written by ``save_prompt_cache``; a bad file raises ValueError."""
    try:
        arrays, header = mx.load(str(file), return_metadata=True)
    except Exception as e:  # mx.load raises several types on truncated data
        raise ValueError(f"{file} is not a readable cache file ({e})") from e
    if header.get("format") != FORMAT:
        raise ValueError(
            f"{file} is not an mlx-h2o cache file (format {header.get('format')!r}); "
            "for plain mlx-lm caches use mlx_lm.models.cache.load_prompt_cache"
        )
    try:
        cache = _rebuild(arrays, header)
        metadata = json.loads(header["metadata"])
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"{file} is a corrupt mlx-h2o cache file ({e})") from e
    # As make_h2o_cache left them: a loaded cache decodes as fast (GPU groups).
    link_layers([c for c in cache if hasattr(c, "set_fold_phase")])
    return (cache, metadata) if return_metadata else cache


def _rebuild(arrays, header):
    classes = json.loads(header["classes"])
    lengths = json.loads(header["lengths"])
    scalars = json.loads(header["scalars"])
    metas = json.loads(header["meta_states"])
    cache = []
    for i, (name, n, meta) in enumerate(zip(classes, lengths, metas)):
        state = [
            arrays[f"{i}.{j}"] if f"{i}.{j}" in arrays else scalars[f"{i}.{j}"]
            for j in range(n)
        ]
        cache.append(_make(name, state, meta))
    return cache


def _make(name, state, meta):
    if name in CACHE_CLASSES:
        return CACHE_CLASSES[name].from_state(state, meta)
    cls = getattr(mlx_cache, name, None)
    if not isinstance(cls, type):
        raise ValueError(f"unknown cache class {name!r}")
    obj = cls.from_state(state)
    if meta is not None and hasattr(cls, "meta_state"):
        obj.meta_state = meta
    return obj
