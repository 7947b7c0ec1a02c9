// CUDA cast kernels: one thread per element, conversions by the cuda_fp8.h / cuda_bf16.h /
// cuda_fp16.h intrinsics (hardware cvt.rn[.satfinite] on sm_90).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "ops/cuda/cast.cuh"

namespace hlm::ops::cuda {
namespace {

template <class Store>
__global__ void cast_kernel(const float* __restrict__ x, int64_t n, Store store) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) store(i, x[i]);
}

template <class Store>
void launch(const Tensor& x, Store store) {
  const int64_t n = x.numel();
  if (n == 0) return;
  const int threads = 256;
  const int64_t blocks = (n + threads - 1) / threads;
  cast_kernel<<<unsigned(blocks), threads>>>(x.data<float>(), n, store);
  const cudaError_t err = cudaGetLastError();
  HLM_CHECK(err == cudaSuccess, "cast kernel launch: {}", cudaGetErrorString(err));
}

}  // namespace

void cast(const Tensor& x, Tensor& y, Saturate sat) {
  const __nv_saturation_t s = sat == Saturate::finite ? __NV_SATFINITE : __NV_NOSAT;
  switch (y.dtype()) {
    case DType::f32:
      device_copy(y.raw(), Device::cuda, x.raw(), Device::cuda, x.nbytes());
      return;
    case DType::bf16: {
      auto* p = static_cast<__nv_bfloat16*>(y.raw());
      launch(x, [p] __device__(int64_t i, float v) { p[i] = __float2bfloat16_rn(v); });
      return;
    }
    case DType::f16: {
      auto* p = static_cast<__half*>(y.raw());
      launch(x, [p] __device__(int64_t i, float v) { p[i] = __float2half_rn(v); });
      return;
    }
    case DType::e4m3:
    case DType::e5m2: {
      auto* p = static_cast<__nv_fp8_storage_t*>(y.raw());
      const __nv_fp8_interpretation_t f = y.dtype() == DType::e4m3 ? __NV_E4M3 : __NV_E5M2;
      launch(x,
             [p, s, f] __device__(int64_t i, float v) { p[i] = __nv_cvt_float_to_fp8(v, s, f); });
      return;
    }
    default:
      HLM_FAIL("cast on CUDA: unsupported target dtype {}", dtype_name(y.dtype()));
  }
}

}  // namespace hlm::ops::cuda
