// KDA chunked forward on CUDA (ops/kda_chunk_cuda.h; spec kda.md 2.1-2.4, 2.6, 3), C = 64.
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
// exp safety (spec 2.6): g <= 0 makes G non-increasing. Block row i (rows n .. n+15, n = 16 i)
// of A_qk / A_kk uses the reference row n: exp(G_r - G_s) = exp(G_r - G_n) exp(G_n - G_s), i.e.
// A[r][s] = (q_r exp(G_r - G_n)) . (k_s exp(G_n - G_s)), a plain product of pre-scaled rows.
//   s < n (off-diagonal 16x16 blocks): both factors <= 1, always safe (FLA's choice too).
//   n <= s <= r (diagonal block): exp(G_r - G_n) in [exp(-span), 1], exp(G_n - G_s) in
//     [1, exp(span)] with span = max_d (G_n - G_{n+15}); used while span <= 80 nats (both factors
//     normal and finite in FP32; the products above the diagonal are discarded by select, never
//     multiplied by a mask). A diagonal block that spans more (mean decay above ~5.3 nats per
//     token; never with the lower-bound gate, which caps it at 5 * 15 = 75) forms exp(G_r - G_s)
//     per element instead, only for s <= r (masked before the exp).
// exp(-G) alone is never formed; exp(G) and exp(G_{L-1} - G) are <= 1. The factors take expf
// for f32 inputs and ex2.approx.ftz for bf16 inputs (exp_in, kda_chunk_common.cuh: ~6e-6 relative
// at the 80-nat span, where the arguments reach -80).
//
// Kernel families (no atomics; every reduction has a fixed order). The matrix products run on
// tensor cores for bf16 inputs (mma_tf32.cuh: TF32 operands, or 3xTF32 with exact_bf16_products;
// the stage precisions of kda_chunk_common.cuh; FP32 accumulation) and in FP32 FMA for f32 inputs
// (the same fragment ownership); the cumsum, norms, exps and the 16x16 substitutions are FP32 FMA.
//   kda_intra_kernel<K, Tin>: grid (NC, HV), 512 threads, one block per (chunk, value head).
//     Writes W, U, qg, kg, A_qk, gl for its chunk into the f32 workspace (all C rows). A_qk and
//     A_kk by 16-row block rows (16 x 8 tiles over the 16 warps); M^-1: the four 16x16 diagonal
//     blocks by forward substitution (one thread per column, in registers), then block rows;
//     W and U as M^-1 products (lower triangular: each 16-row tile stops at its last row).
//   kda_state_kernel<K, Tin>: grid (N * HV * V/32), 256 threads, one block per (sequence, value
//     head, 32-wide V tile), looping over the sequence's chunks. The state tile S [K, 32] lives
//     in shared memory; the next chunk's operands are fetched by cp.async while the current one
//     is computed (two commit groups per chunk: {W, qg, U} for phase A, {kg, A_qk, gl} for B).
//
// The backward (kda_chunk_bwd.cu) reuses both kernels through kda_cuda_detail::recompute: the
// intra kernel then also stores G, the normalised q / k, beta and M^-1, the state kernel the
// chunk-start states h and V_new, and the output o is skipped.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "ops/cuda/kda_chunk_common.cuh"
#include "ops/cuda/mma_tf32.cuh"
#include "ops/kda_chunk_cuda.h"
#include "ops/seqlens.h"

namespace hlm::ops {
namespace {

using namespace kda_cu;

constexpr int kC = 64;              // chunk size (== kKdaChunk)
constexpr int kSub = 16;            // sub-chunk (block) size of the intra matrices
constexpr int kIntraThreads = 512;  // intra kernel: one warp per row of a 16-row block
constexpr int kIntraMaxV = 128;     // the largest V the kernels take
constexpr int kThreads = 256;       // state kernel
constexpr float kSpanMax = 80.f;    // largest decay span (nats) of a diagonal 16x16 block for
                                    // the split-reference product (else per element)
constexpr int kBV = 32;             // V tile of the state pass: 32, or 64 when that still fills
                                    // the GPU (state_tile)
constexpr int kAP = kC + 4;         // row stride of the C x C shared matrices (A_kk, M^-1)
constexpr int kTP = 3 * kSub + 4;   // row stride of the block-inverse scratch [16][48]
constexpr int kIntraKX = 64;        // channels per pass of the intra kernel's A products

static_assert(kKdaChunk == kC, "the CUDA kernels are written for C = 64");

enum GateKind : int { kGateNone = 0, kGateStandard = 1, kGateLowerBound = 2 };

// ------------------------------------------------------------------ parameter blocks

// Intra-chunk kernel. task = chunk * HV + h indexes the per-(chunk, head) workspace slices.
template <class Tin>
struct IntraParams {
  const Tin* q;          // [T, H, K]
  const Tin* k;          // [T, H, K]
  const Tin* v;          // [T, HV, V]
  const Tin* g;          // [T, HV, K] log decay, or the raw gate input z (gate != none)
  const Tin* beta;       // [T, HV] in (0, 1), or logits (beta_logits)
  const float* A_log;    // [HV] or null (exp(A_log) = 1); gate only
  const float* dt_bias;  // [HV * K] or null (0); gate only
  const int* chunk_bos;  // [NC] first token of each chunk
  const int* chunk_len;  // [NC] 1..C
  float* qg;             // [NC, HV, C, K] scale q exp(G)
  float* kg;             // [NC, HV, C, K] k exp(G_{L-1} - G)
  float* w;              // [NC, HV, C, K] M^-1 (beta exp(G) k)
  float* u;              // [NC, HV, C, V] M^-1 (beta v)
  float* aqk;            // [NC, HV, C, C] A_qk (scale included)
  float* gl;             // [NC, HV, K]    exp(G_{L-1})
  // Backward recompute only (null in the forward): G, the normalised q and k, beta (after the
  // sigmoid) and M^-1 of all C rows of the chunk (padded rows: G = G_{L-1}, q = k = beta = 0,
  // M^-1 rows of the identity).
  float* G_out;     // [NC, HV, C, K]
  float* qn_out;    // [NC, HV, C, K]
  float* kn_out;    // [NC, HV, C, K]
  float* beta_out;  // [NC, HV, C]
  float* minv_out;  // [NC, HV, C, C] (also the forward's, when it keeps M^-1 for the backward)
  // Backward recompute from the forward's kept A_qk (then read-only at aqk) and M^-1: the A
  // products and the inverse are skipped; null otherwise.
  const float* minv_in;  // [NC, HV, C, C]
  int H, HV, V;
  float scale;
  int gate;           // GateKind
  float lower_bound;  // gate == lower bound
  bool l2norm;        // q, k <- x / sqrt(sum x^2 + 1e-6)
  bool beta_logits;   // beta <- sigmoid(beta)
  bool vec16;         // q, k, v, g (and dt_bias) 16-byte aligned: loaded 16 bytes at a time
};

// State-pass kernel.
template <class Tin>
struct StateParams {
  const float* qg;         // [NC, HV, C, K]
  const float* kg;         // [NC, HV, C, K]
  const float* w;          // [NC, HV, C, K]
  const float* u;          // [NC, HV, C, V]
  const float* aqk;        // [NC, HV, C, C]
  const float* gl;         // [NC, HV, K]
  const float* h0;         // [N, HV, K, V] or null (zeros)
  const int* chunk_bos;    // [NC]
  const int* chunk_len;    // [NC]
  const int* first_chunk;  // [N+1] chunks of sequence n: first_chunk[n] .. first_chunk[n+1]-1
  Tin* o;                  // [T, HV, V], or null (backward recompute: no output)
  float* ht;               // [N, HV, K, V]
  float* h_out;            // [NC, HV, K, V] state at each chunk start, or null (forward)
  float* vnew_out;         // [NC, HV, C, V] V_new of each chunk, or null (forward)
  int HV, V;
};

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

// Shared-memory floats of the state kernel (all offsets multiples of 4: float4 / cp.async). Row
// strides for conflict-free tensor-core fragment loads (mma_tf32.cuh): W, qg and A_qk are read
// as A = Mat (ld = 4 mod 32), kg as A = MatT and the 32-wide tiles as B = Mat (ld = 8 mod 32).
// The BV-wide tiles have row stride BV + 8.
constexpr int kAqP = kC + 4;  // A_qk [C][kAqP]
__host__ __device__ constexpr int state_smem_floats(int K, int BV) {
  return 2 * kC * (K + 4)     // W, qg
         + kC * (K + 8)       // kg
         + 3 * kC * (BV + 8)  // U tile, V_new, qg S (then O)
         + kC * kAqP          // A_qk
         + K                  // gl
         + K * (BV + 8);      // S tile
}

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

// ------------------------------------------------------------------ state-pass kernel

// Issue the cp.async copies of phase A's operands of one chunk: W, qg [C][K] (qg null: not
// fetched, no output) and the U tile.
template <int K, int BV>
__device__ __forceinline__ void fetch_a(const float* w, const float* qg, const float* u, int V,
                                        float* sW, float* sQg, float* sU) {
  constexpr int K4 = K / 4;
  for (int i = threadIdx.x; i < kC * K4; i += kThreads) {
    const int r = i / K4, c = 4 * (i % K4);
    cp_async16(sW + r * (K + 4) + c, w + 4 * i);
    if (qg) cp_async16(sQg + r * (K + 4) + c, qg + 4 * i);
  }
  for (int i = threadIdx.x; i < kC * BV / 4; i += kThreads) {
    const int r = i / (BV / 4), c = 4 * (i % (BV / 4));
    cp_async16(sU + r * (BV + 8) + c, u + int64_t(r) * V + c);
  }
}

// ... and phase B's: kg [C][K], A_qk [C][C] (null: not fetched), gl [K].
template <int K>
__device__ __forceinline__ void fetch_b(const float* kg, const float* aqk, const float* gl,
                                        float* sKg, float* sAqk, float* sGl) {
  constexpr int K4 = K / 4, C4 = kC / 4;
  for (int i = threadIdx.x; i < kC * K4; i += kThreads)
    cp_async16(sKg + (i / K4) * (K + 8) + 4 * (i % K4), kg + 4 * i);
  if (aqk)
    for (int i = threadIdx.x; i < kC * C4; i += kThreads)
      cp_async16(sAqk + (i / C4) * kAqP + 4 * (i % C4), aqk + 4 * i);
  if (threadIdx.x < K4) cp_async16(sGl + 4 * threadIdx.x, gl + 4 * threadIdx.x);
}

__device__ __forceinline__ void store1(float* p, float x) {
  *p = x;
}
__device__ __forceinline__ void store1(__nv_bfloat16* p, float x) {
  *p = __float2bfloat16_rn(x);
}

// Per (sequence, value head, BV-wide V tile), chunks in order; eight warps, all products on
// tensor cores (mma_tf32.cuh: TF32 or 3xTF32 for bf16 inputs, FP32 FMA for f32).
//   phase A: warps 0-3 V_new = U - W S, warps 4-7 qg S, rows 16 (w % 4) .. + 15, all BV columns
//            (no output: every warp V_new, rows 16 (w % 4) .., half the columns);
//   phase B: O = qg S + A_qk V_new (rows 16 (w % 4) .. + 15, half the columns; A_qk lower
//            triangular: the sum stops at the tile's last row), then every warp S <- Diag(gl) S
//            + kg^T V_new for the state rows 16 w' .. + 15 (w' = w, w + 8, ..; own elements: in
//            place).
template <int K, int BV, class Tin, bool kTf32>
__global__ void __launch_bounds__(kThreads) kda_state_kernel(const StateParams<Tin> p) {
  static_assert(K % 32 == 0 && K <= 128, "K must be 32, 64 or 128");
  using namespace mma_cu;
  constexpr Prec P = prec_for<Tin, kTf32>;
  constexpr int KA = K + 4, KB = K + 8, kT8 = BV + 8, WN = BV / 8;
  extern __shared__ float4 smem4[];
  float* sW = reinterpret_cast<float*>(smem4);  // [C][KA]   W
  float* sQg = sW + kC * KA;                    // [C][KA]   qg
  float* sU = sQg + kC * KA;                    // [C][kT8]  U tile
  float* sKg = sU + kC * kT8;                   // [C][KB]   kg
  float* sAqk = sKg + kC * KB;                  // [C][kAqP] A_qk
  float* sGl = sAqk + kC * kAqP;                // [K]       exp(G_{L-1})
  float* sVn = sGl + K;                         // [C][kT8]  V_new
  float* sO = sVn + kC * kT8;                   // [C][kT8]  qg S
  float* sS = sO + kC * kT8;                    // [K][kT8]  state tile

  const int t = threadIdx.x, warp = t >> 5;
  const int nvt = p.V / BV;
  const int vt = int(blockIdx.x % unsigned(nvt));
  const int nh = int(blockIdx.x / unsigned(nvt));
  const int h = nh % p.HV, n = nh / p.HV;
  const int v0 = vt * BV;
  const int64_t sbase = (int64_t(n) * p.HV + h) * K * p.V + v0;  // S[n][h][0][v0]

  for (int i = t; i < K * BV / 4; i += kThreads) {
    const int d = i / (BV / 4), c = 4 * (i % (BV / 4));
    st4(sS + d * kT8 + c,
        p.h0 ? ld4(p.h0 + sbase + int64_t(d) * p.V + c) : make_float4(0.f, 0.f, 0.f, 0.f));
  }

  const int c_begin = p.first_chunk[n], c_end = p.first_chunk[n + 1];
  auto task_of = [&](int ci) { return int64_t(ci) * p.HV + h; };
  if (c_begin < c_end) {
    const int64_t tk = task_of(c_begin);
    fetch_a<K, BV>(p.w + tk * kC * K, p.o ? p.qg + tk * kC * K : nullptr, p.u + tk * kC * p.V + v0,
                   p.V, sW, sQg, sU);
    cp_async_commit();
    fetch_b<K>(p.kg + tk * kC * K, p.o ? p.aqk + tk * kC * kC : nullptr, p.gl + tk * K, sKg, sAqk,
               sGl);
    cp_async_commit();
  }
  for (int ci = c_begin; ci < c_end; ++ci) {
    const int bos = p.chunk_bos[ci], L = p.chunk_len[ci];
    cp_async_wait<1>();  // this chunk's {W, qg, U} landed ({kg, A_qk, gl} may be in flight)
    __syncthreads();
    if (p.h_out) {  // backward recompute: the state at the chunk start
      float* hs = p.h_out + task_of(ci) * K * p.V + v0;
      for (int i = t; i < K * BV / 4; i += kThreads) {
        const int d = i / (BV / 4), c = 4 * (i % (BV / 4));
        st4(hs + int64_t(d) * p.V + c, ld4(sS + d * kT8 + c));
      }
    }

    if (p.o) {  // ---- phase A: warps 0-3 V_new = U - W S, warps 4-7 qg S
      const int role = warp >> 2, m0 = 16 * (warp & 3);
      float acc[1][WN][4];
      zero(acc);
      warp_mma<P>(acc, Mat{role ? sQg : sW, KA}, Mat{sS, kT8}, m0, 0, 0, K);
      if (role == 0)
        for_each(acc, m0, 0,
                 [&](int r, int c, float x) { sVn[r * kT8 + c] = sU[r * kT8 + c] - x; });
      else
        for_each(acc, m0, 0, [&](int r, int c, float x) { sO[r * kT8 + c] = x; });
    } else {  // ---- phase A without an output: V_new over all eight warps (half a tile row each)
      const int m0 = 16 * (warp & 3), n0 = (BV / 2) * (warp >> 2);
      float acc[1][WN / 2][4];
      zero(acc);
      warp_mma<P>(acc, Mat{sW, KA}, Mat{sS, kT8}, m0, n0, 0, K);
      for_each(acc, m0, n0, [&](int r, int c, float x) { sVn[r * kT8 + c] = sU[r * kT8 + c] - x; });
    }
    __syncthreads();   // V_new, qg S complete; sW, sQg, sU free
    if (p.vnew_out) {  // backward recompute: V_new (all C rows; padded rows are zero)
      float* vs = p.vnew_out + task_of(ci) * kC * p.V + v0;
      for (int i = t; i < kC * BV / 4; i += kThreads) {
        const int r = i / (BV / 4), c = 4 * (i % (BV / 4));
        st4(vs + int64_t(r) * p.V + c, ld4(sVn + r * kT8 + c));
      }
    }
    if (ci + 1 < c_end) {
      const int64_t tk = task_of(ci + 1);
      fetch_a<K, BV>(p.w + tk * kC * K, p.o ? p.qg + tk * kC * K : nullptr,
                     p.u + tk * kC * p.V + v0, p.V, sW, sQg, sU);
    }
    cp_async_commit();   // (possibly empty: keeps the group count uniform)
    cp_async_wait<1>();  // this chunk's {kg, A_qk, gl} landed
    __syncthreads();

    // ---- phase B
    if (p.o) {  // O = qg S + A_qk V_new: rows 16 (w % 4) .., half the columns per warp
      const int m0 = 16 * (warp & 3), n0 = (BV / 2) * (warp >> 2);
      float acc[1][WN / 2][4];
#pragma unroll
      for (int j = 0; j < WN / 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[0][j][e] = sO[acc_row(m0, 0, e) * kT8 + acc_col(n0, j, e)];
      warp_mma<P>(acc, Mat{sAqk, kAqP}, Mat{sVn, kT8}, m0, n0, 0, m0 + 16);
      for_each(acc, m0, n0, [&](int r, int c, float x) {
        if (r < L) store1(p.o + ((int64_t(bos) + r) * p.HV + h) * p.V + v0 + c, x);
      });
    }
    {  // S <- Diag(gl) S + kg^T V_new (rows >= L of kg and V_new are zero)
      const int kend = (L + 7) & ~7;
      for (int m0 = 16 * warp; m0 < K; m0 += 16 * (kThreads / 32)) {
        float acc[1][WN][4];
#pragma unroll
        for (int j = 0; j < WN; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int d = acc_row(m0, 0, e), c = acc_col(0, j, e);
            acc[0][j][e] = sGl[d] * sS[d * kT8 + c];
          }
        warp_mma<P>(acc, MatT{sKg, KB}, Mat{sVn, kT8}, m0, 0, 0, kend);
        for_each(acc, m0, 0, [&](int d, int c, float x) { sS[d * kT8 + c] = x; });
      }
    }
    __syncthreads();  // S updated; sKg, sAqk, sGl, sVn, sO free
    if (ci + 1 < c_end) {
      const int64_t tk = task_of(ci + 1);
      fetch_b<K>(p.kg + tk * kC * K, p.o ? p.aqk + tk * kC * kC : nullptr, p.gl + tk * K, sKg, sAqk,
                 sGl);
    }
    cp_async_commit();
  }
  cp_async_wait<0>();
  __syncthreads();
  for (int i = t; i < K * BV / 4; i += kThreads) {
    const int d = i / (BV / 4), c = 4 * (i % (BV / 4));
    st4(p.ht + sbase + int64_t(d) * p.V + c, ld4(sS + d * kT8 + c));
  }
}

// ------------------------------------------------------------------ host side

constexpr const char* kOp = "kda_chunk_forward_cuda";

// Validated shapes, the chunk table and the workspace layout of one call.
struct Plan : kda_cuda_detail::Plan {
  // workspace offsets in floats (multiples of 64: 256-byte aligned slices)
  int64_t off_qg, off_kg, off_w, off_u, off_aqk, off_gl, off_meta, total;
};

void require_cuda(const Tensor& t, const char* what, const char* op = kOp) {
  HLM_CHECK(t.defined(), "{}: {} is undefined", op, what);
  HLM_CHECK(t.device() == Device::cuda, "{}: {} must be a CUDA tensor, got {}", op, what,
            t.describe());
  HLM_CHECK(t.is_contiguous(), "{}: {} must be contiguous, got {}", op, what, t.describe());
}

Plan make_plan(const KdaArgs& a, const char* op = kOp) {
  require_cuda(a.q, "q", op);
  require_cuda(a.k, "k", op);
  require_cuda(a.v, "v", op);
  require_cuda(a.g, "g", op);
  require_cuda(a.beta, "beta", op);
  HLM_CHECK(a.q.dtype() == DType::f32 || a.q.dtype() == DType::bf16,
            "{}: q must be f32 or bf16, got {}", op, a.q.describe());
  HLM_CHECK(a.q.dim() == 3, "{}: q must be [T, H, K], got {}", op, a.q.describe());
  HLM_CHECK(a.v.dim() == 3, "{}: v must be [T, HV, V], got {}", op, a.v.describe());
  Plan p;
  p.T = a.q.size(0), p.H = a.q.size(1), p.K = a.q.size(2);
  p.HV = a.v.size(1), p.V = a.v.size(2);
  HLM_CHECK(p.H > 0 && p.HV > 0, "{}: empty head dims: q {}, v {}", op, a.q.describe(),
            a.v.describe());
  HLM_CHECK(a.k.shape() == a.q.shape(), "{}: k must have q's shape {}, got {}", op,
            shape_str(a.q.shape()), a.k.describe());
  HLM_CHECK(a.v.size(0) == p.T, "{}: v must be [T={}, HV, V], got {}", op, p.T, a.v.describe());
  HLM_CHECK(p.HV % p.H == 0, "{}: value heads HV={} (v) must be a multiple of qk heads H={} (q)",
            op, p.HV, p.H);
  HLM_CHECK(a.g.shape() == Shape({p.T, p.HV, p.K}), "{}: g must be [{}, {}, {}], got {}", op, p.T,
            p.HV, p.K, a.g.describe());
  HLM_CHECK(a.beta.shape() == Shape({p.T, p.HV}), "{}: beta must be [{}, {}], got {}", op, p.T,
            p.HV, a.beta.describe());
  for (auto [t, name] : {std::pair{&a.k, "k"}, {&a.v, "v"}, {&a.g, "g"}, {&a.beta, "beta"}})
    HLM_CHECK(t->dtype() == a.q.dtype(), "{}: {} must have the dtype of q ({}), got {}", op, name,
              dtype_name(a.q.dtype()), t->describe());
  HLM_CHECK(p.K == 32 || p.K == 64 || p.K == 128,
            "{}: key head dim K must be 32, 64 or 128 on CUDA, got {} (q {})", op, p.K,
            a.q.describe());
  HLM_CHECK(p.V % kBV == 0 && p.V >= 32 && p.V <= 128,
            "{}: value head dim V must be a multiple of 32 in [32, 128] on CUDA, got {} (v {})", op,
            p.V, a.v.describe());
  HLM_CHECK(p.T < (int64_t(1) << 31) - kC, "{}: T={} tokens exceed the int32 chunk table", op, p.T);

  std::vector<int64_t> cu;
  if (a.cu_seqlens.defined()) {
    HLM_CHECK(a.cu_seqlens.dim() == 1 && a.cu_seqlens.size(0) >= 2,
              "{}: cu_seqlens must be [N+1] with N >= 1, got {}", op, a.cu_seqlens.describe());
    cu = check_cu_seqlens(a.cu_seqlens, p.T, fmt::format("{}: cu_seqlens", op).c_str());
  } else {
    cu = {0, p.T};
  }
  p.N = int64_t(cu.size()) - 1;
  if (a.initial_state.defined()) {
    require_cuda(a.initial_state, "initial_state", op);
    HLM_CHECK(a.initial_state.dtype() == DType::f32, "{}: initial_state must be f32, got {}", op,
              a.initial_state.describe());
    HLM_CHECK(a.initial_state.shape() == Shape({p.N, p.HV, p.K, p.V}),
              "{}: initial_state must be [{}, {}, {}, {}], got {}", op, p.N, p.HV, p.K, p.V,
              a.initial_state.describe());
    HLM_CHECK(aligned16(a.initial_state), "{}: initial_state must be 16-byte aligned", op);
  }
  if (a.gate) {
    HLM_CHECK(a.A_log.defined() || *a.gate == KdaGateKind::lower_bound,
              "{}: A_log [HV] is required with the standard gate", op);
    if (a.A_log.defined()) {
      require_cuda(a.A_log, "A_log", op);
      HLM_CHECK(a.A_log.dtype() == DType::f32 && a.A_log.shape() == Shape({p.HV}),
                "{}: A_log must be f32 [{}], got {}", op, p.HV, a.A_log.describe());
    }
    if (a.dt_bias.defined()) {
      require_cuda(a.dt_bias, "dt_bias", op);
      HLM_CHECK(a.dt_bias.dtype() == DType::f32 && a.dt_bias.shape() == Shape({p.HV * p.K}),
                "{}: dt_bias must be f32 [{}], got {}", op, p.HV * p.K, a.dt_bias.describe());
    }
    if (*a.gate == KdaGateKind::lower_bound)
      HLM_CHECK(a.lower_bound >= -5.0 && a.lower_bound < 0.0,
                "{}: lower_bound must lie in [-5, 0), got {}", op, a.lower_bound);
  }
  HLM_CHECK(std::isfinite(a.scale), "{}: scale must be finite, got {}", op, a.scale);
  p.scale = float(a.scale > 0 ? a.scale : 1.0 / std::sqrt(double(p.K)));

  // Chunk table: chunks never cross a sequence boundary; the last one of a sequence may be short.
  std::vector<int32_t> bos, len, first{0};
  for (int64_t n = 0; n < p.N; ++n) {
    for (int64_t s = cu[size_t(n)]; s < cu[size_t(n) + 1]; s += kC) {
      bos.push_back(int32_t(s));
      len.push_back(int32_t(std::min<int64_t>(kC, cu[size_t(n) + 1] - s)));
    }
    first.push_back(int32_t(bos.size()));
  }
  p.NC = int64_t(bos.size());
  HLM_CHECK(p.N * p.HV * (p.V / kBV) < (int64_t(1) << 31),
            "{}: N={} sequences x HV={} heads exceed the grid", op, p.N, p.HV);
  p.meta = bos;
  p.meta.insert(p.meta.end(), len.begin(), len.end());
  p.meta.insert(p.meta.end(), first.begin(), first.end());

  const int64_t tasks = p.NC * p.HV;
  int64_t off = 0;
  auto take = [&](int64_t floats) {
    const int64_t o = off;
    off = round_up(off + floats, 64);
    return o;
  };
  p.off_qg = take(tasks * kC * p.K);
  p.off_kg = take(tasks * kC * p.K);
  p.off_w = take(tasks * kC * p.K);
  p.off_u = take(tasks * kC * p.V);
  p.off_aqk = take(tasks * kC * kC);
  p.off_gl = take(tasks * p.K);
  p.off_meta = take(int64_t(p.meta.size()));  // int32 stored in f32 slots (same size)
  p.total = off;
  return p;
}

}  // namespace

// 64-wide V tiles (half the operand traffic of 32) when they still give every SM a block.
int kda_cuda_detail::state_tile(const Plan& pl) {
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return pl.V % 64 == 0 && pl.N * pl.HV * (pl.V / 64) >= sms ? 64 : 32;
}

namespace {

template <int K, class Tin>
void run_kernels(const kda_cuda_detail::Plan& pl, const KdaArgs& a,
                 const kda_cuda_detail::Intermediates& x, Tin* o) {
  const int* chunk_bos = x.meta;
  const int* chunk_len = x.meta + pl.NC;
  const int* first_chunk = x.meta + 2 * pl.NC;

  if (pl.NC > 0) {
    IntraParams<Tin> ip;
    ip.q = static_cast<const Tin*>(a.q.raw());
    ip.k = static_cast<const Tin*>(a.k.raw());
    ip.v = static_cast<const Tin*>(a.v.raw());
    ip.g = static_cast<const Tin*>(a.g.raw());
    ip.beta = static_cast<const Tin*>(a.beta.raw());
    ip.gate = !a.gate                            ? kGateNone
              : *a.gate == KdaGateKind::standard ? kGateStandard
                                                 : kGateLowerBound;
    ip.A_log = (a.gate && a.A_log.defined()) ? a.A_log.data<float>() : nullptr;
    ip.dt_bias = (a.gate && a.dt_bias.defined()) ? a.dt_bias.data<float>() : nullptr;
    ip.chunk_bos = chunk_bos;
    ip.chunk_len = chunk_len;
    ip.qg = x.qg;
    ip.kg = x.kg;
    ip.w = x.w;
    ip.u = x.u;
    ip.aqk = x.aqk;
    ip.gl = x.gl;
    ip.G_out = x.G;
    ip.qn_out = x.qn;
    ip.kn_out = x.kn;
    ip.beta_out = x.beta;
    ip.minv_out = x.a_kept ? nullptr : x.minv;
    ip.minv_in = x.a_kept ? x.minv : nullptr;
    HLM_CHECK(!x.G == !x.qn && !x.G == !x.kn && !x.G == !x.beta, "{}: G, qn, kn, beta go together",
              kOp);
    ip.H = int(pl.H), ip.HV = int(pl.HV), ip.V = int(pl.V);
    ip.scale = pl.scale;
    ip.lower_bound = float(a.lower_bound);
    ip.l2norm = a.use_qk_l2norm;
    ip.beta_logits = a.beta_logits;
    ip.vec16 = aligned16(a.q) && aligned16(a.k) && aligned16(a.v) && aligned16(a.g) &&
               (!ip.dt_bias || aligned16(a.dt_bias));
    const size_t smem = size_t(IntraLayout<Tin>(K, int(pl.V)).total) * sizeof(float);
    with_prec<kStageIntra, Tin>(a.exact_bf16_products, [&](auto tf32) {
      constexpr bool F = decltype(tf32)::value;
      set_smem(kOp, reinterpret_cast<const void*>(&kda_intra_kernel<K, Tin, F>), smem,
               "intra kernel");
      kda_intra_kernel<K, Tin, F>
          <<<dim3(unsigned(pl.NC), unsigned(pl.HV)), kIntraThreads, smem>>>(ip);
    });
    check_launch(kOp, "intra kernel");
  }

  StateParams<Tin> sp;
  sp.qg = x.qg;
  sp.kg = x.kg;
  sp.w = x.w;
  sp.u = x.u;
  sp.aqk = x.aqk;
  sp.gl = x.gl;
  sp.h0 = a.initial_state.defined() ? a.initial_state.data<float>() : nullptr;
  sp.chunk_bos = chunk_bos;
  sp.chunk_len = chunk_len;
  sp.first_chunk = first_chunk;
  sp.o = o;
  sp.ht = x.ht;
  sp.h_out = x.h;
  sp.vnew_out = x.vnew;
  sp.HV = int(pl.HV), sp.V = int(pl.V);
  auto launch = [&](auto bv) {
    constexpr int BV = decltype(bv)::value;
    const size_t smem = size_t(state_smem_floats(K, BV)) * sizeof(float);
    with_prec<kStageState, Tin>(a.exact_bf16_products, [&](auto tf32) {
      constexpr bool F = decltype(tf32)::value;
      set_smem(kOp, reinterpret_cast<const void*>(&kda_state_kernel<K, BV, Tin, F>), smem,
               "state kernel");
      kda_state_kernel<K, BV, Tin, F><<<unsigned(pl.N * pl.HV * (pl.V / BV)), kThreads, smem>>>(sp);
    });
    check_launch(kOp, "state kernel");
  };
  if (state_tile(pl) == 64)
    launch(std::integral_constant<int, 64>{});
  else
    launch(std::integral_constant<int, 32>{});
}

template <class Tin>
void dispatch_k(const kda_cuda_detail::Plan& pl, const KdaArgs& a,
                const kda_cuda_detail::Intermediates& x, Tin* o) {
  switch (pl.K) {
    case 32:
      return run_kernels<32, Tin>(pl, a, x, o);
    case 64:
      return run_kernels<64, Tin>(pl, a, x, o);
    case 128:
      return run_kernels<128, Tin>(pl, a, x, o);
    default:
      HLM_FAIL("{}: unsupported K={}", kOp, pl.K);
  }
}

}  // namespace

int64_t kda_chunk_cuda_workspace_floats(const KdaArgs& a) {
  return make_plan(a).total;
}

int64_t kda_chunk_cuda_kept_floats(const KdaArgs& a) {
  return kda_cuda_detail::kept_floats(make_plan(a));
}

KdaOutput kda_chunk_forward_cuda(const KdaArgs& a, const KdaChunkCudaBuffers& buffers) {
  const Plan pl = make_plan(a);
  const DType dt = a.q.dtype();

  KdaOutput out;
  out.o = output_buffer(buffers.o, dt, {pl.T, pl.HV, pl.V}, kOp, "buffers.o");
  out.final_state = output_buffer(buffers.final_state, DType::f32, {pl.N, pl.HV, pl.K, pl.V}, kOp,
                                  "buffers.final_state");
  // The intermediates: in the caller's `saved` buffer in the backward's layout (with G, q^, k^,
  // beta, M^-1, h and V_new), or in the forward's own workspace.
  const bool save = buffers.saved.defined(), keep = buffers.kept.defined();
  HLM_CHECK(!(save && keep), "{}: buffers.saved and buffers.kept are alternatives; give one", kOp);
  const Tensor ws = save ? workspace_buffer(buffers.saved, kda_cuda_detail::saved_floats(pl), kOp,
                                            "buffers.saved")
                         : workspace_buffer(buffers.workspace, pl.total, kOp);
  float* wsp = ws.data<float>();
  kda_cuda_detail::Intermediates x;
  if (save) {
    x = kda_cuda_detail::saved_intermediates(pl, wsp);
  } else {
    x.meta = reinterpret_cast<const int*>(wsp + pl.off_meta);
    x.qg = wsp + pl.off_qg;
    x.kg = wsp + pl.off_kg;
    x.w = wsp + pl.off_w;
    x.u = wsp + pl.off_u;
    x.aqk = wsp + pl.off_aqk;
    x.gl = wsp + pl.off_gl;
  }
  if (keep) {  // A_qk and M^-1 into the caller's buffer, for the backward
    const Tensor kb =
        workspace_buffer(buffers.kept, kda_cuda_detail::kept_floats(pl), kOp, "buffers.kept");
    x.aqk = kb.data<float>();
    x.minv = x.aqk + pl.NC * pl.HV * kC * kC;
  }
  static_assert(sizeof(int32_t) == sizeof(float), "the chunk table shares the f32 workspace");
  device_copy(const_cast<int*>(x.meta), Device::cuda, pl.meta.data(), Device::cpu,
              pl.meta.size() * sizeof(int32_t));
  x.ht = out.final_state.data<float>();
  if (dt == DType::bf16)
    dispatch_k<__nv_bfloat16>(pl, a, x, static_cast<__nv_bfloat16*>(out.o.raw()));
  else
    dispatch_k<float>(pl, a, x, out.o.data<float>());
  device_synchronize();
  return out;
}

namespace kda_cuda_detail {

Plan plan(const KdaArgs& a, const char* op) {
  return make_plan(a, op);
}

int64_t kept_floats(const Plan& p) {
  return 2 * p.NC * p.HV * kC * kC;
}

void recompute(const KdaArgs& a, const Plan& p, const Intermediates& x) {
  if (a.q.dtype() == DType::bf16)
    dispatch_k<__nv_bfloat16>(p, a, x, nullptr);
  else
    dispatch_k<float>(p, a, x, nullptr);
}

}  // namespace kda_cuda_detail

}  // namespace hlm::ops
