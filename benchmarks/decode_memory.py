"""Active memory after decoding below the budget, H2O vs mlx-lm's KVCache.

SmolLM2-135M (packaged; ``--model`` another), a 1024-token prompt, 256
greedy tokens (``--steps``) through mlx-lm's generate_step, H2O with max_size
2048 (nothing evicted) per score mode. A decode step's metadata update left lazy would hold its logits or K
buffer, and H2O's active memory would grow with each token; it should end
within ~1 MiB of KVCache's.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python benchmarks/decode_memory.py [--model smollm2-135m] [--steps 256]
"""

import argparse
import gc

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import mlx_h2o
from mlx_h2o import H2OConfig, make_h2o_cache
from mlx_h2o.models import load_model


def active_after(model, prompt, cache, steps=256):
    """MiB of MLX active memory once ``steps`` tokens are generated."""
    with mlx_h2o.patch():
        for _ in zip(range(steps), generate_step(prompt, model, prompt_cache=cache)):
            pass
    gc.collect()
    return mx.get_active_memory() / 2**20


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="packaged name or mlx-lm path")
    p.add_argument("--steps", type=int, default=256, help="tokens generated")
    args = p.parse_args()
    model, _ = load_model(args.model)
    prompt = mx.array(list(range(1000, 2024)))
    base = active_after(model, prompt, make_prompt_cache(model), args.steps)
    print(f"KVCache: active {base:.1f} MiB")
    for mode in ("accumulated", "ema"):
        cache = make_h2o_cache(model, H2OConfig(max_size=2048, score=mode),
                               layer_budget="uniform")
        mib = active_after(model, prompt, cache, args.steps)
        print(f"H2O {mode}: active {mib:.1f} MiB ({mib - base:+.1f} vs KVCache; "
              f"evicted {sum(c.evicted for c in cache)})")


if __name__ == "__main__":
    main()
