// KPool compression on CUDA (ops/cuda/dsa_kpool.cuh), the math of ops/cpu/dsa_kpool.cpp: for pool
// p of a document starting at s0 (first token s = s0 + pP), slot j < P, channel c,
//   z_j = gate[s + j, c] + ape[j, c],  a_j = softmax_j z  (max-subtracted),  K = sum_j a_j k[s + j,
//   c] dk[s + j, c] = a_j dK[p, c],  dgate[s + j, c] = dz_j = a_j (k[s + j, c] - K) dK[p, c],
//   dape[j, c] = sum over all pools (in pool-id order) of dz_j.
// Tokens outside complete pools get zero gradients. Arithmetic in f32 (f64 for f64).
//
// Work split (all element-wise over channels, coalesced along c):
//   kpool_fwd:          one thread per (pool, channel); the pool's document by binary search in
//                       the pool offsets cp, the softmax and the weighted sum over j in order.
//   kpool_bwd_tokens:   one thread per (token, channel): the token's document by binary search in
//                       cu; inside a complete pool it recomputes the pool's softmax and K (P-fold
//                       redundant, P is small) and writes dk and dgate, else zeros.
//   kpool_dape_partial: one thread per (chunk of kChunk pools, channel): for each slot j the sum
//                       of dz_j over the chunk's pools in id order, into a workspace
//                       [chunks, P, d] in the computation dtype (dz in f32, not rounded to bf16).
//   kpool_dape_reduce:  one thread per (j, c): the chunks in order, then dape in ape's dtype.
// No atomics; every sum has a fixed order, so results repeat bit for bit.
#include <algorithm>

#include "ops/cuda/dsa_kpool.cuh"
#include "ops/cuda/layer_ops_common.cuh"
#include "ops/dsa_common.h"

namespace hlm::ops::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int64_t kChunk = 64;  // pools per dape partial

// The softmax of pool slots at (s, c): max m, normaliser sum, and the pooled value K, as the CPU
// computes them (z_j - m, exp, sum over j in order, a_j = e_j / sum, K += a_j k_j).
template <class A>
struct PoolSoftmax {
  A m, sum, K;
};

template <class A, class T, class TP>
__device__ __forceinline__ A slot_logit(const T* gate, const TP* ape, int64_t s, int j, int64_t c,
                                        int D) {
  return ld<A>(gate, (s + j) * D + c) + ld<A>(ape, int64_t(j) * D + c);
}

template <class A, class T, class TP>
__device__ __forceinline__ PoolSoftmax<A> pool_softmax(const T* k, const T* gate, const TP* ape,
                                                       int64_t s, int64_t c, int D, int P) {
  PoolSoftmax<A> r;
  r.m = -INFINITY;
  for (int j = 0; j < P; ++j) {
    const A z = slot_logit<A>(gate, ape, s, j, c, D);
    r.m = r.m < z ? z : r.m;
  }
  r.sum = 0;
  for (int j = 0; j < P; ++j) r.sum += dexp(slot_logit<A>(gate, ape, s, j, c, D) - r.m);
  r.K = 0;
  for (int j = 0; j < P; ++j) {
    const A a = dexp(slot_logit<A>(gate, ape, s, j, c, D) - r.m) / r.sum;
    r.K = dfma(a, ld<A>(k, (s + j) * D + c), r.K);
  }
  return r;
}

template <class T, class TP>
__global__ void __launch_bounds__(kThreads)
    kpool_fwd_kernel(const T* __restrict__ k, const T* __restrict__ gate,
                     const TP* __restrict__ ape, const int64_t* __restrict__ cu,
                     const int64_t* __restrict__ cp, int64_t ndocs, T* __restrict__ pooled,
                     int64_t NP, int D, int P) {
  using A = acc_t<T>;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= NP * D) return;
  const int64_t p = i / D, c = i % D;
  const int64_t d = last_le(cp, ndocs + 1, p);
  const int64_t s = cu[d] + (p - cp[d]) * P;
  st(pooled, i, pool_softmax<A>(k, gate, ape, s, c, D, P).K);
}

template <class T, class TP>
__global__ void __launch_bounds__(kThreads)
    kpool_bwd_tokens_kernel(const T* __restrict__ k, const T* __restrict__ gate,
                            const TP* __restrict__ ape, const T* __restrict__ dpool,
                            const int64_t* __restrict__ cu, const int64_t* __restrict__ cp,
                            int64_t ndocs, T* __restrict__ dk, T* __restrict__ dgate, int64_t T_,
                            int D, int P) {
  using A = acc_t<T>;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= T_ * D) return;
  const int64_t t = i / D, c = i % D;
  const int64_t d = last_le(cu, ndocs + 1, t);
  const int64_t r = t - cu[d], pl = r / P;
  if (pl >= (cu[d + 1] - cu[d]) / P) {  // not in a complete pool
    st(dk, i, A(0));
    st(dgate, i, A(0));
    return;
  }
  const int j = int(r % P);
  const int64_t s = cu[d] + pl * P, p = cp[d] + pl;
  const PoolSoftmax<A> sm = pool_softmax<A>(k, gate, ape, s, c, D, P);
  const A a = dexp(slot_logit<A>(gate, ape, s, j, c, D) - sm.m) / sm.sum;
  const A dK = ld<A>(dpool, p * D + c);
  st(dk, i, a * dK);
  st(dgate, i, a * (ld<A>(k, i) - sm.K) * dK);
}

// part [chunks, P, D]: blockIdx.y = chunk, threads over channels.
template <class T, class TP>
__global__ void __launch_bounds__(kThreads)
    kpool_dape_partial_kernel(const T* __restrict__ k, const T* __restrict__ gate,
                              const TP* __restrict__ ape, const T* __restrict__ dpool,
                              const int64_t* __restrict__ cu, const int64_t* __restrict__ cp,
                              int64_t ndocs, acc_t<T>* __restrict__ part, int64_t NP, int D,
                              int P) {
  using A = acc_t<T>;
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= D) return;
  const int64_t ch = blockIdx.y, p0 = ch * kChunk, p1 = std::min(NP, p0 + kChunk);
  A* out = part + ch * P * D;
  for (int j = 0; j < P; ++j) out[int64_t(j) * D + c] = A(0);
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t d = last_le(cp, ndocs + 1, p);
    const int64_t s = cu[d] + (p - cp[d]) * P;
    const PoolSoftmax<A> sm = pool_softmax<A>(k, gate, ape, s, c, D, P);
    const A dK = ld<A>(dpool, p * D + c);
    for (int j = 0; j < P; ++j) {
      const A a = dexp(slot_logit<A>(gate, ape, s, j, c, D) - sm.m) / sm.sum;
      out[int64_t(j) * D + c] += a * (ld<A>(k, (s + j) * D + c) - sm.K) * dK;
    }
  }
}

template <class A, class TP>
__global__ void __launch_bounds__(kThreads)
    kpool_dape_reduce_kernel(const A* __restrict__ part, TP* __restrict__ dape, int64_t chunks,
                             int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  A v = 0;
  for (int64_t ch = 0; ch < chunks; ++ch) v += part[ch * n + i];
  st(dape, i, v);
}

struct Geometry {
  int64_t T = 0, NP = 0, ndocs = 0;
  int D = 0, P = 0;
  Tensor cu, cp;  // i64 [N+1] on the device
};

Geometry geometry(const Tensor& k, const Tensor& ape, const std::vector<int64_t>& cu) {
  Geometry g;
  g.T = k.size(0), g.D = int(k.size(1)), g.P = int(ape.size(0));
  const std::vector<int64_t> cp = dsa_detail::pool_offsets(cu, g.P);
  g.NP = cp.back();
  g.ndocs = int64_t(cu.size()) - 1;
  g.cu = to_device(cu);
  g.cp = to_device(cp);
  return g;
}

// f(T{}, TP{}) for k's storage type T and ape's TP.
template <class F>
void dispatch_kpool(const Tensor& k, const Tensor& ape, F&& f) {
  dispatch_storage(k.dtype(), [&](auto tag) {
    using T = decltype(tag);
    dispatch_param<T>(ape.dtype(), [&](auto ptag) { f(T{}, decltype(ptag){}); });
  });
}

}  // namespace

void kpool_compress(const Tensor& k, const Tensor& gate, const Tensor& ape,
                    const std::vector<int64_t>& cu, Tensor& pooled) {
  const Geometry g = geometry(k, ape, cu);
  const int64_t n = g.NP * g.D;
  if (n == 0) return;
  dispatch_kpool(k, ape, [&](auto tt, auto tp) {
    using T = decltype(tt);
    using TP = decltype(tp);
    kpool_fwd_kernel<T, TP><<<blocks_for(n, kThreads), kThreads>>>(
        cptr<T>(k), cptr<T>(gate), cptr<TP>(ape), cptr<int64_t>(g.cu), cptr<int64_t>(g.cp), g.ndocs,
        mptr<T>(pooled), g.NP, g.D, g.P);
    check_launch("kpool_compress");
  });
}

void kpool_compress_backward(const Tensor& k, const Tensor& gate, const Tensor& ape,
                             const std::vector<int64_t>& cu, const Tensor& d_pooled,
                             KPoolCompressGrads& grads) {
  const Geometry g = geometry(k, ape, cu);
  dispatch_kpool(k, ape, [&](auto tt, auto tp) {
    using T = decltype(tt);
    using TP = decltype(tp);
    using A = acc_t<T>;
    const int64_t nt = g.T * g.D;
    if (nt > 0) {
      kpool_bwd_tokens_kernel<T, TP><<<blocks_for(nt, kThreads), kThreads>>>(
          cptr<T>(k), cptr<T>(gate), cptr<TP>(ape), cptr<T>(d_pooled), cptr<int64_t>(g.cu),
          cptr<int64_t>(g.cp), g.ndocs, mptr<T>(grads.dk), mptr<T>(grads.dgate), g.T, g.D, g.P);
      check_launch("kpool_compress_backward tokens");
    }
    const int64_t na = int64_t(g.P) * g.D;
    if (na == 0) return;
    const int64_t chunks = (g.NP + kChunk - 1) / kChunk;
    Tensor part;
    if (chunks > 0) {
      part = alloc({chunks, g.P, g.D}, compute_dtype(k.dtype()));
      const dim3 grid(blocks_for(g.D, kThreads), unsigned(chunks));
      kpool_dape_partial_kernel<T, TP><<<grid, kThreads>>>(
          cptr<T>(k), cptr<T>(gate), cptr<TP>(ape), cptr<T>(d_pooled), cptr<int64_t>(g.cu),
          cptr<int64_t>(g.cp), g.ndocs, mptr<A>(part), g.NP, g.D, g.P);
      check_launch("kpool_compress_backward dape partial");
    }
    kpool_dape_reduce_kernel<A, TP>
        <<<blocks_for(na, kThreads), kThreads>>>(cptr<A>(part), mptr<TP>(grads.dape), chunks, na);
    check_launch("kpool_compress_backward dape");
  });
}

}  // namespace hlm::ops::cuda
