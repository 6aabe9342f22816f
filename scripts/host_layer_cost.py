"""Host time per decode token of H2O's decode paths vs mlx-lm's caches.

    python scripts/host_layer_cost.py [--path evict|fill] [--layers 36] [--budget 256]
        [--steps 200] [--rounds 5] [--profile]

No model: each strategy runs ``--layers`` caches (Qwen3-8B heads: 32 / 8, D=128),
one decode token each per step, and times building the token's graph (the
caches' Python and MLX op construction; evaluated every 8 tokens, untimed).
``--path evict``: H2O in the evicting steady state of a StepGroup
(cache/group.py), its fold replaced by precomputed results, against
RotatingKVCache; what is timed is everything an H2O layer adds on the host
except the fold's kernel launch, which needs a GPU (scripts/gpu_launch_cost.py
measures that). ``--path fill``: H2O below its budget (deferred scores,
cache/deferred.py) against KVCache; the queue folds every ``defer_steps``
tokens on the same token in every layer, so the median token has none (the
fold's own cost is scripts/bench_queue_fold.py's). Runs on any backend;
rounds alternate the strategies; medians per round and a final JSON line.
``--profile``: then one more round of each strategy under cProfile, its
functions by own time (where a host's extra time per layer goes).
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mlx_h2o import H2OConfig  # noqa: E402
from mlx_h2o.cache import group as group_mod  # noqa: E402
from mlx_h2o.cache.h2o import H2OKVCache  # noqa: E402

B, HQ, HK, D = 1, 32, 8, 128


class StubFold:
    """The group fold's results without its launch: the stacked metadata
    unchanged and the same evaluated per-layer victims every token (the
    real fold's views of its output are built by the native tape with the
    launch, which this leaves out)."""

    def __init__(self, layers, budget):
        self.victims = [mx.zeros((B, HK, 1, D), mx.int32) + (i % budget) for i in range(layers)]
        self.stacked = mx.zeros((layers * B, HK, 1, D), mx.int32)
        mx.eval(self.victims, self.stacked)

    def __call__(self, group, caches, queries, offsets):
        pos, score, count = group._meta
        return pos, score, count, self.stacked, self.victims


def h2o_caches(layers, budget):
    """A full group of evicting H2O caches, as make_h2o_cache sets it up on a GPU."""
    stub = StubFold(layers, budget)
    group_mod.StepGroup._kernel_runs = lambda self, q, hk, kind: True
    group_mod.StepGroup._fold_kernel = lambda self, c, q, o: stub(self, c, q, o)
    H2OKVCache._may_fuse = lambda self: True  # the group path needs a GPU otherwise
    caches = [H2OKVCache(H2OConfig(max_size=budget, heavy_budget=budget // 2))
              for _ in range(layers)]
    group = group_mod.StepGroup()
    k = mx.random.normal((B, HK, budget, D))
    for c in caches:
        group.add(c)
        c.update_and_fetch(k, k)
        c._pending = False
        c._victim = mx.zeros((B, HK, 1, D), mx.int32)  # the fold picked a victim
        c._positions = mx.broadcast_to(mx.arange(budget), (B, HK, budget)) + 0
        c._score, c._count = mx.zeros((B, HK, budget)), mx.zeros((B, HK, budget))
    return caches


def h2o_token(caches, q, k1, scale):
    outs = []
    for c in caches:
        keys, values = c.update_and_fetch(k1, k1)
        outs.append(c.h2o_attention(q, keys, values, scale=scale))
    return outs, [c.kv.keys for c in caches]


def rotating_caches(layers, budget):
    caches = [RotatingKVCache(max_size=budget, keep=4) for _ in range(layers)]
    k = mx.random.normal((B, HK, budget + 8, D))
    for c in caches:
        c.update_and_fetch(k, k)
    return caches


def mlx_lm_token(caches, q, k1, scale):
    """One decode token through mlx-lm caches (RotatingKVCache or KVCache) and SDPA."""
    outs = []
    for c in caches:
        keys, values = c.update_and_fetch(k1, k1)
        outs.append(mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale))
    return outs, [c.keys for c in caches]


def filling_caches(layers, budget):
    """H2O caches below their budget: every decode token appends and queues."""
    caches = [H2OKVCache(H2OConfig(max_size=budget * 64)) for _ in range(layers)]
    k = mx.random.normal((B, HK, budget, D))
    for c in caches:
        keys, values = c.update_and_fetch(k, k)
        c.h2o_attention(mx.random.normal((B, HQ, budget, D)), keys, values,
                        scale=D ** -0.5, mask="causal")
    mx.eval([c.kv.keys for c in caches])
    return caches


def kvcache_caches(layers, budget):
    caches = [KVCache() for _ in range(layers)]
    k = mx.random.normal((B, HK, budget, D))
    for c in caches:
        c.update_and_fetch(k, k)
    return caches


PATHS = {
    "evict": (("rotating", rotating_caches, mlx_lm_token), ("h2o_group", h2o_caches, h2o_token)),
    "fill": (("kvcache", kvcache_caches, mlx_lm_token), ("h2o_fill", filling_caches, h2o_token)),
}


def us_per_token(make, token, layers, budget, steps):
    caches = make(layers, budget)
    q, k1 = mx.random.normal((B, HQ, 1, D)), mx.random.normal((B, HK, 1, D))
    mx.eval(q, k1)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        built = token(caches, q, k1, D ** -0.5)
        times.append(time.perf_counter() - t0)
        if i % 8 == 7:
            mx.eval(built)
    return statistics.median(times[8:]) * 1e6


def profiled(make, token, layers, budget, steps, top=18) -> str:
    """The functions of ``steps`` tokens by own time, under cProfile."""
    prof = cProfile.Profile()
    prof.enable()
    us_per_token(make, token, layers, budget, steps)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", choices=sorted(PATHS), default="evict")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="then a cProfile of each strategy")
    a = p.parse_args()
    print(f"mlx {mx.__version__} device {mx.default_device()} path={a.path} "
          f"layers={a.layers} budget={a.budget}")
    (base, *_), (ours, *_) = order = PATHS[a.path]
    rows = {base: [], ours: []}
    for r in range(a.rounds):
        for name, make, token in order if r % 2 == 0 else order[::-1]:
            rows[name].append(us_per_token(make, token, a.layers, a.budget, a.steps))
        print(f"round={r} {base} {rows[base][-1]:7.1f} us/token  "
              f"{ours} {rows[ours][-1]:7.1f} us/token")
    diff = statistics.median(h - r for h, r in zip(rows[ours], rows[base]))
    print(f"median: {base} {statistics.median(rows[base]):.1f}  {ours} "
          f"{statistics.median(rows[ours]):.1f}  {ours} - {base} (paired) "
          f"{diff:.1f} us/token, {diff / a.layers:.2f} per layer")
    for name, make, token in order if a.profile else ():
        print(f"--- cProfile: {name}, {a.steps} tokens (and its caches' set-up)")
        print(profiled(make, token, a.layers, a.budget, a.steps))
    print(json.dumps({"path": a.path, "layers": a.layers, "budget": a.budget,
                      "us_per_token": rows}))


if __name__ == "__main__":
    main()
