"""mlx-lm integration: cache factory, attention routing, generation."""
