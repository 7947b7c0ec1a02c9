// The CUDA side of GEMM (ops/gemm.h): host interface of the cuBLAS launcher (gemm_cublas.cu),
// includable from C++. The front door (ops/gemm.cpp) checks the arguments (2-D CUDA tensors,
// dtypes, op(A) [m, k] op(B) [k, n] C [m, n] with m, n, k >= 1); A, B and C may be strided views.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "ops/gemm.h"

namespace hlm::ops::cuda {

// C = alpha op(A) op(B) + beta C (C not read when beta == 0). Default stream.
void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, int64_t m,
          int64_t n, int64_t k, double alpha, double beta, GemmOptions opt);

}  // namespace hlm::ops::cuda
