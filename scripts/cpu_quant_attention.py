"""CPU attention with scores over 8-bit K/V: mx.quantized_matmul vs dequantize +
BLAS GEMM, by query rows (why quantized_attention takes the matmul path for
decode only, kernels/quantized.py).

    python scripts/cpu_quant_attention.py [--reps 20]

Prints ms per call for each (heads, head_dim, N, L) and the ratio; final JSON line.
"""

import argparse
import json
import os
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mlx_h2o.kernels.quantized_reference import (  # noqa: E402
    quantized_matmul_attention_with_scores,
    quantized_scaled_dot_product_attention_with_scores,
)


def ms(fn, reps):
    mx.eval(fn())
    tic = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    return (time.perf_counter() - tic) / reps * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    rows = []
    for hq, hk, d in ((9, 3, 64), (32, 8, 128)):
        for n in (256, 2048):
            for length in (1, 4, 16, 64, 256):
                q = mx.random.normal((1, hq, length, d))
                k, v = (mx.quantize(mx.random.normal((1, hk, n, d)), group_size=64, bits=8)
                        for _ in range(2))
                mx.eval(q, k, v)
                kw = dict(scale=d ** -0.5, bits=8, group_size=64)
                a = ms(lambda: quantized_matmul_attention_with_scores(q, k, v, **kw), args.reps)
                b = ms(lambda: quantized_scaled_dot_product_attention_with_scores(q, k, v, **kw),
                       args.reps)
                rows.append(dict(heads=f"{hq}/{hk}", D=d, N=n, L=length, matmul_ms=a,
                                 dequant_ms=b))
                print(f"heads {hq}/{hk} D={d} N={n} L={length} (rows {hq // hk * length}): "
                      f"quantized_matmul {a:.2f} ms, dequantize+GEMM {b:.2f} ms, "
                      f"ratio {a / b:.2f}", flush=True)
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
