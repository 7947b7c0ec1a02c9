// The CUDA side of GEMM (ops/gemm.h): host interface of the cuBLAS launcher (gemm_cublas.cu),
// includable from C++. The front door (ops/gemm.cpp) checks the arguments (2-D CUDA tensors,
// dtypes, op(A) [m, k] op(B) [k, n] C [m, n] with m, n, k >= 1); A, B and C may be strided views.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/gemm.h"

namespace hlm::ops::cuda {

// C = alpha op(A) op(B) + beta C (C not read when beta == 0). Default stream.
void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, int64_t m,
          int64_t n, int64_t k, double alpha, double beta, GemmOptions opt);

// A grouped GEMM (the experts of an MoE layer): for every group g, the row-major product
//   C_g = alpha op(A_g) op(B_g) + beta C_g,   op(A_g) [m, k], op(B_g) [k, n], C_g [m, n],
// where A_g, B_g and C_g are contiguous row-major blocks starting at element a_off / b_off / c_off
// of a, b and c (A_g is [m, k], or [k, m] with trans_a; B_g is [k, n], or [n, k] with trans_b).
// a, b and c: contiguous CUDA tensors of one dtype, f32 (FP32 accumulation, no TF32) or f64.
// Every m, n, k >= 1. One cublasGemmGroupedBatchedEx call for all groups (a loop of cublasGemmEx
// where cuBLAS does not support the grouped call for the dtype); deterministic run to run.
struct GemmGroup {
  int64_t m, n, k;
  int64_t a_off, b_off, c_off;
};
void gemm_grouped(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                  const std::vector<GemmGroup>& groups, double alpha, double beta);

}  // namespace hlm::ops::cuda
