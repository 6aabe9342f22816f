"""Pass 1 on tensor cores (CUDA, float16 / bfloat16): the split-N decode
attention with scores, for the plain and causal cases at head dims 64, 96, 128.

The shared-body pass 1 (source.PASS1) spends its time in warp shuffles: the
reduce-scatter of partial dots and the broadcasts of p, ~40 a warp iteration
(docs/DESIGN.md). Here each warp takes 16 keys an iteration
and computes S = Q K^T and O += P V with ``mma.sync.m16n8k16`` (fp32
accumulators): query rows are the MMA's M (rows 8-15 zero), keys its N (S)
or K (P V). Only the row max crosses lanes (two shuffles a quad).
The ``mma`` launch setting (decode.LaunchSettings) takes it at D 64 / 96 by
default: on an H200 it was faster than the shared body there and slower at
D=128, with 162 registers and with 128 and a few spilled
(docs/DESIGN.md). Below D=128 a warp reads its next K tile while
it finishes the current one (3-6% less time).

Layouts (lane = 4 q4 + t4):
- D is permuted alike for Q and K: k-step 2j + h of the QK MMA takes
  elements 32 j + 8 t4 + 4 h + {0, 1} (as k = 2 t4 + {0, 1}) and + {2, 3}
  (as k = 2 t4 + 8 + {0, 1}), so a lane reads 16 contiguous bytes of a key.
- S's accumulator (row q4, keys 2 t4 + {0, 1}) is P's A fragment as is.
- Output dims are permuted: n8 tile i, column n is element n * (D / 8) + i,
  so a lane reads D / 8 contiguous elements of each of its 4 V rows and packs
  two keys' elements of a tile into one register.
Partials are written as source.WRITE_PARTIAL's (pass 2 merges them).
No Metal twin: Metal keeps the shared body (its simdgroup matrices are 8x8
and were never run here).
"""

# Appended to source.CUDA_HEADER for this kernel only.
MMA_HEADER = r"""
// At most 128 registers a thread, so 4 blocks of 128 threads fit an SM: at
// D=128 this kernel took 162 (3 blocks an SM) and was slower than the shared
// body. MLX writes the kernel's declaration after this header,
// so its __global__ carries the bounds (D=64 takes 100 either way).
#undef __global__
#define __global__ __location__(global) __launch_bounds__(128, 4)
// D = A B + D for one m16n8k16 tile whose A rows 8-15 are zero: c0, c1 are
// row lane / 4's columns 2 (lane % 4) + {0, 1}; z0, z1 (rows 8-15) stay zero.
#define H2O_MMA_FOR(TYPE, PTX)                                                       \
  H2O_FN void h2o_mma(float& c0, float& c1, float& z0, float& z1, unsigned a0, unsigned a2,  \
                      unsigned b0, unsigned b1, const TYPE*) {                        \
    asm("mma.sync.aligned.m16n8k16.row.col.f32." PTX "." PTX ".f32 {%0,%1,%2,%3}, "  \
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                                    \
        : "+f"(c0), "+f"(c1), "+f"(z0), "+f"(z1)                                       \
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));                       \
  }
H2O_MMA_FOR(__half, "f16")
H2O_MMA_FOR(__nv_bfloat16, "bf16")

// Two floats as T, the first in the low half (the lower k of a fragment).
template <typename T>
H2O_FN unsigned h2o_pack2(float lo, float hi) {
  T x[2] = {static_cast<T>(lo), static_cast<T>(hi)};
  return *reinterpret_cast<unsigned*>(x);
}

// Element i of two rows' raw slices as one register (row a low).
template <int E, typename T>
H2O_FN unsigned h2o_pair(const H2ORaw<T, E>& a, const H2ORaw<T, E>& b, int i) {
  const unsigned lo = reinterpret_cast<const unsigned short*>(a.w)[i];
  const unsigned hi = reinterpret_cast<const unsigned short*>(b.w)[i];
  return lo | (hi << 16);
}
"""

PASS1_MMA = r"""
$IDS
  constexpr int NT = 128;
  constexpr int NG = NT / 32;
  constexpr int STEP = NG * 16;  // keys per block iteration: 16 a warp
  constexpr int KC = D / 32;     // 16-byte K slices a lane reads per key
  constexpr int VE = D / 8;      // V elements a lane reads per key (= n8 tiles)
  constexpr int VW = VE % 8 == 0 ? 8 : 4;  // V elements a fetch
  constexpr int NV = VE / VW;
  constexpr int RT = G * L / R;
  const int q4 = lane >> 2;  // S / O row; the key this lane reads for S
  const int t4 = lane & 3;
  const bool row_on = q4 < R;
$RANGE  const int r = q4;  // the row this lane masks and writes

  // Q as A fragments, words 2h and 2h + 1 of slice j for k-step 2j + h.
  unsigned qa[KC][4];
  H2O_UNROLL
  for (int j = 0; j < KC; ++j) {
    H2ORaw<T, 8> raw;
    T* x = reinterpret_cast<T*>(raw.w);
    H2O_UNROLL
    for (int e = 0; e < 8; ++e) {
      const int d = 32 * j + 8 * t4 + e;
      x[e] = row_on ? q[b * q_strides[0] + H2O_ROW_HQ(r) * q_strides[1]
          + H2O_ROW_L(r) * q_strides[2] + d * q_strides[3]] : static_cast<T>(0.0f);
    }
    H2O_UNROLL
    for (int w = 0; w < 4; ++w) qa[j][w] = reinterpret_cast<const unsigned*>(raw.w)[w];
  }

  const i64 kbase = b * k_strides[0] + hk * k_strides[1];
  const i64 vbase = b * v_strides[0] + hk * v_strides[1];
$KV_VEC
  float m_run = -H2O_INF;  // row q4's max, the same in its quad
  float l_run = 0.0f;      // this lane's share of the row's sum
  float o[VE][2];
  H2O_UNROLL
  for (int i = 0; i < VE; ++i) o[i][0] = o[i][1] = 0.0f;
  // The MMAs' rows 8-15 (zero): shared by the tiles, four pairs so that
  // they chain at most VE / 4 MMAs (registers: ~2 * VE fewer).
  float z[4][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}, {0.0f, 0.0f}, {0.0f, 0.0f}};

  // K rows FIRST + 8 tau + q4 into kr (zeros past n1).
#define H2O_K_ROWS(FIRST)                                                           \
  H2O_UNROLL                                                                        \
  for (int tau = 0; tau < 2; ++tau) {                                               \
    const int key_ = (FIRST) + 8 * tau + q4;                                        \
    H2O_UNROLL                                                                      \
    for (int j = 0; j < KC; ++j) {                                                  \
      if (key_ < n1) {                                                              \
        h2o_fetch<8>(k + kbase + key_ * ks + (32 * j + 8 * t4) * k_strides[3],      \
                     k_strides[3], kvec, kr[tau][j]);                               \
      } else {                                                                      \
        h2o_zero<8>(kr[tau][j]);                                                    \
      }                                                                             \
    }                                                                               \
  }
  // V rows base + 8 (c >> 1) + 2 t4 + (c & 1) are read once S is done (K's
  // registers free: ~200 registers a thread at D=128 with both in flight, 2
  // blocks an SM). Below D=128 the next iteration's K rows go out with them,
  // so they arrive while this one's softmax and P V run (PF: registers allow).
  constexpr bool PF = D < 128;
  H2ORaw<T, 8> kr[2][KC];
  if (PF) {
    H2O_K_ROWS(n0 + warp * 16)
  }
  for (int base = n0 + warp * 16; base < n1; base += STEP) {
    H2ORaw<T, VW> vr[4][NV];
    if (!PF) {
      H2O_K_ROWS(base)
    }
    // S: row q4, keys base + 8 tau + 2 t4 + {0, 1} in s[tau][0 .. 1].
    float s[2][2];
    H2O_UNROLL
    for (int tau = 0; tau < 2; ++tau) {
      s[tau][0] = s[tau][1] = 0.0f;
      H2O_UNROLL
      for (int j = 0; j < KC; ++j) {
        const unsigned* kw = reinterpret_cast<const unsigned*>(kr[tau][j].w);
        H2O_UNROLL
        for (int h = 0; h < 2; ++h) {
          h2o_mma(s[tau][0], s[tau][1], z[tau][0], z[tau][1], qa[j][2 * h], qa[j][2 * h + 1],
                  kw[2 * h], kw[2 * h + 1], static_cast<const T*>(nullptr));
        }
      }
    }
    H2O_UNROLL
    for (int c = 0; c < 4; ++c) {
      const int key = base + 8 * (c >> 1) + 2 * t4 + (c & 1);
      H2O_UNROLL
      for (int f = 0; f < NV; ++f) {
        if (key < n1) {
          h2o_fetch<VW>(v + vbase + key * vs + (q4 * VE + f * VW) * v_strides[3],
                        v_strides[3], vvec, vr[c][f]);
        } else {
          h2o_zero<VW>(vr[c][f]);
        }
      }
    }
    if (PF) {
      H2O_K_ROWS(base + STEP)
    }
    float p[4];
    float mx = -H2O_INF;
    H2O_UNROLL
    for (int c = 0; c < 4; ++c) {
      const int key = base + 8 * (c >> 1) + 2 * t4 + (c & 1);
      float x_ = -H2O_INF;
      if (key < n1 && row_on) {
        x_ = s[c >> 1][c & 1] * scale;
$MASK_APPLY
        logits[((i64)(b * HK * G + H2O_ROW_HQ(r)) * L + H2O_ROW_L(r)) * NS + key] = x_;
      }
      p[c] = x_;
      mx = H2O_FMAX(mx, x_);
    }
    mx = H2O_FMAX(mx, H2O_SHFL_XOR(mx, 1));
    mx = H2O_FMAX(mx, H2O_SHFL_XOR(mx, 2));
    const float m_new = H2O_FMAX(m_run, mx);
    const float shift = m_new == -H2O_INF ? 0.0f : m_new;
    const float alpha = m_run == -H2O_INF ? 0.0f : H2O_EXP(m_run - m_new);
    H2O_UNROLL
    for (int c = 0; c < 4; ++c) p[c] = H2O_EXP(p[c] - shift);
    l_run = l_run * alpha + ((p[0] + p[1]) + (p[2] + p[3]));
    m_run = m_new;
    // O += P V: P's A fragment is S's layout; V's B fragment of tile i packs
    // element i of keys 2 t4 + {0, 1} (b0 b1) and 8 + 2 t4 + {0, 1} (b2 b3).
    const unsigned pa0 = h2o_pack2<T>(p[0], p[1]);
    const unsigned pa1 = h2o_pack2<T>(p[2], p[3]);
    H2O_UNROLL
    for (int i = 0; i < VE; ++i) {
      o[i][0] *= alpha;
      o[i][1] *= alpha;
      const unsigned b0 = h2o_pair<VW>(vr[0][i / VW], vr[1][i / VW], i % VW);
      const unsigned b1 = h2o_pair<VW>(vr[2][i / VW], vr[3][i / VW], i % VW);
      h2o_mma(o[i][0], o[i][1], z[i % 4][0], z[i % 4][1], pa0, pa1, b0, b1,
              static_cast<const T*>(nullptr));
    }
  }
#undef H2O_K_ROWS

  // The row's sum over its quad; then the warps merge as source.PASS1's do.
  l_run += H2O_SHFL_XOR(l_run, 1);
  l_run += H2O_SHFL_XOR(l_run, 2);
  H2O_SHARED float gm_s[NG * R];
  H2O_SHARED float gl_s[NG * R];
  H2O_SHARED float red[NG * R * D];
  if (row_on) {
    if (t4 == 0) {
      gm_s[warp * R + r] = m_run;
      gl_s[warp * R + r] = l_run;
    }
    H2O_UNROLL
    for (int i = 0; i < VE; ++i) {
      H2O_UNROLL
      for (int c = 0; c < 2; ++c) red[(warp * R + r) * D + (2 * t4 + c) * VE + i] = o[i][c];
    }
  }
  H2O_BARRIER();
  for (int idx = tid; idx < R * D; idx += NT) {
    const int rr = idx / D;
    const int d = idx % D;
    float M = -H2O_INF;
    H2O_UNROLL
    for (int w = 0; w < NG; ++w) M = H2O_FMAX(M, gm_s[w * R + rr]);
    float s_ = 0.0f;
    float lsum = 0.0f;
    H2O_UNROLL
    for (int w = 0; w < NG; ++w) {
      const float gm = gm_s[w * R + rr];
      const float f = gm == -H2O_INF ? 0.0f : H2O_EXP(gm - M);
      s_ += red[(w * R + rr) * D + d] * f;
      lsum += gl_s[w * R + rr] * f;
    }
    const i64 prow = ((i64)unit * S + split) * R + rr;
    part_o[prow * D + d] = s_;
    if (d == 0) {
      part_ml[prow * 2] = M;
      part_ml[prow * 2 + 1] = lsum;
    }
  }
"""
