// The greedy choice of every row of logits, where the logits are (a decode step's sampling for
// greedy requests: only the choices cross to the host, not the [R, V] logits):
//   token_r   = the largest logit of row r, ties to the lowest id
//   logprob_r = x_{r, token} - (m + log sum_v exp(x_{r,v} - m)),  m = x_{r, token}     in FP64
//   bad_r     = the first id whose logit is NaN or infinite, -1 when none (then token and logprob
//               are meaningless: the caller reports the bad logit)
// as infer::sample_token computes them for a greedy request (FP64 from the stored values). The CPU
// sums each row in id order (the bits of sample_token); CUDA sums in a fixed tree (one block per
// row), so its log-probabilities differ from the CPU's in FP64 rounding only.
#pragma once

#include "core/tensor.h"

namespace hlm::ops {

struct GreedyPick {
  Tensor token;    // [R] i64
  Tensor logprob;  // [R] f64
  Tensor bad;      // [R] i64
};

// logits [R, V] (V >= 1): f32 or f64 on the CPU, also bf16 on CUDA. Outputs on the logits' device.
GreedyPick greedy_pick(const Tensor& logits);

}  // namespace hlm::ops
