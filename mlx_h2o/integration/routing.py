"""Route mlx-lm attention through H2O caches, explicitly and reversibly.

mlx-lm model modules import ``scaled_dot_product_attention`` by name from
``mlx_lm.models.base``; we swap that name in ``base`` and in every loaded
``mlx_lm.models.*`` module. Modules imported while patched pick up the routed
function from ``base``; unpatching restores every module that holds it.
"""

import sys
import threading
from contextlib import contextmanager
from contextvars import ContextVar
from typing import List, Optional

import mlx.core as mx
import mlx_lm.models.base as base

_ORIGINAL = base.scaled_dot_product_attention
_lock = threading.Lock()
_depth = 0
# While check_supported traces a forward pass: the caches of the attention
# calls that no H2O cache computed.
_unrouted: ContextVar[Optional[list]] = ContextVar("mlx_h2o_unrouted", default=None)


def scaled_dot_product_attention(
    queries, keys, values, cache, scale: float, mask, sinks: Optional[mx.array] = None
):
    """mlx-lm's SDPA, except that caches with ``h2o_attention`` compute it themselves."""
    attend = getattr(cache, "h2o_attention", None)
    if attend is None:
        calls = _unrouted.get()
        if calls is not None:
            calls.append(cache)
        return _ORIGINAL(
            queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks
        )
    return attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


def _model_modules():
    return [
        m
        for name, m in list(sys.modules.items())
        if m is not None and (name == "mlx_lm.models" or name.startswith("mlx_lm.models."))
    ]


def _swap(old, new):
    for module in _model_modules():
        if getattr(module, "scaled_dot_product_attention", None) is old:
            module.scaled_dot_product_attention = new


def enable() -> None:
    """Route attention of all mlx-lm models through H2O caches (nestable)."""
    global _depth
    with _lock:
        if _depth == 0:
            _swap(_ORIGINAL, scaled_dot_product_attention)
        _depth += 1


def disable() -> None:
    """Undo one ``enable()``; the last one restores mlx-lm's function everywhere."""
    global _depth
    with _lock:
        if _depth == 0:
            raise RuntimeError("mlx_h2o routing is not enabled")
        _depth -= 1
        if _depth == 0:
            _swap(scaled_dot_product_attention, _ORIGINAL)


def is_enabled() -> bool:
    return _depth > 0


@contextmanager
def patch():
    """``with mlx_h2o.patch(): model(x, cache=h2o_cache)``."""
    enable()
    try:
        yield
    finally:
        disable()


@contextmanager
def trace_unrouted():
    """``patch()``, also collecting the ``cache`` argument of every routed call
    that no H2O cache computed (``check_supported``'s traced forward pass)."""
    calls: List = []
    token = _unrouted.set(calls)
    try:
        with patch():
            yield calls
    finally:
        _unrouted.reset(token)
