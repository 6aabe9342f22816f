"""The op-by-op decode step: the specification the other steps are tested against.

An update writes the token into the policy's victim once the cache is full
(a prompt left past the budget is compacted first), else appends it; the
attention exports its logits (kernels.scaled_dot_product_attention_with_scores)
and policy.fold_scores folds them. About 90 MLX ops a layer and token.
"""

from .base import DecodeStep


class ReferenceStep(DecodeStep):
    kind = "reference"
    # An appended token's position and scores are written by the step's
    # kernel (FusedStep), not by the update.
    kernel_writes_meta = False

    def __init__(self, cache, sdpa_victims: bool = False):
        super().__init__(cache)
        # In a StepGroup the victim's token is attended by MLX's SDPA: a
        # quantized storage's write then also hands it dense K/V.
        self.sdpa_victims = sdpa_victims

    def update(self, keys, values):
        c = self.cache
        if c.into_victim():  # the evicting steady state
            return c.decode_into_victim(keys, values, for_sdpa=self.sdpa_victims)
        c.token_bytes = keys.nbytes + values.nbytes
        self.place(keys, values)
        c.offset += 1
        c.pending = 1
        return c.kv.fetch(c.slots_used)

    def place(self, keys, values):
        """The token into a slot: the policy's victim of a full cache, else a new one."""
        c = self.cache
        c.written_slot = c.next_victim = None
        c.compact_past_budget()
        if c.slots_used >= c.max_size:
            c.written_slot = c.write_into_victim(keys, values)
        else:
            c.append(keys, values, c.offset, meta=not self.kernel_writes_meta)

    def attend(self, queries, keys, values, scale, mask, sinks):
        c = self.cache
        if c.meta_pending and c.window_size is not None:
            c.write_pending_meta()  # the window mask reads the new token's position
        out, logits, lse = c.attention(queries, keys, values, scale, c.mask_for(1, mask), sinks)
        return self.fold(out, logits, lse)

    def fold(self, out, logits, lse):
        """This step's logits folded into the slots' scores, op by op."""
        c = self.cache
        if c.meta_pending:
            c.write_pending_meta()
        c.fold_ops(logits, lse)
        return c.with_metadata(out)

    def take(self, res) -> None:
        """A kernel's or compiled call's results (H2OStep / H2OFold): the
        metadata it wrote, and the victim the next decode token goes to once
        the cache is full."""
        c = self.cache
        c.set_slot_metadata(res.positions, res.score, res.count)
        c.next_victim = res.victim if c.slots_used >= c.max_size else None
        c.written_slot, c.meta_pending, c.pending = None, False, False
