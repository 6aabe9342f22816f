"""Save and load prompt caches that hold H2O caches.

mlx-lm's ``load_prompt_cache`` resolves classes inside ``mlx_lm.models.cache``
and cannot see ours, so we keep our own safetensors layout: arrays under
``"<cache>.<item>"`` and JSON metadata (classes, scalars, meta states).

The metadata carries a ``checksum``: sha256 over the other header fields and
every array (name, dtype, shape, bytes; names sorted). A loaded file must
match it, then pass the checks of files/checks.py. Files written before
the checksum existed load with a warning (the other checks still apply).
"""

import hashlib
import json
import os
import tempfile
import warnings
from typing import Any, Dict, List, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from ..cache import H2OKVCache, MixedPrecisionH2OKVCache, QuantizedH2OKVCache
from ..cache.group import link_layers
from .checks import REBUILD, check_h2o, check_model, corrupt, read_header

FORMAT = "mlx-h2o-cache/1"
HEADER_FIELDS = ("format", "classes", "lengths", "scalars", "meta_states", "metadata")
CACHE_CLASSES: Dict[str, type] = {
    cls.__name__: cls for cls in (H2OKVCache, QuantizedH2OKVCache, MixedPrecisionH2OKVCache)}


def register_cache_class(cls: type) -> type:
    """Make a cache class loadable by ``load_prompt_cache`` (by its name)."""
    CACHE_CLASSES[cls.__name__] = cls
    return cls


def save_prompt_cache(
    file: str, cache: List[Any], metadata: Optional[Dict[str, str]] = None
) -> None:
    """Write ``cache`` atomically to a ``.safetensors`` file (mode 0666 less
    the umask, as ``open`` would create it), with a content checksum."""
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
    header["checksum"] = checksum(arrays, header)
    folder = os.path.dirname(os.path.abspath(file))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".safetensors")
    os.close(fd)
    try:
        mx.save_safetensors(tmp, arrays, header)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp made it 0600
        os.replace(tmp, file)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def checksum(arrays: Dict[str, mx.array], header: Dict[str, str]) -> str:
    """``"sha256:<hex>"`` of the header fields and the arrays, in a fixed order."""
    h = hashlib.sha256()
    h.update(json.dumps([header.get(k) for k in HEADER_FIELDS]).encode())
    for name in sorted(arrays):
        a = arrays[name]
        h.update(json.dumps([name, str(a.dtype), list(a.shape)]).encode())
        h.update(memoryview(mx.contiguous(a)))  # C order: a slice is copied first
    return "sha256:" + h.hexdigest()


def load_prompt_cache(
    file: str,
    return_metadata: bool = False,
    model: Union[None, Any, Sequence[Any]] = None,
):
    """Read a cache written by ``save_prompt_cache``; a bad file raises ValueError.

    ``model``: the model the cache is for (or a list: a model, then its draft
    model, whose caches follow it in the file). The file must then hold what
    ``make_h2o_cache`` builds for it: as many caches as it has layers, each of
    the right kind (H2O with the layer's window, or the model's own cache),
    with its KV heads and head dims.
    """
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
        _verify(file, arrays, header)
        classes, lengths, scalars, metas, metadata = read_header(header, arrays)
        cache, heads = [], []
        for i, (name, n, meta) in enumerate(zip(classes, lengths, metas)):
            state = [arrays.get(f"{i}.{j}", scalars.get(f"{i}.{j}")) for j in range(n)]
            cache.append(_layer(i, name, state, meta, heads))
        if model is not None:
            check_model(
                cache, heads, [model] if not isinstance(model, (list, tuple)) else model
            )
    except ValueError as e:
        raise ValueError(f"cache file {file}: {e}") from e
    # As make_h2o_cache left them: a loaded cache decodes as fast (GPU groups).
    link_layers([c for c in cache if hasattr(c, "set_fold_phase")])
    return (cache, metadata) if return_metadata else cache


def _verify(file, arrays, header):
    stored = header.get("checksum")
    if stored is None:
        warnings.warn(
            f"cache file {file} has no checksum (written before checksums): its "
            "contents are not verified; save the cache again to add one",
            stacklevel=3,
        )
    elif stored != checksum(arrays, header):
        raise ValueError(
            "its content checksum does not match: the file was changed or damaged "
            f"after it was saved; {REBUILD}"
        )


def _layer(i, name, state, meta, heads):
    """Cache ``i`` of the file, checked; its heads appended to ``heads``."""
    cls = CACHE_CLASSES.get(name) or getattr(mlx_cache, name, None)
    if not isinstance(cls, type):
        raise ValueError(
            f"its layer {i} is of unknown cache class {name!r}: import the module "
            "that defines it (and registers it with register_cache_class) first"
        )
    try:
        heads.append(check_h2o(cls, state, meta))
    except ValueError as e:
        raise ValueError(f"layer {i} ({name}): {e}") from e
    try:
        return _make(name, cls, state, meta)
    except Exception as e:  # from_state raises several types on bad states
        raise corrupt(
            f"layer {i} ({name}) cannot be rebuilt ({type(e).__name__}: {e})"
        ) from e


def _make(name, cls, state, meta):
    if name in CACHE_CLASSES:
        return cls.from_state(state, meta)
    obj = cls.from_state(state)
    if meta is not None and hasattr(cls, "meta_state"):
        obj.meta_state = meta
    return obj
