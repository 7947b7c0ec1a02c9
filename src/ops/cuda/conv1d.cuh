// The CUDA side of the causal depthwise conv1d (ops/conv1d.h): host interface of conv1d.cu,
// includable from C++. The front door (ops/conv1d.cpp) checks the arguments (dtype rules in
// ops/op_checks.h; contiguous), checks the sequence layout and allocates the outputs:
// y, dx, final_state, dstate (the last two when not nullptr); dw accumulates. state: undefined
// when absent. Kernels run on the default stream.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace hlm::ops::cuda {

void causal_conv1d_forward(const Tensor& x, const Tensor& w, const std::vector<int64_t>& cu,
                           const Tensor& state, bool silu, Tensor& y, Tensor* final_state);
void causal_conv1d_backward(const Tensor& dy, const Tensor& x, const Tensor& w,
                            const std::vector<int64_t>& cu, const Tensor& state, bool silu,
                            Tensor& dx, Tensor* dstate, Tensor& dw);
// slots: sequence n's state is row slots[n] of state (empty: row n).
void causal_conv1d_update(const Tensor& x, Tensor& state, const Tensor& w, bool silu, Tensor& y,
                          const std::vector<int64_t>& slots = {});

}  // namespace hlm::ops::cuda
