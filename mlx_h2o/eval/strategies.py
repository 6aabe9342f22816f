"""Named KV-cache strategies for the evaluation commands.

A strategy turns a model and a KV budget (``max_kv`` tokens per layer) into a
prompt cache:

- ``baseline``: mlx-lm's ``KVCache`` (unbounded; the reference).
- ``rotating``: mlx-lm's ``RotatingKVCache(max_kv, keep=sink)`` (sliding window
  with attention sinks; StreamingLLM).
- ``h2o-recent`` / ``h2o-balanced`` / ``h2o-heavy``: H2O with the paper's splits
  of 256 (s4 h32 r220, s4 h64 r188, s4 h128 r124), scaled to other budgets by
  keeping the heavy fraction (1/8, 1/4, 1/2) and a sink of 4.
- ``h2o``: H2O with ``H2OConfig``'s own defaults for the split.

Any name takes overrides after a colon, ``name:key=value,key=value``: ``heavy``
(a fraction of max_kv when < 1, else tokens), ``sink``, and any ``H2OConfig``
field (``score=normalized``, ``ema_alpha=0.9``, ...). Score-mode shorthands:
a mode's ``short`` name (mlx_h2o/scores.py) as a suffix, e.g. ``h2o-heavy-acc``,
``h2o-heavy-norm`` (any split).
``layer_budget`` shares the budget between layers as ``make_h2o_cache`` does:
``auto`` (the strategies' default, under which the results were measured: the
shipped layer profile of a packaged model, else uniform), ``uniform`` (max_kv in
every layer: ``make_h2o_cache``'s and the commands' default), a profile file (``mlx-h2o calibrate``), or a statistic calibrated
in-process (``entropy``, ``topk``, ``invtopk``; ``eval/calibrate.py``). An H2O
strategy must be ``calibrated(model, tokenizer)`` before use (``uniform``
excepted). Result keys name the resolved budget, not its spelling: ``h2o-heavy``
on a packaged model and ``h2o-heavy:layer_budget=invtopk`` with the same sizes
share a key; ``h2o-heavy:layer_budget=uniform`` keys as ``h2o-heavy`` did before.
Quantized H2O (``QuantizedH2OKVCache``): ``kv_bits`` (4 or 8), ``kv_group_size``
(32, 64 or 128; default 64) and ``kv_mixed=true`` (heavy hitters at 8 bits, the
recent window at 4), e.g. ``h2o-heavy:kv_bits=8``, ``h2o-heavy:kv_mixed=true``.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from ..budgets import layer_sizes
from ..cache import QuantConfig, quantized_cache_type
from ..config import H2OConfig, config_to_dict
from ..integration.factory import attention_windows, make_h2o_cache, resolve_layer_profile
from ..profiles import LayerProfile
from ..scores import SCORES

SPLITS = {"recent": 1 / 8, "balanced": 1 / 4, "heavy": 1 / 2}
STATISTICS = ("entropy", "topk", "invtopk")  # keys of calibrate.WEIGHTS
LAYER_BUDGETS = ("auto", "uniform") + STATISTICS  # or a profile file (.json)
SCORE_SHORT = {m.short: m.name for m in SCORES.values()}  # h2o-heavy-acc: accumulated
DEFAULT_STRATEGIES = ("baseline", "rotating", "h2o-recent", "h2o-balanced", "h2o-heavy")
_CONFIG_FIELDS = {f.name: f.type for f in dataclasses.fields(H2OConfig)}
_OWN_OPTIONS = ("sink", "heavy", "layer_budget", "kv_bits", "kv_group_size", "kv_mixed")


@dataclass(frozen=True)
class Strategy:
    """A named recipe for a prompt cache at a given KV budget."""

    name: str
    kind: str  # "baseline" | "rotating" | "h2o"
    sink: int = 4
    heavy: float = None  # fraction of max_kv (< 1) or tokens; None: config default
    options: dict[str, Any] = field(default_factory=dict)
    layer_budget: str = "auto"  # LAYER_BUDGETS or a profile path
    profile: LayerProfile = None  # set by calibrated(); None: uniform
    layer_windows: tuple = None  # set by calibrated(): the model's attention windows
    quant: QuantConfig = None  # quantized K/V (QuantizedH2OKVCache); None: dense

    @property
    def bounded(self) -> bool:
        return self.kind != "baseline"

    @property
    def resolved(self) -> bool:
        """Whether the layer budget is known without a model (see ``calibrated``)."""
        return self.kind != "h2o" or self.layer_windows is not None or (
            self.layer_budget == "uniform")

    def h2o_config(self, max_kv: int) -> H2OConfig:
        heavy = self.heavy
        if heavy is not None:
            heavy = int(round(heavy * max_kv)) if heavy < 1 else int(heavy)
        opts = dict(self.options)
        return H2OConfig(max_size=max_kv, sink_size=self.sink, heavy_budget=heavy, **opts)

    def check_budget(self, max_kv: int) -> None:
        """ValueError naming the fix unless this strategy's cache can be made at
        ``max_kv`` tokens a layer (no model needed: commands check it first)."""
        if not self.bounded:
            return
        if max_kv < 1:
            raise ValueError(f"strategy {self.name!r}: a budget is the tokens a layer "
                             "holds: use 1 or more")
        if self.kind == "rotating":
            if max_kv <= self.sink:
                raise ValueError(f"strategy {self.name!r} keeps {self.sink} sink tokens: "
                                 f"use a budget above {self.sink}")
            return
        try:
            self.h2o_config(max_kv)
        except ValueError as e:
            raise ValueError(f"strategy {self.name!r}: {e}") from None
        if self.layer_budget != "uniform" and max_kv < self.sink + 2:
            raise ValueError(f"strategy {self.name!r}: a layer profile needs a budget of "
                             f"at least sink + 2 = {self.sink + 2}")

    def calibrated(self, model, tokenizer=None) -> "Strategy":
        """This strategy with its layer budget resolved for ``model``."""
        if self.kind != "h2o":
            return self
        windows = attention_windows(model)
        if self.layer_budget in STATISTICS:
            from .calibrate import make_profile

            if tokenizer is None:
                raise ValueError(f"strategy {self.name!r}: call calibrated(model, tokenizer) "
                                 "first: calibrating needs the tokenizer")
            profile = make_profile(model, tokenizer, self.layer_budget)
            profile = dataclasses.replace(profile, source=f"calibrated ({self.layer_budget})")
        else:
            profile = resolve_layer_profile(model, self.layer_budget, windows)
        return dataclasses.replace(self, profile=profile, layer_windows=windows)

    def for_model(self, model) -> "Strategy":
        """Resolved for ``model`` if it is not yet (layer budgets that need no tokenizer)."""
        return self if self.resolved else self.calibrated(model)

    def layer_sizes(self, max_kv: int) -> list[int] | None:
        if not self.resolved:
            raise ValueError(f"strategy {self.name!r}: layer_budget={self.layer_budget!r} "
                             "depends on the model: call calibrated(model, tokenizer) first")
        if self.kind != "h2o" or self.profile is None:
            return None
        return layer_sizes(self.profile.weights, self.layer_windows, max_kv, self.sink)

    def describe(self, max_kv: int) -> dict[str, Any]:
        d = {"strategy": self.name, "kind": self.kind, "max_kv": max_kv}
        if self.kind == "rotating":
            d.update(sink=self.sink)
        elif self.kind == "h2o":
            d.update(config_to_dict(self.h2o_config(max_kv)))
            if self.quant is not None:
                d.update(kv_quant=dataclasses.asdict(self.quant))
            if self.profile is not None:
                d.update(layer_budget=self.profile.statistic,
                         layer_sizes=self.layer_sizes(max_kv),
                         layer_weights=list(self.profile.weights),
                         layer_profile=self.profile.name)
        return d

    def key(self, max_kv: int) -> str:
        """A file-name key: the canonical name plus a hash of the resolved H2O config
        and layer sizes, so results saved under other defaults are never reused."""
        if self.kind != "h2o":
            return self.name
        from .results import config_hash

        d = config_to_dict(self.h2o_config(max_kv))
        sizes = self.layer_sizes(max_kv)
        if sizes is not None:
            d["layer_sizes"] = sizes
        if self.quant is not None:
            d["kv_quant"] = dataclasses.asdict(self.quant)
        return f"{self._canonical_name()}-{config_hash(d)[:6]}"

    def _canonical_name(self) -> str:
        """The name with ``layer_budget`` as resolved: dropped when uniform, else
        ``layer_budget=<statistic>`` last (the sizes are in the key's hash)."""
        base, _, opts = self.name.partition(":")
        items = [o for o in opts.split(",") if o and not o.startswith("layer_budget=")]
        if self.profile is not None:
            items.append(f"layer_budget={self.profile.statistic}")
        return base + (":" + ",".join(items) if items else "")

    def make_cache(self, model, max_kv: int) -> list[Any]:
        if not self.resolved:
            return self.calibrated(model).make_cache(model, max_kv)
        if self.kind == "baseline":
            return make_prompt_cache(model)
        if self.kind == "rotating":
            return rotating_cache(model, max_kv, self.sink)
        return make_h2o_cache(model, self.h2o_config(max_kv), quantized_cache_type(self.quant),
                              **self.budget_kwargs(max_kv))

    def budget_kwargs(self, max_kv: int) -> dict[str, Any]:
        """``make_h2o_cache`` arguments for this strategy's resolved layer budget."""
        sizes = self.layer_sizes(max_kv)
        return {"layer_budget": "uniform"} if sizes is None else {"layer_sizes": sizes}


def rotating_cache(model, max_kv: int, sink: int) -> list[Any]:
    """Every attention cache a sliding window of max_kv tokens with ``sink`` kept.

    A model's own sliding-window layers keep their window (capped at max_kv)
    and no sinks, so their attention stays within the window they were trained on.
    """
    caches = make_prompt_cache(model)
    for i, c in enumerate(caches):
        if type(c) is KVCache:
            caches[i] = RotatingKVCache(max_size=max_kv, keep=sink)
        elif type(c) is RotatingKVCache and c.max_size > max_kv:
            caches[i] = RotatingKVCache(max_size=max_kv, keep=0)
    return caches


def parse_strategy(spec: str) -> Strategy:
    """``'h2o-heavy-norm:ema_alpha=0.9'`` -> Strategy."""
    base, _, opts = spec.partition(":")
    parts = base.split("-")
    options = _parse_options(opts, spec)
    sink = int(options.pop("sink", 4))
    heavy = options.pop("heavy", None)
    layer_budget = options.pop("layer_budget", None)
    quant = _quant(options, spec)
    if parts[0] in ("baseline", "rotating") and len(parts) == 1:
        if options or layer_budget is not None or quant is not None:
            raise ValueError(f"strategy {spec!r}: {parts[0]} takes only sink=")
        return Strategy(spec, parts[0], sink=sink)
    if parts[0] != "h2o" or len(parts) > 3:
        raise ValueError(f"unknown strategy {spec!r}; e.g. {', '.join(DEFAULT_STRATEGIES)}")
    rest = parts[1:]
    if rest and rest[-1] in SCORE_SHORT:
        options.setdefault("score", SCORE_SHORT[rest.pop()])
    if rest:
        if rest[0] not in SPLITS or len(rest) > 1:
            raise ValueError(f"strategy {spec!r}: split must be one of {sorted(SPLITS)}")
        heavy = SPLITS[rest[0]] if heavy is None else heavy
    heavy = None if heavy is None else float(heavy)
    layer_budget = "auto" if layer_budget is None else layer_budget
    if layer_budget not in LAYER_BUDGETS and not _is_profile_path(layer_budget):
        raise ValueError(f"strategy {spec!r}: layer_budget must be one of {LAYER_BUDGETS} "
                         "or a profile file (.json, from `mlx-h2o calibrate`)")
    strategy = Strategy(spec, "h2o", sink=sink, heavy=heavy, options=options,
                        layer_budget=layer_budget, quant=quant)
    strategy.h2o_config(256)  # validate the options now, not mid-run
    return strategy


def _quant(options: dict[str, Any], spec: str):
    """Pop the K/V quantization options: a QuantConfig, or None (dense)."""
    bits, group = options.pop("kv_bits", None), options.pop("kv_group_size", 64)
    mixed = options.pop("kv_mixed", False)
    if group != 64 and bits is None and not mixed:
        raise ValueError(f"strategy {spec!r}: kv_group_size needs kv_bits= or kv_mixed=true")
    if not isinstance(mixed, bool):
        raise ValueError(f"strategy {spec!r}: kv_mixed must be true or false, got {mixed!r}")
    try:
        return QuantConfig.from_flags(bits, group, mixed)
    except (TypeError, ValueError) as e:
        raise ValueError(f"strategy {spec!r}: {e}") from None


def _is_profile_path(value) -> bool:
    return isinstance(value, str) and value.endswith(".json")


def _parse_options(opts: str, spec: str) -> dict[str, Any]:
    out = {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"strategy {spec!r}: option {item!r} is not key=value")
        if key not in _OWN_OPTIONS and key not in _CONFIG_FIELDS:
            raise ValueError(f"strategy {spec!r}: unknown option {key!r}")
        out[key] = _convert(value)
    return out


def _convert(value: str):
    low = value.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value

