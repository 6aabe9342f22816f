"""Write the Swift parity vectors (swift/Tests/Vectors/*.json) from the Python cache.

Each stream drives the real ``H2OKVCache`` (prefill chunks, decode steps,
trims) whose storage attends with scripted logits instead of q.k, so the
vectors pin the H2O bookkeeping and policy, not a matmul. Logits are multiples
of 1/16 (exact in float32 and in JSON); lse is computed in float64 and
rounded once to float32. Every recorded step holds its inputs (masked logits,
lse) and the expected state after it (offset, evicted, slot positions, scores,
counts, victim slots). ``H2OSlots`` in swift/Sources/H2OCore replays them.

Decisions must not hinge on float rounding: the script fails if an eviction
boundary (victim vs runner-up, last kept vs first dropped) has two finite
priorities closer than 1e-4 relative, unless the stream is built for exact
ties (constant logits, where every candidate's score is bit-identical).

Usage: python tools/make_swift_vectors.py [--out swift/Tests/Vectors]
"""

import argparse
import functools
import json
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import mlx.core as mx
import numpy as np

from mlx_h2o import policy
from mlx_h2o.cache import H2OKVCache, QuantConfig, QuantizedH2OKVCache
from mlx_h2o.cache.chunk import selected_columns
from mlx_h2o.cache.quantized_storage import QuantizedKV
from mlx_h2o.cache.storage import DenseKV
from mlx_h2o.config import H2OConfig, config_from_dict, config_to_dict
from mlx_h2o.kernels.reference import grouped_mask

FORMAT = "mlx-h2o-swift-vectors/1"
OUT = os.path.join(os.path.dirname(__file__), "..", "swift", "Tests", "Vectors")
MARGIN = 1e-4
D = 32  # head dim of the dummy keys/values (one quantization group); logits ignore them


def f32(x) -> float:
    """A float32 as the Python float of its shortest decimal (short, exact JSON)."""
    return float(str(np.float32(x)))


def f32_list(a) -> list:
    return [None if np.isneginf(x) else f32(x) for x in np.asarray(a).reshape(-1)]


class ScriptedAttention:
    """Storage mixin whose attention returns ``next_logits`` (masked) and their lse."""

    next_logits: Optional[np.ndarray] = None  # (B, n_heads, L, N) float32, unmasked
    last: Optional[Tuple[np.ndarray, np.ndarray]] = None  # masked logits, lse

    def attention(self, queries, keys, values, *, scale, mask, sinks):
        B, Hq, L, _ = queries.shape
        packed = keys[0] if isinstance(keys, tuple) else keys  # quantized: a triple
        Hk, N = packed.shape[1], packed.shape[2]
        raw = self.next_logits
        assert raw is not None and raw.shape == (B, Hq, L, N), (raw.shape, queries.shape)
        m = grouped_mask(mask, B, Hq, Hk, L, N)
        if m is not None:
            m = np.broadcast_to(np.array(m), (B, Hk, Hq // Hk, L, N)).reshape(raw.shape)
            raw = np.where(m, raw, -np.inf).astype(np.float32)
        wide = raw.astype(np.float64)
        top = wide.max(axis=-1, keepdims=True)
        lse = (np.log(np.exp(wide - top).sum(axis=-1)) + top[..., 0]).astype(np.float32)
        self.last, self.next_logits = (raw, lse), None
        out = mx.zeros(queries.shape, queries.dtype)  # unused: only the scores matter
        return out, mx.array(raw), mx.array(lse)

    def column_attention(self, queries, keys, values, *, scale, mask, sinks, weights):
        """A chunk's columns, from the scripted logits."""
        out, logits, lse = self.attention(queries, keys, values, scale=scale, mask=mask,
                                          sinks=sinks)
        packed = keys[0] if isinstance(keys, tuple) else keys  # quantized: a triple
        return (out, *scripted_columns(logits, lse, weights, packed.shape[1]))


def scripted_columns(logits, lse, weights, n_kv_heads: int):
    """(probs, seen) of scripted logits (B, n_heads, L, N), as
    attention_with_column_sums sums them (queries of weight 0 left out)."""
    B, _, L, _ = logits.shape
    select = mx.ones((B, L), mx.bool_) if weights is None else weights > 0
    return selected_columns("accumulated", logits, lse, select, n_kv_heads)


class ScriptedKV(ScriptedAttention, DenseKV):
    pass


class ScriptedQuantizedKV(ScriptedAttention, QuantizedKV):
    pass


class Scripted:
    """Cache mixin: every attention call goes through the storage's (scripted)
    attention: the reference decode step, no score queue, and chunks past the
    budget scored in full rather than by MLX's SDPA plus their window."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.set_decode("reference", defer=0)

    def _scored_by_window(self, L) -> bool:
        return False


class ScriptedH2OKVCache(Scripted, H2OKVCache):
    storage_cls = ScriptedKV


class ScriptedQuantizedH2OKVCache(Scripted, QuantizedH2OKVCache):
    def _make_storage(self):
        return ScriptedQuantizedKV(self.quant.bits, self.quant.group_size)


def make_cache(s: "Stream"):
    if s.quant is None:
        return ScriptedH2OKVCache(s.config, window_size=s.window_size)
    return ScriptedQuantizedH2OKVCache(s.config, s.window_size, QuantConfig(**s.quant))


@dataclass
class Stream:
    name: str
    config: H2OConfig
    schedule: tuple  # ints: update lengths; ("trim", n)
    batch: int = 1
    n_heads: int = 2
    n_kv_heads: int = 1
    window_size: Optional[int] = None
    seed: int = 0
    constant: Optional[float] = None  # every logit equal: exact ties by design
    quant: Optional[dict] = None  # QuantConfig fields: a QuantizedH2OKVCache
    replay: Optional[list] = None  # recorded steps to feed back instead of random logits

    @property
    def ties_ok(self) -> bool:
        return self.constant is not None or self.replay is not None

    @classmethod
    def from_document(cls, doc: dict) -> "Stream":
        """The stream a vector file records, replaying its logits."""
        schedule = tuple(
            ("trim", st["n"]) if st["op"] == "trim" else st["length"] for st in doc["steps"]
        )
        return cls(
            doc["name"], config_from_dict(doc["config"]), schedule, doc["batch_size"],
            doc["n_heads"], doc["n_kv_heads"], doc["window_size"], quant=doc["quant"],
            replay=doc["steps"],
        )

    def logits(self, rng, step: int, shape) -> np.ndarray:
        if self.replay is not None:
            flat = [-np.inf if x is None else x for x in self.replay[step]["logits"]]
            return np.array(flat, np.float32).reshape(shape)
        if self.constant is not None:
            return np.full(shape, self.constant, np.float32)
        return (rng.integers(-64, 64, size=shape) / 16.0).astype(np.float32)


def priorities(cache, offset):
    """(B, Hk, n) eviction priorities through the public policy functions."""
    cfg, n = cache.config, cache.size()
    pos = cache.positions[..., :n]
    keep = policy.protected(pos, offset, cfg.sink_size, cfg.recent_budget, cfg.pinned)
    score = policy.eviction_score(cfg.score, cache.score[..., :n], cache.count[..., :n])
    return np.array(policy.priority(score, keep, pos, offset, cache.window_size))


def check_boundary(pri, k, ties_ok, where):
    """The k-th and (k+1)-th lowest priorities of every row must be far apart."""
    rows = np.sort(pri.reshape(-1, pri.shape[-1]), axis=-1)
    for lo, hi in rows[:, k - 1 : k + 1]:
        if not (np.isfinite(lo) and np.isfinite(hi)) or (lo == hi and ties_ok):
            continue
        if hi - lo <= MARGIN * max(abs(lo), abs(hi), 1e-3):
            raise ValueError(f"{where}: near tie {lo!r} vs {hi!r}; change the seed")


def check_trim_boundary(cache, n, ties_ok, where):
    """A trim past evicted tokens keeps each row's best held slots below the
    cut, as many as the fewest any row holds: that choice must not be a near tie."""
    cut = cache.offset - min(n, cache.offset)
    if not cache.evicted or n <= 0:
        return
    pos = np.array(cache.positions[..., : cache.size()]).reshape(-1, cache.size())
    pri = np.array(policy.sinks_first(mx.array(priorities(cache, cut)), cache.positions[
        ..., : cache.size()], cache.config.sink_size)).reshape(pos.shape)
    held = [p[q < cut] for p, q in zip(pri, pos)]
    k = min(len(h) for h in held)
    for h in held:
        if 0 < k < len(h):
            lo, hi = np.sort(h)[len(h) - k - 1 : len(h) - k + 1]
            if np.isinf(lo) or hi >= np.finfo(np.float32).max or (lo == hi and ties_ok):
                continue
            if hi - lo <= MARGIN * max(abs(lo), abs(hi), 1e-3):
                raise ValueError(f"{where}: near tie {lo!r} vs {hi!r} in a trim; change the seed")


def state(cache, **extra):
    n = cache.size()
    record = {
        "offset": cache.offset,
        "evicted": cache.evicted,
        "size": n,
        "capacity": cache.kv.capacity,
        "positions": np.array(cache.positions[..., :n]).tolist(),
        "score": f32_list(cache.score[..., :n]),
        "count": f32_list(cache.count[..., :n]),
    }
    record.update(extra)
    return record


def run_update(cache, s: Stream, rng, L, i, where):
    B, Hq, Hk = s.batch, s.n_heads, s.n_kv_heads
    n, cfg = cache.size(), cache.config
    victim_step = L == 1 and n >= cfg.max_size
    if victim_step:
        check_boundary(priorities(cache, cache.offset + 1), 1, s.ties_ok, where)
        before = np.array(cache.positions[..., :n])
    mask = cache.make_mask(L)
    zeros = mx.zeros((B, Hk, L, D))
    keys, values = cache.update_and_fetch(zeros, zeros)
    N = cache.size()
    cache.kv.next_logits = s.logits(rng, i, (B, Hq, L, N))
    victims = evicted_positions = None
    if victim_step:
        after = np.array(cache.positions[..., :n])
        victims = np.argmax(after != before, axis=-1).tolist()  # (B, Hk)
        evicted_positions = np.take_along_axis(
            before, np.array(victims)[..., None], axis=-1
        )[..., 0].tolist()
    pre = (cache.score[..., :N], cache.count[..., :N], cache.positions[..., :N])
    cache.h2o_attention(mx.zeros((B, Hq, L, D)), keys, values, scale=1.0, mask=mask)
    logits, lse = cache.kv.last
    if N > cfg.max_size:  # compaction: re-fold to see the priorities it used
        if policy.window_replaces(cfg, L, N - L):  # the window alone decides
            pre = (mx.zeros_like(pre[0]), mx.zeros_like(pre[1]), pre[2])
        sc, ct = policy.fold_scores(
            cfg.score, pre[0], pre[1], mx.array(logits), mx.array(lse), cfg.ema_alpha,
            cfg.prefill_window, pre[2], cfg.prefill_pool,
        )
        keep = policy.protected(
            pre[2], cache.offset, cfg.sink_size, cfg.recent_budget, cfg.pinned
        )
        pri = policy.priority(
            policy.eviction_score(cfg.score, sc, ct), keep, pre[2], cache.offset,
            cache.window_size,
        )
        check_boundary(np.array(pri), N - cfg.max_size, s.ties_ok, where)
    return {
        "op": "update",
        "length": L,
        "logits": f32_list(logits),
        "lse": f32_list(lse),
        "expect": state(cache, victims=victims, evicted_positions=evicted_positions),
    }


def run_stream(s: Stream) -> dict:
    rng = np.random.default_rng(s.seed)
    cache = make_cache(s)
    steps = []
    for i, item in enumerate(s.schedule):
        where = f"{s.name} step {i}"
        if isinstance(item, tuple):
            check_trim_boundary(cache, item[1], s.ties_ok, where)
            trimmed = cache.trim(item[1])
            steps.append({"op": "trim", "n": item[1], "expect": state(cache, trimmed=trimmed)})
        else:
            steps.append(run_update(cache, s, rng, item, i, where))
    return {
        "format": FORMAT,
        "name": s.name,
        "config": config_to_dict(s.config),
        "window_size": s.window_size,
        "quant": s.quant,
        "batch_size": s.batch,
        "n_heads": s.n_heads,
        "n_kv_heads": s.n_kv_heads,
        "steps": steps,
    }


def streams():
    # Streams pin the scoring they were written for, whatever the library
    # defaults, and the Swift port's prompt rule ("chunk": it runs no preview).
    C = functools.partial(H2OConfig, score="ema", prefill_window=0, prefill_pool=0,
                          prefill_compact="chunk")
    decode = lambda k: (1,) * k
    return [
        Stream(
            "ema_gqa_b2", C(max_size=8, sink_size=1, recent_budget=3, step=4),
            (5, *decode(12), 3, *decode(4), ("trim", 2), *decode(3)),
            batch=2, n_heads=4, n_kv_heads=2, seed=1,
        ),
        Stream(
            "accumulated_prefill_overflow",
            C(max_size=8, sink_size=2, heavy_budget=3, score="accumulated"),
            (13, *decode(10), 6, *decode(3)), n_heads=2, seed=2,
        ),
        Stream(
            "normalized_pinned_b2",
            C(max_size=9, sink_size=1, recent_budget=3, score="normalized",
              pinned=((3, 5),), step=4),
            (7, *decode(14), ("trim", 5), *decode(4)),
            batch=2, n_heads=2, n_kv_heads=2, seed=3,
        ),
        Stream(
            "ema_window_layer", C(max_size=8, sink_size=2, recent_budget=3, step=4),
            (6, *decode(6), 5, *decode(8)), n_heads=4, n_kv_heads=2,
            window_size=6, seed=4,
        ),
        Stream(
            "ema_constant_ties", C(max_size=6, sink_size=1, recent_budget=2, step=2),
            (4, *decode(8), 3, *decode(3)), n_heads=2, constant=1.0,
        ),
        Stream(
            "attention_ema_prefill_window",
            C(max_size=8, sink_size=1, recent_budget=3, score="attention_ema",
              prefill_window=3, step=4),
            (12, *decode(6), 5, *decode(3)), batch=2, n_heads=4, n_kv_heads=2, seed=7,
        ),
        Stream(
            "accumulated_prefill_pool",
            C(max_size=10, sink_size=1, recent_budget=3, score="accumulated",
              prefill_pool=3, step=4),
            (14, *decode(5), 6, *decode(4), 4), n_heads=2, seed=8,
        ),
        Stream(
            # A chunk that fits is scored by all its queries; only one that
            # overflows the budget is scored by its last prefill_window.
            "prefill_window_fitting_chunk",
            C(max_size=12, sink_size=1, recent_budget=3, score="accumulated",
              prefill_window=3, prefill_pool=3, step=4),
            (6, *decode(3), 6, *decode(4)), n_heads=2, seed=9,
        ),
        Stream(
            # A later chunk that overflows a full cache: one shorter than
            # prefill_window adds to the scores, one of L >= prefill_window
            # replaces them with its window's (policy.window_replaces).
            "accumulated_window_replaces",
            C(max_size=6, sink_size=1, recent_budget=2, score="accumulated",
              prefill_window=3, step=4),
            (8, *decode(2), 2, *decode(1), 4, 3, *decode(2)), n_heads=2, seed=11,
        ),
        Stream(
            "quantized_8bit_gqa", C(max_size=8, sink_size=1, recent_budget=3, step=4),
            (9, *decode(6), 4, ("trim", 2), *decode(3)), n_heads=4, n_kv_heads=2,
            quant=dict(bits=8, group_size=32), seed=6,
        ),
        Stream(
            # TOVA: the last call's attention alone ranks the slots.
            "tova_prefill_overflow",
            C(max_size=8, sink_size=1, recent_budget=3, score="tova", step=4),
            (10, *decode(6), 3, *decode(2)), n_heads=2, seed=10,
        ),
        Stream(
            "trim_before_eviction", C(max_size=8, sink_size=1, recent_budget=3, step=4),
            (5, ("trim", 3), 2, ("trim", 10), 6, *decode(5), ("trim", 9), *decode(2)),
            n_heads=2, seed=5,
        ),
    ]


CONFIG_CASES = [
    dict(max_size=8),
    dict(max_size=9, sink_size=2),
    dict(max_size=8, heavy_budget=5),
    dict(max_size=8, recent_budget=2),
    dict(max_size=8, sink_size=0, heavy_budget=0),
    dict(max_size=8, pinned=[[6, 7], [1, 3]], score="normalized"),
    dict(max_size=12, sink_size=1, recent_budget=3, pinned=[[6, 7], [1, 3]], ema_alpha=0.5),
    dict(max_size=0),
    dict(max_size=8, sink_size=-1),
    dict(max_size=8, step=0),
    dict(max_size=8, prefill_window=-1),
    dict(max_size=8, prefill_window=16, score="attention_ema"),
    dict(max_size=8, prefill_pool=-2),
    dict(max_size=8, prefill_pool=5, prefill_window=4),
    dict(max_size=4, sink_size=4),
    dict(max_size=8, heavy_budget=-1),
    dict(max_size=8, heavy_budget=2, recent_budget=2),
    dict(max_size=8, heavy_budget=7),
    dict(max_size=8, score="sum"),
    dict(max_size=8, ema_alpha=1.0),
    dict(max_size=8, ema_alpha=0.0),
    dict(max_size=8, pinned=[[3, 3]]),
    dict(max_size=8, pinned=[[-1, 2]]),
    dict(max_size=8, pinned=[[1, 4], [3, 5]]),
    dict(max_size=8, sink_size=1, recent_budget=3, pinned=[[10, 15]]),
]


def config_cases() -> dict:
    cases = []
    for kw in CONFIG_CASES:
        args = dict(kw, pinned=tuple(tuple(r) for r in kw.get("pinned", ())))
        args.setdefault("prefill_compact", "chunk")  # the Swift port's rule
        try:
            d = config_to_dict(H2OConfig(**args))
            # "json": the text H2OKVCache.meta_state carries (Swift writes the same).
            expect = {"config": d, "json": json.dumps(d)}
        except ValueError as e:
            expect = {"error": str(e)}
        cases.append({"input": kw, **expect})
    return {"format": FORMAT, "name": "config_cases", "cases": cases}


def render(doc: dict) -> str:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False) + "\n"


def documents():
    """(file name, JSON text) of every vector file, deterministic."""
    mx.set_default_device(mx.cpu)
    docs = [("config_cases.json", render(config_cases()))]
    docs += [(f"{s.name}.json", render(run_stream(s))) for s in streams()]
    return docs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=OUT, help="vector folder")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    total = 0
    for name, text in documents():
        with open(os.path.join(args.out, name), "w") as f:
            f.write(text)
        total += len(text)
        print(f"wrote {name} ({len(text)} bytes)")
    print(f"total={total} bytes")


if __name__ == "__main__":
    main()
