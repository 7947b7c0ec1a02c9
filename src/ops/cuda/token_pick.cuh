// The CUDA side of the token picks (ops/token_pick.h): host interface, includable from C++. The
// front door (ops/token_pick.cpp) checks the arguments (logits [R, V] f32 / f64 / bf16
// contiguous, R >= 1, the sampling rows) and allocates the outputs on the device. Default stream;
// nothing is read back (sample_pick copies the rows' settings to the device).
#pragma once

#include <vector>

#include "core/tensor.h"
#include "ops/token_pick.h"

namespace hlm::ops::cuda {

void greedy_pick(const Tensor& logits, TokenPick& out);
void sample_pick(const Tensor& logits, const std::vector<SampleRow>& rows, TokenPick& out);
void score_tokens(const Tensor& logits, const std::vector<int64_t>& tokens, TokenPick& out);

}  // namespace hlm::ops::cuda
