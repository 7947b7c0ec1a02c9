// The CPU reference of the sparse MLA attention (ops/dsa_sparse_attention.h). The front door
// (ops/dsa_sparse_attention.cpp) checks the arguments, turns the selection into a pattern
// (ops/dsa_common.h) and allocates the outputs; tensors are contiguous, f32 or f64, one dtype.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "ops/dsa_common.h"

namespace hlm::ops::cpu {

// out [T, H, d_v], lse [T, H].
void sparse_attention(const Tensor& q, const Tensor& kv, const dsa_detail::Pattern& p, int64_t d_v,
                      double scale, Tensor& out, Tensor& lse);
// dq [T, H, D_qk], dkv [T, D_qk] written.
void sparse_attention_backward(const Tensor& q, const Tensor& kv, const dsa_detail::Pattern& p,
                               int64_t d_v, double scale, const Tensor& out, const Tensor& lse,
                               const Tensor& d_out, Tensor& dq, Tensor& dkv);

}  // namespace hlm::ops::cpu
