"""Where does decode time go on the GPU? Host build vs dispatch vs GPU, per strategy.

    python scripts/gpu_decode_profile.py [--context 4096] [--budget 256] [--steps 32]

Part 1 times building one call (host only) and chains of calls for: a JIT
`mx.fast.cuda_kernel`, the same kernel through `mx.fast.precompiled_cuda_kernel`
(binary taken from MLX's PTX cache, scalars by value), that JIT call wrapped in
`mx.compile`, and MLX built-ins (SDPA, slice update, put_along_axis).
Part 2 times one attention layer alone (cache update + attention) per strategy,
round-robin. Part 3 decodes a Qwen3-8B-shaped 4-bit model and splits each step into graph
building (the forward call), dispatch (`mx.async_eval`) and the rest, with a
cProfile of the H2O forward. Diagnostic, not a benchmark of record.
"""

import argparse
import cProfile
import glob
import io
import os
import pstats
import statistics
import sys
import tempfile
import time

import mlx.core as mx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from gpu_cache_check import without_groups  # noqa: E402

TINY = r"""
extern "C" __global__ void h2o_probe_add(const float* x, const float* y,
                                         float* out, int n, float scale) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = (x[i] + y[i]) * scale;
}
"""


def per_call(fn, n=2000):
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def chain(step, x0, n=500):
    """us per call of a dependent chain, built and evaluated (host + device)."""
    mx.eval(step(x0))
    mx.synchronize()
    t = time.perf_counter()
    x = x0
    for _ in range(n):
        x = step(x)
    mx.eval(x)
    mx.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def find_binary(kernel_name):
    roots = [os.environ.get("MLX_PTX_CACHE_DIR", ""), os.path.join(tempfile.gettempdir(), "mlx")]
    for root in roots:
        hits = glob.glob(os.path.join(root, "**", kernel_name + ".ptx"), recursive=True) if root else []
        if hits:
            return open(hits[0], "rb").read()
    return None


def call_costs():
    n = 4096
    x = mx.random.normal((n,))
    y = mx.random.normal((n,))
    mx.eval(x, y)
    jit = mx.fast.cuda_kernel(
        name="h2o_probe", input_names=["x", "y"], output_names=["out"],
        source="int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < S) out[i] = (x[i] + y[i]) * 0.5f;",
        header=TINY,
    )

    def j(a):
        return jit(inputs=[a, y], template=[("S", n)], grid=(n, 1, 1), threadgroup=(256, 1, 1),
                   output_shapes=[a.shape], output_dtypes=[a.dtype])[0]

    ref = j(x)
    mx.eval(ref)
    rows = {"jit cuda_kernel": (lambda: j(x), j)}
    blob = find_binary(f"custom_kernel_h2o_probe_{n}")
    print(f"precompiled binary from MLX's cache: {None if blob is None else len(blob)} bytes")
    if blob is not None:
        def p(a):
            return mx.fast.precompiled_cuda_kernel(
                name="h2o_probe_add", compiled_source=blob, inputs=[a, y],
                output_shapes=[a.shape], output_dtypes=[a.dtype], scalars=[n, 0.5],
                grid=(n, 1, 1), threadgroup=(256, 1, 1))[0]
        got = p(x)
        err = mx.abs(got - (x + y) * 0.5).max().item()
        print(f"precompiled output max err {err:.3g}")
        rows["precompiled"] = (lambda: p(x), p)
    # What makes a call expensive: source length (header or body), arity, templates.
    pad = "// " + "x" * 76 + "\n"
    body = "int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < S) out[i] = x[i] * 0.5f;"
    variants = {
        "14 KB header": dict(header=pad * 180, source=body),
        "14 KB body": dict(header="", source=body + "\n" + pad * 180),
    }
    for label, kw in variants.items():
        kv = mx.fast.cuda_kernel(name="h2o_probe_" + label.split()[-1], input_names=["x"],
                                 output_names=["out"], **kw)
        call = lambda kv=kv: kv(inputs=[x], template=[("S", n)], grid=(n, 1, 1),  # noqa: E731
                                threadgroup=(256, 1, 1), output_shapes=[x.shape],
                                output_dtypes=[x.dtype])[0]
        mx.eval(call())
        rows[f"jit, {label}"] = (call, None)
    names_in = [f"i{t}" for t in range(10)]
    names_out = [f"o{t}" for t in range(7)]
    wide = mx.fast.cuda_kernel(name="h2o_probe_wide", input_names=names_in, output_names=names_out,
                               source="int i = threadIdx.x; if (i < S) { o0[i] = i0[i]; }")
    tmpl = [("S", n)] + [(f"C{t}", t) for t in range(10)]
    wcall = lambda: wide(inputs=[x] * 10, template=tmpl, grid=(256, 1, 1),  # noqa: E731
                         threadgroup=(256, 1, 1), output_shapes=[x.shape] * 7,
                         output_dtypes=[x.dtype] * 7)[0]
    mx.eval(wcall())
    rows["jit, 10 in / 7 out / 11 templates"] = (wcall, None)
    cj = mx.compile(j)
    rows["mx.compile(jit)"] = (lambda: cj(x), cj)
    k = mx.random.normal((1, 8, 256, 128)).astype(mx.float16)
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.float16)
    idx = mx.zeros((1, 8, 1, 1), mx.int32)
    mx.eval(k, q, idx)
    sd = lambda a: mx.fast.scaled_dot_product_attention(a, k, k, scale=0.1)  # noqa: E731
    rows["mx.fast sdpa N=256"] = (lambda: sd(q), sd)
    rows["put_along_axis"] = (lambda: mx.put_along_axis(k, idx, q[:, :8], axis=2), None)
    rows["mx.array 5 ints"] = (lambda: mx.array([1, 2, 3, 4, 5], dtype=mx.int32), None)
    for name, (build, step) in rows.items():
        b = per_call(build)
        c = chain(step, q if "sdpa" in name else x) if step is not None else float("nan")
        if name.startswith("jit,"):
            c = float("nan")
        print(f"{name:>34}: build {b:6.2f} us/call   chain {c:6.2f} us/call")


def strategies(model, context, budget):
    from mlx_lm.models.cache import KVCache, RotatingKVCache
    from mlx_h2o import H2OConfig, make_h2o_cache
    n = len(model.layers)
    return {
        "kvcache": lambda: [KVCache() for _ in range(n)],
        "rotating": lambda: [RotatingKVCache(max_size=budget, keep=4) for _ in range(n)],
        "h2o_no_evict": lambda: make_h2o_cache(model, H2OConfig(max_size=context + 512)),
        "h2o_evict": lambda: make_h2o_cache(model, H2OConfig(max_size=budget, heavy_budget=budget // 2)),
        "h2o_perlayer": lambda: without_groups(make_h2o_cache(
            model, H2OConfig(max_size=budget, heavy_budget=budget // 2))),
    }


def decode_split(model, cache, context, steps, profile=False):
    import mlx_h2o
    with mlx_h2o.patch():
        for s in range(0, context, 1024):
            mx.eval(model(mx.random.randint(0, 1000, (1, min(1024, context - s))), cache=cache))
        y = mx.array([[1]])
        for _ in range(4):
            y = model(y, cache=cache)[:, -1:].argmax(-1)
            mx.eval(y)
        build, disp = [], []
        prof = cProfile.Profile() if profile else None
        mx.synchronize()
        tic = time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            y = model(y, cache=cache)[:, -1:].argmax(-1)
            if prof:
                prof.disable()
            t1 = time.perf_counter()
            mx.async_eval(y)
            t2 = time.perf_counter()
            build.append(t1 - t0)
            disp.append(t2 - t1)
        mx.eval(y)
        total = (time.perf_counter() - tic) / steps
        sync = []
        for _ in range(8):
            t0 = time.perf_counter()
            y = model(y, cache=cache)[:, -1:].argmax(-1)
            mx.eval(y)
            sync.append(time.perf_counter() - t0)
    ms = lambda v: statistics.median(v) * 1e3  # noqa: E731
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(20)
        pstats.Stats(prof, stream=s).sort_stats("cumtime").print_stats("mlx_h2o", 30)
        print(s.getvalue())
    return ms(build), ms(disp), total * 1e3, ms(sync)


def live_arrays(obj, depth=2):
    """The arrays an object holds (attributes, lists, one nested object deep)."""
    found = []
    for v in vars(obj).values():
        if isinstance(v, mx.array):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found += [a for a in v if isinstance(a, mx.array)]
            found += [a for t in v if isinstance(t, (list, tuple)) for a in t if isinstance(a, mx.array)]
        elif depth and hasattr(v, "__dict__") and not callable(v):
            found += live_arrays(v, depth - 1)
    return found


def layer_caches(context, budget):
    from mlx_lm.models.cache import KVCache, RotatingKVCache
    from mlx_h2o import H2OConfig, H2OKVCache
    from mlx_h2o.cache import QuantConfig, quantized_cache_type
    evict = H2OConfig(max_size=budget, heavy_budget=budget // 2)
    return {
        "kvcache": KVCache,
        "rotating": lambda: RotatingKVCache(max_size=budget, keep=4),
        "h2o_evict": lambda: H2OKVCache(evict),
        "h2o_no_evict": lambda: H2OKVCache(H2OConfig(max_size=context + 4096)),
        "h2o_no_evict_eager": lambda: _eager(H2OKVCache(H2OConfig(max_size=context + 4096))),
        "h2o_evict_q8": lambda: quantized_cache_type(QuantConfig(8, 64))(evict),
    }


def _eager(cache):
    cache.defer_scores = False  # fold every decode step (the fused launch)
    return cache


def prefill_layer(c, context, heads=(32, 8), D=128, dt=mx.bfloat16):
    """One layer's cache filled with `context` random tokens in 512-token chunks
    through the routed attention (routing must be on)."""
    from mlx_h2o.integration.routing import scaled_dot_product_attention as sdpa
    (Hq, Hk), scale = heads, D ** -0.5
    for s in range(0, context, 512):
        L = min(512, context - s)
        k = mx.random.normal((1, Hk, L, D)).astype(dt)
        kk, vv = c.update_and_fetch(k, k)
        out = sdpa(mx.random.normal((1, Hq, L, D)).astype(dt), kk, vv, c, scale=scale,
                   mask="causal")
        mx.eval(out, live_arrays(c))
    return c


def layer_costs(context, budget, steps=300, rounds=5):
    """One attention layer's decode step alone (cache update + attention; Qwen3-8B
    heads, bf16): host build us and pipelined us per step, round-robin."""
    import mlx_h2o
    from mlx_h2o.integration.routing import scaled_dot_product_attention as sdpa
    B, Hq, Hk, D, dt = 1, 32, 8, 128, mx.bfloat16
    scale = D ** -0.5
    qs = [mx.random.normal((B, Hq, 1, D)).astype(dt) for _ in range(8)]
    ks = [mx.random.normal((B, Hk, 1, D)).astype(dt) for _ in range(8)]
    mx.eval(qs, ks)
    caches = {}
    with mlx_h2o.patch():
        for name, make in layer_caches(context, budget).items():
            caches[name] = prefill_layer(make(), context)
        res = {n: ([], []) for n in caches}
        for r in range(rounds):
            for name, c in caches.items():
                mx.synchronize()
                build = 0.0
                tic = time.perf_counter()
                for i in range(steps):
                    t0 = time.perf_counter()
                    kk, vv = c.update_and_fetch(ks[i % 8], ks[(i + 1) % 8])
                    out = sdpa(qs[i % 8], kk, vv, c, scale=scale, mask=None)
                    build += time.perf_counter() - t0
                    mx.async_eval(out, live_arrays(c))
                mx.eval(out)
                mx.synchronize()
                res[name][0].append(build / steps * 1e6)
                res[name][1].append((time.perf_counter() - tic) / steps * 1e6)
    print(f"layer costs: context={context} budget={budget} steps={steps} rounds={rounds}")
    for name, (b, t) in res.items():
        print(f"  {name:>13}: build {statistics.median(b):6.1f} us  pipelined "
              f"{statistics.median(t):6.1f} us/step  [{min(t):.1f}, {max(t):.1f}]", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--skip-calls", action="store_true")
    p.add_argument("--layer-only", action="store_true", help="only the one-layer costs")
    p.add_argument("--rounds", type=int, default=2, help="model decode repetitions")
    p.add_argument("--profile", nargs="*", default=["h2o_evict"],
                   help="strategies to cProfile in the second repetition")
    args = p.parse_args()
    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    if not args.skip_calls:
        call_costs()
    layer_costs(args.context, args.budget)
    if args.layer_only:
        return
    from mlx_h2o.eval.bench import random_model
    model = random_model("qwen3-8b", bits=4, dtype=mx.bfloat16)
    for rep in range(args.rounds):
        for name, make in strategies(model, args.context, args.budget).items():
            b, d, t, s = decode_split(model, make(), args.context, args.steps,
                                      profile=(rep == 1 and name in args.profile))
            print(f"rep={rep} {name:>13}: build {b:6.2f} ms  dispatch {d:6.2f} ms  "
                  f"pipelined {t:6.2f} ms/step ({1e3 / t:6.1f} tok/s)  synced {s:6.2f} ms", flush=True)


if __name__ == "__main__":
    main()
