"""GPU decode matrix: tok/s of KVCache, Rotating and H2O, interleaved round by round.

    python benchmarks/decode_matrix.py [--context 4096] [--budget 256] [--rounds 6]
        [--steps 32] [--strategies ...] [--pin CPU] [--trace] [--model PATH]

Strategies (``--strategies``, default all):
  kvcache       mlx-lm's KVCache (everything kept)
  rotating      mlx-lm's RotatingKVCache(budget, keep=4)
  h2o_no_evict  H2O with room for the whole context (scores, no eviction)
  h2o           H2O(budget, heavy = budget / 2), evicting every decode step
  h2o_batch64   the same with ``evict_batch=64`` (appends between batch evictions)

A Qwen3-8B-shaped 4-bit model (random weights: speed does not depend on them;
``--model``: a packaged name or an mlx-lm model dir) is prefilled to
``--context`` tokens once per strategy, then decodes as mlx-lm's generate_step
does: the next token's graph is built (``build``: the forward call) and
dispatched (``dispatch``: ``mx.async_eval``) while the GPU runs the current
one, then ``.item()`` waits for it (``wait``). ``wait`` near zero means the
step is host bound; ``cpu`` is the thread's CPU time per token (steadier than
wall time where the host is shared). ``--trace``: each round also runs every
strategy under torch.profiler (CUPTI sees MLX's kernels; it inflates
durations) for the GPU kernel time per token and the CUDA graph calls.

Each round starts one strategy later (a fixed order gave one position an
edge), with a garbage collection before each turn. Ratios are medians of
per-round ratios (paired) and of each strategy's fastest round ("best
rounds"): run-to-run noise is ~10%, so compare paired ratios. Prints a config
header, a line per round and strategy, medians and ratios, then a JSON line
that benchmarks/plot_decode_matrix.py reads.
"""

import argparse
import collections
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import replace

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_kernels import cuda_kernel_times  # noqa: E402  (benchmarks/, beside this file)

import mlx_h2o  # noqa: E402
from mlx_h2o import H2OConfig, H2OKVCache, make_h2o_cache  # noqa: E402
from mlx_h2o.eval.bench import random_model  # noqa: E402
from mlx_h2o.models import load_model  # noqa: E402

REFERENCES = ("rotating", "kvcache", "h2o")  # the ratios' denominators


def strategies(model, context: int, budget: int) -> dict:
    n = len(model.layers)
    cfg = H2OConfig(max_size=budget, heavy_budget=budget // 2)
    return {
        "kvcache": lambda: [KVCache() for _ in range(n)],
        "rotating": lambda: [
            RotatingKVCache(max_size=budget, keep=4) for _ in range(n)
        ],
        "h2o_no_evict": lambda: make_h2o_cache(
            model, H2OConfig(max_size=context + 4096)
        ),
        "h2o": lambda: make_h2o_cache(model, cfg),
        "h2o_batch64": lambda: make_h2o_cache(model, replace(cfg, evict_batch=64)),
    }


def prefill(model, cache, context: int):
    """``context`` random tokens in 512-token chunks, then 3 warm-up decode steps
    (kernel builds, compiled traces); returns the next input token."""
    with mlx_h2o.patch():
        for s in range(0, context, 512):
            mx.eval(
                model(
                    mx.random.randint(0, 1000, (1, min(512, context - s))), cache=cache
                )
            )
        y = mx.array([[1]])
        for _ in range(3):
            y = model(y, cache=cache)[:, -1:].argmax(-1)
            mx.eval(y)
        # Fold what the warm-up queued: a process's first fold builds its
        # kernels, which would otherwise land in a timed round.
        mx.eval([c.score for c in cache if isinstance(c, H2OKVCache)])
    return y


def generate_split(model, cache, y, steps: int):
    """generate_step's pipeline: ms per token of build, dispatch, wait, wall, cpu."""
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
    return y, {
        "build": build * ms,
        "dispatch": disp * ms,
        "wait": wait * ms,
        "wall": wall * ms,
        "cpu": cpu * ms,
    }


def kernel_time(model, cache, y, steps: int):
    """GPU kernel ms per token (sum of CUPTI kernel durations), kernels per token,
    per kernel name its total us and launches, and the CUDA graph API calls."""
    from torch.profiler import ProfilerActivity, profile

    with mlx_h2o.patch(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            y = model(y, cache=cache)[:, -1:].argmax(-1)
            mx.async_eval(y)
        mx.eval(y)
        mx.synchronize()
    names, launches = cuda_kernel_times(prof, 60)
    total, count = sum(names.values()), sum(launches.values())
    return (
        y,
        total / steps / 1e3,
        count / steps,
        names,
        launches,
        graph_api_counts(prof),
    )


def graph_api_counts(prof) -> collections.Counter:
    """CUDA graph API calls in a trace by name (cudaGraphInstantiate,
    cudaGraphExecUpdate, cudaGraphLaunch ...): MLX's CUDA backend replays a
    cached graph when a step's dependency topology repeats and instantiates a
    new one otherwise. Empty where the profiler does not record these calls."""
    return collections.Counter(
        e.name for e in prof.events() if e.name.startswith(("cudaGraph", "cuGraph"))
    )


def paired(rows, a: str, b: str, key: str) -> float:
    return statistics.median(x[key] / y[key] for x, y in zip(rows[a], rows[b]))


def best_wall(rs) -> float:
    return min(x["wall"] for x in rs)


def run_rounds(model, made: dict, args):
    """Every strategy prefilled once, then decoded round-robin; the rows and traces."""
    state = {name: [make(), None] for name, make in made.items()}
    for name, st in state.items():
        st[1] = prefill(model, st[0], args.context)
    rows = {k: [] for k in made}
    traces = {k: [collections.Counter() for _ in range(3)] for k in made}
    order = list(state)
    for r in range(args.rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            cache, y = state[name]
            gc.collect()
            y, row = generate_split(model, cache, y, args.steps)
            row.update(
                active_gb=mx.get_active_memory() / 2**30,
                peak_gb=mx.get_peak_memory() / 2**30,
            )
            mx.reset_peak_memory()
            if args.trace:
                y, row["kernel"], row["kernels"], *counts = kernel_time(
                    model, cache, y, args.steps
                )
                for total, c in zip(traces[name], counts):
                    total.update(c)
            state[name][1] = y
            rows[name].append(row)
            print(
                f"round={r} {name:>12}: "
                + " ".join(f"{k} {v:6.2f}" for k, v in row.items()),
                flush=True,
            )
    return rows, traces


def summary(rows: dict, traces: dict, args) -> None:
    keys = list(rows[next(iter(rows))][0])
    print("medians (ms per token) and paired ratios of wall (tok/s ratio = 1 / it):")
    for name, rs in rows.items():
        med = {k: statistics.median(x[k] for x in rs) for k in keys}
        refs = [r for r in REFERENCES if r in rows and r != name]
        vs = [(r, paired(rows, r, name, "wall")) for r in refs]
        vs += [(f"{r} (cpu time)", paired(rows, r, name, "cpu")) for r in refs]
        vs += [(f"{r} (best rounds)", best_wall(rows[r]) / best_wall(rs)) for r in refs]
        print(
            f"  {name:>12}: "
            + " ".join(f"{k} {v:6.2f}" for k, v in med.items())
            + "".join(f"  tok/s vs {ref} {v:.3f}" for ref, v in vs)
        )
    per = args.steps * args.rounds
    for name, (times, launches, graphs) in traces.items() if args.trace else ():
        head = ", ".join(f"{k[:40]} {t / per:.0f}" for k, t in times.most_common(8))
        print(f"  top kernels {name} (us/token): {head}")
        head = ", ".join(f"{k[:40]} {n / per:.1f}" for k, n in launches.most_common(12))
        print(f"  launches per token {name}: {head}")
        head = ", ".join(f"{k} {n / per:.2f}" for k, n in sorted(graphs.items()))
        print(f"  CUDA graph calls per token {name}: {head or 'none recorded'}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--steps", type=int, default=32, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--strategies", nargs="*", default=None, help="default: all")
    p.add_argument(
        "--trace",
        action="store_true",
        help="also the CUPTI kernel times per token (needs torch)",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="a real model (packaged name or mlx-lm model dir) instead of the "
        "random-weight Qwen3-8B-shaped one",
    )
    p.add_argument(
        "--pin",
        type=int,
        default=None,
        metavar="CPU",
        help="run on this CPU core only (less scheduler noise)",
    )
    args = p.parse_args()
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
    if args.model:
        model = load_model(args.model)[0]
    else:
        model = random_model("qwen3-8b", bits=4, dtype=mx.bfloat16)
    every = strategies(model, args.context, args.budget)
    unknown = sorted(set(args.strategies or ()) - set(every))
    if unknown:
        p.error(f"unknown strategies {unknown}: choose from {sorted(every)}")
    made = {
        k: v for k, v in every.items() if not args.strategies or k in args.strategies
    }
    print(
        f"mlx={mx.__version__} device={mx.default_device()} "
        f"model={args.model or 'qwen3-8b shapes, 4-bit, random'} "
        f"context={args.context} budget={args.budget} steps={args.steps} "
        f"rounds={args.rounds}",
        flush=True,
    )
    rows, traces = run_rounds(model, made, args)
    summary(rows, traces, args)
    print(json.dumps({"context": args.context, "budget": args.budget, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
