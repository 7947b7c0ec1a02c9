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

}  // namespace hlm::ops::cuda
