"""Launch plans and the GPU decode attention (Lq <= 8) that exports scores."""

from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from functools import lru_cache, partial
from typing import Iterator, Optional, Tuple, Union

import mlx.core as mx

from .replay import replayer
from .build import (_make_pass1_kernel, _make_pass1_mma_kernel, _make_pass2_kernel,
                    device_backend)

NT = 128  # threads per block (source.NT)
MAX_SPLITS = 256  # more never measured faster (docs/DESIGN.md, "--tune")
MIN_SPLIT_KEYS = 128
MMA_TILE = 64  # keys per block iteration of the tensor-core pass 1
SINGLE_PASS_MAX_N = 256  # below this one launch beats two (measured: docs/DESIGN.md)
DTYPES = (mx.float16, mx.bfloat16, mx.float32)

Mask = Union[None, str, mx.array]


@dataclass(frozen=True)
class LaunchSettings:
    """The launch knobs of ``decode_attention`` (and the fused step's layout).
    The defaults measured fastest on an H200 (docs/DESIGN.md); benchmarks and
    tests change them for a block of calls with ``launch_settings``."""

    # U, keys per warp iteration; 0: min(8, TPK / padded R)
    keys_per_lane_group: int = 0
    # TPK: 32, 16 or 8 (2 or 4 key rows a warp read); 0: lanes_per_key()
    lanes_per_key: int = 0
    max_rows: int = 8  # query rows per block: registers hold R * EPL floats twice
    target_blocks: int = 512  # ~4 blocks per SM on a 132-SM H100
    # tensor-core pass 1 (source_mma.py): 0 off, 1 where faster (D 64 / 96),
    # 2 also D=128
    mma: int = 1

    def __post_init__(self):
        values = tuple(getattr(self, f.name) for f in fields(self))
        for f, value in zip(fields(self), values):
            if type(value) is not int:
                raise TypeError(f"launch setting {f.name} must be an int, got {value!r}")
        if self.lanes_per_key not in (0, 8, 16, 32):
            raise ValueError(f"lanes_per_key={self.lanes_per_key}: "
                             "use 32, 16, 8 or 0 (automatic)")
        if self.mma not in (0, 1, 2):
            raise ValueError(f"mma={self.mma}: use 0 (off), 1 (D 64 / 96) "
                             "or 2 (also D=128)")
        if self.keys_per_lane_group < 0 or self.max_rows < 1 or self.target_blocks < 1:
            raise ValueError(f"{self}: keys_per_lane_group >= 0 (0: automatic), "
                             "max_rows >= 1 and target_blocks >= 1")
        # Hashed once: every repeated call's signature holds the settings.
        object.__setattr__(self, "_hash", hash(values))

    def __hash__(self) -> int:
        return self._hash


_SETTINGS = [LaunchSettings()]  # the one in force: swapped only by launch_settings


def settings() -> LaunchSettings:
    """The launch settings in force."""
    return _SETTINGS[0]


@contextmanager
def launch_settings(**changes) -> Iterator[LaunchSettings]:
    """Run a block of calls with some launch knobs changed, e.g.
    ``with launch_settings(mma=0): ...``; the previous settings come back on
    exit. Unknown names raise TypeError, bad values ValueError."""
    names = {f.name for f in fields(LaunchSettings)}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise TypeError(f"unknown launch settings {unknown}: use {sorted(names)}")
    old = _SETTINGS[0]
    _SETTINGS[0] = replace(old, **changes)
    try:
        yield _SETTINGS[0]
    finally:
        _SETTINGS[0] = old


@dataclass(frozen=True)
class Layout:
    """How one block maps a (sequence, KV head, row tile) onto threads."""

    R: int  # query rows per block (divides G * L)
    RT: int  # row tiles per KV head
    TPK: int  # lanes per key row: 32, 16 or 8 (a warp reads 32 / TPK rows at once)
    EPL: int  # elements per lane
    U: int  # key rows each TPK-lane group loads per iteration
    tile: int  # keys per block iteration (splits are multiples of it)

    def template(self, dtype, D, L, G, Hk):
        return [
            ("T", dtype), ("D", D), ("R", self.R), ("L", L), ("G", G), ("HK", Hk),
            ("TPK", self.TPK), ("EPL", self.EPL), ("U", self.U),
        ]


@lru_cache(maxsize=None)
def layout(D: int, itemsize: int, G: int, L: int, U: int = 0, TPK: int = 0,
           max_rows: int = LaunchSettings.max_rows) -> Layout:
    # TPK lanes read one key row: each lane a slice of EPL = 2, 4 or 8 elements.
    tpk = TPK or 32
    if not any(tpk * e >= D and D % e == 0 for e in (2, 4, 8)):
        tpk = 32  # the row does not fit TPK lanes
    epl = next(e for e in (2, 4, 8) if tpk * e >= D and D % e == 0)
    rows = G * L
    R = max(r for r in range(1, max_rows + 1) if rows % r == 0)
    rp = 1 << (R - 1).bit_length()  # rows padded to a power of two
    # R x U logits per key-row group iteration are spread over its TPK lanes.
    if U and rp * U > tpk:
        raise ValueError(f"U={U} keys for {R} query rows needs {rp * U} lanes a key "
                         f"group, more than its {tpk}: use U <= {max(1, tpk // rp)}")
    U = U or min(8, tpk // rp)
    return Layout(R=R, RT=rows // R, TPK=tpk, EPL=epl, U=U, tile=(NT // 32) * U * (32 // tpk))


def mma_supported(dtype, D: int, L: int, G: int, kind: str) -> bool:
    """Whether a split launch takes the tensor-core pass 1 (CUDA, float16 /
    bfloat16, no mask or causal, <= 8 query rows a KV head; sinks are pass
    2's): with the ``mma`` setting 1 at D 64 / 96, where it measured faster
    than the shared body on an H200 (D=128 slower, also at 128 registers;
    docs/DESIGN.md), with 2 also at D=128; 0 never."""
    cfg = settings()
    dims = {1: (64, 96), 2: (64, 96, 128)}.get(cfg.mma, ())
    return (device_backend() == "cuda" and dtype in (mx.float16, mx.bfloat16)
            and D in dims and kind in ("none", "causal")
            and G * L <= min(cfg.max_rows, 8))  # the MMA's 16 rows: 8 queries, 8 zero


def lanes_per_key(D: int, N: int) -> int:
    """Lanes a key row, where each measured fastest on an H200 (fewer lanes
    a row: fewer warp shuffles per logit, wider loads, more registers):
    D=64 16, and 8 in one pass (<= 256 keys) or from 8K keys (4 rows a warp
    read); D 80 / 96 16; D=128 16; else, and on Metal (never run), 32.
    docs/DESIGN.md (D=128 below 8K keys: 10.6-14.8
    against 11.5-15.5 us with 32 lanes, in one pass 10.9 against 13.2)."""
    if device_backend() != "cuda":
        return 32
    if D == 64:
        return 8 if N >= 8192 or N <= SINGLE_PASS_MAX_N else 16
    return 16 if D in (80, 96, 128) else 32


def choose_splits(N: int, units: int, tile: int, D: int = 128) -> int:
    """Key splits per (sequence, KV head, row tile): fill the GPU, keep splits long.

    Head dims above 128 take half the blocks: pass 1 then needs ~168
    registers a thread, 3 blocks fit an SM, and 512 blocks ran as two waves
    (H200, D=256: S=32 73 / 106 us at 16K / 32K, S=64 85 / 128; docs/DESIGN.md).
    """
    if N <= SINGLE_PASS_MAX_N:
        return 1
    by_len = -(-N // max(MIN_SPLIT_KEYS, tile))
    blocks = settings().target_blocks
    by_fill = -(-(blocks if D <= 128 else blocks // 2) // units)
    return max(1, min(by_len, by_fill, MAX_SPLITS))


def mask_mode(mask: Mask, B: int, Hq: int, Hk: int, L: int, N: int):
    """(kind, head mode) of a mask the kernels take, or None if unsupported."""
    if mask is None:
        return "none", 0
    if isinstance(mask, str):
        return ("causal", 0) if mask == "causal" else None
    if mask.ndim > 4 or mask.ndim == 0:
        return None
    shape = (1,) * (4 - mask.ndim) + tuple(mask.shape)
    if shape[0] not in (1, B) or shape[2] not in (1, L) or shape[3] not in (1, N):
        return None
    heads = {Hq: 1, Hk: 2, 1: 0}.get(shape[1])  # Hq first: equal when G == 1
    if heads is None:
        return None
    if mask.dtype == mx.bool_:
        return "bool", heads
    if mask.dtype in DTYPES:
        return "add", heads
    return None


@lru_cache(maxsize=64)
def params_f(scale: float, alpha: float = 0.95) -> mx.array:
    # (1 - alpha) rounded once from double, as the policy's mx ops do.
    return mx.array([scale, alpha, 1.0 - alpha], dtype=mx.float32)


class Repeated:
    """Replayed launches for call signatures seen before.

    A chain of calls with one signature (a full cache, a fixed buffer, a
    benchmark) replays the graph of its second call instead of rebuilding
    each custom-kernel call (``replay.replayer``: mx.compile). A
    signature's first call runs plain, so a growing cache (a new N every
    step) never records; at most ``size`` replays are kept (``size=0``:
    every call plain).
    """

    def __init__(self, size: int = 32):
        self.size = size
        self._seen = OrderedDict()  # signature -> replay, or None once seen

    def call(self, signature, arrays, make, *args):
        """``make(*args)(*arrays)``, replayed if ``signature`` was seen twice
        (``make`` runs only when a call is not replayed)."""
        seen = self._seen
        fn = seen.get(signature)
        if fn is not None:
            seen.move_to_end(signature)
            outs = fn(*arrays)
            if outs is not None:
                return outs  # else an input shape the signature leaves out changed
        launch = make(*args)
        outs = launch(*arrays)
        if signature in seen:  # its second call, or a refused replay: record
            seen[signature] = replayer(launch)
            seen.move_to_end(signature)
        elif self.size > 0:
            seen[signature] = None
            if len(seen) > self.size:
                seen.popitem(last=False)
        return outs


_REPEATED = Repeated()


def decode_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: Mask = None,
    sinks: Optional[mx.array] = None,
    num_splits: Optional[int] = None,
    poison: Optional[float] = None,
) -> Tuple[mx.array, mx.array, mx.array]:
    """GPU twin of the reference: (out, logits float32, lse float32).

    ``num_splits`` overrides the split count (1: single pass); ``poison``
    (tests) fills every output, partials included, before the kernels run.
    A repeated call (same shapes, dtypes, mask kind and splits) replays a
    recorded launch; K / V strides are read when the kernel runs.
    """
    arrays = [q, k, v, params_f(float(scale))]
    if isinstance(mask, mx.array):
        arrays.append(mask)
        mask_key = (mask.shape, mask.dtype)
    else:
        mask_key = mask
    if sinks is not None:
        arrays.append(sinks)
    if poison is None:
        # What the plan depends on (a replay refuses other input shapes or
        # dtypes itself): the plan is made only when a call is not replayed.
        signature = (q.shape, k.shape, q.dtype, mask_key, sinks is None, num_splits,
                     _SETTINGS[0])
        return _REPEATED.call(signature, arrays, _plan, q, k, mask, sinks, num_splits)
    return _plan(q, k, mask, sinks, num_splits)(*arrays, poison=poison)


def _plan(q, k, mask, sinks, num_splits):
    """``_launch`` bound to the layout, mask kind and split count of a call."""
    B, Hq, L, D = q.shape
    Hk, N = k.shape[1], k.shape[2]
    cfg = settings()
    tpk = cfg.lanes_per_key or lanes_per_key(D, N)
    lay = layout(D, q.dtype.size, Hq // Hk, L, cfg.keys_per_lane_group, tpk,
                 cfg.max_rows)
    kind, mh = mask_mode(mask, B, Hq, Hk, L, N)
    mma = mma_supported(q.dtype, D, L, Hq // Hk, kind)
    S = num_splits or choose_splits(N, B * Hk * lay.RT, MMA_TILE if mma else lay.tile, D)
    mma = mma and S > 1  # the tensor-core kernel writes partials only
    return partial(_launch, lay=lay, kind=kind, mh=mh, S=max(1, min(S, MAX_SPLITS)),
                   has_sinks=sinks is not None, mma=mma)


def _launch(q, k, v, prm_f, *extra, lay, kind, mh, S, has_sinks, mma=False, poison=None):
    """The kernel launches of ``decode_attention``: one pass, or splits + a
    merge with one block per query row."""
    B, Hq, L, D = q.shape
    Hk, N = k.shape[1], k.shape[2]
    G = Hq // Hk
    units = B * Hk * lay.RT
    sinks = list(extra[-1:]) if has_sinks else []
    inputs = [q, k, v, prm_f] + list(extra[:1] if kind in ("bool", "add") else [])
    tmpl = lay.template(q.dtype, D, L, G, Hk) + [("MH", mh)]
    k1 = _make_pass1_kernel(kind, has_sinks, S > 1, False)
    f32 = mx.float32
    if S == 1:
        out, logits, lse = k1(
            inputs=inputs + sinks, template=tmpl, grid=(units * NT, 1, 1),
            threadgroup=(NT, 1, 1),
            output_shapes=[(B, Hq, L, D), (B, Hq, L, N), (B, Hq, L)],
            output_dtypes=[q.dtype, f32, f32], init_value=poison,
        )
        return out, logits, lse
    if mma:  # mma_supported: G * L <= max_rows, so one row tile (lay.R rows)
        k1 = _make_pass1_mma_kernel(kind)
    logits, part_o, part_ml = k1(
        inputs=inputs, template=tmpl, grid=(units * NT, S, 1), threadgroup=(NT, 1, 1),
        output_shapes=[(B, Hq, L, N), (units, S, lay.R, D), (units, S, lay.R, 2)],
        output_dtypes=[f32, f32, f32], init_value=poison,
    )
    k2 = _make_pass2_kernel(has_sinks, False)
    out, lse = k2(
        inputs=[part_o, part_ml] + sinks, template=lay.template(q.dtype, D, L, G, Hk),
        grid=(units * lay.R * NT, 1, 1),
        threadgroup=(NT, 1, 1), output_shapes=[(B, Hq, L, D), (B, Hq, L)],
        output_dtypes=[q.dtype, f32], init_value=poison,
    )
    return out, logits, lse
