"""Perplexity of quantized H2O caches next to dense H2O (paper decode protocol).

    python scripts/quantized_ppl.py --model smollm2-135m --corpus austen \
        --strategies baseline h2o-heavy h2o-heavy@8 h2o-heavy@4 h2o-heavy@8/4

``NAME@B`` is strategy NAME (see mlx_h2o.eval.strategies) with K/V at B bits;
``NAME@8/4`` is mixed precision (heavy hitters 8, recent window 4). Runs the
eval engineer's ``mlx_h2o.eval.ppl.sweep``, so numbers are comparable with
``mlx-h2o ppl``; prints per-run lines, a table and a final JSON line.
"""

import argparse
import dataclasses
import json
import sys
import time

from mlx_lm.models.cache import QuantizedKVCache

from mlx_h2o.cache import QuantConfig, quantized_cache_type
from mlx_h2o.eval.common import fmt_table, load_any
from mlx_h2o.eval.ppl import compare, sweep
from mlx_h2o.eval.results import machine_info
from mlx_h2o.eval.strategies import Strategy, parse_strategy
from mlx_h2o.integration.factory import make_h2o_cache


@dataclasses.dataclass(frozen=True)
class QuantStrategy(Strategy):
    quant: QuantConfig = dataclasses.field(default_factory=QuantConfig)

    def make_cache(self, model, max_kv):
        cache_type = quantized_cache_type(self.quant)
        return make_h2o_cache(model, self.h2o_config(max_kv), cache_type=cache_type,
                              **self.budget_kwargs(max_kv))

    def describe(self, max_kv):
        d = super().describe(max_kv)
        d.update(
            kv_bits=self.quant.bits,
            kv_group_size=self.quant.group_size,
            kv_recent_bits=self.quant.recent_bits,
        )
        return d


@dataclasses.dataclass(frozen=True)
class MlxLmQuantStrategy(Strategy):
    """mlx-lm's unbounded ``QuantizedKVCache`` (quantization alone, no eviction)."""

    bits: int = 8
    group_size: int = 64

    @property
    def bounded(self) -> bool:
        return True  # compared with the baseline like the other caches

    def make_cache(self, model, max_kv):
        return [QuantizedKVCache(self.group_size, self.bits) for _ in model.layers]

    def describe(self, max_kv):
        return {
            "strategy": self.name,
            "kind": "mlx_lm_quantized",
            "max_kv": None,
            "kv_bits": self.bits,
            "kv_group_size": self.group_size,
        }


def parse(spec: str, group_size: int) -> Strategy:
    base, at, bits = spec.partition("@")
    if base == "kv":  # kv@8: mlx-lm QuantizedKVCache, unbounded
        return MlxLmQuantStrategy(
            spec, "baseline", bits=int(bits), group_size=group_size
        )
    s = parse_strategy(base)
    if not at:
        return s
    hi, _, lo = bits.partition("/")
    quant = QuantConfig(int(hi), group_size, int(lo) if lo else None)
    fields = {f.name: getattr(s, f.name) for f in dataclasses.fields(Strategy)}
    return QuantStrategy(**{**fields, "name": spec}, quant=quant)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--corpus", default="austen")
    p.add_argument("--num-samples", "-n", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--max-kv", type=int, default=256)
    p.add_argument("--prefill", type=int, default=32)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--strategies",
        nargs="+",
        default=[
            "baseline",
            "h2o-heavy",
            "h2o-heavy@8",
            "h2o-heavy@4",
            "h2o-heavy@8/4",
        ],
    )
    args = p.parse_args(argv)
    strategies = [parse(s, args.group_size) for s in args.strategies]
    print("# quantized ppl " + " ".join(f"{k}={v}" for k, v in vars(args).items()))
    print("# " + json.dumps(machine_info()))
    from mlx_h2o.eval.corpora import load_corpus, sample_token_windows

    model, tokenizer = load_any(args.model)
    strategies = [s.calibrated(model, tokenizer) for s in strategies]  # layer budgets
    docs = load_corpus(args.corpus)
    tokens = sample_token_windows(
        tokenizer, docs, args.num_samples, args.seq_len, args.seed
    )
    tic = time.perf_counter()
    rows = sweep(
        model,
        {args.seq_len: tokens},
        strategies,
        [args.max_kv],
        mode="decode",
        prefill=args.prefill,
    )
    cols = (
        "strategy",
        "max_kv",
        "ppl",
        "ppl_se",
        "delta_pct",
        "delta_se_pct",
        "seconds",
    )
    print(fmt_table(rows, cols))
    dense = next((r for r in rows if r["strategy"] == "h2o-heavy"), None)
    if dense is not None:
        for r in rows:
            if "@" not in r["strategy"]:
                continue
            paired = compare(r, dense)  # per-sample paired NLL differences
            r["vs_dense_h2o_pct"] = paired["delta_pct"]
            r["vs_dense_h2o_se_pct"] = paired["delta_se_pct"]
            if "delta_pct" in dense and "delta_pct" in r:
                r["vs_dense_h2o_pp"] = r["delta_pct"] - dense["delta_pct"]
            print(
                f"{r['strategy']}: ppl {paired['delta_pct']:+.3f}% "
                f"(se {paired['delta_se_pct']:.3f}) vs h2o-heavy, "
                f"{r.get('vs_dense_h2o_pp', float('nan')):+.3f} pp of the change vs baseline"
            )
    print(f"# total {time.perf_counter() - tic:.0f}s")
    keep = [{k: v for k, v in r.items() if k != "nll_per_sample"} for r in rows]
    print(json.dumps({"model": args.model, "corpus": args.corpus, "rows": keep}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
