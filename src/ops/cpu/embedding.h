// The CPU reference of the embedding (ops/embedding.h). The front door (ops/embedding.cpp) checks
// the arguments (id: the checked ids, flat) and allocates the output; tensors are contiguous.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace hlm::ops::cpu {

// out [n, D] (any leading shape of n rows) = table[id[t]], rows copied bit-exactly.
void embedding_forward(const Tensor& table, const std::vector<int64_t>& id, Tensor& out);
// dtable [V, D] (f32 / f64) += dy rows, in token order.
void embedding_backward(const Tensor& dy, const std::vector<int64_t>& id, Tensor& dtable);

}  // namespace hlm::ops::cpu
