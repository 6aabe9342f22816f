"""Resident KV bytes of quantized H2O caches (measured ``nbytes``) and decode-step cost.

    python benchmarks/quantized_memory.py [--contexts 4096 16384] [--max-kv 256 1024]

One attention layer with Qwen3-8B's K/V shape (8 KV heads, head_dim 128,
float16), filled through the real cache path (512-token prefill chunks with
attention and compaction). Reports bytes per kept token from ``cache.nbytes``
(K/V buffers plus H2O bookkeeping) and the compression ratio vs an unbounded
float16 mlx-lm ``KVCache`` of the same context. Then times decode steps
(update + attention, CPU) and counts mixed-precision promotions.
"""

import argparse
import json
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from mlx_h2o import H2OConfig
from mlx_h2o.cache import QuantConfig, quantized_cache_type

B, HK, HQ, D = 1, 8, 8, 128
KINDS = {
    "h2o_fp16": None,
    "h2o_q8": QuantConfig(8, 64),
    "h2o_q4": QuantConfig(4, 64),
    "h2o_mixed_8_4": QuantConfig(8, 64, 4),
}


def kv(rng, L):
    return [
        mx.array(rng.standard_normal((B, h, L, D)).astype(np.float16))
        for h in (HQ, HK, HK)
    ]


def feed(cache, q, k, v):
    L = k.shape[2]
    if not hasattr(cache, "h2o_attention"):
        cache.update_and_fetch(k, v)
        mx.eval(cache.state)
        return
    mask = cache.make_mask(L)
    keys, values = cache.update_and_fetch(k, v)
    mx.eval(cache.h2o_attention(q, keys, values, scale=D**-0.5, mask=mask))


def fill(cache, context, rng, chunk=512):
    for s in range(0, context, chunk):
        feed(cache, *kv(rng, min(chunk, context - s)))
    return cache


def memory_rows(contexts, budgets):
    rows, rng = [], np.random.default_rng(0)
    for C in contexts:
        ref = fill(KVCache(), C, rng).nbytes
        row = {"context": C, "cache": "mlx_lm_fp16_unbounded", "nbytes": ref}
        rows.append({**row, "bytes_per_token": ref / C, "ratio": 1.0})
        for bits in (8, 4):
            n = fill(QuantizedKVCache(64, bits), C, rng).nbytes
            rows.append(
                {
                    "context": C,
                    "cache": f"mlx_lm_q{bits}_unbounded",
                    "nbytes": n,
                    "bytes_per_token": n / C,
                    "ratio": ref / n,
                }
            )
        for M in budgets:
            cfg = H2OConfig(max_size=M, sink_size=4, heavy_budget=M // 2)
            for name, quant in KINDS.items():
                cache = fill(quantized_cache_type(quant)(cfg), C, rng)
                meta = sum(
                    a.nbytes for a in (cache.positions, cache.score, cache.count)
                )
                kept = cache.size()
                rows.append(
                    {
                        "context": C,
                        "cache": f"{name}_max{M}",
                        "nbytes": cache.nbytes,
                        "kv_nbytes": cache.nbytes - meta,
                        "kept": kept,
                        "bytes_per_token": cache.nbytes / kept,
                        "kv_bytes_per_token": (cache.nbytes - meta) / kept,
                        "ratio": ref / cache.nbytes,
                    }
                )
    for r in rows:
        print(
            " ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in r.items()
            )
        )
    return rows


def step_costs(max_kv, steps):
    """Median ms per decode step (update + attention) and promotions per step."""
    out, cfg = {}, H2OConfig(max_size=max_kv, sink_size=4, heavy_budget=max_kv // 2)
    for name, quant in KINDS.items():
        rng = np.random.default_rng(1)
        cache = fill(quantized_cache_type(quant)(cfg), 2 * max_kv, rng)
        times, promoted = [], 0
        R = cfg.recent_budget
        for _ in range(steps):
            q, k, v = kv(rng, 1)
            tic = time.perf_counter()
            feed(cache, q, k, v)
            times.append(time.perf_counter() - tic)
            exiting = cache.offset - 1 - R  # left the recent window this step
            pos = np.array(cache.positions[..., : cache.size()])
            promoted += int((pos == exiting).sum())
        out[name] = {
            "ms_per_step": 1e3 * float(np.median(times)),
            "promotions_per_head_step": promoted / (steps * B * HK),
        }
        print(
            f"step max_kv={max_kv} cache={name} ms={out[name]['ms_per_step']:.3f} "
            f"promotions_per_head_step={out[name]['promotions_per_head_step']:.3f}"
        )
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--max-kv", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args()
    print(
        f"# layer B={B} n_kv_heads={HK} head_dim={D} float16 mlx={mx.__version__} "
        f"device={mx.default_device()}"
    )
    result = {
        "memory": memory_rows(args.contexts, args.max_kv),
        "steps": {M: step_costs(M, args.steps) for M in args.max_kv},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
