"""Fused decode attention with scores over quantized K/V (CUDA and Metal).

One kernel body for both backends, written against the shared prelude of
``kernels/source.py`` (macros for ids, barriers, shuffles, math). Each block
owns one query row (sequence, query head, query) and 256 threads:

1. logits: thread-per-key, each thread reads its key's packed words, scales
   and biases and dequantizes in registers (scale * code + bias, float32);
   logits go out as they are computed, with a running (max, sum) per thread;
2. block reduction of (max, sum) (+ sink) into the row's lse;
3. p @ V: a warp per key, lanes split head_dim, p = exp(logit - lse) read
   back from the logits just written; partial rows summed across warps.

K/V come as up to two segments of slots (mixed precision; one on Metal,
``MAX_SEGMENTS``), each at its own bit width; slot order is segment 0 then
segment 1, like the reference. The slot count of each segment is read from
its array's shape and strides are read from the arrays, so the cache's
slices go in without a copy.
"""

import hashlib
import struct
from collections.abc import Sequence
from functools import cache
from string import Template

import mlx.core as mx

from .backend import gpu_backend
from .source import CUDA_HEADER, CUDA_IDS, METAL_HEADER, METAL_IDS

NT = 256
HEAD_DIMS = (64, 96, 128, 256)
MAX_L = 8
# Segments one launch reads. Metal binds at most 31 buffers a kernel (inputs,
# the shapes / strides the body reads, outputs): two segments need 32-37
# (tests/test_metal_check.py counts them), so a mixed cache on Metal attends
# by the dequantize path.
MAX_SEGMENTS = {"cuda": 2, "metal": 1}
SINGLE_PASS_N = 256  # up to here one launch; longer rows split their keys
MIN_SPLIT_KEYS = 128
TARGET_BLOCKS = 528  # four blocks per SM of a 132-SM H100
MAX_SPLITS = 128

QHEADER = r"""
#if defined(__METAL_VERSION__)
#define H2O_I2F(x) as_type<float>(x)
#else
#define H2O_I2F(x) __int_as_float(x)
#endif

// Dot of the shared query row with one packed key row; dequantized in registers.
template <int BITS, int D, int GS, typename W, typename S, typename Q>
H2O_FN float h2o_qdot(W w, S sc, S bz, i64 gst, Q qs) {
  constexpr int PW = 32 / BITS;
  constexpr unsigned MASKB = (1u << BITS) - 1u;
  float acc = 0.0f;
  // Groups one at a time keep a group's words (not the row's) in registers.
  for (int g = 0; g < D / GS; ++g) {
    const float s = static_cast<float>(sc[g * gst]);
    const float b = static_cast<float>(bz[g * gst]);
    H2O_UNROLL
    for (int i = 0; i < GS / PW; ++i) {
      const unsigned word = w[(g * GS) / PW + i];
      H2O_UNROLL
      for (int j = 0; j < PW; ++j) {
        const float c = static_cast<float>((word >> (j * BITS)) & MASKB);
        acc += qs[g * GS + i * PW + j] * (s * c + b);
      }
    }
  }
  return acc;
}

// acc[e] += p * v[d] for this lane's PER dims d = lane * PER + e.
template <int BITS, int GS, int PER, typename W, typename S>
H2O_FN void h2o_qaxpy(W w, S sc, S bz, i64 gst, int lane, float p, H2O_THREAD float* acc) {
  constexpr unsigned MASKB = (1u << BITS) - 1u;
  H2O_UNROLL
  for (int e = 0; e < PER; ++e) {
    const int d = lane * PER + e;
    const unsigned word = w[(d * BITS) / 32];
    const float c = static_cast<float>((word >> ((d * BITS) % 32)) & MASKB);
    const int g = d / GS;
    acc[e] += p * (static_cast<float>(sc[g * gst]) * c + static_cast<float>(bz[g * gst]));
  }
}
"""

BODY = Template(r"""
$IDS
  constexpr int NW = $NT / 32;
  constexpr int PER = D / 32;
  const int Lq = q_shape[2];
  const int Hq = q_shape[1];
  const int row = blk_x;
  const int l = row % Lq;
  const int hq = (row / Lq) % Hq;
  const int b = row / (Lq * Hq);
  const int hk = hq / G;
  const int n0 = k0w_shape[2];
  const int n1 = $N1;
  const int N = n0 + n1;
  const float scale = H2O_I2F(SCALE_BITS);  // a template constant: no per-call upload
  const i64 lrow = (i64)row * N;
  // Split `split` of S owns keys [lo, hi); S == 1 is the single pass.
  const int S = n_blk_y;
  const int split = blk_y;
  const int chunk = (N + S - 1) / S;
  const int lo = split * chunk;
  const int hi = H2O_MIN(N, lo + chunk);

  H2O_SHARED float qs[D];
  H2O_SHARED float red_m[NW];
  H2O_SHARED float red_l[NW];
  H2O_SHARED float o_s[NW * D];
  for (int d = tid; d < D; d += $NT) {
    qs[d] = static_cast<float>(q[b * q_strides[0] + hq * q_strides[1] + l * q_strides[2]
        + d * q_strides[3]]);
  }
$MASK_SETUP
  H2O_BARRIER();

  // (1) logits, thread per key.
  float m_run = -H2O_INF;
  float l_run = 0.0f;
  for (int n = lo + tid; n < hi; n += $NT) {
    float dot;
    if (n < n0) {
      dot = h2o_qdot<B0, D, GS>(
          k0w + b * k0w_strides[0] + hk * k0w_strides[1] + n * k0w_strides[2],
          k0s + b * k0s_strides[0] + hk * k0s_strides[1] + n * k0s_strides[2],
          k0b + b * k0b_strides[0] + hk * k0b_strides[1] + n * k0b_strides[2],
          (i64)k0s_strides[3], qs);
    } else {
$SEG1_QDOT
    }
    float x = dot * scale;
$MASK_APPLY
    logits[lrow + n] = x;
    if (x > m_run) {
      l_run = l_run * H2O_EXP(m_run - x) + 1.0f;
      m_run = x;
    } else if (x > -H2O_INF) {
      l_run += H2O_EXP(x - m_run);
    }
  }

  // (2) row lse: warp then block reduction of (max, sum).
  H2O_UNROLL
  for (int off = 16; off > 0; off >>= 1) {
    const float m2 = H2O_SHFL_XOR(m_run, off);
    const float l2 = H2O_SHFL_XOR(l_run, off);
    const float M = H2O_FMAX(m_run, m2);
    l_run = (m_run == -H2O_INF ? 0.0f : l_run * H2O_EXP(m_run - M))
        + (m2 == -H2O_INF ? 0.0f : l2 * H2O_EXP(m2 - M));
    m_run = M;
  }
  if (lane == 0) {
    red_m[warp] = m_run;
    red_l[warp] = l_run;
  }
  H2O_BARRIER_DEVICE();
  float M = -H2O_INF;
  for (int w = 0; w < NW; ++w) M = H2O_FMAX(M, red_m[w]);
$SINK_MAX
  const float shift = M == -H2O_INF ? 0.0f : M;
  float lsum = 0.0f;
  for (int w = 0; w < NW; ++w) {
    lsum += red_m[w] == -H2O_INF ? 0.0f : red_l[w] * H2O_EXP(red_m[w] - shift);
  }
$SINK_SUM
  const float lse_v = H2O_LOG(lsum) + shift;

  // (3) out = sum_n exp(logit_n - lse) v_n, a warp per key, U keys in flight.
  constexpr int U = 4;
  float acc[PER];
  H2O_UNROLL
  for (int e = 0; e < PER; ++e) acc[e] = 0.0f;
  for (int n0u = lo + warp; n0u < hi; n0u += NW * U) {
    float p[U];
    H2O_UNROLL
    for (int u = 0; u < U; ++u) {
      const int n = n0u + u * NW;
      const float x = n < hi ? logits[lrow + n] : -H2O_INF;
      p[u] = x == -H2O_INF ? 0.0f : H2O_EXP(x - lse_v);
    }
    H2O_UNROLL
    for (int u = 0; u < U; ++u) {
      const int n = n0u + u * NW;
      if (p[u] == 0.0f) continue;  // masked, past the end, or underflow: adds nothing
      if (n < n0) {
        h2o_qaxpy<B0, GS, PER>(
            v0w + b * v0w_strides[0] + hk * v0w_strides[1] + n * v0w_strides[2],
            v0s + b * v0s_strides[0] + hk * v0s_strides[1] + n * v0s_strides[2],
            v0b + b * v0b_strides[0] + hk * v0b_strides[1] + n * v0b_strides[2],
            (i64)v0s_strides[3], lane, p[u], acc);
      } else {
$SEG1_QAXPY
      }
    }
  }
  H2O_UNROLL
  for (int e = 0; e < PER; ++e) o_s[warp * D + lane * PER + e] = acc[e];
  H2O_BARRIER();
  for (int d = tid; d < D; d += $NT) {
    float s = 0.0f;
    for (int w = 0; w < NW; ++w) s += o_s[w * D + d];
$WRITE
  }
""")

# One split: the final row. Several: the split's normalised partial and lse.
WRITE_FINAL = """    out[(i64)row * D + d] = static_cast<T>(s);
    if (d == 0) lse[row] = lse_v;"""
WRITE_PARTIAL = """    part_o[((i64)row * S + split) * D + d] = s;
    if (d == 0) part_lse[(i64)row * S + split] = lse_v;"""

# Merge the S partials of a row (a block per row): weights exp(lse_s - lse).
MERGE = Template(r"""
$IDS
  const int row = blk_x;
  const int hq = (row / q_shape[2]) % q_shape[1];
  const int S = part_lse_shape[1];
  float M = -H2O_INF;
  for (int s = 0; s < S; ++s) M = H2O_FMAX(M, part_lse[(i64)row * S + s]);
$SINK_MAX
  const float shift = M == -H2O_INF ? 0.0f : M;
  float lsum = 0.0f;
  for (int s = 0; s < S; ++s) {
    const float x = part_lse[(i64)row * S + s];
    lsum += x == -H2O_INF ? 0.0f : H2O_EXP(x - shift);
  }
$SINK_SUM
  const float inv = 1.0f / (lsum > 0.0f ? lsum : 1.0f);
  for (int d = tid; d < D; d += $NT) {
    float o = 0.0f;
    for (int s = 0; s < S; ++s) {
      const float x = part_lse[(i64)row * S + s];
      if (x > -H2O_INF) o += part_o[((i64)row * S + s) * D + d] * H2O_EXP(x - shift);
    }
    out[(i64)row * D + d] = static_cast<T>(o * inv);
  }
  if (tid == 0) lse[row] = H2O_LOG(lsum) + shift;
""")

SEG1_QDOT = r"""
      const int m = n - n0;
      dot = h2o_qdot<B1, D, GS>(
          k1w + b * k1w_strides[0] + hk * k1w_strides[1] + m * k1w_strides[2],
          k1s + b * k1s_strides[0] + hk * k1s_strides[1] + m * k1s_strides[2],
          k1b + b * k1b_strides[0] + hk * k1b_strides[1] + m * k1b_strides[2],
          (i64)k1s_strides[3], qs);"""

SEG1_QAXPY = r"""
        const int m = n - n0;
        h2o_qaxpy<B1, GS, PER>(
          v1w + b * v1w_strides[0] + hk * v1w_strides[1] + m * v1w_strides[2],
          v1s + b * v1s_strides[0] + hk * v1s_strides[1] + m * v1s_strides[2],
          v1b + b * v1b_strides[0] + hk * v1b_strides[1] + m * v1b_strides[2],
          (i64)v1s_strides[3], lane, p[u], acc);"""

# Offset of this row's mask row; dims of size 1 broadcast, shapes right-aligned.
MASK_SETUP = r"""
  i64 moff = 0;
  i64 mst3 = 0;
  {
    const int nd = mask_ndim;
    i64 st[4];
    H2O_UNROLL
    for (int a = 0; a < 4; ++a) {
      const int i = a - (4 - nd);
      st[a] = (i < 0 || mask_shape[i] == 1) ? 0 : (i64)mask_strides[i];
    }
    mst3 = st[3];
    const int head = MH == 1 ? hq : (MH == 2 ? hk : 0);
    moff = b * st[0] + head * st[1] + l * st[2];
  }"""

MASK_APPLY = {
    "none": "",
    "causal": "    if (n > N - Lq + l) x = -H2O_INF;",
    "bool": "    if (!mask[moff + (i64)n * mst3]) x = -H2O_INF;",
    "add": "    x += static_cast<float>(mask[moff + (i64)n * mst3]);",
}
SINK_MAX = (
    "  const float sink = static_cast<float>(sinks[hq]);\n  M = H2O_FMAX(M, sink);"
)
SINK_SUM = "  lsum += H2O_EXP(sink - shift);"
SEG_NAMES = ("w", "s", "b")


def _prelude(backend: str):
    return (CUDA_HEADER, CUDA_IDS) if backend == "cuda" else (METAL_HEADER, METAL_IDS)


def kernel_source(backend: str, mask: str, sinks: bool, two: bool, split: bool = False):
    """(header, body, input names, output names) of pass 1 for these flags.

    With ``split`` the sinks join in the merge, not here.
    """
    header, ids = _prelude(backend)
    own_sinks = sinks and not split
    body = BODY.substitute(
        IDS=ids,
        NT=NT,
        N1="k1w_shape[2]" if two else "0",
        SEG1_QDOT=SEG1_QDOT if two else "      dot = 0.0f;",
        SEG1_QAXPY=SEG1_QAXPY if two else "",
        MASK_SETUP=MASK_SETUP if mask in ("bool", "add") else "",
        MASK_APPLY=MASK_APPLY[mask],
        SINK_MAX=SINK_MAX if own_sinks else "",
        SINK_SUM=SINK_SUM if own_sinks else "",
        WRITE=WRITE_PARTIAL if split else WRITE_FINAL,
    )
    inputs = ["q"] + [
        f"{x}{i}{c}" for i in range(1 + two) for x in "kv" for c in SEG_NAMES
    ]
    inputs += ["mask"] if mask in ("bool", "add") else []
    inputs += ["sinks"] if own_sinks else []
    outputs = ["logits", "part_o", "part_lse"] if split else ["out", "logits", "lse"]
    return header + QHEADER, body, inputs, outputs


def merge_source(backend: str, sinks: bool):
    header, ids = _prelude(backend)
    body = MERGE.substitute(
        IDS=ids,
        NT=NT,
        SINK_MAX=SINK_MAX if sinks else "",
        SINK_SUM=SINK_SUM if sinks else "",
    )
    inputs = ["q", "part_o", "part_lse"] + (["sinks"] if sinks else [])
    return header, body, inputs, ["out", "lse"]


def _build(backend, name, header, body, inputs, outputs):
    digest = hashlib.sha1(f"{header}\0{body}".encode()).hexdigest()[:10]
    make = mx.fast.cuda_kernel if backend == "cuda" else mx.fast.metal_kernel
    return make(
        name=f"{name}_{digest}",
        input_names=inputs,
        output_names=outputs,
        source=body,
        header=header,
        ensure_row_contiguous=False,
    )


@cache
def _make_quantized_kernel(mask: str, sinks: bool, two: bool, split: bool):
    """Pass 1 for these flags (built once), or None without a GPU backend."""
    backend = gpu_backend()
    if backend is None:
        return None
    name = f"h2o_qattn_{mask}_{int(sinks)}{int(two)}{int(split)}"
    return _build(backend, name, *kernel_source(backend, mask, sinks, two, split))


@cache
def _make_merge_kernel(sinks: bool):
    """The split merge (built once), or None without a GPU backend."""
    backend = gpu_backend()
    if backend is None:
        return None
    return _build(
        backend, f"h2o_qattn_merge_{int(sinks)}", *merge_source(backend, sinks)
    )


def choose_splits(N: int, rows: int) -> int:
    """Key splits per row: one pass up to SINGLE_PASS_N keys, else enough blocks
    to fill the GPU with at least MIN_SPLIT_KEYS keys per split."""
    if N <= SINGLE_PASS_N:
        return 1
    by_len = N // MIN_SPLIT_KEYS
    by_fill = -(-TARGET_BLOCKS // rows)
    return max(1, min(by_len, by_fill, MAX_SPLITS))


def _mask_kind(mask, L: int, Hq: int, Hk: int):
    """(kind, head mode, mask array or None)."""
    if mask is None or (isinstance(mask, str) and L == 1):
        return "none", 0, None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}: use None, 'causal' or an array")
        return "causal", 0, None
    heads = mask.shape[-3] if mask.ndim >= 3 else 1  # shapes are right-aligned
    mh = 0 if heads == 1 else (1 if heads == Hq else 2)
    return ("bool" if mask.dtype == mx.bool_ else "add"), mh, mask


def applies(queries: mx.array, keys: Sequence, values: Sequence, group_size: int) -> bool:
    """Whether ``fused_quantized_attention`` runs for these shapes (segments
    as there) on this machine's GPU backend."""
    Hq, L, D = queries.shape[1:]
    vdim = values[0][1].shape[-1] * group_size
    return (L <= MAX_L and D in HEAD_DIMS and vdim == D
            and len(keys) <= MAX_SEGMENTS.get(gpu_backend(), 0)
            and Hq % keys[0][0].shape[1] == 0)


def fused_quantized_attention(
    queries: mx.array,
    keys: Sequence,
    values: Sequence,
    *,
    scale: float,
    bits: Sequence[int],
    group_size: int,
    mask=None,
    sinks: mx.array | None = None,
):
    """(out, logits, lse) from the fused kernel, or None where it does not apply
    (no GPU backend, L > 8, head_dim not in HEAD_DIMS, more segments than
    MAX_SEGMENTS).

    keys/values: sequences of (w, scales, biases) segments; bits one per segment.
    """
    if not applies(queries, keys, values, group_size):
        return None
    B, Hq, L, D = queries.shape
    Hk = keys[0][0].shape[1]
    kind, mh, mask_arr = _mask_kind(mask, L, Hq, Hk)
    two = len(keys) == 2
    N = sum(k[0].shape[2] for k in keys)
    rows = B * Hq * L
    S = choose_splits(N, rows)
    kernel = _make_quantized_kernel(kind, sinks is not None, two, S > 1)  # applies(): built
    inputs = [queries] + [
        a for i in range(len(keys)) for t in (keys[i], values[i]) for a in t
    ]
    inputs += [] if mask_arr is None else [mask_arr]
    inputs += [sinks] if sinks is not None and S == 1 else []
    template = _template(queries.dtype, D, group_size, Hq // Hk, bits, mh, scale)
    launch = {"grid": (rows * NT, S, 1), "threadgroup": (NT, 1, 1), "template": template}
    if S == 1:
        return kernel(
            inputs=inputs,
            **launch,
            output_shapes=[(B, Hq, L, D), (B, Hq, L, N), (B, Hq, L)],
            output_dtypes=[queries.dtype, mx.float32, mx.float32],
        )
    logits, part_o, part_lse = kernel(
        inputs=inputs,
        **launch,
        output_shapes=[(B, Hq, L, N), (rows, S, D), (rows, S)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    out, lse = _merge_splits(queries, part_o, part_lse, sinks)
    return out, logits, lse


def _template(dtype, D, group_size, G, bits, mh, scale):
    """The pass-1 kernel's template: the scale travels as its float32 bits."""
    scale_bits = struct.unpack("<i", struct.pack("<f", scale))[0]
    return [("T", dtype), ("D", D), ("GS", group_size), ("G", G), ("B0", bits[0]),
            ("B1", bits[-1]), ("MH", mh), ("SCALE_BITS", scale_bits)]


def _merge_splits(queries, part_o, part_lse, sinks):
    """(out, lse) from the key splits' partial outputs and log-sum-exps."""
    B, Hq, L, D = queries.shape
    merge = _make_merge_kernel(sinks is not None)
    return merge(
        inputs=[queries, part_o, part_lse] + ([sinks] if sinks is not None else []),
        template=[("T", queries.dtype), ("D", D)],
        grid=(B * Hq * L * NT, 1, 1),
        threadgroup=(NT, 1, 1),
        output_shapes=[(B, Hq, L, D), (B, Hq, L)],
        output_dtypes=[queries.dtype, mx.float32],
    )
