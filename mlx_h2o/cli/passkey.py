"""`mlx-h2o passkey`: passkey retrieval over context lengths x depths x budgets x strategies.

Example (max_kv = 25% of the context):
    mlx-h2o passkey --model smollm2-135m --contexts 2048 4096 --budgets 0.25
A budget <= 1 is a fraction of the context length, a larger one is tokens.
Writes <results-dir>/passkey/<model>-<hash>/: one JSON per finished
(strategy, context, budget) (a rerun skips them), summary.json and passkey.png.
"""

import json
import time

from ..eval.common import fmt_table
from ..eval.results import ResultsDir, machine_info
from .common import (
    add_contexts_arg,
    add_model_arg,
    add_output_args,
    add_prompt_args,
    check_at_least,
    check_budgets,
    check_depths,
    check_model_arg,
    command_parser,
    fail,
    has_matplotlib,
    load_model_or_fail,
    load_tokenizer_or_fail,
    save_plot,
    strategies_or_fail,
)


def setup_arg_parser():
    p = command_parser("passkey", __doc__)
    add_model_arg(p)
    add_contexts_arg(p)
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9],
                   help="where the passkey sits in the filler (0 = start, 1 = end)")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.25],
                   help="KV budget per layer: <= 1 a fraction of the context, else tokens")
    add_prompt_args(p)
    p.add_argument("--trials", type=int, default=4, help="prompts per (context, depth)")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens decoded for the answer")
    p.add_argument("--batch-size", type=int, default=0,
                   help="prompts per batch (0: one batch per context length)")
    p.add_argument("--seed", type=int, default=0, help="seed of the passkeys")
    add_output_args(p)
    return p


def budget_label(budget: float) -> str:
    """How a --budgets value reads: a fraction of the context or tokens."""
    return f"max_kv={budget:g}x context" if budget <= 1 else f"max_kv={budget:g}"


def check_budget_args(parser, args, strategies) -> None:
    """``--budgets`` (with ``--contexts``) that every strategy can run, and the
    retrieval commands' counts: before anything loads."""
    from ..eval.passkey import budget_tokens

    check_at_least(parser, "--contexts", args.contexts, 1)
    check_depths(parser, args.depths)
    for b in args.budgets:
        if not b > 0:
            fail(parser, f"--budgets {b:g}: a budget is a fraction of the context in "
                 "(0, 1] or a number of tokens above 1")
    check_budgets(parser, strategies, [
        (f"{b:g} (max_kv {budget_tokens(b, c)} at context {c})", budget_tokens(b, c))
        for b in args.budgets for c in args.contexts], "--budgets")
    check_at_least(parser, "--new-tokens", args.new_tokens, 1)
    check_at_least(parser, "--batch-size", args.batch_size, 0)
    check_at_least(parser, "--prefill-step-size", args.prefill_step_size, 1)


def prompts_or_fail(parser, make, contexts) -> dict:
    """{context: prompts}, ``make(context)`` for each; a context too short for
    its prompts ends the command."""
    out = {}
    for ctx in contexts:
        try:
            out[ctx] = make(ctx)
        except ValueError as e:
            fail(parser, f"--contexts {ctx}: {e}")
    return out


def checked_strategies(parser, args) -> list:
    """``--model``, ``--strategies`` and the budget arguments, checked."""
    check_model_arg(parser, args.model)
    strategies = strategies_or_fail(parser, args.strategies)
    check_budget_args(parser, args, strategies)
    return strategies


def check_args(parser, args) -> list:
    """The strategies, once every argument is checked (before anything loads;
    the contexts against the prompts' lengths come with the tokenizer)."""
    strategies = checked_strategies(parser, args)
    check_at_least(parser, "--trials", args.trials, 1)
    return strategies


def units(args, strategies):
    """(context, budget, strategy, max_kv, result key) in run order; the
    unbounded baseline once per context."""
    from ..eval.passkey import budget_tokens

    for ctx in args.contexts:
        for budget in args.budgets:
            for st in strategies:
                if not st.bounded and budget != args.budgets[0]:
                    continue
                max_kv = budget_tokens(budget, ctx)
                key = f"{st.key(max_kv)}-ctx{ctx}" + (f"-b{budget:g}" if st.bounded else "")
                yield ctx, budget, st, max_kv, key


def main(argv=None) -> int:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    strategies = check_args(parser, args)
    from ..eval.passkey import accuracy_grid, make_prompts, run_strategy

    tokenizer = load_tokenizer_or_fail(parser, args.model)
    grid = prompts_or_fail(parser, lambda ctx: make_prompts(
        tokenizer, [ctx], args.depths, args.trials, args.seed), args.contexts)
    plots = has_matplotlib(parser.prog)
    config = {"model": args.model, "depths": args.depths, "trials": args.trials,
              "prefill_step": args.prefill_step_size, "new_tokens": args.new_tokens,
              "seed": args.seed}
    rdir = ResultsDir(args.results_dir, "passkey", config, ("model",))
    print(f"# mlx-h2o passkey  results={rdir.path}")
    print("# " + " ".join(f"{k}={v}" for k, v in config.items()))
    model, tokenizer = load_model_or_fail(parser, args.model)
    strategies = [s.calibrated(model, tokenizer) for s in strategies]
    tic, rows, grids = time.perf_counter(), [], {}
    for ctx, budget, st, max_kv, key in units(args, strategies):
        res = rdir.load(key)
        if res is None:
            res = run_strategy(model, tokenizer, grid[ctx], st, max_kv, args.prefill_step_size,
                               args.new_tokens, args.batch_size, not args.no_progress)
            rdir.save(key, res)
        label = f"{st.name}, {budget_label(budget)}" if st.bounded else f"{st.name} (unbounded)"
        grids.setdefault(label, {}).update(accuracy_grid(res))
        rows.append({"context": ctx, "budget": budget if st.bounded else None,
                     "max_kv": max_kv if st.bounded else None, "strategy": st.name,
                     "accuracy": res["accuracy"], "seconds": res["seconds"]})
        print(f"ctx={ctx} strategy={st.name} max_kv={rows[-1]['max_kv']} "
              f"accuracy={res['accuracy']:.3f} time={res['seconds']:.1f}s")
    print()
    print(fmt_table(rows, ("context", "strategy", "budget", "max_kv", "accuracy")))
    summary = {"config": config, "machine": machine_info(), "rows": rows,
               "seconds": time.perf_counter() - tic}
    rdir.save("summary", summary)  # before the plot: it may fail
    if plots:
        from ..eval.plots import plot_heatmaps

        save_plot(plot_heatmaps, grids, args.contexts, args.depths, rdir.path / "passkey.png",
                  title=f"{args.model} passkey accuracy, {args.trials} trial(s) a cell")
    print(json.dumps({"results": str(rdir.path), "rows": rows}))
    return 0
