"""Check every GPU kernel variant against a float64 reference; exit 1 on any mismatch.

    python tools/gpu_check.py [--quick] [--seed S] [--fused-steps 300]
        [--attention-only | --skip-attention] [--jobs N]

Attention: N in {1, 97, 257, 1025, 4097, 16385, 32768}, head dims 64-256,
float16/bfloat16/float32, masks, GQA 1/2/4/8/16, Lq 1-8, sinks, cache views;
fresh random inputs, every output poisoned with NaN before the kernels run.
Queue fold (kernels/queued.py): every N, head dim and dtype against float64.
Fused H2O step: runs next to the reference H2OKVCache (on the CPU) for a few
hundred decode steps and compares outputs, scores and every eviction.
Fold step (h2o_fold_step): exact victims and positions against the policy.
Before the checks, --jobs processes compile the kernels (MLX keeps them on
disk for the checker). Exit 2 without a GPU backend (Metal or CUDA).
"""

import argparse
import os
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mlx_h2o import policy  # noqa: E402
from mlx_h2o.cache import H2OKVCache  # noqa: E402
from mlx_h2o.config import H2OConfig  # noqa: E402
from mlx_h2o.kernels import gpu_backend, h2o_decode_step, h2o_fold_step  # noqa: E402
from mlx_h2o.kernels.decode import decode_attention  # noqa: E402
from mlx_h2o.kernels.queued import TILES, queue_fold  # noqa: E402
from kernel_refs import (  # noqa: E402  (beside this file)
    OUT_TOL, Case, check_case, make_inputs, queue_fold_ref64, rel_err, to_np,
)

NS = (1, 97, 257, 1025, 4097, 16385, 32768)
DS = (64, 80, 96, 128, 256)
DTYPES = ("float16", "bfloat16", "float32")
NAN = float("nan")
# The queue-fold cases: query heads per KV head and queue length by head dim.
QUEUE_CASES = dict(zip(DS, zip((1, 2, 4, 8, 4), (1, 7, 32, 128, 32))))


def attention_cases(quick: bool):
    ns = (1, 257, 4097) if quick else NS
    cases = {"dims": [], "paths": [], "gqa": [], "masks": [], "views": []}
    for N in ns:
        for D in DS:
            for dt in DTYPES:
                cases["dims"].append(Case(N=N, D=D, dtype=dt))
        for S in (1, 3, 64):
            cases["paths"].append(Case(N=N, splits=S, Hq=32, Hk=8))
    for Hq, Hk in ((2, 2), (4, 2), (8, 2), (16, 2), (32, 8), (32, 2), (28, 4)):
        for L in (1, 3, 8):
            for N in (97, 4097):
                cases["gqa"].append(Case(Hq=Hq, Hk=Hk, L=L, N=N))
    for mask in ("causal", "bool_kv", "bool_q", "bool_row", "add_q", "add_bcast"):
        for L in ((4,) if mask in ("causal", "bool_row") else (1, 4)):
            for N in (257, 4097):
                for sinks in (False, True):
                    cases["masks"].append(Case(mask=mask, L=L, N=N, sinks=sinks, B=2))
    for view, dt in (("slice", "float16"), ("slice", "bfloat16"), ("strided", "float16"),
                     ("strided", "float32")):
        for N in (257, 1025) if quick else (257, 1025, 32768):
            cases["views"].append(Case(view=view, dtype=dt, N=N, B=2, D=128))
    return cases


def run_attention(quick: bool, seed: int) -> int:
    def fn_for(case):
        def fn(q, k, v, scale, mask, sinks):
            return decode_attention(q, k, v, scale=scale, mask=mask, sinks=sinks,
                                    num_splits=case.splits, poison=NAN)
        return fn

    failures = 0
    print(f"{'section':8s} {'cases':>5s} {'fail':>4s}  max err/tol: out  logits  lse")
    for name, cases in attention_cases(quick).items():
        t0 = time.time()
        worst = {"out": 0.0, "logits": 0.0, "lse": 0.0}
        bad = []
        for i, case in enumerate(cases):
            ok, errs = check_case(case, seed + 7919 * i, fn_for(case))
            tol = {"out": OUT_TOL[case.dtype], "logits": 2e-5, "lse": 2e-5}
            for key in worst:
                worst[key] = max(worst[key], errs[key] / tol[key])
            if not ok:
                bad.append((case, errs))
        failures += len(bad)
        print(f"{name:8s} {len(cases):5d} {len(bad):4d}  "
              f"{worst['out']:.3f} {worst['logits']:.3f} {worst['lse']:.3f}  "
              f"({time.time() - t0:.0f} s)")
        for case, errs in bad[:10]:
            print(f"   FAIL {case.label()}  " +
                  " ".join(f"{k}={v:.2e}" for k, v in errs.items()))
    return failures


class FusedDriver:
    """Drives h2o_decode_step the way the cache should (see docs/DESIGN.md)."""

    def __init__(self, ref: H2OKVCache, splits, cap):
        n = ref.size()
        pad = lambda a: mx.concatenate(  # noqa: E731
            [a[:, :, :n], mx.zeros((*a.shape[:2], cap - n, *a.shape[3:]), a.dtype)], 2)
        self.keys, self.values = pad(ref.kv.keys), pad(ref.kv.values)
        self.positions, self.score, self.count = (
            pad(ref.positions), pad(ref.score), pad(ref.count))
        self.n, self.offset, self.cfg, self.window = n, ref.offset, ref.config, ref.window_size
        self.victim, self.splits, self.steps = None, splits, 0

    def policy_victim(self):
        cfg, n = self.cfg, self.n
        pos = self.positions[..., :n]
        keep = policy.protected(pos, self.offset + 1, cfg.sink_size, cfg.recent_budget,
                                cfg.pinned)
        sc = policy.eviction_score(cfg.score, self.score[..., :n], self.count[..., :n])
        pri = policy.priority(sc, keep, pos, self.offset + 1, self.window)
        return policy.select_victim(pri, pos).astype(mx.int32)

    def step(self, q, k, v, scale, mask=None):
        cfg, n = self.cfg, self.n
        if n < cfg.max_size:
            self.keys[..., n:n + 1, :] = k
            self.values[..., n:n + 1, :] = v
            slot, app, self.n = None, n, n + 1
        else:
            if self.victim is None:  # the kernel's victim is (B, Hk, 1, D)
                v0 = self.policy_victim()
                self.victim = mx.broadcast_to(v0[..., None, None], (*v0.shape, 1, k.shape[3]))
            idx = self.victim
            self.keys = mx.put_along_axis(self.keys, idx, k, axis=2)
            self.values = mx.put_along_axis(self.values, idx, v, axis=2)
            slot, app = self.victim, None
        self.offset += 1
        res = h2o_decode_step(
            q, self.keys[..., :self.n, :], self.values[..., :self.n, :], self.positions,
            self.score, self.count, slot=slot, append_slot=app, offset=self.offset,
            scale=scale, mode=cfg.score, alpha=cfg.ema_alpha, sink_size=cfg.sink_size,
            recent_budget=cfg.recent_budget, pinned=cfg.pinned, window_size=self.window,
            mask=mask,
            # Every other step unpoisoned, so a full cache takes the compiled launch.
            num_splits=self.splits, poison=NAN if self.steps % 2 == 0 else None)
        self.steps += 1
        self.positions, self.score, self.count, self.victim = res[1:5]
        return res.out, slot


def step_mask(rng, B, n):
    """A decode step's bool mask over n slots, (B, 1, 1, n): ~15% of the
    slots hidden, slot 0 always seen (no row fully masked)."""
    m = rng.random((B, 1, 1, n)) >= 0.15
    m[..., 0] = True
    return mx.array(m)


def fused_run(cfg, *, B, Hq, Hk, D, dtype, window, prefill, steps, splits, seed,
              masked=False):
    """The fused step driven as the cache drives it, against the reference
    cache step by step; ``masked``: every step has a random bool mask."""
    rng = np.random.default_rng(seed)
    dt, scale = getattr(mx, dtype), D ** -0.5
    rnd = lambda *s: mx.array(rng.standard_normal(s)).astype(dt)  # noqa: E731
    ref = H2OKVCache(cfg, window_size=window)
    with mx.stream(mx.cpu):
        kk, vv = ref.update_and_fetch(rnd(B, Hk, prefill, D), rnd(B, Hk, prefill, D))
        ref.h2o_attention(rnd(B, Hq, prefill, D), kk, vv, scale=scale,
                          mask=ref.make_mask(prefill))
        mx.eval(ref.kv.keys, ref.score)
    drv = FusedDriver(ref, splits, cfg.max_size)
    stats = dict(evictions=0, ties=0, fails=0, out=0.0, score=0.0)
    for t in range(steps):
        q, k, v = rnd(B, Hq, 1, D), rnd(B, Hk, 1, D), rnd(B, Hk, 1, D)
        mask = step_mask(rng, B, min(drv.n + 1, cfg.max_size)) if masked else None
        out, slot = drv.step(q, k, v, scale, mask)
        mx.eval(out, drv.positions, drv.score, drv.count, drv.victim)
        with mx.stream(mx.cpu):
            full = ref.size() >= cfg.max_size
            if full:
                pri, pos = ref.priority(ref.offset + 1)
                ref_slot = np.array(policy.select_victim(pri, pos))
                pri = np.array(pri)
            kk, vv = ref.update_and_fetch(k, v)
            out_ref = ref.h2o_attention(q, kk, vv, scale=scale, mask=mask)
            mx.eval(out_ref, ref.score, ref.count, ref.positions)
        n = ref.size()
        if full:
            stats["evictions"] += 1
            full_slot = np.array(slot)
            mine = full_slot[..., 0, 0]
            if not (full_slot == mine[..., None, None]).all():
                stats["fails"] += 1
                print(f"   step {t}: victim not repeated along D")
                return stats
            if not np.array_equal(mine, ref_slot):
                a = np.take_along_axis(pri, ref_slot[..., None], -1)
                b = np.take_along_axis(pri, mine[..., None], -1)
                if np.allclose(a, b, rtol=1e-5, atol=1e-7):
                    stats["ties"] += 1  # a near tie: adopt the reference state
                    drv = FusedDriver(ref, splits, cfg.max_size)
                    continue
                stats["fails"] += 1
                print(f"   step {t}: victim {mine.ravel()[:8]} != reference "
                      f"{ref_slot.ravel()[:8]}")
                return stats
        e_out = rel_err(to_np(out), to_np(out_ref))
        same_pos = np.array_equal(np.array(drv.positions[..., :n]), np.array(ref.positions[..., :n]))
        e_sc = max(float(np.max(np.abs(np.array(drv.score[..., :n]) - np.array(ref.score[..., :n]))
                             / (1e-6 + np.abs(np.array(ref.score[..., :n]))))),
                   float(np.max(np.abs(np.array(drv.count[..., :n]) - np.array(ref.count[..., :n])))))
        stats["out"], stats["score"] = max(stats["out"], e_out), max(stats["score"], e_sc)
        if e_out > 2 * OUT_TOL[dtype] or not same_pos or e_sc > 1e-4:
            stats["fails"] += 1
            print(f"   step {t}: out err {e_out:.2e} positions equal {same_pos} "
                  f"score/count err {e_sc:.2e}")
            return stats
    return stats


FUSED_RUNS = (
    # (config, B, Hq, Hk, D, dtype, window, prefill, splits)
    (H2OConfig(max_size=256, sink_size=4, recent_budget=124), 1, 32, 8, 128, "float16",
     None, 200, None),
    (H2OConfig(max_size=256, sink_size=4, recent_budget=124), 1, 32, 8, 128, "float16",
     None, 200, 4),
    (H2OConfig(max_size=128, sink_size=2, recent_budget=32, score="accumulated",
               pinned=((10, 20),)), 2, 16, 2, 64, "bfloat16", 96, 100, None),
    (H2OConfig(max_size=96, sink_size=0, recent_budget=16, score="normalized"), 2, 4, 4,
     80, "float32", None, 60, 3),
    (H2OConfig(max_size=300, sink_size=4, recent_budget=100, score="attention_ema"), 1, 32,
     2, 256, "bfloat16", None, 290, None),
    (H2OConfig(max_size=1024, sink_size=4, recent_budget=256, score="accumulated"), 1, 32,
     8, 128, "float16", None, 1000, None),
)
# Runs with a random bool mask every step (batched decode's padding masks):
# one pass where the split rule allows it (two on Metal), and forced splits.
MASKED_RUNS = (
    (H2OConfig(max_size=128, sink_size=4, recent_budget=32), 2, 32, 8, 128, "float16",
     None, 100, None),
    (H2OConfig(max_size=96, sink_size=2, recent_budget=16, score="accumulated"), 1, 8, 2,
     64, "bfloat16", None, 80, 3),
)


def run_fused(steps: int, seed: int) -> int:
    print(f"{'fused H2O step':44s} steps evict ties  out/tol score  result")
    failures = 0
    runs = [(r, False) for r in FUSED_RUNS] + [(r, True) for r in MASKED_RUNS]
    for i, ((cfg, B, Hq, Hk, D, dt, window, prefill, splits), masked) in enumerate(runs):
        t0 = time.time()
        st = fused_run(cfg, B=B, Hq=Hq, Hk=Hk, D=D, dtype=dt, window=window,
                       prefill=prefill, steps=steps, splits=splits, seed=seed + i,
                       masked=masked)
        label = (f"{cfg.score} max={cfg.max_size} H={Hq}/{Hk} D={D} {dt} "
                 f"w={window} S={splits}{' mask' if masked else ''}")
        failures += st["fails"] > 0
        print(f"{label:44s} {steps:5d} {st['evictions']:5d} {st['ties']:4d} "
              f"{st['out'] / OUT_TOL[dt]:7.3f} {st['score']:.1e}  "
              f"{'FAIL' if st['fails'] else 'ok'}  ({time.time() - t0:.0f} s)")
    return failures


FOLD_CASES = (  # (mode, B, Hq, Hk, N, cap, window, pinned)
    ("ema", 1, 32, 8, 256, 256, None, ()),
    ("accumulated", 2, 16, 2, 97, 128, 40, ((10, 20),)),
    ("normalized", 1, 4, 4, 1025, 1100, None, ()),
    ("attention_ema", 2, 28, 4, 300, 300, 200, ((0, 2),)),
)


def fold_reference(logits, lse, positions, score, count, slot, offset, mode, sink, recent,
                   pinned, window):
    s = slot.reshape(*slot.shape[:2], -1)[..., :1]
    positions = mx.put_along_axis(positions, s, mx.full(s.shape, offset - 1, mx.int32), axis=2)
    score = mx.put_along_axis(score, s, mx.zeros(s.shape, mx.float32), axis=2)
    count = mx.put_along_axis(count, s, mx.zeros(s.shape, mx.float32), axis=2)
    N = logits.shape[-1]
    pos = positions[..., :N]
    sc, cn = policy.fold_scores(mode, score[..., :N], count[..., :N], logits, lse, 0.95)
    keep = policy.protected(pos, offset + 1, sink, recent, pinned)
    pri = policy.priority(policy.eviction_score(mode, sc, cn), keep, pos, offset + 1, window)
    return pos, sc, cn, policy.select_victim(pri, pos)


def run_fold(seed: int) -> int:
    """h2o_fold_step vs the policy in mx ops on the CPU: exact victims and positions."""
    rng, fails = np.random.default_rng(seed), 0
    for mode, B, Hq, Hk, N, cap, window, pinned in FOLD_CASES:
        offset = N + 50
        pos = np.stack([np.stack([rng.permutation(offset - 1)[:cap] for _ in range(Hk)])
                        for _ in range(B)]).astype(np.int32)
        logits = rng.standard_normal((B, Hq, 1, N)).astype(np.float32) * 3
        logits[..., rng.random(N) < 0.1] = -np.inf  # masked keys
        lse = np.log(np.exp(logits).sum(-1))
        score = rng.random((B, Hk, cap)).astype(np.float32)
        count = rng.integers(0, 9, (B, Hk, cap)).astype(np.float32)
        slot = rng.integers(0, N, (B, Hk)).astype(np.int32)
        args = [mx.array(a) for a in (logits, lse, pos, score, count)]
        res = h2o_fold_step(*args, slot=mx.array(slot), offset=offset, mode=mode,
                            sink_size=4, recent_budget=16, pinned=pinned, window_size=window)
        mx.eval(res)
        with mx.stream(mx.cpu):
            ref = fold_reference(*args, mx.array(slot), offset, mode, 4, 16, pinned, window)
            mx.eval(ref)
        ok = (np.array_equal(np.array(res.victim)[..., 0, 0], np.array(ref[3]))
              and np.array_equal(np.array(res.positions)[..., :N], np.array(ref[0]))
              and np.allclose(np.array(res.score)[..., :N], np.array(ref[1]), rtol=1e-5, atol=1e-7)
              and np.array_equal(np.array(res.count)[..., :N], np.array(ref[2]))
              and np.array_equal(np.array(res.positions)[..., N:], pos[..., N:]))
        fails += not ok
        print(f"fold {mode:14s} B={B} H={Hq}/{Hk} N={N} cap={cap} w={window}: "
              f"{'ok' if ok else 'FAIL'}")
    return fails


def run_queue_fold(quick: bool, seed: int) -> int:
    """queue_fold vs float64 for every N, head dim and dtype (GQA 1-8 by head
    dim, queues of 1-128 queries, K buffers longer than N, outputs poisoned)."""
    rng, fails = np.random.default_rng(seed), 0
    for N in NS[:4] if quick else NS:
        for D, (G, T) in QUEUE_CASES.items():
            for dtype in DTYPES:
                T = min(T if N < 16385 else 8, N)
                visible = [N - T + 1 + t for t in range(T)]
                cap, M = N + 29, N + (3 if N % 2 else 0)
                q = mx.array(rng.standard_normal((1, 4 * G, T, D)), getattr(mx, dtype))
                k = mx.array(2 * rng.standard_normal((1, 4, cap, D)), getattr(mx, dtype))
                score = mx.array(rng.random((1, 4, M)), mx.float32)
                count = mx.array(rng.integers(0, 50, (1, 4, M)), mx.float32)
                ref = queue_fold_ref64(*(to_np(a) for a in (q, k)), visible, 0.3,
                                       to_np(score), to_np(count))
                for tile in TILES:  # the default and the other tiles measured
                    got = queue_fold(q, k, visible, 0.3, score, count, poison=NAN, tile=tile)
                    mx.eval(got)
                    ok = (np.array_equal(np.array(got[1]), ref[1])
                          and np.allclose(np.array(got[0]), ref[0], rtol=2e-5, atol=2e-5))
                    fails += not ok
                    print(f"queue fold N={N} D={D} {dtype} G={G} T={T} tile={tile[0]}x{tile[1]}: "
                          f"{'ok' if ok else 'FAIL'}")
    return fails


def warm(quick: bool, shard: int, jobs: int, attention: bool = True, folds: bool = True):
    """Compile this shard's kernels (MLX caches them on disk for the checker)."""
    cases = [c for group in attention_cases(quick).values() for c in group] if attention else []
    for case in cases[shard::jobs]:
        q, k, v, mask, sinks = make_inputs(case, 0)
        mx.eval(decode_attention(q, k, v, scale=0.1, mask=mask, sinks=sinks,
                                 num_splits=case.splits))
    builds = [(D, G, dt, t) for D, (G, _) in QUEUE_CASES.items() for dt in DTYPES for t in TILES]
    for D, G, dtype, tile in builds[shard::jobs] if folds else []:  # run_queue_fold's
        dt, zero = getattr(mx, dtype), mx.zeros((1, 4, 1))
        mx.eval(queue_fold(mx.zeros((1, 4 * G, 1, D), dt), mx.zeros((1, 4, 1, D), dt), [1],
                           0.3, zero, zero, tile=tile))


def warm_all(quick: bool, jobs: int, attention: bool = True, folds: bool = True):
    t0 = time.time()
    cmd = [sys.executable, __file__, "--warm-jobs", str(jobs)] + (["--quick"] if quick else [])
    cmd += [] if attention else ["--skip-attention"]
    cmd += [] if folds else ["--attention-only"]
    procs = [subprocess.Popen(cmd + ["--warm-shard", str(i)]) for i in range(jobs)]
    codes = [p.wait() for p in procs]
    print(f"compiled kernels in {jobs} processes: {time.time() - t0:.0f} s, exit codes {set(codes)}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--fused-steps", type=int, default=300)
    p.add_argument("--skip-attention", action="store_true")
    p.add_argument("--attention-only", action="store_true",
                   help="only the attention sections (no folds, no fused steps)")
    p.add_argument("--jobs", type=int, default=min(15, os.cpu_count() or 1),
                   help="processes that compile kernels before the checks")
    p.add_argument("--warm-shard", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--warm-jobs", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.warm_shard is not None:
        warm(args.quick, args.warm_shard, args.warm_jobs, not args.skip_attention,
             not args.attention_only)
        return 0
    if gpu_backend() is None:
        print("no GPU backend (mx.metal / mx.cuda unavailable): nothing to check")
        return 2
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(3), "little")
    print(f"backend={gpu_backend()} mlx={mx.__version__} seed={seed}")
    t0 = time.time()
    if args.jobs > 1:
        warm_all(args.quick, args.jobs, not args.skip_attention, not args.attention_only)
    fails = 0 if args.skip_attention else run_attention(args.quick, seed)
    if not args.attention_only:
        fails += run_fold(seed)
        fails += run_queue_fold(args.quick, seed)
        fails += run_fused(args.fused_steps, seed)
    print(f"total failures: {fails}  ({time.time() - t0:.0f} s)")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
