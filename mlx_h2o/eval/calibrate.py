"""Per-layer budget weights from attention statistics on calibration text.

The statistics come from ``profile_model`` (one full forward pass) over windows
drawn with their own seed (``CALIBRATION``), not the evaluation windows, so
sizes are fixed before any evaluation sample is seen. Weights per statistic:

- ``entropy``: exp(mean entropy) = the effective number of keys a query attends.
- ``topk``: 1 - share of the accumulated attention held by the top 10% of keys.
- ``invtopk``: that share itself: concentrated layers get more slots (the
  opposite of PyramidKV's rule; measured better on SmolLM2, docs/RESULTS.md,
  per-layer budgets). The statistic of the shipped layer profiles.

``make_profile`` packs the weights as a ``LayerProfile`` (``mlx-h2o calibrate``).
"""

import math
from typing import Any, Optional

import mlx.core as mx
import mlx_lm

from ..integration.factory import attention_windows, model_name
from ..profiles import LayerProfile
from .profile import profile_model

CALIBRATION = {"corpus": "austen", "num_samples": 4, "seq_len": 512, "seed": 1234}
DEFAULT_STATISTIC = "invtopk"
WEIGHTS = {
    "entropy": lambda row: math.exp(row["entropy"]),
    "topk": lambda row: 1.0 - row["topk_share"],
    "invtopk": lambda row: 1.0 - round(1.0 - row["topk_share"], 6),  # as first run
}
_ROWS: dict[tuple, list[dict[str, Any]]] = {}  # calibration profiles by (model id, ...)


def calibration_spec(corpus: Optional[str] = None) -> dict[str, Any]:
    """``CALIBRATION`` with another corpus (None: the default)."""
    return dict(CALIBRATION, corpus=corpus or CALIBRATION["corpus"])


def layer_weights(model, tokenizer, stat: str, calibration: Optional[dict] = None
                  ) -> tuple[float, ...]:
    """One weight per attention layer from the calibration profile (memoised per model)."""
    if stat not in WEIGHTS:
        raise ValueError(f"layer_budget={stat!r}: use one of {sorted(WEIGHTS)}")
    c = CALIBRATION if calibration is None else calibration
    key = (id(model),) + tuple(c[k] for k in CALIBRATION)
    if key not in _ROWS:
        from .corpora import load_corpus, sample_token_windows

        tokens = sample_token_windows(tokenizer, load_corpus(c["corpus"]),
                                      c["num_samples"], c["seq_len"], c["seed"], bos=True)
        _ROWS[key] = profile_model(model, tokens)
    return tuple(round(WEIGHTS[stat](r), 6) for r in _ROWS[key])


def make_profile(model, tokenizer, stat: str = DEFAULT_STATISTIC,
                 calibration: Optional[dict] = None, model_label: str = "",
                 command: str = "") -> LayerProfile:
    """A ``LayerProfile`` of ``model`` measured on ``calibration`` text."""
    c = dict(CALIBRATION if calibration is None else calibration)
    weights = layer_weights(model, tokenizer, stat, c)
    windows = attention_windows(model)
    made_by = {"command": command, "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
               "mlx_h2o": _version(), "device": str(mx.default_device())}
    return LayerProfile(statistic=stat, weights=weights, attention_layers=len(windows),
                        windows=windows, model=model_label, model_type=model_name(model),
                        calibration=c, made_by=made_by)


def _version() -> str:
    from .. import __version__

    return __version__
