"""GPU check of the fused quantized attention, then decode timings.

    python tools/gpu_check_quantized.py [--quick] [--no-model | --model-only]
        [--context 2048] [--max-kv 1024] [--steps 32] [--reps 2]

1. kernel vs float64 (tests/test_quantized_kernel.check: logits, lse, out)
   over dtypes, head dims, widths (mixed too), odd lengths, GQA, masks, sinks;
2. quantized H2O caches decoding on the GPU (fused kernel) vs the CPU path:
   same kept positions, outputs within float16 rounding;
3. attention microbench (B=1, 32/8 heads, D=128, fp16): fused vs dequantize
   path vs mlx-lm's quantized SDPA vs dense;
4. decode tok/s of a Qwen3-8B-shaped random 4-bit model per cache: mlx-lm's
   KVCache and QuantizedKVCache(8), dense H2O, 8-bit H2O read by the fused
   kernel and by dequantizing, 4-bit, mixed 8/4-bit.
Prints ``key=value`` lines and a final JSON line. Run it on a GPU: the fused
kernel needs MLX with CUDA or Metal.
"""

import argparse
import functools
import json
import os
import sys
import time

import mlx.core as mx
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_quantized_kernel import check, make

from mlx_h2o.eval.bench import random_model
from mlx_h2o.kernels.quantized import quantized_attention


def kernel_cases(quick):
    """About 25 kernel instantiations (each compiles once), lengths varied within."""
    rng = np.random.default_rng(0)
    lengths = (1, 97, 1025) if quick else (1, 97, 257, 1025, 4097)
    f16, base = mx.float16, {"D": 128, "gs": 64, "mask": "none", "sinks": False}
    groups = [  # (overrides, bits list, heads list)
        ({}, [(8,), (4,), (2,), (8, 4)], [(8, 2), (4, 4)]),
        ({"mask": "causal"}, [(8,)], [(8, 2)]),
        ({"mask": "bool_kv"}, [(8,), (8, 4)], [(8, 2)]),
        ({"mask": "additive", "sinks": True}, [(4,)], [(8, 2)]),
        ({"sinks": True}, [(8,)], [(8, 2)]),
        ({"dtype": mx.bfloat16}, [(4,)], [(8, 2)]),
        ({"dtype": mx.float32}, [(8, 4)], [(8, 2)]),
        ({"D": 64}, [(4,), (8, 4)], [(8, 2)]),
        ({"D": 96, "gs": 32}, [(4,), (8, 4)], [(6, 2)]),
        ({"D": 256, "gs": 128}, [(8,), (8, 4)], [(4, 1)]),
    ]
    for over, bits_list, heads_list in groups:
        for bits in bits_list:
            for heads in heads_list:
                for N in lengths:
                    for L in (1, 3):
                        if over.get("mask") == "causal" and L == 1:
                            continue
                        c = {**base, "dtype": f16, **over, "bits": bits, "heads": heads}
                        yield {**c, "N": N, "L": L, "rng": rng}


def run_case(c):
    Hq, Hk = c["heads"]
    B, L, N, D, rng = 2, c["L"], c["N"], c["D"], c["rng"]
    q, k, v, k64, v64 = make(
        B, Hq, Hk, L, N, D, c["bits"], c["gs"], c["dtype"], rng, segments=len(c["bits"])
    )
    mask = mask_np = sinks = sinks_np = None
    if c["mask"] == "causal":
        mask, mask_np = "causal", np.arange(N - L, N)[:, None] >= np.arange(N)[None]
    elif c["mask"] == "bool_kv":
        m = rng.random((B, Hk, L, N)) > 0.3
        mask, mask_np = mx.array(m), np.repeat(m, Hq // Hk, axis=1)
    elif c["mask"] == "additive":
        m = rng.standard_normal((1, 1, L, N)).astype(np.float32)
        mask, mask_np = mx.array(m), m.astype(np.float64)
    if c["sinks"]:
        s = rng.standard_normal(Hq).astype(np.float32)
        sinks, sinks_np = mx.array(s), s.astype(np.float64)
    scale = D**-0.5
    res = quantized_attention(
        q,
        k,
        v,
        scale=scale,
        bits=c["bits"][: len(k)],
        group_size=c["gs"],
        mask=mask,
        sinks=sinks,
        use_kernel=True,
    )
    mx.eval(res)
    check(res, q, k64, v64, scale, c["dtype"], mask_np, sinks_np)


def check_kernel(quick):
    n = fails = 0
    for c in kernel_cases(quick):
        n += 1
        try:
            run_case(c)
        except AssertionError as e:
            fails += 1
            if fails <= 5:
                label = {k: v for k, v in c.items() if k != "rng"}
                print(f"FAIL {label}: {str(e).splitlines()[0][:300]}")
    print(f"kernel_cases={n} kernel_failures={fails}")
    return fails


def check_caches():
    from mlx_h2o import H2OConfig
    from mlx_h2o.cache import QuantConfig, quantized_cache_type

    cfg = H2OConfig(max_size=64, sink_size=4, heavy_budget=30)
    worst, same = {1: 0.0, 40: 0.0}, True  # by chunk length: decode / prefill
    for quant in (QuantConfig(8, 64), QuantConfig(4, 64), QuantConfig(8, 64, 4)):
        rng = np.random.default_rng(1)
        gpu, cpu = (quantized_cache_type(quant)(cfg) for _ in range(2))
        for L in [40] + [1] * 60:
            q, k, v = (
                mx.array(rng.standard_normal((1, h, L, 128)).astype(np.float16))
                for h in (8, 2, 2)
            )
            outs = []
            for cache, dev in ((gpu, mx.gpu), (cpu, mx.cpu)):
                with mx.stream(dev):
                    mask = cache.make_mask(L)
                    keys, values = cache.update_and_fetch(k, v)
                    outs.append(
                        cache.h2o_attention(q, keys, values, scale=0.088, mask=mask)
                    )
                    mx.eval(outs[-1], cache.positions)
            diff = np.abs(np.array(outs[0] - outs[1], dtype=np.float32)).max()
            worst[L] = max(worst[L], float(diff))
            a, b = (
                np.sort(np.array(c.positions[..., : c.size()]), -1) for c in (gpu, cpu)
            )
            same = same and a.shape == b.shape and bool((a == b).all())
    print(
        f"cache_gpu_vs_cpu_max_out_diff decode={worst[1]:.3g} prefill={worst[40]:.3g} "
        f"cache_same_positions={same}"
    )
    return worst[1] < 4e-3 and same  # float16 output rounding (eps 2^-11 * |v| ~ 4)


def timeit(fn, iters=50):
    for _ in range(5):
        mx.eval(fn())
    tic = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn())
    return (time.perf_counter() - tic) / iters * 1e6


def microbench(quick):
    from mlx_lm.models.base import quantized_scaled_dot_product_attention as mlx_qsdpa

    from mlx_h2o.kernels import scaled_dot_product_attention_with_scores as dense_scores
    from mlx_h2o.kernels.reference import (
        scaled_dot_product_attention_with_scores as dense_reference,
    )

    rows = []
    for N in (256, 1024, 4096) if quick else (256, 1024, 4096, 16384):
        q = mx.random.normal((1, 32, 1, 128)).astype(mx.float16)
        k = mx.random.normal((1, 8, N, 128)).astype(mx.float16)
        v = mx.random.normal((1, 8, N, 128)).astype(mx.float16)
        t = {}
        qa = functools.partial(quantized_attention, q, scale=0.088)
        for bits in (8, 4):
            kq, vq = mx.quantize(k, bits=bits), mx.quantize(v, bits=bits)
            mx.eval(kq, vq)
            t[f"fused_q{bits}"] = timeit(
                functools.partial(qa, kq, vq, bits=bits, use_kernel=True)
            )
            t[f"dequant_q{bits}"] = timeit(
                functools.partial(qa, kq, vq, bits=bits, use_kernel=False)
            )
            t[f"mlx_lm_qsdpa_q{bits}"] = timeit(
                functools.partial(
                    mlx_qsdpa, q, kq, vq, scale=0.088, mask=None, bits=bits
                )
            )
        h = N // 2
        k8, v8 = mx.quantize(k[:, :, :h], bits=8), mx.quantize(v[:, :, :h], bits=8)
        k4, v4 = mx.quantize(k[:, :, h:], bits=4), mx.quantize(v[:, :, h:], bits=4)
        t["fused_mixed_8_4"] = timeit(
            functools.partial(qa, (k8, k4), (v8, v4), bits=(8, 4), use_kernel=True)
        )
        t["dense_scores"] = timeit(
            functools.partial(dense_scores, q, k, v, scale=0.088)
        )
        t["dense_reference"] = timeit(
            functools.partial(dense_reference, q, k, v, scale=0.088)
        )
        t["mx_fast_sdpa_fp16"] = timeit(
            functools.partial(
                mx.fast.scaled_dot_product_attention, q, k, v, scale=0.088
            )
        )
        print(f"attn N={N} " + " ".join(f"{a}_us={b:.1f}" for a, b in t.items()))
        rows.append({"N": N, **t})
    return rows


def decode_tps(model, make_cache, prompt, steps):
    from mlx_h2o import patch

    cache = make_cache()
    with patch():
        for s in range(0, prompt.shape[1], 512):
            mx.eval(model(prompt[:, s : s + 512], cache=cache))
        tok = prompt[:, -1:]
        for _ in range(3):  # warm-up (kernel builds)
            tok = mx.argmax(model(tok, cache=cache)[:, -1:], axis=-1)
            mx.eval(tok)
        tic = time.perf_counter()
        for _ in range(steps):  # pipelined, as mlx-lm's generate_step
            tok = mx.argmax(model(tok, cache=cache)[:, -1:], axis=-1)
            mx.async_eval(tok)
        mx.eval(tok)
    return steps / (time.perf_counter() - tic)


def model_bench(context, max_kv, steps, reps):
    from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

    import mlx_h2o.cache.quantized_storage as storage
    from mlx_h2o import H2OConfig, make_h2o_cache
    from mlx_h2o.cache import QuantConfig, quantized_cache_type

    model = random_model("qwen3-8b", bits=4, dtype=mx.bfloat16)
    cfg = H2OConfig(max_size=max_kv, sink_size=4, heavy_budget=max_kv // 2)
    fused = storage.quantized_attention

    def h2o(quant):
        return lambda: make_h2o_cache(
            model, cfg, cache_type=quantized_cache_type(quant)
        )

    caches = {
        "mlx_lm_kv": lambda: make_prompt_cache(model),
        "mlx_lm_q8": lambda: [QuantizedKVCache(64, 8) for _ in model.layers],
        "h2o_dense": h2o(None),
        "h2o_q8_fused": h2o(QuantConfig(8, 64)),
        "h2o_q8_dequant": h2o(QuantConfig(8, 64)),
        "h2o_q4_fused": h2o(QuantConfig(4, 64)),
        "h2o_mixed_8_4": h2o(QuantConfig(8, 64, 4)),
    }
    prompt = mx.random.randint(0, 151936, (1, context))
    results = {name: [] for name in caches}
    for rep in range(reps):
        for name, new_cache in caches.items():
            storage.quantized_attention = (
                functools.partial(fused, use_kernel=False)
                if "dequant" in name
                else fused
            )
            try:
                results[name].append(decode_tps(model, new_cache, prompt, steps))
            except (RuntimeError, ValueError) as e:  # e.g. a shape MLX's CUDA lacks
                print(f"decode cache={name} failed: {str(e).splitlines()[0]}")
                results[name].append(float("nan"))
                continue
            print(
                f"decode rep={rep} cache={name} context={context} max_kv={max_kv} "
                f"tok_s={results[name][-1]:.1f}"
            )
    storage.quantized_attention = fused
    summary = {k: float(np.median(v)) for k, v in results.items()}
    base = summary["h2o_dense"]
    print(
        "decode_summary "
        + " ".join(f"{k}={v:.1f}({v / base:.3f}x)" for k, v in summary.items())
    )
    return summary


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-model", action="store_true")
    p.add_argument("--model-only", action="store_true", help="only the decode benchmark")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--max-kv", type=int, default=1024)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args()
    print(
        f"mlx={mx.__version__} device={mx.default_device()} "
        f"cuda={hasattr(mx, 'cuda') and mx.cuda.is_available()} metal={mx.metal.is_available()}"
    )
    out = {}
    if not args.model_only:
        out = {"kernel_failures": check_kernel(args.quick), "caches_ok": check_caches()}
        out["attention_us"] = microbench(args.quick)
    if not args.no_model:
        out["decode_tok_s"] = model_bench(
            args.context, args.max_kv, args.steps, args.reps
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
