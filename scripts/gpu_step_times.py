"""Per-step decode times of one cache strategy, and what MLX compiled in the slow ones.

    python3 scripts/gpu_step_times.py [--context 4096] [--steps 200] [--strategy h2o_no_evict]
        [--jit-dir /tmp/mlx]

A Qwen3-8B-shaped random 4-bit model (as scripts/gpu_cache_check.py) is
prefilled (timed: a first prompt also builds kernels), then decoded one
synchronous step at a time. Steps slower than
3x the median are listed with the files that appeared meanwhile under
--jit-dir (MLX's on-disk cache of JIT-compiled CUDA kernels): a kernel built
on first use shows up there. Used to explain the slow rounds of H2O without
eviction in docs/data/gpu_cache_check_s16_loaded.log (docs/GPU.md, session 17).
"""

import argparse
import os
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

import mlx_h2o
from mlx_h2o import H2OConfig, make_h2o_cache
from mlx_h2o.cache import QuantConfig, quantized_cache_type
from mlx_h2o.eval.bench import random_model


def files(root):
    found = set()
    for d, _, names in os.walk(root):
        found.update(os.path.join(d, n) for n in names)
    return found


def make_cache(strategy, model, context):
    n = len(model.layers)
    if strategy == "kvcache":
        return [KVCache() for _ in range(n)]
    if strategy == "rotating_256":
        return [RotatingKVCache(max_size=256, keep=4) for _ in range(n)]
    if strategy == "h2o_no_evict":
        return make_h2o_cache(model, H2OConfig(max_size=context + 4096))
    if strategy == "h2o_evict_256":
        return make_h2o_cache(model, H2OConfig(max_size=256, heavy_budget=128))
    if strategy == "h2o_q8_evict_256":
        return make_h2o_cache(model, H2OConfig(max_size=256, heavy_budget=128),
                              cache_type=quantized_cache_type(QuantConfig(8, 64)))
    raise ValueError(f"unknown strategy {strategy!r}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--strategy", default="h2o_no_evict",
                   choices=["kvcache", "rotating_256", "h2o_no_evict", "h2o_evict_256",
                            "h2o_q8_evict_256"])
    p.add_argument("--jit-dir", default="/tmp/mlx")
    p.add_argument("--model", default="qwen3-8b", help="a random config (eval/bench.py)")
    args = p.parse_args()
    model = random_model(args.model, bits=4, dtype=mx.bfloat16)
    cache = make_cache(args.strategy, model, args.context)
    with mlx_h2o.patch():
        before, t0 = files(args.jit_dir), time.perf_counter()
        for s in range(0, args.context, 512):
            mx.eval(model(mx.random.randint(0, 1000, (1, min(512, args.context - s))),
                          cache=cache))
        prompt_s, prompt_new = time.perf_counter() - t0, files(args.jit_dir) - before
        y, times, new = mx.array([[1]]), [], []
        for _ in range(args.steps):
            before = files(args.jit_dir)
            t0 = time.perf_counter()
            y = model(y, cache=cache)[:, -1:].argmax(-1)
            mx.eval(y)
            times.append(time.perf_counter() - t0)
            new.append(sorted(files(args.jit_dir) - before))
    med = statistics.median(times)
    print(f"{args.strategy} context={args.context} steps={args.steps} "
          f"median {med * 1e3:.2f} ms, total {sum(times):.2f} s, mlx {mx.__version__}")
    print(f"prompt: {prompt_s:.2f} s in chunks of 512, {len(prompt_new)} new JIT files")
    for i, (t, f) in enumerate(zip(times, new)):
        if t > 3 * med or f:
            print(f"step {i:4d}: {t * 1e3:9.1f} ms  new JIT files: {len(f)}")
            for name in f[:8]:
                print(f"      {os.path.relpath(name, args.jit_dir)}")


if __name__ == "__main__":
    main()
