// The CUDA side of the KDA decode step (ops/kda_decode.h): host interface of kda_decode.cu,
// includable from C++. The front door (ops/kda_decode.cpp) checks the arguments (contiguous CUDA
// tensors; q / k / v f32 or bf16, g / beta / state f32), resolves the state slots (slots[n] < 0:
// sequence n skipped, its o rows zero) and the scale, and allocates o [N, HV, V] f32; the state
// is updated in place. K must be 32, 64, 128 or 256. Synchronises before returning.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/kda_decode.h"

namespace hlm::ops::cuda {

void kda_decode_step(const KdaDecodeArgs& a, const std::vector<int64_t>& slots, double scale,
                     Tensor& o);

}  // namespace hlm::ops::cuda
