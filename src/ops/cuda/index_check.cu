// The index check of ops/cuda/index_check.cuh:
//   first_bad = min { i : idx[i] outside [0, bound) and (!has_ignore or idx[i] != ignore) }
//   kept      = #{ i : !has_ignore or idx[i] != ignore }
// One block of 1024 threads: thread j reads positions j, j + 1024, ... in order (coalesced) and
// keeps its first bad position and its count; the block then takes the minimum and the sum
// (integers: exact in any order) by warp butterflies and one warp over the 32 warp results.
// Reads each index once (8 bytes an i64 index): about the cost of one copy of idx through one SM,
// small beside the ops that use the indices. No atomics.
#include <cuda_runtime.h>

#include "core/device.h"
#include "ops/cuda/index_check.cuh"
#include "ops/cuda/layer_ops_common.cuh"

namespace hlm::ops::cuda {
namespace {

constexpr int kThreads = 1024;

__device__ __forceinline__ int64_t warp_min_i64(int64_t x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const int64_t y = __shfl_xor_sync(0xffffffffu, x, off);
    x = y < x ? y : x;
  }
  return x;
}

// out[0] = first bad position (n when none), out[1] = its value (0 when none), out[2] = kept.
template <class I>
__global__ void __launch_bounds__(kThreads)
    scan_kernel(const I* __restrict__ idx, int64_t n, int64_t bound, bool has_ignore,
                int64_t ignore, int64_t* __restrict__ out) {
  __shared__ int64_t s_bad[kThreads / 32], s_kept[kThreads / 32];
  int64_t bad = n, kept = 0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const int64_t v = int64_t(idx[i]);
    if (has_ignore && v == ignore) continue;
    ++kept;
    if ((v < 0 || v >= bound) && bad == n) bad = i;
  }
  bad = warp_min_i64(bad);
  kept = warp_sum(kept);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  if (lane == 0) {
    s_bad[warp] = bad;
    s_kept[warp] = kept;
  }
  __syncthreads();
  if (warp == 0) {
    bad = s_bad[lane];
    kept = s_kept[lane];
    bad = warp_min_i64(bad);
    kept = warp_sum(kept);
    if (lane == 0) {
      out[0] = bad;
      out[1] = bad < n ? int64_t(idx[bad]) : 0;
      out[2] = kept;
    }
  }
}

}  // namespace

IndexScan scan_indices(const Tensor& idx, int64_t bound, bool has_ignore, int64_t ignore) {
  IndexScan r;
  const int64_t n = idx.numel();
  if (n == 0) return r;
  Tensor out = alloc({3}, DType::i64);
  if (idx.dtype() == DType::i64)
    scan_kernel<<<1, kThreads>>>(cptr<int64_t>(idx), n, bound, has_ignore, ignore,
                                 mptr<int64_t>(out));
  else
    scan_kernel<<<1, kThreads>>>(cptr<int32_t>(idx), n, bound, has_ignore, ignore,
                                 mptr<int64_t>(out));
  check_launch("scan_indices");
  int64_t h[3];
  device_copy(h, Device::cpu, out.raw(), Device::cuda, sizeof(h));
  r.first_bad = h[0] < n ? h[0] : -1;
  r.bad_value = h[1];
  r.kept = h[2];
  return r;
}

}  // namespace hlm::ops::cuda
