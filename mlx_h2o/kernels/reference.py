"""Reference attention with exported scores, in plain mx ops.

This is the CPU implementation and the specification the GPU kernels are
tested against. Everything is computed in float32 whatever the input dtype.
"""

from typing import Optional, Tuple, Union

import mlx.core as mx

Mask = Union[None, str, mx.array]


def causal_mask(L: int, N: int) -> mx.array:
    """Bottom-right aligned causal mask (mlx-lm's "causal"): query i sits at key N - L + i."""
    q_idx = mx.arange(N - L, N)[:, None]
    return q_idx >= mx.arange(N)[None]  # (L, N)


def grouped_mask(mask: Mask, B: int, Hq: int, Hk: int, L: int, N: int):
    """Bring a mask to the grouped layout (B|1, Hk|1, G|1, L, N).

    Accepted: None, "causal", or an array broadcastable to (B, Hq, L, N), or
    with a head axis of n_kv_heads (one mask per KV head, shared by its group).
    """
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}: use None, 'causal' or an array")
        return causal_mask(L, N)[None, None, None]
    if mask.ndim > 4:
        raise ValueError(f"mask must have at most 4 dims, got shape {mask.shape}")
    while mask.ndim < 4:
        mask = mask[None]
    heads = mask.shape[1]
    if heads == Hq:  # (B, Hq, L, N) -> (B, Hk, G, L, N)
        return mask.reshape(mask.shape[0], Hk, Hq // Hk, *mask.shape[2:])
    if heads in (1, Hk):
        return mx.expand_dims(mask, 2)
    raise ValueError(
        f"mask head axis {heads} matches neither n_heads={Hq} nor n_kv_heads={Hk}"
    )


def masked_softmax(logits: mx.array, mask, sinks: Optional[mx.array] = None):
    """Mask grouped float32 logits (B, Hk, G, L, N); return (logits, probs, lse).

    ``mask`` in the grouped layout of ``grouped_mask``; ``sinks`` (n_heads,)
    add a softmax column with no value.
    """
    if mask is not None:
        if mask.dtype == mx.bool_:
            logits = mx.where(mask, logits, -mx.inf)
        else:
            logits = logits + mask.astype(mx.float32)
    row_max = logits.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(mx.float32).reshape(1, *logits.shape[1:3], 1, 1)
        row_max = mx.maximum(row_max, sink)
    # Fully masked rows: keep the shift finite so they give out 0, lse -inf.
    shift = mx.where(mx.isinf(row_max), 0.0, row_max)
    e = mx.exp(logits - shift)
    denom = e.sum(axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + mx.exp(sink - shift)
    lse = mx.log(denom) + shift
    return logits, e / mx.where(denom > 0, denom, 1.0), lse


def scaled_dot_product_attention_with_scores(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: Mask = None,
    sinks: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array, mx.array]:
    """Attention that also returns the logits it used and their log-sum-exp.

    Shapes:
        queries: (B, n_heads, L, D); keys: (B, n_kv_heads, N, D);
        values: (B, n_kv_heads, N, Dv); n_heads a multiple of n_kv_heads.
        mask: None, "causal", bool (True = attend) or additive, broadcastable
            to (B, n_heads, L, N), or per KV head (B, n_kv_heads, L, N).
        sinks: optional (n_heads,) logits of an attention sink (an extra
            softmax column with no value).
    Returns:
        out (B, n_heads, L, Dv) in the queries' dtype; logits float32
        (B, n_heads, L, N) = scale * q.k (+ mask; masked -> -inf); lse float32
        (B, n_heads, L), so probabilities are exp(logits - lse).
    """
    B, Hq, L, D = queries.shape
    Hk, N = keys.shape[1], keys.shape[2]
    if Hq % Hk:
        raise ValueError(f"n_heads={Hq} is not a multiple of n_kv_heads={Hk}")
    G = Hq // Hk
    # A GQA group's G * L query rows as one matrix per KV head: one GEMM
    # each, no K / V broadcast over G (~28% less CPU time per decode step).
    q = queries.astype(mx.float32).reshape(B, Hk, G * L, D)
    logits = (q @ keys.astype(mx.float32).swapaxes(-1, -2)) * scale
    logits, probs, lse = masked_softmax(
        logits.reshape(B, Hk, G, L, N), grouped_mask(mask, B, Hq, Hk, L, N), sinks
    )
    out = (probs.reshape(B, Hk, G * L, N) @ values.astype(mx.float32)).astype(queries.dtype)
    return (
        out.reshape(B, Hq, L, -1),
        logits.reshape(B, Hq, L, N),
        lse.reshape(B, Hq, L),
    )


def attention_with_column_sums(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: Mask = None,
    sinks: Optional[mx.array] = None,
    weights: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array, mx.array]:
    """Attention and the per-key sums a score fold needs, without the logits.

    What folding ``scaled_dot_product_attention_with_scores``' exp(logits -
    lse) gives (up to float32 summation order), in one softmax and two GEMMs
    where the logits' way takes four more passes over (B, n_heads, L, N).

    Shapes: as ``scaled_dot_product_attention_with_scores``; ``weights``
    (B, L) float32 per query (None: all 1). Returns out (B, n_heads, L, Dv)
    in the queries' dtype; probs (B, n_kv_heads, N) float32, the weighted
    sum over queries of the group-mean softmax probability of each key;
    seen (B, n_kv_heads, N) float32, the weighted count of queries whose
    group's first head may see the key. A query that sees no key gives out
    0 and adds nothing.
    """
    B, Hq, L, D = queries.shape
    Hk, N = keys.shape[1], keys.shape[2]
    if Hq % Hk:
        raise ValueError(f"n_heads={Hq} is not a multiple of n_kv_heads={Hk}")
    G = Hq // Hk
    q = queries.astype(mx.float32).reshape(B, Hk, G * L, D)
    logits = ((q @ keys.astype(mx.float32).swapaxes(-1, -2)) * scale).reshape(B, Hk, G, L, N)
    w = mx.ones((B, L), mx.float32) if weights is None else weights.astype(mx.float32)
    w = w.reshape(B, 1, 1, L)
    m = grouped_mask(mask, B, Hq, Hk, L, N)  # (B|1, Hk|1, G|1, L, N)
    if m is None:
        sees, seen = None, mx.broadcast_to(w.sum(axis=-1), (B, Hk, N))
    else:
        visible = m if m.dtype == mx.bool_ else m > -mx.inf
        sees = visible.any(axis=-1)  # (B|1, Hk|1, G|1, L)
        seen = (w @ visible[:, :, 0].astype(mx.float32))[:, :, 0]  # (B, Hk|1, N)
        seen = mx.broadcast_to(seen, (B, Hk, N))
        # A query that sees nothing attends every key (finite probabilities),
        # then counts for nothing: its weight and output are zeroed.
        if m.dtype == mx.bool_:
            logits = mx.where(m | ~sees[..., None], logits, -mx.inf)
        else:
            logits = logits + mx.where(sees[..., None], m, 0.0).astype(mx.float32)
    if sinks is None:
        probs = mx.softmax(logits, axis=-1, precise=True)
    else:
        _, probs, _ = masked_softmax(logits, None, sinks)
    probs = probs.reshape(B, Hk, G * L, N)
    out = probs @ values.astype(mx.float32)  # (B, Hk, G * L, Dv)
    row_w = mx.broadcast_to(w, (B, Hk, G, L))
    if sees is not None:
        row_w = row_w * sees
        out = out * mx.broadcast_to(sees, (B, Hk, G, L)).reshape(B, Hk, G * L, 1)
    colsum = (row_w.reshape(B, Hk, 1, G * L) / G) @ probs  # (B, Hk, 1, N)
    out = out.astype(queries.dtype).reshape(B, Hq, L, -1)
    return out, colsum[:, :, 0], seen
