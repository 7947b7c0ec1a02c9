// The CPU reference of the token picks (ops/token_pick.h). The front door (ops/token_pick.cpp)
// checks the arguments; logits [R, V] f32 or f64 contiguous, outputs allocated.
#pragma once

#include <vector>

#include "core/tensor.h"
#include "ops/token_pick.h"

namespace hlm::ops::cpu {

// One row's pick (the row's loops; ops::pick_host_row is the front door of a single row).
template <class T>
RowPick pick_row(const T* x, int64_t V, const SampleRow& p);
// The row's log-probability of `token` (score_tokens).
template <class T>
RowPick score_row(const T* x, int64_t V, int64_t token);

void greedy_pick(const Tensor& logits, TokenPick& out);
void sample_pick(const Tensor& logits, const std::vector<SampleRow>& rows, TokenPick& out);
void score_tokens(const Tensor& logits, const std::vector<int64_t>& tokens, TokenPick& out);

}  // namespace hlm::ops::cpu
