"""Throughput and peak memory of cache strategies, measured interleaved.

One trial of a strategy: a fresh cache, prefill a fixed random prompt in
chunks (``prefill_step``), then decode ``generation`` tokens greedily with
mlx-lm's pipelining (``mx.async_eval`` of the next step while the graph of the
following one is built). Strategies run interleaved within each trial, so
slow drift of the machine hits all of them alike; ratios vs the baseline come
from the medians of the same run.
"""

import statistics
import time
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..integration.routing import patch
from .strategies import Strategy

# Shapes of real models, for speed runs with random weights (speed does not
# depend on weight values). Values from the models' config.json files.
RANDOM_CONFIGS = {
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36,
                     intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
                     tie_word_embeddings=False),
    "qwen3-4b": dict(model_type="qwen3", hidden_size=2560, num_hidden_layers=36,
                     intermediate_size=9728, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
                     tie_word_embeddings=True),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32,
                         intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5,
                         rope_theta=500000.0, tie_word_embeddings=False),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, num_hidden_layers=30,
                         intermediate_size=1536, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rms_norm_eps=1e-5,
                         rope_theta=100000.0, tie_word_embeddings=True),
    "gemma3-270m": dict(model_type="gemma3_text", hidden_size=640, num_hidden_layers=18,
                        intermediate_size=2048, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=256, vocab_size=262144,
                        sliding_window=512, sliding_window_pattern=6,
                        query_pre_attn_scalar=256, rope_theta=1e6,
                        rope_local_base_freq=10000.0),
}


def random_model(name: str, bits: int = 0, group_size: int = 64, dtype=mx.bfloat16,
                 seed: int = 0) -> nn.Module:
    """A random-weight model with the shapes of ``name`` (RANDOM_CONFIGS), optionally quantized."""
    from mlx_lm.utils import _get_classes

    if name not in RANDOM_CONFIGS:
        raise ValueError(f"unknown random config {name!r}; use one of {sorted(RANDOM_CONFIGS)}")
    config = dict(RANDOM_CONFIGS[name])
    mx.random.seed(seed)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    model.set_dtype(dtype)
    if bits:
        nn.quantize(model, group_size=group_size, bits=bits)
    mx.eval(model.parameters())
    return model


def _states(cache):
    out = []
    for c in cache:
        s = c.state
        out.extend(s if isinstance(s, (list, tuple)) else [s])
    return out


def one_trial(model, prompt: mx.array, strategy: Strategy, max_kv: int,
              generation: int, prefill_step: int) -> dict[str, Any]:
    """Prefill ``prompt`` (B, P) and decode ``generation`` tokens; timings and memory."""
    cache = strategy.make_cache(model, max_kv)
    mx.synchronize()
    mx.reset_peak_memory()
    B, P = prompt.shape
    with patch():
        tic = time.perf_counter()
        for s in range(0, P, prefill_step):
            logits = model(prompt[:, s : s + prefill_step], cache=cache)
            mx.eval(logits, _states(cache))
        y = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(y)
        t_prefill = time.perf_counter() - tic
        tic = time.perf_counter()
        for _ in range(generation):
            y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
            mx.async_eval(y, _states(cache))
        mx.eval(y, _states(cache))
        t_decode = time.perf_counter() - tic
    return {
        "strategy": strategy.name, "max_kv": max_kv if strategy.bounded else None,
        "prefill_tps": B * P / t_prefill, "decode_tps": B * generation / t_decode,
        "peak_gb": mx.get_peak_memory() / 1e9,
        "kv_mb": sum(getattr(c, "nbytes", 0) for c in cache) / 1e6,
    }


def summarize(trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median per (strategy, max_kv); ratios vs the baseline's medians."""
    groups: dict[tuple, list] = {}
    for t in trials:
        groups.setdefault((t["strategy"], t["max_kv"]), []).append(t)
    rows = []
    for (name, kv), ts in groups.items():
        row = {"strategy": name, "max_kv": kv, "trials": len(ts)}
        for k in ("prefill_tps", "decode_tps", "peak_gb", "kv_mb"):
            row[k] = statistics.median(t[k] for t in ts)
        row["decode_spread_pct"] = 100 * (
            (max(t["decode_tps"] for t in ts) - min(t["decode_tps"] for t in ts))
            / row["decode_tps"])
        rows.append(row)
    base = next((r for r in rows if r["strategy"] == "baseline"), None)
    for r in rows:
        if base is not None:
            r["prefill_ratio"] = r["prefill_tps"] / base["prefill_tps"]
            r["decode_ratio"] = r["decode_tps"] / base["decode_tps"]
            r["peak_delta_gb"] = r["peak_gb"] - base["peak_gb"]
    return rows
