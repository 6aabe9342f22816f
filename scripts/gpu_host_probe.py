"""Where a decode-attention call's host time goes (graph building only, no eval).

    python scripts/gpu_host_probe.py [--dims 64 128] [--ns 4096 32768] [--calls 2000]

Builds, without evaluating, one call of each form below many times on
evaluated inputs (B=1, 32 / 8 heads, Lq=1, fp16) and prints the median us a
call over --rounds rounds (each round's graph is evaluated and dropped
between rounds, outside the timing):
- sdpa: ``mx.fast.scaled_dot_product_attention`` (MLX's C++ primitive);
- ours: ``decode_attention`` as callers use it;
- ours, compiled launch: the launch under ``mx.compile``, called directly
  (how session 19's ``decode_attention`` replayed, less its Python);
- ours, tape: the launch's native Tape (``mlx_h2o.native``, session 20)
  called directly;
- ours, out only: the same launch traced to return ``out`` alone (what the
  two Python objects of logits and lse cost);
- plain ops, compiled: ``mx.compile`` of plain ops with our call's inputs,
  nodes and outputs (4 in; a 3-output and a 2-output node; 3 returned), to
  tell MLX's compile replay from the custom-kernel primitive;
- plain ops, compiled, 1 out: 4 in, one node, one output.
Diagnostic, not a benchmark of record (docs/GPU.md, session 20).
"""

import argparse
import os
import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mlx_h2o import native  # noqa: E402
from mlx_h2o.kernels import decode  # noqa: E402

B, HQ, HK = 1, 32, 8


def build_us(fn, calls, rounds):
    """Median us a call of building ``fn()`` (no eval) over ``rounds``."""
    keep = [fn() for _ in range(10)]
    mx.eval(keep)
    samples = []
    for _ in range(rounds):
        out = []
        t0 = time.perf_counter()
        for _ in range(calls):
            out.append(fn())
        samples.append((time.perf_counter() - t0) / calls * 1e6)
        mx.eval(out)
        del out
    return statistics.median(samples)


def forms(D, N):
    q = mx.random.normal((B, HQ, 1, D)).astype(mx.float16)
    k = mx.random.normal((B, HK, N, D)).astype(mx.float16)
    v = mx.random.normal((B, HK, N, D)).astype(mx.float16)
    mx.eval(q, k, v)
    scale = D ** -0.5
    prm = decode.params_f(scale)
    plan = decode._plan(q, k, None, None, None)
    launch = mx.compile(plan)
    tape = native.replayer(plan, [q, k, v, prm], plan(q, k, v, prm))
    out_only = mx.compile(lambda *a: plan(*a)[0])

    def plain(q_, k_, v_, p_):
        a = q_ * p_[0]
        logits, part_o, part_ml = a + 1, a + 2, a + 3
        return (part_o - part_ml) * 2, logits, part_o.sum()

    plain_c = mx.compile(plain)
    one_c = mx.compile(lambda q_, k_, v_, p_: q_ * p_[0])
    return {
        "sdpa": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale),
        "ours": lambda: decode.decode_attention(q, k, v, scale=scale),
        "ours, compiled launch": lambda: launch(q, k, v, prm),
        "ours, tape": lambda: tape(q, k, v, prm),
        "ours, out only": lambda: out_only(q, k, v, prm),
        "plain ops, compiled": lambda: plain_c(q, k, v, prm),
        "plain ops, compiled, 1 out": lambda: one_c(q, k, v, prm),
        "q + 1": lambda: q + 1,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--ns", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    print(f"mlx {mx.__version__} device {mx.default_device()} calls={args.calls} "
          f"rounds={args.rounds} native={native.load()}")
    for D in args.dims:
        for N in args.ns:
            for name, fn in forms(D, N).items():
                us = build_us(fn, args.calls, args.rounds)
                print(f"D={D:3d} N={N:6d} {name:>28s}: {us:6.2f} us a call (build only)")


if __name__ == "__main__":
    main()
