// KDA chunked backward on CUDA, B4c: the intra backward and the finish of dg (params.cuh;
// docs/kda.md, "CUDA chunked backward"), C = 64; the stages and their notation are listed in
// bwd_launch.cu. Per (chunk, head, slice of 64 channels), from a = scale dA_qk (s <= r) and b =
// dA_kk (s < r), with E_rs = exp(G_r - G_s) per channel:
//   dq_r += sum_s a_rs k_s E_rs;  R_r = sum_s b_rs k_s E_rs;  dk_r += beta_r R_r;
//   dbeta_r += k_r . R_r;  P_s = sum_r (a_rs q_r + beta_r b_rs k_r) E_rs;  dk_s += P_s;
//   dG_r += q_r dq^intra_r + beta_r k_r R_r;  dG_s -= k_s P_s
// then dg = reverse cumsum of dG in the chunk, the fused gate's chain rule (dz, per-chunk partial
// sums of dA_log and d dt_bias); dbeta^intra and dA_log as per-slice partials.
// exp safety: E_rs is split per 16-row block i with the reference row n = 16 i, E_rs =
// exp(G_r - G_n) exp(G_n - G_s), as the forward's intra stage (intra.cu) does; a diagonal block
// spanning more than 80 nats forms E_rs per element for s <= r only.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "ops/cuda/kda_chunk/common.cuh"
#include "ops/cuda/kda_chunk/params.cuh"
#include "ops/cuda/mma_tf32.cuh"

namespace hlm::ops::cuda::kda {
namespace {

constexpr const char* kOp = "kda_chunk_backward_cuda";

constexpr int kWarps = kThreads / 32;
constexpr int kAP2 = kC + 4;  // row stride of dA_qk, dA_kk in the intra backward (A = Mat / MatT)

// Row strides: KH + 8 for the [C][KH] arrays (Y, Xq, Xk are read as B = Mat). The column sums P
// live in registers and land in Y's place at the end. K = 128, V = 128: ~100 KB, two blocks per SM.
struct IntraBwdLayout {
  int g, kk, ca, cb, xq, xk, y, beta, dbi, red, rp, total;
  __host__ __device__ IntraBwdLayout(int K) {
    const int KP = slice_k(K) + 8;
    g = 0;                // G      [C][KP]
    kk = g + kC * KP;     // k^     [C][KP]
    ca = kk + kC * KP;    // scale dA_qk [C][kAP2]
    cb = ca + kC * kAP2;  // dA_kk  [C][kAP2]
    xq = cb + kC * kAP2;  // Xq     [16][KP]
    xk = xq + kSub * KP;  // Xk     [16][KP] (beta_r included)
    y = xk + kSub * KP;   // Y      [C][KP], at the end P
    beta = y + kC * KP;   // beta   [C]
    dbi = beta + kC;      // intra dbeta over the block's channels [C]
    red = dbi + kC;       // [KH] dA_log partials per channel
    rp = red + K;         // [KH / 8 <= warps][16] intra dbeta partials of a block row
    total = rp + kWarps * kSub;
  }
};

// Block (chunk, value head, channel slice z): channels c_lo = KH z .. c_lo + KH - 1. Everything
// but dbeta and dA_log is per channel; their sums over the channels leave as per-slice partials
// (dbi, pA), which the GVA kernel (dbeta) and the gate-sum kernel (dA_log) add in slice order.
template <int K, class Tin, bool kTf32>
__global__ void __launch_bounds__(kThreads, 2) kda_bwd_intra_kernel(const BwdParams<Tin> p) {
  using namespace mma_cu;
  constexpr Prec P = prec_for<Tin, kTf32>;
  constexpr int KH = slice_k(K), NS = slices(K), KP = KH + 8;
  // P: 16 x 16 tiles [C / 16][TN], NPT per warp of the column side (kSide warps)
  constexpr int kSide = kWarps / 2, TN = KH / 16, NPT = 4 * TN / kSide;
  static_assert(NPT >= 1 && (4 * TN) % kSide == 0, "whole P tiles per warp");
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  const IntraBwdLayout lay(K);
  float* sG = smem + lay.g;
  float* sK = smem + lay.kk;
  float* sCA = smem + lay.ca;
  float* sCB = smem + lay.cb;
  float* sXq = smem + lay.xq;
  float* sXk = smem + lay.xk;
  float* sY = smem + lay.y;
  float* sBeta = smem + lay.beta;
  float* sDbI = smem + lay.dbi;
  float* sRed = smem + lay.red;
  float* sRowPart = smem + lay.rp;

  const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
  const int ci = blockIdx.x, h = blockIdx.y, z = blockIdx.z, c_lo = KH * z;
  const int bos = p.chunk_bos[ci], L = p.chunk_len[ci];
  const int64_t tk = int64_t(ci) * p.HV + h;
  // [C][K] global arrays of the task, offset to the slice's first channel (row stride K)
  const float* qn = p.qn + tk * kC * K + c_lo;
  float* dq = p.dq + tk * kC * K + c_lo;
  float* dk = p.dk + tk * kC * K + c_lo;
  float* dG = p.dG + tk * kC * K + c_lo;

  cp_rows(sG, KP, p.G + tk * kC * K + c_lo, K, kC, KH);
  cp_rows(sK, KP, p.kn + tk * kC * K + c_lo, K, kC, KH);
  cp_async_commit();
  for (int i = t; i < kC * kC / 4; i += kThreads) {  // four columns per step
    const int r = i / (kC / 4), s = 4 * (i % (kC / 4));
    const int64_t o = tk * kC * kC + 4 * i;
    const float4 a = ld4(p.daqk + o), b = ld4(p.dakk + o), c = ld4(p.dakv + o);
    st4(sCA + r * kAP2 + s,
        make_float4(p.scale * a.x, p.scale * a.y, p.scale * a.z, p.scale * a.w));
    st4(sCB + r * kAP2 + s,
        make_float4(s < r ? -(b.x + c.x) : 0.f, s + 1 < r ? -(b.y + c.y) : 0.f,
                    s + 2 < r ? -(b.z + c.z) : 0.f, s + 3 < r ? -(b.w + c.w) : 0.f));
  }
  if (t < kC) sBeta[t] = p.beta[tk * kC + t], sDbI[t] = 0.f;
  cp_async_wait<0>();
  __syncthreads();

  // P tiles of column-side warp kSide + w': tile w' + kSide m -> rows 16 (tile / TN) .., channels
  // 16 (tile % TN) ..
  float pacc[NPT][1][2][4];
#pragma unroll
  for (int m = 0; m < NPT; ++m) zero(pacc[m]);

  for (int ib = 0; ib < kC / kSub; ++ib) {
    const int n = kSub * ib, ncol = n + kSub;
    // Xq_r = q_r exp(G_r - G_n), Xk_r = beta_r k_r exp(G_r - G_n) (rows of block ib),
    // Y_s = k_s exp(G_n - G_s) (s < n + 16)
    // Four channels per thread: the sweep's rows 0..15 are Xq / Xk (rows n..n+15, where the
    // diagonal block's span is checked too), rows 16.. are Y (rows 0..ncol-1). The forward intra
    // kernel's loop has the same shape over other operands (raw q / k rows with their norm
    // factors, no beta), so the two are written out.
    bool wide = false;
    {
      constexpr int C4 = KH / 4, RPS = kThreads / C4;
      static_assert(RPS % 2 == 0 && 32 % C4 == 0, "warp-uniform X / Y rows");
      const int c = 4 * (t % C4);
      alignas(16) float gn[4];
      ld16(sG + n * KP + c, gn);
      for (int row = t / C4; row < kSub + ncol; row += RPS) {
        alignas(16) float G[4], kv[4], y[4];
        if (row < kSub) {
          const int r = n + row;
          alignas(16) float qv[4], xq[4];
          ld16(sG + r * KP + c, G);
          ld16(sK + r * KP + c, kv);
          ld16(qn + r * K + c, qv);
          const float br = sBeta[r];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            wide |= !(fabsf(gn[e] - G[e]) <= kSpanMax);
            const float ee = exp_in<Tin>(G[e] - gn[e]);
            xq[e] = qv[e] * ee;
            y[e] = br * kv[e] * ee;
          }
          st16(sXq + row * KP + c, xq);
          st16(sXk + row * KP + c, y);
        } else {
          const int s2 = row - kSub;
          ld16(sG + s2 * KP + c, G);
          ld16(sK + s2 * KP + c, kv);
#pragma unroll
          for (int e = 0; e < 4; ++e) y[e] = kv[e] * exp_in<Tin>(gn[e] - G[e]);
          st16(sY + s2 * KP + c, y);
        }
      }
    }
    // Also the barrier for X, Y. A slice decides for its own channels: the split and the
    // per-element sum are two exact forms of the same terms.
    const bool per_element = __syncthreads_or(wide) != 0;
    const int send = per_element ? n : ncol;  // columns taken by the split product

    // Two sides of four warps, both reading only X, Y, CA, CB, G, k^ and writing disjoint
    // outputs:
    //   row side (w < 4), rows r = n .. n + 15: dq^intra_r = E_rn sum_{s < send} a_rs Y_s and
    //     R_r = E_rn sum_s b_rs Y_s (E_rn = exp(G_r - G_n)) on tensor cores, one Y fragment for
    //     both; warp w owns channels 16 w .. 16 w + 15;
    //   column side (w >= 4): the P tiles (below), warp 4 + w' owning tiles w', w' + 4, ...
    if (warp < kSide) {
      float dbr[2][2] = {};  // k_r . R_r per 8-channel group j, rows g and g + 8
      for (int c0 = 16 * warp; c0 < KH; c0 += 16 * kSide) {
        // The global dq, dk, dG, q^ of the tile's elements, loaded before the products (the
        // stores below could otherwise serialise them).
        float gq[2][4], gk[2][4], gG[2][4], gqn[2][4];
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = acc_row(n, 0, e), d = acc_col(c0, j, e);
            const bool in = r < L;
            gq[j][e] = in ? dq[r * K + d] : 0.f;
            gk[j][e] = in ? dk[r * K + d] : 0.f;
            gG[j][e] = in ? dG[r * K + d] : 0.f;
            gqn[j][e] = in ? qn[r * K + d] : 0.f;
          }
        float aq[1][2][4], ab[1][2][4];
        zero(aq);
        zero(ab);
        warp_mma_pair<P>(aq, Mat{sCA, kAP2}, ab, Mat{sCB, kAP2}, Mat{sY, KP}, n, c0, 0, send);
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = acc_row(n, 0, e), d = acc_col(c0, j, e);
            const float E = exp_in<Tin>(sG[r * KP + d] - sG[n * KP + d]);
            float dqi = E * aq[0][j][e], R = E * ab[0][j][e];
            if (per_element) {  // the diagonal block, exp(G_r - G_s) per element for s <= r
              for (int s2 = n; s2 <= r; ++s2) {
                const float kE = sK[s2 * KP + d] * exp_in<Tin>(sG[r * KP + d] - sG[s2 * KP + d]);
                dqi = fmaf(sCA[r * kAP2 + s2], kE, dqi);
                R = fmaf(sCB[r * kAP2 + s2], kE, R);
              }
            }
            const float kr = sK[r * KP + d], br = sBeta[r];
            dbr[j][e >> 1] = fmaf(kr, R, dbr[j][e >> 1]);
            if (r < L) {
              dq[r * K + d] = gq[j][e] + dqi;
              dk[r * K + d] = gk[j][e] + br * R;
              dG[r * K + d] = gG[j][e] + (gqn[j][e] * dqi + br * kr * R);
            }
          }
      }
      // One partial per 8-channel group (over the 4 lanes t of a row), summed in group order
      // after the barrier. KH <= 16 kSide: one pass of the loop above.
      static_assert(slice_k(K) <= 16 * kSide, "one channel pass per warp");
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          dbr[j][e] += __shfl_xor_sync(0xffffffffu, dbr[j][e], 1);
          dbr[j][e] += __shfl_xor_sync(0xffffffffu, dbr[j][e], 2);
        }
      if ((lane & 3) == 0 && 16 * warp < KH) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          sRowPart[(2 * warp + j) * kSub + (lane >> 2)] = dbr[j][0];
          sRowPart[(2 * warp + j) * kSub + (lane >> 2) + 8] = dbr[j][1];
        }
      }
    } else {
      // columns s < send: P_s += exp(G_n - G_s) sum_{a < 16} (a_{n+a, s} Xq_a + b_{n+a, s} Xk_a),
      // tensor cores, into the warp's P tiles; with per_element, the diagonal block's columns
      // s = n .. n + 15 per element instead (rows r = s .. n + 15), in the same tiles.
#pragma unroll
      for (int m = 0; m < NPT; ++m) {
        const int tile = (warp - kSide) + kSide * m, m0 = 16 * (tile / TN), c0 = 16 * (tile % TN);
        if (m0 < send) {
          float acc[1][2][4];
          zero(acc);
          warp_mma<P>(acc, MatT{sCA + n * kAP2, kAP2}, Mat{sXq, KP}, m0, c0, 0, kSub);
          warp_mma<P>(acc, MatT{sCB + n * kAP2, kAP2}, Mat{sXk, KP}, m0, c0, 0, kSub);
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int s2 = acc_row(m0, 0, e), d = acc_col(c0, j, e);
              pacc[m][0][j][e] += exp_in<Tin>(sG[n * KP + d] - sG[s2 * KP + d]) * acc[0][j][e];
            }
        } else if (per_element && m0 == n) {
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int s = acc_row(m0, 0, e), d = acc_col(c0, j, e);
              float acc = 0.f;
              for (int r = s; r < ncol; ++r) {
                const float E = exp_in<Tin>(sG[r * KP + d] - sG[s * KP + d]);
                const float c = sCA[r * kAP2 + s] * qn[r * K + d] +
                                sBeta[r] * sCB[r * kAP2 + s] * sK[r * KP + d];
                acc = fmaf(c, E, acc);
              }
              pacc[m][0][j][e] += acc;
            }
        }
      }
    }
    __syncthreads();  // X, Y free for the next block row; the row updates complete
    if (t < kSub) {   // intra dbeta of the block's rows: the groups' partials in channel order
      float db = 0.f;
      for (int w = 0; w < KH / 8; ++w) db += sRowPart[w * kSub + t];
      sDbI[n + t] = db;
    }
  }
  float* sP = sY;  // [C][KP] (Y is free after the last block row's barrier)
  if (warp >= kSide) {
#pragma unroll
    for (int m = 0; m < NPT; ++m) {
      const int tile = (warp - kSide) + kSide * m, m0 = 16 * (tile / TN), c0 = 16 * (tile % TN);
      for_each(pacc[m], m0, c0, [&](int s, int d, float x) { sP[s * KP + d] = x; });
    }
  }
  __syncthreads();

  // dk_s += P_s; dG_s -= k_s P_s (all threads, in place in P); dg = reverse cumsum of dG (one
  // thread per channel, rows last to first, in shared memory); the gate's chain rule (all
  // threads: thread t takes channel t % KH of the rows t / KH, t / KH + NT / KH, ..., so the dz
  // and dA_log sums run per thread, then over the NT / KH row groups in order).
  // (Four channels per step, batches of kTB4 steps per thread: the global loads of a batch come
  // before its stores.)
  {
    constexpr int kTB4 = 4, G4 = KH / 4;
    for (int i0 = t; i0 < L * G4; i0 += kTB4 * kThreads) {
      float4 gdk[kTB4], gdG[kTB4];
#pragma unroll
      for (int b = 0; b < kTB4; ++b) {
        const int i = i0 + b * kThreads, r = i / G4, d = 4 * (i % G4);
        if (i < L * G4) gdk[b] = ld4(dk + r * K + d), gdG[b] = ld4(dG + r * K + d);
      }
#pragma unroll
      for (int b = 0; b < kTB4; ++b) {
        const int i = i0 + b * kThreads, r = i / G4, d = 4 * (i % G4);
        if (i < L * G4) {
          const float4 Pv = ld4(sP + r * KP + d), kv = ld4(sK + r * KP + d);
          st4(dk + r * K + d,
              make_float4(gdk[b].x + Pv.x, gdk[b].y + Pv.y, gdk[b].z + Pv.z, gdk[b].w + Pv.w));
          st4(sP + r * KP + d, make_float4(gdG[b].x - kv.x * Pv.x, gdG[b].y - kv.y * Pv.y,
                                           gdG[b].z - kv.z * Pv.z, gdG[b].w - kv.w * Pv.w));
        }
      }
    }
  }
  __syncthreads();
  if (t < KH) {  // rows in batches of 8: the batch's loads issue together, then its sums in order
    float acc = 0.f;
    int r = L - 1;
    for (; r >= 7; r -= 8) {
      float v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = sP[(r - j) * KP + t];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        acc += v[j];
        sP[(r - j) * KP + t] = acc;
      }
    }
    for (; r >= 0; --r) {
      acc += sP[r * KP + t];
      sP[r * KP + t] = acc;
    }
  }
  __syncthreads();
  {
    static_assert(kThreads % KH == 0, "whole row groups");
    constexpr int NG = kThreads / KH;
    const int d = t % KH, g0 = t / KH, dc = c_lo + d;
    const float eA = (p.gate != kGateNone && p.A_log) ? expf(p.A_log[h]) : 1.f;
    const float bias = (p.gate != kGateNone && p.dt_bias) ? p.dt_bias[h * K + dc] : 0.f;
    float sdt = 0.f, sA = 0.f;
    constexpr int kTB = 8;  // rows per thread and batch: the batch's z loads before its work
    // The loop once per gate kind (kind a constant: no per-element branch on it).
    auto chain = [&](auto kind_c) {
      constexpr int kind = decltype(kind_c)::value;
      for (int r0 = g0; r0 < L; r0 += kTB * NG) {
        float gz[kTB];
#pragma unroll
        for (int b = 0; b < kTB; ++b) {
          const int r = r0 + b * NG;
          gz[b] = (kind != kGateNone && r < L) ? to_f(p.z[((int64_t(bos) + r) * p.HV + h) * K + dc])
                                               : 0.f;
        }
#pragma unroll
        for (int b = 0; b < kTB; ++b) {
          const int r = r0 + b * NG;
          if (r >= L) break;
          const float acc = sP[r * KP + d];
          const int64_t oi = ((int64_t(bos) + r) * p.HV + h) * K + dc;
          float out = acc;
          if constexpr (kind != kGateNone) {
            const float x = gz[b] + bias;
            float dz, dae;
            if constexpr (kind == kGateStandard) {
              const float sp = x > 20.f ? x : log1pf(expf(x));
              const float g = -mul0(eA, sp);
              dz = -mul0(mul0(eA, sigmoid_f(x)), acc);
              dae = mul0(acc, g);
            } else {
              const float y = mul0(eA, x);
              // sigmoid(y) sigmoid(-y) = e / (1 + e)^2 with e = exp(-|y|): one exp, one
              // reciprocal
              const float e = exp_in<Tin>(-fabsf(y)), rc = rcp_in<Tin>(1.f + e);
              const float ds = e * rc * rc;
              dz = mul0(mul0(acc * p.lower_bound, ds), eA);
              dae = mul0(dz, x);
            }
            out = dz;
            sdt += dz;
            sA += dae;
          }
          p.o_dg[oi] = out;
        }
      }
    };
    if (p.gate == kGateLowerBound)
      chain(std::integral_constant<int, kGateLowerBound>{});
    else if (p.gate == kGateStandard)
      chain(std::integral_constant<int, kGateStandard>{});
    else
      chain(std::integral_constant<int, kGateNone>{});
    if (p.gate != kGateNone) {
      float* part = sXq;  // [2][NG][KH] (X is free; 2 NT <= 32 KP)
      static_assert(2 * kThreads <= 2 * kSub * (KH + 8), "partials fit in Xq, Xk");
      part[g0 * KH + d] = sdt;
      part[(NG + g0) * KH + d] = sA;
      __syncthreads();
      if (t < KH) {
        float s1 = 0.f, s2 = 0.f;
        for (int g = 0; g < NG; ++g) s1 += part[g * KH + t], s2 += part[(NG + g) * KH + t];
        p.pdt[tk * K + c_lo + t] = s1;
        sRed[t] = s2;
      }
    }
  }
  if (t < kC) p.dbi[(tk * NS + z) * kC + t] = t < L ? sDbI[t] : 0.f;
  if (p.gate != kGateNone) {
    __syncthreads();
    if (t == 0) {
      float s = 0.f;
      for (int d = 0; d < KH; ++d) s += sRed[d];
      p.pA[tk * NS + z] = s;
    }
  }
}

}  // namespace

template <class Tin>
void launch_intra_bwd(const Plan& pl, const BwdParams<Tin>& bp, unsigned tf32) {
  with_k(pl.K, kOp, [&](auto kc) {
    constexpr int K = decltype(kc)::value;
    const size_t smem = size_t(IntraBwdLayout(K).total) * sizeof(float);
    with_prec<kStageIntraBwd, Tin>(tf32, [&](auto tf32c) {
      constexpr bool F = decltype(tf32c)::value;
      set_smem(kOp, reinterpret_cast<const void*>(&kda_bwd_intra_kernel<K, Tin, F>), smem,
               "intra bwd");
      kda_bwd_intra_kernel<K, Tin, F>
          <<<dim3(unsigned(pl.NC), unsigned(pl.HV), unsigned(slices(K))), kThreads, smem>>>(bp);
    });
    check_launch(kOp, "intra bwd kernel");
  });
}

template void launch_intra_bwd<float>(const Plan&, const BwdParams<float>&, unsigned);
template void launch_intra_bwd<__nv_bfloat16>(const Plan&, const BwdParams<__nv_bfloat16>&,
                                              unsigned);

}  // namespace hlm::ops::cuda::kda
