// How a GEMM operand is handed to BLAS / cuBLAS: shared by the CPU (ops/cpu/gemm.cpp) and the
// cuBLAS (ops/cuda/gemm_cublas.cu) paths of ops::gemm. Internal.
#pragma once

#include "core/tensor.h"

namespace hlm::ops::detail {

// One operand as BLAS sees it: a row-major matrix at `ptr` with leading dimension `ld`, used
// transposed when `trans`. `keep` holds a contiguous copy when one was needed.
struct BlasMat {
  const void* ptr = nullptr;
  int ld = 1;
  bool trans = false;
  Tensor keep;
};

// View the 2-D `t` ([R, C] as stored) with logical transpose flag `trans` as a BLAS operand: in
// place when it is row- or column-major with a unit inner stride, else through a contiguous copy
// on its device. hlm::Error when a leading dimension exceeds the int range of the BLAS APIs.
BlasMat as_blas(const Tensor& t, bool trans);

// True when C can be written in place by BLAS (row-major, last dimension contiguous).
bool blas_row_major(const Tensor& t);

}  // namespace hlm::ops::detail
