// cu_seqlens: the sequence boundaries of a packed [T, ...] batch (FlashAttention convention).
// Sequence n holds tokens [cu[n], cu[n+1]). Every op that looks along the sequence validates its
// cu_seqlens with check_cu_seqlens and restarts at each boundary.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace hlm::ops {

// Validates `cu_seqlens` (a 1-D i64 or i32 tensor [N+1], N >= 0 sequences; CPU or CUDA) against
// `total_tokens` = T and returns its values: it must start at 0, be non-decreasing (zero-length
// sequences are allowed) and end at T. Throws hlm::Error naming `what` and the problem.
std::vector<int64_t> check_cu_seqlens(const Tensor& cu_seqlens, int64_t total_tokens,
                                      const char* what = "cu_seqlens");

// The same checks on values already on the host.
void check_cu_seqlens(const std::vector<int64_t>& cu, int64_t total_tokens,
                      const char* what = "cu_seqlens");

// A cu_seqlens tensor (i64, CPU) from sequence lengths: {3, 0, 2} -> [0, 3, 3, 5].
Tensor cu_seqlens_from_lengths(const std::vector<int64_t>& lengths);

}  // namespace hlm::ops
