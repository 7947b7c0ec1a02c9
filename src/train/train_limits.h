// The limits of a training config and the memory a training run needs, checked before the run
// directory is created or anything large is allocated (docs/robustness.md, "Limits").
#pragma once

#include <cstdint>
#include <string>

#include "model/config_limits.h"
#include "train/trainer.h"

namespace hlm::train {

namespace limits {
inline constexpr int64_t kMaxSteps = 1'000'000'000;             // steps and step counts
inline constexpr int64_t kMaxTokensPerStep = int64_t(1) << 24;  // tokens_per_step, seq_len
inline constexpr int64_t kMaxEvalBatches = 100'000;             // eval_batches
}  // namespace limits

// Every count of `c` within its bound (steps, warmup_steps, decay_steps, the intervals,
// dsa_dense_warmup_steps: kMaxSteps; tokens_per_step, seq_len: kMaxTokensPerStep;
// eval_batches: kMaxEvalBatches), then the model's limits and the memory estimate of one training
// step against the memory limit. hlm::Error naming the key, its value and the bound.
void check_train_limits(const TrainConfig& c, const ModelConfig& model,
                        const std::string& what = "training config");

// The workload of one training step of `c` (model/config_limits.h).
Workload training_workload(const TrainConfig& c, const ModelConfig& model);

}  // namespace hlm::train
