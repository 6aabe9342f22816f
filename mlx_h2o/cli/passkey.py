"""`mlx-h2o passkey`: passkey retrieval over context lengths x depths x budgets x strategies.

Example (max_kv = 25% of the context):
    mlx-h2o passkey --model smollm2-135m --contexts 2048 4096 --budgets 0.25
A budget <= 1 is a fraction of the context length, a larger one is tokens.
"""

import argparse
import json
import time

from ..eval.common import fmt_table, load_any
from ..eval.passkey import accuracy_grid, budget_tokens, make_prompts, run_strategy
from ..eval.plots import plot_heatmaps
from ..eval.results import DEFAULT_ROOT, ResultsDir, machine_info
from ..eval.strategies import parse_strategy


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    p.add_argument("--budgets", type=float, nargs="+", default=[0.25])
    p.add_argument("--strategies", nargs="+",
                   default=["baseline", "rotating", "h2o-heavy"])
    p.add_argument("--trials", type=int, default=4, help="prompts per (context, depth)")
    p.add_argument("--prefill-step", type=int, default=2048,
                   help="prompt chunk size (mlx-lm generate's default is 2048)")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=0, help="0: one batch per length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", default=DEFAULT_ROOT)
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv=None) -> int:
    args = setup_arg_parser().parse_args(argv)
    strategies = [parse_strategy(s) for s in args.strategies]
    config = {k: getattr(args, k) for k in
              ("model", "depths", "trials", "prefill_step", "new_tokens", "seed")}
    rdir = ResultsDir(args.results_dir, "passkey", config, ("model",))
    print(f"# mlx-h2o passkey  results={rdir.path}")
    print("# " + " ".join(f"{k}={v}" for k, v in config.items()))
    model, tokenizer = load_any(args.model)
    strategies = [s.calibrated(model, tokenizer) for s in strategies]
    tic, rows, grids = time.perf_counter(), [], {}
    for ctx in args.contexts:
        prompts = make_prompts(tokenizer, [ctx], args.depths, args.trials, args.seed)
        for budget in args.budgets:
            for st in strategies:
                max_kv = budget_tokens(budget, ctx)
                key = f"{st.key(max_kv)}-ctx{ctx}"
                key += f"-b{budget:g}" if st.bounded else ""
                res = rdir.load(key)
                if res is None:
                    res = run_strategy(model, tokenizer, prompts, st, max_kv,
                                       args.prefill_step, args.new_tokens,
                                       args.batch_size, not args.no_progress)
                    rdir.save(key, res)
                label = st.name if not st.bounded else f"{st.name} b={budget:g}"
                grids.setdefault(label, {}).update(accuracy_grid(res))
                rows.append({"context": ctx, "budget": budget if st.bounded else None,
                             "max_kv": max_kv if st.bounded else None,
                             "strategy": st.name, "accuracy": res["accuracy"],
                             "seconds": res["seconds"]})
                print(f"ctx={ctx} strategy={st.name} max_kv={rows[-1]['max_kv']} "
                      f"accuracy={res['accuracy']:.3f} time={res['seconds']:.1f}s")
    _dedupe_baseline(rows)
    print()
    print(fmt_table(rows, ("context", "strategy", "budget", "max_kv", "accuracy")))
    out = plot_heatmaps(grids, args.contexts, args.depths, rdir.path / "passkey.png",
                        title=f"{args.model} passkey accuracy (budget = max_kv/context)")
    print(f"# plot {out}")
    summary = {"config": config, "machine": machine_info(), "rows": rows,
               "seconds": time.perf_counter() - tic}
    (rdir.path / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({"results": str(rdir.path), "rows": rows}))
    return 0


def _dedupe_baseline(rows):
    seen = set()
    for r in list(rows):
        if r["budget"] is None:
            if r["context"] in seen:
                rows.remove(r)
            seen.add(r["context"])
