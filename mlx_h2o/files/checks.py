"""Checks of a cache file's contents before ``load_prompt_cache`` builds caches.

Each check raises ValueError naming the problem and the fix; files/io.py
adds the file name. ``read_header``: the header's structure; ``check_h2o``:
one H2O cache's meta state and arrays (shapes, counts, positions);
``check_model``: the caches against the model(s) they are loaded for.
"""

import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from ..config import H2OConfig, check_window_size, config_from_dict
from ..cache import H2OKVCache
from ..cache.quantized import MixedPrecisionH2OKVCache, QuantConfig, QuantizedH2OKVCache
from ..integration.factory import make_h2o_cache

REBUILD = "delete it and save the cache again"
Heads = Optional[Tuple[int, int, int]]  # (n_kv_heads, key head_dim, value head_dim)


def corrupt(problem: str) -> ValueError:
    return ValueError(f"{problem}: the file is damaged or was edited; {REBUILD}")


def read_header(header: Dict[str, str], arrays: Dict[str, mx.array]):
    """(classes, lengths, scalars, meta states, metadata), each checked: one
    entry per cache, and every state item stored once (array or scalar)."""
    fields = {}
    for key in ("classes", "lengths", "scalars", "meta_states", "metadata"):
        try:
            fields[key] = json.loads(header[key])
        except (KeyError, TypeError, ValueError):
            raise corrupt(f"its header field {key!r} is missing or not JSON") from None
    classes, lengths, metas = (
        fields["classes"],
        fields["lengths"],
        fields["meta_states"],
    )
    if not (
        _list_of(classes, str) and _list_of(lengths, int) and isinstance(metas, list)
    ):
        raise corrupt(
            "its header lists of classes, state lengths and meta states are malformed"
        )
    if not len(classes) == len(lengths) == len(metas):
        raise corrupt(
            f"its header lists {len(classes)} classes, {len(lengths)} state lengths "
            f"and {len(metas)} meta states (one each per layer)"
        )
    scalars = fields["scalars"]
    if not isinstance(scalars, dict) or not isinstance(fields["metadata"], dict):
        raise corrupt("its header's scalars or metadata are not JSON objects")
    expected = {f"{i}.{j}" for i, n in enumerate(lengths) for j in range(max(n, 0))}
    held = set(arrays) | set(scalars)
    if any(n < 0 for n in lengths) or held != expected or set(arrays) & set(scalars):
        missing, extra = sorted(expected - held), sorted(held - expected)
        raise corrupt(
            f"its state items disagree with the header (missing {missing[:5]}, "
            f"unexpected {extra[:5]})"
        )
    return classes, lengths, scalars, metas, fields["metadata"]


def _list_of(value, kind) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, kind) and not isinstance(v, bool) for v in value
    )


def _layouts() -> Dict[type, str]:
    return {
        H2OKVCache: "dense",
        QuantizedH2OKVCache: "quantized",
        MixedPrecisionH2OKVCache: "mixed",
    }


def check_h2o(cls: type, state: List[Any], meta: Any) -> Heads:
    """Check one cache of a class this package defines; other classes: None
    (their ``from_state`` decides). Returns its heads, None when empty."""
    kind = _layouts().get(cls)
    if kind is None:
        return None
    fields = 5 if kind == "dense" else 6
    if not _list_of(meta, str) or len(meta) != fields:
        raise corrupt(
            f"its meta state must be {fields} strings, got {repr(meta)[:200]}"
        )
    offset, evicted = _count("offset", meta[0]), _count("evicted", meta[1])
    try:
        check_window_size(int(meta[2]) if meta[2] else None)
        config = config_from_dict(json.loads(meta[4]))
        quant = _quant_config(json.loads(meta[5])) if kind != "dense" else None
    except (TypeError, ValueError) as e:
        raise corrupt(f"its meta state holds an invalid window or config ({e})") from e
    if quant is not None and quant.mixed != (kind == "mixed"):
        raise corrupt(f"its quantization {quant} does not fit a {kind} cache")
    if not state:
        if offset or evicted:
            raise corrupt(f"it holds no tokens, yet offset={offset}, evicted={evicted}")
        return None
    if len(state) < 3 or not all(isinstance(a, mx.array) for a in state):
        raise corrupt(
            f"its state must be K/V arrays, positions, score and count; "
            f"got {len(state)} items"
        )
    *kv, positions, score, count = state
    _check_meta_arrays(positions, score, count, config, offset, evicted)
    if kind == "dense":
        return _dense_heads(kv, positions.shape)
    return _quantized_heads(kv, positions.shape, config, quant, kind == "mixed")


def _quant_config(d):
    if not isinstance(d, dict):
        raise TypeError(
            f"a quantization must be a dict of QuantConfig fields, got {d!r}"
        )
    return QuantConfig(**d)


def _count(name: str, text: str) -> int:
    if not text.isdigit():
        raise corrupt(f"its meta state's {name} {text!r} is not a count")
    return int(text)


def _check_meta_arrays(positions, score, count, config: H2OConfig, offset, evicted):
    if positions.ndim != 3 or positions.dtype != mx.int32:
        raise corrupt(
            f"its positions must be (B, n_kv_heads, slots) int32, got "
            f"{positions.shape} {positions.dtype}"
        )
    for name, a in (("score", score), ("count", count)):
        if a.shape != positions.shape or a.dtype != mx.float32:
            raise corrupt(
                f"its {name} is {a.shape} {a.dtype}, its positions "
                f"{positions.shape}: both must be that shape, float32"
            )
    for name, a in (("score", score), ("count", count)):
        if not np.isfinite(np.array(a)).all():
            raise corrupt(f"its {name} holds NaN or infinite values")
    n = positions.shape[2]
    # prefill_compact="prompt": a prompt grows past max_size until the first
    # decode step compacts it.
    if n > config.max_size and config.prefill_compact != "prompt":
        raise corrupt(
            f"it holds {n} tokens, above max_size={config.max_size} of its config"
        )
    # Between two batch evictions the evicted slots that decode steps still
    # attend are saved too, past the offset - evicted slots in use.
    lingering = n + evicted - offset
    if lingering < 0 or lingering > (config.evict_batch if config.evict_batch > 1 else 0):
        raise corrupt(
            f"offset={offset} must count the {n} tokens held plus the {evicted} evicted"
        )
    pos = np.array(positions).reshape(-1, n)
    if n and (pos.min() < 0 or pos.max() >= offset):
        raise corrupt(
            f"its positions span {pos.min()}..{pos.max()}, outside 0..{offset - 1} "
            f"(offset={offset})"
        )
    if n > 1 and (np.diff(np.sort(pos, axis=-1), axis=-1) == 0).any():
        raise corrupt("its positions repeat a token within a (sequence, head) row")


def _slots(arrays, shape, what):
    """Every array (B, Hk, slots, ...) with the positions' B and Hk and ``slots``."""
    for a in arrays:
        if a.ndim != 4 or tuple(a.shape[:3]) != tuple(shape):
            raise corrupt(
                f"its {what} arrays are {[tuple(x.shape) for x in arrays]}, "
                f"their first dims must be (B, n_kv_heads, slots) = {tuple(shape)}"
            )


def _dense_heads(kv, shape) -> Heads:
    if len(kv) != 2:
        raise corrupt(f"a dense cache stores 2 K/V arrays, this one {len(kv)}")
    _slots(kv, shape, "K/V")
    keys, values = kv
    if not mx.issubdtype(keys.dtype, mx.floating) or keys.dtype != values.dtype:
        raise corrupt(
            f"its K/V dtypes {keys.dtype} / {values.dtype} must be one float type"
        )
    return shape[1], keys.shape[-1], values.shape[-1]


def _quantized_heads(kv, shape, config, quant, mixed) -> Heads:
    """Triples (w, scales, biases) of K then V per zone, the zones as MixedKV
    fetches them: the non-empty ones of [0, split) and [split, n)."""
    B, Hk, n = shape
    zones = [(quant.bits, n)]
    if mixed:
        split = config.max_size - config.recent_budget
        zones = [
            (b, m)
            for b, m in ((quant.bits, min(n, split)), (quant.recent_bits, n - split))
            if m > 0
        ]
    if len(kv) != 6 * len(zones):
        raise corrupt(
            f"it stores {len(kv)} quantized arrays, {6 * len(zones)} expected "
            f"(K and V triples for {len(zones)} zone(s))"
        )
    heads = set()
    for z, (bits, m) in enumerate(zones):
        arrays = kv[6 * z : 6 * z + 6]
        _slots(arrays, (B, Hk, m), "quantized K/V")
        for w, s, b in (arrays[:3], arrays[3:]):
            D = s.shape[-1] * quant.group_size
            if (
                w.dtype != mx.uint32
                or s.shape != b.shape
                or w.shape[-1] * 32 != D * bits
            ):
                raise corrupt(
                    f"its {bits}-bit triple {w.shape} {w.dtype} / {s.shape} / "
                    f"{b.shape} does not hold group_size={quant.group_size} data"
                )
        heads.add(
            (
                Hk,
                arrays[1].shape[-1] * quant.group_size,
                arrays[4].shape[-1] * quant.group_size,
            )
        )
    if len(heads) > 1:
        raise corrupt(f"its zones disagree on the head dims: {sorted(heads)}")
    return heads.pop() if heads else None


def check_model(cache: List[Any], heads: List[Heads], models: Sequence[Any]) -> None:
    """ValueError unless ``cache`` is what ``make_h2o_cache`` builds for
    ``models`` (a model, then a draft model: their caches in that order):
    the layer count, each layer's kind (H2O with the layer's window, or the
    cache the model made), and each H2O layer's KV heads and head dims."""
    expected = [e for m in models for e in _expected_layers(m)]
    if len(cache) != len(expected):
        raise ValueError(
            f"it holds {len(cache)} layers, the model has {len(expected)}: it was "
            "saved from another model; delete it or pass the matching --model"
        )
    for i, (c, h, (kinds, want)) in enumerate(zip(cache, heads, expected)):
        if _kind(c) not in kinds:
            raise ValueError(
                f"its layer {i} is {_show(_kind(c))}, the model's layer {i} takes "
                f"{' or '.join(map(_show, kinds))}: it was saved from another model "
                "(or other settings); delete it or pass the matching --model"
            )
        if h is not None and want is not None and h != want:
            raise ValueError(
                f"its layer {i} holds (n_kv_heads, key dim, value dim) = {h}, the "
                f"model's layer {i} makes {want}: it was saved from another model; "
                "delete it or pass the matching --model"
            )


def _expected_layers(model) -> List[Tuple[tuple, Heads]]:
    """Per cache of ``model``: (kinds it may hold, heads its K/V have)."""
    own = _own_caches(model)
    try:
        h2o = make_h2o_cache(model, H2OConfig(max_size=16), layer_budget="uniform")
    except ValueError:  # no attention to replace, or not supported: only its own caches
        h2o = own
    probe = _own_caches(model)
    # The K/V shapes of one token: a lazy graph, never evaluated.
    model(mx.zeros((1, 1), mx.int32), cache=probe)
    return [
        (tuple(dict.fromkeys((_kind(b), _kind(a)))), _heads(p))
        for a, b, p in zip(own, h2o, probe)
    ]


def _own_caches(model) -> List[Any]:
    """The caches the model makes itself (as make_h2o_cache starts from)."""
    if hasattr(model, "make_cache"):
        return model.make_cache()
    return [KVCache() for _ in model.layers]


def _kind(cache) -> tuple:
    if hasattr(cache, "h2o_attention"):
        return ("H2O", cache.window_size)
    subs = getattr(cache, "caches", None)
    if isinstance(subs, (list, tuple)):
        return (type(cache).__name__, tuple(_kind(s) for s in subs))
    return (type(cache).__name__,)


def _show(kind: tuple) -> str:
    if kind[0] == "H2O":
        return "an H2O cache" + (
            f" (window {kind[1]})" if kind[1] else " (full attention)"
        )
    return kind[0]


def _heads(cache) -> Heads:
    keys, values = getattr(cache, "keys", None), getattr(cache, "values", None)
    if (
        not isinstance(keys, mx.array)
        or not isinstance(values, mx.array)
        or keys.ndim != 4
    ):
        return None
    return keys.shape[1], keys.shape[-1], values.shape[-1]
