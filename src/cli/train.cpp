// `hybridlm train`: trains a hybrid model on the CPU (train/trainer.h; docs/training.md, "The
// training loop"). Without arguments: configs/train_mqar.json, the tiny GLM-5.3-Flash-shaped
// hybrid on MQAR, into runs/mqar (runs/mqar-2, ... when that holds a run already).
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <fmt/ranges.h>

#include "cli/command.h"
#include "core/error.h"
#include "dist/comm.h"
#include "train/train_limits.h"
#include "train/trainer.h"

namespace hlm::cli {
namespace {
namespace fs = std::filesystem;

constexpr const char* kDefaultConfig = "configs/train_mqar.json";
constexpr const char* kDefaultOut = "runs/mqar";

struct TrainArgs {
  std::string config, data, tokenizer, out, resume, device = "cpu";
  std::optional<int64_t> steps, seed, stop_after;
  std::vector<std::string> sets;
  bool overwrite = false;
  int64_t expert_parallel = 1;
  int64_t context_parallel = 1;
  int64_t tensor_parallel = 1;
  std::string cp_mode = "chunkwise";
};

// The default training config: in the current directory, else beside the executable (build
// directories sit in the repository: <repo>/build-x/hybridlm).
std::string find_default_config() {
  std::vector<fs::path> tried;
  tried.push_back(kDefaultConfig);
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    fs::path d = exe.parent_path();
    for (int up = 0; up < 3 && !d.empty(); ++up, d = d.parent_path()) {
      tried.push_back(d / kDefaultConfig);
      if (d == d.root_path()) break;
    }
  }
  std::string list;
  for (const auto& p : tried) {
    if (fs::exists(p, ec)) return p.lexically_normal().string();
    list += (list.empty() ? "" : ", ") + p.string();
  }
  throw Error(
      fmt::format("the default training config {} was not found (looked at {}); pass "
                  "--config FILE",
                  kDefaultConfig, list));
}

// A directory holds a run when it holds a checkpoint; what a run stopped before its first
// checkpoint left there (metrics, train_config.json) is replaced by a fresh run.
bool holds_run(const fs::path& dir) {
  std::error_code ec;
  return fs::exists(dir / train::kTrainerStateFile, ec);
}

void run_train(const TrainArgs& a) {
  if (a.device != "cpu" && a.device != "cuda")
    throw Error(fmt::format("--device must be cpu or cuda, got '{}'", a.device));

  train::TrainerOptions opts;
  opts.device = a.device == "cuda" ? Device::cuda : Device::cpu;
  opts.stop_after = a.stop_after;
  opts.handle_signals = true;  // Ctrl-C / SIGTERM: checkpoint, then exit 130 / 143
  // The typed options win over the config file and --set.
  const auto from_args = [&a](train::TrainConfig& c) {
    if (a.steps) c.steps = *a.steps;
    if (a.seed) c.seed = uint64_t(*a.seed);  // >= 0: the option's range validator
    // The data path is relative to the current directory (not to the config file).
    if (!a.data.empty()) c.data_path = fs::absolute(a.data).string();
    if (!a.tokenizer.empty()) c.tokenizer_path = fs::absolute(a.tokenizer).string();
  };
  train::TrainConfig cfg;
  if (!a.resume.empty()) {
    if (!a.config.empty())
      throw Error(
          "--config and --resume exclude each other: a resumed run continues with the "
          "checkpoint's training config (change settings with --set key=value)");
    if (!a.out.empty() && fs::weakly_canonical(a.out) != fs::weakly_canonical(a.resume))
      throw Error(
          fmt::format("--out {} and --resume {} differ: a resumed run continues in its "
                      "own directory",
                      a.out, a.resume));
    if (!a.data.empty())
      throw Error("--data and --resume exclude each other: a resumed run keeps its data");
    if (!a.tokenizer.empty())
      throw Error("--tokenizer and --resume exclude each other: a resumed run keeps its tokenizer");
    // Rank 0 of a data-parallel job may hold the directory's lock already.
    const train::TrainerCheckpoint ck =
        train::read_trainer_checkpoint(a.resume, dist::world().rank() == 0);
    const train::SplitOverrides ov = train::split_overrides(a.sets);
    if (!ov.model.empty())
      throw Error(
          fmt::format("--resume: the model of a checkpoint cannot change (model overrides: "
                      "{}); only training settings can be set",
                      fmt::join(ov.model, " ")));
    cfg = train::make_train_config(ck.train_config, a.sets,
                                   a.resume + "/" + train::kTrainerStateFile, "", from_args);
    opts.out_dir = a.resume;
    opts.resume = true;
  } else {
    const std::string path = a.config.empty() ? find_default_config() : a.config;
    nlohmann::json j = train::read_train_config_file(path);
    cfg =
        train::make_train_config(j, a.sets, path, fs::path(path).parent_path().string(), from_args);
    if (a.out.empty()) {
      // The default directory: the first of runs/mqar, runs/mqar-2, ... that holds no run.
      std::string out = kDefaultOut;
      for (int i = 2; holds_run(out); ++i) out = fmt::format("{}-{}", kDefaultOut, i);
      opts.out_dir = out;
    } else {
      if (holds_run(a.out) && !a.overwrite)
        throw Error(
            fmt::format("--out {} holds a training run already: pass --resume {} to "
                        "continue it, --overwrite to replace it, or another --out",
                        a.out, a.out));
      opts.out_dir = a.out;
    }
  }
  // Under mpirun the processes train one model data-parallel (train/data_parallel.h).
  if (dist::world().size() > 1) opts.comm = &dist::world();
  opts.expert_parallel = int(a.expert_parallel);
  opts.context_parallel = int(a.context_parallel);
  opts.tensor_parallel = int(a.tensor_parallel);
  opts.cp_mode = a.cp_mode == "headwise" ? KdaCpMode::headwise : KdaCpMode::chunkwise;
  train::Trainer trainer(cfg, opts);
  const train::TrainSummary sum = trainer.run();
  if (sum.interrupted_by) throw ExitStatus{128 + sum.interrupted_by};
}

std::function<void()> setup_train(CLI::App& app) {
  auto a = std::make_shared<TrainArgs>();
  app.add_option("--config", a->config,
                 "training config (JSON; default configs/train_mqar.json: the tiny hybrid on MQAR)")
      ->check(input_file());
  app.add_option("--data", a->data,
                 "training data: a UTF-8 text file (byte tokens) or a .bin of uint32 ids; MQAR "
                 "when absent")
      ->check(input_file());
  app.add_option("--tokenizer", a->tokenizer,
                 "encode the --data text file with this Hugging Face tokenizer.json (or the "
                 "directory holding it) instead of byte tokens");
  app.add_option("--steps", a->steps, "total optimizer steps (also the total when resuming)")
      ->check(count_range(1, train::limits::kMaxSteps));
  app.add_option("--out", a->out, "run directory (default runs/mqar, or runs/mqar-N when taken)");
  app.add_option("--resume", a->resume, "continue the run in this directory to --steps total");
  app.add_option("--seed", a->seed, "seed of the initialisation and the data")
      ->check(count_range(0, INT64_MAX));
  app.add_option("--device", a->device,
                 "cpu or cuda: where the steps run (the model and optimizer state move there)");
  app.add_option("--set", a->sets,
                 "key=value override (repeatable): a training key, or model.KEY / any model "
                 "config field for the model")
      ->take_all()
      ->allow_extra_args(false);
  app.add_option("--stop-after", a->stop_after,
                 "stop with a checkpoint after this step, as if interrupted (resume later; 0: "
                 "checkpoint the initialised model)")
      ->check(count_range(0, train::limits::kMaxSteps));
  app.add_flag("--overwrite", a->overwrite, "replace a run that --out holds already");
  app.add_option("--expert-parallel", a->expert_parallel,
                 "under mpirun: split every MoE layer's experts over groups of this many "
                 "processes (default 1: every process holds every expert)")
      ->check(count_range(1, 1 << 20));
  app.add_option("--context-parallel", a->context_parallel,
                 "under mpirun: split each part of the batch along its tokens over groups of "
                 "this many processes (default 1; KDA, MoE and dense-MLP models without MTP)")
      ->check(count_range(1, 1 << 20));
  app.add_option("--tensor-parallel", a->tensor_parallel,
                 "under mpirun: split every attention layer's heads and dense MLP's channels "
                 "over groups of this many processes (default 1; not with --context-parallel "
                 "yet)")
      ->check(count_range(1, 1 << 20));
  app.add_option("--cp-mode", a->cp_mode,
                 "the KDA layers' context-parallel mode: chunkwise (states passed between "
                 "slices, default) or headwise (heads exchanged with all-to-alls)")
      ->check(CLI::IsMember({"chunkwise", "headwise"}));
  return [a] { run_train(*a); };
}

}  // namespace

HLM_REGISTER_COMMAND("train",
                     "train a hybrid model on the CPU or one GPU (default: tiny hybrid on MQAR)",
                     setup_train);

}  // namespace hlm::cli
