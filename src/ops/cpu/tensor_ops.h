// The CPU loops of the copy and elementwise ops (ops/tensor_ops.h). The front door
// (ops/tensor_ops.cpp) checks the arguments and hands over contiguous operands already converted
// to the destination's dtype (f32 / f64; scale_: f32 / f64 / bf16 of any strides).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace hlm::ops::cpu {

void add_(Tensor& dst, const Tensor& src);    // dst += src
void add_bias_(Tensor& y, const Tensor& b);   // y [T, O] += b [O] per row
void sum_rows(const Tensor& x, Tensor& out);  // out [O] = sum over t of x [T, O], t ascending
void scale_(Tensor& c, double beta);          // c = beta c (beta == 0: c = 0, c not read)
void causal_conv1d_final_state_backward(const Tensor& dfinal, const std::vector<int64_t>& cu,
                                        int64_t width, Tensor& dx, Tensor* dinitial);

}  // namespace hlm::ops::cpu
