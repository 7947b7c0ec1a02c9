// Cross-entropy from logits, mean over the tokens that are not ignored:
//   lse_t  = log sum_v exp(logits[t, v])        (max-subtracted)
//   loss_t = lse_t - logits[t, target_t]         (0 for target_t == ignore_index)
//   loss   = sum_t loss_t / count,  count = #{t : target_t != ignore_index}
//   dlogits[t, v] = dloss * (softmax(logits_t)_v - [v == target_t]) / count,  0 on ignored rows
// logits [T, V] f32 or f64; targets [T] i64 or i32, each in [0, V) or == ignore_index (else an
// error naming the position and value). With count == 0 the loss is 0 and dlogits is 0 (not NaN).
// Per-row work is in the logits' dtype; the mean is summed in FP64 in token order.
// CUDA (ops/cuda/cross_entropy.cu): logits f32, f64 or bf16 (any strides). bf16 logits compute in
// f32: row_loss and lse are f32 and dlogits is bf16; otherwise all are in the logits' dtype (the
// computation dtype, compute_dtype in core/dtype.h, in every case). Targets are checked on the
// device (bad targets get the CPU's message). One block per row with a fixed-order block
// reduction (bit-identical run to run; within FP32 rounding of the CPU, whose sums run in another
// order); the row losses are copied to the host and summed there in FP64 in token order.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace hlm::ops {

struct CrossEntropyResult {
  double loss = 0;    // mean over non-ignored tokens
  int64_t count = 0;  // number of non-ignored tokens
  Tensor row_loss;    // [T], computation dtype of logits (f32 for bf16); 0 on ignored rows
  Tensor lse;         // [T], log-sum-exp per row (same dtype), saved for backward
  int64_t ignore_index = -100;
};

CrossEntropyResult cross_entropy_forward(const Tensor& logits, const Tensor& targets,
                                         int64_t ignore_index = -100);
// Returns dlogits [T, V] (the logits' dtype) for d(loss)/d(loss) = dloss. mean_count > 0: the
// rows are a chunk of a larger batch whose mean divides by mean_count (>= the chunk's count), so
// dlogits = dloss (softmax - onehot) / mean_count, each row the whole batch's.
Tensor cross_entropy_backward(const Tensor& logits, const Tensor& targets,
                              const CrossEntropyResult& saved, double dloss = 1.0,
                              int64_t mean_count = 0);

}  // namespace hlm::ops
