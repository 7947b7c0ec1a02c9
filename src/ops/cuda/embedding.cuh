// The CUDA side of the embedding (ops/embedding.h): host interface, includable from C++. The front
// door (ops/embedding.cpp) checks the arguments (every id in [0, V) on the device, with
// ops/cuda/index_check.cuh) and allocates the output; ids are i64 or i32 and contiguous, table
// and dy contiguous, dtable contiguous. Default stream.
#pragma once

#include "core/tensor.h"

namespace hlm::ops::cuda {

// out [n, D] (any leading shape of n rows) = table[ids[t]]: rows copied bit-exactly, any dtype.
void embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out);
// dtable [V, D] (f32 / f64) += dy [n, D] rows: each touched row adds its tokens in increasing t
// order, the CPU reference's order (the same bits).
void embedding_backward(const Tensor& dy, const Tensor& ids, Tensor& dtable);

}  // namespace hlm::ops::cuda
