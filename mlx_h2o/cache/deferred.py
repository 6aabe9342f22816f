"""Deferred score folding for decode steps that evict nothing.

While a cache is below ``max_size`` no decision reads its scores, so a decode
step can attend with MLX's own SDPA (no score export, no custom launch) and
keep its queries; their scores are folded in one batched pass every few steps,
or as soon as anything reads the cache's metadata. For summed scores
(``accumulated``, ``normalized``) the batched fold equals the per-step folds
up to float summation order: keys are only appended meanwhile, and each query
is masked to the keys that existed at its step. ``DeferredScores`` is the
cache's side of it (a mixin of H2OKVCache, which owns the state).
"""

from typing import List, NamedTuple, Optional, Tuple

import mlx.core as mx

from ..kernels import queue_fold, queue_fold_supported
from ..scores import DEFERRABLE  # modes whose fold is a plain sum over queries
from . import first_use
from .storage import DenseKV

QUEUE_FOLD = "queue fold"  # its kernel's family for the Metal first-use check
# float32 logits of one batched fold at most (64 MiB); longer caches fold sooner.
MAX_LOGITS = 1 << 24


class QueuedQuery(NamedTuple):
    queries: mx.array  # (B, n_heads, 1, D)
    n: int  # slots visible to it (its own token is slot n - 1)
    position: int  # its token's position
    scale: float


class ScoreQueue:
    """Decode queries whose scores are not folded yet, oldest first.

    ``steps``: fold after this many queries; ``phase`` (e.g. the layer index)
    makes the first fold come ``phase % steps`` queries early, so the layers of
    a model fold on different decode steps (bounded transient memory, no
    periodic slow token).
    """

    def __init__(self, steps: int, phase: int = 0):
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.steps = steps
        self._head_start = phase % steps
        self._limit = steps
        self.items: List[QueuedQuery] = []

    def __len__(self) -> int:
        return len(self.items)

    def start(self, queries: mx.array, n: int, width: Optional[int]) -> None:
        """Bound the fold whose first query comes next (set once per fold: no
        shape reads per decode step). ``n``: slots in use now; ``width``: slots
        the ops fold reads then, whose float32 logits grow with the queue
        (MAX_LOGITS bounds them); None: the fold kernel (kernels/queued.py)
        runs, whose memory does not grow with the queue, so ``steps`` alone
        bounds it."""
        self._limit = self.steps
        if width is not None:
            B, Hq = queries.shape[:2]
            most = max(n + self.steps, width)  # slots the fold may read
            self._limit = max(1, min(self.steps, MAX_LOGITS // (B * Hq * most)))

    def push(self, queries: mx.array, n: int, position: int, scale: float) -> bool:
        """Queue one decode query; True when the queue should be folded now."""
        self.items.append(QueuedQuery(queries, n, position, scale))
        return len(self.items) + self._head_start >= self._limit

    def take(self) -> List[QueuedQuery]:
        items, self.items, self._head_start, self._limit = self.items, [], 0, self.steps
        return items


def batch_logits(items: List[QueuedQuery], keys: mx.array) -> Tuple[mx.array, mx.array]:
    """float32 logits (B, n_heads, T, n) and lse (B, n_heads, T) of the queued
    queries over ``keys`` (B, n_kv_heads, n, D); query t sees slots < items[t].n.

    Computed as the reference attention computes them: in float32 (float16 /
    bfloat16 values are exact in TF32 too), logits = (q . k) * scale.
    """
    bias = _bias(_visible(items, keys.shape[2]))
    logits = masked_logits(queued_queries(items), keys, items[0].scale, bias)
    B, Hk, G, T, n = logits.shape
    logits = logits.reshape(B, Hk * G, T, n)
    return logits, mx.logsumexp(logits, axis=-1)


def batch_fold(items: List[QueuedQuery], keys: mx.array) -> Tuple[mx.array, mx.array]:
    """What folding the queued queries one by one adds to (score, count) in the
    summed modes (policy.fold_scores): per slot, the attention probability
    averaged over each GQA group and summed over the queries, (B, n_kv_heads,
    n); and the number of queries that saw the slot, (n,). float32."""
    visible = _visible(items, keys.shape[2])
    step = fold_step(queued_queries(items), keys, items[0].scale, _bias(visible))
    return step, visible.sum(axis=0).astype(mx.float32)


def fold_step(queries: mx.array, keys: mx.array, scale: float, bias: mx.array) -> mx.array:
    """(B, n_kv_heads, n): queries (B, n_heads, T, D)' softmax attention over
    ``keys``, averaged over each GQA group and summed over the queries;
    ``bias`` (T, n) is 0 where query t sees slot j, -inf elsewhere."""
    logits = masked_logits(queries, keys, scale, bias)  # few passes over the largest array
    return mx.softmax(logits, axis=-1).sum(axis=(2, 3)) / logits.shape[2]


def masked_logits(queries: mx.array, keys: mx.array, scale: float, bias: mx.array) -> mx.array:
    """(B, n_kv_heads, G, T, n) float32 logits plus ``bias`` (T, n)."""
    B, Hq, T, D = queries.shape
    Hk, n = keys.shape[1], keys.shape[2]
    q = queries.astype(mx.float32).reshape(B, Hk, (Hq // Hk) * T, D)
    logits = (q @ keys.astype(mx.float32).swapaxes(-1, -2)) * scale
    return logits.reshape(B, Hk, Hq // Hk, T, n) + bias


def _visible(items: List[QueuedQuery], n: int) -> mx.array:
    """(T, n) bool: query t sees slots < items[t].n."""
    return mx.arange(n)[None] < mx.array([it.n for it in items])[:, None]


def _bias(visible: mx.array) -> mx.array:
    return mx.where(visible, 0.0, -mx.inf)


def queued_queries(items: List[QueuedQuery]) -> mx.array:
    return mx.concatenate([it.queries for it in items], axis=2)  # (B, n_heads, T, D)


class DeferredScores:
    """H2OKVCache's decode steps below the budget that queue their scores
    (a mixin: the cache owns ``_queue`` and the metadata)."""

    _event_lazy = False  # a batch event's metadata is not evaluated yet
    # Decode steps that evict nothing attend with MLX's SDPA and fold their
    # scores in batches of ``defer_steps``: no custom launch and no metadata
    # writes per step while the cache fills.
    defer_scores = True
    defer_steps = 128
    # On a GPU, queue folds run kernels/queued.py: three launches that write
    # no logits (False: the ops fold, kept to compare the two in benchmarks).
    fold_queue_on_gpu = True

    def set_fold_phase(self, phase: int) -> None:
        """Stagger this layer's batched score folds (make_h2o_cache: layer index).

        Batch evictions (``evict_batch``) are not staggered: every layer's
        event falls on the same token, so the other tokens' graphs stay
        identical (MLX's CUDA backend caches graphs by topology; staggered
        events measured 0.78-0.90 of Rotating against 0.90-1.03, docs/DESIGN.md)."""
        self._queue = ScoreQueue(self.defer_steps, phase)

    def _may_defer(self) -> bool:
        # Sliding-window layers mask by position and EMA modes are not sums:
        # both keep the per-step fold.
        return (self.defer_scores and self.window_size is None
                and self.config.score in DEFERRABLE and type(self.kv) is DenseKV)

    def _deferred_attention(self, queries, keys, values, scale):
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale)
        if not self._queue.items:  # decided once per fold, not per step
            self._queue_kernel = (self.fold_queue_on_gpu and first_use.passed(QUEUE_FOLD)
                                  and queue_fold_supported(  # the kernel takes a full queue
                                      queries, keys, queued=self._queue.steps))
            self._queue.start(queries, self._n,
                              None if self._queue_kernel else self._fold_width(self._n))
        due = self._queue.push(queries, self._n, self.offset - 1, scale)
        self._meta_pending = self._pending = False  # the queue owns them now
        if due:
            self._fold_queue()
        if due or self._event_lazy:
            # A batch event's metadata held its queue and K buffer; each event
            # left lazy chained onto the last (memory grew every event).
            self._event_lazy = False
            out = self._with_metadata(out)
        return out

    def _fold_queue(self):
        """Fold the queued decode queries' scores and write their tokens' metadata."""
        items = self._queue.take()
        first, n = items[0].n - 1, items[-1].n
        # Queued tokens are consecutive (anything else folds the queue first);
        # their slots' scores are zero (fresh buffer, or zeroed by trim).
        self._positions[..., first:n] = mx.arange(items[0].position, items[0].position + n - first)
        keys = self.kv.dense_keys(self.kv.capacity)
        # Checked again: a read of the metadata can fold under another default
        # device than the first push saw (e.g. a CPU stream); the ops fold runs there.
        if self._queue_kernel and queue_fold_supported(items[0].queries, keys, len(items)):
            def kernel():
                return queue_fold(queued_queries(items), keys, [it.n for it in items],
                                  items[0].scale, self._score, self._count)
            if first_use.needs_check(QUEUE_FOLD):  # Metal's first: against the ops
                self._score, self._count = first_use.checked(
                    QUEUE_FOLD, kernel, lambda: self._ops_fold(items, n),
                    first_use.queue_differs)
                self._queue_kernel = first_use.passed(QUEUE_FOLD)
            else:
                self._score, self._count = kernel()
            return
        self._score, self._count = self._ops_fold(items, n)

    def _ops_fold(self, items, n):
        """The queue's fold in mx ops: the new (score, count)."""
        w = self._fold_width(n)
        step, seen = batch_fold(items, self.kv.dense_keys(w))
        if w == self._score.shape[-1]:
            return self._score + step, self._count + seen
        score, count = mx.array(self._score), mx.array(self._count)  # new arrays
        score[..., :w] = score[..., :w] + step
        count[..., :w] = count[..., :w] + seen
        return score, count

    def _fold_width(self, n: int) -> int:
        """Slots a fold of the queue reads: ``n`` rounded up to ``config.step``
        (or the whole buffer). Slots a query does not see add exact zeros, and
        the fold's shapes repeat for up to ``step`` tokens instead of changing
        every token (H100, 16K context without eviction: 0.840 of KVCache's
        tok/s against 0.792 with folds of exactly ``n``; docs/DESIGN.md)."""
        # After a prompt compaction the metadata can be shorter than the buffer.
        cap = min(self.kv.capacity, self._score.shape[-1])
        return min(cap, -(-n // self.config.step) * self.config.step)

    def _fills_deferred(self) -> bool:
        """A decode token below the budget whose scores go to the queue."""
        return (self._n < self.max_size and self._may_defer()
                and (self._group is None or not self._group.waits_for(self)))

    def _append_decode(self, keys, values):
        """What the general path does for a decode token that appends and
        queues its scores (below the budget, or between two batch events),
        without its checks: this step runs every token of every layer, and
        decode is host bound on the GPU (docs/DESIGN.md)."""
        n = self._n
        self.kv.write(n, keys, values)
        self._n, self.offset = n + 1, self.offset + 1
        self._slot = self._victim = None
        self._lazy = self._pending = self._meta_pending = True
        return self._fetch()
