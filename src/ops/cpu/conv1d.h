// The CPU reference of the causal depthwise conv1d (ops/conv1d.h). Inputs are checked by the
// front door (ops/conv1d.cpp): f32 or f64, one dtype, contiguous; cu: validated host cu_seqlens;
// state: [N, W-1, C] or undefined (zeros). Outputs are allocated by the front door; dw
// accumulates, state (update) is rolled in place.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace hlm::ops::cpu {

// y [T, C]; final_state [N, W-1, C] when not nullptr.
void causal_conv1d_forward(const Tensor& x, const Tensor& w, const std::vector<int64_t>& cu,
                           const Tensor& state, bool silu, Tensor& y, Tensor* final_state);
// dx [T, C] and dstate [N, W-1, C] (when not nullptr) written; dw [C, W] accumulated.
void causal_conv1d_backward(const Tensor& dy, const Tensor& x, const Tensor& w,
                            const std::vector<int64_t>& cu, const Tensor& state, bool silu,
                            Tensor& dx, Tensor* dstate, Tensor& dw);
// One decode step: y [N, C]; state [N, W-1, C] shifted and appended in place.
// slots: sequence n's state is row slots[n] of state (empty: row n).
void causal_conv1d_update(const Tensor& x, Tensor& state, const Tensor& w, bool silu, Tensor& y,
                          const std::vector<int64_t>& slots = {});

}  // namespace hlm::ops::cpu
