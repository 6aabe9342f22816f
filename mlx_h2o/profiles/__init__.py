"""Layer profiles: one budget weight per attention layer, saved as JSON.

A profile says how to share a KV budget between a model's attention layers:
layer i gets a max_size in proportion to ``weights[i]`` (``budgets.layer_sizes``)
at the memory of the uniform budget. ``mlx-h2o calibrate`` measures the
weights on calibration text (``mlx_h2o.eval.calibrate``) and writes a profile;
this folder ships one per packaged model (``<name>.json``), which
``make_h2o_cache(..., layer_budget="auto")`` uses when the model was loaded by
``mlx_h2o.models.load_model`` under that name. Reading and checking only: no
model, no mlx.
"""

import json
import math
import os
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Optional, Union

from ..jsonfile import write_json

FORMAT = "mlx-h2o-layer-profile/1"
# Set by mlx_h2o.models.load_model on a packaged model it loaded (its registry name).
PACKAGED_ATTR = "mlx_h2o_packaged_model"
_FIX = "make a new one with `mlx-h2o calibrate --model MODEL --out FILE`"


@dataclass(frozen=True)
class LayerProfile:
    """Budget weights of one model's attention layers, in layer order.

    ``windows``: each layer's sliding window (None: full attention), checked
    against the model the profile is used with. ``source``: where it was read
    from (not saved).
    """

    statistic: str
    weights: tuple
    attention_layers: int
    windows: tuple
    model: str = ""
    model_type: str = ""
    calibration: dict = field(default_factory=dict)
    made_by: dict = field(default_factory=dict)
    source: str = ""

    def __post_init__(self):
        where = f"layer profile {self.source or self.model or '(unnamed)'}"
        if not isinstance(self.statistic, str) or not self.statistic:
            raise ValueError(f"{where}: 'statistic' must be a non-empty string; {_FIX}")
        if not isinstance(self.attention_layers, int) or self.attention_layers < 1:
            raise ValueError(f"{where}: 'attention_layers' must be an int >= 1; {_FIX}")
        weights = tuple(self.weights)
        if len(weights) != self.attention_layers:
            raise ValueError(
                f"{where}: {len(weights)} weights for attention_layers="
                f"{self.attention_layers}; {_FIX}"
            )
        if not all(_is_number(w) and math.isfinite(w) and w >= 0 for w in weights) or not (
            sum(weights) > 0
        ):
            raise ValueError(
                f"{where}: weights must be finite numbers >= 0, not all 0; got "
                f"{list(weights)}; {_FIX}"
            )
        windows = tuple(self.windows)
        if len(windows) != self.attention_layers or not all(
            w is None or (isinstance(w, int) and w >= 1) for w in windows
        ):
            raise ValueError(
                f"{where}: 'windows' must hold one int >= 1 or null per attention "
                f"layer ({self.attention_layers}); {_FIX}"
            )
        object.__setattr__(self, "weights", tuple(float(w) for w in weights))
        object.__setattr__(self, "windows", windows)

    @property
    def name(self) -> str:
        return self.source or f"{self.model} ({self.statistic})"

    def check_model(self, model_type: str, windows) -> None:
        """ValueError unless a model with these attention layers can use the profile."""
        windows = tuple(windows)
        problem = None
        if len(windows) != self.attention_layers:
            problem = (f"the profile has {self.attention_layers} attention layers, "
                       f"the model {len(windows)}")
        elif windows != self.windows:
            problem = f"sliding windows differ: profile {self.windows}, model {windows}"
        elif self.model_type and model_type and model_type != self.model_type:
            problem = f"model_type differs: profile {self.model_type!r}, model {model_type!r}"
        if problem:
            raise ValueError(
                f"layer profile {self.name} does not fit this model ({problem}); "
                f"{_FIX}, or use layer_budget='uniform'"
            )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["source"]
        d.update(weights=list(self.weights), windows=list(self.windows))
        order = ("model", "model_type", "statistic", "attention_layers", "windows",
                 "weights", "calibration", "made_by")
        return {"format": FORMAT, **{k: d[k] for k in order}}


def _is_number(w) -> bool:
    return isinstance(w, (int, float)) and not isinstance(w, bool)


def profile_from_dict(d: Any, source: str = "") -> LayerProfile:
    """A LayerProfile from parsed JSON; ValueError naming ``source`` when malformed."""
    where = f"layer profile {source or '(dict)'}"
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        got = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise ValueError(f"{where}: not a layer profile (format {got!r}, expected "
                         f"{FORMAT!r}); {_FIX}")
    known = {"statistic", "weights", "attention_layers", "windows", "model",
             "model_type", "calibration", "made_by"}
    missing = {"statistic", "weights", "attention_layers", "windows"} - d.keys()
    if missing:
        raise ValueError(f"{where}: missing {sorted(missing)}; {_FIX}")
    if not isinstance(d["weights"], list) or not isinstance(d["windows"], list):
        raise ValueError(f"{where}: 'weights' and 'windows' must be lists; {_FIX}")
    return LayerProfile(**{k: v for k, v in d.items() if k in known}, source=source)


def load_profile(path: Union[str, os.PathLike]) -> LayerProfile:
    """Read a profile file; ValueError (naming the file and the fix) when it is bad."""
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"layer profile {path} does not exist; {_FIX}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"layer profile {path} is not readable JSON ({e}); {_FIX}") from None
    return profile_from_dict(d, str(path))


def save_profile(profile: LayerProfile, path: Union[str, os.PathLike]) -> Path:
    """Write atomically: a temp file beside ``path``, then rename; nothing left on failure."""
    path = Path(path)
    write_json(path, profile.to_dict())
    return path


def shipped_profile(name: str) -> Optional[LayerProfile]:
    """The profile shipped for packaged model ``name``, or None."""
    res = resources.files(__name__) / f"{name}.json"
    if not res.is_file():
        return None
    return profile_from_dict(json.loads(res.read_text()), f"mlx_h2o/profiles/{name}.json")


def packaged_name(model) -> Optional[str]:
    """The packaged-model name ``load_model`` recorded on ``model`` (None: not one)."""
    name = getattr(model, PACKAGED_ATTR, None)
    return name if isinstance(name, str) else None
