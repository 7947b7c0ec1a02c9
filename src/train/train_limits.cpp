#include "train/train_limits.h"

#include <algorithm>

#include "core/error.h"

namespace hlm::train {

namespace {
void bound(int64_t v, int64_t max, const char* key, const std::string& what) {
  HLM_CHECK(v <= max, "{}: '{}' is {}, more than the limit of {}", what, key, v, max);
}
}  // namespace

Workload training_workload(const TrainConfig& c, const ModelConfig& model) {
  Workload w;
  w.tokens = c.tokens_per_step;
  // MQAR documents are at most 4 * max_pairs tokens; token streams cut windows of seq_len.
  if (c.data_path.empty())
    w.max_seq_len = std::min(c.tokens_per_step, 4 * std::max<int64_t>(c.mqar.max_pairs, 1));
  else
    w.max_seq_len = c.seq_len > 0 ? std::min(c.seq_len, c.tokens_per_step) : c.tokens_per_step;
  w.training = true;
  w.optimizer = true;
  w.dtype = c.dtype;
  w.mtp = c.mtp && model.mtp.num_layers > 0;
  w.dense_attention = c.dsa_dense_warmup_steps != 0;
  return w;
}

void check_train_limits(const TrainConfig& c, const ModelConfig& model, const std::string& what) {
  using namespace limits;
  bound(c.steps, kMaxSteps, "steps", what);
  bound(c.warmup_steps, kMaxSteps, "warmup_steps", what);
  bound(c.decay_steps, kMaxSteps, "decay_steps", what);
  bound(c.eval_interval, kMaxSteps, "eval_interval", what);
  bound(c.log_interval, kMaxSteps, "log_interval", what);
  bound(c.checkpoint_interval, kMaxSteps, "checkpoint_interval", what);
  bound(c.dsa_dense_warmup_steps, kMaxSteps, "dsa_dense_warmup_steps", what);
  bound(c.tokens_per_step, kMaxTokensPerStep, "tokens_per_step", what);
  bound(c.seq_len, kMaxTokensPerStep, "seq_len", what);
  bound(c.eval_batches, kMaxEvalBatches, "eval_batches", what);
  bound(c.mqar.max_pairs, kMaxTokensPerStep, "mqar.max_pairs", what);
  check_memory_for(model, training_workload(c, model),
                   fmt::format("{}: a training step of {} tokens", what, c.tokens_per_step));
}

}  // namespace hlm::train
