// The CPU reference of the KPool ops (ops/dsa_kpool.h). The front door (ops/dsa_kpool.cpp) checks
// the arguments (cu: checked cu_seqlens) and allocates the outputs; tensors are contiguous, f32 or
// f64, one dtype.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/dsa_common.h"
#include "ops/dsa_kpool.h"

namespace hlm::ops::cpu {

// pooled [NP, d] from k, gate [T, d] and ape [P, d].
void kpool_compress(const Tensor& k, const Tensor& gate, const Tensor& ape,
                    const std::vector<int64_t>& cu, Tensor& pooled);
// g.dk, g.dgate, g.dape written.
void kpool_compress_backward(const Tensor& k, const Tensor& gate, const Tensor& ape,
                             const std::vector<int64_t>& cu, const Tensor& d_pooled,
                             KPoolCompressGrads& g);
// indices i32 [T, K (+ P - 1 with the tail)] from the selected pools i32 [T, K / P].
// (The window's queries, ops/dsa_common.h.)
void kpool_select_indices(const Tensor& pools, const dsa_detail::QueryWindow& w, int64_t K,
                          int64_t P, bool always_select_tail, Tensor& indices);
// out [T, Wp] from the dense token target [T, Wt] (the window's queries).
void kpool_pool_target_dense(const Tensor& token_target, const dsa_detail::QueryWindow& w,
                             int64_t P, Tensor& out);
// out [T, G] from the token target in the selection's layout; pools: the G pool ids of each row.
void kpool_pool_target_sparse(const Tensor& token_target, const std::vector<int64_t>& pools,
                              int64_t P, Tensor& out);

}  // namespace hlm::ops::cpu
