// The CPU reference of the FP8 blockwise quantizer (ops/fp8_quant.h). The front door
// (ops/fp8_quant.cpp) checks the arguments and allocates the outputs; quantized tensors are
// contiguous.
#pragma once

#include "core/tensor.h"
#include "ops/fp8_quant.h"

namespace hlm::ops::cpu {

// x [rows, cols] f32 / f64 (any strides) into out.q and out.scale_inv (allocated; out.recipe
// set). Throws hlm::Error naming the first non-finite element (found while it reads the tiles).
void fp8_quantize(const Tensor& x, Fp8Tensor& out);
void fp8_dequantize(const Fp8Tensor& t, Tensor& out);  // out [rows, cols] f32
void fp8_values(const Fp8Tensor& t, Tensor& out);      // out [rows, cols] f32
// t.q [C, pad128(R)] and t.scale_inv (allocated; t.recipe set) from w quantized 128x128.
void fp8_transpose_blocks(const Fp8Tensor& w, Fp8Tensor& t);
void fp8_gemm_tn(const Fp8Tensor& a, const Fp8Tensor& b, Tensor& c);  // c [M, N] f32

}  // namespace hlm::ops::cpu
