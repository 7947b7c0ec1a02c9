// Causal depthwise conv1d on CUDA (ops/conv1d.h, ops/cuda/conv1d.cuh), the math of
// ops/cpu/conv1d.cpp. Per sequence n = [bos, eos) of length L, xe(p) is x[bos + p] for p >= 0 and
// the conv state row p + W - 1 (or 0) for -(W-1) <= p < 0.
//   forward:  one thread per (token, channel): z = sum_j w[c, j] xe(t - W + 1 + j) as a chain of
//             FMAs in j order (the decode step uses the same chain, so it is bit-identical to
//             the full conv, and a token's output never depends on the rest of the batch);
//             the token's sequence comes from a binary search of cu_seqlens.
//   backward: dz = dy act'(z) into an FP32 (FP64) workspace [T, C]; dxe(p) = sum_j w[c, j]
//             dz(p + W - 1 - j), one thread per (token or state row, channel);
//             dw: every sequence is cut into chunks of kChunk tokens from its own start; one
//             thread per (chunk, c, j) sums its chunk in token order into a workspace
//             [chunks, C, W], then one thread per (c, j) walks the sequences in order, sums each
//             sequence's chunks in order and adds that sum to dw. The chunking depends only on
//             each sequence's length, so a packed batch adds to dw exactly what its sequences
//             add one call at a time, and the result is bit-identical run to run (no atomics).
#include <vector>

#include "ops/cuda/conv1d.cuh"
#include "ops/cuda/layer_ops_common.cuh"

namespace hlm::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = 128;  // dw partial sums: tokens per chunk

struct ConvDims {
  int64_t T, C, W, N;
  const int64_t* cu;  // [N+1] device
};

// The sequence of token t: the largest n < N with cu[n] <= t (t < T, N >= 1).
__device__ __forceinline__ int64_t seq_of(const int64_t* cu, int64_t N, int64_t t) {
  return last_le(cu, N, t);
}

template <class A, class TX>
__device__ __forceinline__ A xe(const TX* x, const TX* sp, const ConvDims& d, int64_t n,
                                int64_t bos, int64_t p, int64_t c) {
  if (p >= 0) return ld<A>(x, (bos + p) * d.C + c);
  if (!sp) return A(0);
  return ld<A>(sp, (n * (d.W - 1) + p + d.W - 1) * d.C + c);
}

template <class A, class TX, class TW>
__device__ __forceinline__ A conv_at(const TX* x, const TW* w, const TX* sp, const ConvDims& d,
                                     int64_t n, int64_t bos, int64_t t, int64_t c) {
  A z = 0;
  for (int64_t j = 0; j < d.W; ++j)
    z = dfma(ld<A>(w, c * d.W + j), xe<A>(x, sp, d, n, bos, t - d.W + 1 + j, c), z);
  return z;
}

template <class TX, class TW>
__global__ void conv_fwd_kernel(const TX* __restrict__ x, const TW* __restrict__ w,
                                const TX* __restrict__ sp, TX* __restrict__ y, ConvDims d,
                                bool silu) {
  using A = acc_t<TX>;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= d.T * d.C) return;
  const int64_t t = i / d.C, c = i % d.C;
  const int64_t n = seq_of(d.cu, d.N, t), bos = d.cu[n];
  const A z = conv_at<A>(x, w, sp, d, n, bos, t - bos, c);
  st(y, i, silu ? z * dsigmoid(z) : z);
}

// final[n, i, c] = xe(L - (W-1) + i): the last W-1 inputs of each sequence.
template <class TX>
__global__ void conv_final_state_kernel(const TX* __restrict__ x, const TX* __restrict__ sp,
                                        TX* __restrict__ fin, ConvDims d) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= d.N * (d.W - 1) * d.C) return;
  const int64_t c = i % d.C, r = (i / d.C) % (d.W - 1), n = i / (d.C * (d.W - 1));
  const int64_t bos = d.cu[n], len = d.cu[n + 1] - bos;
  const int64_t p = len - (d.W - 1) + r;
  // A copy of an input element: move the stored value, no rounding.
  if (p >= 0) {
    fin[i] = x[(bos + p) * d.C + c];
  } else if (sp) {
    fin[i] = sp[(n * (d.W - 1) + p + d.W - 1) * d.C + c];
  } else {
    fin[i] = TX(0.0f);
  }
}

// dz = dy * act'(z) in the arithmetic type.
template <class TX, class TW>
__global__ void conv_dz_kernel(const TX* __restrict__ dy, const TX* __restrict__ x,
                               const TW* __restrict__ w, const TX* __restrict__ sp,
                               acc_t<TX>* __restrict__ dz, ConvDims d, bool silu) {
  using A = acc_t<TX>;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= d.T * d.C) return;
  A g = ld<A>(dy, i);
  if (silu) {
    const int64_t t = i / d.C, c = i % d.C;
    const int64_t n = seq_of(d.cu, d.N, t), bos = d.cu[n];
    const A z = conv_at<A>(x, w, sp, d, n, bos, t - bos, c);
    const A s = dsigmoid(z);
    g *= s * (A(1) + z * (A(1) - s));
  }
  dz[i] = g;
}

// dxe(p) = sum_j w[c, j] dz(p + W - 1 - j) over 0 <= p + W - 1 - j < L.
template <class A, class TW>
__device__ __forceinline__ A dxe_at(const A* dz, const TW* w, const ConvDims& d, int64_t bos,
                                    int64_t len, int64_t p, int64_t c) {
  A s = 0;
  for (int64_t j = 0; j < d.W; ++j) {
    const int64_t t = p + d.W - 1 - j;
    if (t >= 0 && t < len) s = dfma(ld<A>(w, c * d.W + j), dz[(bos + t) * d.C + c], s);
  }
  return s;
}

template <class TX, class TW>
__global__ void conv_dx_kernel(const acc_t<TX>* __restrict__ dz, const TW* __restrict__ w,
                               TX* __restrict__ dx, ConvDims d) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= d.T * d.C) return;
  const int64_t t = i / d.C, c = i % d.C;
  const int64_t n = seq_of(d.cu, d.N, t), bos = d.cu[n], len = d.cu[n + 1] - bos;
  st(dx, i, dxe_at(dz, w, d, bos, len, t - bos, c));
}

template <class TX, class TW>
__global__ void conv_dstate_kernel(const acc_t<TX>* __restrict__ dz, const TW* __restrict__ w,
                                   TX* __restrict__ ds, ConvDims d) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= d.N * (d.W - 1) * d.C) return;
  const int64_t c = i % d.C, r = (i / d.C) % (d.W - 1), n = i / (d.C * (d.W - 1));
  const int64_t bos = d.cu[n], len = d.cu[n + 1] - bos;
  st(ds, i, dxe_at(dz, w, d, bos, len, r - (d.W - 1), c));
}

// chunks: [nk] (sequence, first local token) of every chunk, in sequence order.
struct ChunkTable {
  const int64_t* seq;    // [nk]
  const int64_t* t0;     // [nk]
  const int64_t* first;  // [N+1]: chunks of sequence n are [first[n], first[n+1])
  int64_t nk;
};

// part[k, c, j] = sum over the chunk's tokens t (in order) of dz_t xe(t - W + 1 + j).
template <class TX>
__global__ void conv_dw_partial_kernel(const acc_t<TX>* __restrict__ dz, const TX* __restrict__ x,
                                       const TX* __restrict__ sp, acc_t<TX>* __restrict__ part,
                                       ConvDims d, ChunkTable ct) {
  using A = acc_t<TX>;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t cw = d.C * d.W;
  if (i >= ct.nk * cw) return;
  const int64_t k = i / cw, e = i % cw, c = e / d.W, j = e % d.W;
  const int64_t n = ct.seq[k], bos = d.cu[n], len = d.cu[n + 1] - bos;
  const int64_t t0 = ct.t0[k], t1 = t0 + kChunk < len ? t0 + kChunk : len;
  A acc = 0;
  for (int64_t t = t0; t < t1; ++t)
    acc = dfma(dz[(bos + t) * d.C + c], xe<A>(x, sp, d, n, bos, t - d.W + 1 + j, c), acc);
  part[i] = acc;
}

// dw[e] += (sum of sequence n's chunks, in order), sequence by sequence.
template <class A, class TDW>
__global__ void conv_dw_reduce_kernel(const A* __restrict__ part, TDW* __restrict__ dw, ConvDims d,
                                      ChunkTable ct) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t cw = d.C * d.W;
  if (e >= cw) return;
  A acc = ld<A>(dw, e);
  for (int64_t n = 0; n < d.N; ++n) {
    if (ct.first[n] == ct.first[n + 1]) continue;  // empty sequence: adds nothing
    A s = 0;
    for (int64_t k = ct.first[n]; k < ct.first[n + 1]; ++k) s += part[k * cw + e];
    acc += s;
    // dw is stored after every sequence: round as a separate call's store would.
    if constexpr (std::is_same_v<TDW, nv_bf16>) acc = __bfloat162float(__float2bfloat16_rn(acc));
  }
  st(dw, e, acc);
}

template <class TX, class TW>
__global__ void conv_update_kernel(const TX* __restrict__ x, TX* __restrict__ state,
                                   const TW* __restrict__ w, TX* __restrict__ y,
                                   const int64_t* __restrict__ slots, int64_t N, int64_t C,
                                   int64_t W, bool silu) {
  using A = acc_t<TX>;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N * C) return;
  const int64_t n = i / C, c = i % C;
  TX* sn = state + (slots ? slots[n] : n) * (W - 1) * C;
  A z = 0;
  for (int64_t j = 0; j < W; ++j) {
    const A v = j < W - 1 ? ld<A>(sn, j * C + c) : ld<A>(x, i);
    z = dfma(ld<A>(w, c * W + j), v, z);
  }
  st(y, i, silu ? z * dsigmoid(z) : z);
  for (int64_t r = 0; r + 1 < W - 1; ++r) sn[r * C + c] = sn[(r + 1) * C + c];
  if (W > 1) sn[(W - 2) * C + c] = x[i];
}

}  // namespace

void causal_conv1d_forward(const Tensor& x, const Tensor& w, const std::vector<int64_t>& cu,
                           const Tensor& state, bool silu, Tensor& y, Tensor* final_state) {
  const int64_t T = x.size(0), C = x.size(1), W = w.size(1), N = int64_t(cu.size()) - 1;
  if (N == 0) return;
  const Tensor dcu = to_device(cu);
  const ConvDims d{T, C, W, N, dcu.data<int64_t>()};
  dispatch_storage(x.dtype(), [&](auto tx) {
    using TX = decltype(tx);
    dispatch_param<TX>(w.dtype(), [&](auto tw) {
      using TW = decltype(tw);
      if (T * C > 0)
        conv_fwd_kernel<TX, TW><<<blocks_for(T * C, kThreads), kThreads>>>(
            cptr<TX>(x), cptr<TW>(w), cptr<TX>(state), mptr<TX>(y), d, silu);
      check_launch("causal_conv1d_forward");
    });
    const int64_t ns = N * (W - 1) * C;
    if (final_state && ns > 0)
      conv_final_state_kernel<TX><<<blocks_for(ns, kThreads), kThreads>>>(
          cptr<TX>(x), cptr<TX>(state), mptr<TX>(*final_state), d);
    check_launch("causal_conv1d_forward final state");
  });
}

void causal_conv1d_backward(const Tensor& dy, const Tensor& x, const Tensor& w,
                            const std::vector<int64_t>& cu, const Tensor& state, bool silu,
                            Tensor& dx, Tensor* dstate, Tensor& dw) {
  const int64_t T = x.size(0), C = x.size(1), W = w.size(1), N = int64_t(cu.size()) - 1;
  if (N == 0 || C == 0) return;
  // Chunk table: every sequence cut into kChunk-token chunks from its own start.
  std::vector<int64_t> first(size_t(N) + 1, 0), cseq, ct0;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t len = cu[size_t(n) + 1] - cu[size_t(n)];
    for (int64_t t0 = 0; t0 < len; t0 += kChunk) cseq.push_back(n), ct0.push_back(t0);
    first[size_t(n) + 1] = int64_t(cseq.size());
  }
  const int64_t nk = int64_t(cseq.size());
  std::vector<int64_t> table(cu);
  table.insert(table.end(), first.begin(), first.end());
  table.insert(table.end(), cseq.begin(), cseq.end());
  table.insert(table.end(), ct0.begin(), ct0.end());
  const Tensor dt = to_device(table);
  const int64_t* base = dt.data<int64_t>();
  const ConvDims d{T, C, W, N, base};
  const ChunkTable ct{base + 2 * (N + 1), base + 2 * (N + 1) + nk, base + (N + 1), nk};
  dispatch_storage(x.dtype(), [&](auto tx) {
    using TX = decltype(tx);
    using A = acc_t<TX>;
    const DType adt = std::is_same_v<A, double> ? DType::f64 : DType::f32;
    const Tensor dz = alloc({T, C}, adt);
    const Tensor part = alloc({nk, C, W}, adt);
    dispatch_param<TX>(w.dtype(), [&](auto tw) {
      using TW = decltype(tw);
      if (T > 0) {
        conv_dz_kernel<TX, TW><<<blocks_for(T * C, kThreads), kThreads>>>(
            cptr<TX>(dy), cptr<TX>(x), cptr<TW>(w), cptr<TX>(state), mptr<A>(dz), d, silu);
        check_launch("causal_conv1d_backward dz");
        conv_dx_kernel<TX, TW>
            <<<blocks_for(T * C, kThreads), kThreads>>>(cptr<A>(dz), cptr<TW>(w), mptr<TX>(dx), d);
        check_launch("causal_conv1d_backward dx");
      }
      const int64_t ns = N * (W - 1) * C;
      if (dstate && ns > 0) {
        conv_dstate_kernel<TX, TW><<<blocks_for(ns, kThreads), kThreads>>>(cptr<A>(dz), cptr<TW>(w),
                                                                           mptr<TX>(*dstate), d);
        check_launch("causal_conv1d_backward dinitial_state");
      }
    });
    if (nk > 0)
      conv_dw_partial_kernel<TX><<<blocks_for(nk * C * W, kThreads), kThreads>>>(
          cptr<A>(dz), cptr<TX>(x), cptr<TX>(state), mptr<A>(part), d, ct);
    check_launch("causal_conv1d_backward dw partials");
    dispatch_param<TX>(dw.dtype(), [&](auto tdw) {
      using TDW = decltype(tdw);
      conv_dw_reduce_kernel<A, TDW>
          <<<blocks_for(C * W, kThreads), kThreads>>>(cptr<A>(part), mptr<TDW>(dw), d, ct);
      check_launch("causal_conv1d_backward dw");
    });
  });
}

void causal_conv1d_update(const Tensor& x, Tensor& state, const Tensor& w, bool silu, Tensor& y,
                          const std::vector<int64_t>& slots) {
  const int64_t N = x.size(0), C = x.size(1), W = w.size(1);
  if (N * C == 0) return;
  const Tensor dslots = slots.empty() ? Tensor() : to_device(slots);
  const int64_t* sp = slots.empty() ? nullptr : dslots.data<int64_t>();
  dispatch_storage(x.dtype(), [&](auto tx) {
    using TX = decltype(tx);
    dispatch_param<TX>(w.dtype(), [&](auto tw) {
      using TW = decltype(tw);
      conv_update_kernel<TX, TW><<<blocks_for(N * C, kThreads), kThreads>>>(
          cptr<TX>(x), mptr<TX>(state), cptr<TW>(w), mptr<TX>(y), sp, N, C, W, silu);
      check_launch("causal_conv1d_update");
    });
  });
}

}  // namespace hlm::ops::cuda
