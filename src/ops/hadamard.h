// The normalised Walsh-Hadamard transform of the last dimension:
//   y = x H_d / sqrt(d),  H_1 = [1],  H_2n = [[H_n, H_n], [H_n, -H_n]] (Sylvester)
// x [..., d], d a power of two (any number of leading rows). H_d / sqrt(d) is symmetric and
// orthogonal, so the backward (dx = dy H_d / sqrt(d)) is the same transform. Computed by
// butterflies of stride 1, 2, 4, ... ((a, b) -> (a + b, a - b)), then one multiplication by
// 1 / sqrt(d) rounded to the computation dtype; the CPU and CUDA run the same sequence, so f32 /
// f64 results agree bit for bit. CPU: f32 / f64. CUDA (ops/cuda/hadamard.cu): also bf16,
// computed in f32 (f64 for f64).
#pragma once

#include "core/tensor.h"

namespace hlm::ops {

// Returns the transformed copy of x.
Tensor hadamard(const Tensor& x);
// Transforms x (contiguous) in place.
void hadamard_inplace(Tensor& x);

}  // namespace hlm::ops
