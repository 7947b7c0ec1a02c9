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
// exp(-G) alone is never formed; exp(G) and exp(G_{L-1} - G) are <= 1. The factors use the
// accurate expf (their arguments reach -80).
//
// Kernel families (FP32 FMA arithmetic; no atomics; every reduction has a fixed order):
//   kda_intra_kernel<K, Tin>: grid (NC, HV), 512 threads (one warp per row of the current 16-row
//     block), one block per (chunk, value head). Writes W, U, qg, kg, A_qk, gl for its chunk into
//     the f32 workspace (all C rows). M^-1: the four 16x16 diagonal blocks by forward
//     substitution (one thread per column, in registers), then block rows.
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
#include <vector>

#include "ops/cuda/kda_chunk_common.cuh"
#include "ops/kda_chunk_cuda.h"
#include "ops/seqlens.h"

namespace hlm::ops {
namespace {

using namespace kda_cu;

constexpr int kC = 64;              // chunk size (== kKdaChunk)
constexpr int kSub = 16;            // sub-chunk (block) size of the intra matrices
constexpr int kIntraThreads = 512;  // intra kernel: one warp per row of a 16-row block
constexpr int kThreads = 256;       // state kernel
constexpr int kVMax = 128;          // largest V
constexpr float kSpanMax = 80.f;    // largest decay span (nats) of a diagonal 16x16 block for
                                    // the split-reference product (else per element)
constexpr int kBV = 32;             // V tile of the state pass
constexpr int kAP = kC + 1;         // row stride of the C x C shared matrices (A_kk, M^-1)
constexpr int kTP = 3 * kSub + 1;   // row stride of the block-inverse scratch [16][48]

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
  float* minv_out;  // [NC, HV, C, C]
  int H, HV, V;
  float scale;
  int gate;           // GateKind
  float lower_bound;  // gate == lower bound
  bool l2norm;        // q, k <- x / sqrt(sum x^2 + 1e-6)
  bool beta_logits;   // beta <- sigmoid(beta)
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

// Shared-memory layout of the intra kernel, in floats (the same on host and device).
struct IntraLayout {
  int kp, qp;               // row strides: K + 1 and max(K, V) + 1 (odd: conflict-free columns)
  int g, q, k, a, x, beta;  // offsets
  int total;
  __host__ __device__ IntraLayout(int K, int V) {
    kp = K + 1;
    qp = (K > V ? K : V) + 1;
    g = 0;             // G      [C][kp]
    q = g + kC * kp;   // q, later beta v   [C][qp]
    k = q + kC * qp;   // k, later beta exp(G) k   [C][kp]
    a = k + kC * kp;   // A_kk   [C][kAP]
    x = a + kC * kAP;  // union: {Xq [16][kp], Xk [16][kp], Y [64][kp]} | {M^-1, scratch}
    const int xa = (2 * kSub + kC) * kp, xb = kC * kAP + kSub * kTP;
    beta = x + (xa > xb ? xa : xb);  // beta [C]
    total = beta + kC;
  }
};

// Shared-memory floats of the state kernel (all offsets multiples of 4: float4 / cp.async).
__host__ __device__ constexpr int state_smem_floats(int K) {
  return 3 * kC * K      // W, qg, kg
         + kC * kBV      // U tile
         + kC * kC       // A_qk
         + K             // gl
         + 2 * kC * kBV  // V_new, qg S (then O)
         + K * kBV;      // S tile
}

// ------------------------------------------------------------------ device helpers

// The decay gate of kda_gate.h on x = z + dt_bias.
__device__ __forceinline__ float gate_f(float x, float eA, int kind, float lb) {
  if (kind == kGateStandard) {
    const float sp = x > 20.f ? x : log1pf(expf(x));
    return -mul0(eA, sp);
  }
  return lb * sigmoid_f(mul0(eA, x));
}

__device__ __forceinline__ void store4(float* p, float4 x) {
  st4(p, x);
}
__device__ __forceinline__ void store4(__nv_bfloat16* p, float4 x) {
  __nv_bfloat162 lo = __floats2bfloat162_rn(x.x, x.y), hi = __floats2bfloat162_rn(x.z, x.w);
  uint2 bits;
  bits.x = *reinterpret_cast<const unsigned*>(&lo);
  bits.y = *reinterpret_cast<const unsigned*>(&hi);
  *reinterpret_cast<uint2*>(p) = bits;
}

// Wait until at most N of this thread's most recent groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// W = Mi Kb and U = Mi Vb in one pass: Mi [64][kAP] lower triangular (zeros above the diagonal),
// Kb [64][K + 1], Vb [64][qp] in shared memory; w [64][K], u [64][V] in global memory.
// Thread (ty, tx) = (t / 32, t % 32) owns rows 4 ty .. 4 ty + 3 (one row group per warp, so the
// causal bound of the s loop is warp-uniform) and columns tx + 32 b of both outputs.
template <int K>
__device__ __forceinline__ void wy_product(const float* Mi, const float* Kb, const float* Vb,
                                           int qp, int V, float* w, float* u) {
  constexpr int KP = K + 1, NBK = K / 32, NBV = kVMax / 32;
  const int ty = threadIdx.x >> 5, tx = threadIdx.x & 31;
  const int nbv = V / 32;
  float acc[4][NBK + NBV];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int b = 0; b < NBK + NBV; ++b) acc[i][b] = 0.f;
  const int rmax = 4 * ty + 3;  // Mi[r][s] = 0 for s > r: the sum stops at the last own row
  for (int s = 0; s <= rmax; ++s) {
    float m[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) m[i] = Mi[(4 * ty + i) * kAP + s];
#pragma unroll
    for (int b = 0; b < NBK; ++b) {
      const float x = Kb[s * KP + tx + 32 * b];
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[i][b] = fmaf(m[i], x, acc[i][b]);
    }
#pragma unroll
    for (int b = 0; b < NBV; ++b) {
      if (b < nbv) {
        const float x = Vb[s * qp + tx + 32 * b];
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i][NBK + b] = fmaf(m[i], x, acc[i][NBK + b]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = 4 * ty + i;
#pragma unroll
    for (int b = 0; b < NBK; ++b) w[r * K + tx + 32 * b] = acc[i][b];
#pragma unroll
    for (int b = 0; b < NBV; ++b)
      if (b < nbv) u[r * V + tx + 32 * b] = acc[i][NBK + b];
  }
}

// ------------------------------------------------------------------ intra-chunk kernel

template <int K, class Tin>
__global__ void __launch_bounds__(kIntraThreads) kda_intra_kernel(const IntraParams<Tin> p) {
  static_assert(K % 32 == 0 && K <= 128, "K must be 32, 64 or 128");
  static_assert(kIntraThreads == 32 * kSub, "one warp per row of a 16-row block");
  constexpr int KP = K + 1;
  constexpr int NT = kIntraThreads;
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  const IntraLayout lay(K, p.V);
  const int QP = lay.qp;
  float* sG = smem + lay.g;        // [C][KP]  g, then G
  float* sQ = smem + lay.q;        // [C][QP]  q (normalised), then beta v
  float* sK = smem + lay.k;        // [C][KP]  k (normalised), then beta exp(G) k
  float* sA = smem + lay.a;        // [C][kAP] A_kk
  float* sX = smem + lay.x;        // union region (see IntraLayout)
  float* sBeta = smem + lay.beta;  // [C]

  const int t = threadIdx.x;
  const int ci = blockIdx.x, h = blockIdx.y;
  const int bos = p.chunk_bos[ci], L = p.chunk_len[ci];
  const int hk = h / (p.HV / p.H);
  const int64_t task = int64_t(ci) * p.HV + h;

  // ---- 1. load g (through the gate when fused), q, k, beta; zero the padded rows
  const float eA = (p.gate != kGateNone && p.A_log) ? expf(p.A_log[h]) : 1.f;
#pragma unroll 4
  for (int i = t; i < kC * K; i += NT) {
    const int r = i / K, d = i % K;
    float gv = 0.f, qv = 0.f, kv = 0.f;
    if (r < L) {
      const int64_t tok = int64_t(bos) + r;
      const float x = to_f(p.g[(tok * p.HV + h) * K + d]);
      gv = p.gate == kGateNone
               ? x
               : gate_f(x + (p.dt_bias ? p.dt_bias[h * K + d] : 0.f), eA, p.gate, p.lower_bound);
      qv = to_f(p.q[(tok * p.H + hk) * K + d]);
      kv = to_f(p.k[(tok * p.H + hk) * K + d]);
    }
    sG[r * KP + d] = gv;
    sQ[r * QP + d] = qv;
    sK[r * KP + d] = kv;
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
  // q / k L2 norm (one warp per row; butterfly sums give every lane the same value)
  if (t < K) {
    float acc = 0.f;
    for (int r = 0; r < kC; ++r) {
      acc += sG[r * KP + t];
      sG[r * KP + t] = acc;
    }
  }
  if (p.l2norm) {
    const int warp = t >> 5, lane = t & 31;
    for (int r = warp; r < L; r += NT / 32) {
      float a = 0.f, b = 0.f;
      for (int d = lane; d < K; d += 32) {
        const float x = sQ[r * QP + d], y = sK[r * KP + d];
        a = fmaf(x, x, a);
        b = fmaf(y, y, b);
      }
      for (int off = 16; off > 0; off >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, off);
        b += __shfl_xor_sync(0xffffffffu, b, off);
      }
      const float ra = 1.f / sqrtf(a + float(kKdaL2Eps)), rb = 1.f / sqrtf(b + float(kKdaL2Eps));
      for (int d = lane; d < K; d += 32) {
        sQ[r * QP + d] *= ra;
        sK[r * KP + d] *= rb;
      }
    }
  }
  __syncthreads();
  if (p.G_out) {  // backward recompute: G, normalised q / k, beta (read-only use of shared memory)
    for (int i = t; i < kC * K; i += NT) {
      const int r = i / K, d = i % K;
      p.G_out[task * kC * K + i] = sG[r * KP + d];
      p.qn_out[task * kC * K + i] = sQ[r * QP + d];
      p.kn_out[task * kC * K + i] = sK[r * KP + d];
    }
    if (t < kC) p.beta_out[task * kC + t] = sBeta[t];
  }

  // ---- 3. pre-gated q and k for the state pass, and the chunk decay exp(G_{L-1})
  const float* GL = sG + (L - 1) * KP;
  {
    float* qg = p.qg + task * kC * K;
    float* kg = p.kg + task * kC * K;
#pragma unroll 4
    for (int i = t; i < kC * K; i += NT) {
      const int r = i / K, d = i % K;
      float a = 0.f, b = 0.f;
      if (r < L) {
        const float G = sG[r * KP + d];
        a = p.scale * sQ[r * QP + d] * expf(G);  // exp(G) <= 1
        b = sK[r * KP + d] * expf(GL[d] - G);    // G_{L-1} <= G_r
      }
      qg[i] = a;
      kg[i] = b;
    }
    if (t < K) p.gl[task * K + t] = expf(GL[t]);
  }

  // ---- 4. A_qk (to global) and A_kk (to shared), one 16-row block row i at a time, all with the
  // reference row n = 16 i: Xq_r = q_r exp(G_r - G_n), Xk_r = k_r exp(G_r - G_n) for the 16 rows
  // r of block row i, Y_s = k_s exp(G_n - G_s) for s < n + 16, and A[r][s] = Xq_r . Y_s.
  //   s < n (off-diagonal blocks): both factors <= 1, always safe.
  //   n <= s <= r (diagonal block): exp(G_r - G_n) >= exp(-span), exp(G_n - G_s) <= exp(span),
  //     span = max_d (G_n - G_{n+15}); used while span <= kSpanMax (both factors normal and
  //     finite; upper-triangle products are discarded by select). A block row whose diagonal block
  //     spans more (mean decay > kSpanMax / 15 nats per token) forms exp(G_r - G_s) per element.
  // Warp rr computes row r = n + rr; lane c computes columns c and c + 32.
  {
    float* sXq = sX;                 // [16][KP]
    float* sXk = sX + kSub * KP;     // [16][KP]
    float* sY = sX + 2 * kSub * KP;  // [64][KP]
    float* aqk = p.aqk + task * kC * kC;
    const int rr = t >> 5, c = t & 31;
    for (int i = 0; i < kC / kSub; ++i) {
      const int n = kSub * i, ncol = n + kSub;
      for (int idx = t; idx < kSub * K; idx += NT) {
        const int a = idx / K, d = idx % K;
        const float e = expf(sG[(n + a) * KP + d] - sG[n * KP + d]);
        sXq[a * KP + d] = sQ[(n + a) * QP + d] * e;
        sXk[a * KP + d] = sK[(n + a) * KP + d] * e;
      }
      bool wide = false;
      for (int idx = t; idx < ncol * K; idx += NT) {
        const int s = idx / K, d = idx % K;
        const float x = sG[n * KP + d] - sG[s * KP + d];
        if (s >= n) wide |= !(fabsf(x) <= kSpanMax);
        sY[s * KP + d] = sK[s * KP + d] * expf(x);
      }
      const bool per_element = __syncthreads_or(wide) != 0;  // also the barrier for X, Y

      const int r = n + rr;
      const float br = sBeta[r];
      const int y1 = min(c, ncol - 1), y2 = min(c + 32, ncol - 1);  // idle lanes: a valid row
      float aq1 = 0.f, ak1 = 0.f, aq2 = 0.f, ak2 = 0.f;
      if (i >= 2) {  // warp-uniform: columns c + 32 exist
#pragma unroll 4
        for (int d = 0; d < K; ++d) {
          const float xq = sXq[rr * KP + d], xk = sXk[rr * KP + d];
          const float ya = sY[y1 * KP + d], yb = sY[y2 * KP + d];
          aq1 = fmaf(xq, ya, aq1);
          ak1 = fmaf(xk, ya, ak1);
          aq2 = fmaf(xq, yb, aq2);
          ak2 = fmaf(xk, yb, ak2);
        }
      } else {
#pragma unroll 8
        for (int d = 0; d < K; ++d) {
          const float ya = sY[y1 * KP + d];
          aq1 = fmaf(sXq[rr * KP + d], ya, aq1);
          ak1 = fmaf(sXk[rr * KP + d], ya, ak1);
        }
      }
      auto put = [&](int s, float aq, float ak) {
        float vq = 0.f, vk = 0.f;  // s > r: above the diagonal
        if (s <= r) {
          if (per_element && s >= n) {
            aq = 0.f, ak = 0.f;
            for (int d = 0; d < K; ++d) {
              const float ke = sK[s * KP + d] * expf(sG[r * KP + d] - sG[s * KP + d]);  // r >= s
              aq = fmaf(sQ[r * QP + d], ke, aq);
              ak = fmaf(sK[r * KP + d], ke, ak);
            }
          }
          vq = p.scale * aq;
          vk = s < r ? br * ak : 0.f;
        }
        aqk[r * kC + s] = vq;
        sA[r * kAP + s] = vk;
      };
      put(c, aq1, ak1);
      put(c + 32, aq2, ak2);
      __syncthreads();  // A_kk rows complete; sX free for the next block row
    }
  }

  // ---- 5. M^-1 = (I + A_kk)^-1 into sM (lower triangular, zeros above the diagonal).
  // (a) the four 16x16 diagonal blocks D_b^-1 by forward substitution, one thread per column j,
  //     the column in registers: X[r][j] = -sum_{m < r} A[r][m] X[m][j] (X[m][j] = 0 for m < j),
  //     X[j][j] = 1;
  // (b) block rows i = 1..3: T = A[block i][0, n) M^-1[0, n)[0, n);  M^-1[block i][0, n) = -D_i^-1
  // T.
  float* sM = sX;             // [C][kAP]
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
  for (int i = 1; i < kC / kSub; ++i) {
    const int n = kSub * i;
    for (int idx = t; idx < kSub * n; idx += NT) {
      const int a = idx / n, c = idx % n;
      float acc = 0.f;
      for (int m = c; m < n; ++m) acc = fmaf(sA[(n + a) * kAP + m], sM[m * kAP + c], acc);
      sT[a * kTP + c] = acc;
    }
    __syncthreads();
    for (int idx = t; idx < kSub * n; idx += NT) {
      const int a = idx / n, c = idx % n;
      float acc = 0.f;
      for (int m = 0; m <= a; ++m) acc = fmaf(sM[(n + a) * kAP + n + m], sT[m * kTP + c], acc);
      sM[(n + a) * kAP + c] = -acc;
    }
    __syncthreads();
  }

  if (p.minv_out)  // backward recompute
    for (int idx = t; idx < kC * kC; idx += NT)
      p.minv_out[task * kC * kC + idx] = sM[(idx / kC) * kAP + idx % kC];

      // ---- 6. W = M^-1 (beta exp(G) k), U = M^-1 (beta v)
#pragma unroll 4
  for (int i = t; i < kC * K; i += NT) {
    const int s = i / K, d = i % K;
    sK[s * KP + d] *= sBeta[s] * expf(sG[s * KP + d]);
  }
  for (int i = t; i < kC * p.V; i += NT) {
    const int s = i / p.V, c = i % p.V;
    float x = 0.f;
    if (s < L) x = sBeta[s] * to_f(p.v[((int64_t(bos) + s) * p.HV + h) * p.V + c]);
    sQ[s * QP + c] = x;
  }
  __syncthreads();
  wy_product<K>(sM, sK, sQ, QP, p.V, p.w + task * kC * K, p.u + task * kC * p.V);
}

// ------------------------------------------------------------------ state-pass kernel

// Issue the cp.async copies of phase A's operands of one chunk: W, qg [C][K] and the U tile.
template <int K>
__device__ __forceinline__ void fetch_a(const float* w, const float* qg, const float* u, int V,
                                        float* sW, float* sQg, float* sU) {
  for (int i = threadIdx.x; i < kC * K / 4; i += kThreads) {
    cp_async16(sW + 4 * i, w + 4 * i);
    cp_async16(sQg + 4 * i, qg + 4 * i);
  }
  for (int i = threadIdx.x; i < kC * kBV / 4; i += kThreads) {
    const int r = i / (kBV / 4), c = 4 * (i % (kBV / 4));
    cp_async16(sU + r * kBV + c, u + int64_t(r) * V + c);
  }
}

// ... and phase B's: kg [C][K], A_qk [C][C], gl [K].
template <int K>
__device__ __forceinline__ void fetch_b(const float* kg, const float* aqk, const float* gl,
                                        float* sKg, float* sAqk, float* sGl) {
  for (int i = threadIdx.x; i < kC * K / 4; i += kThreads) cp_async16(sKg + 4 * i, kg + 4 * i);
  for (int i = threadIdx.x; i < kC * kC / 4; i += kThreads) cp_async16(sAqk + 4 * i, aqk + 4 * i);
  if (threadIdx.x < K / 4) cp_async16(sGl + 4 * threadIdx.x, gl + 4 * threadIdx.x);
}

template <int K, class Tin>
__global__ void __launch_bounds__(kThreads) kda_state_kernel(const StateParams<Tin> p) {
  static_assert(K % 32 == 0 && K <= 128, "K must be 32, 64 or 128");
  extern __shared__ float4 smem4[];
  float* sW = reinterpret_cast<float*>(smem4);  // [C][K]   W
  float* sQg = sW + kC * K;                     // [C][K]   qg
  float* sU = sQg + kC * K;                     // [C][BV]  U tile
  float* sKg = sU + kC * kBV;                   // [C][K]   kg
  float* sAqk = sKg + kC * K;                   // [C][C]   A_qk
  float* sGl = sAqk + kC * kC;                  // [K]      exp(G_{L-1})
  float* sVn = sGl + K;                         // [C][BV]  V_new
  float* sO = sVn + kC * kBV;                   // [C][BV]  qg S
  float* sS = sO + kC * kBV;                    // [K][BV]  state tile

  const int t = threadIdx.x;
  const int nvt = p.V / kBV;
  const int vt = int(blockIdx.x % unsigned(nvt));
  const int nh = int(blockIdx.x / unsigned(nvt));
  const int h = nh % p.HV, n = nh / p.HV;
  const int v0 = vt * kBV;
  const int64_t sbase = (int64_t(n) * p.HV + h) * K * p.V + v0;  // S[n][h][0][v0]

  for (int i = t; i < K * kBV / 4; i += kThreads) {
    const int d = i / (kBV / 4), c = 4 * (i % (kBV / 4));
    st4(sS + d * kBV + c,
        p.h0 ? ld4(p.h0 + sbase + int64_t(d) * p.V + c) : make_float4(0.f, 0.f, 0.f, 0.f));
  }

  const int c_begin = p.first_chunk[n], c_end = p.first_chunk[n + 1];
  auto task_of = [&](int ci) { return int64_t(ci) * p.HV + h; };
  if (c_begin < c_end) {
    const int64_t tk = task_of(c_begin);
    fetch_a<K>(p.w + tk * kC * K, p.qg + tk * kC * K, p.u + tk * kC * p.V + v0, p.V, sW, sQg, sU);
    cp_async_commit();
    fetch_b<K>(p.kg + tk * kC * K, p.aqk + tk * kC * kC, p.gl + tk * K, sKg, sAqk, sGl);
    cp_async_commit();
  }
  for (int ci = c_begin; ci < c_end; ++ci) {
    const int bos = p.chunk_bos[ci], L = p.chunk_len[ci];
    cp_async_wait<1>();  // this chunk's {W, qg, U} landed ({kg, A_qk, gl} may be in flight)
    __syncthreads();
    if (p.h_out) {  // backward recompute: the state at the chunk start
      float* hs = p.h_out + task_of(ci) * K * p.V + v0;
      for (int i = t; i < K * kBV / 4; i += kThreads) {
        const int d = i / (kBV / 4), c = 4 * (i % (kBV / 4));
        st4(hs + int64_t(d) * p.V + c, ld4(sS + d * kBV + c));
      }
    }

    // ---- phase A: warps 0-3: V_new = U - W S; warps 4-7: qg S. Thread (ty, tx) of its half owns
    // rows ty + 16 a (a < 4) and columns 4 tx .. 4 tx + 3 of the tile.
    {
      const int role = t >> 7, tt = t & 127, ty = tt >> 3, tx = tt & 7;
      const float* Mx = role ? sQg : sW;
      float4 acc[4];
#pragma unroll
      for (int a = 0; a < 4; ++a) acc[a] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 2
      for (int d = 0; d < K; d += 4) {
        float4 s[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) s[e] = ld4(sS + (d + e) * kBV + 4 * tx);
#pragma unroll
        for (int a = 0; a < 4; ++a) {
          const float4 m = ld4(Mx + (ty + 16 * a) * K + d);
          fma4(acc[a], m.x, s[0]);
          fma4(acc[a], m.y, s[1]);
          fma4(acc[a], m.z, s[2]);
          fma4(acc[a], m.w, s[3]);
        }
      }
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        const int r = ty + 16 * a;
        if (role == 0) {
          const float4 uu = ld4(sU + r * kBV + 4 * tx);
          st4(sVn + r * kBV + 4 * tx,
              make_float4(uu.x - acc[a].x, uu.y - acc[a].y, uu.z - acc[a].z, uu.w - acc[a].w));
        } else {
          st4(sO + r * kBV + 4 * tx, acc[a]);
        }
      }
    }
    __syncthreads();   // V_new, qg S complete; sW, sQg, sU free
    if (p.vnew_out) {  // backward recompute: V_new (all C rows; padded rows are zero)
      float* vs = p.vnew_out + task_of(ci) * kC * p.V + v0;
      for (int i = t; i < kC * kBV / 4; i += kThreads) {
        const int r = i / (kBV / 4), c = 4 * (i % (kBV / 4));
        st4(vs + int64_t(r) * p.V + c, ld4(sVn + r * kBV + c));
      }
    }
    if (ci + 1 < c_end) {
      const int64_t tk = task_of(ci + 1);
      fetch_a<K>(p.w + tk * kC * K, p.qg + tk * kC * K, p.u + tk * kC * p.V + v0, p.V, sW, sQg, sU);
    }
    cp_async_commit();   // (possibly empty: keeps the group count uniform)
    cp_async_wait<1>();  // this chunk's {kg, A_qk, gl} landed
    __syncthreads();

    // ---- phase B. Thread (ty, tx) = (t / 8, t % 8), columns 4 tx .. 4 tx + 3.
    {
      const int ty = t >> 3, tx = t & 7;
      // O = qg S + A_qk V_new for rows ty and ty + 32 (A_qk[r][s] = 0 for s > r).
      if (p.o) {
        float4 o0 = ld4(sO + ty * kBV + 4 * tx), o1 = ld4(sO + (ty + 32) * kBV + 4 * tx);
        for (int s = 0; s <= ty + 32; s += 4) {
          const float4 a0 = ld4(sAqk + ty * kC + s), a1 = ld4(sAqk + (ty + 32) * kC + s);
          const float4 n0 = ld4(sVn + (s + 0) * kBV + 4 * tx),
                       n1 = ld4(sVn + (s + 1) * kBV + 4 * tx);
          const float4 n2 = ld4(sVn + (s + 2) * kBV + 4 * tx),
                       n3 = ld4(sVn + (s + 3) * kBV + 4 * tx);
          fma4(o0, a0.x, n0);
          fma4(o0, a0.y, n1);
          fma4(o0, a0.z, n2);
          fma4(o0, a0.w, n3);
          fma4(o1, a1.x, n0);
          fma4(o1, a1.y, n1);
          fma4(o1, a1.z, n2);
          fma4(o1, a1.w, n3);
        }
        if (ty < L) store4(p.o + ((int64_t(bos) + ty) * p.HV + h) * p.V + v0 + 4 * tx, o0);
        if (ty + 32 < L)
          store4(p.o + ((int64_t(bos) + ty + 32) * p.HV + h) * p.V + v0 + 4 * tx, o1);
      }

      // S <- Diag(gl) S + kg^T V_new for rows d = ty + 32 a (own elements only: in place).
      constexpr int NR = K / 32;
      float4 sacc[NR];
#pragma unroll
      for (int a = 0; a < NR; ++a) {
        const int d = ty + 32 * a;
        const float gd = sGl[d];
        const float4 x = ld4(sS + d * kBV + 4 * tx);
        sacc[a] = make_float4(gd * x.x, gd * x.y, gd * x.z, gd * x.w);
      }
      for (int r = 0; r < L; ++r) {  // rows >= L of kg and V_new are zero
        const float4 vn = ld4(sVn + r * kBV + 4 * tx);
#pragma unroll
        for (int a = 0; a < NR; ++a) fma4(sacc[a], sKg[r * K + ty + 32 * a], vn);
      }
#pragma unroll
      for (int a = 0; a < NR; ++a) st4(sS + (ty + 32 * a) * kBV + 4 * tx, sacc[a]);
    }
    __syncthreads();  // S updated; sKg, sAqk, sGl, sVn, sO free
    if (ci + 1 < c_end) {
      const int64_t tk = task_of(ci + 1);
      fetch_b<K>(p.kg + tk * kC * K, p.aqk + tk * kC * kC, p.gl + tk * K, sKg, sAqk, sGl);
    }
    cp_async_commit();
  }
  cp_async_wait<0>();
  __syncthreads();
  for (int i = t; i < K * kBV / 4; i += kThreads) {
    const int d = i / (kBV / 4), c = 4 * (i % (kBV / 4));
    st4(p.ht + sbase + int64_t(d) * p.V + c, ld4(sS + d * kBV + c));
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
    ip.minv_out = x.minv;
    HLM_CHECK(!x.G == !x.qn && !x.G == !x.kn && !x.G == !x.beta, "{}: G, qn, kn, beta go together",
              kOp);
    ip.H = int(pl.H), ip.HV = int(pl.HV), ip.V = int(pl.V);
    ip.scale = pl.scale;
    ip.lower_bound = float(a.lower_bound);
    ip.l2norm = a.use_qk_l2norm;
    ip.beta_logits = a.beta_logits;
    const size_t smem = size_t(IntraLayout(K, int(pl.V)).total) * sizeof(float);
    set_smem(kOp, reinterpret_cast<const void*>(&kda_intra_kernel<K, Tin>), smem, "intra kernel");
    kda_intra_kernel<K, Tin><<<dim3(unsigned(pl.NC), unsigned(pl.HV)), kIntraThreads, smem>>>(ip);
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
  const size_t smem = size_t(state_smem_floats(K)) * sizeof(float);
  set_smem(kOp, reinterpret_cast<const void*>(&kda_state_kernel<K, Tin>), smem, "state kernel");
  kda_state_kernel<K, Tin><<<unsigned(pl.N * pl.HV * (pl.V / kBV)), kThreads, smem>>>(sp);
  check_launch(kOp, "state kernel");
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

KdaOutput kda_chunk_forward_cuda(const KdaArgs& a, const KdaChunkCudaBuffers& buffers) {
  const Plan pl = make_plan(a);
  const DType dt = a.q.dtype();

  KdaOutput out;
  out.o = output_buffer(buffers.o, dt, {pl.T, pl.HV, pl.V}, kOp, "buffers.o");
  out.final_state = output_buffer(buffers.final_state, DType::f32, {pl.N, pl.HV, pl.K, pl.V}, kOp,
                                  "buffers.final_state");
  const Tensor ws = workspace_buffer(buffers.workspace, pl.total, kOp);
  float* wsp = ws.data<float>();
  static_assert(sizeof(int32_t) == sizeof(float), "the chunk table shares the f32 workspace");
  device_copy(wsp + pl.off_meta, Device::cuda, pl.meta.data(), Device::cpu,
              pl.meta.size() * sizeof(int32_t));

  kda_cuda_detail::Intermediates x;
  x.meta = reinterpret_cast<const int*>(wsp + pl.off_meta);
  x.qg = wsp + pl.off_qg;
  x.kg = wsp + pl.off_kg;
  x.w = wsp + pl.off_w;
  x.u = wsp + pl.off_u;
  x.aqk = wsp + pl.off_aqk;
  x.gl = wsp + pl.off_gl;
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

void recompute(const KdaArgs& a, const Plan& p, const Intermediates& x) {
  if (a.q.dtype() == DType::bf16)
    dispatch_k<__nv_bfloat16>(p, a, x, nullptr);
  else
    dispatch_k<float>(p, a, x, nullptr);
}

}  // namespace kda_cuda_detail

}  // namespace hlm::ops
