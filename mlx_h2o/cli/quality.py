"""`mlx-h2o quality`: perplexity of cache strategies on a named set (tuning or evaluation).

Example (the set defaults are never tuned on; every packaged model):
    mlx-h2o quality --set evaluation --strategies baseline rotating h2o-heavy
A small run (one model, one corpus, 2 windows of 128 tokens at a 64-token budget):
    mlx-h2o quality --models smollm2-135m --corpora sharegpt -n 2 \
        --sequence-length 128 --max-kv-size 64
Each (model, corpus, seed) is one `mlx-h2o ppl` run with the set's protocol (or
the one these flags change) and shares its results folder (finished units are
skipped). Prints, per model and
corpus and pooled over the corpora, each strategy's PPL change against the
baseline (paired standard error) and its ratio to the reference strategy's
change (delta-method se, bootstrap 95% interval); the target ratio is 1/3.
"""

import dataclasses
import json
import time

from ..eval.evalsets import EVAL_SETS, eval_set, pooled
from ..eval.results import machine_info
from .common import (
    add_output_args,
    check_budgets,
    command_parser,
    ensure_corpus_or_fail,
    fail,
    load_model_or_fail,
    strategies_or_fail,
)

COLUMNS = ("model", "corpus", "strategy", "ppl", "delta_pct", "delta_se_pct", "ratio",
           "ratio_se", "ratio_ci95")


def setup_arg_parser():
    p = command_parser("quality", __doc__)
    p.add_argument("--set", default="evaluation", choices=tuple(EVAL_SETS),
                   help="named set (mlx_h2o/eval/evalsets.py)")
    p.add_argument("--models", nargs="+", default=None,
                   help="subset of the set's models (default: all of them)")
    p.add_argument("--corpora", nargs="+", default=None,
                   help="subset of the set's corpora (default: all of them)")
    p.add_argument("--strategies", nargs="+", default=["baseline", "rotating", "h2o-heavy"],
                   help="names from mlx_h2o.eval.strategies; the first must be baseline")
    p.add_argument("--reference", default="rotating",
                   help="the strategy whose PPL change the others are divided by")
    p.add_argument("--num-samples", "-n", type=int, default=None,
                   help="token windows per corpus and seed (default: the set's, 10; "
                   "at least 2, for paired standard errors)")
    p.add_argument("--sequence-length", type=int, default=None,
                   help="tokens per window (default: the set's, 512)")
    p.add_argument("--max-kv-size", type=int, default=None,
                   help="KV budget in tokens a layer, below --sequence-length "
                   "(default: the set's, 256)")
    add_output_args(p)
    return p


def _protocol(parser, args, es):
    """The set with the windows and budget the flags ask for; what cannot run
    (too few windows, a budget that never evicts) ends the command."""
    changes = {k: v for k, v in (("num_samples", args.num_samples),
                                 ("seq_len", args.sequence_length),
                                 ("max_kv", args.max_kv_size)) if v is not None}
    try:
        es = dataclasses.replace(es, **changes)
    except ValueError as e:
        fail(parser, f"--num-samples {args.num_samples}: {e}")
    if es.seq_len <= es.prefill:
        fail(parser, f"--sequence-length {es.seq_len}: a window needs more than the "
             f"set's {es.prefill}-token prefill")
    if es.max_kv >= es.seq_len:
        fail(parser, f"--max-kv-size {es.max_kv}: no strategy evicts in a window of "
             f"--sequence-length {es.seq_len}; use a budget below it")
    return es


def _subset(parser, asked, allowed, what):
    if asked is None:
        return list(allowed)
    bad = [a for a in asked if a not in allowed]
    if bad:
        fail(parser, f"{what} {bad} not in the set: use some of {list(allowed)}")
    return asked


def _run_one(es, model, tokenizer, strategies, name, corpus, seed, args):
    """One `mlx-h2o ppl` unit set: rows of every strategy (nll per window kept)."""
    from ..eval.ppl import sweep
    from ..eval.results import ResultsDir
    from . import ppl as ppl_cli

    argv = es.ppl_args(name, corpus, seed) + ["--results-dir", args.results_dir]
    a = ppl_cli.setup_arg_parser().parse_args(argv)
    rdir = ResultsDir(a.results_dir, "ppl", ppl_cli.run_config(a), ("model", "corpus", "mode"))
    print(f"# {name} {corpus} seed={seed}  results={rdir.path}", flush=True)
    data = ppl_cli.load_data(tokenizer, a)
    return sweep(model, data, strategies, a.max_kv_size, rdir, mode="decode",
                 prefill=a.prefill, show=not args.no_progress)


def summarize(rows_by_corpus: dict, reference: str) -> list[dict]:
    """Table rows: each corpus, then ``pooled`` over the corpora (per model)."""
    from ..eval.ppl import compare, ratio_vs

    out = []
    groups = dict(rows_by_corpus)
    strategies = [r["strategy"] for r in next(iter(groups.values()))]
    groups["pooled"] = [pooled([rows[i] for rows in rows_by_corpus.values()])
                        for i in range(len(strategies))]
    for corpus, rows in groups.items():
        by = {r["strategy"]: r for r in rows}
        base, ref = by[strategies[0]], by.get(reference)
        for r in rows[1:]:
            row = {"corpus": corpus, "strategy": r["strategy"], "ppl": r.get("ppl")}
            row.update(compare(r, base))
            if ref is not None and r is not ref:
                ratio = ratio_vs(r, ref, base)
                row.update(ratio=ratio["ratio"], ratio_se=ratio["ratio_se"],
                           ratio_ci95=[round(x, 3) for x in ratio["ratio_ci95"]])
            out.append(row)
    return out


def main(argv=None) -> int:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    es = _protocol(parser, args, eval_set(args.set))
    models = _subset(parser, args.models, es.models, "models")
    corpora = _subset(parser, args.corpora, es.corpora, "corpora")
    specs = strategies_or_fail(parser, args.strategies)
    if specs[0].bounded:
        fail(parser, "--strategies: the first must be baseline (the unbounded reference)")
    check_budgets(parser, specs, [es.max_kv])
    for corpus in corpora:
        ensure_corpus_or_fail(parser, corpus, "--corpora")
    print(f"# mlx-h2o quality  set={es.name} models={models} corpora={corpora} "
          f"seeds={list(es.seeds)} n={es.num_samples} seq_len={es.seq_len} "
          f"prefill={es.prefill} max_kv={es.max_kv}", flush=True)
    tic, table = time.perf_counter(), []
    from ..eval.common import fmt_table

    for name in models:
        model, tokenizer = load_model_or_fail(parser, name, "--models")
        strategies = [s.calibrated(model, tokenizer) for s in specs]
        by_corpus = {}
        for corpus in corpora:
            rows = []
            for seed in es.seeds:  # several seeds: more windows of one corpus
                part = _run_one(es, model, tokenizer, strategies, name, corpus, seed, args)
                rows = part if not rows else [pooled([a, b]) | {"ppl": None}
                                              for a, b in zip(rows, part)]
            by_corpus[corpus] = rows
        table += [{"model": name} | r for r in summarize(by_corpus, args.reference)]
    print()
    print(fmt_table(table, COLUMNS))
    print(json.dumps({"set": es.name, "machine": machine_info(),
                      "seconds": time.perf_counter() - tic, "rows": table}))
    return 0
