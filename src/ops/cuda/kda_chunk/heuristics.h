// Launch planning of the CUDA chunked KDA kernels (params.cuh): the V tile of the sequential
// state passes and the precision of each stage's bf16 products. Plain C++, so that the kernel lab
// (bench/kda_lab/) can show and vary the choices.
#pragma once

#include <cstdint>

#include "ops/cuda/kda_chunk/params.cuh"

namespace hlm::ops::cuda::kda {

// The V tile (32 or 64) of the sequential state passes, forward and reverse, on a device of `sms`
// multiprocessors: 64-wide V tiles (half the operand traffic of 32) when they still give every SM
// a block.
inline int state_tile(const Plan& p, int sms) {
  return p.V % 64 == 0 && p.N * p.HV * (p.V / 64) >= sms ? 64 : 32;
}

// The stages of the chunked forward and backward. With bf16 inputs each stage's products run in
// plain TF32 or in 3xTF32 (mma_tf32.cuh); both are compiled, and the launchers take the set of
// TF32 stages as a bit mask (bit 1 << stage). KdaArgs::exact_bf16_products takes 3xTF32
// everywhere; otherwise the stages of kTf32Stages take TF32. The intra backward keeps 3xTF32: in
// TF32 it alone put dg 8.2e-3 and dA_log / d dt_bias 3e-2 to 4e-2 from the FP32 path, while TF32
// in all the other stages together stays within 4.2e-4 (bench/kda_chunk_notes.md; the study is
// bench/kda_lab/kda_tf32_study.cpp).
enum KdaStage : int {
  kStageIntra = 0,     // forward intra kernel (A_qk, A_kk, W, U), also in the recompute
  kStageState = 1,     // forward state pass, also in the recompute
  kStageStateBwd = 2,  // reverse state pass
  kStageProducts = 3,  // backward contractions over V (dA_qk, dq, dk, dW)
  kStageWy = 4,        // WY backward
  kStageIntraBwd = 5,  // intra backward
};
inline constexpr unsigned kTf32Stages = 0x1fu;  // every stage but the intra backward

// The TF32 stages of a call.
inline unsigned tf32_stages(bool exact_bf16_products) {
  return exact_bf16_products ? 0u : kTf32Stages;
}

}  // namespace hlm::ops::cuda::kda
