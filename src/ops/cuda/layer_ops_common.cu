// Host helpers of the CUDA layer ops (ops/layer_ops_cuda.h): output allocation with the NaN
// poisoning test hook, and launch error checks.
#include <atomic>

#include "ops/cuda/layer_ops_common.cuh"
#include "ops/layer_ops_cuda.h"

namespace hlm::ops::cuda {
namespace {
std::atomic<bool> g_poison{false};
}

void set_poison_outputs(bool on) {
  g_poison = on;
}

Tensor alloc(const Shape& shape, DType dt) {
  Tensor t = Tensor::empty(shape, dt, Device::cuda);
  if (g_poison && t.nbytes() > 0) {
    const cudaError_t err = cudaMemset(t.raw(), 0xFF, t.nbytes());
    HLM_CHECK(err == cudaSuccess, "poisoning an output: {}", cudaGetErrorString(err));
  }
  return t;
}

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  HLM_CHECK(err == cudaSuccess, "{} kernel launch: {}", what, cudaGetErrorString(err));
}

}  // namespace hlm::ops::cuda
