// The CUDA side of the greedy pick (ops/greedy.h): host interface, includable from C++. The front
// door (ops/greedy.cpp) checks the arguments (logits [R, V] f32 / f64 / bf16 contiguous, R >= 1)
// and allocates the outputs on the device. Default stream; nothing is read back.
#pragma once

#include "core/tensor.h"
#include "ops/greedy.h"

namespace hlm::ops::cuda {

void greedy_pick(const Tensor& logits, GreedyPick& out);

}  // namespace hlm::ops::cuda
