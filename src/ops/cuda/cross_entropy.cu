// The cross-entropy on CUDA (ops/cuda/cross_entropy.cuh), the math of ops/cpu/cross_entropy.cpp:
//   lse_t = m + log sum_v e^{x_v - m};  row_loss_t = lse_t - x_{target_t} (0 where ignored)
//   loss = sum_t row_loss_t / count (FP64, token order)
//   dx_v = scale (e^{x_v - lse} - [v == target]),  scale = dloss / count
// in the computation dtype A (f64 for f64, else f32: bf16 logits are read as f32 and dlogits
// rounded to bf16 once).
//
// Forward: one 512-thread block per row, one read of the row. Thread j walks v = j, j + 512, ...
// (or the packs j, j + 512, ...) in order keeping a running maximum m and the sum s of e^{x - m}
// (rescaled by e^{m_old - m_new} when the maximum grows: the online normalizer of softmax); the
// block then merges the (m, s) pairs, a merge being (max, s_a e^{m_a - m} + s_b e^{m_b - m})
// (symmetric), by xor butterflies over each warp and one more butterfly over the 16 warp results: a
// fixed order, so the same bits every run. The host sums the row losses in FP64 in token order
// (ignored rows hold +0, which leaves an FP64 sum unchanged), as the CPU does. The sum differs from
// the CPU's sequential two-pass sum in rounding only (f32: about 1e-7 relative).
//
// Backward: one 256-thread block per (row, tile of 2048 items); consecutive threads on
// consecutive items (coalesced); every element one fixed expression. No atomics.
// Both kernels move 16-byte packs (an item = 4 f32, 8 bf16 or 2 f64) when a row's bytes are a
// multiple of 16 and the tensors 16-byte aligned (V = 154880 qualifies), single elements
// otherwise; the forward's order of additions depends on that choice, so bits repeat for the same
// V and alignment.
//
// Non-finite logits: a NaN in a row gives a NaN lse; -inf logits contribute 0 (a row of -inf only
// gives lse = -inf, the CPU NaN); a +inf logit gives lse = +inf (the CPU NaN).
#include <cuda_runtime.h>

#include <cmath>
#include <vector>

#include "core/device.h"
#include "ops/cuda/cross_entropy.cuh"
#include "ops/cuda/layer_ops_common.cuh"

namespace hlm::ops::cuda {
namespace {

constexpr int kFwdThreads = 512;
constexpr int kBwdThreads = 256;
constexpr int kBwdPer = 8;  // columns per thread of a backward tile
constexpr int64_t kBwdTile = int64_t(kBwdThreads) * kBwdPer;

__device__ __forceinline__ float dlog(float x) {
  return logf(x);
}
__device__ __forceinline__ double dlog(double x) {
  return log(x);
}

// Adds e^{x - m} to (m, s), moving m up to x when x is larger.
template <class A>
__device__ __forceinline__ void online_add(A& m, A& s, A x) {
  if (x > m) {
    s = s * dexp(m - x) + A(1);
    m = x;
  } else {
    s += x == A(-INFINITY) ? A(0) : dexp(x - m);
  }
}

// (m, s) := merge((m, s), (m2, s2)); symmetric in its two pairs.
template <class A>
__device__ __forceinline__ void online_merge(A& m, A& s, A m2, A s2) {
  const A mm = m2 > m ? m2 : m;
  s = (m == mm ? s : s * dexp(m - mm)) + (m2 == mm ? s2 : s2 * dexp(m2 - mm));
  m = mm;
}

template <class A>
__device__ __forceinline__ void warp_merge(A& m, A& s) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const A m2 = __shfl_xor_sync(0xffffffffu, m, off);
    const A s2 = __shfl_xor_sync(0xffffffffu, s, off);
    online_merge(m, s, m2, s2);
  }
}

// W = 16 / sizeof(T): the row is read as 16-byte packs (v % W == 0, 16-byte aligned rows);
// W = 1: element by element.
template <class T, class I, int W>
__global__ void __launch_bounds__(kFwdThreads)
    ce_forward_kernel(const T* __restrict__ x, const I* __restrict__ tg, int64_t v,
                      int64_t ignore_index, acc_t<T>* __restrict__ row_loss,
                      acc_t<T>* __restrict__ lse) {
  using A = acc_t<T>;
  constexpr int kWarps = kFwdThreads / 32;
  __shared__ A sm[kWarps], ss[kWarps];
  const int64_t t = blockIdx.x;
  const T* xr = x + t * v;
  A m = A(-INFINITY), s = A(0);
  if constexpr (W == 1) {
    for (int64_t i = threadIdx.x; i < v; i += kFwdThreads) online_add(m, s, ld<A>(xr, i));
  } else {
    const int64_t np = v / W;
    for (int64_t p = threadIdx.x; p < np; p += kFwdThreads) {
      A e[W];
      ldv<W>(xr, p * W, e);
#pragma unroll
      for (int k = 0; k < W; ++k) online_add(m, s, e[k]);
    }
  }
  warp_merge(m, s);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  if (warp != 0) return;
  m = lane < kWarps ? sm[lane] : A(-INFINITY);
  s = lane < kWarps ? ss[lane] : A(0);
  warp_merge(m, s);
  if (lane == 0) {
    const A l = m + dlog(s);
    lse[t] = l;
    const int64_t target = int64_t(tg[t]);
    row_loss[t] = target == ignore_index ? A(0) : l - ld<A>(xr, target);
  }
}

// Items of W elements (16-byte packs, or single elements for W = 1): block (t, y) writes items
// y * kBwdTile + threadIdx.x + k * kBwdThreads, k < kBwdPer, of row t.
template <class T, class I, int W>
__global__ void __launch_bounds__(kBwdThreads)
    ce_backward_kernel(const T* __restrict__ x, const I* __restrict__ tg,
                       const acc_t<T>* __restrict__ lse, int64_t v, int64_t ignore_index,
                       acc_t<T> scale, T* __restrict__ dx) {
  using A = acc_t<T>;
  const int64_t t = blockIdx.x;
  const int64_t target = int64_t(tg[t]);
  const bool ignored = target == ignore_index;
  const T* xr = x + t * v;
  T* dr = dx + t * v;
  const int64_t items = v / W;
  const int64_t i0 = int64_t(blockIdx.y) * kBwdTile + threadIdx.x;
  const A l = ignored ? A(0) : lse[t];
#pragma unroll
  for (int k = 0; k < kBwdPer; ++k) {
    const int64_t it = i0 + int64_t(k) * kBwdThreads;
    if (it >= items) break;
    const int64_t c = it * W;
    A e[W];
    if (ignored) {
#pragma unroll
      for (int j = 0; j < W; ++j) e[j] = A(0);
    } else {
      if constexpr (W == 1) {
        e[0] = ld<A>(xr, c);
      } else {
        ldv<W>(xr, c, e);
      }
#pragma unroll
      for (int j = 0; j < W; ++j) e[j] = scale * (dexp(e[j] - l) - (c + j == target ? A(1) : A(0)));
    }
    if constexpr (W == 1) {
      st(dr, c, e[0]);
    } else {
      stv<W>(dr, c, e);
    }
  }
}

template <class F>
void dispatch_index(DType dt, F&& f) {
  if (dt == DType::i64)
    f(int64_t{});
  else
    f(int32_t{});
}

// Whether rows of v elements of T at p (and q) can be read as 16-byte packs.
template <class T>
bool packed_rows(int64_t v, const void* p, const void* q = nullptr) {
  const auto a = reinterpret_cast<uintptr_t>(p) | reinterpret_cast<uintptr_t>(q);
  return (size_t(v) * sizeof(T)) % 16 == 0 && a % 16 == 0;
}

}  // namespace

void cross_entropy_forward(const Tensor& logits, const Tensor& targets, int64_t count,
                           CrossEntropyResult& out) {
  const int64_t nt = logits.size(0), v = logits.size(1);
  out.count = count;
  out.loss = 0;
  if (nt == 0) return;
  dispatch_storage(logits.dtype(), [&](auto tx) {
    using T = decltype(tx);
    using A = acc_t<T>;
    constexpr int W = 16 / sizeof(T);
    const bool packed = packed_rows<T>(v, logits.raw());
    dispatch_index(targets.dtype(), [&](auto ti) {
      using I = decltype(ti);
      auto* kernel = packed ? &ce_forward_kernel<T, I, W> : &ce_forward_kernel<T, I, 1>;
      kernel<<<unsigned(nt), kFwdThreads>>>(cptr<T>(logits), cptr<I>(targets), v, out.ignore_index,
                                            mptr<A>(out.row_loss), mptr<A>(out.lse));
    });
    check_launch("cross_entropy_forward");
    std::vector<A> h(static_cast<size_t>(nt));
    device_copy(h.data(), Device::cpu, out.row_loss.raw(), Device::cuda, h.size() * sizeof(A));
    double sum = 0;  // token order, FP64; ignored rows are +0
    for (const A r : h) sum += double(r);
    out.loss = count > 0 ? sum / double(count) : 0.0;
  });
}

void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            int64_t ignore_index, int64_t count, double dloss, Tensor& dlogits) {
  const int64_t nt = logits.size(0), v = logits.size(1);
  if (nt == 0 || v == 0) return;
  dispatch_storage(logits.dtype(), [&](auto tx) {
    using T = decltype(tx);
    using A = acc_t<T>;
    constexpr int W = 16 / sizeof(T);
    const bool packed = packed_rows<T>(v, logits.raw(), dlogits.raw());
    const int64_t items = packed ? v / W : v;
    const int64_t tiles = (items + kBwdTile - 1) / kBwdTile;
    HLM_CHECK(tiles <= 65535, "cross_entropy_backward: V = {} is too large", v);
    const A scale = count > 0 ? A(dloss / double(count)) : A(0);
    dispatch_index(targets.dtype(), [&](auto ti) {
      using I = decltype(ti);
      auto* kernel = packed ? &ce_backward_kernel<T, I, W> : &ce_backward_kernel<T, I, 1>;
      kernel<<<dim3(unsigned(nt), unsigned(tiles)), kBwdThreads>>>(
          cptr<T>(logits), cptr<I>(targets), cptr<A>(lse), v, ignore_index, scale,
          mptr<T>(dlogits));
    });
    check_launch("cross_entropy_backward");
  });
}

}  // namespace hlm::ops::cuda
