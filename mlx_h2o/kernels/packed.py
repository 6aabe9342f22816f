"""One uint32 buffer per layer for quantized K and V (the GPU decode layout).

A custom kernel's host cost grows with its outputs: ~3 us each on the H100,
inputs ~0.4 us. Six triples (K and V codes, scales, biases) made the quantized write kernel the
dearest op of a decode step. Packed, a row (sequence, KV head, slot) is

    [K codes: WPR words | V codes: WPR words | K scales, K biases | V scales, V biases]

with WPR = D * bits / 32 and the scales / biases (D / group_size each, the
keys' dtype) stored bit for bit in the remaining ``D / group_size *
itemsize`` words. The codes, scales and biases are those of ``mx.quantize``;
``pack`` / ``unpack`` convert without rounding.
"""

import mlx.core as mx

Triple = tuple  # (codes, scales, biases), as mx.quantize returns them


def row_words(head_dim: int, bits: int, group_size: int, dtype) -> int:
    """Words per packed row (K and V of one slot)."""
    return 2 * head_dim * bits // 32 + head_dim // group_size * dtype.size


def pack(keys: Triple, values: Triple) -> mx.array:
    """K and V triples (B, Hk, S, ·) -> (B, Hk, S, row_words) uint32."""
    (kw, ks, kb), (vw, vs, vb) = keys, values
    sb = mx.concatenate([ks, kb, vs, vb], axis=-1).view(mx.uint32)
    return mx.concatenate([kw, vw, sb], axis=-1)


def unpack(packed: mx.array, head_dim: int, bits: int, group_size: int, dtype):
    """Inverse of ``pack``: (keys, values) triples as views of ``packed``."""
    wpr, spr = head_dim * bits // 32, head_dim // group_size
    sb = packed[..., 2 * wpr:].view(dtype)
    keys = (packed[..., :wpr], sb[..., :spr], sb[..., spr:2 * spr])
    values = (packed[..., wpr:2 * wpr], sb[..., 2 * spr:3 * spr], sb[..., 3 * spr:])
    return keys, values
