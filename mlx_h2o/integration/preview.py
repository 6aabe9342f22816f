"""The prompt's end, seen ahead (``prefill_compact="preview"``).

A prompt longer than the prefill step is compacted chunk by chunk before
its end (the question) exists. ``preview_prompt`` runs the prompt's last
``PREVIEW_TOKENS`` tokens through the model alone, at their own positions,
before the prefill, and hands each layer's cache the queries of the last
``prefill_window`` of them: every chunk compacted before the end arrives is
then scored by them too. They saw only the end, not the text before it, so
they approximate the queries the prefill will compute; the real ones take
over when the end arrives.
"""

import inspect
from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.generate import generate_step

from .routing import patch

# The prefill step of mlx-lm's generate_step when a caller passes none.
MLX_LM_PREFILL_STEP = inspect.signature(generate_step).parameters["prefill_step_size"].default

# How much of the prompt's end the preview pass reads before the queries it
# hands on: the more context they are computed in, the closer they point to
# where the real ones do (SmolLM2 at 4K: their top-10% keys hold 0.73 of the
# real queries' after 32 tokens, 0.80 after 128, 0.83 after 512 plus sinks;
# benchmarks/preview_agreement.py).
PREVIEW_TOKENS = 128


class PreviewLayer:
    """One layer's cache for the preview pass: the previewed tokens' own K/V
    only, at their true positions (``offset`` drives RoPE); the last
    ``window`` queries go to the layer's H2O cache."""

    def __init__(self, target, offset: int, window: int):
        self.target, self.offset, self.window = target, offset, window

    def update_and_fetch(self, keys, values):
        self.offset += keys.shape[2]
        return keys, values

    def h2o_attention(self, queries, keys, values, *, scale, mask=None, sinks=None):
        if hasattr(self.target, "set_preview"):
            self.target.set_preview(queries[:, :, -self.window:], self.offset - self.window)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                    mask=mask, sinks=sinks)


def preview_window(cache: Sequence) -> int:
    """Tokens to preview for ``cache`` (a model's per-layer caches): the
    longest ``prefill_window`` of a layer that wants a preview; 0: none does."""
    windows = [c.config.prefill_window for c in cache
               if getattr(c, "wants_preview", lambda: False)()]
    return max(windows, default=0)


def preview_prompt(model, cache: List, prompt, prefill_step: Optional[int] = None) -> None:
    """Give ``cache`` (``model``'s per-layer caches) the queries of the last
    tokens of ``prompt`` (token ids, (L,) or (B, L), about to be fed after
    what the caches hold) before it is prefilled.

    Nothing to do unless a layer's cache wants a preview
    (``prefill_compact="preview"``), the prompt is longer than its window
    and than what one chunk holds: with ``prefill_step`` (the prefill's
    chunk; mlx-lm feeds a prompt's last token on its own) a prompt of at
    most ``prefill_step + 1`` tokens is one chunk, which holds its end.
    Every layer's cache must take a preview pass: a model with a cache other
    than an H2O one (a recurrent layer's state) is left without a preview.
    """
    tokens = mx.array(prompt) if not isinstance(prompt, mx.array) else prompt
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2:
        raise ValueError(f"prompt must be token ids of shape (L,) or (B, L), got {tokens.shape}")
    W, L = preview_window(cache), tokens.shape[1]
    one_chunk = prefill_step is not None and L - 1 <= prefill_step
    if W == 0 or L <= W or one_chunk or not all(hasattr(c, "set_preview") for c in cache):
        return
    P = min(L, max(W, PREVIEW_TOKENS))
    layers = [PreviewLayer(c, c.offset + L - P, W) for c in cache]
    body = getattr(model, "model", model)  # the transformer, without the LM head
    with patch():
        out = body(tokens[:, L - P:], cache=layers)
    mx.eval(out, [c.preview for c in cache if c.preview is not None])
