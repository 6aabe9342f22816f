"""Fold queued decode queries into the summed H2O scores in three launches.

cache/decode/deferred.py keeps the decode queries of a cache below its budget and
folds them every few steps. In plain ops that fold materializes float32
logits, their softmax and a float32 copy of K: at 16K context and 32
queries about 330 MB of transients per fold, which cost an H100 decode
3.5-4 ms per token (docs/DESIGN.md). These kernels never write a
logit: "partials" gives each block (sequence, KV head, key split) and
writes every query row's partial (max, sum exp) over its keys; "merge"
turns each row's partials into its lse; "fold" recomputes the logits and
adds each slot's probability, averaged over the GQA group and summed over
the queries, to ``score``, and the number of queries that saw it to
``count``.

Rows of a block are (g, t) of its KV head: query head hk * G + g, queued
query t, which sees slots < vis[t]. A thread owns KPT keys and reads their
rows once per chunk of RC rows staged in shared memory; each staged query
value it reads there serves all KPT keys.
Template constants: T dtype, D head dim, G query heads per KV head; source
constants NT threads, KPT keys per thread (a block covers KPT * NT slots),
RC rows per chunk.
"""

from functools import lru_cache
from typing import Optional, Sequence, Tuple

import mlx.core as mx

from .backend import gpu_backend, runs_on_gpu
from .build import _built_once, _prelude
from .decode import DTYPES, params_f

# (NT threads, KPT keys per thread): a block covers NT * KPT = 128 slots,
# blocks enough to fill a GPU at 4K slots. More keys per thread read the
# staged queries fewer times per FMA but hold more registers: on the H100
# one key per thread was fastest at 4K and 32K, 64x2 at 16K by ~10%, 32x4
# slowest (docs/DESIGN.md). NT: a multiple of 32, >= RC.
TILE = (128, 1)
TILES = ((128, 1), (64, 2), (32, 4))  # the tiles measured; the tests run each
RC = 8
MAX_ROWS = 2048  # G * queued queries: pass 2 keeps one lse per row in shared memory

# float4 constructor of each backend (the shared body stages q as float4).
F4 = {"cuda": "#define H2O_F4 make_float4\n", "metal": "#define H2O_F4 float4\n"}

SETUP = r"""
$IDS
  constexpr int NW = NT / 32;
  constexpr int E = 8;  // K elements per fetch
  constexpr int D4 = D / 4;
  const int TQ = q_shape[2];
  const int NR = G * TQ;
  const int cap = k_shape[2];
  const int bh = blk_x;  // b * HK + hk
  const int split = blk_y;
  const int NS = n_blk_y;
  const int j0 = split * KPT * NT;
  int nmax = 0;  // slots any queued query sees
  for (int t = 0; t < TQ; ++t) nmax = vis[t] > nmax ? vis[t] : nmax;
  const float scale = prm_f[0];
  auto qb = q + (i64)bh * NR * D;
  auto kb = k + (i64)bh * cap * D;
  H2O_SHARED float4 qs[RC * D4];
  H2O_SHARED int vis_s[RC];  // slots each staged row sees (0 past NR)
"""

# Stage rows r0 .. r0 + RC of the block's queries as float4 (zeros past NR).
STAGE = r"""
    H2O_BARRIER();
    for (int i = tid; i < RC * D4; i += NT) {
      const int r = r0 + i / D4;
      const int d = (i % D4) * 4;
      auto p = qb + (i64)(r < NR ? r : 0) * D + d;
      const float on = r < NR ? 1.0f : 0.0f;
      qs[i] = H2O_F4(on * static_cast<float>(p[0]), on * static_cast<float>(p[1]),
                     on * static_cast<float>(p[2]), on * static_cast<float>(p[3]));
    }
    for (int r = tid; r < RC; r += NT) vis_s[r] = r0 + r < NR ? vis[(r0 + r) % TQ] : 0;
    H2O_BARRIER();
"""

# acc[u][r] = q_r . k_j for this thread's keys j = j0 + u * NT + tid and the
# staged rows r: each key row is read once per chunk, each staged value once
# for all KPT keys.
DOT = r"""
    float acc[KPT][RC];
    H2O_UNROLL
    for (int u = 0; u < KPT; ++u) {
      H2O_UNROLL
      for (int r = 0; r < RC; ++r) acc[u][r] = 0.0f;
    }
    for (int d0 = 0; d0 < D; d0 += E) {
      float kf[KPT][E];
      H2O_UNROLL
      for (int u = 0; u < KPT; ++u) {
        const int j = j0 + u * NT + tid;
        H2ORaw<T, E> raw;
        if (j < nmax) {
          auto kr = kb + (i64)j * D + d0;
          h2o_fetch<E>(kr, 1, H2O_ALIGNED16(kr), raw);
        } else {
          h2o_zero<E>(raw);
        }
        h2o_cvt<E>(raw, kf[u]);
      }
      H2O_UNROLL
      for (int r = 0; r < RC; ++r) {
        const float4 a = qs[r * D4 + d0 / 4];
        const float4 c = qs[r * D4 + d0 / 4 + 1];
        H2O_UNROLL
        for (int u = 0; u < KPT; ++u) {
          float x = acc[u][r];  // a chain of 8 FMAs
          x += a.x * kf[u][0]; x += a.y * kf[u][1]; x += a.z * kf[u][2]; x += a.w * kf[u][3];
          x += c.x * kf[u][4]; x += c.y * kf[u][5]; x += c.z * kf[u][6]; x += c.w * kf[u][7];
          acc[u][r] = x;
        }
      }
    }
"""

# For each of this thread's keys j and each staged row r that sees it: the
# logit x (the code between EACH_LOGIT and END_EACH runs per (j, r)).
EACH_LOGIT = r"""
$DOT
    H2O_UNROLL
    for (int u = 0; u < KPT; ++u) {
      const int j = j0 + u * NT + tid;
      H2O_UNROLL
      for (int r = 0; r < RC; ++r) {
        if (j < vis_s[r]) {
          const float x = acc[u][r] * scale;
""".strip("\n")
END_EACH = """        }
      }
    }"""

PASS1 = r"""
  H2O_SHARED float red[NW * RC * 2];
  const i64 pbase = ((i64)bh * NS + split) * NR;
  for (int r0 = 0; r0 < NR; r0 += RC) {
    if (j0 >= nmax) {  // no visible key in this split
      if (tid < RC && r0 + tid < NR) {
        part[(pbase + r0 + tid) * 2] = -H2O_INF;
        part[(pbase + r0 + tid) * 2 + 1] = 0.0f;
      }
      continue;
    }
$STAGE
    float m[RC];  // running max and sum of exp(x - max) of each staged row
    float s[RC];
    H2O_UNROLL
    for (int r = 0; r < RC; ++r) m[r] = -H2O_INF;
    H2O_UNROLL
    for (int r = 0; r < RC; ++r) s[r] = 0.0f;
$EACH_LOGIT
            if (x > m[r]) {
              s[r] = s[r] * H2O_EXP(m[r] - x) + 1.0f;
              m[r] = x;
            } else {
              s[r] += H2O_EXP(x - m[r]);
            }
$END_EACH
    H2O_UNROLL
    for (int r = 0; r < RC; ++r) {
      float mr = m[r];
      for (int o = 16; o > 0; o >>= 1) mr = H2O_FMAX(mr, H2O_SHFL_XOR(mr, o));
      float sr = s[r] > 0.0f ? s[r] * H2O_EXP(m[r] - mr) : 0.0f;
      for (int o = 16; o > 0; o >>= 1) sr += H2O_SHFL_XOR(sr, o);
      if (lane == 0) {
        red[(warp * RC + r) * 2] = mr;
        red[(warp * RC + r) * 2 + 1] = sr;
      }
    }
    H2O_BARRIER();
    if (tid < RC && r0 + tid < NR) {
      float mb = -H2O_INF;
      for (int w = 0; w < NW; ++w) mb = H2O_FMAX(mb, red[(w * RC + tid) * 2]);
      float sb = 0.0f;
      for (int w = 0; w < NW; ++w) {
        const float sw = red[(w * RC + tid) * 2 + 1];
        sb += sw > 0.0f ? sw * H2O_EXP(red[(w * RC + tid) * 2] - mb) : 0.0f;
      }
      part[(pbase + r0 + tid) * 2] = mb;
      part[(pbase + r0 + tid) * 2 + 1] = sb;
    }
  }
"""

# The splits' partials of each row merged into its lse, a thread per row.
MERGE = r"""
$IDS
  const int NS = part_shape[1];
  const int NR = part_shape[2];
  const i64 i = (i64)blk_x * NT + tid;  // b * HK * NR + hk * NR + row
  if (i < (i64)part_shape[0] * NR) {
    const i64 pr = (i / NR) * NS * NR + i % NR;
    float mb = -H2O_INF;
    for (int sp = 0; sp < NS; ++sp) mb = H2O_FMAX(mb, part[(pr + (i64)sp * NR) * 2]);
    float sb = 0.0f;
    for (int sp = 0; sp < NS; ++sp) {
      const float sw = part[(pr + (i64)sp * NR) * 2 + 1];
      sb += sw > 0.0f ? sw * H2O_EXP(part[(pr + (i64)sp * NR) * 2] - mb) : 0.0f;
    }
    lse[i] = mb + H2O_LOG(sb);
  }
"""

PASS2 = r"""
  H2O_SHARED float lse[MAX_ROWS];
  const int M = score_in_shape[2];
  float sc[KPT];
  H2O_UNROLL
  for (int u = 0; u < KPT; ++u) sc[u] = 0.0f;  // unrolled u loops keep sc in registers
  if (j0 < nmax) {
    for (int r = tid; r < NR; r += NT) lse[r] = lse_in[(i64)bh * NR + r];
    for (int r0 = 0; r0 < NR; r0 += RC) {
$STAGE
$EACH_LOGIT
            sc[u] += H2O_EXP(x - lse[r0 + r]);
$END_EACH
    }
  }
  H2O_UNROLL
  for (int u = 0; u < KPT; ++u) {
    const int j = j0 + u * NT + tid;
    if (j < M) {
      int seen = 0;
      for (int t = 0; t < TQ; ++t) seen += j < vis[t] ? 1 : 0;
      const i64 o = (i64)bh * M + j;
      score_out[o] = score_in[o] + sc[u] / G;
      count_out[o] = count_in[o] + static_cast<float>(seen);
    }
  }
"""


KINDS = ("partials", "merge", "fold")


def pass_names(kind: str):
    """Input and output names of the partials, merge or fold kernel."""
    inputs = ["q", "k", "vis", "prm_f"]
    if kind == "merge":
        return ["part"], ["lse"]
    if kind == "fold":
        return inputs + ["lse_in", "score_in", "count_in"], ["score_out", "count_out"]
    return inputs, ["part"]


def pass_source(backend: str, kind: str, tile: Tuple[int, int] = TILE) -> Tuple[str, str]:
    """(header, body) of one kernel (``KINDS``) for ``backend``; ``tile``:
    (threads per block, keys per thread)."""
    header, ids = _prelude(backend)
    nt, kpt = tile
    consts = f"constexpr int NT = {nt};\nconstexpr int RC = {RC};\nconstexpr int KPT = {kpt};\n"
    consts += f"constexpr int MAX_ROWS = {MAX_ROWS};\n"
    if kind == "merge":
        return header + consts, MERGE.replace("$IDS", ids)
    body = SETUP.replace("$IDS", ids) + (PASS2 if kind == "fold" else PASS1)
    body = body.replace("$EACH_LOGIT", EACH_LOGIT).replace("$END_EACH", END_EACH)
    body = body.replace("$STAGE", STAGE).replace("$DOT", DOT)
    return header + F4[backend] + consts, body


@lru_cache(maxsize=None)
def _make_pass_kernel(kind: str, tile: Tuple[int, int] = TILE):
    """The ``kind`` kernel, or None without a GPU backend. Queries, K and the
    scores are indexed flat, so inputs are made row-contiguous."""
    backend = gpu_backend()
    if backend is None:
        return None
    # Precompiled: no ~4 s of builds at a CUDA process's first fold.
    return _built_once(backend, f"h2o_qfold_{kind}", pass_names(kind),
                       *pass_source(backend, kind, tile))


def queue_fold_supported(queries: mx.array, keys: mx.array, queued: int = 0) -> bool:
    """Whether queue_fold runs here for these queries (B, Hq, T, D) and K
    buffer (B, Hk, cap, D); ``queued``: fold that many queries instead of T."""
    B, Hq, T, D = queries.shape
    Hk, T = keys.shape[1], queued or T
    return (runs_on_gpu() and queries.dtype in DTYPES and keys.dtype == queries.dtype
            and D % 8 == 0 and 8 <= D <= 256 and keys.shape[-1] == D
            and keys.shape[0] == B and Hq % Hk == 0 and (Hq // Hk) * T <= MAX_ROWS)


def queue_fold(queries: mx.array, keys: mx.array, visible: Sequence[int], scale: float,
               score: mx.array, count: mx.array, *, poison: Optional[float] = None,
               tile: Tuple[int, int] = TILE) -> Tuple[mx.array, mx.array]:
    """(score, count) with the queued queries folded in (new arrays).

    Shapes:
        queries: (B, n_heads, T, D), query t sees slots < visible[t];
        keys: the K buffer (B, n_kv_heads, cap, D), read in place;
        score, count: (B, n_kv_heads, M) float32, M >= max(visible).
    As cache/deferred.fold_queue added to (score, count), up to float
    summation order. ``poison`` (tests): what an unwritten output reads;
    ``tile`` (benchmarks): one of ``TILES``.
    """
    B, Hq, T, D = queries.shape
    Hk, cap, M = keys.shape[1], keys.shape[2], score.shape[-1]
    if len(visible) != T or not 0 < min(visible) <= max(visible) <= min(cap, M):
        raise ValueError(f"queue_fold: visible must give 1..{min(cap, M)} slots for each "
                         f"of {T} queries, got {list(visible)}")
    if not queue_fold_supported(queries, keys) or score.shape != (B, Hk, M):
        raise ValueError(f"queue_fold: not supported here for queries {queries.shape} "
                         f"{queries.dtype}, keys {keys.shape} {keys.dtype}, score "
                         f"{score.shape} (backend={gpu_backend()})")
    if tile not in TILES:
        raise ValueError(f"queue_fold: tile must be one of {TILES}, got {tile}")
    template = [("T", queries.dtype), ("D", D), ("G", Hq // Hk)]
    nt, kpt = tile
    grid = (B * Hk * nt, -(-M // (kpt * nt)), 1)
    rows = (Hq // Hk) * T
    # prm_f[0] is the scale (decode's parameter row, cached per scale)
    inputs = [queries, keys, mx.array(visible, mx.int32), params_f(float(scale))]
    f32, block = mx.float32, (nt, 1, 1)
    (part,) = _make_pass_kernel("partials", tile)(
        inputs=inputs, template=template, grid=grid, threadgroup=block,
        output_shapes=[(B * Hk, grid[1], rows, 2)], output_dtypes=[f32], init_value=poison)
    (lse,) = _make_pass_kernel("merge", tile)(
        inputs=[part], grid=(-(-B * Hk * rows // nt) * nt, 1, 1), threadgroup=block,
        output_shapes=[(B * Hk, rows)], output_dtypes=[f32], init_value=poison)
    score, count = _make_pass_kernel("fold", tile)(
        inputs=inputs + [lse, score, count], template=template, grid=grid,
        threadgroup=block, output_shapes=[(B, Hk, M)] * 2, output_dtypes=[f32, f32],
        init_value=poison)
    return score, count
