"""Time one fold of queued decode queries: the queue-fold kernel vs the ops fold.

    python benchmarks/bench_queue_fold.py [--ns 4096 16384 32768] [--queued 32 128]
        [--heads 32 8] [--dim 128] [--reps 20]

H2O below its budget queues decode queries and folds their scores later, in
one go. Per (N keys, queued queries): ms per fold of ``queue_fold``
(kernels/queued.py, three launches; needs MLX with CUDA or Metal, exit 2
otherwise) and of the ops fold the cache uses where the kernel does not run
(``deferred.fold_queue`` plus the score update), each the median over
``--reps`` timed evaluations, and the kernel's FP32 throughput (2 passes x
rows x N x D multiply-adds). B=1, bfloat16 queries and K. Ends with a JSON line.
"""

import argparse
import json
import os
import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mlx_h2o.cache.score_queue import QueuedQuery, fold_queue  # noqa: E402
from mlx_h2o.kernels.queued import queue_fold, queue_fold_supported  # noqa: E402


def timed(fn, reps):
    mx.eval(fn())  # compile / warm
    out = []
    for _ in range(reps):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(fn())
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def case(N, T, Hq, Hk, D, reps):
    dt = mx.bfloat16
    q = mx.random.normal((1, Hq, T, D)).astype(dt)
    k = mx.random.normal((1, Hk, N + 256, D)).astype(dt)
    score, count = mx.zeros((1, Hk, N + 256)), mx.zeros((1, Hk, N + 256))
    visible = [N - T + 1 + t for t in range(T)]
    items = [QueuedQuery(q[:, :, t:t + 1], v, 0, D ** -0.5) for t, v in enumerate(visible)]
    mx.eval(q, k, score, count, *[it.queries for it in items])

    def kernel():
        return queue_fold(q, k, visible, D ** -0.5, score, count)

    def ops():
        step, seen = fold_queue(items, k[..., :N, :])
        return score[..., :N] + step, count[..., :N] + seen

    ms, ms_o = timed(kernel, reps), timed(ops, reps)
    fma = 2 * Hq * T * N * D  # both passes
    return {"N": N, "queued": T, "kernel_ms": ms, "ops_ms": ms_o, "ratio": ms / ms_o,
            "tflops": 2 * fma / ms / 1e9}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ns", type=int, nargs="*", default=[4096, 16384, 32768])
    p.add_argument("--queued", type=int, nargs="*", default=[32, 128])
    p.add_argument("--heads", type=int, nargs=2, default=[32, 8])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    (Hq, Hk), D = args.heads, args.dim
    probe = (mx.zeros((1, Hq, max(args.queued), D), mx.bfloat16),
             mx.zeros((1, Hk, 1, D), mx.bfloat16))
    if not queue_fold_supported(*probe):
        print("queue_fold does not run here (needs MLX with CUDA or Metal)")
        return 2
    print(f"mlx {mx.__version__} device {mx.default_device()} heads {Hq}/{Hk} D={D} "
          f"bfloat16 reps={args.reps}")
    rows = []
    for N in args.ns:
        for T in args.queued:
            r = case(N, T, Hq, Hk, D, args.reps)
            rows.append(r)
            print(f"N={N} queued={T} kernel_ms={r['kernel_ms']:.3f} ops_ms={r['ops_ms']:.3f} "
                  f"ratio={r['ratio']:.3f} tflops={r['tflops']:.1f}", flush=True)
    print(json.dumps({"heads": [Hq, Hk], "D": D, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
