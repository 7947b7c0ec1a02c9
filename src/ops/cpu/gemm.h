// The CPU reference of GEMM (ops/gemm.h). The front door (ops/gemm.cpp) checks the arguments
// (2-D, one device, dtypes, op(A) [m, k] op(B) [k, n] C [m, n] with m, n, k >= 1) and picks the
// backend; A, B and C may be strided views (handled as ops/gemm_operand.h says).
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "ops/gemm.h"

namespace hlm::ops::cpu {

// C = alpha op(A) op(B) + beta C (C not read when beta == 0).
void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, int64_t m,
          int64_t n, int64_t k, double alpha, double beta, GemmOptions opt, GemmBackend backend);

}  // namespace hlm::ops::cpu
