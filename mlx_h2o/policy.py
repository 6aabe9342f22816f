"""H2O policy: score accumulation and victim selection (pure functions).

Scores are kept per (sequence, KV head, slot): the query heads of a GQA group
are averaged into one score. Selection uses an exact total order so every
backend makes the same decision: a slot's key is (priority, position), where
priority is +inf for protected slots (sinks, recent window, pinned), -inf for
slots a sliding-window layer can no longer see, else the eviction score. Ties
in score evict the older position first.
"""

from typing import NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .kernels.reference import Mask, grouped_mask, masked_softmax
from .scores import score_mode

EMPTY = -1  # position of a slot that holds no token of its row
LOWEST, HIGHEST = -(2**63), 2**63 - 1  # order keys below / above every slot's


def fold_scores(
    mode: str,
    score: mx.array,
    count: mx.array,
    logits: mx.array,
    lse: mx.array,
    alpha: float = 0.95,
    window: int = 0,
    positions: Optional[mx.array] = None,
    pool: int = 0,
    weight: float = 1.0,
) -> Tuple[mx.array, mx.array]:
    """Fold one attention call into the running scores.

    Shapes: score, count (B, n_kv_heads, N) float32; logits (B, n_heads, L, N)
    with masked entries -inf; lse (B, n_heads, L). ``count`` is the number of
    queries that could see each key (visibility taken from the group's first
    head: masks are shared within a GQA group). ``window`` > 0 folds only the
    last ``window`` queries of the call. ``pool`` > 1 (with ``positions``, the
    slots' token positions) max-pools the call's contribution over keys within
    ``pool // 2`` positions, for calls that stand for more than one query
    (prompt chunks). Each row of ``logits`` stands for ``weight`` queries
    (``expected_logits``' row: the window's W). ``mode`` names a
    ``scores.SCORES`` entry: its fold and magnitude apply (a "fixed" fold
    leaves ``score`` as written: ``written_score``).
    """
    step, seen = call_columns(mode, logits, lse, score.shape[1], window)
    pool = pool if logits.shape[2] * weight > 1 else 0
    return fold_columns(mode, score, count, step, seen, alpha, positions, pool, weight)


def call_columns(mode: str, logits: mx.array, lse: mx.array, n_kv_heads: int,
                 window: int = 0) -> Tuple[Optional[mx.array], mx.array]:
    """(step, seen) of one attention call, per slot (B, n_kv_heads, N): the
    sum over the call's (last ``window``) queries of the group-mean
    magnitude of ``mode`` (None for a "fixed" fold), and how many of those
    queries could see the slot (``kernels.attention_with_column_sums``
    gives the probability sums without logits)."""
    spec = score_mode(mode)
    L = logits.shape[2]
    if 0 < window < L:
        logits, lse = logits[:, :, -window:], lse[:, :, -window:]
    B, Hq, Lw, N = logits.shape
    Hk = n_kv_heads
    lg = logits.reshape(B, Hk, Hq // Hk, Lw, N)
    visible = lg[:, :, 0] > -mx.inf  # (B, Hk, Lw, N)
    seen = visible.astype(mx.float32).sum(axis=2)  # (B, Hk, N)
    if spec.fold == "fixed":
        return None, seen
    if spec.magnitude == "abs_logit":
        mag = mx.where(visible[:, :, None], mx.abs(lg), 0.0)
    else:  # probability
        mag = mx.exp(lg - lse.reshape(B, Hk, Hq // Hk, Lw, 1))
    return mag.mean(axis=2).sum(axis=2), seen  # (B, Hk, N)


def cache_head_columns(step: mx.array, seen: mx.array,
                       n_kv_heads: int) -> Tuple[mx.array, mx.array]:
    """``call_columns`` per cache KV head from ``attention_with_column_sums``'
    per attended KV head (B, H, N): a model that repeats its KV heads after
    the cache attends H = r * n_kv_heads of them; a cache head's group is
    then its r heads' groups (mean of step, first head's seen)."""
    B, H, N = step.shape
    if H == n_kv_heads:
        return step, seen
    r = H // n_kv_heads
    return step.reshape(B, n_kv_heads, r, N).mean(axis=2), seen[:, ::r]


def fold_columns(mode: str, score: mx.array, count: mx.array, step: Optional[mx.array],
                 seen: mx.array, alpha: float = 0.95, positions: Optional[mx.array] = None,
                 pool: int = 0, weight: float = 1.0) -> Tuple[mx.array, mx.array]:
    """Fold a call's ``call_columns`` (step, seen) into the running scores
    (``fold_scores`` for the arguments)."""
    spec = score_mode(mode)
    if weight != 1:  # no op on the decode paths
        seen = weight * seen
    if spec.fold == "fixed":
        return score, count + seen
    if weight != 1:
        step = weight * step
    if pool > 1 and positions is not None:
        step = pool_neighbours(step, positions, pool // 2)
    if spec.fold == "ema":
        step = step / mx.maximum(seen, 1.0)
        ema = mx.where(count > 0, alpha * score + (1.0 - alpha) * step, step)
        score = mx.where(seen > 0, ema, score)
    elif spec.fold == "last":
        score = mx.where(seen > 0, step / mx.maximum(seen, 1.0), score)
    else:
        score = score + step
    return score, count + seen


def expected_logits(queries: mx.array, keys: mx.array, scale: float, mask: Mask = None,
                    sinks: Optional[mx.array] = None) -> Tuple[mx.array, mx.array]:
    """Expected Attention's logit row (Devoto et al. 2025) and its lse.

    Per query head, the ``W`` queries are taken as samples of a Gaussian
    (mean mu, covariance Sigma = (1/W) sum (q - mu)(q - mu)^T) and each key
    gets z = log E[exp(scale q.k)] = scale mu.k + scale^2 / 2 k^T Sigma k.

    Shapes: queries (B, n_heads, W, D) (float32 inside); keys (B,
    n_kv_heads, N, D); ``mask`` one query row's (None, "causal", or an array
    broadcastable to (B, n_heads or n_kv_heads, 1, N)); ``sinks`` (n_heads,)
    an extra softmax column. Returns logits (B, n_heads, 1, N) float32 (z,
    masked -> -inf, an additive mask added) and lse (B, n_heads, 1), as
    ``scaled_dot_product_attention_with_scores`` returns a query's.
    """
    B, Hq, W, D = queries.shape
    Hk, N = keys.shape[1], keys.shape[2]
    if Hq % Hk:
        raise ValueError(f"n_heads={Hq} is not a multiple of n_kv_heads={Hk}")
    G = Hq // Hk
    q = queries.astype(mx.float32)
    mu = q.mean(axis=2, keepdims=True)  # (B, Hq, 1, D)
    # k^T Sigma k = mean over the window of ((q - mu).k)^2: W rows of one
    # GEMM per KV head, no (D, D) matrix per head.
    rows = mx.concatenate([mu, q - mu], axis=2).reshape(B, Hk, G * (W + 1), D)
    dots = rows @ keys.astype(mx.float32).swapaxes(-1, -2)
    dots = dots.reshape(B, Hk, G, W + 1, N)
    z = scale * dots[:, :, :, :1] + (0.5 * scale * scale) * mx.mean(
        dots[:, :, :, 1:] ** 2, axis=3, keepdims=True)  # (B, Hk, G, 1, N)
    logits, _, lse = masked_softmax(z, grouped_mask(mask, B, Hq, Hk, 1, N), sinks)
    return logits.reshape(B, Hq, 1, N), lse.reshape(B, Hq, 1)


def written_score(mode: str, keys: mx.array):
    """The score slots start with when ``keys`` (B, n_kv_heads, L, D) are
    written: for a key-norm mode, (B, n_kv_heads, L) float32 ``-||k||_2`` of
    each key as the cache receives it (after RoPE; a quantized cache's
    incoming float key, so every storage ranks the same numbers); 0.0 for the
    attention modes, whose folds add to it."""
    if not score_mode(mode).from_keys:
        return 0.0
    k = keys.astype(mx.float32)  # float16 squares overflow past |k| ~ 256
    return -mx.sqrt((k * k).sum(axis=-1))


def grown_size(config, need: int) -> int:
    """Slots a cache holds to take ``need`` tokens: growth in steps of
    ``config.step`` up to ``max_size``; a prompt chunk past the budget gets
    exact room (compacted after its attention)."""
    step, top = config.step, config.max_size
    return min(-(-need // step) * step, top) if need <= top else need


def scored_by_window(config, chunk: int, over: bool, window_size) -> bool:
    """Whether a prompt chunk of ``chunk`` tokens that leaves the cache over
    its budget (``over``) is scored by its last ``prefill_window`` queries
    alone (SnapKV): on a global layer (``window_size`` None), when the chunk
    is longer than the window and the window W > 1, so that neighbour pooling
    applies. The single and the batch caches score such a chunk alike."""
    W = config.prefill_window
    return over and chunk > W > 1 and window_size is None


class ChunkFold(NamedTuple):
    """How one sequence's prompt chunk is scored and folded (``chunk_fold``)."""

    over: bool  # the chunk leaves the cache over its budget
    scored: int  # its queries whose attention is folded: the last ones
    expected: bool  # scored by expected attention (scores.ScoreMode.prefill)
    weight: int  # what one folded row stands for (an expected row: the window)
    pool: int  # neighbours its scores are max-pooled over (0: none)
    replace: bool  # its window replaces the held scores (``window_replaces``)
    compact: bool  # compacted to max_size after its attention (all modes but "prompt")


def chunk_fold(config, chunk: int, before: int, window_size=None) -> ChunkFold:
    """The decisions of a prompt chunk of ``chunk`` tokens arriving while
    ``before`` are held, one sequence's (a row's in a batch): a chunk that
    overflows the budget is scored by its last ``prefill_window`` queries
    (or their expected attention), pooled where more than one query row
    stands behind its scores, and compacted after it unless the mode is
    "prompt"."""
    over = chunk > 1 and before + chunk > config.max_size
    W = config.prefill_window
    scored = W if over and 0 < W < chunk else chunk
    expected = (scored_by_window(config, chunk, over, window_size)
                and score_mode(config.score).prefill == "expected")
    weight = W if expected else 1
    pool = config.prefill_pool if over and scored * weight > 1 else 0
    return ChunkFold(over, scored, expected, weight, pool,
                     over and window_replaces(config, chunk, before),
                     over and config.prefill_compact != "prompt")


def window_replaces(config, chunk: int, before: int) -> bool:
    """Whether a prompt chunk of ``chunk`` tokens that leaves the cache over
    its budget, arriving while ``before`` tokens are already held, replaces
    every held slot's score and count with its own window's instead of adding
    to them.

    It does when the chunk is scored by a full window (0 < ``prefill_window``
    <= ``chunk``) and the cache already held ``max_size`` tokens: what it holds
    was chosen before (by an earlier window or by decode steps), and the
    newest window, the one nearest the question, alone decides; added to the
    earlier windows' scores, a long prompt's filler would keep ranking it.
    The same holds under both ``prefill_compact`` modes. The first chunk to
    overflow (``before < max_size``) adds to what the chunks that fitted
    gave, so a prompt prefilled in one chunk is unaffected. A key-norm score
    is the key's own: no window replaces it."""
    return (0 < config.prefill_window <= chunk and before >= config.max_size
            and not score_mode(config.score).from_keys)


def pool_neighbours(x: mx.array, positions: mx.array, radius: int) -> mx.array:
    """Max of ``x`` (>= 0) over slots whose positions lie within ``radius``.

    Shapes: x, positions (B, n_kv_heads, N). Slots are put in position order
    first, so the result does not depend on the storage's slot layout.
    """
    order = mx.argsort(positions, axis=-1)
    xs = mx.take_along_axis(x, order, axis=-1)
    ps = mx.take_along_axis(positions, order, axis=-1)
    out = xs
    pad = lambda a, d, v: mx.pad(a, [(0, 0), (0, 0), d], constant_values=v)  # noqa
    big = 2**30
    # Positions are unique: those within radius sit at most radius slots away.
    for d in range(1, min(radius, x.shape[-1] - 1) + 1):
        right, pos_r = pad(xs[..., d:], (0, d), 0), pad(ps[..., d:], (0, d), big)
        left, pos_l = pad(xs[..., :-d], (d, 0), 0), pad(ps[..., :-d], (d, 0), -big)
        out = mx.maximum(out, mx.where(pos_r - ps <= radius, right, 0.0))
        out = mx.maximum(out, mx.where(ps - pos_l <= radius, left, 0.0))
    return mx.take_along_axis(out, mx.argsort(order, axis=-1), axis=-1)


def eviction_score(mode: str, score: mx.array, count: mx.array) -> mx.array:
    """The number that ranks tokens (``mode``'s rank): higher is kept."""
    if score_mode(mode).rank == "per_query":
        return score / mx.maximum(count, 1.0)
    return score


def protected(
    positions: mx.array,
    offset: int,
    sink_size: int,
    recent_budget: int,
    pinned: Sequence[Tuple[int, int]] = (),
) -> mx.array:
    """Slots that are never evicted, given ``offset`` tokens seen (incl. new ones)."""
    keep = (positions < sink_size) | (positions >= offset - recent_budget)
    for start, end in pinned:
        keep = keep | ((positions >= start) & (positions < end))
    return keep


def priority(
    score: mx.array,
    keep: mx.array,
    positions: mx.array,
    offset: int,
    window_size: Optional[int] = None,
) -> mx.array:
    """Eviction priority: +inf protected, -inf outside a sliding window."""
    pri = mx.where(keep, mx.inf, score)
    if window_size is not None:
        # The newest query sits at offset - 1; older keys are invisible to it.
        pri = mx.where(positions <= offset - 1 - window_size, -mx.inf, pri)
    return pri


def slot_priority(config, positions, score, count, offset, window_size=None,
                  zones=None) -> mx.array:
    """Eviction priority of the slots (``priority``) for ``offset`` tokens
    seen: protected zones +inf, the score mode's ranking otherwise.
    ``offset``: an int, an int32 scalar array (a compiled step's input), or
    (B, 1, 1) per row; ``zones``: (sink size, recent budget), default the
    config's (may be int32 scalar arrays)."""
    sink, recent = (config.sink_size, config.recent_budget) if zones is None else zones
    keep = protected(positions, offset, sink, recent, config.pinned)
    ranked = eviction_score(config.score, score, count)
    return priority(ranked, keep, positions, offset, window_size)


def position_mask(kpos: mx.array, qpos: mx.array, window_size: Optional[int] = None):
    """(B, n_kv_heads, L, N) bool: what queries at positions ``qpos`` (B or
    1, L; ``EMPTY`` for padding, which sees nothing) see of slots at
    positions ``kpos`` (B, n_kv_heads, N): held tokens at or before them,
    within a sliding window's last ``window_size`` positions."""
    k = kpos[:, :, None, :]
    q = qpos[:, None, :, None]
    mask = (k >= 0) & (k <= q)
    if window_size is not None:
        mask = mask & (k > q - window_size)
    return mask


def combine_masks(own, mask):
    """A cache's own mask (None, "causal" or a bool array from positions)
    with the mask the model passed: an array mask is combined (bool: and;
    additive: kept where ``own`` sees, -inf elsewhere)."""
    if not isinstance(mask, mx.array):
        return own
    if own is None or isinstance(own, str):
        return mask  # a slot-layout array mask already encodes causality
    if mask.dtype == mx.bool_:
        return own & mask
    return mx.where(own, mask, -mx.inf)


def first_empty(positions: mx.array) -> mx.array:
    """(B, n_kv_heads) lowest slot that holds no token (0 where none)."""
    return mx.argmax(positions < 0, axis=-1)


def sinks_first(pri: mx.array, positions: mx.array, sink_size: int) -> mx.array:
    """``pri`` with protected slots other than sinks just below the sinks, for
    a selection that may keep fewer slots than the protected zones hold."""
    top = mx.where(positions < sink_size, mx.inf, np.finfo(np.float32).max)
    return mx.where(pri == mx.inf, top, pri)


def order_keys(pri: mx.array, positions: mx.array) -> mx.array:
    """Unique int64 keys ordering slots by (priority, position)."""
    bits = mx.view(pri.astype(mx.float32) + 0.0, mx.int32)  # + 0.0 folds -0 into 0
    ordered = mx.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return ordered.astype(mx.int64) * (1 << 32) + positions.astype(mx.int64)


def held_keys(pri: mx.array, positions: mx.array, empty: int) -> mx.array:
    """``order_keys`` with slots that hold no token (position ``EMPTY``) at
    ``empty``: the highest key keeps them from being a victim, the lowest
    from being kept."""
    keys = order_keys(pri, positions)
    return mx.where(positions < 0, mx.array(empty, mx.int64), keys)


def select_victim(pri: mx.array, positions: mx.array) -> mx.array:
    """(B, n_kv_heads) slot of the lowest (priority, position) held token."""
    return mx.argmin(held_keys(pri, positions, HIGHEST), axis=-1)


def keep_then_evict(pri: mx.array, positions: mx.array, k: int) -> mx.array:
    """(B, n_kv_heads, n) every slot: the k kept ones (select_keep's set), best
    first, then the evicted ones, worst first (slot order is free: masks come
    from positions; a batch eviction overwrites the worst evicted slot first)."""
    order = mx.argsort(order_keys(pri, positions), axis=-1)  # ascending
    n = order.shape[-1]
    return mx.concatenate([order[..., n - k :][..., ::-1], order[..., : n - k]], axis=-1)


def keep_mask(pri: mx.array, positions: mx.array, k,
              drop: Optional[mx.array] = None) -> mx.array:
    """(B, n_kv_heads, N) True on each row's ``k`` (an int, or (B, 1, 1)
    per row) highest (priority, position) held slots: ``select_keep``'s set
    where rows hold different numbers of tokens; ``drop``: slots that rank
    below every held one."""
    keys = held_keys(pri, positions, LOWEST)
    if drop is not None:
        keys = mx.where(drop, mx.array(LOWEST, mx.int64), keys)
    rank = mx.argsort(mx.argsort(keys, axis=-1), axis=-1)  # 0 = lowest
    return rank >= positions.shape[-1] - k


def packed_order(positions: mx.array, k: int) -> mx.array:
    """(B, n_kv_heads, k) slots holding each row's tokens in position order,
    then empty ones: a gather to ``k`` slots that keeps every held token
    when no row holds more than ``k``."""
    big = mx.array(2**30, positions.dtype)
    order = mx.argsort(mx.where(positions < 0, big, positions), axis=-1)
    return order[..., :k]


def select_keep(pri: mx.array, positions: mx.array, k: int,
                drop: Optional[mx.array] = None) -> mx.array:
    """(B, n_kv_heads, k) slots of the k highest keys (``keep_mask``), in
    position order (k must not exceed the fewest slots any row keeps)."""
    keep = keep_mask(pri, positions, k, drop)
    return packed_order(mx.where(keep, positions, EMPTY), k)
