"""Host time of the group fold inside decode, piece by piece (GPU diagnostic).

    python3 scripts/fold_in_decode.py [--context 4096] [--budget 256] [--steps 64] [--rounds 4]

Decodes a Qwen3-8B-shaped 4-bit model (random weights) with evicting H2O
caches as mlx-lm's generate_step does (gpu_split.py's generate_split: the
graph build and the dispatch, ``mx.async_eval``, means a token; session
24's logs, made before the script used it, give their medians) and times
with perf_counter, per token: StepGroup.flush (the fold's Python and
launch), inside it _fold_checked and _fold_kernel, and the GroupPlan call
inside those (the native tape's replay: one custom-kernel node and its row
views). Medians per round, in us; a final JSON line.
Session 24 found the fold launch costing 0.26-0.98 ms a token in decode
against ~0.1 ms alone (docs/GPU.md): this says which part of the host's
share is where.
"""

import argparse
import json
import os
import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from gpu_cache_check import prefill  # noqa: E402
from gpu_split import generate_split  # noqa: E402
from mlx_h2o import H2OConfig, make_h2o_cache  # noqa: E402
from mlx_h2o.cache import group as group_mod  # noqa: E402
from mlx_h2o.eval.bench import random_model  # noqa: E402
from mlx_h2o.kernels import group_fold as fold_mod  # noqa: E402

PARTS = ("flush", "fold_checked", "fold_kernel", "replay")


def timed(owner, name, bucket):
    """Wrap ``owner.name`` so that each call adds its wall time to ``bucket``."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            bucket.append(time.perf_counter() - t0)

    setattr(owner, name, wrapper)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    a = p.parse_args()
    times = {k: [] for k in PARTS}
    timed(group_mod.StepGroup, "flush", times["flush"])
    timed(group_mod.StepGroup, "_fold_checked", times["fold_checked"])
    timed(group_mod.StepGroup, "_fold_kernel", times["fold_kernel"])
    timed(fold_mod.GroupPlan, "__call__", times["replay"])
    model = random_model("qwen3-8b", bits=4, dtype=mx.bfloat16)
    cache = make_h2o_cache(model, H2OConfig(max_size=a.budget, heavy_budget=a.budget // 2))
    y = prefill(model, cache, a.context)
    print(f"mlx {mx.__version__} context={a.context} budget={a.budget} steps={a.steps}")
    rows = []
    for r in range(a.rounds):
        for v in times.values():
            v.clear()
        y, split = generate_split(model, cache, y, a.steps)
        row = {k: split[k] * 1e3 for k in ("build", "dispatch")}
        row.update({k: statistics.median(v) * 1e6 for k, v in times.items() if v})
        row["folds"] = len(times["flush"])
        rows.append(row)
        print(f"round={r} " + " ".join(f"{k} {v:7.1f}" for k, v in row.items()), flush=True)
    print(json.dumps({"context": a.context, "budget": a.budget, "rounds": rows}))


if __name__ == "__main__":
    main()
