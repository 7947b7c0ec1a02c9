// The greedy pick on CUDA (ops/cuda/greedy.cuh), the math of ops/cpu/greedy.cpp: one 512-thread
// block per row, two reads of the row. Pass 1: thread j walks v = j, j + 512, ... keeping its
// largest finite logit (ties: the lower id, which it meets first) and its first non-finite id; the
// block merges the (value, id) pairs (larger value, then lower id: a total order, so any merge
// order gives the same pair) and the first bad ids (the minimum). Pass 2: thread j sums
// exp(x_v - m) in FP64 over its ids; the 512 sums are added by xor butterflies over each warp and
// over the 16 warp sums: a fixed order, so the same bits every run. Nothing atomic.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "ops/cuda/greedy.cuh"
#include "ops/cuda/layer_ops_common.cuh"

namespace hlm::ops::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kNone = INT64_MAX;

// (v, i) := the better of (v, i) and (v2, i2): the larger value, then the lower id.
__device__ __forceinline__ void better(double& v, int64_t& i, double v2, int64_t i2) {
  if (v2 > v || (v2 == v && i2 < i)) {
    v = v2;
    i = i2;
  }
}

// Every lane gets the warp's best (value, id) and its first bad id (xor butterflies).
__device__ __forceinline__ void warp_merge(double& best, int64_t& idx, int64_t& first_bad) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    better(best, idx, __shfl_xor_sync(0xffffffffu, best, off),
           __shfl_xor_sync(0xffffffffu, idx, off));
    const int64_t b2 = __shfl_xor_sync(0xffffffffu, first_bad, off);
    first_bad = b2 < first_bad ? b2 : first_bad;
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    greedy_kernel(const T* __restrict__ x, int64_t V, int64_t* __restrict__ token,
                  double* __restrict__ logprob, int64_t* __restrict__ bad) {
  __shared__ double sv[kWarps], ss[kWarps];
  __shared__ int64_t si[kWarps], sb[kWarps];
  __shared__ double s_best;
  __shared__ bool s_bad;
  const int64_t r = blockIdx.x;
  const T* row = x + r * V;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  double best = -INFINITY;
  int64_t idx = kNone, first_bad = kNone;
  for (int64_t v = threadIdx.x; v < V; v += kThreads) {
    const double e = ld<double>(row, v);
    if (!(fabs(e) < INFINITY)) {  // NaN or infinite
      if (first_bad == kNone) first_bad = v;
      continue;
    }
    if (e > best) {
      best = e;
      idx = v;
    }
  }
  warp_merge(best, idx, first_bad);
  if (lane == 0) {
    sv[warp] = best;
    si[warp] = idx;
    sb[warp] = first_bad;
  }
  __syncthreads();
  if (warp == 0) {
    best = lane < kWarps ? sv[lane] : -INFINITY;
    idx = lane < kWarps ? si[lane] : kNone;
    first_bad = lane < kWarps ? sb[lane] : kNone;
    warp_merge(best, idx, first_bad);
    if (lane == 0) {
      s_best = best;
      s_bad = first_bad != kNone;
      token[r] = idx == kNone ? 0 : idx;
      bad[r] = first_bad == kNone ? -1 : first_bad;
    }
  }
  __syncthreads();
  const double m = s_best;
  double s = 0;
  for (int64_t v = threadIdx.x; v < V; v += kThreads) s += exp(ld<double>(row, v) - m);
  s = warp_sum(s);
  if (lane == 0) ss[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = warp_sum(lane < kWarps ? ss[lane] : 0.0);
    if (lane == 0) logprob[r] = s_bad ? 0.0 : m - (m + log(s));
  }
}

}  // namespace

void greedy_pick(const Tensor& logits, GreedyPick& out) {
  const int64_t R = logits.size(0), V = logits.size(1);
  dispatch_storage(logits.dtype(), [&](auto tx) {
    using T = decltype(tx);
    greedy_kernel<T><<<unsigned(R), kThreads>>>(cptr<T>(logits), V, mptr<int64_t>(out.token),
                                                mptr<double>(out.logprob), mptr<int64_t>(out.bad));
  });
  check_launch("greedy_pick");
}

}  // namespace hlm::ops::cuda
