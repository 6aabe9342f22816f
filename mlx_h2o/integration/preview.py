"""The prompt's end, seen ahead (``prefill_compact="preview"``).

A prompt longer than the prefill step is compacted chunk by chunk before
its end (the question) exists. ``preview_prompt`` runs the prompt's last
``prefill_window`` tokens through the model alone, at their own positions,
before the prefill, and hands each layer's queries to its cache: every chunk
compacted before the end arrives is then scored by them too. They saw only
the end itself, not the text before it, so they approximate the queries the
prefill will compute; the real ones take over when the end arrives.
"""

from typing import List, Sequence

import mlx.core as mx

from .routing import patch


class PreviewLayer:
    """One layer's cache for the preview pass: the previewed tokens' own K/V
    only, at their true positions (``offset`` drives RoPE); the queries go to
    the layer's H2O cache."""

    def __init__(self, target, offset: int):
        self.target, self.offset = target, offset

    def update_and_fetch(self, keys, values):
        self.offset += keys.shape[2]
        return keys, values

    def h2o_attention(self, queries, keys, values, *, scale, mask=None, sinks=None):
        if hasattr(self.target, "set_preview"):
            self.target.set_preview(queries, self.offset - queries.shape[2])
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                    mask=mask, sinks=sinks)


def preview_window(cache: Sequence) -> int:
    """Tokens to preview for ``cache`` (a model's per-layer caches): the
    longest ``prefill_window`` of a layer that wants a preview; 0: none does."""
    windows = [c.config.prefill_window for c in cache
               if getattr(c, "wants_preview", lambda: False)()]
    return max(windows, default=0)


def preview_prompt(model, cache: List, prompt) -> None:
    """Give ``cache`` (``model``'s per-layer caches, empty) the queries of
    the ``prompt``'s (token ids: (L,) or (B, L)) last tokens before it is
    prefilled. Nothing to do unless a layer's cache wants a preview
    (``prefill_compact="preview"``) and the prompt is longer than the window.

    Every layer's cache must take a preview pass: a model with a cache other
    than an H2O one (a recurrent layer's state) is left without a preview.
    """
    tokens = mx.array(prompt) if not isinstance(prompt, mx.array) else prompt
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2:
        raise ValueError(f"prompt must be token ids of shape (L,) or (B, L), got {tokens.shape}")
    W, L = preview_window(cache), tokens.shape[1]
    if W == 0 or L <= W or not all(hasattr(c, "set_preview") for c in cache):
        return
    if any(c.offset for c in cache):
        raise ValueError("preview_prompt needs an empty cache: preview a prompt before "
                         "any of it is prefilled")
    layers = [PreviewLayer(c, L - W) for c in cache]
    body = getattr(model, "model", model)  # the transformer, without the LM head
    with patch():
        out = body(tokens[:, L - W:], cache=layers)
    mx.eval(out, [c.preview for c in cache if c.preview is not None])
