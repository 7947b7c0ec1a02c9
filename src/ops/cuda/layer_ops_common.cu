// Host helpers of the CUDA layer ops (ops/cuda/layer_ops_common.cuh): workspace allocation and
// launch error checks.
#include "ops/cuda/layer_ops_common.cuh"
#include "ops/dispatch.h"

namespace hlm::ops::cuda {

Tensor alloc(const Shape& shape, DType dt) {
  return detail::new_output(shape, dt, Device::cuda);
}

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  HLM_CHECK(err == cudaSuccess, "{} kernel launch: {}", what, cudaGetErrorString(err));
}

int smem_optin() {
  int dev = 0, optin = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  return optin;
}

void set_smem(const void* kernel, size_t bytes, const char* what) {
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  HLM_CHECK(err == cudaSuccess, "{}: cudaFuncSetAttribute: {}", what, cudaGetErrorString(err));
}

}  // namespace hlm::ops::cuda
