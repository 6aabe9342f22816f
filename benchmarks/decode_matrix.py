"""Decode time split, round-robin: host build, dispatch, host wait, GPU kernel time.

    python3 scripts/gpu_split.py [--context 4096] [--budget 256] [--rounds 6]
        [--steps 32] [--strategies ...] [--no-trace] [--ops] [--model PATH]

A Qwen3-8B-shaped 4-bit model (random weights; ``--model``: a real one, e.g.
the packaged SmolLM2 quantized by scripts/gpu_model_parts.sh) decodes as
mlx-lm's generate_step does: the next token's graph is built (``build``: the forward
call) and dispatched (``dispatch``: ``mx.async_eval``) while the GPU runs the
current one, then ``.item()`` waits for it (``wait``). ``wait`` near zero
means the step is host bound; ``cpu`` is the thread's CPU time per token
(steadier than wall time where the host is shared). A serial pass per round
dispatches each token to an idle GPU: ``disp_idle`` (MLX encoding, the GPU
starting as kernels arrive) and ``tail`` (GPU time left once it returns).
Unless ``--no-trace``, each round also runs every strategy under
torch.profiler (CUPTI sees MLX's kernels; it inflates durations) for the
kernel time per token. ``--ops``: build and dispatch cost of cache writes + SDPA
by op, and of the group fold.
Strategies are interleaved round by round, each round starting one strategy
later (a fixed order gave one position a systematic edge), with a garbage
collection before each strategy's turn (none pays for another's garbage);
``--pin CPU`` keeps the process on one core. Ratios are medians of per-round
ratios (paired), and of each strategy's fastest round ("best rounds").
Diagnostic, not a benchmark of record (docs/GPU.md).
"""

import argparse
import collections
import functools
import gc
import json
import os
import statistics
import sys
import time
import types
from dataclasses import replace

import mlx.core as mx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_kernels import cuda_kernel_times  # noqa: E402
from fold_variants import mlx_built, mlx_fold, outputs_plan, victim_outputs  # noqa: E402
from gpu_cache_check import prefill, without_groups  # noqa: E402
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache  # noqa: E402
import mlx_h2o  # noqa: E402
from mlx_h2o import H2OConfig, make_h2o_cache  # noqa: E402
from mlx_h2o.cache import QuantConfig, quantized_cache_type  # noqa: E402
from mlx_h2o.eval.bench import random_model  # noqa: E402
from mlx_h2o.kernels import cubin  # noqa: E402
from mlx_h2o.kernels.build import group_names, group_source  # noqa: E402
from mlx_h2o.kernels.group_fold import GroupFold, group_plan  # noqa: E402
from mlx_h2o.kernels.group_fold import layer_params  # noqa: E402
from mlx_h2o.kernels.kv_write import write_plan  # noqa: E402
from mlx_h2o.kernels.packed import pack  # noqa: E402
from mlx_h2o.models import load_model  # noqa: E402


def kernel_sdpa(kv, queries, keys, values, *, scale):
    """A group step's attention by the fused quantized kernel, scores dropped
    (the alternative to QuantizedKV.sdpa's dequantize + SDPA)."""
    return kv.attention(queries, keys, values, scale=scale, mask=None, sinks=None)[0]


def quantized(model, cfg, bits, group, by_kernel=False, fused_write=True):
    cache = make_h2o_cache(model, cfg, cache_type=quantized_cache_type(QuantConfig(bits, 64)))
    for c in cache:
        c.kv.fused_write = fused_write
        if by_kernel:
            c.kv.sdpa = types.MethodType(kernel_sdpa, c.kv)
    return cache if group else without_groups(cache)


def with_attrs(cache, part=lambda c: c, **attrs):
    """``cache`` with ``attrs`` set on each layer's ``part`` (the cache, its
    storage or its group; None is skipped): the strategies that flip a switch."""
    for target in map(part, cache):
        for name, value in attrs.items() if target is not None else ():
            setattr(target, name, value)
    return cache


def folds_together(cache):
    """Every layer folds its queued scores on the same token (no phase)."""
    for c in cache:
        c.set_fold_phase(0)
    return cache


def fixed_victims(cache):
    """Diagnostic (wrong decisions, timing only): no group fold launch; every
    token hands out the same evaluated victims (slot 0), metadata unchanged.
    With ``h2o`` and ``h2o_slot0``: what the fold's launch costs the host."""
    fixed = []

    def fold(group, caches, queries, offsets):
        if not fixed:
            B, Hk, _, D = caches[0].kv.keys.shape
            fixed[:] = [mx.zeros((len(caches) * B, Hk, 1, D), mx.int32),
                        [mx.zeros((B, Hk, 1, D), mx.int32) for _ in caches]]
            mx.eval(fixed)
        return (*group._meta, *fixed)

    for group in {id(c._group): c._group for c in cache if c._group is not None}.values():
        group._fold_kernel = functools.partial(fold, group)
    return cache


def unheld_keys(cache):
    """Diagnostic (wrong decisions, timing only): the group fold reads one
    fixed zero K buffer per layer instead of the layer's own, so no launch
    holds a layer's K buffer past its own token's SDPA. With ``h2o`` and
    ``h2o_fixed_victims``: whether the fold's hold on every K buffer (until
    its token has run on the GPU) keeps the next token's victim writes from
    donating them (each then copies its buffer). The storage's class becomes
    a subclass, so the ``type(kv) is DenseKV`` paths are off (deferred scores
    below the budget, the per-layer fused step, window-scored prompt chunks):
    the prefill differs, the group steady state that is timed does not."""
    for c in cache:
        base = type(c.kv)

        class Unheld(base):
            @property
            def group_keys(self):
                held = getattr(self, "_zeros", None)
                if held is None or held.shape != self.keys.shape:
                    self._zeros = held = mx.zeros(self.keys.shape, self.keys.dtype)
                    mx.eval(held)
                return held

        c.kv.__class__ = Unheld
    return cache


def slot0_writes(cache):
    """Diagnostic (wrong contents, timing only): each victim write is a slice
    update of slot 0, as RotatingKVCache writes, instead of two scatters."""
    def write(kv, index, keys, values, for_sdpa=False):
        kv.keys[..., :1, :] = keys
        kv.values[..., :1, :] = values

    for c in cache:
        c.kv.write_index = types.MethodType(write, c.kv)
    return cache


def strategies(model, context, budget):
    n = len(model.layers)
    cfg = H2OConfig(max_size=budget, heavy_budget=budget // 2)
    return {
        "kvcache": lambda: [KVCache() for _ in range(n)],
        "rotating": lambda: [RotatingKVCache(max_size=budget, keep=4) for _ in range(n)],
        "h2o": lambda: make_h2o_cache(model, cfg),
        # batched eviction (H2OConfig.evict_batch): KVCache-like appends between batches
        "h2o_batch32": lambda: make_h2o_cache(model, replace(cfg, evict_batch=32)),
        "h2o_batch64": lambda: make_h2o_cache(model, replace(cfg, evict_batch=64)),
        "h2o_no_evict": lambda: make_h2o_cache(model, H2OConfig(max_size=context + 4096)),
        "h2o_no_evict_sync": lambda: folds_together(
            make_h2o_cache(model, H2OConfig(max_size=context + 4096))),
        # the ops fold of queued queries (before session 12) and folds shaped
        # by the slots in use (before session 11)
        "h2o_no_evict_ops": lambda: with_attrs(
            make_h2o_cache(model, H2OConfig(max_size=context + 4096)), fold_queue_on_gpu=False),
        "h2o_no_evict_exact": lambda: with_attrs(
            make_h2o_cache(model, H2OConfig(max_size=context + 4096)), fixed_fold_width=False),
        "h2o_q8": lambda: quantized(model, cfg, 8, False),
        "h2o_q8_group": lambda: quantized(model, cfg, 8, True),
        "h2o_q8_group_kernel": lambda: quantized(model, cfg, 8, True, by_kernel=True),
        "h2o_q8_group_ops": lambda: quantized(model, cfg, 8, True, fused_write=False),
        # victim writes by kernels/kv_write.py; group folds at the next token's
        # first member call (before session 9)
        "h2o_fw": lambda: with_attrs(make_h2o_cache(model, cfg), lambda c: c.kv, fused_write=True),
        "h2o_fold_next": lambda: with_attrs(make_h2o_cache(model, cfg), lambda c: c._group,
                                            fold_at_last_push=False),
        "h2o_per_layer": lambda: without_groups(make_h2o_cache(model, cfg)),
        # the group fold built by MLX, launched directly (before session 18)
        "h2o_mlxfold": lambda: mlx_fold(cfg, model),
        # the group fold with one victim output per layer (before session 23)
        "h2o_victim_outputs": lambda: victim_outputs(cfg, model),
        # diagnostics (wrong results): no fold launch / slice updates for scatters
        "h2o_fixed_victims": lambda: fixed_victims(make_h2o_cache(model, cfg)),
        # session 24: without the steady state's fast path (the general path's
        # checks; the fast path's own check and a lambda call a layer remain)
        "h2o_general_path": lambda: with_attrs(make_h2o_cache(model, cfg),
                                               _into_victim=lambda keys: False),
        "h2o_slot0": lambda: slot0_writes(make_h2o_cache(model, cfg)),
        "h2o_unheld_keys": lambda: unheld_keys(make_h2o_cache(model, cfg)),
        # mlx-lm's own: opt-in, MLX 0.32's CUDA quantized_matmul has no kernel
        # for 4097 keys, so it fails at the first decode step after prefill
        "qkv8": lambda: [QuantizedKVCache(group_size=64, bits=8) for _ in range(n)],
    }


def generate_split(model, cache, y, steps):
    """generate_step's pipeline: ms per token of build / dispatch / wait / wall."""
    build = disp = wait = 0.0
    with mlx_h2o.patch():
        mx.synchronize()
        tic, cpu = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            t0 = time.perf_counter()
            nxt = model(y, cache=cache)[:, -1:].argmax(-1)
            t1 = time.perf_counter()
            mx.async_eval(nxt)
            t2 = time.perf_counter()
            y.item() if y.size == 1 else mx.eval(y)
            t3 = time.perf_counter()
            build, disp, wait = build + t1 - t0, disp + t2 - t1, wait + t3 - t2
            y = nxt
        mx.eval(y)
        wall, cpu = time.perf_counter() - tic, time.thread_time() - cpu
    ms = 1e3 / steps
    return y, {"build": build * ms, "dispatch": disp * ms, "wait": wait * ms, "wall": wall * ms,
               "cpu": cpu * ms}


def serial_split(model, cache, y, steps):
    """One token at a time on an idle GPU: ``disp_idle`` is MLX's encoding cost
    alone, ``tail`` the GPU time left once it returns (ms per token)."""
    disp = tail = 0.0
    with mlx_h2o.patch():
        for _ in range(steps):
            y = model(y, cache=cache)[:, -1:].argmax(-1)
            mx.synchronize()
            t0 = time.perf_counter()
            mx.async_eval(y)
            t1 = time.perf_counter()
            mx.synchronize()
            t2 = time.perf_counter()
            disp, tail = disp + t1 - t0, tail + t2 - t1
    return y, {"disp_idle": disp * 1e3 / steps, "tail": tail * 1e3 / steps}


def kernel_time(model, cache, y, steps):
    """GPU kernel ms per token (sum of CUPTI kernel durations), kernels per token,
    and per kernel name its total us and its launches."""
    from torch.profiler import ProfilerActivity, profile

    with mlx_h2o.patch(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            y = model(y, cache=cache)[:, -1:].argmax(-1)
            mx.async_eval(y)
        mx.eval(y)
        mx.synchronize()
    names, launches = cuda_kernel_times(prof, 60)
    total, count = sum(names.values()), sum(launches.values())
    graphs = graph_api_counts(prof)
    return y, total / steps / 1e3, count / steps, names, launches, graphs


def graph_api_counts(prof) -> collections.Counter:
    """CUDA graph API calls in a trace by name (cudaGraphInstantiate,
    cudaGraphExecUpdate, cudaGraphLaunch ...): MLX's CUDA backend replays a
    cached graph per ~20 kernels when the graph's dependency topology repeats
    and instantiates a new one otherwise (mlx/backend/cuda/device.cpp; its
    cache of 100 is cleared whole when full). Empty where the profiler does
    not record these calls."""
    return collections.Counter(e.name for e in prof.events()
                               if e.name.startswith(("cudaGraph", "cuGraph")))


def op_probe(layers=36, n=256, reps=20):
    """Dispatch ms (idle GPU) of one token's cache writes + SDPA over ``layers``
    layers, per write kind: what a decode step costs MLX to encode, by op."""
    B, Hq, Hk, D, dt = 1, 32, 8, 128, mx.bfloat16
    kv = [[mx.random.normal((B, Hk, n, D)).astype(dt) for _ in range(2)] for _ in range(layers)]
    q = mx.random.normal((B, Hq, 1, D)).astype(dt)
    new = mx.random.normal((B, Hk, 1, D)).astype(dt)
    idx = mx.random.randint(0, n, (B, Hk, 1, 1)).astype(mx.uint32)
    mx.eval(kv, q, new, idx)

    def slice_update(a, i):
        a[..., i % n:i % n + 1, :] = new
        return a

    def scatter(a, i):
        return mx.put_along_axis(a, idx, new, axis=2)

    idx_d = mx.contiguous(mx.broadcast_to(idx.astype(mx.int32), (B, Hk, 1, D)))  # as the fold gives it
    idx_q = idx.astype(mx.int32)
    qkv = [[mx.quantize(a, group_size=64, bits=8) for a in pair] for pair in kv]
    mx.eval(idx_d, idx_q, qkv)

    dense_plan, q8_plan = write_plan(dt, D), write_plan(dt, D, 8, 64, True)
    packed_plan = write_plan(dt, D, 8, 64, True, True)
    packed = [pack(*pair) for pair in qkv]
    mx.eval(packed)

    def kernel_write(pair, i):  # what DenseKV.write_index calls
        return list(dense_plan(new, new, idx_d, *pair))

    def q8_ops(pair, i):
        t = mx.quantize(new, group_size=64, bits=8)
        pair = [tuple(mx.put_along_axis(a, idx_q, x, axis=2) for a, x in zip(p, t)) for p in pair]
        return pair, [mx.dequantize(*p, group_size=64, bits=8) for p in pair]

    def q8_fused(pair, i):  # what QuantizedKV.write_index calls
        res = q8_plan(new, new, idx_q, *pair[0], *pair[1])
        return [tuple(res[:3]), tuple(res[3:6])], res[6:]

    def q8_direct(pair, i):  # the same launch without mx.compile
        res = q8_plan._launch(new, new, idx_q, *pair[0], *pair[1])
        return [tuple(res[:3]), tuple(res[3:6])], res[6:]

    def q8_packed(buf, i):  # what QuantizedKV.write_index calls in a group step
        buf, kd, vd = packed_plan(new, new, idx_q, buf)
        return buf, (kd, vd)

    out = {}
    for name, write in (("slice_update", slice_update), ("put_along_axis", scatter),
                        ("kv_write_kernel", kernel_write), ("sdpa_only", None),
                        ("q8_ops", q8_ops), ("q8_fused_write", q8_fused),
                        ("q8_fused_write_direct", q8_direct), ("q8_packed_write", q8_packed)):
        times, builds = [], []
        for r in range(reps):
            outs = []
            mx.synchronize()
            tb = time.perf_counter()
            for j, pair in enumerate(kv):
                if name == "q8_packed_write":
                    packed[j], dense = write(packed[j], r)
                    outs.append(mx.fast.scaled_dot_product_attention(q, *dense, scale=0.08))
                    continue
                if name.startswith("q8"):
                    qkv[j], dense = write(qkv[j], r)
                    outs.append(mx.fast.scaled_dot_product_attention(q, *dense, scale=0.08))
                    continue
                if write is kernel_write:
                    pair[:] = write(pair, r)
                elif write is not None:
                    pair[:] = [write(a, r) for a in pair]
                outs.append(mx.fast.scaled_dot_product_attention(q, *pair, scale=0.08))
            t0 = time.perf_counter()
            mx.async_eval(outs, kv, qkv, packed)
            times.append(time.perf_counter() - t0)
            builds.append(t0 - tb)
            mx.synchronize()
        out[name] = statistics.median(times[2:]) * 1e3
        out[name + " (build)"] = statistics.median(builds[2:]) * 1e3
    return out


def fold_launch(plan, kernel="mlx", compiled=False):
    """The plan's launch with MLX's build of its kernel or ours (``cubin``:
    kernels/cubin.py, built once per machine), optionally under mx.compile."""
    plan = mlx_built(plan)
    if kernel == "cubin":  # a new kernel object: its first call reads or builds the cubin
        quantized = plan.VD == 1
        plan.kernel = cubin.PrecompiledKernel(
            f"h2o_group{'q' if quantized else ''}{plan.n}", *group_names(plan.n, quantized),
            *group_source("cuda", plan.n, quantized), fallback=plan.kernel)
    return mx.compile(plan._launch) if compiled else plan._launch


def fold_probe(layers=36, M=256, reps=20, bits=None, kernel="mlx", compiled=False):
    """Build, dispatch and wait ms (idle GPU) of one token's group fold over
    ``layers`` layers (kernels/group_fold.py; ``bits``: packed K/V), chained as
    in decode, and the first call's (build included); ``kernel`` and
    ``compiled`` as fold_launch, or ``kernel`` "library" (the plan's own
    launch: our cubin replayed by the native tape) or "outputs" (the same
    with a victim output a layer, before session 23). ``same``: the first
    call's outputs equal those of MLX's build launched directly."""
    B, Hq, Hk, D, dt, offset = 1, 32, 8, 128, mx.bfloat16, 5000
    qs = [mx.random.normal((B, Hq, 1, D)).astype(dt) for _ in range(layers)]
    keys = [mx.random.normal((B, Hk, M, D)).astype(dt) for _ in range(layers)]
    if bits is not None:
        keys = [pack(*[mx.quantize(k, group_size=64, bits=bits)] * 2) for k in keys]
    pos = mx.broadcast_to(mx.arange(offset - 1 - M, offset - 1, dtype=mx.int32),
                          (layers * B, Hk, M)) + 0
    score, count = mx.random.uniform(shape=pos.shape), mx.ones(pos.shape)
    slot = mx.zeros((layers * B, Hk, 1, D), mx.int32)
    lay_i = mx.array([layer_params(offset, 4, M // 2, M, M)] * layers, dtype=mx.int32)
    lay_f = mx.array([[D ** -0.5, 0.95, 0.05, 0.0]] * layers, mx.float32)
    mx.eval(qs, keys, pos, score, count, slot, lay_i, lay_f)
    key = (layers, B, Hq, Hk, D, dt, M, "accumulated", (), bits, 64)
    plan, same = group_plan(*key), None
    if kernel == "library":  # as the caches launch it: our cubin, the native tape
        launch = plan._run
    elif kernel == "outputs":  # the same with an output a layer (before session 23)
        launch = outputs_plan(*key)._run
    else:
        launch = fold_launch(plan, kernel, compiled)
    builds, disps, waits = [], [], []
    for r in range(reps):
        mx.synchronize()
        t0 = time.perf_counter()
        out = launch(*qs, *keys, lay_i, lay_f, pos, score, count, slot)
        res = GroupFold(*out[:6], list(out[6:]))
        t1 = time.perf_counter()
        mx.async_eval(res.positions, res.victims)
        t2 = time.perf_counter()
        mx.synchronize()
        builds.append(t1 - t0)
        disps.append(t2 - t1)
        waits.append(time.perf_counter() - t2)
        if r == 0:
            first = time.perf_counter() - t0
            ref = fold_launch(plan)(*qs, *keys, lay_i, lay_f, pos, score, count, slot)
            same = all(mx.array_equal(a, b).item() for a, b in zip(out, ref))
        pos, score, count, slot, lay_i = res.positions, res.score, res.count, res.victim, res.lay_i
    return {"first": first * 1e3, "build": statistics.median(builds[2:]) * 1e3,
            "dispatch": statistics.median(disps[2:]) * 1e3,
            "wait": statistics.median(waits[2:]) * 1e3, "same": same}


# MLX's build first: the cubin variants check their outputs against it.
# The library's launch and the one before session 23 alternate, twice each.
FOLD_LAUNCHES = ([("mlx", False), ("mlx", True), ("cubin", False), ("cubin", True)]
                 + [("library", False), ("outputs", False)] * 2)


def best_wall(rs):
    return min(x["wall"] for x in rs)


def paired(rows, a, b, key):
    return statistics.median(x[key] / y[key] for x, y in zip(rows[a], rows[b]))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--strategies", nargs="*", default=None, help="default: all but qkv8")
    p.add_argument("--no-trace", action="store_true", help="skip the CUPTI kernel times")
    p.add_argument("--ops", action="store_true", help="also the per-op dispatch probe")
    p.add_argument("--ops-only", action="store_true", help="the probes, no decode runs")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="a real model (packaged name or mlx-lm model dir) instead of the "
                        "random-weight Qwen3-8B-shaped one")
    p.add_argument("--pin", type=int, default=None, metavar="CPU",
                   help="run on this CPU core only (less scheduler noise)")
    args = p.parse_args()
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
    if args.ops or args.ops_only:
        print("op probe, dispatch (and build) ms per token (36 layers, idle GPU):",
              json.dumps({k: round(v, 3) for k, v in op_probe().items()}), flush=True)
        for bits in (None, 8):
            for kernel, compiled in FOLD_LAUNCHES:
                res = fold_probe(bits=bits, kernel=kernel, compiled=compiled)
                print(f"fold probe, ms per token (36 layers, bits={bits}, kernel={kernel}, "
                      f"compiled={compiled}):", json.dumps(
                          {k: round(v, 3) if isinstance(v, float) else v
                           for k, v in res.items()}), flush=True)
    if args.ops_only:
        return
    if args.model:
        model = load_model(args.model)[0]
    else:
        model = random_model("qwen3-8b", bits=4, dtype=mx.bfloat16)
    print(f"mlx {mx.__version__} model={args.model or 'qwen3-8b shapes, 4-bit, random'} "
          f"context={args.context} budget={args.budget} "
          f"steps={args.steps} rounds={args.rounds}", flush=True)
    made = {k: v for k, v in strategies(model, args.context, args.budget).items()
            if (k in args.strategies if args.strategies else k != "qkv8")}
    state = {}
    for name, make in made.items():
        cache = make()
        state[name] = [cache, prefill(model, cache, args.context)]
    rows = {k: [] for k in made}
    top = {k: collections.Counter() for k in made}
    launched = {k: collections.Counter() for k in made}
    graph_calls = {k: collections.Counter() for k in made}
    order = list(state)
    for r in range(args.rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            cache, y = state[name]
            gc.collect()
            y, row = generate_split(model, cache, y, args.steps)
            y, idle = serial_split(model, cache, y, args.steps)
            row.update(idle)
            row.update(active_gb=mx.get_active_memory() / 2**30,
                       cache_gb=mx.get_cache_memory() / 2**30,
                       peak_gb=mx.get_peak_memory() / 2**30)
            mx.reset_peak_memory()
            if not args.no_trace:
                y, row["kernel"], row["kernels"], names, n, graphs = kernel_time(
                    model, cache, y, args.steps)
                top[name].update(names)
                launched[name].update(n)
                graph_calls[name].update(graphs)
            state[name][1] = y
            rows[name].append(row)
            print(f"round={r} {name:>13}: " + " ".join(f"{k} {v:6.2f}" for k, v in row.items()),
                  flush=True)
    keys = list(rows[next(iter(rows))][0])
    print("medians (ms per token) and paired ratios of wall (tok/s ratio = 1 / it):")
    for name, rs in rows.items():
        med = {k: statistics.median(x[k] for x in rs) for k in keys}
        refs = [r for r in ("rotating", "kvcache", "h2o") if r in rows and r != name]
        vs = [(r, paired(rows, r, name, "wall")) for r in refs]
        vs += [(f"{r} (cpu time)", paired(rows, r, name, "cpu")) for r in refs]
        # Each strategy's quietest round: the host's speed drifts (docs/GPU.md).
        vs += [(f"{r} (best rounds)", best_wall(rows[r]) / best_wall(rs))
               for r in refs]
        kern = [(ref, paired(rows, name, ref, "kernel")) for ref in ("rotating", "h2o")
                if "kernel" in keys and ref in rows and ref != name]
        print(f"  {name:>13}: " + " ".join(f"{k} {v:6.2f}" for k, v in med.items())
              + "".join(f"  tok/s vs {ref} {v:.3f}" for ref, v in vs)
              + "".join(f"  kernel ms / {ref}'s {v:.3f}" for ref, v in kern))
    if not args.no_trace:
        for name, c in top.items():
            head = ", ".join(f"{k[:40]} {t / args.steps / args.rounds:.0f}"
                             for k, t in c.most_common(8))
            print(f"  top kernels {name} (us/token): {head}")
            per = args.steps * args.rounds
            head = ", ".join(f"{k[:40]} {n / per:.1f}" for k, n in launched[name].most_common(12))
            print(f"  launches per token {name}: {head}")
            head = ", ".join(f"{k} {n / per:.2f}" for k, n in sorted(graph_calls[name].items()))
            print(f"  CUDA graph calls per token {name}: {head or 'none recorded'}")
    print(json.dumps({"context": args.context, "budget": args.budget, "rows": rows}))


if __name__ == "__main__":
    main()
