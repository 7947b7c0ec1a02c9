// KDA chunked backward on CUDA, B5 and B6: the gradients of the arguments as passed (params.cuh;
// docs/kda.md, "CUDA chunked backward"); the stages and their notation are listed in bwd_launch.cu.
//   B5 per (chunk, qk head): dq, dk summed over the value heads of the group in order, then the
//      L2-norm backward dx = rstd (dx^ - x^ (x^ . dx^)); dbeta = the WY part + the slices'
//      partials, then the beta sigmoid's chain rule.
//   B6 per value head: dA_log, d dt_bias = the per-chunk partials summed in chunk order.
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

// ------------------------------------------------------------------ B5: GVA sum + L2 norm

template <int K, class Tin>
__global__ void __launch_bounds__(kThreads) kda_bwd_qk_kernel(const BwdParams<Tin> p) {
  constexpr int NB = K / 32;
  const int ci = blockIdx.x, hk = blockIdx.y;
  const int bos = p.chunk_bos[ci], L = p.chunk_len[ci];
  const int Gq = p.HV / p.H;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int r = warp; r < L; r += kThreads / 32) {
    const int64_t tok = int64_t(bos) + r;
    for (int which = 0; which < 2; ++which) {
      const float* src = which ? p.dk : p.dq;
      float dx[NB];
#pragma unroll
      for (int b = 0; b < NB; ++b) dx[b] = 0.f;
      for (int g = 0; g < Gq; ++g) {  // the value heads of the group, in order
        const float* row = src + ((int64_t(ci) * p.HV + hk * Gq + g) * kC + r) * K;
#pragma unroll
        for (int b = 0; b < NB; ++b) dx[b] += row[lane + 32 * b];
      }
      float* out = (which ? p.o_dk : p.o_dq) + (tok * p.H + hk) * K;
      if (p.l2norm) {
        const Tin* xr = (which ? p.k : p.q) + (tok * p.H + hk) * K;
        float x[NB], ss = 0.f;
#pragma unroll
        for (int b = 0; b < NB; ++b) {
          x[b] = to_f(xr[lane + 32 * b]);
          ss = fmaf(x[b], x[b], ss);
        }
        for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
        const float rs = 1.f / sqrtf(ss + float(kKdaL2Eps));
        float dot = 0.f;
#pragma unroll
        for (int b = 0; b < NB; ++b) {
          x[b] *= rs;
          dot = fmaf(x[b], dx[b], dot);
        }
        for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
#pragma unroll
        for (int b = 0; b < NB; ++b) out[lane + 32 * b] = rs * (dx[b] - x[b] * dot);
      } else {
#pragma unroll
        for (int b = 0; b < NB; ++b) out[lane + 32 * b] = dx[b];
      }
    }
  }
  // dbeta of the group's value heads = the WY part + the intra slices' partials (in slice
  // order), then the beta sigmoid's chain rule.
  constexpr int NS = slices(K);
  for (int i = threadIdx.x; i < Gq * L; i += kThreads) {
    const int g = i / L, r = i % L, hv = hk * Gq + g;
    const int64_t tk = int64_t(ci) * p.HV + hv;
    float di = 0.f;
    for (int zs = 0; zs < NS; ++zs) di += p.dbi[(tk * NS + zs) * kC + r];
    float db = (p.dbw[(tk * 2 + 1) * kC + r] + p.dbw[tk * 2 * kC + r]) + di;
    if (p.beta_logits) {
      const float b = p.beta[tk * kC + r];
      db *= b * (1.f - b);
    }
    p.o_dbeta[(int64_t(bos) + r) * p.HV + hv] = db;
  }
}

// ------------------------------------------------------------------ B6: gate parameter sums

template <int K, class Tin>
__global__ void __launch_bounds__(kThreads) kda_bwd_gate_sum_kernel(const BwdParams<Tin> p) {
  const int h = blockIdx.x, t = threadIdx.x;
  if (p.o_ddt && t < K) {
    float s = 0.f;
    for (int ci = 0; ci < p.NC; ++ci) s += p.pdt[(int64_t(ci) * p.HV + h) * K + t];
    p.o_ddt[h * K + t] = s;
  }
  if (p.o_dA && t == 0) {
    float s = 0.f;
    constexpr int NS = slices(K);
    for (int ci = 0; ci < p.NC; ++ci)
      for (int z = 0; z < NS; ++z) s += p.pA[(int64_t(ci) * p.HV + h) * NS + z];
    p.o_dA[h] = s;
  }
}

}  // namespace

template <class Tin>
void launch_qk_bwd(const Plan& pl, const BwdParams<Tin>& bp) {
  with_k(pl.K, kOp, [&](auto kc) {
    constexpr int K = decltype(kc)::value;
    kda_bwd_qk_kernel<K, Tin><<<dim3(unsigned(pl.NC), unsigned(pl.H)), kThreads>>>(bp);
    check_launch(kOp, "qk bwd kernel");
  });
}

template <class Tin>
void launch_gate_sums(const Plan& pl, const BwdParams<Tin>& bp) {
  with_k(pl.K, kOp, [&](auto kc) {
    constexpr int K = decltype(kc)::value;
    kda_bwd_gate_sum_kernel<K, Tin><<<unsigned(pl.HV), kThreads>>>(bp);
    check_launch(kOp, "gate sum kernel");
  });
}

template void launch_qk_bwd<float>(const Plan&, const BwdParams<float>&);
template void launch_qk_bwd<__nv_bfloat16>(const Plan&, const BwdParams<__nv_bfloat16>&);
template void launch_gate_sums<float>(const Plan&, const BwdParams<float>&);
template void launch_gate_sums<__nv_bfloat16>(const Plan&, const BwdParams<__nv_bfloat16>&);

}  // namespace hlm::ops::cuda::kda
