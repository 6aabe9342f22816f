"""Attention kernels that export their scores (imports mlx only, never mlx_lm)."""

from .reference import causal_mask, scaled_dot_product_attention_with_scores

__all__ = ["causal_mask", "scaled_dot_product_attention_with_scores"]
