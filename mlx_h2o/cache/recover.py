"""Putting a prompt cache right after a forward pass that stopped midway."""

from typing import Any, List


def recover_prompt_cache(cache: List[Any]) -> int:
    """Drop the tokens of an interrupted forward pass from every layer.

    An exception or KeyboardInterrupt inside the model leaves the layers it
    reached holding the pass's tokens and the later ones without them (an H2O
    layer stopped between its update and its attention also waits for
    scores). Every layer is trimmed back to the tokens before that pass, so
    feeding them again goes on as if the pass had never started (a later call
    that failed on the interrupted layer is undone too). Returns the tokens
    every layer now holds (the ``offset`` to go on from).
    """
    offsets = [_offset_before(c) for c in cache]
    known = [o for o in offsets if o is not None]
    if not known:
        return 0
    target = min(known)
    for i, (c, before) in enumerate(zip(cache, offsets)):
        if c.offset == target:
            continue
        if before is None or not c.is_trimmable():
            raise ValueError(
                f"layer {i} ({type(c).__name__}) cannot drop the interrupted pass's "
                "tokens: make a new cache (make_h2o_cache or mlx-lm's make_prompt_cache)"
            )
        c.trim(c.offset - target)
    return target


def _offset_before(c):
    """Tokens the layer held before a pass it was interrupted in (None: the
    cache keeps no token count, e.g. a recurrent layer's state)."""
    offset = getattr(c, "offset", None)
    if not isinstance(offset, int):
        return None
    return offset - getattr(c, "pending_tokens", 0)
