// The CUDA side of the cross-entropy (ops/cross_entropy.h): host interface, includable from C++.
// The front door (ops/cross_entropy.cpp) checks the arguments (every target on the device, with
// ops/cuda/index_check.cuh, which also counts the non-ignored ones) and allocates the outputs.
// logits [T, V] f32 / f64 / bf16 contiguous; targets [T] i64 / i32 contiguous; lse and row_loss
// [T] in the computation dtype (f64 for f64, else f32); dlogits in the logits' dtype. Default
// stream.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "ops/cross_entropy.h"

namespace hlm::ops::cuda {

// Fills out.row_loss and out.lse (allocated), and out.loss = the FP64 sum of row_loss in token
// order / count (0 when count == 0), out.count = count. Copies row_loss to the host (synchronous).
void cross_entropy_forward(const Tensor& logits, const Tensor& targets, int64_t count,
                           CrossEntropyResult& out);
// dlogits [T, V] = dloss / count (softmax - one_hot), zero rows where ignored (all when count ==
// 0).
void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            int64_t ignore_index, int64_t count, double dloss, Tensor& dlogits);

}  // namespace hlm::ops::cuda
