// CUDA kernels of the copy and elementwise ops of ops/tensor_ops.h: a strided copy with dtype
// conversion (rank <= 8), in-place add, bias add, column sums in row order, scaling, and the
// scatter of the final conv state's gradient. One thread per output element (per column for the
// sums, each summed in ascending row order), so results are bit-identical to the CPU loops and
// run to run. Default stream, asynchronous.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <limits>

#include "ops/cuda/layer_ops_common.cuh"
#include "ops/cuda/tensor_ops.cuh"

namespace hlm::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kMaxBlocks = 65536;

constexpr int kMaxDims = 8;
struct Layout {
  int nd = 0;
  int64_t size[kMaxDims] = {};
  int64_t stride[kMaxDims] = {};
  bool contiguous = true;
};

Layout layout_of(const Tensor& t) {
  Layout l;
  l.nd = int(t.dim());
  for (int d = 0; d < l.nd; ++d) {
    l.size[d] = t.size(d);
    l.stride[d] = t.stride(d);
  }
  l.contiguous = t.is_contiguous();
  return l;
}

__device__ __forceinline__ int64_t offset_of(const Layout& l, int64_t i) {
  if (l.contiguous) return i;
  int64_t off = 0;
  for (int d = l.nd - 1; d >= 0; --d) {
    const int64_t s = l.size[d];
    off += (i % s) * l.stride[d];
    i /= s;
  }
  return off;
}

// One rounding from the source type to the destination type.
template <class D, class S>
__device__ __forceinline__ D convert(S v) {
  if constexpr (std::is_same_v<D, S>) {
    return v;
  } else if constexpr (std::is_same_v<D, nv_bf16>) {
    if constexpr (std::is_same_v<S, double>) {
      return __double2bfloat16(v);
    } else {
      return __float2bfloat16_rn(v);
    }
  } else if constexpr (std::is_same_v<S, nv_bf16>) {
    return D(__bfloat162float(v));
  } else {
    return D(v);
  }
}

template <class D, class S>
__global__ void copy_kernel(D* __restrict__ dst, Layout ld, const S* __restrict__ src, Layout ls,
                            int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[offset_of(ld, i)] = convert<D>(src[offset_of(ls, i)]);
}

template <class T>
__global__ void add_kernel(T* __restrict__ dst, const T* __restrict__ src, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] += src[i];
}

template <class T>
__global__ void bias_kernel(T* __restrict__ y, const T* __restrict__ b, int64_t n, int64_t cols) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    y[i] += b[i % cols];
}

// out[o] = sum_t x[t, o], t ascending (coalesced across o).
template <class T>
__global__ void sum_rows_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t rows,
                                int64_t cols) {
  const int64_t o = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (o >= cols) return;
  T s = T(0);
  for (int64_t t = 0; t < rows; ++t) s += x[t * cols + o];
  out[o] = s;
}

template <class T>
__global__ void scale_kernel(T* __restrict__ c, Layout l, int64_t n, double beta) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t off = offset_of(l, i);
    c[off] = beta == 0.0 ? convert<T>(0.0) : convert<T>(convert<double>(c[off]) * beta);
  }
}

template <class T>
__global__ void nan_if_flagged_kernel(T* __restrict__ t, int64_t n,
                                      const int32_t* __restrict__ flag, double qnan) {
  if (*flag == 0) return;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    t[i] = convert<T>(qnan);
}

// One thread per (sequence n, entry i, channel ch) of dfinal [N, W-1, C].
template <class T>
__global__ void final_state_bwd_kernel(const T* __restrict__ dfin, const int64_t* __restrict__ cu,
                                       int64_t nseq, int64_t wm, int64_t c, T* __restrict__ dx,
                                       T* __restrict__ dinit) {
  const int64_t total = nseq * wm * c;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t ch = e % c, i = (e / c) % wm, n = e / (c * wm);
    const int64_t bos = cu[n], len = cu[n + 1] - bos;
    const int64_t p = len - wm + i;
    if (p >= 0) {
      dx[(bos + p) * c + ch] += dfin[e];
    } else if (dinit) {
      dinit[(n * wm + p + wm) * c + ch] += dfin[e];
    }
  }
}

unsigned grid_for(int64_t n) {
  return std::max<unsigned>(1, std::min<unsigned>(blocks_for(n, kThreads), kMaxBlocks));
}

template <class F>
void dispatch_acc(DType dt, F&& f) {
  if (dt == DType::f64)
    f(double{});
  else
    f(float{});
}

}  // namespace

void copy_into(Tensor& dst, const Tensor& src) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  if (dst.dtype() == src.dtype() && dst.is_contiguous() && src.is_contiguous()) {
    const cudaError_t err =
        cudaMemcpyAsync(dst.raw(), src.raw(), dst.nbytes(), cudaMemcpyDeviceToDevice, 0);
    HLM_CHECK(err == cudaSuccess, "copy_into: {}", cudaGetErrorString(err));
    return;
  }
  const Layout ld = layout_of(dst), ls = layout_of(src);
  dispatch_storage(dst.dtype(), [&](auto td) {
    using D = decltype(td);
    dispatch_storage(src.dtype(), [&](auto ts) {
      using S = decltype(ts);
      copy_kernel<D, S><<<grid_for(n), kThreads>>>(mptr<D>(dst), ld, cptr<S>(src), ls, n);
    });
  });
  check_launch("copy_into");
}

void add_(Tensor& dst, const Tensor& src) {
  const int64_t n = dst.numel();
  dispatch_acc(dst.dtype(), [&](auto tag) {
    using T = decltype(tag);
    add_kernel<T><<<grid_for(n), kThreads>>>(mptr<T>(dst), cptr<T>(src), n);
  });
  check_launch("add_");
}

void add_bias_(Tensor& y, const Tensor& b) {
  const int64_t n = y.numel();
  dispatch_acc(y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    bias_kernel<T><<<grid_for(n), kThreads>>>(mptr<T>(y), cptr<T>(b), n, y.size(1));
  });
  check_launch("add_bias_");
}

void sum_rows(const Tensor& x, Tensor& out) {
  const int64_t rows = x.size(0), cols = x.size(1);
  dispatch_acc(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    sum_rows_kernel<T><<<blocks_for(cols, 128), 128>>>(cptr<T>(x), mptr<T>(out), rows, cols);
  });
  check_launch("sum_rows");
}

void scale_(Tensor& c, double beta) {
  const int64_t n = c.numel();
  const Layout l = layout_of(c);
  dispatch_storage(c.dtype(), [&](auto tag) {
    using T = decltype(tag);
    scale_kernel<T><<<grid_for(n), kThreads>>>(mptr<T>(c), l, n, beta);
  });
  check_launch("scale_");
}

void nan_if_flagged_(Tensor& t, const Tensor& flag) {
  const int64_t n = t.numel();
  dispatch_storage(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    nan_if_flagged_kernel<T><<<grid_for(n), kThreads>>>(mptr<T>(t), n, cptr<int32_t>(flag),
                                                        std::numeric_limits<double>::quiet_NaN());
  });
  check_launch("nan_if_flagged_");
}

void causal_conv1d_final_state_backward(const Tensor& dfinal, const std::vector<int64_t>& cu,
                                        int64_t width, Tensor& dx, Tensor* dinitial) {
  const int64_t nseq = int64_t(cu.size()) - 1, wm = width - 1, c = dx.size(1);
  const int64_t total = nseq * wm * c;
  if (total == 0) return;
  Tensor cu_dev = to_device(cu);
  dispatch_acc(dx.dtype(), [&](auto tag) {
    using T = decltype(tag);
    final_state_bwd_kernel<T>
        <<<grid_for(total), kThreads>>>(cptr<T>(dfinal), cptr<int64_t>(cu_dev), nseq, wm, c,
                                        mptr<T>(dx), dinitial ? mptr<T>(*dinitial) : nullptr);
  });
  check_launch("causal_conv1d_final_state_backward");
}

namespace {

// One thread per word of the output: row r takes its words from row rows[r] of src.
template <class W>
__global__ void gather_rows_kernel(const W* src, const int64_t* rows, int64_t R, int64_t words,
                                   W* out) {
  const int64_t n = R * words;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / words, w = i - r * words;
    out[i] = src[rows[r] * words + w];
  }
}

// One thread per word of src: row r goes to row rows[r] of dst.
template <class W>
__global__ void scatter_rows_kernel(const W* src, const int64_t* rows, int64_t R, int64_t words,
                                    W* dst) {
  const int64_t n = R * words;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / words, w = i - r * words;
    dst[rows[r] * words + w] = src[i];
  }
}

// The word the row copies move: 4 bytes when a row is a whole number of them, else bytes.
template <class Fn>
void by_word(size_t row_bytes, Fn&& f) {
  if (row_bytes % 4 == 0)
    f(uint32_t{}, int64_t(row_bytes / 4));
  else
    f(uint8_t{}, int64_t(row_bytes));
}

}  // namespace

void scatter_rows(Tensor& dst, const std::vector<int64_t>& rows, const Tensor& src) {
  const int64_t R = int64_t(rows.size());
  const Tensor rows_dev = to_device(rows);
  by_word(size_t(dst.size(1)) * dst.element_size(), [&](auto w, int64_t words) {
    using W = decltype(w);
    scatter_rows_kernel<W><<<grid_for(R * words), kThreads>>>(static_cast<const W*>(src.raw()),
                                                              cptr<int64_t>(rows_dev), R, words,
                                                              static_cast<W*>(dst.raw()));
  });
  check_launch("scatter_rows");
}

void gather_rows(const Tensor& src, const std::vector<int64_t>& rows, Tensor& out) {
  const int64_t R = int64_t(rows.size());
  const Tensor rows_dev = to_device(rows);
  by_word(size_t(src.size(1)) * src.element_size(), [&](auto w, int64_t words) {
    using W = decltype(w);
    gather_rows_kernel<W><<<grid_for(R * words), kThreads>>>(static_cast<const W*>(src.raw()),
                                                             cptr<int64_t>(rows_dev), R, words,
                                                             static_cast<W*>(out.raw()));
  });
  check_launch("gather_rows");
}

}  // namespace hlm::ops::cuda
