"""H2OKVCache: a bounded KV cache that keeps sinks, heavy hitters and a recent window."""

import json
from typing import Optional

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from .. import policy
from ..config import H2OConfig, check_window_size, config_from_dict, config_to_dict
from ..kernels import fold_step_supported, scaled_dot_product_attention_with_scores
from .deferred import DeferredScores, ScoreQueue
from .mixed_storage import MixedKV
from .quantized_storage import QuantizedKV
from .slots import Slots
from .steps import DecodeSteps
from .storage import DenseKV, deepcopy_attrs

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


def _folded(name):
    """Slot metadata read through this property is up to date: queued decode
    queries (``defer_scores``) are folded first."""
    attr = "_" + name

    def get(self):
        self._leave_group()
        if self._queue.items:
            self._fold_queue()
        return getattr(self, attr)

    def put(self, value):
        self._leave_group()
        setattr(self, attr, value)

    return property(get, put)


class H2OKVCache(Slots, DeferredScores, DecodeSteps):
    """mlx-lm KV cache with H2O eviction.

    Storage is slot based: preallocated (B, n_kv_heads, slots, D) buffers with a
    token position per slot. A decode step that evicts writes the new token
    into the victim's slot (per sequence and KV head), so slot order is not
    token order and masks come from positions. Chunks of L > 1 tokens are
    appended, attended in full, then compacted once to ``max_size``.
    ``offset`` counts every token seen (it drives RoPE), never the slots used.
    The decode steps that fold without the op-by-op path (GPU kernels, group
    steps, compiled CPU steps) come from cache/steps.py, those that queue their
    scores below the budget from cache/deferred.py, slot bookkeeping (appends,
    victims, compaction, batched eviction, masks) from cache/slots.py.
    """

    storage_cls = DenseKV

    positions = _folded("positions")  # (B, Hk, cap) int32 token position per slot
    score = _folded("score")  # (B, Hk, cap) float32 accumulated score
    count = _folded("count")  # (B, Hk, cap) float32 queries that saw the slot

    def __init__(self, config: H2OConfig, window_size: Optional[int] = None):
        if not isinstance(config, H2OConfig):
            raise TypeError(f"config must be an H2OConfig, got {type(config).__name__}")
        self.config = config
        self.window_size = check_window_size(window_size)
        self._queue = ScoreQueue(self.defer_steps)
        self._lazy = False  # this decode step's scores go to the queue
        self._queue_kernel = False  # the queue is folded by kernels/queued.py
        self.kv = self.storage_cls()
        self.positions = self.score = self.count = None
        self.offset = 0  # tokens seen
        self.token_bytes = 0  # dense K+V bytes of one token (all sequences, heads)
        self.evicted = 0  # tokens evicted per (sequence, KV head)
        self._n = 0  # slots in use
        # Slots n..capacity hold tokens a batch eviction dropped (evict_batch):
        # decode steps attend them until new tokens overwrite them.
        self._lingering = False
        self._pending = False
        self._victim = None  # (B, Hk, 1, D) next victim, from the fused step
        self._slot = None  # (B, Hk, 1[, D]) slot this step's token overwrote
        # The fused step's StepPlan (None: op-by-op) and the signature it was
        # decided for: device, shapes, dtypes, scale.
        self._plan = self._plan_key = None
        self._meta_pending = False  # its position/scores are not written yet
        self.model_name = ""

    @property
    def max_size(self) -> int:
        return self.config.max_size

    # --- mlx-lm cache contract -------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self._pending:
            raise RuntimeError(self._pending_error())
        if keys.ndim != 4 or keys.shape[:3] != values.shape[:3] or not keys.shape[2]:
            raise ValueError(_bad_update(keys, values))
        if self._victim is not None and self._into_victim(keys):
            return self._write_decode_victim(keys, values)
        if keys.shape[2] == 1 and self._n < self.kv.capacity and (
                self._lingering or self._fills_deferred()):
            return self._append_decode(keys, values)
        if self._group is not None and self._group.waits_for(self):
            self._group.flush()  # a new token: last token's folds, every member's victim
        L = keys.shape[2]
        self.token_bytes = (keys.nbytes + values.nbytes) // L
        self._slot, self._meta_pending = None, False
        if L == 1 and self._n > self.max_size:
            self._compact()  # the prompt is over (prefill_compact="prompt")
        if L == 1 and self._n >= self.max_size and self._batched():
            self._evict_batch()  # room for the next evict_batch decode tokens
        if L == 1 and self._n >= self.max_size and self._victim is not None:
            # The group's flush above just picked it (the fast path took every
            # other victim; a compaction or a batch eviction drops one): the
            # steady state's write. The fused step or fold writes the metadata.
            return self._write_decode_victim(keys, values)
        if L == 1 and self._n >= self.max_size:
            self._slot = self._write_into_victim(keys, values)
        else:
            # A decode token's position and scores wait for its attention: the
            # fused step writes them itself (three slice updates saved), or the
            # score queue does.
            self._lazy = L == 1 and self._may_defer()
            defer = L == 1 and (self._lazy or self._may_fuse() or self._may_fold())
            self._append(keys, values, meta=not defer)
            self._meta_pending = defer
        self._victim = None
        self.offset += L
        self._pending = L  # tokens whose attention has not run yet
        return self._fetch()

    @property
    def pending_tokens(self) -> int:
        """Tokens of the last update whose attention has not run (an
        interrupted forward pass: mlx_h2o.recover_prompt_cache)."""
        return int(self._pending)

    def _pending_error(self) -> str:
        from ..integration.routing import is_enabled  # the cache layer never routes

        name = f" (model: {self.model_name})" if self.model_name else ""
        if is_enabled():
            return INTERRUPTED.format(model=name, n=int(self._pending))
        return NO_SCORES.format(model=name)

    def _fetch(self):
        """What this step attends. After a batch eviction, a deferred decode
        step also sees the evicted tokens not yet overwritten: the whole
        buffer, as RotatingKVCache returns it (no slice nodes)."""
        return self.kv.fetch(self.kv.capacity if self._lazy and self._lingering else self._n)

    def h2o_attention(self, queries, keys, values, *, scale, mask=None, sinks=None):
        """Attention over the fetched keys/values that folds in this step's scores."""
        lazy, self._lazy = self._lazy, False
        if lazy and mask is None and sinks is None:
            return self._deferred_attention(queries, keys, values, scale)
        if self._lingering and keys.shape[2] > self._n:  # only unmasked decode steps see them
            keys, values = keys[..., : self._n, :], values[..., : self._n, :]
        if self._queue.items:
            self._fold_queue()  # what follows reads the metadata (backing fields)
        if self._group is not None:
            if self._group_step(queries, mask, sinks):
                out = self.kv.sdpa(queries, keys, values, scale=scale)
                return self._group.push(self, queries, scale, out)
            self._leave_group()
        plan = self._fused_plan(queries, keys, values, scale, mask, sinks)
        if plan is not None:
            return self._fused_step(plan, queries, keys, values, scale, mask, sinks)
        if self._steps_compiled(queries, mask, sinks):
            return self._compiled_step(queries, keys, values, scale)
        if self._fills_compiled(queries, mask, sinks):
            return self._compiled_fill(queries, scale)
        L = queries.shape[2]
        if self._meta_pending and self.window_size is not None:
            self._write_pending_meta()  # the window mask reads the new token's position
        out, logits, lse = self._attention(queries, keys, values, scale, self._mask(L, mask), sinks)
        if L == 1 and self._may_fold() and fold_step_supported(logits, lse, self.positions):
            return self._fold_step(out, logits, lse)  # the kernel writes the metadata
        if self._meta_pending:
            self._write_pending_meta()
        self._fold_ops(logits, lse, L)
        if L == 1:
            return self._with_metadata(out)
        # A chunk's (L, N) logits are large: finish this layer before the next
        # builds its own, or every layer's logits stay alive at once (a 2K
        # prompt at B=5 on SmolLM2 peaked at 22 GB).
        mx.eval(out, self.score, self.count, self.positions)
        return out

    def _attention(self, queries, keys, values, scale, mask, sinks):
        """(out, logits, lse); logits / lse of the rows that will be folded only."""
        W = self.config.prefill_window
        if not self._scored_by_window(queries.shape[2]):
            return self.kv.attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        # Only the window's scores are folded: MLX's SDPA attends the whole
        # chunk, and logits come for the last W queries alone (a 2K chunk's
        # float32 logits were ~1 GB per layer for an 8B model).
        keys, values = self.kv.dense(keys, values, queries.dtype)
        out = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        _, logits, lse = scaled_dot_product_attention_with_scores(
            queries[:, :, -W:], keys, values, scale=scale, mask=_last_rows(mask, W),
            sinks=sinks)
        return out, logits, lse

    def _scored_by_window(self, L) -> bool:
        """A chunk that overflows is scored by its last ``prefill_window`` queries
        (global layers, dense or quantized storage; W > 1 so that neighbour
        pooling applies as before)."""
        W = self.config.prefill_window
        return (L > W > 1 and self._n > self.max_size and self.window_size is None
                and type(self.kv) in (DenseKV, QuantizedKV, MixedKV))

    def _fold_ops(self, logits, lse, L):
        """Fold this step's scores op by op, then compact a chunk that overflowed.

        ``L``: the call's query count (``logits`` may hold only its window)."""
        n, cfg = self._n, self.config
        # Only a chunk that overflows the budget is scored by its window (SnapKV).
        over = n > self.max_size
        score, count = self.score[..., :n], self.count[..., :n]
        if over and self._replaces_window(L):
            score, count = mx.zeros_like(score), mx.zeros_like(count)
        score, count = policy.fold_scores(
            cfg.score, score, count, logits, lse,
            cfg.ema_alpha, cfg.prefill_window if over else 0,
            self.positions[..., :n], cfg.prefill_pool if over else 0,
        )
        self.score[..., :n] = score
        self.count[..., :n] = count
        self._pending = False
        if over and cfg.prefill_compact == "chunk":
            self._compact()  # "prompt" waits for the first decode step

    def _replaces_window(self, L) -> bool:
        """A later chunk of a prompt left uncompacted: its window alone decides."""
        cfg = self.config
        return (cfg.prefill_compact == "prompt" and 0 < cfg.prefill_window <= L
                and self._n - L > self.max_size)

    def size(self) -> int:
        return self._n

    @classmethod
    def merge(cls, caches) -> "BatchH2OKVCache":  # noqa: F821
        """mlx-lm's batch contract (BatchGenerator, the server): a
        BatchH2OKVCache whose rows are these single-sequence caches."""
        from .batch_cache import BatchH2OKVCache  # it builds rows of this class

        return BatchH2OKVCache.merge(caches)

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
        if n == 0:
            return 0
        self.settle()
        cut = self.offset - n
        if self.evicted:
            # Slots are out of token order: regather the rows' best held slots.
            pos = self.positions[..., : self._n]
            gone = pos >= cut
            k = self._n - int(gone.sum(axis=-1).max())
            pri = policy.sinks_first(self._priority(cut)[0], pos, self.config.sink_size)
            self._gather(policy.select_keep(pri, pos, k, drop=gone))
        else:
            self._n -= n  # slots are in token order until the first eviction
            # Freed slots get fresh scores: queued tokens refill them unzeroed.
            self.score[..., self._n : self._n + n] = 0.0
            self.count[..., self._n : self._n + n] = 0.0
        self.offset = cut
        self.evicted = cut - self._n
        return n

    def __deepcopy__(self, memo):
        """What mlx-lm's prompt LRU hands out: a cache that goes on as this one
        (queued folds folded first; the fused step's plan, made per shape and
        device, is made again)."""
        self.settle()
        return deepcopy_attrs(self, memo, fresh={"_plan": _none, "_plan_key": _none})

    def settle(self) -> None:
        """Bring the slot metadata up to date before it is read or rewritten:
        queued score folds, a decode token whose attention has not run yet
        (an interrupted forward pass), the group's pending fold."""
        self._leave_group()
        if self._queue.items:
            self._fold_queue()
        if self._meta_pending:
            self._write_pending_meta()
        self._victim, self._lazy, self._pending = None, False, False

    def make_mask(self, N: int, window_size=None, return_array: bool = False):
        # Windows are applied from positions in h2o_attention; this describes
        # the slot layout after the upcoming append (new tokens at the end).
        if N == 1:
            return None
        if return_array:
            return create_causal_mask(N, self._n)
        return "causal"

    @property
    def state(self):
        """Storage arrays, then (positions, score, count), of the slots in use;
        between two batch evictions also the evicted slots that decode steps
        still attend (their number is the slots beyond ``offset - evicted``)."""
        if self.positions is None:
            return []
        n = self.kv.capacity if self._lingering else self._n
        meta = (self.positions[..., :n], self.score[..., :n], self.count[..., :n])
        return (*self.kv.state(n), *meta)

    @state.setter
    def state(self, v):
        self._victim, self._slot, self._meta_pending = None, None, False
        self._lingering = False
        self._queue.take()
        if not v:
            self.kv = self.storage_cls()
            self.positions = self.score = self.count = None
            self._n = 0
            return
        # Own array objects: slot writes update arrays in place (__setitem__),
        # and a state read from another cache may be that cache's buffers.
        *kv, self.positions, self.score, self.count = (mx.array(a) for a in v)
        self.kv.set_state(kv)
        self._restore_size()

    def _restore_size(self):
        """Slots in use after a restore: ``offset - evicted`` of the saved
        ones; those past it are lingering evicted slots (state, above)."""
        if self._positions is None:
            return
        slots, live = self._positions.shape[2], self.offset - self.evicted
        self._n = live if 0 < live < slots else slots
        self._lingering = self._n < slots

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

    # --- decode step results ------------------------------------------------------
    def _with_metadata(self, out):
        """``out``, evaluated together with the metadata a decode step updated.
        Nothing else reads it until a decision does; left lazy, each update's
        graph held that step's K buffer or logits (an H100 decode at 16K
        context grew by ~5 GB per 128 tokens and ran out of memory,
        docs/DESIGN.md)."""
        return mx.depends(out, [self._positions, self._score, self._count])


def _none():
    return None


def _bad_update(keys, values) -> str:
    """What is wrong with an update's keys / values (mlx-lm's layout)."""
    return (
        "update_and_fetch takes keys and values of shape (B, n_kv_heads, L, head_dim) "
        f"with the same B, n_kv_heads and L >= 1; got keys {tuple(keys.shape)}, "
        f"values {tuple(values.shape)}"
    )


def _last_rows(mask, W: int):
    """The mask of a call's last W queries (mlx-lm's "causal" is bottom-right aligned)."""
    if isinstance(mask, mx.array) and mask.ndim >= 2 and mask.shape[-2] > 1:
        return mask[..., -W:, :]
    return mask
