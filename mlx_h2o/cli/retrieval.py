"""`mlx-h2o retrieval`: RULER-style retrieval tasks over contexts x budgets x strategies.

Example (7 tasks x 3 depths a context; max_kv = 10/25/50% of the context):
    mlx-h2o retrieval --model smollm2-135m --contexts 2048 4096 --budgets 0.1 0.25 0.5
Tasks (mlx_h2o/eval/retrieval_data.py): single / multikey / multivalue /
multiquery key-value needles, a sentence needle, variable tracking and a
question about a document, in a haystack of essay text, asked through the
model's chat template where it has one; the prompt is prefilled in chunks of
--prefill-step-size tokens (mlx-lm's default 2048), the answer decoded greedily.
Writes <results-dir>/retrieval/<model>-<hash>/: one JSON per finished
(strategy, context, budget) with every output, summary.json and one heatmap
PNG per context.
"""

import json
import time

from ..eval.common import fmt_table
from ..eval.results import ResultsDir, machine_info
from ..eval.retrieval_data import TASKS
from .common import (
    add_contexts_arg,
    add_model_arg,
    add_output_args,
    add_prompt_args,
    command_parser,
    ensure_corpus_or_fail,
    fail,
    has_matplotlib,
    load_model_or_fail,
    load_tokenizer_or_fail,
    save_plot,
)
from .passkey import budget_label, checked_strategies, prompts_or_fail, units


def setup_arg_parser():
    p = command_parser("retrieval", __doc__)
    add_model_arg(p)
    add_contexts_arg(p)
    p.add_argument("--tasks", nargs="+", default=list(TASKS), help=f"some of {TASKS}")
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9],
                   help="where the (asked) needle sits (0 = start, 1 = end): a prompt each")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.25, 0.5],
                   help="KV budget per layer: <= 1 a fraction of the context, else tokens")
    add_prompt_args(p)
    p.add_argument("--haystack", default="austen",
                   help="noise (repeated filler sentences), a corpus name (austen, "
                   "python-docs, ...) or the path of your own text file or folder")
    p.add_argument("--no-chat", action="store_true",
                   help="plain prompts even where the model has a chat template")
    p.add_argument("--new-tokens", type=int, default=64,
                   help="tokens decoded for the answer (4 values of 7 digits in a list: ~45)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="prompts per batch (0: one batch per context length)")
    p.add_argument("--seed", type=int, default=0, help="seed of the needles")
    add_output_args(p)
    return p


def check_args(parser, args) -> list:
    """The strategies, once every argument is checked (before anything loads;
    the contexts against the prompts' lengths come with the tokenizer)."""
    bad = [t for t in args.tasks if t not in TASKS]
    if bad:
        fail(parser, f"--tasks {' '.join(bad)}: unknown; use some of {' '.join(TASKS)}")
    return checked_strategies(parser, args)


def main(argv=None) -> int:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    strategies = check_args(parser, args)
    if args.haystack != "noise":
        ensure_corpus_or_fail(parser, args.haystack, "--haystack")
    from ..eval.passkey import run_strategy
    from ..eval.retrieval import haystack_text, make_prompts, task_accuracy

    tokenizer, hay = load_tokenizer_or_fail(parser, args.model), haystack_text(args.haystack)
    grid = prompts_or_fail(parser, lambda ctx: make_prompts(
        tokenizer, args.tasks, [ctx], args.depths, args.seed, hay, not args.no_chat),
        args.contexts)
    plots = has_matplotlib(parser.prog)
    config = {"model": args.model, "tasks": args.tasks, "depths": args.depths,
              "haystack": args.haystack, "prefill_step": args.prefill_step_size,
              "new_tokens": args.new_tokens, "seed": args.seed, "chat": not args.no_chat}
    rdir = ResultsDir(args.results_dir, "retrieval", config, ("model",))
    print(f"# mlx-h2o retrieval  results={rdir.path}")
    print("# " + " ".join(f"{k}={v}" for k, v in config.items()), flush=True)
    model, tokenizer = load_model_or_fail(parser, args.model)
    strategies = [s.calibrated(model, tokenizer) for s in strategies]
    tic, rows, full = time.perf_counter(), [], {}  # full: the baseline's result a context
    for ctx, budget, st, max_kv, key in units(args, strategies):
        res = rdir.load(key)
        if res is None:
            res = run_strategy(model, tokenizer, grid[ctx], st, max_kv, args.prefill_step_size,
                               args.new_tokens, args.batch_size, not args.no_progress)
            rdir.save(key, res)
        acc = task_accuracy(res)
        if not st.bounded:
            full[ctx] = res
        rows.append({"context": ctx, "strategy": st.name,
                     "budget": budget if st.bounded else None,
                     "max_kv": max_kv if st.bounded else None, **acc,
                     **_kept(res, full.get(ctx)), "seconds": res["seconds"]})
        print(f"ctx={ctx} strategy={st.name} max_kv={rows[-1]['max_kv']} "
              f"mean={acc['mean']:.3f} " + " ".join(
                  f"{t}={acc[t]:.2f}" for t in args.tasks), flush=True)
    cols = ("context", "strategy", "budget", "max_kv", *args.tasks, "mean", "kept")
    print()
    print(fmt_table(rows, cols))
    summary = {"config": config, "machine": machine_info(), "rows": rows,
               "seconds": time.perf_counter() - tic}
    rdir.save("summary", summary)  # before the plots: they may fail
    if plots:
        _plots(rows, args, rdir)
    print(json.dumps({"results": str(rdir.path), "rows": rows}))
    return 0


def _kept(res, full) -> dict:
    """``kept``: "k/n", of the n prompts the baseline answered this strategy
    answered k (none before the baseline has run: list it first)."""
    if full is None or res is full:
        return {}
    from ..eval.retrieval import kept_columns

    return kept_columns(res, full)


def _plots(rows, args, rdir):
    from ..eval.plots import plot_heatmaps

    cols = [*args.tasks, "mean"]
    for ctx in args.contexts:
        sel = [r for r in rows if r["context"] == ctx]
        names = list(dict.fromkeys(r["strategy"] for r in sel))
        acc = {}
        for budget in args.budgets:
            panel = {}
            for r in sel:
                if r["budget"] in (budget, None):
                    panel.update({(r["strategy"], t): r[t] for t in cols})
            acc[budget_label(budget)] = panel
        save_plot(plot_heatmaps, acc, names, cols, rdir.path / f"retrieval_ctx{ctx}.png",
                  row_label="strategy", col_label="task",
                  title=f"{args.model} retrieval accuracy at {ctx} tokens, "
                  f"{len(args.depths)} prompt(s) a task")
    kept = [r for r in rows if r.get("kept_frac") is not None]
    if kept:  # one panel: a column per (context, budget), a row per strategy
        names = list(dict.fromkeys(r["strategy"] for r in kept))
        cell = {(r["strategy"], f"{r['context']}\n{r['budget']:.0%}" if r["budget"] <= 1
                 else f"{r['context']}\n{r['max_kv']}"): r["kept_frac"] for r in kept}
        cols = list(dict.fromkeys(c for _, c in cell))
        save_plot(plot_heatmaps, {"answers kept": cell}, names, cols,
                  rdir.path / "retrieval_kept.png", row_label="strategy",
                  col_label="context (tokens), max_kv", title=f"{args.model}: of the "
                  "prompts the full cache answered, the share each strategy answers too")
