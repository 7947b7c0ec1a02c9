// The CPU reference of the KDA decode step (ops/kda_decode.h). Inputs are checked by the front
// door (ops/kda_decode.cpp): contiguous, q / k / v f32 or bf16 (read as f32), g / beta / state f32;
// slots[n]: the state row of sequence n (< 0: skipped, its o rows zero); scale resolved. o
// [N, HV, V] f32 is allocated by the front door; the state is updated in place.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/kda_decode.h"

namespace hlm::ops::cpu {

void kda_decode_step(const KdaDecodeArgs& a, const std::vector<int64_t>& slots, double scale,
                     Tensor& o);

}  // namespace hlm::ops::cpu
