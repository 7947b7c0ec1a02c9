// What the stage files of the CUDA chunked KDA (params.cuh) share: the chunk constants, scalar and
// float4 device helpers, cp.async, and the host-side launch helpers. Internal.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "core/error.h"
#include "core/tensor.h"
#include "ops/cuda/cp_async.cuh"
#include "ops/cuda/kda_chunk/heuristics.h"
#include "ops/cuda/kda_chunk/params.cuh"
#include "ops/dispatch.h"
#include "ops/kda.h"

namespace hlm::ops::cuda::kda {

constexpr int kC = 64;            // chunk size (== kKdaChunk)
constexpr int kSub = 16;          // sub-chunk (block) size of the intra matrices and their split
constexpr int kThreads = 256;     // the state passes and every backward kernel
constexpr float kSpanMax = 80.f;  // largest decay span (nats) of a diagonal 16x16 block for the
                                  // split-reference product (else per element)
constexpr int kSliceK = 64;       // channels per block of the contractions and the intra backward

static_assert(kKdaChunk == kC, "the CUDA kernels are written for C = 64");

// Channels per block of the channel-split backward kernels, and blocks per (chunk, head): K = 128
// -> 2.
__host__ __device__ constexpr int slice_k(int K) {
  return K < kSliceK ? K : kSliceK;
}
__host__ __device__ constexpr int slices(int K) {
  return K / slice_k(K);
}

// ------------------------------------------------------------------ device helpers

__device__ __forceinline__ float to_f(float x) {
  return x;
}
__device__ __forceinline__ float to_f(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

__device__ __forceinline__ float sigmoid_f(float x) {
  if (x >= 0.f) return 1.f / (1.f + expf(-x));
  const float e = expf(x);
  return e / (1.f + e);
}

// e^x in the chunk kernels' decay factors (and the gate activations of bf16 inputs): f32 inputs
// expf (within 1 ulp, 8 instructions); bf16 inputs 2^(x log2 e) by ex2.approx.ftz (2
// instructions: __expf without -ftz adds a range test and two scalings for subnormal results).
// CUDA's bound for __expf, 2 + 1.17 |x| ulp, is ~6e-6 relative at the largest split span, 80
// nats, far below the rounding of the bf16 inputs; results below 2^-126 (x < -87.3) flush to
// zero, where the FP32 value is below 1.2e-38 of the terms it scales.
template <class Tin>
__device__ __forceinline__ float exp_in(float x) {
  if constexpr (std::is_same_v<Tin, float>) {
    return expf(x);
  } else {
#ifdef HLM_CUDA_EMU
    return ::hlm::emu::ex2_approx_ftz(x * 1.44269504088896341f);
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.44269504088896341f));
    return y;
#endif
  }
}

// 1 / x for the gate activations: IEEE division for f32 inputs; for bf16 inputs the approximate
// reciprocal (rcp.approx.ftz, within 1 ulp), taken only on x in [1, 2].
template <class Tin>
__device__ __forceinline__ float rcp_in(float x) {
  if constexpr (std::is_same_v<Tin, float>) {
    return 1.f / x;
  } else {
#ifdef HLM_CUDA_EMU
    return ::hlm::emu::rcp_approx_ftz(x);
#else
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#endif
  }
}

// a * b with 0 * anything = 0 (the gate's 0 * inf guard, as the CPU gate).
__device__ __forceinline__ float mul0(float a, float b) {
  return (a == 0.f || b == 0.f) ? 0.f : a * b;
}

__device__ __forceinline__ float4 ld4(const float* p) {
  return *reinterpret_cast<const float4*>(p);
}
__device__ __forceinline__ void st4(float* p, float4 x) {
  *reinterpret_cast<float4*>(p) = x;
}

// acc += a * x (per component).
__device__ __forceinline__ void fma4(float4& acc, float a, float4 x) {
  acc.x = fmaf(a, x.x, acc.x);
  acc.y = fmaf(a, x.y, acc.y);
  acc.z = fmaf(a, x.z, acc.z);
  acc.w = fmaf(a, x.w, acc.w);
}

// n consecutive elements (n * sizeof(T) a multiple of 16 bytes, p 16-byte aligned) as 16-byte
// loads / stores.
template <int n, class T>
__device__ __forceinline__ void ld16(const T* p, T (&v)[n]) {
  static_assert(n * sizeof(T) % 16 == 0, "whole 16-byte chunks");
#pragma unroll
  for (int c = 0; c < int(n * sizeof(T) / 16); ++c)
    reinterpret_cast<uint4*>(v)[c] = reinterpret_cast<const uint4*>(p)[c];
}
template <int n, class T>
__device__ __forceinline__ void st16(T* p, const T (&v)[n]) {
  static_assert(n * sizeof(T) % 16 == 0, "whole 16-byte chunks");
#pragma unroll
  for (int c = 0; c < int(n * sizeof(T) / 16); ++c)
    reinterpret_cast<uint4*>(p)[c] = reinterpret_cast<const uint4*>(v)[c];
}

// 4 consecutive elements of a raw (Tin) shared-memory row as f32 (p 4-element aligned).
__device__ __forceinline__ void lds4(const float* p, float (&x)[4]) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
}
__device__ __forceinline__ void lds4(const __nv_bfloat16* p, float (&x)[4]) {
  const uint2 v = *reinterpret_cast<const uint2*>(p);
  x[0] = __uint_as_float(v.x << 16), x[1] = __uint_as_float(v.x & 0xffff0000u);
  x[2] = __uint_as_float(v.y << 16), x[3] = __uint_as_float(v.y & 0xffff0000u);
}

// Copies rows x cols floats (cols % 4 == 0) from global (row stride gs) to shared (row stride ss,
// ss % 4 == 0) by cp.async with kThreads threads; the caller commits and waits.
__device__ __forceinline__ void cp_rows(float* dst, int ss, const float* src, int64_t gs, int rows,
                                        int cols) {
  const int c4 = cols / 4;
  for (int i = threadIdx.x; i < rows * c4; i += kThreads) {
    const int r = i / c4, c = 4 * (i % c4);
    cp_async16(dst + r * ss + c, src + r * gs + c);
  }
}

// ------------------------------------------------------------------ host helpers

inline int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}

// Calls f(std::bool_constant<tf32>) with the precision of stage S (heuristics.h) for inputs of
// type Tin: TF32 when bit S of `tf32` is set, else 3xTF32 (f32 inputs: always false, FP32 FMA).
template <int S, class Tin, class F>
void with_prec(unsigned tf32, F&& f) {
  if constexpr (std::is_same_v<Tin, float>) {
    f(std::false_type{});
  } else {
    if ((tf32 >> S) & 1u)
      f(std::true_type{});
    else
      f(std::false_type{});
  }
}

// Calls f(std::integral_constant<int, K>) for K = 32, 64, 128 (checked by ops::kda_check).
template <class F>
void with_k(int64_t K, const char* op, F&& f) {
  switch (K) {
    case 32:
      return f(std::integral_constant<int, 32>{});
    case 64:
      return f(std::integral_constant<int, 64>{});
    case 128:
      return f(std::integral_constant<int, 128>{});
    default:
      HLM_FAIL("{}: unsupported K={}", op, K);
  }
}

// The checks of a direct call of the CUDA entry points (params.cuh): q on CUDA, then those of
// every call (ops::kda_check, ops/kda.cpp).
inline KdaDims check_call(const KdaArgs& a, const char* op) {
  HLM_CHECK(a.q.defined() && a.q.device() == Device::cuda, "{}: q must be a CUDA tensor, got {}",
            op, a.q.defined() ? a.q.describe() : "undefined");
  return kda_check(a, op);
}

// The V tile of the state passes for this call on the current device (heuristics.h).
inline int state_tile(const Plan& p) {
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return state_tile(p, sms);
}

// Calls f(std::integral_constant<int, BV>) with that V tile.
template <class F>
void with_state_tile(const Plan& p, F&& f) {
  if (state_tile(p) == 64)
    f(std::integral_constant<int, 64>{});
  else
    f(std::integral_constant<int, 32>{});
}

// Consecutive slices of a workspace, each starting at a multiple of 64 floats (256 bytes).
struct Offsets {
  int64_t end = 0;  // floats taken so far
  int64_t take(int64_t floats) {
    const int64_t o = end;
    end = round_up(end + floats, 64);
    return o;
  }
};

inline bool aligned16(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.raw()) % 16 == 0;
}

// Turns a failed kernel launch into hlm::Error naming the op and the kernel.
inline void check_launch(const char* op, const char* what) {
  const cudaError_t err = cudaGetLastError();
  HLM_CHECK(err == cudaSuccess, "{}: {} launch: {}", op, what, cudaGetErrorString(err));
}

// Opts `kernel` in to `bytes` of dynamic shared memory (an error when the device has less).
inline void set_smem(const char* op, const void* kernel, size_t bytes, const char* what) {
  int dev = 0, optin = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  HLM_CHECK(size_t(optin) >= bytes, "{}: {} needs {} bytes of shared memory, the device allows {}",
            op, what, bytes, optin);
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  HLM_CHECK(err == cudaSuccess, "{}: cudaFuncSetAttribute({}): {}", op, what,
            cudaGetErrorString(err));
}

// A buffer for an output: the caller's, checked (CUDA, contiguous, 16-byte aligned, dtype `dt`,
// shape `shape`), or a new tensor when `given` is undefined.
inline Tensor output_buffer(const Tensor& given, DType dt, const Shape& shape, const char* op,
                            const char* what) {
  if (!given.defined()) return detail::new_output(shape, dt, Device::cuda);
  HLM_CHECK(given.device() == Device::cuda && given.is_contiguous() && aligned16(given) &&
                given.dtype() == dt && given.shape() == shape,
            "{}: {} must be a contiguous, 16-byte aligned CUDA tensor {} {}, got {}", op, what,
            dtype_name(dt), shape_str(shape), given.describe());
  return given;
}

// An f32 workspace of at least `floats` elements: the caller's, checked as above, or a new one.
inline Tensor workspace_buffer(const Tensor& given, int64_t floats, const char* op,
                               const char* what = "buffers.workspace") {
  if (!given.defined()) return detail::new_output({floats}, DType::f32, Device::cuda);
  HLM_CHECK(given.device() == Device::cuda && given.is_contiguous() && aligned16(given) &&
                given.dtype() == DType::f32 && given.numel() >= floats,
            "{}: {} must be a contiguous, 16-byte aligned CUDA f32 tensor of at least {} elements, "
            "got {}",
            op, what, floats, given.describe());
  return given;
}

}  // namespace hlm::ops::cuda::kda
