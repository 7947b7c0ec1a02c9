// The CPU reference of the greedy pick (ops/greedy.h). The front door (ops/greedy.cpp) checks the
// arguments; logits [R, V] f32 or f64 contiguous, outputs allocated.
#pragma once

#include "core/tensor.h"
#include "ops/greedy.h"

namespace hlm::ops::cpu {

void greedy_pick(const Tensor& logits, GreedyPick& out);

}  // namespace hlm::ops::cpu
