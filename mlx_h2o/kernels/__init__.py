"""Attention kernels that export their scores (imports mlx only, never mlx_lm).

``scaled_dot_product_attention_with_scores`` runs the CUDA / Metal decode
kernels (Lq <= 8) when the backend and shapes allow, else the reference in
plain mx ops. ``h2o_decode_step`` is the fused H2O decode step and
``queue_fold`` the fold of queued decode queries (GPU only; check
``h2o_step_supported`` / ``queue_fold_supported`` first).
"""

from typing import Optional, Tuple

import mlx.core as mx

from . import reference
from .backend import gpu_backend, runs_on_gpu, supported
from .decode import decode_attention
from .h2o_step import H2OFold, H2OStep, fold_step_supported, h2o_decode_step
from .h2o_step import h2o_fold_step, h2o_rows_step, h2o_step_supported, make_plan
from .queued import queue_fold, queue_fold_supported
from .reference import Mask, attention_with_column_sums, causal_mask


def scaled_dot_product_attention_with_scores(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: Mask = None,
    sinks: Optional[mx.array] = None,
    use_kernel: Optional[bool] = None,
) -> Tuple[mx.array, mx.array, mx.array]:
    """Attention that also returns the logits it used and their log-sum-exp.

    Same contract as ``reference.scaled_dot_product_attention_with_scores``.
    ``use_kernel``: None picks the GPU kernel when it supports the inputs,
    True requires it (ValueError otherwise), False forces the reference.
    Non-float inputs raise TypeError: attention in integers would return
    integer outputs, silently wrong.
    """
    for name, a in (("queries", queries), ("keys", keys), ("values", values)):
        if not mx.issubdtype(a.dtype, mx.floating):
            raise TypeError(
                f"{name} must be float16, bfloat16 or float32, got {a.dtype}: cast them "
                f"first ({name}.astype(mx.float32))"
            )
    ok = supported(queries, keys, values, mask, sinks)
    if use_kernel and not ok:
        raise ValueError(
            f"no GPU kernel for these inputs (backend={gpu_backend()}, "
            f"queries {queries.shape} {queries.dtype}, keys {keys.shape} {keys.dtype})"
        )
    if ok if use_kernel is None else use_kernel:
        return decode_attention(
            queries, keys, values, scale=scale, mask=mask, sinks=sinks
        )
    return reference.scaled_dot_product_attention_with_scores(
        queries, keys, values, scale=scale, mask=mask, sinks=sinks
    )


__all__ = [
    "H2OFold",
    "H2OStep",
    "attention_with_column_sums",
    "causal_mask",
    "fold_step_supported",
    "gpu_backend",
    "h2o_decode_step",
    "h2o_fold_step",
    "h2o_rows_step",
    "h2o_step_supported",
    "make_plan",
    "queue_fold",
    "queue_fold_supported",
    "runs_on_gpu",
    "scaled_dot_product_attention_with_scores",
]
