// The CUDA side of the copy and elementwise ops (ops/tensor_ops.h): host interface of
// tensor_ops.cu, includable from C++. The front door (ops/tensor_ops.cpp) checks the arguments;
// tensors are on CUDA. Default stream, asynchronous.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace hlm::ops::cuda {

void copy_into(Tensor& dst, const Tensor& src);       // any strides (rank <= 8), f32 / f64 / bf16
void add_(Tensor& dst, const Tensor& src);            // both contiguous, one dtype (f32 / f64)
void add_bias_(Tensor& y, const Tensor& b);           // contiguous, one dtype (f32 / f64)
void sum_rows(const Tensor& x, Tensor& out);          // contiguous, one dtype (f32 / f64)
void scale_(Tensor& c, double beta);                  // 2-D, any strides
void nan_if_flagged_(Tensor& t, const Tensor& flag);  // t contiguous; flag i32 [1]
// out [R, C] = src[rows] (both contiguous, one dtype; rows checked by the front door).
void gather_rows(const Tensor& src, const std::vector<int64_t>& rows, Tensor& out);
// dst[rows] = src [R, C] (both contiguous, one dtype; rows checked by the front door).
void scatter_rows(Tensor& dst, const std::vector<int64_t>& rows, const Tensor& src);
void causal_conv1d_final_state_backward(const Tensor& dfinal, const std::vector<int64_t>& cu,
                                        int64_t width, Tensor& dx, Tensor* dinitial);

}  // namespace hlm::ops::cuda
