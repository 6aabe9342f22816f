"""Attention with scores over quantized K/V: one entry point, paths behind it.

- GPU decode (L <= 8, CUDA or Metal): the fused kernel of
  ``quantized_gpu``, which reads the packed words and dequantizes in registers.
- CPU decode (L = 1): ``mx.quantized_matmul`` per precision segment (never
  materialises the cache).
- otherwise (prefill, and mixed segments on GPU): the reference,
  dequantize then the dense reference kernel.
All paths return the reference's numbers (out, logits float32, lse float32).
"""

from collections.abc import Sequence

import mlx.core as mx

from .quantized_reference import (
    Mask,
    Triple,
    as_segments,
    quantized_matmul_attention_with_scores,
    quantized_scaled_dot_product_attention_with_scores,
)

MAX_DECODE_L = 8


def _gpu_module():
    try:
        from . import quantized_gpu
    except ImportError:  # the shared GPU kernel body is not in this build
        return None
    return quantized_gpu


def on_gpu() -> bool:
    """Whether work runs on the GPU device (the fused kernel's precondition)."""
    return mx.default_device() == mx.gpu


def uses_kernel(queries: mx.array, keys, values, *, bits=8, group_size: int = 64,
                **_) -> bool:
    """Whether ``quantized_attention(..., use_kernel=None)`` runs the fused GPU
    kernel for these inputs (its other arguments are taken and ignored)."""
    if not on_gpu() or queries.shape[2] > MAX_DECODE_L:
        return False
    module = _gpu_module()
    keys, _ = as_segments(keys, bits)
    values, _ = as_segments(values, bits)
    return module is not None and module.applies(queries, keys, values, group_size)


def quantized_attention(
    queries: mx.array,
    keys: Triple | Sequence[Triple],
    values: Triple | Sequence[Triple],
    *,
    scale: float,
    bits: int | Sequence[int] = 8,
    group_size: int = 64,
    mask: Mask = None,
    sinks: mx.array | None = None,
    use_kernel: bool | None = None,
):
    """Quantized attention with scores; ``use_kernel``: None picks the fused GPU
    kernel where it applies, True requires it (ValueError otherwise), False
    skips it.

    Shapes and returns as ``quantized_scaled_dot_product_attention_with_scores``.
    """
    keys, kbits = as_segments(keys, bits)
    values, _ = as_segments(values, bits)
    gpu = on_gpu()
    if use_kernel is None and (not gpu or queries.shape[2] > MAX_DECODE_L):
        use_kernel = False  # prefill (and CPU) take the dequantize / matmul paths
    if use_kernel is not False:
        module = _gpu_module()
        out = None
        if module is not None:
            out = module.fused_quantized_attention(
                queries, keys, values, scale=scale, bits=kbits,
                group_size=group_size, mask=mask, sinks=sinks,
            )
        if out is not None:
            return out
        if use_kernel:
            raise ValueError(
                "no fused quantized kernel for these inputs (needs a CUDA or Metal "
                "backend, L <= 8, head_dim 64/96/128/256, one segment on Metal or two "
                f"on CUDA; queries {queries.shape}, {len(keys)} segments)"
            )
    if not gpu and queries.shape[2] == 1:
        # MLX's CPU quantized_matmul runs row by row: past decode's few rows,
        # dequantizing and one BLAS GEMM was 2-7x faster (measured on this project's CPU).
        return quantized_matmul_attention_with_scores(
            queries,
            keys,
            values,
            scale=scale,
            bits=kbits,
            group_size=group_size,
            mask=mask,
            sinks=sinks,
        )
    return quantized_scaled_dot_product_attention_with_scores(
        queries,
        keys,
        values,
        scale=scale,
        bits=kbits,
        group_size=group_size,
        mask=mask,
        sinks=sinks,
    )
