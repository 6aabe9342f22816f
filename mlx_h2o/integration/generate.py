"""Generation with H2O caches: mlx-lm's generate / stream_generate, routed."""

from typing import Any, Generator, List, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..config import H2OConfig
from .factory import make_h2o_cache
from .preview import MLX_LM_PREFILL_STEP, preview_prompt, preview_window
from .routing import patch


def _h2o_cache(model, draft_model, h2o_config, kwargs) -> Optional[List[Any]]:
    cache = kwargs.pop("prompt_cache", None)
    layer_budget = kwargs.pop("layer_budget", "uniform")
    if h2o_config is None:
        return cache
    if kwargs.get("max_kv_size") is not None:
        raise ValueError(
            "max_kv_size (mlx-lm's rotating cache) and h2o_config both bound the "
            "cache: pass only h2o_config (its max_size is the budget)"
        )
    if kwargs.get("kv_bits") is not None:
        raise ValueError(
            "kv_bits quantizes mlx-lm's cache, not H2O's: use a quantized H2O "
            "cache (mlx_h2o.cache.quantized) for bounded and quantized KV"
        )
    if cache is not None:
        raise ValueError("pass either prompt_cache or h2o_config, not both")
    cache = make_h2o_cache(model, h2o_config, layer_budget=layer_budget)
    if draft_model is not None:
        cache = cache + make_h2o_cache(draft_model, h2o_config, layer_budget=layer_budget)
    return cache


def _previewed(model, tokenizer, prompt, cache, draft_model, step):
    """The prompt as token ids, its end previewed into ``cache`` where the
    caches ask for it (``prefill_compact="preview"``); else as given."""
    if cache is None or not preview_window(cache):
        return prompt
    if not isinstance(prompt, mx.array):
        if isinstance(prompt, str):  # as mlx_lm.stream_generate encodes it
            tokenizer = (tokenizer if isinstance(tokenizer, TokenizerWrapper)
                         else TokenizerWrapper(tokenizer))
            bos = tokenizer.bos_token
            prompt = tokenizer.encode(prompt, add_special_tokens=bos is None
                                      or not prompt.startswith(bos))
        prompt = mx.array(prompt)
    n = len(model.layers)
    preview_prompt(model, cache[:n], prompt, step)
    if draft_model is not None:
        preview_prompt(draft_model, cache[n:], prompt, step)
    return prompt


def stream_generate(
    model: nn.Module,
    tokenizer,
    prompt,
    max_tokens: int = 256,
    h2o_config: Optional[H2OConfig] = None,
    **kwargs,
) -> Generator[Any, None, None]:
    """``mlx_lm.stream_generate`` with H2O caches built from ``h2o_config``.

    Routing is enabled only while each response is computed. Pass
    ``prompt_cache=`` (from ``make_h2o_cache``) instead to keep the cache and
    read its stats afterwards. ``layer_budget=`` ("uniform" by default:
    ``h2o_config.max_size`` tokens in every layer; "auto" or a profile path)
    goes to ``make_h2o_cache``.
    """
    draft = kwargs.get("draft_model")
    cache = _h2o_cache(model, draft, h2o_config, kwargs)
    prompt = _previewed(model, tokenizer, prompt, cache, draft,
                        kwargs.get("prefill_step_size", MLX_LM_PREFILL_STEP))
    responses = mlx_lm.stream_generate(
        model, tokenizer, prompt, max_tokens=max_tokens, prompt_cache=cache, **kwargs
    )
    while True:
        with patch():
            response = next(responses, None)
        if response is None:
            return
        yield response


def generate(
    model: nn.Module,
    tokenizer,
    prompt,
    verbose: bool = False,
    h2o_config: Optional[H2OConfig] = None,
    **kwargs,
) -> str:
    """``mlx_lm.generate`` with H2O caches (see ``stream_generate``)."""
    draft = kwargs.get("draft_model")
    cache = _h2o_cache(model, draft, h2o_config, kwargs)
    prompt = _previewed(model, tokenizer, prompt, cache, draft,
                        kwargs.get("prefill_step_size", MLX_LM_PREFILL_STEP))
    with patch():
        return mlx_lm.generate(
            model, tokenizer, prompt, verbose=verbose, prompt_cache=cache, **kwargs
        )
