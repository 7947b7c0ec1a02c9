// The training loop: a HybridModel trained with AdamW on MQAR (or a text / .bin token stream),
// with evaluation, metrics, atomic checkpoints and bit-exact resume. docs/training.md, "The
// training loop", describes the training config, the checkpoint layout and the guarantees.
//
// One update s = 1..steps (docs/training.md, "Steps are counted from 1"):
//   batch   = source.batch(s)                                    a pure function of (seed, s)
//   stage   = s <= dsa_dense_warmup_steps ? dense_warmup : sparse  (model.set_dsa_stage)
//   zero_grad; out = forward(Context{training}, tokens, cu_seqlens, targets); check out.loss
//   backward; r = AdamW.step(lr(s)) (global-norm clip); check r.grad_norm
//   update_moe_bias(out.expert_counts)                           only when the update was applied
// A non-finite loss or gradient norm stops the run (hlm::Error naming the step) or, with
// nonfinite = "skip", skips the step: no update, no bias update, the optimizer's step count stays.
// Evaluation (Context{training = false}) every eval_interval steps and after the last step;
// metrics every log_interval steps; a checkpoint every checkpoint_interval steps and at the end.
//
// Checkpoint (in the run directory, docs/training.md):
//   trainer_state.safetensors   the commit point, self-contained: AdamW state ("optimizer.*",
//                               the FP32 masters restore the weights bit-exactly) + metadata:
//                               step, the resolved training config (model config inline), ...
//   model.safetensors, config.json   the weights in the HF layout (save_module)
//   train_config.json           the resolved training config (readable; usable as --config)
// Every file is written atomically (temporary, fsync, rename); the trainer state first, so a
// crash at any moment leaves a loadable checkpoint: the previous one or the new one. Each
// safetensors file carries a checksum that resuming verifies (core/safetensors.h).
// The run holds the directory's lock (train/run_lock.h) from before it reads or writes anything
// there to its end; its limits and memory estimate (train/train_limits.h) are checked in the
// constructor, before the directory is created.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "dist/comm.h"
#include "model/hybrid_model.h"
#include "train/adamw.h"
#include "train/data.h"
#include "train/data_parallel.h"
#include "train/metrics.h"
#include "train/run_lock.h"
#include "train/schedule.h"

namespace hlm::train {

enum class NonfinitePolicy : uint8_t { stop, skip };
NonfinitePolicy parse_nonfinite_policy(const std::string& s);  // "stop" | "skip"
const char* nonfinite_policy_name(NonfinitePolicy p);

// The training config (JSON; docs/training.md lists every key). Unknown keys are errors.
struct TrainConfig {
  // ---- model ----
  // The model config, parsed once from the JSON key "model" (a config.json path or an inline
  // object) with the key "model_overrides" (a list of "key=value" strings) applied first.
  // to_json() writes it inline (ModelConfig::to_json) and no overrides.
  ModelConfig model;
  std::string model_source;  // where it came from: a path, or "inline" (informational)
  DType dtype = DType::f32;  // parameter dtype: f32, bf16 (FP32 masters) or f64
  Recompute recompute = Recompute::none;
  bool mtp = true;  // build the MTP block when the model config has one

  // ---- run ----
  int64_t steps = 300;  // total optimizer updates
  int64_t tokens_per_step = 1024;
  uint64_t seed = 0;  // model initialisation and data

  // ---- optimizer and schedule ----
  ScheduleKind schedule = ScheduleKind::cosine;
  double lr = 3e-3;
  int64_t warmup_steps = 20;
  double min_lr_ratio = 0.1;
  int64_t decay_steps = 0;  // the cosine's horizon S; 0: steps
  AdamWConfig adamw;        // beta1, beta2, eps, weight_decay, grad_clip (max_grad_norm)

  // ---- evaluation, logging, checkpoints (0: off; the end of the run always evaluates and
  // checkpoints) ----
  int64_t eval_interval = 100;
  int64_t eval_batches = 4;
  int64_t log_interval = 10;
  int64_t checkpoint_interval = 100;

  // ---- model-specific schedule and policies ----
  int64_t dsa_dense_warmup_steps = 0;  // steps 1..W run the DSA dense warm-up stage (-1: all)
  NonfinitePolicy nonfinite = NonfinitePolicy::stop;

  // ---- data ----
  std::string data_path;  // "": MQAR; else a text file or a .bin of uint32 ids
  MqarConfig mqar;        // vocab_size 0: the model's; num_keys 0: vocab_size / 2; the
                          // tokens_per_step, eval_batches and seed fields are taken from above
  int64_t seq_len = 0;    // token streams: window length (0: tokens_per_step)
  bool shuffle = true;    // token streams
  // "": a text file is byte tokens; else the Hugging Face tokenizer.json (or its directory) that
  // encodes the text file (tokenizer/tokenizer.h)
  std::string tokenizer_path;

  // Parses a training config. Relative model paths are resolved against `base_dir` (the directory
  // of the file the config came from; "" = the current directory). `what` names the source.
  // Errors (hlm::Error) name the key: unknown keys, wrong types, out-of-range values.
  static TrainConfig from_json(const nlohmann::json& j, const std::string& what = "training config",
                               const std::string& base_dir = "");
  // Every key, resolved (the model config inline): from_json(to_json()) gives an equal config.
  nlohmann::json to_json() const;

  MqarConfig mqar_config() const;  // mqar with the defaults resolved against the model
  ScheduleConfig schedule_config() const;
  void validate(const std::string& what = "training config") const;
};

// The keys of a training config (from_json() also accepts "model_overrides" and "_comment"-style
// keys); split_overrides() routes a --set key whose first component is one of them here.
const std::vector<std::string>& train_config_keys();

// Reads a training-config file (JSON; a bad file is an error naming it).
nlohmann::json read_train_config_file(const std::string& path);

// `--set key=value` routing: a key whose first dotted component is a training key (other than
// "model") overrides the training config; "model.X" and any other key override the model config.
// model overrides are applied with hlm::apply_overrides after the model config is loaded.
struct SplitOverrides {
  std::vector<std::string> train, model;
};
SplitOverrides split_overrides(const std::vector<std::string>& key_values);

// Builds a training config from its JSON form and overrides: training overrides first (so
// "model=path" can pick the model file), then the model config (a path is read, relative to
// base_dir), then the model overrides, then `adjust` (typed settings that win over the file and
// the overrides, e.g. the command line's --steps), then validate(). Errors name the override or
// the key.
TrainConfig make_train_config(nlohmann::json j, const std::vector<std::string>& overrides,
                              const std::string& what, const std::string& base_dir,
                              const std::function<void(TrainConfig&)>& adjust = {});

// ---- the trainer ----------------------------------------------------------------------------

// Test hooks (all optional).
struct TrainerHooks {
  // After backward, before the optimizer step (e.g. to poison a gradient).
  std::function<void(int64_t step, HybridModel& model)> after_backward;
  // After each temporary checkpoint file is written and fsynced, before it is renamed.
  std::function<void(const std::string& tmp_path)> after_temp_written;
  // After the checkpoint of `step` is complete.
  std::function<void(int64_t step)> after_checkpoint;
};

struct TrainerOptions {
  std::string out_dir = "runs/mqar";
  bool resume = false;  // continue the run in out_dir (its trainer_state.safetensors)
  // Stop (with a checkpoint) after this step, as if interrupted; 0 writes the checkpoint of the
  // initialised model (step 0) and trains nothing. Unset: train to cfg.steps.
  std::optional<int64_t> stop_after;
  // Catch SIGINT / SIGTERM during run() (train/interrupt.h): finish the step, checkpoint, return
  // with TrainSummary::interrupted_by set. The command turns it on; a library caller may too.
  bool handle_signals = false;
  // Where the steps run: the model is built (and a resumed run read) on the CPU, then the model
  // and the optimizer state move to this device for the steps; checkpoints are written from host
  // copies, so a run may resume on either device.
  Device device = Device::cpu;
  std::FILE* log = stdout;  // messages and the progress line; nullptr: silent
  ProgressBar::Mode progress = ProgressBar::Mode::automatic;
  bool plot = true;           // write the plot at the end
  bool print_summary = true;  // the final summary on `log`
  TrainerHooks hooks;
  // The processes that train together (train/data_parallel.h), e.g. &dist::world() under mpirun;
  // nullptr or a group of one: this process alone. With N > 1 every rank runs the same config
  // on its part of each global batch; rank 0 alone writes the run directory (logs, metrics,
  // checkpoints) and evaluates, the others are silent. On CUDA each rank takes GPU
  // dist::local_rank() % count and the gradients and values move over NCCL.
  dist::Comm* comm = nullptr;
  // Expert parallelism (train/data_parallel.h, ExpertGroups): every MoE layer's routed experts
  // split over groups of this many processes (1: each process holds every expert). It must
  // divide the number of processes and every MoE layer's expert count. Checkpoints keep the
  // one-process layout, so a run resumes with any degree.
  int expert_parallel = 1;
  // Context parallelism (docs/parallel.md, "In the trainer"): each part of the global batch is
  // split along its tokens over a group of this many consecutive processes (1: none), the KDA
  // layers in cp_mode; data parallel over the N / context_parallel groups. It must divide the
  // number of processes; the model must have no DSA / MLA layers and train no MTP block (they do
  // not run context parallel yet). Checkpoints keep the one-process layout.
  int context_parallel = 1;
  KdaCpMode cp_mode = KdaCpMode::chunkwise;
  // Tensor parallelism (docs/parallel.md, "In the trainer"): every attention layer's heads and
  // every dense MLP's channels split over groups of this many consecutive processes
  // (HybridModelOptions::tensor_comm), the ranks of a group running the group's part of the
  // global batch; data parallel over the N / tensor_parallel groups. It must divide the number of
  // processes, the KDA and MLA heads and the dense MLPs' intermediate size. Expert groups are
  // then made of the data-parallel ranks of one tensor-parallel rank; not with context
  // parallelism yet. Checkpoints keep the one-process layout.
  int tensor_parallel = 1;
};

struct EvalResult {
  bool has_accuracy = false;  // MQAR
  Accuracy accuracy;
  double loss = 0;  // mean main CE over the evaluated targets
  int64_t targets = 0;
};

struct TrainSummary {
  int64_t start_step = 0;  // the step the run began at (the checkpoint's when resumed)
  int64_t end_step = 0;
  int64_t skipped_steps = 0;  // non-finite steps skipped in the whole run (with the resumed part)
  double final_loss = 0;      // main CE of the last step
  EvalResult eval;            // the final evaluation
  double chance_accuracy = 0;
  double tokens_per_s = 0;  // training tokens / training time, this process
  double wall_s = 0;        // this process
  int64_t tokens = 0;       // trained in this process (the global batches' tokens)
  int processes = 1;        // data-parallel processes
  // On CUDA: the most device memory the allocator had in use during any step of this process
  // (0 on the CPU). Each step's own peak is in the metrics ("peak_device_gib").
  uint64_t peak_device_bytes = 0;
  std::string out_dir, weights, config, metrics, plot;
  int interrupted_by = 0;  // the signal that stopped the run (handle_signals), else 0
};

// The state a checkpoint directory holds (what resuming reads), verified.
struct TrainerCheckpoint {
  int64_t step = 0;
  int64_t skipped_steps = 0;
  nlohmann::json train_config;  // TrainConfig::to_json() of the run
  safetensors::Contents state;  // optimizer tensors + metadata
};
// Reads DIR/trainer_state.safetensors. hlm::Error with a clear message when the directory holds
// no checkpoint or the file is damaged or inconsistent, or when another process holds the
// directory's lock (a run still writing there); check_lock false skips that check (the ranks of a
// data-parallel job other than 0, whose rank 0 holds the lock for the job).
TrainerCheckpoint read_trainer_checkpoint(const std::string& dir, bool check_lock = true);
inline constexpr const char* kTrainerStateFile = "trainer_state.safetensors";
inline constexpr const char* kTrainConfigFile = "train_config.json";
inline constexpr const char* kMetricsFile = "metrics.jsonl";

class Trainer {
 public:
  // A fresh run (opts.resume false: out_dir may exist; its checkpoint files are replaced) or a
  // resumed one (the state of out_dir is loaded: cfg.model must equal the checkpoint's model
  // config; other settings may differ, e.g. steps).
  Trainer(const TrainConfig& cfg, const TrainerOptions& opts);
  ~Trainer();

  // Trains to cfg.steps (or opts.stop_after), evaluates and checkpoints; returns the summary.
  TrainSummary run();
  // The held-out evaluation (MQAR: eval batches; token streams: batch(0), see docs).
  EvalResult evaluate();
  // Writes the checkpoint of the current step.
  void save();

  const TrainConfig& config() const { return cfg_; }
  HybridModel& model() { return *model_; }
  AdamW& optimizer() { return *opt_; }  // with N > 1 processes: this rank's shard
  int64_t step() const { return step_; }
  const DataSource& data() const { return *data_; }
  double chance_accuracy() const;  // MQAR; 0 for token streams

 private:
  void log(const std::string& line) const;
  void resume_from_checkpoint();
  void move_to_device();  // model and optimizer state to opts_.device
  void write_param_list() const;
  // The shape of parameter `name` in the whole model: an expert weight split over the expert
  // group has ep times the rows this rank holds, a tensor-parallel part the group's size times
  // its split dimension.
  Shape whole_shape(const std::string& name, const Param& p) const;
  // The text file cfg_.data_path encoded with the tokenizer cfg_.tokenizer_path.
  std::unique_ptr<DataSource> open_tokenized_text(TokenStreamConfig tc) const;

  TrainConfig cfg_;
  TrainerOptions opts_;
  std::unique_ptr<ExpertGroups> groups_;  // expert parallelism (opts_.expert_parallel > 1)
  // Context parallelism: this rank's group, and on GPUs its NCCL communicator (the slices'
  // exchanges stay on the devices).
  std::unique_ptr<dist::Comm> cp_comm_, cp_dev_;
  // Tensor and context parallelism together: the ranks of this rank's part of the batch
  // (HybridModelOptions::tensor_context_comm).
  std::unique_ptr<dist::Comm> tcp_comm_;
  // Tensor parallelism: the group (NCCL's on GPUs) and every parameter's layout in
  // named_parameters order. dp_host_: the data-parallel ranks beside it (dp_ runs over them).
  std::unique_ptr<dist::Comm> tp_host_, tp_dev_, dp_host_;
  dist::Comm* tp_ = nullptr;
  std::vector<TpParam> tp_layouts_;
  std::map<std::string, const TpParam*> tp_split_;  // the split ones (rows or cols), by name
  // The layout of the parameter a checkpoint name belongs to (a weight's name, or an optimizer
  // state's "optimizer.<kind><name>"), or null when it is not split.
  const TpParam* tp_layout_of(const std::string& key) const;
  // Each split tensor of `in` gathered whole over the group (every rank calls), or cut to this
  // rank's part (to_parts); the others pass unchanged.
  safetensors::TensorMap tp_convert(const safetensors::TensorMap& in, bool to_parts) const;
  GradNorm tp_grad_norm() const;          // the whole model's gradient norm (sliced parts summed)
  std::set<const Param*> split_experts_;  // and this rank's shares of the expert weights
  std::unique_ptr<HybridModel> model_;
  std::unique_ptr<AdamW> opt_;
  std::unique_ptr<LrSchedule> sched_;
  std::unique_ptr<DataSource> data_;
  const MqarTask* mqar_ = nullptr;     // data_ when it is MQAR
  std::unique_ptr<RunLock> lock_;      // the run directory's lock (train/run_lock.h)
  std::unique_ptr<dist::Comm> dcomm_;  // N > 1 processes on GPUs: NCCL over opts_.comm's ranks
  std::unique_ptr<DataParallel> dp_;   // N > 1 processes: opt_ is this rank's shard
  bool root_ = true;                   // rank 0 (or alone): writes the run directory
  int64_t step_ = 0;
  int64_t skipped_ = 0;
  int64_t start_step_ = 0;
};

// Prints the summary (final loss, accuracy vs chance, tokens/s, wall time, the files).
void print_summary(std::FILE* out, const TrainSummary& s, const TrainConfig& cfg);

}  // namespace hlm::train
