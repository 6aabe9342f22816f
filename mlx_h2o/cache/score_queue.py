"""The score queue: decode queries whose scores are folded later, in one pass.

While a cache is below ``max_size`` no decision reads its scores, so a decode
step can attend with MLX's own SDPA (no score export, no custom launch) and
keep its queries; their scores are folded in one pass every few steps,
or as soon as anything reads the cache's metadata. For summed scores
(``accumulated``, ``normalized``) the queue's fold equals the per-step folds
up to float summation order: keys are only appended meanwhile, and each query
is masked to the keys that existed at its step. The cache's side of it
is the ``DeferredFill`` decode step (cache/decode/deferred.py).
"""

from typing import List, NamedTuple, Optional, Tuple

import mlx.core as mx

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


def queue_logits(items: List[QueuedQuery], keys: mx.array) -> Tuple[mx.array, mx.array]:
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


def fold_queue(items: List[QueuedQuery], keys: mx.array) -> Tuple[mx.array, mx.array]:
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
