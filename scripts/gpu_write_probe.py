"""Does a per-head slot write (put_along_axis) cost the GPU more than mlx-lm's slice update?

One layer's decode write + SDPA, chained, for: slice update (KVCache /
Rotating), put_along_axis into a victim slot (H2O), and put_along_axis while
another kernel also reads the old buffer (the group fold's pattern). Reports
host build and pipelined us per step; a large gap means the scatter copies
the buffer instead of writing in place. Diagnostic, not a benchmark of record.
"""

import statistics
import time

import mlx.core as mx

B, HQ, HK, D, N = 1, 32, 8, 128, 256


def run(kind, steps=400, reps=5):
    dt = mx.bfloat16
    k = mx.random.normal((B, HK, N, D)).astype(dt)
    v = mx.random.normal((B, HK, N, D)).astype(dt)
    q = mx.random.normal((B, HQ, 1, D)).astype(dt)
    kn = mx.random.normal((B, HK, 1, D)).astype(dt)
    idx = mx.broadcast_to(mx.array(17, mx.int32), (B, HK, 1, D))
    mx.eval(k, v, q, kn, idx)
    out, times = [], []
    for _ in range(reps):
        mx.synchronize()
        tic = time.perf_counter()
        for i in range(steps):
            if kind == "slice":
                k[..., i % N: i % N + 1, :] = kn
                v[..., i % N: i % N + 1, :] = kn
            else:
                if kind == "scatter+reader":
                    out.append(mx.sum(k, axis=2))  # another node reads the old buffer
                k = mx.put_along_axis(k, idx, kn, axis=2)
                v = mx.put_along_axis(v, idx, kn, axis=2)
            o = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1)
            mx.async_eval(o)
            out = out[-4:]
        mx.eval(o)
        times.append((time.perf_counter() - tic) / steps * 1e6)
    return statistics.median(times)


if __name__ == "__main__":
    print(f"mlx {mx.__version__} {mx.default_device()} B={B} heads {HQ}/{HK} D={D} N={N}")
    for r in range(2):
        print(" ".join(f"{k}={run(k):.1f}us" for k in ("slice", "scatter", "scatter+reader")))
