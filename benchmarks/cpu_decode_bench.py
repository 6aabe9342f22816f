"""Decode tok/s on CPU: KVCache, Rotating and H2O (dense, 8-bit, mixed 8/4-bit).

    python benchmarks/cpu_decode_bench.py [--context 512] [--budget 256] [--steps 32]
        [--repeats 3] [--model smollm2-135m]

Strategies: ``kvcache``, ``rotating`` (budget, keep 4), ``h2o_no_evict``
(room for the whole context), ``h2o_evict`` (budget, heavy = budget / 2,
evicting every step), ``h2o_q8_evict`` (8-bit K/V) and ``h2o_mixed_evict``
(heavy hitters at 8 bits, the recent window at 4). SmolLM2-135M shapes
(llama: 30 layers, 9/3 heads, head_dim 64), float32 random weights (speed does
not depend on weight values) or --model for real weights. Each trial prefills
``--context`` tokens, then times ``--steps`` synchronous decode steps.
Strategies are interleaved and repeated; a line per trial, medians and ratios
vs KVCache, a final JSON line. Preload OpenBLAS on Linux (README).
"""

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, RotatingKVCache

import mlx_h2o
from mlx_h2o import H2OConfig, make_h2o_cache
from mlx_h2o.cache import QuantConfig, quantized_cache_type

SMOLLM2 = dict(
    model_type="llama", hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
    num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, vocab_size=49152,
    head_dim=64, rope_theta=100000.0, tie_word_embeddings=True,
)


def strategies(model, context, budget):
    n = len(model.layers)
    return {
        "kvcache": lambda: [KVCache() for _ in range(n)],
        "rotating": lambda: [RotatingKVCache(max_size=budget, keep=4) for _ in range(n)],
        "h2o_no_evict": lambda: make_h2o_cache(model, H2OConfig(max_size=context + 1024)),
        "h2o_evict": lambda: make_h2o_cache(model, H2OConfig(max_size=budget, heavy_budget=budget // 2)),
        "h2o_q8_evict": lambda: quantized(model, budget),
        # heavy hitters at 8 bits, the recent window at 4 (MixedPrecisionH2OKVCache)
        "h2o_mixed_evict": lambda: quantized(model, budget, recent_bits=4),
    }


def quantized(model, budget, recent_bits=None):
    """8-bit H2O caches; ``recent_bits``: the recent window at that width (mixed)."""
    return make_h2o_cache(model, H2OConfig(max_size=budget, heavy_budget=budget // 2),
                          cache_type=quantized_cache_type(QuantConfig(8, 64, recent_bits)))


def decode_tps(model, make_cache, context, steps):
    cache = make_cache()
    tokens = mx.random.randint(0, 1000, (1, context))
    with mlx_h2o.patch():
        mx.eval(model(tokens, cache=cache))
        y = mx.array([[1]])
        mx.eval(model(y, cache=cache))  # warm-up step
        tic = time.perf_counter()
        for _ in range(steps):
            logits = model(y, cache=cache)
            y = logits[:, -1:].argmax(-1)
            mx.eval(y)
        return steps / (time.perf_counter() - tic)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default=None, help="packaged name or mlx-lm path (default: random weights)")
    args = p.parse_args()
    if args.model:
        from mlx_h2o.models import load_model

        model = load_model(args.model)[0]
    else:
        model = llama.Model(llama.ModelArgs(**SMOLLM2))
        mx.eval(model.parameters())
    strats = strategies(model, args.context, args.budget)
    weights = args.model or "random weights, smollm2-135m shapes"
    print(f"config: {weights} float32 context={args.context} budget={args.budget} "
          f"steps={args.steps} repeats={args.repeats} mlx={mx.__version__}")
    runs = {k: [] for k in strats}
    for r in range(args.repeats):
        for name, make in strats.items():
            tps = decode_tps(model, make, args.context, args.steps)
            runs[name].append(tps)
            print(f"trial={r} strategy={name} decode_tok_s={tps:.2f}")
    med = {k: statistics.median(v) for k, v in runs.items()}
    for k, v in med.items():
        print(f"{k:>16}: {v:7.2f} tok/s  ratio vs kvcache {v / med['kvcache']:.3f}")
    print(json.dumps({"median_tok_s": med, "ratio": {k: v / med["kvcache"] for k, v in med.items()}}))


if __name__ == "__main__":
    main()
