"""Host cost of the pieces of one H2O decode step on the GPU (diagnostic).

    python scripts/gpu_step_probe.py [--context 4096] [--budget 256]

Times building (no evaluation) of each piece of a layer's decode step for an
evicting and a non-evicting H2O cache with Qwen3-8B heads: the cache update,
the fused step's plan call (compiled and not), the bare kernel launches, and
MLX built-ins for scale. Diagnostic, not a benchmark of record.
"""

import argparse
import os
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import mlx_h2o  # noqa: E402
from mlx_h2o import H2OConfig, H2OKVCache  # noqa: E402
from mlx_h2o.integration.routing import scaled_dot_product_attention as sdpa  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from gpu_decode_profile import per_call, prefill_layer  # noqa: E402

B, HQ, HK, D, DT = 1, 32, 8, 128, mx.bfloat16


def filled(cfg, context):
    scale = D ** -0.5
    with mlx_h2o.patch():
        c = prefill_layer(H2OKVCache(cfg), context, (HQ, HK), D, DT)
        q = mx.random.normal((B, HQ, 1, D)).astype(DT)
        k = mx.random.normal((B, HK, 1, D)).astype(DT)
        for _ in range(3):
            kk, vv = c.update_and_fetch(k, k)
            out = sdpa(q, kk, vv, c, scale=scale, mask=None)
            mx.eval(out, c.positions, c.score, c.count, c.kv.keys, c.kv.values)
    return c, q, k


def probe(name, cfg, context):
    c, q, k = filled(cfg, context)
    scale = D ** -0.5
    plan = c._plan
    if plan is None:
        print(f"{name}: the fused step was not taken (no GPU?)")
        return
    keys, values = c.kv.keys, c.kv.values
    slot = c._victim if c._victim is not None else None
    n = c._n
    args = (q, keys, values, c.positions, c.score, c.count, slot,
            None if slot is not None else n - 1, c.offset)
    prm_i = mx.array([c.offset, -1, 0, 4, 124, n], mx.int32)
    arrays = (q, keys, values, c.positions, c.score, c.count,
              slot if slot is not None else mx.zeros((1, 1), mx.int32), prm_i)
    rows = {
        "plan(...) as the cache calls it": lambda: plan(*args, valid=n),
        "plan._steady(*arrays) (compiled)": lambda: plan._steady(*arrays),
        "plan._launch(*arrays) (uncompiled)": lambda: plan._launch(*arrays),
        "mx.array prm_i": lambda: mx.array([c.offset, -1, 0, 4, 124, n], mx.int32),
        "kv.fetch(n)": lambda: c.kv.fetch(n),
        "mx.fast sdpa on the buffers": lambda: mx.fast.scaled_dot_product_attention(
            q, keys, values, scale=scale),
    }
    if slot is not None:
        rows["kv.write_index (2 put_along_axis)"] = lambda: (
            mx.put_along_axis(keys, slot, k, axis=2), mx.put_along_axis(values, slot, k, axis=2))
    print(f"{name}: n={n} cap={keys.shape[2]} splits={plan.splits(keys.shape[2])} "
          f"victim={'yes' if slot is not None else 'no'}")
    for label, fn in rows.items():
        print(f"  {label:>38}: {per_call(fn):7.2f} us", flush=True)
    # The whole layer step, built and evaluated every 8 steps.
    with mlx_h2o.patch():
        t_upd = t_att = 0.0
        for i in range(400):
            t0 = time.perf_counter()
            kk, vv = c.update_and_fetch(k, k)
            t1 = time.perf_counter()
            out = sdpa(q, kk, vv, c, scale=scale, mask=None)
            t2 = time.perf_counter()
            t_upd += t1 - t0
            t_att += t2 - t1
            mx.async_eval(out, c.positions, c.score, c.count, c.kv.keys, c.kv.values)
        mx.eval(out)
    print(f"  {'update_and_fetch':>38}: {t_upd / 400 * 1e6:7.2f} us")
    print(f"  {'h2o_attention (routed)':>38}: {t_att / 400 * 1e6:7.2f} us", flush=True)
    split_attention(c, q, k)


def split_attention(c, q, k, steps=400):
    """The routed attention's parts, timed inside the decode loop."""
    spent = {}

    def timed(obj, name, label):
        fn = getattr(obj, name)

        def wrapper(*a, **kw):
            t = time.perf_counter()
            r = fn(*a, **kw)
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - t
            return r
        setattr(obj, name, wrapper)

    plan = c._plan
    timed(c, "_fused_plan", "cache._fused_plan (check + plan)")
    timed(c, "_fused_step", "cache._fused_step (incl. launch)")
    timed(c, "h2o_attention", "cache.h2o_attention (all)")
    timed(c, "update_and_fetch", "cache.update_and_fetch (all)")
    timed(plan, "_steady", "plan._steady (compiled launch)")
    timed(c.kv, "write_index", "kv.write_index")
    timed(c.kv, "fetch", "kv.fetch")
    scale = D ** -0.5
    with mlx_h2o.patch():
        for _ in range(steps):
            kk, vv = c.update_and_fetch(k, k)
            out = sdpa(q, kk, vv, c, scale=scale, mask=None)
            mx.async_eval(out, c.positions, c.score, c.count, c.kv.keys, c.kv.values)
        mx.eval(out)
    for label, t in spent.items():
        print(f"  {'in loop: ' + label:>38}: {t / steps * 1e6:7.2f} us", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--budget", type=int, default=256)
    a = p.parse_args()
    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    probe("h2o_evict", H2OConfig(max_size=a.budget, heavy_budget=a.budget // 2), a.context)
    probe("h2o_no_evict", H2OConfig(max_size=a.context + 4096), a.context)


if __name__ == "__main__":
    main()
