"""Decode tok/s under tensor parallelism: KVCache vs H2O, every rank sharded.

    mlx.launch --backend nccl --hosts 127.0.0.1 -n 2 --python $PWD/.venv/bin/python \\
        $PWD/benchmarks/distributed_decode.py [--shape qwen3-8b] [--bits 4]
        [--contexts 4096:256 16384:1024] [--rounds 6] [--steps 32] [--strategies ...]

Strategies (``--strategies``, default all):
  kvcache      mlx-lm's KVCache (everything kept)
  h2o          H2O(budget, heavy = budget / 2), evicting every decode step
  h2o_batch64  the same with ``evict_batch=64`` (appends between batch evictions)

A random-weight model with the shapes of ``--shape`` (mlx_h2o.eval.bench's
RANDOM_CONFIGS; ``tiny`` for a CPU smoke run), quantized to ``--bits``, is
sharded over the ranks with mlx-lm's ``model.shard`` (each rank: whole KV
heads and their query heads; the same seed gives every rank the same weights).
Per context:budget pair each strategy is prefilled once (512-token chunks of
the same tokens on every rank), then decoded round-robin as mlx-lm's
generate_step does (benchmarks/decode_matrix.py's ``generate_split``: build,
dispatch, wait, wall, CPU ms per token); each round starts one strategy later
and every turn begins at a barrier. Rank 0's times are printed: ranks decode
in lockstep (two all_sums per layer). ``gb_s`` is what a token reads on one
rank (its weights and its K/V) over its wall time. Prints a config header, a
line per round and strategy, medians with paired tok/s ratios vs KVCache, and
a final JSON line. In one process (no mlx.launch) nothing is sharded.
"""

import argparse
import gc
import json
import os
import statistics
import sys
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3
from mlx_lm.models.cache import KVCache

sys.path.insert(0, os.path.dirname(__file__))

from decode_matrix import generate_split  # noqa: E402  (benchmarks/, beside this file)

import mlx_h2o  # noqa: E402
from mlx_h2o import H2OConfig, make_h2o_cache  # noqa: E402
from mlx_h2o.eval.bench import RANDOM_CONFIGS, random_model  # noqa: E402
from mlx_h2o.integration.distributed import collective_stream  # noqa: E402

STRATEGIES = ("kvcache", "h2o", "h2o_batch64")
TINY = dict(model_type="qwen3", hidden_size=128, num_hidden_layers=4, intermediate_size=256,
            num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=1024,
            rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
            tie_word_embeddings=False)


def build_model(shape: str, bits: int, dtype, group):
    """The random model of ``shape`` (the same seed on every rank), this rank's shard."""
    if shape == "tiny":
        mx.random.seed(0)
        model = qwen3.Model(qwen3.ModelArgs.from_dict(TINY))
        model.set_dtype(dtype)
        if bits:
            nn.quantize(model, bits=bits)
    else:
        model = random_model(shape, bits=bits, dtype=dtype)
    if group.size() > 1:
        model.shard(group)
        mx.eval(model.parameters())
    return model


def strategies(model, budget: int) -> dict:
    n = len(model.layers)
    cfg = H2OConfig(max_size=budget, heavy_budget=budget // 2)
    return {
        "kvcache": lambda: [KVCache() for _ in range(n)],
        "h2o": lambda: make_h2o_cache(model, cfg, layer_budget="uniform"),
        "h2o_batch64": lambda: make_h2o_cache(model, replace(cfg, evict_batch=64),
                                              layer_budget="uniform"),
    }


def barrier(group) -> None:
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=collective_stream()))


def prefill(model, cache, context: int, vocab: int):
    """``context`` tokens (the same on every rank) in 512-token chunks, then 3
    warm-up decode steps; the next input token."""
    with mlx_h2o.patch():
        for s in range(0, context, 512):
            n = min(512, context - s)
            chunk = mx.random.randint(0, vocab, (1, n), key=mx.random.key(s))  # (B, L)
            mx.eval(model(chunk, cache=cache))
        y = mx.array([[1]])
        for _ in range(3):
            y = model(y, cache=cache)[:, -1:].argmax(-1)
            mx.eval(y)
        mx.eval([c.state for c in cache])  # the warm-up's queued scores folded
    return y


def run_pair(model, args, context: int, budget: int, weight_bytes: int, group) -> dict:
    made = {k: v for k, v in strategies(model, budget).items() if k in args.strategies}
    vocab = model.args.vocab_size
    state = {name: [make(), None] for name, make in made.items()}
    for st in state.values():
        st[1] = prefill(model, st[0], context, vocab)
    rows = {name: [] for name in made}
    order = list(made)
    for r in range(args.rounds):
        for name in order[r % len(order):] + order[: r % len(order)]:
            cache, y = state[name]
            gc.collect()
            barrier(group)
            y, row = generate_split(model, cache, y, args.steps)
            kv = sum(c.nbytes for c in cache)
            row.update(tok_s=1e3 / row["wall"], gb_s=(weight_bytes + kv) / row["wall"] / 1e6,
                       kv_mb=kv / 2**20)
            state[name][1] = y
            rows[name].append(row)
            if group.rank() == 0:
                print(f"round={r} context={context} budget={budget} strategy={name} "
                      + " ".join(f"{k}={v:.3f}" for k, v in row.items()), flush=True)
    return rows


def summary(rows: dict, context: int, budget: int) -> None:
    print(f"context={context} budget={budget}: medians, paired tok/s ratio vs kvcache")
    for name, rs in rows.items():
        med = {k: statistics.median(x[k] for x in rs) for k in ("tok_s", "wall", "gb_s")}
        line = " ".join(f"{k}={v:.3f}" for k, v in med.items())
        if "kvcache" in rows and name != "kvcache":
            ratio = statistics.median(
                k["wall"] / x["wall"] for k, x in zip(rows["kvcache"], rs))
            line += f" vs_kvcache={ratio:.3f}"
        print(f"  {name:>12}: {line}", flush=True)


def pairs(values) -> list:
    out = []
    for v in values:
        context, _, budget = v.partition(":")
        if not (context.isdigit() and budget.isdigit()):
            raise argparse.ArgumentTypeError(f"{v!r}: use CONTEXT:BUDGET, e.g. 4096:256")
        out.append((int(context), int(budget)))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-8b", choices=[*RANDOM_CONFIGS, "tiny"],
                   help="model shapes (random weights); tiny: a CPU smoke run")
    p.add_argument("--bits", type=int, default=4, choices=(0, 4, 8),
                   help="weight quantization (0: none)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--contexts", nargs="+", default=["4096:256", "16384:1024"],
                   metavar="CONTEXT:BUDGET")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=32, help="decode steps per round")
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    args = p.parse_args(argv)
    try:
        args.pairs = pairs(args.contexts)
    except argparse.ArgumentTypeError as e:
        p.error(f"--contexts {e}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    group = mx.distributed.init()
    shape = TINY if args.shape == "tiny" else RANDOM_CONFIGS[args.shape]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    if kv_heads % group.size() or heads % group.size():
        if group.rank() == 0:
            print(f"error: {args.shape} has {kv_heads} KV heads ({heads} query heads), "
                  f"which do not divide over {group.size()} ranks", file=sys.stderr)
        return 2
    model = build_model(args.shape, args.bits, getattr(mx, args.dtype), group)
    weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    if group.rank() == 0:
        print(f"mlx={mx.__version__} device={mx.default_device()} ranks={group.size()} "
              f"model={args.shape} shapes, random, bits={args.bits} dtype={args.dtype} "
              f"kv_heads_per_rank={kv_heads // group.size()} "
              f"weights_per_rank_gb={weight_bytes / 1e9:.2f} contexts={args.contexts} "
              f"rounds={args.rounds} steps={args.steps}", flush=True)
    results = []
    for context, budget in args.pairs:
        rows = run_pair(model, args, context, budget, weight_bytes, group)
        if group.rank() == 0:
            summary(rows, context, budget)
        results.append({"context": context, "budget": budget, "rows": rows})
    if group.rank() == 0:
        print(json.dumps({"ranks": group.size(), "model": args.shape, "bits": args.bits,
                          "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
