"""Decode attention with scores vs mx.fast.scaled_dot_product_attention (no scores).

    python benchmarks/bench_kernels.py [--dims 64 128 256] [--ns 256 1024 ...]
        [--dtype float16] [--step] [--tune] [--trace]

B=1, 32 query / 8 KV heads, Lq=1, on the GPU backend (exit 2 without one).
Ours is ``mlx_h2o.kernels.scaled_dot_product_attention_with_scores`` with
``use_kernel=True`` (out, logits and lse). Each timing is a chain of --chain
calls (each call's output is the next call's query), evaluated once; the
median of --repeats chains, ours and MLX's interleaved. K/V sets rotate so the
working set exceeds L2, as with one cache per layer. Prints the ratio to MLX,
the achieved K+V bandwidth against a measured device copy, and splits each
call into host (building the graph) and eval (the rest: MLX's dispatch and
the GPU).
--step: a whole decode layer as the caches run it, H2OKVCache evicting every
step (update_and_fetch + routed attention) against mlx-lm's RotatingKVCache of
the same size. --tune: each split count of the two-pass kernel. --trace: each
kernel's GPU us a call (CUPTI through torch.profiler).
Ends with a JSON line (benchmarks/plot_bench_kernels.py plots two runs).
"""

import argparse
import collections
import json
import math
import os
import statistics
import sys
import time

import mlx.core as mx
import mlx_lm.models.base as mlx_lm_base
from mlx_lm.models.cache import RotatingKVCache

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import mlx_h2o  # noqa: E402
from mlx_h2o import H2OConfig, H2OKVCache  # noqa: E402
from mlx_h2o.kernels import gpu_backend, scaled_dot_product_attention_with_scores  # noqa: E402
from mlx_h2o.kernels.decode import decode_attention  # noqa: E402

B, HQ, HK = 1, 32, 8
L2_SPILL_BYTES = 200e6  # rotate K/V sets until the chain touches this much
TUNE_SPLITS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the two-pass kernel's split counts
HOST = {}  # fn -> median seconds per call spent building the graph (host)


def timed(fn, chain, repeats):
    """Median seconds per call of `fn` over chains of `chain` dependent calls."""
    samples, host = [], []
    for _ in range(repeats + 1):  # the first chain warms up (compiles, allocates)
        mx.synchronize()
        t0 = time.perf_counter()
        out = fn(chain)
        t1 = time.perf_counter()
        mx.eval(out)
        mx.synchronize()
        samples.append((time.perf_counter() - t0) / chain)
        host.append((t1 - t0) / chain)
    HOST[fn] = statistics.median(host[1:])
    return statistics.median(samples[1:])


def cuda_kernel_times(prof, width=50):
    """(total us, launches) per CUDA kernel, by its name's first ``width``
    characters, of a torch.profiler trace (CUPTI records MLX's kernels too)."""
    import torch

    times, launches = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = (
                e.device_time_total
                if hasattr(e, "device_time_total")
                else e.cuda_time_total
            )
            times[e.name[:width]] += t
            launches[e.name[:width]] += 1
    return times, launches


def kernel_trace(fn, chain):
    """GPU us per call of each kernel ``fn(chain)`` runs, by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    mx.eval(fn(chain))  # compiled and allocated outside the trace
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        mx.eval(fn(chain))
        mx.synchronize()
    times, _ = cuda_kernel_times(prof)
    return collections.Counter({name: t / chain for name, t in times.items()})


def copy_bandwidth(repeats):
    x = mx.random.normal((256 * 1024 * 1024,)).astype(mx.float16)  # 512 MB
    mx.eval(x)

    def chain(n):
        y = x
        for _ in range(n):
            y = y + 1
        return y

    return 2 * x.nbytes / timed(chain, 10, repeats)  # bytes read + written


def n_sets(N, D, dtype):
    """How many K/V sets (one per layer) make a chain spill L2."""
    return max(1, min(8, math.ceil(L2_SPILL_BYTES / (2 * B * HK * N * D * dtype.size))))


def kv_sets(N, D, dtype):
    sets = [
        (
            mx.random.normal((B, HK, N, D)).astype(dtype),
            mx.random.normal((B, HK, N, D)).astype(dtype),
        )
        for _ in range(n_sets(N, D, dtype))
    ]
    mx.eval(sets)
    return sets, 2 * B * HK * N * D * dtype.size


def attention_chains(N, D, dtype, splits=None):
    """(ours, MLX's SDPA, K+V bytes); ``splits``: the two-pass kernel's split count."""
    sets, kv_bytes = kv_sets(N, D, dtype)
    q0 = mx.random.normal((B, HQ, 1, D)).astype(dtype)
    scale = D**-0.5

    def ours(n):
        q = q0
        for i in range(n):
            k, v = sets[i % len(sets)]
            if splits is None:
                q = scaled_dot_product_attention_with_scores(
                    q, k, v, scale=scale, use_kernel=True
                )[0]
            else:
                q = decode_attention(q, k, v, scale=scale, num_splits=splits)[0]
        return q

    def mlx(n):
        q = q0
        for i in range(n):
            k, v = sets[i % len(sets)]
            q = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
        return q

    return ours, mlx, kv_bytes


def filled(cache, N, D, dtype):
    """``cache`` after an N-token prompt attended through mlx-lm's routed SDPA."""
    k = mx.random.normal((B, HK, N, D)).astype(dtype)
    q = mx.random.normal((B, HQ, N, D)).astype(dtype)
    mask = cache.make_mask(N) if hasattr(cache, "h2o_attention") else "causal"
    keys, values = cache.update_and_fetch(k, k)
    mx.eval(
        mlx_lm_base.scaled_dot_product_attention(
            q, keys, values, cache=cache, scale=D**-0.5, mask=mask
        ),
        cache.state,
    )
    return cache


def step_chains(N, D, dtype):
    """One decode layer holding N keys: H2O evicting every step vs Rotating."""
    count = n_sets(N, D, dtype)
    q0 = mx.random.normal((B, HQ, 1, D)).astype(dtype)
    knew = mx.random.normal((B, HK, 1, D)).astype(dtype)
    cfg = H2OConfig(max_size=N, heavy_budget=N // 2)
    caches = {
        "h2o": [filled(H2OKVCache(cfg), N, D, dtype) for _ in range(count)],
        "rotating": [
            filled(RotatingKVCache(max_size=N, keep=4), N, D, dtype)
            for _ in range(count)
        ],
    }

    def chain_of(layers):
        def run(n):
            q = q0
            for i in range(n):
                cache = layers[i % len(layers)]
                keys, values = cache.update_and_fetch(knew, knew)
                q = mlx_lm_base.scaled_dot_product_attention(
                    q, keys, values, cache=cache, scale=D**-0.5, mask=None
                )
            return [q] + [c.state for c in layers]

        return run

    return chain_of(caches["h2o"]), chain_of(caches["rotating"])


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--ns", type=int, nargs="+", default=[256, 1024, 4096, 16384, 32768])
    p.add_argument(
        "--dtype", default="float16", choices=["float16", "bfloat16", "float32"]
    )
    p.add_argument("--chain", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--step", action="store_true", help="also time a whole decode layer")
    p.add_argument("--tune", action="store_true", help="time each split count")
    p.add_argument(
        "--trace",
        action="store_true",
        help="also list each kernel's GPU us a call (CUPTI, needs torch)",
    )
    return p.parse_args()


def attention_row(args, D, N, dtype, bw):
    """Time ours and MLX's SDPA at (D, N), interleaved; print and return the row."""
    ours, mlx, kv_bytes = attention_chains(N, D, dtype)
    t_ours, t_mlx = [], []
    for _ in range(3):  # interleave: noise hits both
        t_ours.append(timed(ours, args.chain, args.repeats))
        t_mlx.append(timed(mlx, args.chain, args.repeats))
    t_o, t_m, floor = statistics.median(t_ours), statistics.median(t_mlx), kv_bytes / bw
    row = dict(
        D=D,
        N=N,
        ours_us=t_o * 1e6,
        mlx_us=t_m * 1e6,
        ratio=t_o / t_m,
        gbps=kv_bytes / t_o / 1e9,
        floor_us=floor * 1e6,
        x_floor=t_o / floor,
        host_ours_us=HOST[ours] * 1e6,
        host_mlx_us=HOST[mlx] * 1e6,
    )
    print(
        f"{D:4d} {N:6d} {row['ours_us']:8.1f} {row['mlx_us']:8.1f} {row['ratio']:6.2f} "
        f"{row['gbps']:6.0f} {row['floor_us']:8.1f} {row['x_floor']:7.2f} "
        f"{row['host_ours_us']:5.1f}/{row['host_mlx_us']:<5.1f} "
        f"{row['ours_us'] - row['host_ours_us']:5.1f}/"
        f"{row['mlx_us'] - row['host_mlx_us']:<5.1f}",
        flush=True,
    )
    for name, fn in (("ours", ours), ("mlx", mlx)) if args.trace else ():
        per = kernel_trace(fn, args.chain)
        kernels = ", ".join(f"{k} {t:.1f}" for k, t in per.most_common(4))
        print(
            f"       trace {name}: {sum(per.values()):.1f} us a call: {kernels}",
            flush=True,
        )
    for S in TUNE_SPLITS if args.tune else ():
        tuned, _, _ = attention_chains(N, D, dtype, splits=S)
        us = timed(tuned, args.chain, args.repeats) * 1e6
        print(f"       tune S={S:3d}: {us:8.1f} us", flush=True)
    return row


def step_rows(args, dtype):
    """A whole H2O decode-layer step against mlx-lm's RotatingKVCache step, D=128."""
    print(
        f"{'D':>4s} {'N':>6s} {'h2o step us':>11s} {'rotating us':>11s} {'ratio':>6s}"
    )
    rows = []
    with mlx_h2o.patch():
        for N in (256, 1024, 4096):
            h2o, rot = step_chains(N, 128, dtype)
            t_h, t_r = [], []
            for _ in range(3):  # interleave
                t_h.append(timed(h2o, args.chain, args.repeats))
                t_r.append(timed(rot, args.chain, args.repeats))
            t_h, t_r = statistics.median(t_h), statistics.median(t_r)
            rows.append(
                dict(
                    D=128,
                    N=N,
                    h2o_us=t_h * 1e6,
                    rotating_us=t_r * 1e6,
                    ratio=t_h / t_r,
                    host_h2o_us=HOST[h2o] * 1e6,
                    host_rotating_us=HOST[rot] * 1e6,
                )
            )
            print(
                f"{128:4d} {N:6d} {t_h * 1e6:11.1f} {t_r * 1e6:11.1f} {t_h / t_r:6.2f}",
                flush=True,
            )
    return rows


def main():
    args = parse_args()
    if gpu_backend() is None:
        print("no GPU backend: nothing to benchmark")
        return 2
    dtype = getattr(mx, args.dtype)
    bw = copy_bandwidth(args.repeats)
    print(
        f"backend={gpu_backend()} mlx={mx.__version__} dtype={args.dtype} B={B} "
        f"heads={HQ}/{HK} chain={args.chain} repeats={args.repeats}"
    )
    print(f"copy bandwidth (read+write): {bw / 1e9:.0f} GB/s")
    print(
        f"{'D':>4s} {'N':>6s} {'ours us':>8s} {'mlx us':>8s} {'ratio':>6s} "
        f"{'GB/s':>6s} {'floor us':>8s} {'x floor':>7s} {'host us o/m':>11s} "
        f"{'eval us o/m':>11s}"
    )
    rows = [attention_row(args, D, N, dtype, bw) for D in args.dims for N in args.ns]
    steps = step_rows(args, dtype) if args.step else []
    print(
        json.dumps(
            dict(
                backend=gpu_backend(),
                mlx=mx.__version__,
                dtype=args.dtype,
                copy_gbps=bw / 1e9,
                attention=rows,
                layer_step=steps,
            )
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
