"""H2OKVCache: a bounded KV cache that keeps sinks, heavy hitters and a recent window."""

import json
from typing import Optional

import mlx.core as mx
import mlx_lm.models.base as mlx_base
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache

from .. import policy
from ..config import H2OConfig, config_from_dict, config_to_dict
from ..scores import score_mode
from . import chunk
from .core import SlotCore
from .decode import DEFER_STEPS, decode_step
from .decode.grouped import GroupedStep
from .storage import deepcopy_attrs

NO_SCORES = (
    "H2OKVCache.update_and_fetch was called again before the attention of the "
    "previous call reported its scores. The model's attention does not go "
    "through mlx_lm.models.base.scaled_dot_product_attention, or routing is "
    "off: wrap the forward pass in `with mlx_h2o.patch():`{model}."
)
INTERRUPTED = (
    "The previous forward pass stopped between this layer's cache update and "
    "its attention (an exception or KeyboardInterrupt inside the model){model}: "
    "its {n} token(s) are in some layers and not in others. Call "
    "mlx_h2o.recover_prompt_cache(cache) to drop them from every layer, then "
    "feed them again."
)


class H2OKVCache(SlotCore, _BaseCache):
    """mlx-lm KV cache with H2O eviction.

    One sequence's face of the slot core (cache/core.py): mlx-lm's cache
    contract, the counts (``offset``, ``evicted``) and the decode moves its
    steps make.
    Chunks of L > 1 tokens are appended, attended in full, then compacted
    once to ``max_size``. A decode token (L == 1) goes through ``decode``,
    the decode step chosen when the cache is made (cache/decode/): the
    op-by-op reference, one compiled CPU call, or fused GPU kernels, with
    the score queue below the budget, bulk eviction or a group fold
    around it. ``offset`` counts every token seen (it drives RoPE), never
    the slots used.

    ``decode``: "auto" (the backend's fastest), "reference", "compiled" or
    "fused" (cache/decode/__init__.py).
    """

    def __init__(self, config: H2OConfig, window_size: Optional[int] = None,
                 decode: str = "auto"):
        super().__init__(config, window_size)
        self.offset = 0  # tokens seen
        self.evicted = 0  # tokens evicted per (sequence, KV head)
        self.token_bytes = 0  # dense K+V bytes of one token (all sequences, heads)
        self.model_name = ""
        self.fold_phase = 0
        self.decode = None
        self.preview = None  # (B, Hq, W, D): the prompt's last queries, seen ahead
        self.preview_from = 0  # the position of the first of them
        self.set_decode(decode)

    def set_decode(self, kind: str = "auto", defer: int = DEFER_STEPS, group=None) -> None:
        """Choose the decode step (cache/decode/): ``kind`` as in the class
        docstring; ``defer`` the decode queries queued below the budget before
        their scores fold (0: each step folds its own); ``group`` a StepGroup
        (cache/group.py) to fold with."""
        if self.decode is not None:
            self.settle()
            member = self.decode.find(GroupedStep)
            if member is not None:
                member.group.remove(member)
        self.decode = decode_step(self, kind, defer, group)
        self._decode_settings = (kind, defer)

    def set_fold_phase(self, phase: int) -> None:
        """Stagger this layer's score queue folds (make_h2o_cache: layer index).

        Batch evictions (``evict_batch``) are not staggered: every layer's
        event falls on the same token, so the other tokens' graphs stay
        identical (MLX's CUDA backend caches graphs by topology; staggered
        events measured 0.78-0.90 of Rotating against 0.90-1.03, docs/DESIGN.md)."""
        self.fold_phase = phase
        self.decode.stagger(phase)

    def groupable(self) -> bool:
        """Whether this cache's evicting decode steps can join a StepGroup."""
        return (self.window_size is None and self.config.evict_batch == 1
                and self.kv.group_kind is not None and self.decode.kind != "reference"
                and score_mode(self.config.score).kernel)

    def join_group(self, group) -> None:
        self.set_decode(*self._decode_settings, group=group)

    # --- decode moves (the steps in cache/decode/ make them) -----------------------
    def into_victim(self) -> bool:
        """Whether this decode token goes straight into the victim the last
        step picked ahead: the full cache's steady state (a cache past its
        budget compacts first; after a trim or a bulk eviction none is held)."""
        return self.next_victim is not None and self.slots_used == self.max_size

    def write_into_victim(self, keys, values):
        """The policy's victim takes this decode token: its slot (B, Hk, 1)."""
        slot = self.victims(self.offset)
        self.write_token(slot, keys, values, self.offset)
        self.evicted += 1
        return slot

    def write_picked_victim(self, keys, values, for_sdpa=False):
        """This decode token into the victim the last step picked ahead
        (``next_victim``), its metadata left to the step's kernel or fold."""
        victim = self.next_victim
        self.kv.write_index(victim, keys, values, for_sdpa=for_sdpa)
        self._note_written(keys)
        self.written_slot, self.next_victim = victim, None
        self.meta_pending = True
        self.evicted += 1

    def decode_into_victim(self, keys, values, for_sdpa=False):
        """A decode token of the steady state (``into_victim``): written into
        the picked victim, counted; returns the K/V attention reads."""
        self.token_bytes = keys.nbytes + values.nbytes
        self.write_picked_victim(keys, values, for_sdpa)
        self.offset += 1
        self.pending = 1
        return self.kv.fetch(self.slots_used)

    def write_pending_meta(self):
        """The last decode token's position and scores, when no kernel wrote them."""
        if self.written_slot is None:
            self._write_append_meta(self.slots_used - 1, 1, self.offset - 1)
            self.meta_pending = False
        else:
            self._write_slot_meta(self.written_slot, self.offset - 1)

    def compact_past_budget(self):
        """A prompt left past the budget (``prefill_compact="prompt"``) is
        compacted by the first decode step."""
        if self.slots_used > self.max_size:
            self._compact()

    def _compact(self):
        self.evicted += self.slots_used - self.max_size
        self.compact(self.offset)

    # --- prompt chunks ---------------------------------------------------------------
    def _windowed(self, call, L, mask, sinks) -> bool:
        # One sequence's rule, the seam tests and the Swift vector generator
        # override: an overflowing chunk on a global layer.
        return call.window > 0 and self._scored_by_window(L)

    def _scored_by_window(self, L) -> bool:
        """A chunk that overflows is scored by its last ``prefill_window``
        queries (``policy.scored_by_window``; dense or quantized storage)."""
        return policy.scored_by_window(self.config, L, self.slots_used > self.max_size,
                                       self.window_size)

    def wants_preview(self) -> bool:
        """Whether chunks are scored by the prompt's end seen ahead
        (``prefill_compact`` "preview" or "two_pass"; a global layer's cache only)."""
        return (self.config.prefill_compact in ("preview", "two_pass")
                and self.window_size is None)

    def set_preview(self, queries: mx.array, start: int) -> None:
        """The queries (B, Hq, W, D) of the prompt's tokens from position
        ``start`` on, computed ahead (mlx_h2o.preview_prompt): every chunk
        compacted before ``start`` adds their attention to its scores."""
        if not self.wants_preview():
            return
        if start < self.offset:
            raise ValueError(
                f"a preview of positions from {start} on came after the cache saw "
                f"{self.offset} tokens: preview a prompt before it is prefilled")
        self.preview, self.preview_from = queries, start

    # --- mlx-lm cache contract -------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.pending:
            raise RuntimeError(self._pending_error())
        if keys.ndim != 4 or keys.shape[:3] != values.shape[:3] or not keys.shape[2]:
            raise ValueError(_bad_update(keys, values))
        L = keys.shape[2]
        if L == 1:
            return self.decode.update(keys, values)
        self.decode.sync()
        self.next_victim = self.written_slot = None
        self.token_bytes = (keys.nbytes + values.nbytes) // L
        self.append(keys, values, self.offset)
        self.offset += L
        self.pending = L
        return self.kv.fetch(self.slots_used)

    @property
    def pending_tokens(self) -> int:
        """Tokens of the last update whose attention has not run (an
        interrupted forward pass: mlx_h2o.recover_prompt_cache)."""
        return int(self.pending)

    def _pending_error(self) -> str:
        name = f" (model: {self.model_name})" if self.model_name else ""
        # Routing (mlx_h2o.patch) swaps mlx-lm's function; the cache never routes.
        if mlx_base.scaled_dot_product_attention.__module__ != mlx_base.__name__:
            return INTERRUPTED.format(model=name, n=int(self.pending))
        return NO_SCORES.format(model=name)

    def h2o_attention(self, queries, keys, values, *, scale, mask=None, sinks=None):
        """Attention over the fetched keys/values that folds in this step's scores."""
        L = queries.shape[2]
        if L == 1:
            return self.decode.attend(queries, keys, values, scale, mask, sinks)
        call = chunk.chunk_call(self.config, ((0, L),), (self.slots_used,), L,
                                self.window_size)
        out, exact, expected, _ = self.chunk_attention(queries, keys, values, scale,
                                                       self.mask_for(L, mask), sinks, call)
        if self.preview is not None and self.offset > self.preview_from:
            self.preview = None  # the prompt's end is here: its own queries score
        if self.preview is not None and call.plans[0].compact and exact is not None:
            exact = chunk.with_preview(self.kv, self.config.score, self._positions.shape[1],
                                       exact, self.preview, keys, values, scale, sinks)
        self.fold_chunk(call, exact, expected)
        if call.plans[0].compact:  # "prompt" waits for the first decode step
            self._compact()
        # A chunk's (L, N) logits are large: finish this layer before the next
        # builds its own, or every layer's logits stay alive at once (a 2K
        # prompt at B=5 on SmolLM2 peaked at 22 GB).
        mx.eval(out, self.score, self.count, self.positions)
        return out

    # The batch cache of these caches (cache/batch_cache.py declares itself).
    batch_class = None

    @classmethod
    def merge(cls, caches):
        """mlx-lm's batch contract (BatchGenerator, the server): a
        BatchH2OKVCache whose rows are these single-sequence caches."""
        return cls.batch_class.merge(caches)

    def empty(self) -> bool:
        return self._positions is None

    @property
    def nbytes(self) -> int:
        if self._positions is None:
            return 0
        meta = (self._positions, self._score, self._count)
        return self.kv.nbytes + sum(a.nbytes for a in meta)

    def is_trimmable(self) -> bool:
        # trim(n) forgets exactly the n newest tokens at any point (below).
        return True

    def trim(self, n: int) -> int:
        """Forget the newest ``n`` tokens, as if they had never been seen.

        Exact at any point: ``offset`` drops by ``n`` and every kept token sits
        below the new offset (those of the n newest that were evicted already
        are simply gone). Rows (sequences, KV heads) that evicted different
        tokens may hold different numbers of them; every row then keeps its
        best ``k`` slots, ``k`` the fewest any row has left: an eviction."""
        n = max(0, min(int(n), self.offset))
        self.preview = None  # previewed for a prompt the trim (or a recovery) abandons
        if n == 0:
            return 0
        self.settle()
        cut = self.offset - n
        if self.evicted:
            # Slots are out of token order: keep the rows' best held slots.
            keep, k = self.trim_keep(cut, per_row=False)
            self.keep_only(keep, k)
        else:
            self.slots_used -= n  # slots are in token order until the first eviction
            # Freed slots get fresh scores: queued tokens refill them unzeroed.
            self.score[..., self.slots_used : self.slots_used + n] = 0.0
            self.count[..., self.slots_used : self.slots_used + n] = 0.0
        self.offset = cut
        self.evicted = cut - self.slots_used
        return n

    def __deepcopy__(self, memo):
        """What mlx-lm's prompt LRU hands out: a cache that goes on as this one
        (queued folds folded first; per-shape decisions are made again)."""
        self.settle()
        return deepcopy_attrs(self, memo)

    def settle(self) -> None:
        """Bring the slot metadata up to date before it is read or rewritten:
        what the decode step holds back (queued score folds, a group's
        stack), a decode token whose attention has not run yet (an
        interrupted forward pass); a victim picked ahead is dropped."""
        self.decode.sync()
        if self.meta_pending:
            self.write_pending_meta()
        self.decode.forget()
        self.next_victim, self.pending = None, False

    def make_mask(self, N: int, window_size=None, return_array: bool = False):
        # Windows are applied from positions in h2o_attention; this describes
        # the slot layout after the upcoming append (new tokens at the end).
        if N == 1:
            return None
        if return_array:
            return create_causal_mask(N, self.slots_used)
        return "causal"

    @property
    def state(self):
        """Storage arrays, then (positions, score, count), of the slots in use;
        between two bulk evictions also the evicted slots that decode steps
        still attend (their number is the slots beyond ``offset - evicted``)."""
        if self.positions is None:
            return []
        n = self.kv.capacity if self.lingering else self.slots_used
        meta = (self.positions[..., :n], self.score[..., :n], self.count[..., :n])
        return (*self.kv.state(n), *meta)

    @state.setter
    def state(self, v):
        self.decode.forget()
        self.next_victim, self.written_slot, self.meta_pending = None, None, False
        self.lingering = False
        if not v:
            self.kv = self.storage_cls()
            self.set_slot_metadata(None, None, None)
            self.slots_used = 0
            return
        # Own array objects: slot writes update arrays in place (__setitem__),
        # and a state read from another cache may be that cache's buffers.
        *kv, positions, score, count = (mx.array(a) for a in v)
        self.set_slot_metadata(positions, score, count)
        self.kv.set_state(kv)
        self._restore_size()

    def _restore_size(self):
        """Slots in use after a restore: ``offset - evicted`` of the saved
        ones; those past it are lingering evicted slots (state, above)."""
        if self._positions is None:
            return
        slots, live = self._positions.shape[2], self.offset - self.evicted
        self.slots_used = live if 0 < live < slots else slots
        self.lingering = self.slots_used < slots

    @property
    def meta_state(self):
        window = "" if self.window_size is None else str(self.window_size)
        config = json.dumps(config_to_dict(self.config))
        return (str(self.offset), str(self.evicted), window, self.model_name, config)

    @meta_state.setter
    def meta_state(self, v):
        offset, evicted, window, self.model_name, config = v
        self.offset, self.evicted = int(offset), int(evicted)
        self.window_size = int(window) if window else None
        self.config = config_from_dict(json.loads(config))
        self._restore_size()  # whichever of state / meta_state comes second

    @classmethod
    def from_state(cls, state, meta_state) -> "H2OKVCache":
        window, config = meta_state[2], json.loads(meta_state[4])
        obj = cls(config_from_dict(config), int(window) if window else None)
        obj.meta_state = meta_state
        obj.state = state
        return obj


def _bad_update(keys, values) -> str:
    """What is wrong with an update's keys / values (mlx-lm's layout)."""
    return (
        "update_and_fetch takes keys and values of shape (B, n_kv_heads, L, head_dim) "
        f"with the same B, n_kv_heads and L >= 1; got keys {tuple(keys.shape)}, "
        f"values {tuple(values.shape)}"
    )
