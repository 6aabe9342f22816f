"""Decode attention with scores vs mx.fast.scaled_dot_product_attention (no scores).

    python scripts/bench_kernels.py [--dims 64 128 256] [--ns 256 1024 ...] [--tune]

B=1, 32 query / 8 KV heads, Lq=1. Each timing is a chain of --chain calls
(each call's output is the next call's query), evaluated once; the median of
--repeats chains, ours and MLX's interleaved. K/V sets rotate so the working
set exceeds L2, as with one cache per layer. Prints the ratio to MLX and the
achieved K+V bandwidth against a measured device copy, and splits each call
into host (building the graph) and eval (the rest: MLX's dispatch and the
GPU); a final JSON line.
--tune times every split count; --step times a whole H2O decode-layer step;
--plain turns off the compiled replay of repeated calls.
"""

import argparse
import collections
import dataclasses
import json
import math
import os
import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mlx_h2o.kernels import decode, gpu_backend, make_plan  # noqa: E402
from mlx_h2o.kernels.decode import decode_attention  # noqa: E402

B, HQ, HK = 1, 32, 8
L2_SPILL_BYTES = 200e6  # rotate K/V sets until the chain touches this much


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
            t = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            times[e.name[:width]] += t
            launches[e.name[:width]] += 1
    return times, launches


def kernel_trace(fn, chain):
    """GPU us per call of each kernel ``fn(chain)`` runs, by kernel name, from a
    CUPTI trace (torch.profiler; it inflates durations a little)."""
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

    sec = timed(chain, 10, repeats)
    return 2 * x.nbytes / sec  # bytes read + written


def kv_sets(N, D, dtype):
    kv_bytes = 2 * B * HK * N * D * dtype.size
    n_sets = max(1, min(8, math.ceil(L2_SPILL_BYTES / kv_bytes)))
    sets = [(mx.random.normal((B, HK, N, D)).astype(dtype),
             mx.random.normal((B, HK, N, D)).astype(dtype)) for _ in range(n_sets)]
    mx.eval(sets)
    return sets, kv_bytes


def knobs(text):
    """'MAX_ROWS=2,TARGET_BLOCKS=1024' -> {name: int}, names of
    decode.LaunchSettings in capitals (as the logs and plots name variants)."""
    out = {}
    names = {f.name.upper() for f in dataclasses.fields(decode.LaunchSettings)}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in names or not value.lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(f"{item!r}: want NAME=INT, NAME one of "
                                             f"{sorted(names)}")
        out[name] = int(value)
    return out


def attention_chains(N, D, dtype, splits=None, variants=({},)):
    """(ours under each of ``variants`` (decode knob values), MLX's SDPA, K+V bytes)."""
    sets, kv_bytes = kv_sets(N, D, dtype)
    q0 = mx.random.normal((B, HQ, 1, D)).astype(dtype)
    scale = D ** -0.5

    def tuned(variant):
        def ours(n):
            with decode.launch_settings(**{k.lower(): v for k, v in variant.items()}):
                q = q0
                for i in range(n):
                    k, v = sets[i % len(sets)]
                    q = decode_attention(q, k, v, scale=scale, num_splits=splits)[0]
                return q
        return ours

    def mlx(n):
        q = q0
        for i in range(n):
            k, v = sets[i % len(sets)]
            q = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
        return q

    return [tuned(v) for v in variants], mlx, kv_bytes


def step_chains(N, D, dtype):
    """One decode layer: mlx-lm KVCache (2 slice updates + SDPA) vs fused H2O."""
    sets, _ = kv_sets(N, D, dtype)
    q0 = mx.random.normal((B, HQ, 1, D)).astype(dtype)
    knew = mx.random.normal((B, HK, 1, D)).astype(dtype)
    pos = mx.broadcast_to(mx.arange(N, dtype=mx.int32), (B, HK, N)) + 0
    zeros = mx.zeros((B, HK, N), mx.float32)
    victim0 = mx.zeros((B, HK, 1, D), mx.int32)
    scale = D ** -0.5
    # As the cache does it: the plan is built once, each step only launches.
    plan = make_plan(q0, sets[0][0], pos, None, None, mode="ema", alpha=0.95, scale=scale,
                     sink_size=4, recent_budget=N // 2, pinned=(), window_size=None)

    def kvcache(n):
        q, keys = q0, [list(s) for s in sets]
        for i in range(n):
            kv = keys[i % len(keys)]
            kv[0][..., N - 1:N, :] = knew
            kv[1][..., N - 1:N, :] = knew
            q = mx.fast.scaled_dot_product_attention(q, kv[0], kv[1], scale=scale)
        return q

    def h2o(n):
        q, state = q0, [[k, v, pos, zeros, zeros + 0, victim0] for k, v in sets]
        for i in range(n):
            st = state[i % len(state)]
            st[0] = mx.put_along_axis(st[0], st[5], knew, axis=2)
            st[1] = mx.put_along_axis(st[1], st[5], knew, axis=2)
            res = plan(q, st[0], st[1], st[2], st[3], st[4], st[5], None, N + i)
            st[2:6] = res[1:5]
            q = res.out
        return q

    return h2o, kvcache


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--ns", type=int, nargs="+", default=[256, 1024, 4096, 16384, 32768])
    p.add_argument("--dtype", default="float16")
    p.add_argument("--chain", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tune", action="store_true", help="time each split count")
    p.add_argument("--tune-splits", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256],
                   help="the split counts --tune times")
    p.add_argument("--step", action="store_true", help="also time a whole layer step")
    p.add_argument("--keys-per-group", type=int, default=0, help="U (0: automatic)")
    p.add_argument("--lanes-per-key", type=int, default=0, choices=[0, 8, 16, 32],
                   help="TPK (0: automatic)")
    p.add_argument("--variants", type=knobs, nargs="+", default=[{}],
                   help="decode.LaunchSettings to time side by side, a row each, named "
                        "in capitals, e.g. '' 'MAX_ROWS=2' 'MAX_ROWS=1,TARGET_BLOCKS=1024' "
                        "('': defaults)")
    p.add_argument("--trace", action="store_true",
                   help="also list each kernel's GPU us a call (CUPTI, needs torch)")
    p.add_argument("--plain", action="store_true",
                   help="never replay a compiled launch (every call rebuilds it)")
    return p.parse_args()


def variant_name(variant) -> str:
    return ",".join(f"{k}={v}" for k, v in variant.items()) or "default"


def attention_rows(args, D, N, dtype, bw):
    """Time ours (each variant) and MLX's SDPA at (D, N), interleaved; print a
    row per variant (and --trace / --tune lines); return the rows."""
    ours, mlx, kv_bytes = attention_chains(N, D, dtype, variants=args.variants)
    t_ours, t_mlx = [[] for _ in ours], []
    for _ in range(3):  # interleave: noise hits every variant
        for fn, ts in zip(ours, t_ours):
            ts.append(timed(fn, args.chain, args.repeats))
        t_mlx.append(timed(mlx, args.chain, args.repeats))
    t_m, floor = statistics.median(t_mlx), kv_bytes / bw
    rows = []
    for variant, fn, ts in zip(args.variants, ours, t_ours):
        t_o = statistics.median(ts)
        row = dict(D=D, N=N, ours_us=t_o * 1e6, mlx_us=t_m * 1e6, ratio=t_o / t_m,
                   gbps=kv_bytes / t_o / 1e9, floor_us=floor * 1e6, x_floor=t_o / floor,
                   host_ours_us=HOST[fn] * 1e6, host_mlx_us=HOST[mlx] * 1e6, variant=variant)
        rows.append(row)
        print(f"{D:4d} {N:6d} {row['ours_us']:8.1f} {row['mlx_us']:8.1f} "
              f"{row['ratio']:6.2f} {row['gbps']:6.0f} {row['floor_us']:8.1f} "
              f"{row['x_floor']:7.2f} {row['host_ours_us']:5.1f}/"
              f"{row['host_mlx_us']:<5.1f} {row['ours_us'] - row['host_ours_us']:5.1f}/"
              f"{row['mlx_us'] - row['host_mlx_us']:<5.1f}"
              + (f"  {variant_name(variant)}" if len(args.variants) > 1 else ""), flush=True)
    if args.trace:
        named = [(variant_name(v), f) for v, f in zip(args.variants, ours)] + [("mlx", mlx)]
        for name, fn in named:
            per = kernel_trace(fn, args.chain)
            kernels = ", ".join(f"{k} {t:.1f}" for k, t in per.most_common(4))
            print(f"       trace {name}: {sum(per.values()):.1f} us a call: {kernels}", flush=True)
    if args.tune:
        for S in args.tune_splits:
            (o,), _, _ = attention_chains(N, D, dtype, splits=S)
            print(f"       tune S={S:3d}: {timed(o, args.chain, args.repeats) * 1e6:8.1f} us",
                  flush=True)
    return rows


def step_rows(args, dtype):
    """Time a whole H2O decode-layer step against mlx-lm's KVCache step."""
    print(f"{'D':>4s} {'N':>6s} {'h2o step us':>11s} {'kvcache us':>10s} {'ratio':>6s}")
    steps = []
    for N in (256, 1024, 4096):
        h2o, kvc = step_chains(N, 128, dtype)
        t_h = statistics.median([timed(h2o, args.chain, args.repeats) for _ in range(3)])
        t_k = statistics.median([timed(kvc, args.chain, args.repeats) for _ in range(3)])
        steps.append(dict(D=128, N=N, h2o_us=t_h * 1e6, kvcache_us=t_k * 1e6,
                          ratio=t_h / t_k, host_h2o_us=HOST[h2o] * 1e6,
                          host_kvcache_us=HOST[kvc] * 1e6))
        print(f"{128:4d} {N:6d} {t_h * 1e6:11.1f} {t_k * 1e6:10.1f} {t_h / t_k:6.2f}", flush=True)
    return steps


def main():
    args = parse_args()
    with decode.launch_settings(keys_per_lane_group=args.keys_per_group,
                                lanes_per_key=args.lanes_per_key):
        return run(args)


def run(args):
    if args.plain:
        decode._REPEATED = decode.Repeated(size=0)
    if gpu_backend() is None:
        print("no GPU backend: nothing to benchmark")
        return 2
    dtype = getattr(mx, args.dtype)
    bw = copy_bandwidth(args.repeats)
    print(f"backend={gpu_backend()} mlx={mx.__version__} dtype={args.dtype} B={B} "
          f"heads={HQ}/{HK} chain={args.chain} repeats={args.repeats} U={args.keys_per_group} "
          f"TPK={args.lanes_per_key} plain={args.plain}")
    print(f"copy bandwidth (read+write): {bw / 1e9:.0f} GB/s")
    print(f"{'D':>4s} {'N':>6s} {'ours us':>8s} {'mlx us':>8s} {'ratio':>6s} "
          f"{'GB/s':>6s} {'floor us':>8s} {'x floor':>7s} {'host us o/m':>11s} "
          f"{'eval us o/m':>11s}" + ("  variant" if len(args.variants) > 1 else ""))
    rows = [row for D in args.dims for N in args.ns
            for row in attention_rows(args, D, N, dtype, bw)]
    steps = step_rows(args, dtype) if args.step else []
    print(json.dumps(dict(backend=gpu_backend(), mlx=mx.__version__, dtype=args.dtype,
                          copy_gbps=bw / 1e9, attention=rows, layer_step=steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
