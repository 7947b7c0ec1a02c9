// The CPU reference of the cross-entropy (ops/cross_entropy.h). The front door
// (ops/cross_entropy.cpp) checks the arguments (tg: the checked targets) and allocates the
// outputs; logits and lse are contiguous, f32 or f64.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/cross_entropy.h"

namespace hlm::ops::cpu {

// Fills out.row_loss, out.lse (allocated), out.loss and out.count.
void cross_entropy_forward(const Tensor& logits, const std::vector<int64_t>& tg,
                           CrossEntropyResult& out);
// dlogits [T, V]; count: the non-ignored targets.
void cross_entropy_backward(const Tensor& logits, const std::vector<int64_t>& tg, const Tensor& lse,
                            int64_t ignore_index, int64_t count, double dloss, Tensor& dlogits);

}  // namespace hlm::ops::cpu
