"""The compiled CPU decode step: attention, score fold and next victim in one call.

Op by op, a decode step is ~90 MLX primitives per layer and token, each with
its own scheduling cost (~7 us of CPU time on a 2-core machine). On the CPU
the evicting step runs as one ``mx.compile`` call (cache/ops_step.py's
``compiled_step``: traced once per shape, elementwise ops fused), which also
picks the next victim, and a decode step that appended its token and folds
now (sliding-window layers, EMA modes) as ``compiled_fill``. Elsewhere (a
GPU stream, masks, attention sinks) the reference step runs.
"""

import mlx.core as mx

from ...kernels import H2OFold
from ..mixed_storage import compiled_mixed_evict
from ..ops_step import compiled_fill, compiled_step, int_array, written_input, zone_arrays
from .reference import ReferenceStep


class CompiledStep(ReferenceStep):
    kind = "compiled"

    def attend(self, queries, keys, values, scale, mask, sinks):
        c = self.cache
        if self.compiles(mask, sinks):
            if c.written_slot is not None and c.slots_used == c.kv.capacity:
                return self.evict_attend(queries, keys, values, scale)
            if self.fills():
                return self.fill(queries, scale)
        return super().attend(queries, keys, values, scale, mask, sinks)

    def compiles(self, mask, sinks) -> bool:
        """No mask but the layer's own window, on the CPU, over buffers whose
        metadata is as long as they are."""
        c = self.cache
        return (mask is None and sinks is None and mx.default_device() == mx.cpu
                and self.attends() is not None
                and c.kv.capacity == c.slot_metadata()[0].shape[2])

    def attends(self):
        """What the compiled calls attend: the storage's group kind
        (ops_step.attention_for)."""
        return self.cache.kv.group_kind

    def fills(self) -> bool:
        """The token was appended with its metadata; it folds now."""
        c = self.cache
        return (c.written_slot is None and not c.meta_pending and not c.lingering
                and c.slots_used <= c.max_size)

    def evict_attend(self, queries, keys, values, scale):
        """The evicting step in one compiled call; it picks the next token's
        victim, which the next update writes into."""
        c = self.cache
        cfg, kind = c.config, self.attends()
        if kind[0] == "quantized":
            keys, values = c.kv.triples(keys, values)
        step = compiled_step(cfg, float(scale), c.window_size, kind)
        out, *state = step(
            queries, keys, values, *c.slot_metadata(), c.written_slot,
            mx.array(c.offset, mx.int32), *zone_arrays(cfg.sink_size, cfg.recent_budget),
            written_input(c.new_score))
        self.take(H2OFold(*state))
        return c.with_metadata(out)

    def fill(self, queries, scale):
        c = self.cache
        fill = compiled_fill(c.config, float(scale), c.window_size, self.attends())
        keys, values = self.fill_inputs()
        out, score, count = fill(queries, keys, values, *c.slot_metadata(),
                                 mx.array(c.slots_used, mx.int32), mx.array(c.offset, mx.int32))
        c.set_slot_metadata(c.slot_metadata()[0], score, count)
        c.pending = False
        return c.with_metadata(out)

    def fill_inputs(self):
        """K / V as the compiled fill reads them: the whole buffers."""
        return self.cache.kv.keys, self.cache.kv.values


class MixedCompiledStep(CompiledStep):
    """The compiled steps of a mixed-precision cache: an eviction moves the
    oldest recent token into a freed high-precision slot (compiled on its
    own, cache/quantized.py), then attention and fold run as one fill."""

    def place(self, keys, values):
        c = self.cache
        if c.slots_used == c.max_size and self.evicts_compiled():
            c.written_slot, c.next_victim = self.evict(keys, values), None
        else:
            super().place(keys, values)

    def evicts_compiled(self) -> bool:
        c = self.cache
        return (mx.default_device() == mx.cpu
                and c.slots_used == c.kv.capacity == c.slot_metadata()[0].shape[2])

    def evict(self, keys, values):
        c = self.cache
        kv, cfg = c.kv, c.config
        step = compiled_mixed_evict(cfg, c.window_size, kv.hi.bits, kv.lo.bits,
                                    kv.hi.group_size, kv.split)
        out = step(kv.hi.keys, kv.hi.values, kv.lo.keys, kv.lo.values, *c.slot_metadata(),
                   keys, values, mx.array(c.offset, mx.int32),
                   *zone_arrays(cfg.sink_size, cfg.recent_budget), int_array(kv.split))
        kv.hi.keys, kv.hi.values, kv.lo.keys, kv.lo.values = (
            tuple(out[i : i + 3]) for i in (0, 3, 6, 9))
        *meta, target = out[12:]
        c.set_slot_metadata(*meta)
        c.meta_pending = False
        c.evicted += 1
        return target

    def attends(self):
        c = self.cache
        return ("quantized", c.kv.segment_bits(c.slots_used), c.kv.hi.group_size)

    def compiles(self, mask, sinks) -> bool:
        # The eviction itself runs in place(): a full cache's step is a fill.
        return super().compiles(mask, sinks) and not self.cache.meta_pending

    def evict_attend(self, queries, keys, values, scale):
        return self.fill(queries, scale)

    def fills(self) -> bool:
        c = self.cache
        return c.slots_used == c.kv.capacity

    def fill_inputs(self):
        return self.cache.kv.fetch(self.cache.slots_used)  # both zones' triples (n == capacity)
