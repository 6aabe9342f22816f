"""Kernel source text: one body for CUDA and Metal behind a small prelude.

Decode attention (Lq <= 8) that exports logits and lse, as two passes:
pass 1 gives each block one (sequence, KV head, row tile, key split) and
reads every K/V row of its split once for all query rows of the GQA group
(a warp reads a key row, each lane a slice; a reduce-scatter leaves each
lane one (row, key) logit; each warp runs its own online softmax);
pass 2 merges the splits. With one split, pass 1 writes the result itself.
The H2O fold (score update + next victim) runs after the merge, in the block
that sees all keys of a (sequence, KV head): pass 1 with one split, else
pass 2.

Template constants (set per call): T dtype; D head dim; R rows per block;
L queries per head; G query heads per KV head; HK KV heads; TPK lanes per
key row (32, 16 or 8: a warp reads 32 / TPK rows at once); EPL elements per lane;
U key rows per lane group iteration; MH mask head mode (0 broadcast, 1 per
query head, 2 per KV head); MODE score mode (a ``kernel_id`` of
mlx_h2o/scores.py; FOLD branches on it). Blocks have NT = 128 threads.
"""

NT = 128

# Backend-neutral macros of both preludes (they use only other H2O_ macros).
ROW_MACROS = r"""
#define H2O_ROW_HQ(r) (hk * G + (rt * R + (r)) / L)
#define H2O_ROW_L(r) ((rt * R + (r)) % L)
// One reduce-scatter level over x[0 .. 2 * HALF) across lanes `lane ^ M`:
// a lane keeps the half its bit selects and adds the partner's copy of it
// (HALF == 0: the values are already scattered, plain butterfly add).
#define H2O_RS(M, HALF)                                                  \
  if ((HALF) > 0) {                                                      \
    const bool up_ = (lane & (M)) != 0;                                  \
    H2O_UNROLL                                                           \
    for (int i_ = 0; i_ < (HALF); ++i_) {                                \
      const float lo_ = x[i_];                                           \
      const float hi_ = x[i_ + (HALF)];                                  \
      const float got_ = H2O_SHFL_XOR(up_ ? lo_ : hi_, (M));             \
      x[i_] = (up_ ? hi_ : lo_) + got_;                                  \
    }                                                                    \
  } else {                                                               \
    x[0] += H2O_SHFL_XOR(x[0], (M));                                     \
  }
""".lstrip("\n")

# Per-backend preludes: the header part (macros, vector fetch) and the ids
# part, which must sit in the body so MLX sees the Metal attribute names.
CUDA_HEADER = r"""
#define H2O_FN __device__ __forceinline__
#define H2O_MIN(a, b) min((a), (b))
typedef long long i64;
""" + ROW_MACROS + r"""#define H2O_SHARED __shared__
#define H2O_DEVICE
#define H2O_THREAD
#define H2O_BARRIER() __syncthreads()
#define H2O_BARRIER_DEVICE() __syncthreads()
#define H2O_SHFL_XOR(x, m) __shfl_xor_sync(0xffffffffu, (x), (m))
#define H2O_SHFL(x, src) __shfl_sync(0xffffffffu, (x), (src))
#define H2O_EXP(x) expf(x)
#define H2O_LOG(x) logf(x)
#define H2O_FABS(x) fabsf(x)
#define H2O_FMAX(a, b) fmaxf((a), (b))
#define H2O_INF __int_as_float(0x7f800000)
#define H2O_F2I(x) __float_as_int(x)
#define H2O_ALIGNED16(p) ((reinterpret_cast<unsigned long long>(p) & 15ull) == 0)
#define H2O_UNROLL _Pragma("unroll")
#define H2O_UNROLL_N(n) _Pragma(H2O_STR(unroll n))
#define H2O_STR(x) #x

// E elements of T as raw words of up to 16 bytes: loads stay as wide as a
// lane's slice allows (4, 8, 16 or 2 x 16 bytes).
template <int BYTES> struct H2OWord { typedef uint4 type; static constexpr int n = BYTES / 16; };
template <> struct H2OWord<8> { typedef uint2 type; static constexpr int n = 1; };
template <> struct H2OWord<4> { typedef unsigned int type; static constexpr int n = 1; };

template <typename T, int E>
struct H2ORaw {
  typedef H2OWord<E * (int)sizeof(T)> W;
  typename W::type w[W::n];
};

template <int E, typename T>
H2O_FN void h2o_fetch(const T* p, i64 st, bool vec, H2ORaw<T, E>& r) {
  typedef typename H2ORaw<T, E>::W W;
  if (vec) {
    H2O_UNROLL
    for (int c = 0; c < W::n; ++c) r.w[c] = reinterpret_cast<const typename W::type*>(p)[c];
  } else {
    T* x = reinterpret_cast<T*>(r.w);
    H2O_UNROLL
    for (int i = 0; i < E; ++i) x[i] = p[i * st];
  }
}

template <int E, typename T>
H2O_FN void h2o_zero(H2ORaw<T, E>& r) {
  typedef typename H2ORaw<T, E>::W W;
  H2O_UNROLL
  for (int c = 0; c < W::n; ++c) r.w[c] = typename W::type{};
}

template <int E, typename T>
H2O_FN void h2o_cvt(const H2ORaw<T, E>& r, float* out) {
  const T* x = reinterpret_cast<const T*>(r.w);
  H2O_UNROLL
  for (int i = 0; i < E; ++i) out[i] = static_cast<float>(x[i]);
}
"""

CUDA_IDS = r"""
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int blk_x = blockIdx.x;
  const int blk_y = blockIdx.y;
  const int n_blk_y = gridDim.y;
"""

METAL_HEADER = r"""
#define H2O_FN inline
#define H2O_MIN(a, b) metal::min((a), (b))
typedef long i64;
""" + ROW_MACROS + r"""#define H2O_SHARED threadgroup
#define H2O_DEVICE device
#define H2O_THREAD thread
#define H2O_BARRIER() threadgroup_barrier(metal::mem_flags::mem_threadgroup)
#define H2O_BARRIER_DEVICE() \
  threadgroup_barrier(metal::mem_flags::mem_device | metal::mem_flags::mem_threadgroup)
#define H2O_SHFL_XOR(x, m) metal::simd_shuffle_xor((x), (ushort)(m))
#define H2O_SHFL(x, src) metal::simd_shuffle((x), (ushort)(src))
#define H2O_EXP(x) metal::precise::exp(x)
#define H2O_LOG(x) metal::precise::log(x)
#define H2O_FABS(x) metal::fabs(x)
#define H2O_FMAX(a, b) metal::fmax((a), (b))
#define H2O_INF INFINITY
#define H2O_F2I(x) as_type<int>(x)
#define H2O_ALIGNED16(p) true
#define H2O_UNROLL _Pragma("clang loop unroll(full)")
#define H2O_UNROLL_N(n) _Pragma(H2O_STR(clang loop unroll_count(n)))
#define H2O_STR(x) #x

template <typename T, int E>
struct H2ORaw {
  T w[E];
};

template <int E, typename T>
H2O_FN void h2o_fetch(const device T* p, i64 st, bool vec, thread H2ORaw<T, E>& r) {
  if (vec) {
    H2O_UNROLL
    for (int i = 0; i < E; ++i) r.w[i] = p[i];
  } else {
    H2O_UNROLL
    for (int i = 0; i < E; ++i) r.w[i] = p[i * st];
  }
}

template <int E, typename T>
H2O_FN void h2o_zero(thread H2ORaw<T, E>& r) {
  H2O_UNROLL
  for (int i = 0; i < E; ++i) r.w[i] = T(0);
}

template <int E, typename T>
H2O_FN void h2o_cvt(thread const H2ORaw<T, E>& r, thread float* out) {
  H2O_UNROLL
  for (int i = 0; i < E; ++i) out[i] = static_cast<float>(r.w[i]);
}
"""

METAL_IDS = r"""
  const int tid = int(thread_position_in_threadgroup.x);
  const int lane = int(thread_index_in_simdgroup);
  const int warp = int(simdgroup_index_in_threadgroup);
  const int blk_x = int(threadgroup_position_in_grid.x);
  const int blk_y = int(threadgroup_position_in_grid.y);
  const int n_blk_y = int(threadgroups_per_grid.y);
"""

# ---------------------------------------------------------------------------
# Shared body pieces. $NAME markers are filled by kernels/build.py.

# Logit masking, run by the lane that owns row r of key `key`.
MASK_CAUSAL = "if (key > N - L + H2O_ROW_L(r)) x_ = -H2O_INF;"
MASK_BOOL = "if (!mask[moff + (i64)key * mst3]) x_ = -H2O_INF;"
MASK_ADD = "x_ += static_cast<float>(mask[moff + (i64)key * mst3]);"
# Fused step: the new token sits in slot w at position Q; a sliding window
# hides positions <= Q - window.
MASK_WINDOW = "if (window > 0 && kpos <= Q - window) x_ = -H2O_INF;"
# Fused step over rows at different fill levels: a row sees the tokens it
# holds (slots at position -1 hold none) up to its own query, and a row
# without a token this step (Q == -1) sees nothing.
MASK_ROWS = "if (kpos < 0 || kpos > Q || (window > 0 && kpos <= Q - window)) x_ = -H2O_INF;"

# Offset of the mask row of this lane's (row, key); size-1 dims broadcast.
MASK_SETUP = r"""
  i64 moff;
  i64 mst3;
  {
    const int nd = mask_ndim;
    i64 st[4];
    H2O_UNROLL
    for (int a = 0; a < 4; ++a) {
      const int i = a - (4 - nd);
      st[a] = (i < 0 || mask_shape[i] == 1) ? 0 : (i64)mask_strides[i];
    }
    mst3 = st[3];
    const int r = my_r < R ? my_r : 0;  // the row this lane masks
    const int head = MH == 1 ? H2O_ROW_HQ(r) : (MH == 2 ? hk : 0);
    moff = b * st[0] + head * st[1] + H2O_ROW_L(r) * st[2];
  }
"""

# The fused step's integer parameters: $PRM is the launch's prm_i (one
# sequence or rows that share an offset) or row b's own 8 of them (rows at
# different fill levels, kernels/h2o_step.py ROW_PARAMS); $FLAGS (0 for
# one launch-wide row) says whether the row has no token this step (1), takes
# its lowest empty slot next instead of a victim (2), and holds empty slots
# (4: never a victim).
FUSED_SETUP = r"""
  const int flags = $FLAGS;
  const int offset = $PRM[0];
  const int Q = (flags & 1) ? -1 : offset - 1;
  const int window = $PRM[2];
  const int w = (flags & 1) ? -1
      : $PRM[1] >= 0 ? $PRM[1]
      : slot[b * slot_strides[0] + hk * slot_strides[1]];
  const i64 pbase = b * pos_in_strides[0] + hk * pos_in_strides[1];
  const i64 pst = pos_in_strides[2];
"""

FUSED_KPOS = "const int kpos = key == w ? Q : pos_in[pbase + key * pst];"

# A pass-1 block's (sequence b, KV head hk, row tile rt) and the keys
# [n0, n1) of its split, in multiples of STEP (both pass-1 kernels).
PASS1_RANGE = r"""
  const int unit = blk_x;
  const int rt = unit % RT;
  const int b = unit / (RT * HK);
  const int hk = (unit / RT) % HK;
  const int NS = k_shape[2];  // slots in the K/V buffer: the logits row stride
  const int N = $NVALID;  // keys attended (the fused step may pass a longer buffer)
  const int S = n_blk_y;
  const int split = blk_y;
  int chunk = (N + S - 1) / S;
  chunk = (chunk + STEP - 1) / STEP * STEP;
  const int n0 = split * chunk;
  const int n1 = H2O_MIN(N, n0 + chunk);
  const float scale = prm_f[0];
""".lstrip("\n")

# Row strides of K / V and whether 16-byte loads can read them (the last
# axis contiguous, rows aligned; else element loads; both pass-1 kernels).
KV_VEC = r"""
  const i64 ks = k_strides[2];
  const i64 vs = v_strides[2];
  constexpr int VEC = 16 / (int)sizeof(T);
  const bool kvec = k_strides[3] == 1 && H2O_ALIGNED16(k) && k_strides[0] % VEC == 0
      && k_strides[1] % VEC == 0 && ks % VEC == 0;
  const bool vvec = v_strides[3] == 1 && H2O_ALIGNED16(v) && v_strides[0] % VEC == 0
      && v_strides[1] % VEC == 0 && vs % VEC == 0;
""".lstrip("\n")

PASS1 = r"""
$IDS
  constexpr int NT = 128;
  constexpr int NG = NT / 32;       // warps
  constexpr int KPR = 32 / TPK;     // key rows a warp reads at once: TPK lanes a row
  constexpr int STEP = NG * U * KPR;  // keys per block iteration
  constexpr int RT = G * L / R;     // row tiles per KV head
  // The R x U logits of a key group's iteration are reduced across its TPK
  // lanes so that each lane ends with one (row, key): li >> SH is its index.
  constexpr int RP = R <= 1 ? 1 : (R <= 2 ? 2 : (R <= 4 ? 4 : 8));
  constexpr int V = RP * U;
  constexpr int LT = TPK == 32 ? 5 : (TPK == 16 ? 4 : 3);  // log2 TPK
  constexpr int SH = LT - (V >= 32 ? 5 : (V >= 16 ? 4 : (V >= 8 ? 3 : (V >= 4 ? 2 : 1))));
  constexpr int LOGU = U >= 8 ? 3 : (U >= 4 ? 2 : (U >= 2 ? 1 : 0));

  const int grp = warp;
  const int li = lane % TPK;  // lane in its key group
  const int kg = lane / TPK;  // key group: reads keys base + u * KPR + kg
  const bool lane_on = li * EPL < D;
  const int my_r = (li >> SH) / U;  // the (row, key) this lane owns after a reduction
  const int my_u = (li >> SH) % U;
  const bool owner = (li & ((1 << SH) - 1)) == 0;  // first of its replicas
$RANGE
  // Row r of this block is query head H2O_ROW_HQ(r), query H2O_ROW_L(r).
$MASK_SETUP
$FUSED_SETUP

  float qf[R][EPL];
  H2O_UNROLL
  for (int r = 0; r < R; ++r) {
    H2O_UNROLL
    for (int e = 0; e < EPL; ++e) {
      const int d = li * EPL + e;
      qf[r][e] = lane_on ? static_cast<float>(q[b * q_strides[0] + H2O_ROW_HQ(r) * q_strides[1]
          + H2O_ROW_L(r) * q_strides[2] + d * q_strides[3]]) : 0.0f;
    }
  }

  const i64 kbase = b * k_strides[0] + hk * k_strides[1] + li * EPL * k_strides[3];
  const i64 vbase = b * v_strides[0] + hk * v_strides[1] + li * EPL * v_strides[3];
$KV_VEC
  H2O_SHARED float gm_s[NG * R];
  H2O_SHARED float gl_s[NG * R];
  H2O_SHARED float m_s[R];
  H2O_SHARED float l_s[R];
  H2O_SHARED float red[NT * EPL];

  // Each warp runs its own online softmax over its keys (no block barriers
  // in the loop); lanes keep m / l of the row they own, acc for all rows.
  float m_run = -H2O_INF;
  float l_run = 0.0f;
$SINK_INIT
  float acc[R][EPL];
  H2O_UNROLL
  for (int r = 0; r < R; ++r) {
    H2O_UNROLL
    for (int e = 0; e < EPL; ++e) acc[r][e] = 0.0f;
  }

  for (int base = n0 + grp * U * KPR; base < n1; base += STEP) {
    // K and V rows of this iteration go out together: one memory round trip.
    H2ORaw<T, EPL> kr[U];
    H2ORaw<T, EPL> vr[U];
    H2O_UNROLL
    for (int u = 0; u < U; ++u) {
      const int key = base + u * KPR + kg;
      if (key < n1 && lane_on) {
        h2o_fetch<EPL>(k + kbase + key * ks, k_strides[3], kvec, kr[u]);
        h2o_fetch<EPL>(v + vbase + key * vs, v_strides[3], vvec, vr[u]);
      } else {
        h2o_zero<EPL>(kr[u]);
        h2o_zero<EPL>(vr[u]);
      }
    }
    // Partial dots of this lane's slice, then a reduce-scatter over the key group.
    float x[V];
    H2O_UNROLL
    for (int u = 0; u < U; ++u) {
      float kf[EPL];
      h2o_cvt<EPL>(kr[u], kf);
      H2O_UNROLL
      for (int r = 0; r < RP; ++r) {
        float s = 0.0f;
        if (r < R) {
          H2O_UNROLL
          for (int e = 0; e < EPL; ++e) s += qf[r][e] * kf[e];
        }
        x[r * U + u] = s;
      }
    }
    if (TPK == 32) {
      H2O_RS(16, V / 2);
    }
    if (TPK >= 16) {
      H2O_RS(8, V >> (LT - 3));
    }
    H2O_RS(4, V >> (LT - 2));
    H2O_RS(2, V >> (LT - 1));
    H2O_RS(1, V >> LT);
    const int key = base + my_u * KPR + kg;
    const int r = my_r;
    float x_ = -H2O_INF;
    if (key < n1 && r < R) {
$FUSED_KPOS
      x_ = x[0] * scale;
$MASK_APPLY
      if (owner) {
        logits[((i64)(b * HK * G + H2O_ROW_HQ(r)) * L + H2O_ROW_L(r)) * NS + key] = x_;
      }
    }
    // Online softmax of the row over its U * KPR keys (lanes that differ in
    // the key bits, then in the key group).
    float mx = x_;
    H2O_UNROLL
    for (int j = 0; j < LOGU; ++j) mx = H2O_FMAX(mx, H2O_SHFL_XOR(mx, 1 << (SH + j)));
    H2O_UNROLL
    for (int j = LT; j < 5; ++j) mx = H2O_FMAX(mx, H2O_SHFL_XOR(mx, 1 << j));
    const float m_new = H2O_FMAX(m_run, mx);
    const float shift = m_new == -H2O_INF ? 0.0f : m_new;
    const float alpha = m_run == -H2O_INF ? 0.0f : H2O_EXP(m_run - m_new);
    const float p = H2O_EXP(x_ - shift);
    float ps = p;
    H2O_UNROLL
    for (int j = 0; j < LOGU; ++j) ps += H2O_SHFL_XOR(ps, 1 << (SH + j));
    H2O_UNROLL
    for (int j = LT; j < 5; ++j) ps += H2O_SHFL_XOR(ps, 1 << j);
    l_run = l_run * alpha + ps;
    m_run = m_new;
    // Every lane needs every row's alpha and p for its slice of acc.
    H2O_UNROLL
    for (int rr = 0; rr < R; ++rr) {
      const float a = H2O_SHFL(alpha, (rr * U) << SH);
      H2O_UNROLL
      for (int e = 0; e < EPL; ++e) acc[rr][e] *= a;
    }
    H2O_UNROLL
    for (int u = 0; u < U; ++u) {
      float vf[EPL];
      h2o_cvt<EPL>(vr[u], vf);
      H2O_UNROLL
      for (int rr = 0; rr < R; ++rr) {
        const float pr = H2O_SHFL(p, kg * TPK + ((rr * U + u) << SH));
        H2O_UNROLL
        for (int e = 0; e < EPL; ++e) acc[rr][e] += pr * vf[e];
      }
    }
  }

  // Key groups hold sums over their own keys of the same slice: add them.
  H2O_UNROLL
  for (int j = LT; j < 5; ++j) {
    H2O_UNROLL
    for (int r = 0; r < R; ++r) {
      H2O_UNROLL
      for (int e = 0; e < EPL; ++e) acc[r][e] += H2O_SHFL_XOR(acc[r][e], 1 << j);
    }
  }
  // Merge the warps: row max over warps, each warp's sum rescaled to it.
  if (owner && my_u == 0 && my_r < R && kg == 0) {
    gm_s[grp * R + my_r] = m_run;
    gl_s[grp * R + my_r] = l_run;
  }
  H2O_UNROLL
  for (int r = 0; r < R; ++r) {
    H2O_BARRIER();
    float M = -H2O_INF;
    for (int j = 0; j < NG; ++j) M = H2O_FMAX(M, gm_s[j * R + r]);
    const float gm = gm_s[grp * R + r];
    const float mine = gm == -H2O_INF ? 0.0f : H2O_EXP(gm - M);
    H2O_UNROLL
    for (int e = 0; e < EPL; ++e) red[tid * EPL + e] = acc[r][e] * mine;
    if (tid == 0) {
      float lsum = 0.0f;
      for (int j = 0; j < NG; ++j) {
        const float mj = gm_s[j * R + r];
        lsum += mj == -H2O_INF ? 0.0f : gl_s[j * R + r] * H2O_EXP(mj - M);
      }
      m_s[r] = M;
      l_s[r] = lsum;
    }
    H2O_BARRIER();
    for (int d = tid; d < D; d += NT) {
      float s = 0.0f;
      for (int j = 0; j < NG; ++j) s += red[j * 32 * EPL + d];
$WRITE_ROW
    }
  }
$TAIL
"""

# Pass-1 row output with one split: normalised out, lse.
WRITE_FINAL = r"""
      const i64 orow = (i64)(b * HK * G + H2O_ROW_HQ(r)) * L + H2O_ROW_L(r);
      const float lsum = l_s[r];
      out[orow * D + d] = static_cast<T>(s / (lsum > 0.0f ? lsum : 1.0f));
      if (d == 0) {
        const float m = m_s[r];
        lse[orow] = H2O_LOG(lsum) + (m == -H2O_INF ? 0.0f : m);
      }
"""

# Pass-1 row output with several splits: unnormalised partials.
WRITE_PARTIAL = r"""
      const i64 prow = ((i64)unit * S + split) * R + r;
      part_o[prow * D + d] = s;
      if (d == 0) {
        part_ml[prow * 2] = m_s[r];
        part_ml[prow * 2 + 1] = l_s[r];
      }
"""

SINK_INIT_PASS1 = r"""
  if (grp == 0 && my_r < R) {  // the sink column counts once, in warp 0
    m_run = static_cast<float>(sinks[H2O_ROW_HQ(my_r)]);
    l_run = 1.0f;
  }
"""

# Pass 2: merge S partials per row: one block per row of a (sequence, KV
# head, row tile), or, fused, per (sequence, KV head) looping over its rows;
# then the optional fold. Every warp finds a row's max and sum itself (lanes
# over splits, no barrier); warp j sums the outputs of splits j, j + NG, ...
# (lane: elements lane + 32 i), and the warps' sums meet in shared memory.
# A serial loop over the splits, 8 blocks at B=1, cost ~20 us at S = 64
# (docs/DESIGN.md).
PASS2 = r"""
$IDS
  constexpr int NT = 128;
  constexpr int NG = NT / 32;
  constexpr int RT = G * L / R;
  constexpr int DL = (D + 31) / 32;  // output elements per lane
$FUSED_ROWS
  const int S = part_ml_shape[1];
  H2O_SHARED float red_o[NG * D];
  H2O_SHARED float lse_sh[G * L];
  const int i0 = FUSED_ROWS ? blk_x * RT * R : blk_x;  // item = unit * R + row
  const int ni = FUSED_ROWS ? RT * R : 1;
  for (int ii = 0; ii < ni; ++ii) {
    const int unit = (i0 + ii) / R;
    const int r = (i0 + ii) % R;
    const int rt = unit % RT;
    const int b = unit / (RT * HK);
    const int hk = (unit / RT) % HK;
    {
      const int gr = rt * R + r;
      const int hq = hk * G + gr / L;
      const int l = gr % L;
      const i64 base = (i64)unit * S * R + r;  // + s * R
      // Warp w's outputs of splits 32 I + w + NG jj (lane: elements lane + 32 e).
#define H2O_SPLIT_O(I)                                                          \
      H2O_UNROLL                                                                \
      for (int jj = 0; jj < 32 / NG; ++jj) {                                    \
        const int s = 32 * (I) + warp + NG * jj;                                \
        const i64 prow = (base + s * R) * D;                                    \
        H2O_UNROLL                                                              \
        for (int e = 0; e < DL; ++e) {                                          \
          const int d = lane + 32 * e;                                          \
          ov[jj][e] = s < S && d < D ? part_o[prow + d] : 0.0f;                 \
        }                                                                       \
      }
      // The first 32 splits' outputs go out with the (m, l) loads below: one
      // memory round trip less a row (S <= 32 in most launches).
      float ov[32 / NG][DL];
      H2O_SPLIT_O(0)
      // Lane j reads the (m, l) of splits j + 32 i once (S <= 32 * SPL =
      // decode.MAX_SPLITS) and keeps their weights for every warp's sums.
      constexpr int SPL = 8;
      float wv[SPL];
      float lv[SPL];
      float M = -H2O_INF;
      H2O_UNROLL
      for (int i = 0; i < SPL; ++i) {
        const int s = lane + 32 * i;
        wv[i] = s < S ? part_ml[(base + s * R) * 2] : -H2O_INF;
        lv[i] = s < S ? part_ml[(base + s * R) * 2 + 1] : 0.0f;
        M = H2O_FMAX(M, wv[i]);
      }
      for (int m_ = 16; m_ > 0; m_ >>= 1) M = H2O_FMAX(M, H2O_SHFL_XOR(M, m_));
$SINK_MAX
      const float shift = M == -H2O_INF ? 0.0f : M;
      float lsum = 0.0f;
      H2O_UNROLL
      for (int i = 0; i < SPL; ++i) {
        wv[i] = wv[i] == -H2O_INF ? 0.0f : H2O_EXP(wv[i] - shift);
        lsum += lv[i] * wv[i];
      }
      for (int m_ = 16; m_ > 0; m_ >>= 1) lsum += H2O_SHFL_XOR(lsum, m_);
$SINK_SUM
      float o[DL];
      H2O_UNROLL
      for (int i = 0; i < DL; ++i) o[i] = 0.0f;
      // Warp w sums splits w, w + NG, ... in order, 32 / NG of them loaded
      // together (one memory round trip), then weighted.
      H2O_UNROLL
      for (int i = 0; i < SPL; ++i) {
        if (32 * i < S) {
          if (i > 0) {
            H2O_SPLIT_O(i)
          }
          H2O_UNROLL
          for (int jj = 0; jj < 32 / NG; ++jj) {
            const float wgt = H2O_SHFL(wv[i], warp + NG * jj);
            H2O_UNROLL
            for (int e = 0; e < DL; ++e) o[e] += ov[jj][e] * wgt;
          }
        }
      }
#undef H2O_SPLIT_O
      H2O_BARRIER();  // the previous row's reads of red_o are done
      H2O_UNROLL
      for (int i = 0; i < DL; ++i) {
        const int d = lane + 32 * i;
        if (d < D) red_o[warp * D + d] = o[i];
      }
      H2O_BARRIER();
      const i64 orow = (i64)(b * HK * G + hq) * L + l;
      const float inv = 1.0f / (lsum > 0.0f ? lsum : 1.0f);
      for (int d = tid; d < D; d += NT) {
        float acc = 0.0f;
        H2O_UNROLL
        for (int j = 0; j < NG; ++j) acc += red_o[j * D + d];
        out[orow * D + d] = static_cast<T>(acc * inv);
      }
      const float lse_v = H2O_LOG(lsum) + shift;
      if (tid == 0) lse[orow] = lse_v;
      if (FUSED_ROWS && tid == 0) lse_sh[gr] = lse_v;
    }
  }
$TAIL
"""

SINK_MAX_PASS2 = "      M = H2O_FMAX(M, static_cast<float>(sinks[hq]));"
SINK_SUM_PASS2 = "      lsum += H2O_EXP(static_cast<float>(sinks[hq]) - shift);"

# The H2O fold and next-victim choice for one (sequence b, KV head hk) with
# L == 1 and lse_sh[g] holding each group row's lse. Mirrors
# mlx_h2o.policy.fold_scores / protected / priority / order_keys.
FOLD = r"""
  H2O_SHARED int bo_s[NT / 32];
  H2O_SHARED int bp_s[NT / 32];
  H2O_SHARED int bs_s[NT / 32];
  H2O_SHARED int victim_s;
  H2O_BARRIER_DEVICE();
  {
    const int cap = pos_in_shape[2];
    const int flags = $FLAGS;
    const int offset = $PRM[0];
    const int Q = (flags & 1) ? -1 : offset - 1;
    const int window = $PRM[2];
    const int sink_n = $PRM[3];
    const int recent = $PRM[4];
    const int n_pin = pin_shape[0];
    const float ema_a = prm_f[1];
    const float ema_b = prm_f[2];
    const int b = blk_x / HK;
    const int hk = blk_x % HK;
    const int Nv = $NV;
    const int w = (flags & 1) ? -1
        : $PRM[1] >= 0 ? $PRM[1]
        : slot[b * slot_strides[0] + hk * slot_strides[1]];
    const i64 pb = b * pos_in_strides[0] + hk * pos_in_strides[1];
    const i64 sb = b * score_in_strides[0] + hk * score_in_strides[1];
    const i64 cb = b * count_in_strides[0] + hk * count_in_strides[1];
    const i64 ob = (i64)(b * HK + hk) * cap;
    const int Ns = $NS;  // logits row stride
    const i64 lb = (i64)(b * HK * G + hk * G) * Ns;
    int best_o = 0, best_p = 0, best_s = -1;
    for (int s = tid; s < cap; s += NT) {
      int p = s == w ? Q : pos_in[pb + s * pos_in_strides[2]];
      float sc = s == w ? 0.0f : score_in[sb + s * score_in_strides[2]];
      float cn = s == w ? 0.0f : count_in[cb + s * count_in_strides[2]];
      if (s < Nv) {
        const bool vis = logits[lb + s] > -H2O_INF;
        const float seen = vis ? 1.0f : 0.0f;
        if (MODE == 0 || MODE == 3) {  // EMA of |logit| or of attention
          float mag = 0.0f;
          for (int g = 0; g < G; ++g) {
            const float x = logits[lb + g * Ns + s];
            mag += MODE == 0 ? (vis ? H2O_FABS(x) : 0.0f) : H2O_EXP(x - lse_sh[g]);
          }
          const float step = (mag * (1.0f / G)) / H2O_FMAX(seen, 1.0f);
          const float ema = cn > 0.0f ? ema_a * sc + ema_b * step : step;
          sc = seen > 0.0f ? ema : sc;
        } else {
          float pr = 0.0f;
          for (int g = 0; g < G; ++g) pr += H2O_EXP(logits[lb + g * Ns + s] - lse_sh[g]);
          sc = (flags & 1) ? sc : sc + pr * (1.0f / G);  // a row without a token folds nothing
        }
        cn = cn + seen;
        bool keep = p < sink_n || p >= offset + 1 - recent;
        for (int i = 0; i < n_pin; ++i) keep = keep || (p >= pin[2 * i] && p < pin[2 * i + 1]);
        const float es = MODE == 2 ? sc / H2O_FMAX(cn, 1.0f) : sc;
        float pri = keep ? H2O_INF : es;
        if (window > 0 && p <= offset - window) pri = -H2O_INF;
        int bits = H2O_F2I(pri);
        if ((bits & 0x7fffffff) == 0) bits = 0;
        const int ord = bits >= 0 ? bits : bits ^ 0x7fffffff;
        // A filling row's next slot is its lowest empty one; a victim is a
        // held token.
        const bool fill = (flags & 2) != 0;
        const int ko = fill ? 0 : ord;
        const int kp = fill ? s : p;
        const bool cand = fill ? p < 0 : (p >= 0 || (flags & 4) == 0);
        if (cand && (best_s < 0 || ko < best_o || (ko == best_o && kp < best_p))) {
          best_o = ko;
          best_p = kp;
          best_s = s;
        }
      }
      pos_out[ob + s] = p;
      score_out[ob + s] = sc;
      count_out[ob + s] = cn;
    }
    // Block argmin of (order, position); positions are unique per row.
    for (int off = 16; off > 0; off >>= 1) {
      const int o2 = H2O_SHFL_XOR(best_o, off);
      const int p2 = H2O_SHFL_XOR(best_p, off);
      const int s2 = H2O_SHFL_XOR(best_s, off);
      if (s2 >= 0 && (best_s < 0 || o2 < best_o || (o2 == best_o && p2 < best_p))) {
        best_o = o2;
        best_p = p2;
        best_s = s2;
      }
    }
    if (lane == 0) {
      bo_s[warp] = best_o;
      bp_s[warp] = best_p;
      bs_s[warp] = best_s;
    }
    H2O_BARRIER();
    if (tid == 0) {
      for (int i = 1; i < NT / 32; ++i) {
        if (bs_s[i] >= 0 && (best_s < 0 || bo_s[i] < best_o
            || (bo_s[i] == best_o && bp_s[i] < best_p))) {
          best_o = bo_s[i];
          best_p = bp_s[i];
          best_s = bs_s[i];
        }
      }
      victim_s = best_s < 0 ? 0 : best_s;  // no candidate: slot 0, as policy.first_empty
    }
    // Repeated along its width VW: the victim indexes the next step's K/V
    // writes as is (D wide for dense K/V, 1 for packed).
    H2O_BARRIER();
    for (int i = tid; i < $VW; i += NT) victim[(i64)(b * HK + hk) * $VW + i] = victim_s;
  }
"""

# The fold alone, after any attention that exported (logits, lse): one block
# per (sequence, KV head). The quantized caches use it (their attention kernel
# has one block per query row, so it cannot fold a GQA group itself).
FOLD_ONLY = r"""
$IDS
  constexpr int NT = 128;
  H2O_SHARED float lse_sh[G];
  if (tid < G) {
    const int b_ = blk_x / HK;
    const int hq_ = (blk_x % HK) * G + tid;
    lse_sh[tid] = lse[b_ * lse_strides[0] + hq_ * lse_strides[1]];
  }
$TAIL
"""

# Pass 1 with one split hands its lse to the fold through shared memory.
FOLD_PASS1_LSE = r"""
  H2O_SHARED float lse_sh[R];
  if (tid < R) {
    const float m = m_s[tid];
    lse_sh[tid] = H2O_LOG(l_s[tid]) + (m == -H2O_INF ? 0.0f : m);
  }
"""

# Many layers' decode steps folded in one launch (kernels/group_fold.py): one
# block per (layer, sequence, KV head) computes the group's logits of the
# layer's last decode query (inputs q0, q1, ...) over its K buffer (k0, k1,
# ...; one input per layer, so nothing is copied to stack them),
# their lse, then runs FOLD on the layers' stacked metadata, where row
# b = layer * NB + sequence. Per-layer parameters: lay_i (8 ints: FOLD's prm_i
# then the K buffer's slot count) and lay_f (scale, EMA a, EMA b, 0).
GROUP_FOLD = r"""
$IDS
  constexpr int NT = 128;
  constexpr int NG = NT / 32;
  constexpr int E = 8;  // K elements per load (D % 8 == 0)
  const int layer = blk_x / (NB * HK);
  const int bq = (blk_x / HK) % NB;
  const int hq0 = (blk_x % HK) * G;
  auto prm_i = lay_i + layer * 8;
  auto prm_f = lay_f + layer * 4;
  // The next token's parameters, offset + 1: they stay on the device (an
  // array the host writes every token costs the GPU a slow first read).
  if (bq == 0 && blk_x % HK == 0 && tid < 8) lay_out[layer * 8 + tid] = prm_i[tid] + (tid == 0);
  const int nv = prm_i[5];
  const i64 kcap = prm_i[6];
$KSETUP
  auto ql = $QSELECT;  // (B, Hq, 1, D)
  const int NSL = pos_in_shape[2];  // logits row stride: the stacked slot count
  const i64 lrow = ((i64)(layer * NB + bq) * HK * G + hq0) * NSL;
  const float scale = prm_f[0];

  H2O_SHARED float q_s[G * D];
  for (int i = tid; i < G * D; i += NT) {
    q_s[i] = static_cast<float>(ql[((i64)bq * HK * G + hq0) * D + i]);
  }
  H2O_BARRIER();
  // A thread per key: the G logits of its row, an online (max, sum) per head.
  float m_[G];
  float l_[G];
  H2O_UNROLL
  for (int g = 0; g < G; ++g) {
    m_[g] = -H2O_INF;
    l_[g] = 0.0f;
  }
  for (int s = tid; s < nv; s += NT) {
    float acc[G];
    H2O_UNROLL
    for (int g = 0; g < G; ++g) acc[g] = 0.0f;
    for (int d0 = 0; d0 < D; d0 += E) {
      float kf[E];
$KLOAD
      H2O_UNROLL
      for (int g = 0; g < G; ++g) {
        H2O_UNROLL
        for (int e = 0; e < E; ++e) acc[g] += q_s[g * D + d0 + e] * kf[e];
      }
    }
    H2O_UNROLL
    for (int g = 0; g < G; ++g) {
      const float x = acc[g] * scale;
      logits[lrow + (i64)g * NSL + s] = x;
      const float mn = H2O_FMAX(m_[g], x);
      l_[g] = l_[g] * H2O_EXP(m_[g] - mn) + H2O_EXP(x - mn);
      m_[g] = mn;
    }
  }
  H2O_SHARED float gm_s[NG * G];
  H2O_SHARED float gl_s[NG * G];
  H2O_SHARED float lse_sh[G];
  H2O_UNROLL
  for (int g = 0; g < G; ++g) {
    float m = m_[g];
    float l = l_[g];
    for (int off = 16; off > 0; off >>= 1) {
      const float m2 = H2O_SHFL_XOR(m, off);
      const float l2 = H2O_SHFL_XOR(l, off);
      const float mn = H2O_FMAX(m, m2);
      if (mn > -H2O_INF) {
        l = (m > -H2O_INF ? l * H2O_EXP(m - mn) : 0.0f)
            + (m2 > -H2O_INF ? l2 * H2O_EXP(m2 - mn) : 0.0f);
      }
      m = mn;
    }
    if (lane == 0) {
      gm_s[warp * G + g] = m;
      gl_s[warp * G + g] = l;
    }
  }
  H2O_BARRIER();
  if (tid < G) {
    float M = -H2O_INF;
    for (int j = 0; j < NG; ++j) M = H2O_FMAX(M, gm_s[j * G + tid]);
    float S = 0.0f;
    for (int j = 0; j < NG; ++j) {
      const float mj = gm_s[j * G + tid];
      S += mj > -H2O_INF ? gl_s[j * G + tid] * H2O_EXP(mj - M) : 0.0f;
    }
    lse_sh[tid] = H2O_LOG(S) + M;
  }
$FOLD
"""

# The group fold's K rows: dense buffers (k0, k1, ...) ...
GROUP_K_DENSE = r"""
  auto kl = $KSELECT;
  kl += ((i64)bq * HK + blk_x % HK) * kcap * D;
  const bool kvec = H2O_ALIGNED16(kl);
"""
GROUP_LOAD_DENSE = r"""
      {
        H2ORaw<T, E> kr;
        h2o_fetch<E>(kl + (i64)s * D + d0, 1, kvec, kr);
        h2o_cvt<E>(kr, kf);
      }
"""
# ... or packed affine-quantized K/V (kernels/packed.py; uint32 rows of
# [K codes | V codes | K scales, K biases | ...]; BITS-wide codes, low bits
# first; one scale per GS values, GS >= E).
GROUP_K_QUANT = r"""
  constexpr int WPR = D * BITS / 32;  // code words per row
  constexpr int SPR = D / GS;  // scales per row
  constexpr int RW = 2 * WPR + SPR * (int)sizeof(T);  // words per packed row
  constexpr unsigned MASKB = (1u << BITS) - 1u;
  auto kl = $KSELECT;
  kl += ((i64)bq * HK + blk_x % HK) * kcap * RW;
"""
GROUP_LOAD_QUANT = r"""
      {
        auto row = kl + (i64)s * RW;
        auto sb = reinterpret_cast<const H2O_DEVICE T*>(row + 2 * WPR);
        const float sc = static_cast<float>(sb[d0 / GS]);
        const float bi = static_cast<float>(sb[SPR + d0 / GS]);
        H2O_UNROLL
        for (int e = 0; e < E; ++e) {
          const int d = d0 + e;
          const unsigned word = row[(d * BITS) / 32];
          kf[e] = static_cast<float>((word >> ((d * BITS) % 32)) & MASKB) * sc + bi;
        }
      }
"""
