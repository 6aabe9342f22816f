"""Write one decode token per (sequence, KV head) into its victim slot, in one launch.

An evicting decode step writes the new token into the slot its fold picked.
With built-in ops that is a ``put_along_axis`` per array: two for dense K/V,
and for quantized triples two ``mx.quantize`` + six scatters + two
``mx.dequantize`` before MLX's SDPA can read them. Decode on the H100 is host
bound (docs/DESIGN.md): each op costs ~5-9 us to build and encode,
so the quantized step's ~11 ops per layer, not its GPU time, made it ~0.67x
of the dense one. ``quantized_write`` does that write in one launch: it
quantizes the token as ``mx.quantize`` does (same formulas, float32, IEEE
division), writes the triples and, for the SDPA that follows, the dequantized
K/V of every slot (transient; freed once attended).

MLX custom kernels cannot write an input in place, so the outputs are new
buffers and every slot is copied: ~2 x (K+V packed) + dense bytes per layer
step (8-bit, 1K slots, 8 KV heads, D 128: ~8 MB, ~4 us at the H100's
2.4 TB/s). Dense K/V take two ``put_along_axis`` (no kernel: two ops).

Each output costs ~3 us of host time per launch (H100), so a group step writes K and V packed in one buffer (``packed_write``,
kernels/packed.py): 3 outputs instead of the triples' 8.

Shapes: keys/values (B, Hk, 1, D); index (B, Hk, 1, W) int32, the slot in
its first column (W = 1 for triples, D for a dense fold's broadcast victim);
stored triples (B, Hk, cap, D * bits / 32) uint32 and (B, Hk, cap, D / gs)
scales / biases of the keys' dtype, or one packed (B, Hk, cap, row_words)
uint32 buffer.
"""

from functools import lru_cache
from string import Template
from typing import NamedTuple, Optional

import mlx.core as mx

from .replay import replay_after_first
from .backend import gpu_backend, runs_on_gpu
from .build import _built_once, _prelude
from .decode import DTYPES
from .packed import row_words
from .quantized_reference import BITS, GROUP_SIZES

NT = 256

KV_HEADER = r"""
#if defined(__METAL_VERSION__)
#define H2O_DIV(a, b) metal::precise::divide((a), (b))
#define H2O_ROUND(x) metal::round(x)
#define H2O_FLT_MAX FLT_MAX
#else
#define H2O_DIV(a, b) __fdiv_rn((a), (b))
#define H2O_ROUND(x) roundf(x)
#define H2O_FLT_MAX 3.402823466e+38f
#endif
"""

# One thread per (row, slot, code word) of K (blk_y 0) or V (blk_y 1):
# neighbouring threads touch neighbouring words and dense values (coalesced).
# In the victim slot, the threads of a group each rescan the new token's
# group for its range and quantize their own word as mlx's affine quantize
# does (w_max starts at 0, as there); the others copy.
QUANT_BODY = Template(r"""
$IDS
  constexpr int WPR = D * BITS / 32;  // code words per row
  constexpr int SPR = D / GS;  // scales per row
  constexpr int GW = GS * BITS / 32;  // code words per group
  constexpr int PW = 32 / BITS;  // codes per word
  constexpr unsigned MASKB = (1u << BITS) - 1u;
  const float NBINS = static_cast<float>((1 << BITS) - 1);
  const i64 cap = ${FIRST}_shape[2];
  const i64 gid = (i64)blk_x * $NT + tid;
  if (gid >= (i64)${FIRST}_shape[0] * ${FIRST}_shape[1] * cap * WPR) return;
  const int j = (int)(gid % WPR);  // word in the row
  const int g = j / GW;  // its group
  const i64 rs = gid / WPR;  // row * cap + slot
  const i64 r = rs / cap;
  const bool is_v = blk_y == 1;
$ROWS
  const bool first = (j % GW) == 0;  // writes the group's scale and bias
  float sc, bi;
  unsigned word = 0u;
  if ((rs % cap) == (i64)idx[r * IDXW]) {
    auto x_in = (is_v ? vn : kn) + r * D + g * GS;
    float w_min = H2O_FLT_MAX;
    float w_max = 0.0f;
    H2O_UNROLL
    for (int i = 0; i < GS; ++i) {
      const float x = static_cast<float>(x_in[i]);
      w_min = H2O_MIN(w_min, x);
      w_max = H2O_FMAX(w_max, x);
    }
    float scale = H2O_FMAX(H2O_DIV(w_max - w_min, NBINS), 1e-7f);
    const bool side = H2O_FABS(w_min) > H2O_FABS(w_max);
    scale = side ? scale : -scale;
    const float edge = side ? w_min : w_max;
    const float q0 = H2O_ROUND(H2O_DIV(edge, scale));
    const bool at_zero = q0 == 0.0f;
    scale = at_zero ? scale : H2O_DIV(edge, q0);
    const float bias = at_zero ? 0.0f : edge;
    const int i0 = (j % GW) * PW;  // this word's first value in the group
    H2O_UNROLL
    for (int e = 0; e < PW; ++e) {
      const float c = H2O_ROUND(H2O_DIV(static_cast<float>(x_in[i0 + e]) - bias, scale));
      word |= ((unsigned)H2O_FMAX(0.0f, H2O_MIN(c, NBINS))) << (e * BITS);
    }
    const T s_ = static_cast<T>(scale);
    const T b_ = static_cast<T>(bias);
    if (first) {
      s_out[g] = s_;
      b_out[g] = b_;
    }
    sc = static_cast<float>(s_);
    bi = static_cast<float>(b_);
  } else {
    const T s_ = s_in[g];
    const T b_ = b_in[g];
    if (first) {
      s_out[g] = s_;
      b_out[g] = b_;
    }
    word = w_in[j];
    sc = static_cast<float>(s_);
    bi = static_cast<float>(b_);
  }
  w_out[j] = word;
$DENSE
""")

# Where a row's codes, scales and biases are read and written: six triples ...
TRIPLE_ROWS = r"""
  auto w_in = (is_v ? vw : kw) + rs * WPR;
  auto s_in = (is_v ? vs : ks) + rs * SPR;
  auto b_in = (is_v ? vb : kb) + rs * SPR;
  auto w_out = (is_v ? vw_out : kw_out) + rs * WPR;
  auto s_out = (is_v ? vs_out : ks_out) + rs * SPR;
  auto b_out = (is_v ? vb_out : kb_out) + rs * SPR;
"""
# ... or one packed buffer (kernels/packed.py): [K codes | V codes | K scales,
# K biases | V scales, V biases], the scales and biases stored as T.
PACKED_ROWS = r"""
  constexpr int RW = 2 * WPR + SPR * (int)sizeof(T);  // words per packed row
  auto w_in = kv + rs * RW + (is_v ? WPR : 0);
  auto s_in = reinterpret_cast<const H2O_DEVICE T*>(kv + rs * RW + 2 * WPR) + (is_v ? 2 * SPR : 0);
  auto b_in = s_in + SPR;
  auto w_out = kv_out + rs * RW + (is_v ? WPR : 0);
  auto s_out = reinterpret_cast<H2O_DEVICE T*>(kv_out + rs * RW + 2 * WPR) + (is_v ? 2 * SPR : 0);
  auto b_out = s_out + SPR;
"""

# This word's values as mx.dequantize gives them (scale * code + bias, one
# rounding to T), for MLX's SDPA.
DENSE_OUT = r"""
  auto d_out = (is_v ? vd : kd) + rs * D + j * PW;
  H2O_UNROLL
  for (int e = 0; e < PW; ++e) {
    const float c = static_cast<float>((word >> (e * BITS)) & MASKB);
    d_out[e] = static_cast<T>(sc * c + bi);
  }
"""

def names(dense_out: bool = True, packed: bool = False):
    """Input and output names of the write kernel (``packed``: one buffer for
    the quantized K and V, kernels/packed.py)."""
    stored = ["kv"] if packed else ["kw", "ks", "kb", "vw", "vs", "vb"]
    outputs = [f"{t}_out" for t in stored] + (["kd", "vd"] if dense_out else [])
    return ["kn", "vn", "idx", *stored], outputs


def source(backend: str, dense_out: bool = True, packed: bool = False):
    """(header, body) of the write kernel."""
    header, ids = _prelude(backend)
    body = QUANT_BODY.substitute(
        IDS=ids, NT=NT, DENSE=DENSE_OUT if dense_out else "",
        FIRST="kv" if packed else "kw", ROWS=PACKED_ROWS if packed else TRIPLE_ROWS)
    return header + KV_HEADER, body


@lru_cache(maxsize=None)
def _make_write_kernel(dense_out: bool = True, packed: bool = False):
    """The write kernel, or None without a GPU backend. Inputs are made
    row-contiguous (they are indexed flat; cache buffers already are)."""
    backend = gpu_backend()
    if backend is None:
        return None
    kind = f"{'p' if packed else 'q'}{int(dense_out)}"
    return _built_once(backend, f"h2o_kvwrite_{kind}", names(dense_out, packed),
                       *source(backend, dense_out, packed))


def write_supported(keys: mx.array, values: mx.array, index: mx.array, bits: int,
                    group_size: int = 64) -> bool:
    """Whether the write kernel runs here for these shapes."""
    B, Hk, L, D = keys.shape
    return (runs_on_gpu() and L == 1
            and keys.dtype in DTYPES and values.dtype == keys.dtype
            and values.shape == keys.shape
            and bits in BITS and group_size in GROUP_SIZES and D % group_size == 0
            and index.shape[:3] == (B, Hk, 1) and index.dtype == mx.int32)


class QuantizedWrite(NamedTuple):
    keys: tuple  # (w, scales, biases), the token written
    values: tuple
    dense_keys: Optional[mx.array]  # (B, Hk, cap, D) dequantized, or None
    dense_values: Optional[mx.array]


class WritePlan:
    """The write for fixed settings; calls replay a recorded launch (host time)."""

    def __init__(self, dtype, D, bits, group_size=64, dense_out=True, packed=False):
        self.dense_out, self.bits = dense_out, bits
        self.kernel = _make_write_kernel(dense_out, packed)
        self.dtype, self.D = dtype, D
        self.template = [("T", dtype), ("D", D), ("BITS", bits), ("GS", group_size)]
        replay_after_first(self, "_steady", self._launch)

    def __call__(self, *arrays):
        return self._steady(*arrays)

    def _launch(self, kn, vn, idx, *stored, poison=None):
        """One launch (``poison``, tests: what an unwritten output element reads)."""
        B, Hk, cap = stored[0].shape[:3]
        per_row = self.D * self.bits // 32  # threads: one per code word
        threads = -(-B * Hk * cap * per_row // NT) * NT
        template = self.template + [("IDXW", idx.shape[-1])]
        shapes = [a.shape for a in stored]
        dtypes = [a.dtype for a in stored]
        if self.dense_out:
            shapes += [(B, Hk, cap, self.D)] * 2
            dtypes += [self.dtype] * 2
        return self.kernel(inputs=[kn, vn, idx, *stored], template=template,
                           grid=(threads, 2, 1), threadgroup=(NT, 1, 1),
                           output_shapes=shapes, output_dtypes=dtypes, init_value=poison)


@lru_cache(maxsize=32)
def write_plan(dtype, D, bits, group_size=64, dense_out=True, packed=False) -> WritePlan:
    return WritePlan(dtype, D, bits, group_size, dense_out, packed)


def _check(keys, values, index, bits, group_size):
    if not write_supported(keys, values, index, bits, group_size):
        raise ValueError(
            f"kv write kernel: not supported here for keys {keys.shape} {keys.dtype}, "
            f"values {values.shape} {values.dtype}, index {index.shape} {index.dtype}, "
            f"bits={bits}, group_size={group_size} (backend={gpu_backend()}, "
            f"device={mx.default_device()})")


def quantized_write(keys, values, index, stored_keys, stored_values, *, bits: int,
                    group_size: int, dense_out: bool = True) -> QuantizedWrite:
    """Quantize one token per row and write it into slot ``index`` of the
    stored triples; with ``dense_out`` also every slot dequantized (T)."""
    _check(keys, values, index, bits, group_size)
    plan = write_plan(keys.dtype, keys.shape[3], bits, group_size, dense_out)
    res = plan(keys, values, index, *stored_keys, *stored_values)
    dense = (res[6], res[7]) if dense_out else (None, None)
    return QuantizedWrite(tuple(res[:3]), tuple(res[3:6]), *dense)


def packed_write(keys, values, index, stored, *, bits: int, group_size: int,
                 dense_out: bool = True):
    """``quantized_write`` for a packed K/V buffer (kernels/packed.py): returns
    (packed buffer, dense keys, dense values) or, without ``dense_out``, the
    buffer alone."""
    _check(keys, values, index, bits, group_size)
    D = keys.shape[3]
    if stored.dtype != mx.uint32 or stored.shape[-1] != row_words(D, bits, group_size,
                                                                   keys.dtype):
        raise ValueError(f"packed_write: stored {stored.shape} {stored.dtype} is not a "
                         f"packed buffer of D={D}, bits={bits}, group_size={group_size}, "
                         f"{keys.dtype} (kernels/packed.py: pack)")
    plan = write_plan(keys.dtype, D, bits, group_size, dense_out, True)
    res = plan(keys, values, index, stored)
    return tuple(res) if dense_out else res[0]
