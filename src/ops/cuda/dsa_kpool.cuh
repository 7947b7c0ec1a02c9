// The CUDA side of the KPool compression (ops/dsa_kpool.h): host interface of dsa_kpool.cu,
// includable from C++. The front door (ops/dsa_kpool.cpp) checks the arguments and allocates the
// outputs. Tensors are contiguous CUDA tensors: k, gate, d_pooled, pooled, dk, dgate in one dtype
// (f32, f64 or bf16); ape and dape in k's dtype, or f32 when k is bf16. Arithmetic in f32 (f64 for
// f64). Kernels run on the default stream.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/dsa_kpool.h"

namespace hlm::ops::cuda {

// pooled [NP, d] from k, gate [T, d] and ape [P, d]; cu: checked cu_seqlens.
void kpool_compress(const Tensor& k, const Tensor& gate, const Tensor& ape,
                    const std::vector<int64_t>& cu, Tensor& pooled);
// g.dk, g.dgate [T, d] (zero outside complete pools) and g.dape [P, d] written.
void kpool_compress_backward(const Tensor& k, const Tensor& gate, const Tensor& ape,
                             const std::vector<int64_t>& cu, const Tensor& d_pooled,
                             KPoolCompressGrads& g);

}  // namespace hlm::ops::cuda
