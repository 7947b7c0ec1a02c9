// How a GEMM operand is handed to BLAS / cuBLAS (ops/gemm_operand.h), shared by the CPU reference
// (ops/cpu/gemm.cpp) and the cuBLAS launcher (ops/cuda/gemm_cublas.cu).
#include "ops/gemm_operand.h"

#include <algorithm>
#include <climits>

#include "ops/tensor_ops.h"

namespace hlm::ops {

namespace detail {

BlasMat as_blas(const Tensor& t, bool trans) {
  const int64_t r = t.size(0), c = t.size(1);
  const int64_t s0 = t.stride(0), s1 = t.stride(1);
  auto ld_of = [&](int64_t ld) {
    HLM_CHECK(ld < INT32_MAX, "gemm: leading dimension {} of {} exceeds the BLAS int range", ld,
              t.describe());
    return int(ld);
  };
  BlasMat m;
  if ((c <= 1 || s1 == 1) && (r <= 1 || s0 >= std::max<int64_t>(c, 1))) {
    m.ptr = t.raw();
    m.ld = ld_of(r <= 1 ? std::max<int64_t>(c, 1) : s0);
    m.trans = trans;
    return m;
  }
  if ((r <= 1 || s0 == 1) && (c <= 1 || s1 >= std::max<int64_t>(r, 1))) {
    // Column-major storage: t = (t^T)^T with t^T row-major [C, R], ld = stride(1).
    m.ptr = t.raw();
    m.ld = ld_of(c <= 1 ? std::max<int64_t>(r, 1) : s1);
    m.trans = !trans;
    return m;
  }
  m.keep = contiguous(t);
  m.ptr = m.keep.raw();
  m.ld = ld_of(std::max<int64_t>(c, 1));
  m.trans = trans;
  return m;
}

bool blas_row_major(const Tensor& t) {
  const int64_t r = t.size(0), c = t.size(1);
  return (c <= 1 || t.stride(1) == 1) && (r <= 1 || t.stride(0) >= std::max<int64_t>(c, 1));
}

}  // namespace detail

}  // namespace hlm::ops
