"""Reference attention with scores over affine-quantized K/V, in plain mx ops.

Keys and values are MLX affine-quantized triples (``mx.quantize``: packed
uint32 weights, scales, biases; one (scale, bias) per ``group_size`` values
along head_dim). A cache may hold several *segments* of slots, each at its own
bit width (mixed precision): the slot axis of the attention is the segments
concatenated in order. The specification is "dequantize in float32, then the
dense reference kernel"; the GPU kernels are tested against it.
"""

from collections.abc import Sequence

import mlx.core as mx

from .reference import (
    Mask,
    grouped_mask,
    masked_softmax,
    scaled_dot_product_attention_with_scores,
)

Triple = tuple[mx.array, mx.array, mx.array]
BITS = (2, 4, 8)  # power-of-two widths: a uint32 holds 32 / bits whole values
GROUP_SIZES = (32, 64, 128)


def check_quantization(bits: int, group_size: int, head_dim: int | None = None):
    """ValueError unless (bits, group_size[, head_dim]) is a supported layout."""
    if bits not in BITS:
        raise ValueError(f"bits={bits} is not supported; use one of {BITS}")
    if group_size not in GROUP_SIZES:
        raise ValueError(
            f"group_size={group_size} is not supported; use one of {GROUP_SIZES}"
        )
    if head_dim is not None and head_dim % group_size:
        raise ValueError(
            f"head_dim={head_dim} is not a multiple of group_size={group_size}: "
            "use a group size that divides the head dimension"
        )


def as_segments(kv, bits) -> tuple[tuple[Triple, ...], tuple[int, ...]]:
    """Normalise one triple + int bits, or sequences of both, to segments."""
    if isinstance(kv[0], mx.array):
        kv = (kv,)
    bits = (bits,) * len(kv) if isinstance(bits, int) else tuple(bits)
    if len(bits) != len(kv) or any(len(t) != 3 for t in kv):
        raise ValueError(
            f"expected (w, scales, biases) triples with one bits value each, got "
            f"{len(kv)} segment(s) and bits={bits}"
        )
    return tuple(tuple(t) for t in kv), bits


def dequantize(t: Triple, *, bits: int, group_size: int, dtype=mx.float32) -> mx.array:
    """(…, N, D) values of a triple, computed as scale * q + bias in ``dtype``."""
    w, s, b = t
    return mx.dequantize(
        w, s.astype(dtype), b.astype(dtype), group_size=group_size, bits=bits
    )


def dequantize_segments(kv, bits, group_size: int, dtype=mx.float32) -> mx.array:
    """Dequantize every segment and concatenate them along the slot axis."""
    kv, bits = as_segments(kv, bits)
    parts = [
        dequantize(t, bits=b, group_size=group_size, dtype=dtype)
        for t, b in zip(kv, bits)
        if t[0].shape[2] > 0
    ]
    if not parts:
        w, s, _ = kv[0]
        return mx.zeros((*w.shape[:3], s.shape[-1] * group_size), dtype)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


def quantized_scaled_dot_product_attention_with_scores(
    queries: mx.array,
    keys: Triple | Sequence[Triple],
    values: Triple | Sequence[Triple],
    *,
    scale: float,
    bits: int | Sequence[int] = 8,
    group_size: int = 64,
    mask: Mask = None,
    sinks: mx.array | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """Reference: dequantize K/V in float32, then the dense reference kernel.

    Shapes:
        queries: (B, n_heads, L, D); keys: a triple (w (B, n_kv_heads, N, D *
            bits / 32) uint32, scales and biases (B, n_kv_heads, N, D /
            group_size)), or a sequence of such triples (segments, one bits
            value each, concatenated along N); values likewise.
        mask, sinks: as for ``scaled_dot_product_attention_with_scores``.
    Returns:
        out (B, n_heads, L, D) in the queries' dtype; logits float32
        (B, n_heads, L, N); lse float32 (B, n_heads, L).
    """
    k = dequantize_segments(keys, bits, group_size)
    v = dequantize_segments(values, bits, group_size)
    return scaled_dot_product_attention_with_scores(
        queries, k, v, scale=scale, mask=mask, sinks=sinks
    )


def quantized_matmul_attention_with_scores(
    queries: mx.array,
    keys: Triple | Sequence[Triple],
    values: Triple | Sequence[Triple],
    *,
    scale: float,
    bits: int | Sequence[int] = 8,
    group_size: int = 64,
    mask: Mask = None,
    sinks: mx.array | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """The reference's numbers via ``mx.quantized_matmul``, one or more
    precision segments (a triple and int bits, or a sequence of each).

    Never materialises the dequantized cache: the matmuls read the packed
    data, two per segment. Computed in float32 (queries and scales are cast),
    so it agrees with the reference to float32 rounding. Shapes as for the
    reference.
    """
    keys, kbits = as_segments(keys, bits)
    values, _ = as_segments(values, bits)
    B, Hq, L, D = queries.shape
    Hk = keys[0][0].shape[1]
    if Hq % Hk:
        raise ValueError(f"n_heads={Hq} is not a multiple of n_kv_heads={Hk}")
    G = Hq // Hk
    q = queries.astype(mx.float32).reshape(B, Hk, G * L, D)  # (B, Hk, G*L, D)
    segs = [(k, v, b) for k, v, b in zip(keys, values, kbits) if k[0].shape[2] > 0]
    if not segs:
        raise ValueError("no K/V slots to attend: every segment is empty")
    parts = [_qmm(q, k, b, group_size, transpose=True) for k, _, b in segs]
    N = sum(p.shape[-1] for p in parts)
    logits = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    logits = logits.reshape(B, Hk, G, L, N) * scale
    logits, probs, lse = masked_softmax(
        logits, grouped_mask(mask, B, Hq, Hk, L, N), sinks
    )
    probs = probs.reshape(B, Hk, G * L, N)
    out, start = None, 0
    for k, v, b in segs:  # each segment's share of the output
        n = k[0].shape[2]
        part = _qmm(probs[..., start : start + n], v, b, group_size, transpose=False)
        out, start = part if out is None else out + part, start + n
    return (
        out.astype(queries.dtype).reshape(B, Hq, L, -1),
        logits.reshape(B, Hq, L, N),
        lse.reshape(B, Hq, L),
    )


def _qmm(x: mx.array, t: Triple, bits: int, group_size: int, transpose: bool) -> mx.array:
    """``x`` times a triple's values (transposed for K) in float32."""
    w, s, b = t
    return mx.quantized_matmul(x, w, s.astype(mx.float32), b.astype(mx.float32),
                               transpose=transpose, group_size=group_size, bits=bits)
