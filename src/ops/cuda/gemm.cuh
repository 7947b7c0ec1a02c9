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

// The grouped GEMM of ops/gemm.h, checked by its front door: a and b of one dtype (f32, f64 or
// bf16), c f32 / f64 (bf16 operands: FP32 accumulation into an f32 c, no TF32 for f32). One
// cublasGemmGroupedBatchedEx call for all groups (a loop of cublasGemmEx where cuBLAS does not
// support the grouped call for the dtypes); deterministic run to run. Groups with k == 0 are
// handled by the front door.
using GemmGroup = ops::GemmGroup;
void gemm_grouped(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                  const std::vector<GemmGroup>& groups, double alpha, double beta);
// gemm_multi of ops/gemm.h, checked by its front door (every operand with a contiguous last
// dimension, every c of one dtype, m, n, k >= 1): one grouped call.
void gemm_multi(const Tensor& a, bool trans_a, const std::vector<Tensor>& b, bool trans_b,
                std::vector<Tensor>& c, GemmOptions opt);
// gemm_grouped's (and gemm_multi's) calls and their per-group fallbacks so far.
ops::GemmGroupedCounts gemm_grouped_counts();

}  // namespace hlm::ops::cuda
