// CUDA side of AdamW (train/adamw.h) for parameters held on a GPU: the sums of squares of the
// gradient-norm blocks and the elementwise update, with the CPU's arithmetic (FP64 per element,
// no contraction into FMA: every product and sum rounded on its own, as the CPU's x86-64 code
// does), so a parameter on either device gets the same bits. Launchers only; reach them through
// HLM_CUDA_PATH (ops/dispatch.h).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace hlm::train::cuda {

// The sum of squares (in FP64, elements in order) of each block of `block` consecutive elements of
// the f32 / f64 gradients gs (contiguous, on the device), one entry per block, the tensors' blocks
// one after the other, on the host. One launch for all tensors: a warp per block, loading 256
// elements at a time (coalesced) and adding them in element order (every lane the same sum).
std::vector<double> block_sum_squares(const std::vector<const Tensor*>& gs, int64_t block);

// One parameter of the update: master w, moments m and v (f32 or f64, one dtype, contiguous, on
// the device), its gradient g (f32 or f64, contiguous), n elements, its decay factor.
struct UpdateSlot {
  void *w, *m, *v;
  const void* g;
  int64_t n;
  double decay_mul;
  int64_t m_f64, g_f64;  // 1: the dtype is f64, 0: f32
};
// The step's scalars: the clip scale, betas, learning rate, bias corrections and eps.
struct UpdateStep {
  double scale, b1, b2, lr, bc1, bc2, eps;
};
// The AdamW update of adamw.h on every slot, in one launch (a block per 8192 elements of one
// parameter).
void adamw_update(const std::vector<UpdateSlot>& slots, const UpdateStep& step);

}  // namespace hlm::train::cuda
