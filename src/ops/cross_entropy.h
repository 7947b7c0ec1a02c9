// Cross-entropy from logits, mean over the tokens that are not ignored:
//   lse_t  = log sum_v exp(logits[t, v])        (max-subtracted)
//   loss_t = lse_t - logits[t, target_t]         (0 for target_t == ignore_index)
//   loss   = sum_t loss_t / count,  count = #{t : target_t != ignore_index}
//   dlogits[t, v] = dloss * (softmax(logits_t)_v - [v == target_t]) / count,  0 on ignored rows
// logits [T, V] f32 or f64; targets [T] i64 or i32, each in [0, V) or == ignore_index (else an
// error naming the position and value). With count == 0 the loss is 0 and dlogits is 0 (not NaN).
// Per-row work is in the logits' dtype; the mean is summed in FP64 in token order.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace hlm::ops {

struct CrossEntropyResult {
  double loss = 0;    // mean over non-ignored tokens
  int64_t count = 0;  // number of non-ignored tokens
  Tensor row_loss;    // [T], dtype of logits; 0 on ignored rows
  Tensor lse;         // [T], log-sum-exp per row, saved for backward
  int64_t ignore_index = -100;
};

CrossEntropyResult cross_entropy_forward(const Tensor& logits, const Tensor& targets,
                                         int64_t ignore_index = -100);
// Returns dlogits [T, V] for d(loss)/d(loss) = dloss.
Tensor cross_entropy_backward(const Tensor& logits, const Tensor& targets,
                              const CrossEntropyResult& saved, double dloss = 1.0);

}  // namespace hlm::ops
