"""GPU kernel time per decode token, per strategy, from a CUPTI trace.

Runs a Qwen3-8B-shaped 4-bit model (random weights) under torch.profiler
(CUPTI sees every CUDA kernel of the process, MLX's included) and prints, per
strategy: wall ms per pipelined token, GPU kernel ms per token (the sum of
kernel durations), kernels per token, and the kernels that take the most time.
If kernel time is well below wall time, the step is host bound. Needs PyTorch
with CUDA next to MLX's CUDA backend. Diagnostic, not a benchmark of record.

    python3 scripts/gpu_trace.py [--context 4096] [--budget 256] [--steps 32]
"""

import argparse
import collections
import os
import sys
import time

import mlx.core as mx
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from gpu_cache_check import prefill, per_layer  # noqa: E402
from mlx_lm.models.cache import KVCache, RotatingKVCache  # noqa: E402
import mlx_h2o  # noqa: E402
from mlx_h2o import H2OConfig, make_h2o_cache  # noqa: E402
from mlx_h2o.eval.bench import random_model  # noqa: E402


def strategies(model, budget):
    n = len(model.layers)
    cfg = H2OConfig(max_size=budget, heavy_budget=budget // 2)
    return {
        "kvcache": lambda: [KVCache() for _ in range(n)],
        "rotating": lambda: [RotatingKVCache(max_size=budget, keep=4) for _ in range(n)],
        "h2o_group": lambda: make_h2o_cache(model, cfg),
        "h2o_perlayer": lambda: per_layer(cfg, model),
    }


def trace(model, cache, y, steps):
    with mlx_h2o.patch(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        mx.synchronize()
        tic = time.perf_counter()
        for _ in range(steps):
            y = model(y, cache=cache)[:, -1:].argmax(-1)
            mx.async_eval(y)
        mx.eval(y)
        wall = (time.perf_counter() - tic) / steps
    kernels = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[e.name[:70]]
            k[0] += 1
            k[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return y, wall, kernels


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--strategies", nargs="*", default=None, help="default: all")
    args = p.parse_args()
    model = random_model("qwen3-8b", bits=4, dtype=mx.bfloat16)
    print(f"mlx {mx.__version__} torch {torch.__version__} context={args.context} "
          f"budget={args.budget} steps={args.steps}")
    for rep in range(2):
        for name, make in strategies(model, args.budget).items():
            if args.strategies and name not in args.strategies:
                continue
            cache = make()
            y = prefill(model, cache, args.context)
            y, wall, kernels = trace(model, cache, y, args.steps)
            n = sum(c for c, _ in kernels.values()) / args.steps
            gpu = sum(t for _, t in kernels.values()) / args.steps / 1e3
            print(f"rep={rep} {name:>13}: wall {wall * 1e3:6.2f} ms/token  kernels "
                  f"{gpu:6.2f} ms/token  {n:6.1f} kernels/token", flush=True)
            if rep == 1:
                ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])
                top = ranked[: args.top] + [kv for kv in ranked[args.top:] if "h2o" in kv[0]]
                for k, (c, t) in top:
                    print(f"      {t / args.steps:8.1f} us/token {c / args.steps:6.1f}x  {k}")


if __name__ == "__main__":
    main()
