"""Read a GGUF file and convert it to mlx-lm weights (float32) and a config.

The architecture-specific parts (tensor names, llama.cpp's rewrites of some
tensors, config keys) live in one module per GGUF architecture
(`gguf_llama.py`, `gguf_gemma3.py`, `gguf_qwen2.py`), each exposing `make_config(meta, names)`
and `convert_tensor(name, array, config) -> (mlx_name, array)`.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Mapping

import mlx.core as mx
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

# GGUF architecture -> module in this package.
_ARCH_MODULES = {"llama": "gguf_llama", "gemma3": "gguf_gemma3", "qwen2": "gguf_qwen2"}
_BLOCK_PREFIX = "blk."
_REQUIRED = object()


def open_gguf(path: str | Path) -> GGUFReader:
    """A `GGUFReader` for `path`; `ValueError` if the file is not a readable GGUF."""
    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # the reader raises many kinds on corrupt input
        raise ValueError(
            f"{path} is not a valid GGUF file (corrupt or truncated?): "
            f"{type(e).__name__}: {e}"
        ) from e
    if not reader.tensors:
        raise ValueError(f"{path} is a GGUF file without tensors")
    return reader


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All metadata key/values of the file (strings, numbers and lists)."""
    return {
        k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")
    }


def meta_value(meta: Mapping[str, Any], key: str, default: Any = _REQUIRED) -> Any:
    """`meta[key]`, with floats rounded to float32's 7 digits (1e-5, not 9.99e-06)."""
    if key not in meta:
        if default is _REQUIRED:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return default
    value = meta[key]
    return float(f"{value:.7g}") if isinstance(value, float) else value


def split_block_name(name: str) -> tuple[int | None, str]:
    """`"blk.3.attn_q.weight"` -> `(3, "attn_q.weight")`; `(None, name)` otherwise."""
    if name.startswith(_BLOCK_PREFIX):
        index, _, rest = name[len(_BLOCK_PREFIX) :].partition(".")
        if index.isdigit():
            return int(index), rest
    return None, name


def rename(name: str, top: Mapping[str, str], block: Mapping[str, str]) -> str:
    """mlx-lm name of GGUF tensor `name`, from per-arch tables (suffix `.weight`/
    `.bias` kept); `ValueError` for a tensor the tables do not know."""
    layer, rest = split_block_name(name)
    stem, _, kind = rest.rpartition(".")
    table = top if layer is None else block
    if stem not in table or kind not in ("weight", "bias"):
        raise ValueError(f"unsupported GGUF tensor {name!r}")
    prefix = "" if layer is None else f"model.layers.{layer}."
    return f"{prefix}{table[stem]}.{kind}"


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """A GGUF tensor as a float32 array in row-major (out, in) order."""
    array = dequantize(tensor.data, tensor.tensor_type)
    expected = tuple(int(d) for d in reversed(tensor.shape))
    if array.shape != expected:
        raise ValueError(
            f"tensor {tensor.name!r} has shape {array.shape}, expected {expected} "
            "(truncated file?)"
        )
    return np.ascontiguousarray(array, dtype=np.float32)


def _arch_module(arch: str) -> Any:
    if arch not in _ARCH_MODULES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; "
            f"supported: {sorted(_ARCH_MODULES)}"
        )
    return importlib.import_module(f"{__package__}.{_ARCH_MODULES[arch]}")


def convert_gguf(
    reader: GGUFReader,
    overrides: Mapping[str, Any] | None = None,
    meta: Mapping[str, Any] | None = None,
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Float32 mlx-lm weights and config.json contents for the model in `reader`.

    `overrides` fill config keys the GGUF metadata does not carry (values the
    metadata gives win); `meta` is `read_metadata(reader)` when already read.
    """
    meta = read_metadata(reader) if meta is None else meta
    module = _arch_module(meta_value(meta, "general.architecture"))
    names = {t.name for t in reader.tensors}
    config = module.make_config(meta, names)
    for key, value in (overrides or {}).items():
        config.setdefault(key, value)
    weights = {}
    for tensor in reader.tensors:
        name, array = module.convert_tensor(
            tensor.name, dequantize_tensor(tensor), config
        )
        weights[name] = mx.array(array)
    return weights, config
