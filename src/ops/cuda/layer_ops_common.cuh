// Device helpers shared by the CUDA layer ops (conv1d.cu, norms.cu, kda_gate.cu,
// activations.cu): typed loads and stores with FP32 (FP64 for f64) arithmetic, 16-byte vector
// packs, the scalar activations written as the CPU writes them, a fixed-order warp sum, and the
// host-side dtype dispatch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/tensor.h"

namespace hlm::ops::cuda {

using nv_bf16 = __nv_bfloat16;

// The arithmetic type of a storage type: double for double, float otherwise.
template <class T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <class A, class T>
__device__ __forceinline__ A ld(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, nv_bf16>) {
    return A(__bfloat162float(p[i]));
  } else {
    return A(p[i]);
  }
}
template <class T, class A>
__device__ __forceinline__ void st(T* p, int64_t i, A v) {
  if constexpr (std::is_same_v<T, nv_bf16>) {
    p[i] = __float2bfloat16_rn(float(v));
  } else {
    p[i] = T(v);
  }
}

// V consecutive elements moved as one aligned access (16 bytes for V = 16 / sizeof(T)).
template <class T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};
template <int V, class A, class T>
__device__ __forceinline__ void ldv(const T* p, int64_t i, A (&out)[V]) {
  const Pack<T, V> pk = *reinterpret_cast<const Pack<T, V>*>(p + i);
#pragma unroll
  for (int k = 0; k < V; ++k) out[k] = ld<A>(pk.v, k);
}
template <int V, class T, class A>
__device__ __forceinline__ void stv(T* p, int64_t i, const A (&in)[V]) {
  Pack<T, V> pk;
#pragma unroll
  for (int k = 0; k < V; ++k) st(pk.v, k, in[k]);
  *reinterpret_cast<Pack<T, V>*>(p + i) = pk;
}

__device__ __forceinline__ float dexp(float x) {
  return expf(x);
}
__device__ __forceinline__ double dexp(double x) {
  return exp(x);
}
__device__ __forceinline__ float dlog1p(float x) {
  return log1pf(x);
}
__device__ __forceinline__ double dlog1p(double x) {
  return log1p(x);
}
__device__ __forceinline__ float dsqrt(float x) {
  return sqrtf(x);
}
__device__ __forceinline__ double dsqrt(double x) {
  return sqrt(x);
}
__device__ __forceinline__ float dfma(float a, float b, float c) {
  return fmaf(a, b, c);
}
__device__ __forceinline__ double dfma(double a, double b, double c) {
  return fma(a, b, c);
}

// sigmoid as ops::sigmoid_scalar: e^x / (1 + e^x) for x < 0, so that no exp overflows.
template <class A>
__device__ __forceinline__ A dsigmoid(A x) {
  if (x >= A(0)) return A(1) / (A(1) + dexp(-x));
  const A e = dexp(x);
  return e / (A(1) + e);
}

// Sum over the 32 lanes by an xor butterfly: a fixed order, the same result in every lane.
template <class A>
__device__ __forceinline__ A warp_sum(A x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Max over the 32 lanes by an xor butterfly (exact in any order), the same value in every lane.
template <class A>
__device__ __forceinline__ A warp_max(A x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const A y = __shfl_xor_sync(0xffffffffu, x, off);
    x = y > x ? y : x;
  }
  return x;
}

// The largest i in [0, n) with a[i] <= v (a non-decreasing, a[0] <= v): the document of a token
// in cu_seqlens (or of a pool in the pool offsets), skipping empty documents.
__device__ __forceinline__ int64_t last_le(const int64_t* a, int64_t n, int64_t v) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (a[mid] <= v)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// ---- host side ----

void check_launch(const char* what);

// The device's opt-in limit of dynamic shared memory per block, and the opt-in of `kernel` to
// `bytes` of it (an hlm::Error naming `what` when refused).
int smem_optin();
void set_smem(const void* kernel, size_t bytes, const char* what);

// A new contiguous CUDA tensor for an output or a workspace (NaN-poisoned while the test hook of
// ops/dispatch.h is on).
Tensor alloc(const Shape& shape, DType dt);

// A host vector (cu_seqlens, offsets, index lists) as a new 1-D CUDA tensor.
template <class V>
Tensor to_device(const std::vector<V>& v) {
  return Tensor::from_vector<V>({int64_t(v.size())}, v).to(Device::cuda);
}

inline unsigned blocks_for(int64_t n, int threads) {
  return unsigned((n + threads - 1) / threads);
}

// f(T{}) for the storage type of dt: float, double or nv_bf16.
template <class F>
void dispatch_storage(DType dt, F&& f) {
  switch (dt) {
    case DType::f32:
      f(float{});
      return;
    case DType::f64:
      f(double{});
      return;
    case DType::bf16:
      f(nv_bf16{});
      return;
    default:
      HLM_FAIL("CUDA layer op: unsupported dtype {}", dtype_name(dt));
  }
}

// f(P{}) for a parameter of an op whose x has storage type T: P = T, or float when T is bf16
// and dt is f32 (the argument checks have allowed only these).
template <class T, class F>
void dispatch_param(DType dt, F&& f) {
  if constexpr (std::is_same_v<T, nv_bf16>) {
    if (dt == DType::f32) {
      f(float{});
      return;
    }
  }
  f(T{});
}

template <class T>
const T* cptr(const Tensor& t) {
  return t.defined() ? static_cast<const T*>(t.raw()) : nullptr;
}
template <class T>
T* mptr(const Tensor& t) {
  return static_cast<T*>(t.raw());
}

}  // namespace hlm::ops::cuda
