"""Quantized H2O caches: eviction bounds the tokens kept, quantization shrinks each.

``QuantizedH2OKVCache`` stores K/V as MLX affine-quantized triples at one
width. ``MixedPrecisionH2OKVCache`` keeps sinks, pinned tokens and heavy
hitters at ``bits`` and the recent window at ``recent_bits`` (see
docs/DESIGN.md, "Quantized storage", for how a token changes zone and what it costs). The slot
bookkeeping (positions, scores, victims, compaction, trim) is the dense
cache's; only the storage differs.
"""

import functools
import json
from dataclasses import asdict, dataclass
from typing import Optional

import mlx.core as mx

from ..config import H2OConfig, check_int, config_from_dict
from ..kernels.quantized_reference import BITS, check_quantization
from .h2o import H2OKVCache
from .mixed_storage import MixedKV, mixed_evict
from .quantized_storage import QuantizedKV


@dataclass(frozen=True)
class QuantConfig:
    """K/V quantization of an H2O cache (MLX affine quantization).

    ``bits`` is the width of every token, or with ``recent_bits`` set, of
    sinks / pinned tokens / heavy hitters, while the recent window is stored at
    ``recent_bits`` (mixed precision; must be narrower). Groups of
    ``group_size`` values along head_dim share a float scale and bias.
    Widths: those the quantized kernels read, ``BITS`` = (2, 4, 8); group
    sizes: ``GROUP_SIZES`` = (32, 64, 128) (kernels/quantized_reference.py).
    """

    bits: int = 8
    group_size: int = 64
    recent_bits: int | None = None

    def __post_init__(self):
        check_int("bits", self.bits)
        check_int("group_size", self.group_size)
        if self.recent_bits is not None:
            check_int("recent_bits", self.recent_bits)
        check_quantization(self.bits, self.group_size)
        if self.recent_bits is not None:
            if self.recent_bits not in BITS:
                raise ValueError(
                    f"recent_bits={self.recent_bits} is not supported; use one of {BITS}"
                )
            if self.recent_bits >= self.bits:
                raise ValueError(
                    f"recent_bits={self.recent_bits} must be narrower than bits="
                    f"{self.bits}: the recent window is the low-precision zone"
                )

    @property
    def mixed(self) -> bool:
        return self.recent_bits is not None

    @classmethod
    def from_flags(
        cls, kv_bits: int | None, group_size: int = 64, mixed: bool = False
    ) -> Optional["QuantConfig"]:
        """The eval strategies' mapping (``kv_bits``, ``kv_group_size``,
        ``kv_mixed``; mlx_h2o/eval/strategies.py). None (dense cache) when
        neither bits nor mixed. The CLI's flags: cli/generate.py."""
        if mixed:
            if kv_bits not in (None, 8):
                raise ValueError(
                    "kv_mixed keeps heavy hitters at 8 bits and the recent "
                    f"window at 4 bits; leave kv_bits unset or 8 (got {kv_bits})"
                )
            return cls(bits=8, group_size=group_size, recent_bits=4)
        if kv_bits is None:
            return None
        return cls(bits=kv_bits, group_size=group_size)


class QuantizedH2OKVCache(H2OKVCache):
    """H2O cache whose K/V slots hold affine-quantized triples (one width).

    ``update_and_fetch`` returns ``(w, scales, biases)`` triples like mlx-lm's
    ``QuantizedKVCache``; attention goes through ``h2o_attention`` (routing
    must be on), which reads them with the quantized kernels.
    """

    storage_cls = QuantizedKV

    def __init__(
        self,
        config: H2OConfig,
        window_size: int | None = None,
        quant: QuantConfig = QuantConfig(),
        decode: str = "auto",
    ):
        if not isinstance(quant, QuantConfig):
            raise TypeError(f"quant must be a QuantConfig, got {type(quant).__name__}")
        self._check_quant(quant, config)
        self.quant = quant
        # The base class builds storage with storage_cls(): bind our widths.
        self.storage_cls = self._make_storage
        super().__init__(config, window_size, decode)

    @staticmethod
    def _check_quant(quant, config):
        if quant.mixed:
            raise ValueError("mixed precision needs MixedPrecisionH2OKVCache")

    def _make_storage(self):
        return QuantizedKV(self.quant.bits, self.quant.group_size)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        check_quantization(self.quant.bits, self.quant.group_size, keys.shape[-1])
        check_quantization(self.quant.bits, self.quant.group_size, values.shape[-1])
        return super().update_and_fetch(keys, values)

    @property
    def meta_state(self):
        return (*super().meta_state, json.dumps(asdict(self.quant)))

    @meta_state.setter
    def meta_state(self, v):
        H2OKVCache.meta_state.fset(self, v[:-1])  # ours is the last item
        self.quant = QuantConfig(**json.loads(v[-1]))

    @classmethod
    def from_state(cls, state, meta_state) -> "QuantizedH2OKVCache":
        cfg = config_from_dict(json.loads(meta_state[4]))
        window, quant = meta_state[2], QuantConfig(**json.loads(meta_state[-1]))
        obj = cls(cfg, int(window) if window else None, quant)
        obj.meta_state = meta_state
        obj.state = state
        return obj


class MixedPrecisionH2OKVCache(QuantizedH2OKVCache):
    """Sinks, pinned tokens and heavy hitters at ``quant.bits``; the recent
    window at ``quant.recent_bits``.

    Slots [0, sink + heavy) are the high-precision zone, the rest the recent
    zone. Tokens are quantized once, at the width of the slot they are
    written to. A decode step that evicts a heavy hitter moves the oldest
    recent token into the freed high slot (widened exactly: it keeps the
    values it was written with) and writes the new token into its slot.
    """

    storage_cls = MixedKV  # its eviction moves a token between zones (no
    # fold kernel, no batched eviction: cache/decode/__init__.py)

    @staticmethod
    def _check_quant(quant, config):
        if not quant.mixed:
            raise ValueError(
                "MixedPrecisionH2OKVCache needs QuantConfig(recent_bits=...)"
            )

    def _make_storage(self):
        q, cfg = self.quant, self.config
        return MixedKV(
            q.bits, q.recent_bits, q.group_size, cfg.max_size - cfg.recent_budget
        )

    def write_into_victim(self, keys, values):
        """The policy's victim leaves; a high-zone victim's slot takes the
        oldest recent token, whose slot takes this one (mixed_evict)."""
        *meta, target = mixed_evict(self.config, self.window_size, self.kv, self.positions,
                                    self.score, self.count, self.slots_used, keys, values,
                                    self.offset)
        self.positions, self.score, self.count = meta
        self.meta_pending = False
        self.evicted += 1
        return target


def quantized_cache_type(quant: QuantConfig | None):
    """``cache_type`` for ``make_h2o_cache``: ``cache_type(config, window_size=...)``.

    None gives the dense ``H2OKVCache``.
    """
    if quant is None:
        return H2OKVCache
    cls = MixedPrecisionH2OKVCache if quant.mixed else QuantizedH2OKVCache
    return functools.partial(cls, quant=quant)
