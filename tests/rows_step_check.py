"""The fused step over rows at different fill levels against its references.

``kernels.h2o_rows_step`` (GPU kernels, or Metal's text in the emulator) is
checked on fresh random batches whose rows differ as a batch cache's do: a
full row (its token in its victim's slot), a filling row (its token in an
empty slot, empty slots left), a row without a token this step, and a full
row that holds empty slots (room another row needed). Its attention output
is compared with a float64 NumPy reference of the masked attention, its
metadata and next slots with ``cache.ops_step.rows_step`` (the batch
cache's step in MLX ops, run on the CPU in float32).
"""

from typing import NamedTuple, Optional

import mlx.core as mx
import numpy as np

from mlx_h2o import policy
from mlx_h2o.cache.ops_step import rows_step
from mlx_h2o.config import H2OConfig
from mlx_h2o.kernels import h2o_rows_step
from kernel_refs import ref64, rel_err, to_np

EMPTY = policy.EMPTY


class RowsCase(NamedTuple):
    mode: str = "accumulated"
    Hq: int = 8
    Hk: int = 2
    D: int = 64
    N: int = 45  # slots of the whole buffers (odd on purpose)
    dtype: str = "float16"
    window: Optional[int] = None
    splits: Optional[int] = None
    sinks: bool = False

    def label(self) -> str:
        return (f"{self.mode}-H{self.Hq}/{self.Hk}-D{self.D}-N{self.N}-{self.dtype}"
                f"-w{self.window}-S{self.splits}" + ("-sinks" if self.sinks else ""))


# (held tokens, tokens seen before this step, has a token, full after it)
ROWS = [(32, 90, True, True), (20, 24, True, False), (32, 70, False, True),
        (32, 61, True, True), (25, 25, False, False)]


def _row_metadata(rng, N, Hk, held, seen, has, full):
    """positions (Hk, N) and the token's slot (Hk,) of one row: ``held``
    tokens of ``seen`` at random slots (the rest EMPTY); a full row's token
    overwrites a held slot, a filling row's goes to an empty one."""
    pos = np.full((Hk, N), EMPTY, np.int32)
    target = np.zeros(Hk, np.int32)
    for h in range(Hk):
        keep = np.sort(rng.choice(seen, held, replace=False))
        slots = rng.choice(N, held, replace=False)
        pos[h, slots] = keep
        free = np.flatnonzero(pos[h] < 0)
        target[h] = rng.choice(slots) if (has and full) else rng.choice(free)
    return pos, target


def make_batch(case: RowsCase, seed: int):
    rng = np.random.default_rng(seed)
    B, dt = len(ROWS), getattr(mx, case.dtype)
    pos, target = zip(*(_row_metadata(rng, case.N, case.Hk, *r) for r in ROWS))
    seen_after = [s + h for _, s, h, _ in ROWS]
    return dict(
        q=mx.array(rng.standard_normal((B, case.Hq, 1, case.D)), dt),
        k=mx.array(2 * rng.standard_normal((B, case.Hk, case.N, case.D)), dt),
        v=mx.array(rng.standard_normal((B, case.Hk, case.N, case.D)), dt),
        positions=mx.array(np.stack(pos)),
        score=mx.array(rng.random((B, case.Hk, case.N)), mx.float32),
        count=mx.array(rng.integers(1, 30, (B, case.Hk, case.N)), mx.float32),
        target=mx.array(np.stack(target)[..., None]),
        sinks=mx.array(rng.standard_normal(case.Hq), mx.float32) if case.sinks else None,
        offsets=seen_after, has=[r[2] for r in ROWS], full=[r[3] for r in ROWS],
    )


def _config(case: RowsCase) -> H2OConfig:
    return H2OConfig(max_size=32, sink_size=2, recent_budget=6, score=case.mode,
                     pinned=((5, 9),))


def reference(case: RowsCase, b, scale):
    """ops_step.rows_step on the CPU in float32: (out, positions, score, count, next)."""
    qpos = [o - 1 if h else EMPTY for o, h in zip(b["offsets"], b["has"])]
    rows = lambda xs, dt=mx.int32: mx.array(xs, dt)[:, None, None]  # noqa: E731
    with mx.stream(mx.cpu):
        f32 = [b[n].astype(mx.float32) for n in ("q", "k", "v")]
        res = rows_step(_config(case), scale, *f32, b["positions"], b["score"], b["count"],
                        b["target"], rows(qpos), rows([o + 1 for o in b["offsets"]]),
                        rows(b["full"], mx.bool_), 0.0, case.window, sinks=b["sinks"])
        mx.eval(res)
    return res


def out_ref64(case: RowsCase, b, positions, scale):
    """float64 attention of each row's query over the slots it holds."""
    qpos = np.array([o - 1 if h else EMPTY for o, h in zip(b["offsets"], b["has"])])
    p = to_np(positions)[:, :, None, :]  # (B, Hk, 1, N)
    q_at = qpos[:, None, None, None]
    seen = (p >= 0) & (p <= q_at)
    if case.window is not None:
        seen &= p > q_at - case.window
    sinks = None if b["sinks"] is None else to_np(b["sinks"])
    return ref64(*(to_np(b[n]) for n in ("q", "k", "v")), scale, seen, sinks)[0]


def _near_tie(case, ref, b, got_slot, want_slot, row, h) -> bool:
    """Whether two victims rank within float noise of each other."""
    pos, score, count = (to_np(a)[row, h] for a in ref[1:4])
    pri = to_np(policy.slot_priority(_config(case), mx.array(pos), mx.array(score),
                                     mx.array(count), b["offsets"][row] + 1, case.window))
    return abs(pri[got_slot] - pri[want_slot]) <= 1e-4 * max(1.0, abs(pri[want_slot]))


def check_rows_step(case: RowsCase, seed: int) -> list:
    """What differs between the fused rows step and its references (empty: none)."""
    b, scale = make_batch(case, seed), case.D ** -0.5
    cfg = _config(case)
    got = h2o_rows_step(
        b["q"], b["k"], b["v"], b["positions"], b["score"], b["count"], target=b["target"],
        offsets=b["offsets"], has=b["has"], full=b["full"], scale=scale, mode=case.mode,
        alpha=cfg.ema_alpha, sink_size=cfg.sink_size, recent_budget=cfg.recent_budget,
        pinned=cfg.pinned, window_size=case.window, sinks=b["sinks"],
        num_splits=case.splits, poison=float("nan"))
    mx.eval(got)
    ref = reference(case, b, scale)
    errors = []
    if not np.array_equal(to_np(got.positions), to_np(ref[1])):
        errors.append("positions")
    if not np.array_equal(to_np(got.count), to_np(ref[3])):
        errors.append("counts")
    if not np.allclose(to_np(got.score), to_np(ref[2]), rtol=1e-4, atol=1e-6):
        errors.append(f"scores (max diff {np.abs(to_np(got.score) - to_np(ref[2])).max():.2e})")
    want_out = out_ref64(case, b, ref[1], scale)
    tol = 2e-3 if case.dtype == "float32" else 2e-2
    for row in range(len(ROWS)):  # a row without a token: zeros
        err = rel_err(to_np(got.out)[row], want_out[row])
        if err > tol:
            errors.append(f"row {row} out (rel err {err:.2e})")
    gv, rv = (np.array(x)[..., 0] for x in (got.victim, ref[4]))
    for row, h in zip(*np.nonzero(gv != rv)):
        if b["full"][row] and _near_tie(case, ref, b, gv[row, h], rv[row, h], row, h):
            continue
        errors.append(f"row {row} head {h} next slot {gv[row, h]} != {rv[row, h]}")
    return errors


CASES = [
    RowsCase(),
    RowsCase(mode="normalized", Hq=6, Hk=2, D=80, N=37, dtype="bfloat16", window=40),
    RowsCase(mode="ema", Hq=4, Hk=4, D=128, N=64, dtype="float32", splits=3),
    RowsCase(mode="attention_ema", Hq=8, Hk=1, D=64, N=51, splits=2, sinks=True),
    RowsCase(mode="accumulated", Hq=16, Hk=2, D=64, N=45, window=25, splits=2),
]
