// KDA chunked forward on CUDA, the intra-chunk stage (params.cuh; docs/kda.md, "CUDA chunked
// forward"), C = 64. The state pass is state.cu, the launcher launch.cu.
//
// Notation per chunk of L <= C tokens of one sequence and one value head h (qk head h / (HV/H)):
// rows r, s = 0..C-1 from the chunk start; rows >= L are padding with q = k = v = beta = 0 and
// g = 0 (so G stays at G_{L-1} and every padded row of every intermediate is exactly zero).
//   G_r    = sum_{i <= r} g_i                        chunk-local cumsum (restarts every chunk)
//   A_qk   = scale sum_d q_rd k_sd exp(G_rd - G_sd)  s <= r (diagonal included), else 0
//   A_kk   = beta_r sum_d k_rd k_sd exp(G_rd - G_sd)  s < r, else 0
//   M^-1   = (I + A_kk)^-1
//   W      = M^-1 (beta exp(G) k)      [C, K]       U = M^-1 (beta v)   [C, V]
//   qg     = scale q exp(G)            [C, K]       kg = k exp(G_{L-1} - G)   [C, K]
//   gl     = exp(G_{L-1})              [K]
// and, sequentially over the chunks of a sequence with the state S [K, V] at chunk start:
//   V_new  = U - W S;   O = qg S + A_qk V_new;   S <- Diag(gl) S + kg^T V_new.
//
// exp safety (docs/kda.md, "exp safety and other numerical pitfalls"): g <= 0 makes G
// non-increasing. Block row i (rows n .. n+15, n = 16 i) of A_qk / A_kk uses the reference row n:
// exp(G_r - G_s) = exp(G_r - G_n) exp(G_n - G_s), i.e. A[r][s] = (q_r exp(G_r - G_n)) . (k_s
// exp(G_n - G_s)), a plain product of pre-scaled rows.
//   s < n (off-diagonal 16x16 blocks): both factors <= 1, always safe (FLA's choice too).
//   n <= s <= r (diagonal block): exp(G_r - G_n) in [exp(-span), 1], exp(G_n - G_s) in
//     [1, exp(span)] with span = max_d (G_n - G_{n+15}); used while span <= 80 nats (both factors
//     normal and finite in FP32; the products above the diagonal are discarded by select, never
//     multiplied by a mask). A diagonal block that spans more (mean decay above ~5.3 nats per
//     token; never with the lower-bound gate, which caps it at 5 * 15 = 75) forms exp(G_r - G_s)
//     per element instead, only for s <= r (masked before the exp).
// exp(-G) alone is never formed; exp(G) and exp(G_{L-1} - G) are <= 1. The factors take expf
// for f32 inputs and ex2.approx.ftz for bf16 inputs (exp_in, common.cuh: ~6e-6 relative
// at the 80-nat span, where the arguments reach -80).
//
// No atomics; every reduction has a fixed order. The matrix products run on tensor cores for bf16
// inputs (mma_tf32.cuh: TF32 operands, or 3xTF32 with exact_bf16_products; the stage precisions of
// heuristics.h; FP32 accumulation) and in FP32 FMA for f32 inputs (the same fragment ownership);
// the cumsum, norms, exps and the 16x16 substitutions are FP32 FMA.
//   kda_intra_kernel<K, Tin>: grid (NC, HV), 512 threads, one block per (chunk, value head).
//     Writes W, U, qg, kg, A_qk, gl for its chunk into the f32 workspace (all C rows). A_qk and
//     A_kk by 16-row block rows (16 x 8 tiles over the 16 warps); M^-1: the four 16x16 diagonal
//     blocks by forward substitution (one thread per column, in registers), then block rows;
//     W and U as M^-1 products (lower triangular: each 16-row tile stops at its last row).
// The backward's recompute (launch.cu: recompute) runs it too: it then also stores G, the
// normalised q / k, beta and M^-1.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ops/cuda/kda_chunk/common.cuh"
#include "ops/cuda/kda_chunk/params.cuh"
#include "ops/cuda/mma_tf32.cuh"

namespace hlm::ops::cuda::kda {
namespace {

constexpr const char* kOp = "kda_chunk_forward_cuda";
constexpr int kIntraThreads = 512;  // intra kernel: one warp per row of a 16-row block
constexpr int kIntraMaxV = 128;     // the largest V the kernels take
constexpr int kAP = kC + 4;         // row stride of the C x C shared matrices (A_kk, M^-1)
constexpr int kTP = 3 * kSub + 4;   // row stride of the block-inverse scratch [16][48]
constexpr int kIntraKX = 64;        // channels per pass of the intra kernel's A products

// Shared-memory layout of the intra kernel, in floats (the same on host and device). The raw q
// and k rows keep their input type (bf16 inputs: exact, and half the bytes; the L2-norm factor
// is applied on every read), which with the 64-channel passes of the A products keeps a bf16
// block at K = V = 128 within 113 KB: two blocks per SM.
template <class Tin>
struct IntraLayout {
  int kp;  // K + 4: row stride of G, later beta exp(G) k (f32)
  int rs;  // K + 8: row stride of the raw q, k (Tin; rows of 16-byte multiples)
  int vp;  // V + 4: row stride of beta v (f32), over the raw q and k
  int xp;  // row stride of Xq, Xk, Y: kIntraKX (or K) + 4
  int g, q, k, vb, a, x, beta, rq, rk;  // offsets (multiples of 4)
  int total;
  __host__ __device__ IntraLayout(int K, int V) {
    kp = K + 4;
    rs = K + 8;
    vp = V + 4;
    xp = (K < kIntraKX ? K : kIntraKX) + 4;
    const int raw = (kC * rs * int(sizeof(Tin)) + 15) / 16 * 4;  // floats per raw array
    g = 0;                                            // G        [C][kp], then beta exp(G) k
    q = g + kC * kp;                                  // raw q    [C][rs]
    k = q + raw;                                      // raw k    [C][rs]
    vb = q;                                           // beta v   [C][vp] (after the inverse)
    a = q + (2 * raw > kC * vp ? 2 * raw : kC * vp);  // A_kk [C][kAP]
    x = a + kC * kAP;  // union: {Xq [16][xp], Xk [16][xp], Y [64][xp]} | {M^-1, scratch}
    const int xa = (2 * kSub + kC) * xp, xb = kC * kAP + kSub * kTP;
    beta = x + (xa > xb ? xa : xb);  // beta [C]
    rq = beta + kC;                  // L2-norm factors of q, k [C] (1 without the norm)
    rk = rq + kC;
    total = rk + kC;
  }
};

// ------------------------------------------------------------------ device helpers

// The decay gate of kda_gate.h on x = z + dt_bias. The lower-bound gate lb sigmoid(y), y = eA x,
// takes, for bf16 inputs, e = exp(-|y|) and r = 1 / (1 + e) (sigmoid(y) = r for y >= 0, e r
// below): one exp and one reciprocal, both the fast forms (exp_in, rcp_in). f32 inputs keep
// sigmoid_f (expf, IEEE division).
template <class Tin>
__device__ __forceinline__ float gate_f(float x, float eA, int kind, float lb) {
  if (kind == kGateStandard) {
    const float sp = x > 20.f ? x : log1pf(expf(x));
    return -mul0(eA, sp);
  }
  const float y = mul0(eA, x);
  if constexpr (std::is_same_v<Tin, float>) return lb * sigmoid_f(y);
  const float e = exp_in<Tin>(-fabsf(y)), r = rcp_in<Tin>(1.f + e);
  return lb * (y >= 0.f ? r : e * r);
}

// ------------------------------------------------------------------ intra-chunk kernel

template <class T>
__device__ __forceinline__ T raw_zero() {
  if constexpr (std::is_same_v<T, float>)
    return 0.f;
  else
    return __float2bfloat16_rn(0.f);
}

template <int K, class Tin, bool kTf32>
__global__ void __launch_bounds__(kIntraThreads, std::is_same_v<Tin, float> ? 1 : 2)
    kda_intra_kernel(const IntraParams<Tin> p) {
  static_assert(K % 32 == 0 && K <= 128, "K must be 32, 64 or 128");
  static_assert(kIntraThreads / 32 >= 2 * (kC / 8), "one warp per A tile of a block row");
  using namespace mma_cu;
  constexpr Prec P = prec_for<Tin, kTf32>;
  constexpr int KP = K + 4, RS = K + 8;
  constexpr int KX = K < kIntraKX ? K : kIntraKX, XP = KX + 4;  // channels per A pass
  constexpr int NT = kIntraThreads;
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  const IntraLayout<Tin> lay(K, p.V);
  const int VP = lay.vp;
  float* sG = smem + lay.g;                        // [C][KP]  g, G, then beta exp(G) k
  Tin* sQ = reinterpret_cast<Tin*>(smem + lay.q);  // [C][RS]  raw q
  Tin* sK = reinterpret_cast<Tin*>(smem + lay.k);  // [C][RS]  raw k
  float* sVb = smem + lay.vb;                      // [C][VP]  beta v (after the inverse)
  float* sA = smem + lay.a;                        // [C][kAP] A_kk
  float* sX = smem + lay.x;                        // union region (see IntraLayout)
  float* sBeta = smem + lay.beta;                  // [C]
  float* sRq = smem + lay.rq;                      // [C]
  float* sRk = smem + lay.rk;                      // [C]
  // The normalised q and k (raw x L2-norm factor: the same f32 product the CPU forms).
  auto qn = [&](int r, int d) { return to_f(sQ[r * RS + d]) * sRq[r]; };
  auto kn = [&](int r, int d) { return to_f(sK[r * RS + d]) * sRk[r]; };

  const int t = threadIdx.x;
  const int ci = blockIdx.x, h = blockIdx.y;
  const int bos = p.chunk_bos[ci], L = p.chunk_len[ci];
  const int hk = h / (p.HV / p.H);
  const int64_t task = int64_t(ci) * p.HV + h;

  // ---- 1. load g (through the gate when fused), q, k, beta; zero the padded rows
  const float eA = (p.gate != kGateNone && p.A_log) ? expf(p.A_log[h]) : 1.f;
  auto gate_of = [&](float x, float bias) {
    return p.gate == kGateNone ? x : gate_f<Tin>(x + bias, eA, p.gate, p.lower_bound);
  };
  // 8 channels per thread and step (K % 8 == 0; rows of 16-byte multiples), the loop once per
  // gate kind (kind a constant: no per-element branch on it)
  auto load16 = [&](auto kind_c) {
    constexpr int kind = decltype(kind_c)::value;
    constexpr int E = 8;
    for (int i = t; i < kC * K / E; i += NT) {
      const int r = i / (K / E), d = E * (i % (K / E));
      alignas(16) Tin qv[E], kv[E], gr[E];
      alignas(16) float gv[E], bias[E];
#pragma unroll
      for (int e = 0; e < E; ++e) qv[e] = kv[e] = raw_zero<Tin>(), gv[e] = 0.f, bias[e] = 0.f;
      if (r < L) {
        const int64_t tok = int64_t(bos) + r;
        ld16(p.g + (tok * p.HV + h) * K + d, gr);
        if (kind != kGateNone && p.dt_bias) ld16(p.dt_bias + h * K + d, bias);
        ld16(p.q + (tok * p.H + hk) * K + d, qv);
        ld16(p.k + (tok * p.H + hk) * K + d, kv);
#pragma unroll
        for (int e = 0; e < E; ++e)
          gv[e] = kind == kGateNone ? to_f(gr[e])
                                    : gate_f<Tin>(to_f(gr[e]) + bias[e], eA, kind, p.lower_bound);
      }
      st16(sG + r * KP + d, gv);
      st16(sQ + r * RS + d, qv);
      st16(sK + r * RS + d, kv);
    }
  };
  if (p.vec16 && p.gate == kGateLowerBound) {
    load16(std::integral_constant<int, kGateLowerBound>{});
  } else if (p.vec16 && p.gate == kGateStandard) {
    load16(std::integral_constant<int, kGateStandard>{});
  } else if (p.vec16) {
    load16(std::integral_constant<int, kGateNone>{});
  } else {
#pragma unroll 4
    for (int i = t; i < kC * K; i += NT) {
      const int r = i / K, d = i % K;
      float gv = 0.f;
      Tin qv = raw_zero<Tin>(), kv = raw_zero<Tin>();
      if (r < L) {
        const int64_t tok = int64_t(bos) + r;
        gv = gate_of(to_f(p.g[(tok * p.HV + h) * K + d]), p.dt_bias ? p.dt_bias[h * K + d] : 0.f);
        qv = p.q[(tok * p.H + hk) * K + d];
        kv = p.k[(tok * p.H + hk) * K + d];
      }
      sG[r * KP + d] = gv;
      sQ[r * RS + d] = qv;
      sK[r * RS + d] = kv;
    }
  }
  if (t < kC) {
    float b = 0.f;
    if (t < L) {
      b = to_f(p.beta[(int64_t(bos) + t) * p.HV + h]);
      if (p.beta_logits) b = sigmoid_f(b);
    }
    sBeta[t] = b;
  }
  __syncthreads();

  // ---- 2. G = cumsum of g (one thread per channel, rows in order: the CPU's bits), and the
  // q / k L2-norm factors (one warp per row; butterfly sums give every lane the same value)
  if (t < K) {  // rows in batches of 8: the batch's loads issue together, then its sums in order
    float acc = 0.f;
#pragma unroll 1
    for (int r0 = 0; r0 < kC; r0 += 8) {
      float v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = sG[(r0 + j) * KP + t];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        acc += v[j];
        sG[(r0 + j) * KP + t] = acc;
      }
    }
  }
  {
    const int warp = t >> 5, lane = t & 31;
    for (int r = warp; r < kC; r += NT / 32) {
      float ra = 1.f, rb = 1.f;
      if (p.l2norm && r < L) {
        float a = 0.f, b = 0.f;
        for (int d = lane; d < K; d += 32) {
          const float x = to_f(sQ[r * RS + d]), y = to_f(sK[r * RS + d]);
          a = fmaf(x, x, a);
          b = fmaf(y, y, b);
        }
        for (int off = 16; off > 0; off >>= 1) {
          a += __shfl_xor_sync(0xffffffffu, a, off);
          b += __shfl_xor_sync(0xffffffffu, b, off);
        }
        ra = 1.f / sqrtf(a + float(kKdaL2Eps));
        rb = 1.f / sqrtf(b + float(kKdaL2Eps));
      }
      if (lane == 0) sRq[r] = ra, sRk[r] = rb;
    }
  }
  __syncthreads();
  if (p.G_out) {  // backward recompute: G, normalised q / k, beta (read-only use of shared memory)
    constexpr int E = 4;
    for (int i = t; i < kC * K / E; i += NT) {
      const int r = i / (K / E), d = E * (i % (K / E));
      alignas(16) float G[E], qv[E], kv[E];
      ld16(sG + r * KP + d, G);
      lds4(sQ + r * RS + d, qv);
      lds4(sK + r * RS + d, kv);
#pragma unroll
      for (int e = 0; e < E; ++e) qv[e] *= sRq[r], kv[e] *= sRk[r];
      st16(p.G_out + task * kC * K + E * i, G);
      st16(p.qn_out + task * kC * K + E * i, qv);
      st16(p.kn_out + task * kC * K + E * i, kv);
    }
    if (t < kC) p.beta_out[task * kC + t] = sBeta[t];
  }

  // ---- 3. pre-gated q and k for the state pass, and the chunk decay exp(G_{L-1})
  const float* GL = sG + (L - 1) * KP;
  {
    float* qg = p.qg + task * kC * K;
    float* kg = p.kg + task * kC * K;
    constexpr int E = 4;  // 4 channels per thread and step: 16-byte shared / global accesses
    for (int i = t; i < kC * K / E; i += NT) {
      const int r = i / (K / E), d = E * (i % (K / E));
      alignas(16) float a[E] = {0.f, 0.f, 0.f, 0.f}, b[E] = {0.f, 0.f, 0.f, 0.f};
      if (r < L) {
        alignas(16) float G[E], Gl[E], qr[E], kr[E];
        ld16(sG + r * KP + d, G);
        ld16(GL + d, Gl);
        lds4(sQ + r * RS + d, qr);
        lds4(sK + r * RS + d, kr);
        const float rq = sRq[r], rk = sRk[r];
#pragma unroll
        for (int e = 0; e < E; ++e) {
          a[e] = p.scale * (qr[e] * rq) * exp_in<Tin>(G[e]);  // exp(G) <= 1
          b[e] = (kr[e] * rk) * exp_in<Tin>(Gl[e] - G[e]);    // G_{L-1} <= G_r
        }
      }
      st16(qg + E * i, a);
      st16(kg + E * i, b);
    }
    if (t < K) p.gl[task * K + t] = exp_in<Tin>(GL[t]);
  }

  float* sM = sX;   // [C][kAP] M^-1 (steps 5, 6)
  if (p.minv_in) {  // backward recompute from the forward's kept A_qk and M^-1: steps 4, 5 skipped
    for (int i = t; i < kC * kC / 4; i += NT) {
      const int r = i / (kC / 4), c = 4 * (i % (kC / 4));
      st4(sM + r * kAP + c, ld4(p.minv_in + task * kC * kC + 4 * i));
    }
    __syncthreads();
  } else {
    // ---- 4. A_qk (to global) and A_kk (to shared), one 16-row block row i at a time, all with the
    // reference row n = 16 i: Xq_r = q_r exp(G_r - G_n), Xk_r = k_r exp(G_r - G_n) for the 16 rows
    // r of block row i, Y_s = k_s exp(G_n - G_s) for s < n + 16, and A[r][s] = Xq_r . Y_s.
    //   s < n (off-diagonal blocks): both factors <= 1, always safe.
    //   n <= s <= r (diagonal block): exp(G_r - G_n) >= exp(-span), exp(G_n - G_s) <= exp(span),
    //     span = max_d (G_n - G_{n+15}); used while span <= kSpanMax (both factors normal and
    //     finite; upper-triangle products are discarded by select). A block row whose diagonal
    //     block spans more (mean decay > kSpanMax / 15 nats per token) forms exp(G_r - G_s) per
    //     element.
    // X and Y are formed KX channels at a time (the tile accumulators persist over the passes).
    // Warp w owns the 16 x 8 tile w of the block row: product w / nt (0: A_qk, 1: A_kk), columns
    // 8 (w % nt) ..
    {
      float* sXq = sX;                 // [16][XP]
      float* sXk = sX + kSub * XP;     // [16][XP]
      float* sY = sX + 2 * kSub * XP;  // [64][XP]
      float* aqk = p.aqk + task * kC * kC;
      const int warp = t >> 5;
#pragma unroll  // constant n: constant divisors below
      for (int i = 0; i < kC / kSub; ++i) {
        const int n = kSub * i, ncol = n + kSub, nt = ncol / 8;
        const int prod = warp / nt, n0 = 8 * (warp % nt);  // prod 0: A_qk, 1: A_kk, >= 2: idle
        float acc[1][1][4];
        zero(acc);
        bool wide = false, per_element = false;
        for (int x0 = 0; x0 < K; x0 += KX) {
          // Four channels per thread: the sweep's rows 0..15 are Xq / Xk (rows n..n+15, where the
          // diagonal block's span is checked too), rows 16.. are Y (rows 0..ncol-1).
          constexpr int C4 = KX / 4, RPS = NT / C4;
          static_assert(32 % C4 == 0 && kSub % (32 / C4) == 0, "warp-uniform X / Y rows");
          const int c = 4 * (t % C4), d = x0 + c;
          alignas(16) float gn[4];
          ld16(sG + n * KP + d, gn);
          for (int row = t / C4; row < kSub + ncol; row += RPS) {
            alignas(16) float G[4], kr[4], y[4];
            if (row < kSub) {  // warp-uniform: a warp covers 32 / C4 rows (2 at KX = 64)
              const int r = n + row;
              alignas(16) float qr[4], xq[4];
              ld16(sG + r * KP + d, G);
              lds4(sQ + r * RS + d, qr);
              lds4(sK + r * RS + d, kr);
              const float rq = sRq[r], rk = sRk[r];
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                wide |= !(fabsf(gn[e] - G[e]) <= kSpanMax);
                const float ee = exp_in<Tin>(G[e] - gn[e]);
                xq[e] = (qr[e] * rq) * ee;
                y[e] = (kr[e] * rk) * ee;
              }
              st16(sXq + row * XP + c, xq);
              st16(sXk + row * XP + c, y);
            } else {
              const int s = row - kSub;
              ld16(sG + s * KP + d, G);
              lds4(sK + s * RS + d, kr);
              const float rk = sRk[s];
#pragma unroll
              for (int e = 0; e < 4; ++e) y[e] = (kr[e] * rk) * exp_in<Tin>(gn[e] - G[e]);
              st16(sY + s * XP + c, y);
            }
          }
          if (x0 + KX < K)
            __syncthreads();
          else
            per_element = __syncthreads_or(wide) != 0;
          if (prod < 2) warp_mma<P>(acc, Mat{prod ? sXk : sXq, XP}, MatT{sY, XP}, 0, n0, 0, KX);
          __syncthreads();  // X, Y free for the next pass
        }
        if (prod < 2)
          for_each(acc, 0, n0, [&](int a, int s, float x) {
            const int r = n + a;
            float v = 0.f;  // s > r (A_qk) or s >= r (A_kk): zero
            if (prod == 0 ? s <= r : s < r) {
              if (per_element && s >= n) {
                x = 0.f;
                for (int d = 0; d < K; ++d)  // r >= s
                  x = fmaf(prod ? kn(r, d) : qn(r, d),
                           kn(s, d) * exp_in<Tin>(sG[r * KP + d] - sG[s * KP + d]), x);
              }
              v = prod == 0 ? p.scale * x : sBeta[r] * x;
            }
            if (prod == 0)
              aqk[r * kC + s] = v;
            else
              sA[r * kAP + s] = v;
          });
        for (int idx = t; idx < kSub * (kC - ncol); idx += NT)  // columns past the block row
          aqk[(n + idx / (kC - ncol)) * kC + ncol + idx % (kC - ncol)] = 0.f;
      }
      __syncthreads();  // A_kk complete
    }

    // ---- 5. M^-1 = (I + A_kk)^-1 into sM (lower triangular, zeros above the diagonal).
    // (a) the four 16x16 diagonal blocks D_b^-1 by forward substitution, one thread per column j,
    //     the column in registers: X[r][j] = -sum_{m < r} A[r][m] X[m][j] (X[m][j] = 0 for m < j),
    //     X[j][j] = 1;
    // (b) block rows i = 1..3: T = A[block i][0, n) M^-1[0, n)[0, n);  M^-1[block i][0, n) =
    // -D_i^-1 T.
    float* sT = sX + kC * kAP;  // [16][kTP]
    for (int idx = t; idx < kC * kAP; idx += NT) sM[idx] = 0.f;
    __syncthreads();
    if (t < kC) {
      const int n = t & ~(kSub - 1), jj = t & (kSub - 1);
      float x[kSub];
#pragma unroll
      for (int r = 0; r < kSub; ++r) x[r] = r == jj ? 1.f : 0.f;
#pragma unroll
      for (int r = 1; r < kSub; ++r) {
        float acc = 0.f;
#pragma unroll
        for (int m = 0; m < r; ++m) acc = fmaf(sA[(n + r) * kAP + n + m], x[m], acc);
        if (r > jj) x[r] = -acc;
      }
#pragma unroll
      for (int r = 0; r < kSub; ++r) sM[(n + r) * kAP + n + jj] = x[r];
    }
    __syncthreads();
#pragma unroll  // constant n: constant divisors below
    for (int i = 1; i < kC / kSub; ++i) {
      // Four columns c .. c + 3 per thread (a float4 of M^-1 or T per step). Column c + j's sum
      // starts at m = c, not c + j: the extra terms are products with the exact zeros of M^-1
      // above its diagonal, so every element is the same sum, bit for bit, as one column at a time.
      const int n = kSub * i, nc = n / 4;
      for (int idx = t; idx < kSub * nc; idx += NT) {
        const int a = idx / nc, c = 4 * (idx % nc);
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int m = c; m < n; ++m) fma4(acc, sA[(n + a) * kAP + m], ld4(sM + m * kAP + c));
        st4(sT + a * kTP + c, acc);
      }
      __syncthreads();
      for (int idx = t; idx < kSub * nc; idx += NT) {
        const int a = idx / nc, c = 4 * (idx % nc);
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int m = 0; m <= a; ++m) fma4(acc, sM[(n + a) * kAP + n + m], ld4(sT + m * kTP + c));
        st4(sM + (n + a) * kAP + c, make_float4(-acc.x, -acc.y, -acc.z, -acc.w));
      }
      __syncthreads();
    }

    if (p.minv_out)  // backward recompute, or the forward keeping M^-1
      for (int idx = t; idx < kC * kC; idx += NT)
        p.minv_out[task * kC * kC + idx] = sM[(idx / kC) * kAP + idx % kC];
  }  // steps 4, 5

  // ---- 6. W = M^-1 (beta exp(G) k), U = M^-1 (beta v). beta exp(G) k replaces G in place;
  // beta v then replaces the raw q and k. With vec16, v arrives 16 bytes per load, issued
  // before the exp loop so that their latency overlaps it.
  constexpr int EV = 16 / int(sizeof(Tin));                  // v elements per 16-byte load
  constexpr int NVL = (kC * kIntraMaxV / EV + NT - 1) / NT;  // loads per thread at V = 128
  alignas(16) Tin vr[NVL][EV];
  const int vl_row = p.V / EV;  // loads per row
  if (p.vec16) {
#pragma unroll
    for (int j = 0; j < NVL; ++j) {
      const int i = t + j * NT, s = i / vl_row, c = EV * (i % vl_row);
      if (i < kC * vl_row && s < L) ld16(p.v + ((int64_t(bos) + s) * p.HV + h) * p.V + c, vr[j]);
    }
  }
  for (int i = t; i < kC * K / 4; i += NT) {
    const int s = i / (K / 4), d = 4 * (i % (K / 4));
    alignas(16) float G[4], kr[4];
    ld16(sG + s * KP + d, G);
    lds4(sK + s * RS + d, kr);
    const float rk = sRk[s], b = sBeta[s];
#pragma unroll
    for (int e = 0; e < 4; ++e) G[e] = (kr[e] * rk) * (b * exp_in<Tin>(G[e]));
    st16(sG + s * KP + d, G);
  }
  __syncthreads();
  if (p.vec16) {
#pragma unroll
    for (int j = 0; j < NVL; ++j) {
      const int i = t + j * NT, s = i / vl_row, c = EV * (i % vl_row);
      if (i < kC * vl_row) {
        alignas(16) float x[EV];
#pragma unroll
        for (int e = 0; e < EV; ++e) x[e] = s < L ? sBeta[s] * to_f(vr[j][e]) : 0.f;
        st16(sVb + s * VP + c, x);
      }
    }
  } else {
    for (int s = t >> 5; s < kC; s += NT / 32)  // a warp per row (V % 32 == 0)
      for (int c = t & 31; c < p.V; c += 32) {
        float x = 0.f;
        if (s < L) x = sBeta[s] * to_f(p.v[((int64_t(bos) + s) * p.HV + h) * p.V + c]);
        sVb[s * VP + c] = x;
      }
  }
  __syncthreads();
  {  // M^-1 is lower triangular: a 16-row tile's sum stops at its last row
    float* w = p.w + task * kC * K;
    float* u = p.u + task * kC * p.V;
    const int V = p.V;
    auto kend = [](int m0) { return m0 + 16; };
    block_mma_kend<P, 1, 4>(kC, K, Mat{sM, kAP}, Mat{sG, KP}, kend,
                            [&](int r, int c, float x) { w[r * K + c] = x; });
    block_mma_kend<P, 1, 4>(kC, V, Mat{sM, kAP}, Mat{sVb, VP}, kend,
                            [&](int r, int c, float x) { u[r * V + c] = x; });
  }
}

}  // namespace

template <class Tin>
void launch_intra(const Plan& pl, const IntraParams<Tin>& ip, unsigned tf32) {
  with_k(pl.K, kOp, [&](auto kc) {
    constexpr int K = decltype(kc)::value;
    const size_t smem = size_t(IntraLayout<Tin>(K, int(pl.V)).total) * sizeof(float);
    with_prec<kStageIntra, Tin>(tf32, [&](auto tf32c) {
      constexpr bool F = decltype(tf32c)::value;
      set_smem(kOp, reinterpret_cast<const void*>(&kda_intra_kernel<K, Tin, F>), smem,
               "intra kernel");
      kda_intra_kernel<K, Tin, F>
          <<<dim3(unsigned(pl.NC), unsigned(pl.HV)), kIntraThreads, smem>>>(ip);
    });
    check_launch(kOp, "intra kernel");
  });
}

template void launch_intra<float>(const Plan&, const IntraParams<float>&, unsigned);
template void launch_intra<__nv_bfloat16>(const Plan&, const IntraParams<__nv_bfloat16>&, unsigned);

}  // namespace hlm::ops::cuda::kda
