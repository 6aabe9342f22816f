"""Decode-time ranking candidates against the default, under `mlx-h2o ppl`'s protocol.

Each candidate is the default H2O cache (``h2o-heavy``: 4 sinks, half the
budget heavy hitters, the rest a recent window, the shipped layer profile)
with one thing changed: how the heavy-hitter slots are scored or ranked.
Sinks and recent window stay protected, ties evict the older position, and
a 32-token prompt is scored as the default scores it (it never overflows).
Every candidate cache runs the op-by-op decode step (``decode="reference"``,
no score queue) with its own ``fold_ops`` / ``priority``; nothing in the
package is changed. Per KV head, over the query heads of its GQA group:

- ``vatp-l1`` / ``vatp-l2``: value-aware token pruning (Guo et al. 2024,
  "Attention Score is not All You Need for Token Importance Indicator in KV
  Cache Reduction: Value Also Matters"): rank by s * ||v||, s the default's
  accumulated attention (group mean, summed over every query), v the slot's
  value as stored; l1 is the paper's norm, l2 the Euclidean one.
- ``persist-w32`` / ``persist-wr``: persistence of importance over a lagged
  window (Liu et al. 2023, Scissorhands): rank by how many of the last w
  decode steps gave the slot more than the uniform share 1/n of attention
  (n = keys the query saw), averaged over the group's query heads; w = 32,
  or w = the layer's recent window (then every heavy-hitter candidate has
  been seen by all w steps, and counting steps above 1/n orders them as
  Scissorhands' count of steps below it does). A token written into a slot
  starts with an empty history; the prompt's attention does not count.
- ``persist-sum-w32``: the last 32 decode steps' attention summed (a window
  on the accumulated score instead of a count).
- ``keyformer``: Keyformer (Adnan et al. 2024): accumulate, every decode
  step, softmax((logits + g) / tau) with g ~ Gumbel(0, 1) drawn per query
  head, key and step (mx.random, seeded per run), tau rising linearly from
  1 to 2 over the T decoded tokens (tau = 1 + t / T, t = 0..T-1, the paper's
  tau_init = 1, tau_end = 2); ranked by the sum. Prompt: the default's plain
  accumulated attention (Keyformer scores it at tau = 1 with noise).

References on the same windows: ``baseline`` (mlx-lm's KVCache),
``rotating`` (RotatingKVCache, 4 sinks), ``default`` (``h2o-heavy`` as
``mlx-h2o ppl`` runs it: the CPU's compiled step with the score queue) and
``default-ref`` (the same cache through the op-by-op step, no score queue:
what the candidates differ from).

Each (candidate, max_kv) is saved in a results folder named from the
protocol and skipped when found there (keyed by candidate name: remove the
folder after changing a definition). ``--from-ppl`` reads baseline, rotating
and default rows from `mlx-h2o ppl` result files of the same windows.
Prints the per-unit lines, a table and a final JSON line.

Example (the tuning protocol; one results folder, resumable):
    python benchmarks/decode_candidates.py --max-kv-size 256 \
        --candidates baseline rotating default default-ref vatp-l1 keyformer
"""

import argparse
import json
import time
from functools import partial
from pathlib import Path

import mlx.core as mx

from mlx_h2o import policy
from mlx_h2o.cache import H2OKVCache
from mlx_h2o.eval.common import load_any
from mlx_h2o.eval.corpora import load_corpus, sample_token_windows
from mlx_h2o.eval.ppl import compare, decode_nll, ratio_vs, summarize
from mlx_h2o.eval.results import ResultsDir, machine_info
from mlx_h2o.eval.strategies import parse_strategy
from mlx_h2o.integration.factory import make_h2o_cache


def group_columns(x: mx.array, n_kv_heads: int) -> mx.array:
    """(B, Hk, N): a decode call's per-query-head (B, Hq, L, N) values,
    mean over each GQA group, summed over the call's queries."""
    B, Hq, L, N = x.shape
    return x.reshape(B, n_kv_heads, Hq // n_kv_heads, L, N).mean(axis=2).sum(axis=2)


def above_uniform(logits: mx.array, lse: mx.array) -> mx.array:
    """(B, Hq, L, N) 1.0 where a key gets more than 1/n of the query's
    attention, n the keys the query sees (masked logits are -inf)."""
    visible = logits > -mx.inf
    n = mx.maximum(visible.sum(axis=-1, keepdims=True), 1).astype(mx.float32)
    p = mx.exp(logits - lse[..., None])
    return (visible & (p * n > 1.0)).astype(mx.float32)


def gumbel_softmax(logits: mx.array, tau: float) -> mx.array:
    """softmax((logits + g) / tau) over keys, g ~ Gumbel(0, 1) per entry."""
    z = (logits + mx.random.gumbel(logits.shape)) / tau
    return mx.softmax(z, axis=-1, precise=True)  # -inf stays -inf: 0


class CandidateCache(H2OKVCache):
    """The default cache (accumulated attention) on the op-by-op step."""

    def __init__(self, config, window_size=None, decode="reference"):
        super().__init__(config, window_size, decode="reference")

    def set_decode(self, kind="reference", defer=0, group=None):
        super().set_decode("reference", 0, group)  # every step through fold_ops

    def rank_score(self, score: mx.array) -> mx.array:
        return score

    def priority(self, seen):
        n = self.slots_used
        pos = self.positions[..., :n]
        score = self.rank_score(self.score[..., :n])
        pri = policy.slot_priority(self.config, pos, score, self.count[..., :n], seen,
                                   self.window_size)
        return pri, pos


class VATPCache(CandidateCache):
    def __init__(self, config, window_size=None, decode="reference", ord: int = 1):
        super().__init__(config, window_size)
        self.ord = ord

    def rank_score(self, score):
        v = self.kv.values[..., : self.slots_used, :].astype(mx.float32)
        if self.ord == 1:
            norm = mx.abs(v).sum(axis=-1)
        else:
            norm = mx.sqrt((v * v).sum(axis=-1))
        return score * norm  # (B, Hk, n)


class PersistenceCache(CandidateCache):
    def __init__(self, config, window_size=None, decode="reference", w=32,
                 measure="count"):
        super().__init__(config, window_size)
        self.w = config.recent_budget if w == "recent" else int(w)
        self.measure = measure
        self.hist = self.hist_pos = None  # (B, Hk, n, w) last w steps; (B, Hk, n)

    def fold_ops(self, logits, lse):
        n, Hk = self.slots_used, self._positions.shape[1]
        x = above_uniform(logits, lse) if self.measure == "count" else mx.exp(
            logits - lse[..., None])
        step = group_columns(x, Hk)  # (B, Hk, n)
        pos = self.positions[..., :n]
        hist = self._history(pos)
        hist = mx.concatenate([hist[..., 1:], step[..., None]], axis=-1)
        self.hist, self.hist_pos = hist, pos
        seen = group_columns((logits > -mx.inf).astype(mx.float32), Hk)
        self.score[..., :n] = hist.sum(axis=-1)
        self.count[..., :n] = self.count[..., :n] + seen
        self.pending = False

    def _history(self, pos):
        """The held history, grown to the slots in use, emptied where a slot
        holds another token than at the last step."""
        B, Hk, n = pos.shape
        if self.hist is None:
            return mx.zeros((B, Hk, n, self.w), mx.float32)
        hist, old = self.hist, self.hist_pos
        if hist.shape[2] < n:
            grow = n - hist.shape[2]
            hist = mx.pad(hist, [(0, 0), (0, 0), (0, grow), (0, 0)])
            old = mx.pad(old, [(0, 0), (0, 0), (0, grow)], constant_values=policy.EMPTY)
        same = (old[..., :n] == pos)[..., None]
        return mx.where(same, hist[:, :, :n], 0.0)


class KeyformerCache(CandidateCache):
    def __init__(self, config, window_size=None, decode="reference", steps=480,
                 tau_init=1.0, tau_end=2.0):
        super().__init__(config, window_size)
        self.steps, self.tau_init, self.tau_end = steps, tau_init, tau_end
        self.t = 0

    def fold_ops(self, logits, lse):
        n, Hk = self.slots_used, self._positions.shape[1]
        tau = self.tau_init + (self.tau_end - self.tau_init) * self.t / self.steps
        self.t += 1
        step = group_columns(gumbel_softmax(logits, tau), Hk)
        seen = group_columns((logits > -mx.inf).astype(mx.float32), Hk)
        self.score[..., :n] = self.score[..., :n] + step
        self.count[..., :n] = self.count[..., :n] + seen
        self.pending = False


def candidate_types(decoded: int) -> dict:
    return {
        "default-ref": CandidateCache,
        "vatp-l1": partial(VATPCache, ord=1),
        "vatp-l2": partial(VATPCache, ord=2),
        "persist-w32": partial(PersistenceCache, w=32),
        "persist-wr": partial(PersistenceCache, w="recent"),
        "persist-sum-w32": partial(PersistenceCache, w=32, measure="sum"),
        "keyformer": partial(KeyformerCache, steps=decoded),
    }


def make_cache(name, model, default, max_kv, decoded):
    """The prompt cache of candidate ``name`` at ``max_kv``."""
    if name in ("baseline", "rotating", "default"):
        strategy = default if name == "default" else parse_strategy(name)
        return strategy.make_cache(model, max_kv)
    cls = candidate_types(decoded)[name]
    return make_h2o_cache(model, default.h2o_config(max_kv), cls, decode="reference",
                          **default.budget_kwargs(max_kv))


def run_unit(model, tokens, name, default, max_kv, prefill, seed):
    mx.random.seed(seed)
    tic = time.perf_counter()
    cache = make_cache(name, model, default, max_kv, tokens.shape[1] - prefill)
    result = summarize(decode_nll(model, tokens, cache, prefill))
    result.update(name=name, max_kv=max_kv, seconds=time.perf_counter() - tic)
    return result


def table(rows: dict, max_kv: int) -> list:
    """Δ vs baseline, ratio to rotating, and vs the default (paired) per
    candidate: default-ref where it ran, else the package's default."""
    base, rot = rows.get("baseline"), rows.get("rotating")
    ref_name = "default-ref" if "default-ref" in rows else "default"
    ref = rows.get(ref_name)
    out = []
    for name, r in rows.items():
        if name == "baseline" or base is None:
            continue
        line = {"max_kv": max_kv, "name": name, "ppl": r["ppl"], **compare(r, base)}
        if rot is not None and name != "rotating" and len(r["nll_per_sample"]) > 1:
            rv = ratio_vs(r, rot, base)
            line.update(ratio=rv["ratio"], ratio_ci95=rv["ratio_ci95"])
        if ref is not None and name != ref_name:
            vs = compare(r, ref)
            line.update(vs=ref_name, vs_ref=vs["delta_pct"],
                        vs_ref_se=vs["delta_se_pct"])
        line["seconds"] = r["seconds"]
        out.append(line)
    return out


def fmt(line: dict) -> str:
    ci = line.get("ratio_ci95")
    ratio = f"{line['ratio']:.2f} ({ci[0]:.2f}-{ci[1]:.2f})" if ci else ""
    vs = (f"{line['vs_ref']:+.2f}% ± {line['vs_ref_se']:.2f} ({line['vs']})"
          if "vs_ref" in line else "")
    return (f"| {line['max_kv']} | {line['name']} | {line['ppl']:.2f} | "
            f"{line['delta_pct']:+.2f}% ± {line['delta_se_pct']:.2f} | {ratio} | "
            f"{vs} | "
            f"{line['seconds']:.0f} |")


def setup_arg_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--corpus", default="austen")
    p.add_argument("-n", "--num-samples", type=int, default=10)
    p.add_argument("--sequence-length", type=int, default=512)
    p.add_argument("--prefill", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-kv-size", type=int, nargs="+", default=[256])
    p.add_argument("--candidates", nargs="+",
                   default=["baseline", "rotating", "default", "default-ref"])
    p.add_argument("--results-dir", default="runs/decode_candidates")
    p.add_argument("--from-ppl", nargs="+", default=[], metavar="JSON",
                   help="`mlx-h2o ppl` result files on the same windows (baseline, "
                   "rotating, h2o-heavy = default): those rows are read, not run")
    return p


PPL_NAMES = {"baseline": "baseline", "rotating": "rotating", "h2o-heavy": "default"}


def from_ppl(paths, name, max_kv, tokens, config):
    """Row ``name`` at ``max_kv`` from `mlx-h2o ppl` result files whose run
    (config.json beside them) drew the same windows, or None."""
    for path in map(Path, paths):
        r = json.loads(path.read_text())
        if (PPL_NAMES.get(r.get("strategy")) != name
                or r.get("seq_len") != tokens.shape[1]):
            continue
        if name != "baseline" and r.get("max_kv") != max_kv:
            continue
        run = json.loads((path.parent / "config.json").read_text())
        keys = ("model", "corpus", "num_samples", "prefill", "seed")
        same = {k: run.get(k) for k in keys}
        if (r.get("mode") != "decode" or not run.get("bos", True)
                or same != {k: config[k] for k in same}):
            raise SystemExit(f"{path}: another protocol ({run}), not {config}")
        return {**r, "name": name, "max_kv": max_kv, "from": str(path)}
    return None


def check_default(rows):
    """How far the op-by-op step is from the package's step, per window."""
    a, b = rows.get("default-ref"), rows.get("default")
    if a is None or b is None:
        return
    diff = max(abs(x - y) for x, y in zip(a["nll_per_sample"], b["nll_per_sample"]))
    print(f"check=default-ref_vs_default max_kv={a['max_kv']} "
          f"max_abs_window_nll_diff={diff:.2e} ppl={a['ppl']:.4f}/{b['ppl']:.4f}")


def main(argv=None) -> int:
    args = setup_arg_parser().parse_args(argv)
    known = {"baseline", "rotating", "default", *candidate_types(1)}
    for name in args.candidates:
        if name not in known:
            raise SystemExit(f"unknown candidate {name!r}; use one of {sorted(known)}")
    config = {"model": args.model, "corpus": args.corpus,
              "num_samples": args.num_samples,
              "sequence_length": args.sequence_length, "prefill": args.prefill,
              "seed": args.seed}
    rdir = ResultsDir(args.results_dir, "decode_candidates", config,
                      ("model", "corpus"))
    print(f"# decode_candidates results={rdir.path}")
    print("# " + " ".join(f"{k}={v}" for k, v in config.items())
          + f" max_kv={args.max_kv_size} candidates={args.candidates}")
    print(f"# machine: {json.dumps(machine_info())}")
    model, tokenizer = load_any(args.model)
    default = parse_strategy("h2o-heavy").calibrated(model, tokenizer)
    tokens = sample_token_windows(tokenizer, load_corpus(args.corpus), args.num_samples,
                                  args.sequence_length, args.seed, bos=True)
    lines = []
    for max_kv in args.max_kv_size:
        rows = {}
        for name in args.candidates:
            kv = None if name == "baseline" else max_kv
            key = f"{name}-kv{kv}" if kv else name
            r = rdir.load(key)
            if r is None:
                r = from_ppl(args.from_ppl, name, kv, tokens, config)
            if r is None:
                r = run_unit(model, tokens, name, default, kv or args.sequence_length,
                             args.prefill, args.seed)
                rdir.save(key, r)
            rows[name] = r
            print(f"name={name} max_kv={kv} ppl={r['ppl']:.4f} nll={r['nll']:.5f} "
                  f"seconds={r['seconds']:.1f}"
                  + (f" from={r['from']}" if "from" in r else ""), flush=True)
        check_default(rows)
        lines += table(rows, max_kv)
    print("\n| max_kv | candidate | PPL | Δ vs baseline | ratio to rotating (95%) "
          "| vs default (paired) | s |\n|---|---|---|---|---|---|---|")
    for line in lines:
        print(fmt(line))
    print(json.dumps({"results": str(rdir.path), "config": config, "rows": lines}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
