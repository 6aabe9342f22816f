"""The prompt's end, seen ahead (``prefill_compact="preview"``).

A prompt longer than the prefill step is compacted chunk by chunk before
its end (the question) exists. ``preview_prompt`` runs the prompt's last
``PREVIEW_TOKENS`` tokens through the model alone, at their own positions,
before the prefill, and hands each layer's cache the queries of the last
``prefill_window`` of them: every chunk compacted before the end arrives is
then scored by them too. They saw only the end, not the text before it, so
they approximate the queries the prefill will compute; the real ones take
over when the end arrives.

Under ``prefill_compact="two_pass"`` the prompt is first prefilled into
copies of the caches, read ahead as above, and the queries its end computes
there, in a compacted context, are the preview instead: the real queries of
a bounded prefill, for the cost of a second one.
"""

import copy
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
    (``prefill_compact`` "preview" or "two_pass"), the prompt is longer than
    its window and than what one chunk holds: with ``prefill_step`` (the
    prefill's chunk; mlx-lm feeds a prompt's last token on its own) a prompt
    of at most ``prefill_step + 1`` tokens is one chunk, which holds its end.
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
    if any(c.wants_preview() and c.config.prefill_compact == "two_pass" for c in cache):
        _first_pass(model, cache, tokens, W, prefill_step)
    else:
        _read_ahead(model, cache, tokens, W)


def _read_ahead(model, cache: List, tokens: mx.array, W: int) -> None:
    """The prompt's last ``PREVIEW_TOKENS`` run alone; their last W queries
    handed to ``cache``."""
    L = tokens.shape[1]
    P = min(L, max(W, PREVIEW_TOKENS))
    layers = [PreviewLayer(c, c.offset + L - P, W) for c in cache]
    body = getattr(model, "model", model)  # the transformer, without the LM head
    with patch():
        out = body(tokens[:, L - P:], cache=layers)
    mx.eval(out, [c.preview for c in cache if c.preview is not None])


class _Recording:
    """A cache seen through: everything is the target's, and the last
    ``window`` queries of its attention calls are kept."""

    def __init__(self, target, window: int):
        self.target, self.window, self.queries = target, window, None

    def __getattr__(self, name):
        return getattr(self.target, name)

    def h2o_attention(self, queries, keys, values, **kwargs):
        self.queries = queries[:, :, -self.window:]
        return self.target.h2o_attention(queries, keys, values, **kwargs)


def _first_pass(model, cache: List, tokens: mx.array, W: int, step: Optional[int]) -> None:
    """Prefill ``tokens`` into copies of ``cache`` (read ahead, chunks of
    ``step``, its last W tokens a call of their own) and hand each cache the
    queries those W tokens computed there."""
    L, body = tokens.shape[1], getattr(model, "model", model)
    copies = copy.deepcopy(list(cache))
    _read_ahead(model, copies, tokens, W)
    step = step or L
    with patch():
        for s in range(0, L - W, step):
            mx.eval(body(tokens[:, s:min(s + step, L - W)], cache=copies))
        ends = [_Recording(c, W) for c in copies]
        mx.eval(body(tokens[:, L - W:], cache=ends))
    for c, end in zip(cache, ends):
        if end.queries is not None:
            c.set_preview(end.queries, c.offset + L - W)
    mx.eval([c.preview for c in cache if c.preview is not None])
