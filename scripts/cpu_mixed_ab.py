"""Mixed-precision H2O decode on the CPU, three ways interleaved in one process:
the op path with the dequantizing reference two segments took before session 14
(``mixed_dequant``), the op path with each segment read by its own
mx.quantized_matmul (``mixed_segments``), and a full cache's attention + fold
as one compiled call (``mixed_compiled``, the default).

    python scripts/cpu_mixed_ab.py [--repeats 3] [--steps 48]

SmolLM2-135M (packaged), context 512, budget 256 (8-bit heavy hitters, 4-bit
recent window); medians and ratios vs KVCache; final JSON line.
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import cpu_decode_bench as bench  # noqa: E402

import mlx_h2o.kernels.quantized as quantized  # noqa: E402
from mlx_h2o.kernels.quantized_reference import as_segments  # noqa: E402
from mlx_h2o.kernels.quantized_reference import (  # noqa: E402
    quantized_scaled_dot_product_attention_with_scores as dequantizing,
)
from mlx_h2o.models import load_model  # noqa: E402

AFTER = quantized.quantized_matmul_attention_with_scores


def before(queries, keys, values, *, bits, **kw):
    """The CPU path before: one segment by matmul, two by the reference."""
    if len(as_segments(keys, bits)[0]) == 1:
        return AFTER(queries, keys, values, bits=bits, **kw)
    return dequantizing(queries, keys, values, bits=bits, **kw)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=48)
    args = p.parse_args()
    model = load_model("smollm2-135m")[0]
    made = bench.strategies(model, 512, 256)
    mixed, op_path = made["h2o_mixed_evict"], lambda: bench.uncompiled(mixed())
    ways = (("mixed_dequant", before, op_path), ("mixed_segments", AFTER, op_path),
            ("mixed_compiled", AFTER, mixed))
    runs = {"kvcache": [], **{name: [] for name, _, _ in ways}}
    for r in range(args.repeats):
        runs["kvcache"].append(bench.decode_tps(model, made["kvcache"], 512, args.steps))
        for name, fn, make in ways:
            quantized.quantized_matmul_attention_with_scores = fn
            runs[name].append(bench.decode_tps(model, make, 512, args.steps))
        quantized.quantized_matmul_attention_with_scores = AFTER
        print(r, {k: round(v[-1], 2) for k, v in runs.items()}, flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratio = {k: v / med["kvcache"] for k, v in med.items()}
    print("medians", {k: round(v, 2) for k, v in med.items()},
          "ratios vs kvcache", {k: round(v, 3) for k, v in ratio.items()})
    print(json.dumps({"median_tok_s": med, "ratio": ratio}))


if __name__ == "__main__":
    main()
