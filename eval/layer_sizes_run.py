"""Exploratory per-layer allocations (docs/RESULTS.md item 9), saved beside the
SmolLM2 decode screen of the same seed (results/ppl/<dir>, same keys as the CLI).

    python eval/layer_sizes_run.py <seed> l012 invtopk

``l012``: layers 0-2 at 2.25x the others' size (512 vs 227-228 at max_kv 256);
``invtopk``: weights = top-10% share (now also ``layer_budget=invtopk``).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mlx_h2o.cli.ppl import setup_arg_parser, run_config, load_data
from mlx_h2o.eval.common import load_any
from mlx_h2o.eval.results import ResultsDir, DEFAULT_ROOT
from mlx_h2o.eval.strategies import Strategy, parse_strategy
from mlx_h2o.eval.calibrate import layer_weights
from mlx_h2o.eval.ppl import sweep
from mlx_h2o.profiles import LayerProfile
args = setup_arg_parser().parse_args(["--model", "smollm2-135m", "--corpus", "austen", "-n", "30",
    "--seq-len", "512", "--max-kv", "256", "--seed", sys.argv[1]])
rdir = ResultsDir(DEFAULT_ROOT, "ppl", run_config(args), ("model", "corpus", "mode"))
model, tok = load_any(args.model)
data = load_data(tok, args)
base = parse_strategy("h2o-heavy:layer_budget=uniform")  # the default of item 9
def mk(name, w):
    stat = name.split("=")[1]
    profile = LayerProfile(statistic=stat, weights=tuple(w), attention_layers=30,
                           windows=(None,) * 30, source=stat)
    return Strategy(name, "h2o", sink=4, heavy=0.5, layer_budget=stat, profile=profile,
                    layer_windows=(None,) * 30)
topk = layer_weights(model, tok, "topk")
cands = {
    "l012": mk("h2o-heavy:layer_budget=l012", [2.25] * 3 + [1.0] * 27),
    "invtopk": mk("h2o-heavy:layer_budget=invtopk", [round(1 - w, 6) for w in topk]),
}
chosen = [cands[k] for k in sys.argv[2:]]
for s in chosen:
    print(s.name, s.layer_sizes(256))
rows = sweep(model, data, [parse_strategy("baseline"), base] + chosen, [256], rdir,
             mode="decode", prefill=32)
for r in rows:
    print(r["strategy"], r["ppl"], r.get("delta_pct"), r.get("delta_se_pct"))
