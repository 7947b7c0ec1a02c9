// The trainer: the training config (parsing, unknown keys, --set routing), a few steps reduce the
// loss, resume is bit-exact (weights and optimizer state), a SIGKILL during a checkpoint write
// (inside the write hook, or at a random moment) leaves the last checkpoint loadable and resumable
// bit-exactly, damaged checkpoints are refused with a clear message, and a non-finite loss or
// gradient stops the run naming the step (or is skipped when configured).
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "core/safetensors.h"
#include "model/checkpoint.h"
#include "testing.h"
#include "train/interrupt.h"
#include "train/run_lock.h"
#include "train/trainer.h"

extern char** environ;

namespace hlm::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A very small GLM-5.3-Flash-shaped hybrid: KDA then DSA with KPool (top-k 4 of pools of 2), the
// second layer MoE, mHC with 4 streams, one MTP depth.
json small_model() {
  return json::parse(R"({
    "model_type": "glm5_next_text", "vocab_size": 24, "hidden_size": 16,
    "num_hidden_layers": 2, "layer_pattern": "KD", "first_k_dense_replace": 1,
    "intermediate_size": 24, "initializer_range": 0.2,
    "linear_num_heads": 2, "linear_head_dim": 8, "linear_conv_kernel_dim": 4,
    "linear_lower_bound": -5.0,
    "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 8, "kv_lora_rank": 8,
    "qk_nope_head_dim": 4, "qk_rope_head_dim": 0, "v_head_dim": 4,
    "index_n_heads": 2, "index_head_dim": 8, "index_topk": 4, "index_kpool": 2,
    "dsa_indexer_loss_coeff": 0.1,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "moe_intermediate_size": 8, "router_aux_loss_coef": 0.01,
    "mhc": true, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "num_nextn_predict_layers": 1, "mtp_loss_scaling_factor": 0.3,
    "gemm_precision": "native"
  })");
}

json small_train(int64_t steps) {
  return json{{"model", small_model()},
              {"steps", steps},
              {"tokens_per_step", 64},
              {"lr", 1e-2},
              {"warmup_steps", 2},
              {"eval_interval", 0},
              {"eval_batches", 1},
              {"log_interval", 1},
              {"checkpoint_interval", 0},
              {"dsa_dense_warmup_steps", 2},
              {"mqar", {{"min_pairs", 2}, {"max_pairs", 4}}}};
}

TrainerOptions quiet(const fs::path& dir) {
  TrainerOptions o;
  o.out_dir = dir.string();
  o.log = nullptr;
  o.plot = false;
  o.print_summary = false;
  return o;
}

class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           fmt::format("hlm_trainer_{}_{}_{}", ::getpid(), info->test_suite_name(), info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  fs::path dir_;
};

::testing::AssertionResult same_tensor(const std::string& name, const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape())
    return ::testing::AssertionFailure() << name << ": " << a.describe() << " vs " << b.describe();
  const Tensor x = a.contiguous(), y = b.contiguous();
  if (std::memcmp(x.raw(), y.raw(), x.nbytes()) != 0)
    return ::testing::AssertionFailure() << name << " differs";
  return ::testing::AssertionSuccess();
}

// Every parameter and every optimizer state tensor bit-identical.
::testing::AssertionResult same_state(Trainer& a, Trainer& b) {
  if (a.step() != b.step())
    return ::testing::AssertionFailure() << "steps " << a.step() << " vs " << b.step();
  auto pa = a.model().named_parameters(), pb = b.model().named_parameters();
  if (pa.size() != pb.size()) return ::testing::AssertionFailure() << "parameter counts differ";
  for (size_t i = 0; i < pa.size(); ++i) {
    auto r = same_tensor(pa[i].first, pa[i].second->value, pb[i].second->value);
    if (!r) return r;
  }
  const auto sa = a.optimizer().state_dict(), sb = b.optimizer().state_dict();
  if (sa.size() != sb.size()) return ::testing::AssertionFailure() << "state sizes differ";
  for (const auto& [name, t] : sa) {
    auto it = sb.find(name);
    if (it == sb.end()) return ::testing::AssertionFailure() << name << " missing";
    auto r = same_tensor(name, t, it->second);
    if (!r) return r;
  }
  return ::testing::AssertionSuccess();
}

// ---- the training config ------------------------------------------------------------------------

TEST(TrainerConfig, RoundTripsAndResolvesDefaults) {
  const TrainConfig c = TrainConfig::from_json(small_train(7), "test");
  EXPECT_EQ(c.steps, 7);
  EXPECT_EQ(c.tokens_per_step, 64);
  EXPECT_EQ(c.mqar_config().vocab_size, 24);  // the model's
  EXPECT_EQ(c.mqar_config().num_keys, 12);    // half of it
  EXPECT_EQ(c.mqar_config().tokens_per_step, 64);
  EXPECT_EQ(c.schedule_config().total_steps, 7);
  const TrainConfig d = TrainConfig::from_json(c.to_json(), "round trip");
  EXPECT_EQ(d.to_json(), c.to_json());
  EXPECT_TRUE(d.model == c.model);
  // The model config is parsed once into the typed struct and written back from it.
  EXPECT_EQ(c.model, ModelConfig::from_json(small_model()));
  EXPECT_EQ(c.model_source, "inline");
  EXPECT_EQ(c.to_json().at("model"), c.model.to_json());
  // "model_overrides" apply to the model before it is parsed (also through from_json).
  json j = small_train(7);
  j["model_overrides"] = {"hidden_size=32", "hc_mult=2"};
  const TrainConfig o = TrainConfig::from_json(j, "test");
  EXPECT_EQ(o.model.hidden_size, 32);
  EXPECT_EQ(o.model.mhc.hc_mult, 2);
  EXPECT_EQ(o.model_source, "inline with hidden_size=32 hc_mult=2");
  EXPECT_FALSE(o.to_json().contains("model_overrides"));
  // Keys starting with '_' are comments; seeds use the whole int64 range.
  j = small_train(7);
  j["_comment"] = "a note";
  j["seed"] = int64_t(1) << 62;
  EXPECT_EQ(TrainConfig::from_json(j, "test").seed, uint64_t(1) << 62);
}

TEST(TrainerConfig, TypedSettingsWinAndAreValidated) {
  // The command line's typed options (make_train_config's adjust) come after --set.
  const TrainConfig c = make_train_config(small_train(3), {"steps=5", "seed=4"}, "cfg", "",
                                          [](TrainConfig& t) { t.steps = 9; });
  EXPECT_EQ(c.steps, 9);
  EXPECT_EQ(c.seed, 4u);
  EXPECT_EQ(c.schedule_config().total_steps, 9);
  // Validation runs after them: a bad file value they replace is fine, a bad value they set
  // is refused.
  json zero = small_train(0);
  EXPECT_EQ(make_train_config(zero, {}, "cfg", "", [](TrainConfig& t) { t.steps = 2; }).steps, 2);
  EXPECT_NE(testing::error_of([&] {
              make_train_config(small_train(3), {}, "cfg", "", [](TrainConfig& t) { t.steps = 0; });
            }).find("'steps' must be >= 1, got 0"),
            std::string::npos);
}

TEST(TrainerConfig, IntegersAreIntegers) {
  auto err = [](const char* key, json v) {
    json j = small_train(3);
    j[key] = v;
    return testing::error_of([&] { TrainConfig::from_json(j, "cfg.json"); });
  };
  EXPECT_NE(err("steps", 5.0).find("cfg.json: 'steps' must be an integer, got 5.0"),
            std::string::npos);
  EXPECT_NE(err("steps", 1e30).find("'steps' must be an integer, got 1e+30"), std::string::npos);
  EXPECT_NE(err("seed", -1).find("'seed' must be an integer in [0, 9223372036854775807], got -1"),
            std::string::npos);
  EXPECT_NE(err("seed", json::parse("18446744073709551615")).find("'seed'"), std::string::npos);
  EXPECT_NE(err("lr", "big").find("'lr' must be a finite number, got \"big\""), std::string::npos);
  EXPECT_NE(err("shuffle", 1).find("'shuffle' must be true or false"), std::string::npos);
  EXPECT_NE(err("dtype", "f16").find("'dtype' must be one of \"f32\""), std::string::npos);
  EXPECT_NE(err("recompute", "some").find("'recompute'"), std::string::npos);
  EXPECT_NE(err("mqar", {{"max_pairs", 2.5}}).find("'mqar.max_pairs' must be an integer"),
            std::string::npos);
  EXPECT_NE(err("mqar", nullptr).find("'mqar' must be an object"), std::string::npos);
  EXPECT_NE(err("model", 3).find("'model' must be a model config path or an inline config object"),
            std::string::npos);
  // A model config error names the model's source and the field.
  json m = small_model();
  m["hidden_size"] = "16";
  EXPECT_NE(err("model", m).find("model config (inline): 'hidden_size' must be an integer >= 1"),
            std::string::npos);
}

TEST(TrainerConfig, RefusesUnknownKeysAndWrongTypes) {
  json j = small_train(3);
  j["stepz"] = 4;
  EXPECT_NE(
      testing::error_of([&] { TrainConfig::from_json(j, "cfg.json"); }).find("unknown key 'stepz'"),
      std::string::npos);
  j = small_train(3);
  j["mqar"]["pairs"] = 4;
  EXPECT_NE(testing::error_of([&] { TrainConfig::from_json(j, "cfg.json"); }).find("'mqar.pairs'"),
            std::string::npos);
  j = small_train(3);
  j["steps"] = "ten";
  EXPECT_NE(testing::error_of([&] {
              TrainConfig::from_json(j, "cfg.json");
            }).find("'steps' must be an integer"),
            std::string::npos);
  j = small_train(3);
  j["nonfinite"] = "ignore";
  EXPECT_NE(testing::error_of([&] { TrainConfig::from_json(j, "cfg.json"); }).find("nonfinite"),
            std::string::npos);
  j = small_train(3);
  j["mqar"]["max_pairs"] = 40;  // 4 * 40 > 64 tokens per step
  EXPECT_NE(testing::error_of([&] { TrainConfig::from_json(j, "cfg.json"); }).find("MQAR"),
            std::string::npos);
  // An unknown --set key is neither a training key nor a model field.
  EXPECT_NE(testing::error_of([&] {
              make_train_config(small_train(3), {"bogus_key=1"}, "cfg", "");
            }).find("bogus_key"),
            std::string::npos);
}

TEST(TrainerConfig, OverridesGoToTheTrainerOrTheModel) {
  const SplitOverrides s = split_overrides(
      {"lr=0.5", "mqar.max_pairs=3", "model.hidden_size=32", "num_hidden_layers=3"});
  EXPECT_EQ(s.train, (std::vector<std::string>{"lr=0.5", "mqar.max_pairs=3"}));
  EXPECT_EQ(s.model, (std::vector<std::string>{"hidden_size=32", "num_hidden_layers=3"}));
  const TrainConfig c = make_train_config(small_train(3),
                                          {"lr=0.5", "mqar.max_pairs=3", "model.hidden_size=32",
                                           "layer_pattern=KDK", "num_hidden_layers=3"},
                                          "cfg", "");
  EXPECT_EQ(c.lr, 0.5);
  EXPECT_EQ(c.mqar.max_pairs, 3);
  EXPECT_EQ(c.model.hidden_size, 32);
  EXPECT_EQ(c.model.num_hidden_layers, 3);
  EXPECT_NE(testing::error_of([] { split_overrides({"novalue"}); }).find("key=value"),
            std::string::npos);
  // The file's model_overrides apply to its model; --set model.X comes after them and wins.
  json j = small_train(3);
  j["model_overrides"] = {"hidden_size=32", "intermediate_size=40"};
  const TrainConfig d = make_train_config(j, {"model.hidden_size=48"}, "cfg", "");
  EXPECT_EQ(d.model.hidden_size, 48);
  EXPECT_EQ(d.model.intermediate_size, 40);
  EXPECT_FALSE(d.to_json().contains("model_overrides"));
  j["model_overrides"] = "hidden_size=32";
  EXPECT_NE(
      testing::error_of([&] { make_train_config(j, {}, "cfg", ""); }).find("'model_overrides'"),
      std::string::npos);
}

// ---- training -----------------------------------------------------------------------------------

TEST_F(TrainerTest, AFewStepsReduceTheLoss) {
  json j = small_train(30);
  j["eval_interval"] = 30;
  Trainer t(TrainConfig::from_json(j), quiet(dir_));
  const TrainSummary s = t.run();
  const auto recs = read_metrics((dir_ / kMetricsFile).string());
  ASSERT_EQ(recs.size(), 30u);
  double first = 0, last = 0;
  for (int i = 0; i < 5; ++i)
    first += recs[size_t(i)].loss / 5, last += recs[recs.size() - 1 - size_t(i)].loss / 5;
  EXPECT_LT(last, first - 0.2) << "first 5 steps " << first << ", last 5 " << last;
  EXPECT_TRUE(std::isfinite(s.final_loss));
  EXPECT_TRUE(s.eval.has_accuracy);
  EXPECT_GT(s.eval.accuracy.total, 0);
  EXPECT_NEAR(s.chance_accuracy, 1.0 / 12, 1e-12);
  ASSERT_TRUE(recs.back().eval_accuracy.has_value());
  EXPECT_EQ(s.end_step, 30);
  // The final files: HF-layout weights + config, the resumable state, the training config.
  for (const char* f : {"model.safetensors", "config.json", kTrainerStateFile, kTrainConfigFile})
    EXPECT_TRUE(fs::exists(dir_ / f)) << f;
  EXPECT_TRUE(ModelConfig::load(dir_.string()) == t.config().model);
  {
    std::ifstream f(dir_ / "config.json");
    const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    EXPECT_EQ(text, t.config().model.to_json().dump(2) + "\n");  // written from the typed config
  }
  // The weights load into a fresh model.
  HybridModel fresh(t.config().model, {DType::f32, 99});
  checkpoint::load_module(dir_.string(), fresh);
  auto pa = fresh.named_parameters(), pb = t.model().named_parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_TRUE(same_tensor(pa[i].first, pa[i].second->value, pb[i].second->value));
}

TEST_F(TrainerTest, ResumeIsBitExact) {
  const TrainConfig cfg = TrainConfig::from_json(small_train(6));
  Trainer straight(cfg, quiet(dir_ / "straight"));
  straight.run();

  // Interrupted after 3 steps (the dense DSA warm-up ends at 2), resumed to 6.
  TrainerOptions o = quiet(dir_ / "split");
  o.stop_after = 3;
  Trainer first(cfg, o);
  first.run();
  EXPECT_EQ(first.step(), 3);
  o.stop_after.reset();
  o.resume = true;
  Trainer second(cfg, o);
  EXPECT_EQ(second.step(), 3);
  second.run();
  EXPECT_TRUE(same_state(straight, second));
  // The metrics of the resumed part repeat the straight run's.
  const auto a = read_metrics((dir_ / "straight" / kMetricsFile).string());
  const auto b = read_metrics((dir_ / "split" / kMetricsFile).string());
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].step, b[i].step);
    EXPECT_EQ(a[i].loss, b[i].loss) << "step " << a[i].step;
    EXPECT_EQ(a[i].grad_norm, b[i].grad_norm) << "step " << a[i].step;
  }

  // A run of 3 steps whose schedule spans 6 (decay_steps), resumed with --steps 6: identical too.
  json j = small_train(3);
  j["decay_steps"] = 6;
  Trainer shorter(TrainConfig::from_json(j), quiet(dir_ / "extend"));
  shorter.run();
  j["steps"] = 6;
  TrainerOptions r = quiet(dir_ / "extend");
  r.resume = true;
  Trainer extended(TrainConfig::from_json(j), r);
  extended.run();
  EXPECT_TRUE(same_state(straight, extended));
}

TEST_F(TrainerTest, ResumeRefusesAnotherModel) {
  TrainerOptions o = quiet(dir_);
  Trainer(TrainConfig::from_json(small_train(2)), o).run();
  json j = small_train(4);
  j["model"]["intermediate_size"] = 32;
  o.resume = true;
  const std::string e = testing::error_of([&] { Trainer(TrainConfig::from_json(j), o); });
  EXPECT_NE(e.find("model config differs"), std::string::npos) << e;
  EXPECT_NE(e.find("intermediate_size"), std::string::npos) << e;
  // --steps below the checkpoint's step.
  const std::string e2 =
      testing::error_of([&] { Trainer(TrainConfig::from_json(small_train(1)), o); });
  EXPECT_NE(e2.find("past the requested total"), std::string::npos) << e2;
}

// ---- damaged checkpoints ------------------------------------------------------------------------

void truncate_file(const fs::path& p) {
  const auto n = fs::file_size(p);
  fs::resize_file(p, n / 2);
}

TEST_F(TrainerTest, DamagedCheckpointIsRefused) {
  const TrainConfig cfg = TrainConfig::from_json(small_train(2));
  TrainerOptions o = quiet(dir_ / "run");
  Trainer(cfg, o).run();
  const fs::path run = dir_ / "run", backup = dir_ / "backup";
  fs::copy(run, backup, fs::copy_options::recursive);
  auto restore = [&] {
    fs::remove_all(run);
    fs::copy(backup, run, fs::copy_options::recursive);
  };
  TrainConfig more = cfg;
  more.steps = 4;
  o.resume = true;
  auto resume_error = [&] { return testing::error_of([&] { Trainer(more, o); }); };
  EXPECT_EQ(resume_error(), "(no error)");  // the intact copy resumes

  truncate_file(run / kTrainerStateFile);
  std::string e = resume_error();
  EXPECT_NE(e.find("trainer_state.safetensors: the checkpoint cannot be read"), std::string::npos)
      << e;
  EXPECT_NE(e.find("trainer_state.safetensors"), std::string::npos) << e;

  restore();
  truncate_file(run / "model.safetensors");
  e = resume_error();
  EXPECT_NE(e.find("model.safetensors is damaged"), std::string::npos) << e;

  restore();
  {
    json c = read_json_file((run / "config.json").string());
    c["hidden_size"] = 32;
    std::ofstream((run / "config.json").string()) << c.dump(2);
  }
  e = resume_error();
  EXPECT_NE(e.find("config.json differs"), std::string::npos) << e;
  EXPECT_NE(e.find("hidden_size"), std::string::npos) << e;

  restore();
  std::ofstream((run / "config.json").string()) << "{\"vocab_size\": 24,";
  e = resume_error();
  EXPECT_NE(e.find("config.json is damaged"), std::string::npos) << e;

  // A weight changed in model.safetensors (same step as the trainer state).
  restore();
  {
    safetensors::Contents w = safetensors::load((run / "model.safetensors").string());
    Tensor& t = w.tensors.at("model.norm.weight");
    t = t.clone();
    t.data<float>()[0] += 1.0f;
    safetensors::save((run / "model.safetensors").string(), w.tensors, w.metadata);
  }
  e = resume_error();
  EXPECT_NE(e.find("'model.norm.weight'"), std::string::npos) << e;
  EXPECT_NE(e.find("was modified"), std::string::npos) << e;

  // The stored training config edited into invalid JSON.
  restore();
  {
    safetensors::Contents s = safetensors::load((run / kTrainerStateFile).string());
    s.metadata["train_config"] = "{\"steps\": 2,";
    safetensors::save((run / kTrainerStateFile).string(), s.tensors, s.metadata);
  }
  e = resume_error();
  EXPECT_NE(e.find("'train_config' is not valid JSON"), std::string::npos) << e;

  // The stored step made inconsistent with the optimizer's update count.
  restore();
  {
    safetensors::Contents s = safetensors::load((run / kTrainerStateFile).string());
    s.metadata["step"] = "5";
    safetensors::save((run / kTrainerStateFile).string(), s.tensors, s.metadata);
  }
  e = resume_error();
  EXPECT_NE(e.find("the optimizer made 2 updates"), std::string::npos) << e;

  // Not a run directory at all.
  e = testing::error_of([&] { read_trainer_checkpoint((dir_ / "nothing").string()); });
  EXPECT_NE(e.find("not a directory"), std::string::npos) << e;
  fs::create_directories(dir_ / "empty");
  e = testing::error_of([&] { read_trainer_checkpoint((dir_ / "empty").string()); });
  EXPECT_NE(e.find("holds no training checkpoint"), std::string::npos) << e;
}

// ---- non-finite values --------------------------------------------------------------------------

TEST_F(TrainerTest, NonFiniteGradientStopsNamingTheStep) {
  json j = small_train(6);
  j["checkpoint_interval"] = 2;
  TrainerOptions o = quiet(dir_);
  o.hooks.after_backward = [](int64_t step, HybridModel& m) {
    if (step == 3) m.named_parameters()[0].second->grad.data<float>()[5] = NAN;
  };
  Trainer t(TrainConfig::from_json(j), o);
  const std::string e = testing::error_of([&] { t.run(); });
  EXPECT_NE(e.find("step 3: the gradient norm is not finite"), std::string::npos) << e;
  EXPECT_NE(e.find("last checkpoint (step 2)"), std::string::npos) << e;
  EXPECT_EQ(read_trainer_checkpoint(dir_.string()).step, 2);
  // The failing step is in the metrics with a null (NaN) gradient norm.
  const auto recs = read_metrics((dir_ / kMetricsFile).string());
  ASSERT_EQ(recs.size(), 3u);
  EXPECT_TRUE(std::isnan(recs.back().grad_norm));
}

TEST_F(TrainerTest, NonFiniteGradientIsSkippedWhenConfigured) {
  json j = small_train(5);
  j["nonfinite"] = "skip";
  TrainerOptions o = quiet(dir_);
  o.hooks.after_backward = [](int64_t step, HybridModel& m) {
    if (step == 2) m.named_parameters()[1].second->grad.data<float>()[0] = INFINITY;
  };
  Trainer t(TrainConfig::from_json(j), o);
  const TrainSummary s = t.run();
  EXPECT_EQ(s.skipped_steps, 1);
  EXPECT_EQ(s.end_step, 5);
  EXPECT_EQ(t.optimizer().step_count(), 4);
  for (auto& [name, p] : t.model().named_parameters())
    EXPECT_EQ(checkpoint::first_non_finite(p->value), -1) << name;
  // The skip is part of the checkpoint: a resume continues from it.
  const TrainerCheckpoint ck = read_trainer_checkpoint(dir_.string());
  EXPECT_EQ(ck.step, 5);
  EXPECT_EQ(ck.skipped_steps, 1);
}

TEST_F(TrainerTest, HugeLearningRateStopsNamingTheStep) {
  // lr 1e30 through --set: the first update blows the weights up; a later step is not finite.
  const TrainConfig c = make_train_config(small_train(6), {"lr=1e30", "grad_clip=0"}, "cfg", "");
  Trainer t(c, quiet(dir_));
  const std::string e = testing::error_of([&] { t.run(); });
  EXPECT_TRUE(e.rfind("step ", 0) == 0) << e;
  EXPECT_NE(e.find("is not finite"), std::string::npos) << e;
  EXPECT_NE(e.find("No checkpoint was written"), std::string::npos) << e;
  // The message names the term that went non-finite, not only their sum.
  const bool named = e.find("the main cross-entropy is") != std::string::npos ||
                     e.find("the MTP loss is") != std::string::npos ||
                     e.find("the MoE aux loss is") != std::string::npos ||
                     e.find("the DSA indexer loss is") != std::string::npos ||
                     e.find("the gradient of '") != std::string::npos;
  EXPECT_TRUE(named) << e;
}

// ---- SIGKILL during a checkpoint write
// ------------------------------------------------------------

// The config of the kill tests: 8 steps, a checkpoint every `interval` steps.
TrainConfig kill_config(int64_t interval) {
  json j = small_train(8);
  j["checkpoint_interval"] = interval;
  return TrainConfig::from_json(j);
}

// The uninterrupted run the kill tests compare with (checkpointing does not change the training).
Trainer& reference_run() {
  static std::unique_ptr<Trainer> ref;
  if (!ref) {
    const fs::path d = fs::temp_directory_path() / fmt::format("hlm_trainer_ref_{}", ::getpid());
    ref = std::make_unique<Trainer>(kill_config(0), quiet(d));
    ref->run();
    fs::remove_all(d);
  }
  return *ref;
}

constexpr const char* kChildEnv = "HLM_TRAINER_KILL_CHILD";

// Re-executes this test binary as the child (fork + exec: the child gets a fresh process, so
// OpenMP and the allocator start clean). The child runs TrainerKillChild.TrainAndCheckpoint.
pid_t spawn_child(const fs::path& dir, int64_t interval, int64_t kill_at_temp) {
  std::vector<std::string> env_s;
  for (char** e = environ; *e; ++e)
    if (std::strncmp(*e, kChildEnv, std::strlen(kChildEnv)) != 0) env_s.emplace_back(*e);
  env_s.push_back(fmt::format("{}={};{};{}", kChildEnv, dir.string(), interval, kill_at_temp));
  std::vector<char*> envp;
  for (auto& s : env_s) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string a0 = "hlm_tests", a1 = "--gtest_filter=TrainerKillChild.TrainAndCheckpoint";
  char* argv[] = {a0.data(), a1.data(), nullptr};
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int devnull = ::open("/dev/null", O_WRONLY);
    if (devnull >= 0) ::dup2(devnull, 1);
    ::execve("/proc/self/exe", argv, envp.data());
    ::_exit(127);
  }
  return pid;
}

TEST(TrainerKillChild, TrainAndCheckpoint) {
  const char* env = std::getenv(kChildEnv);
  if (!env) GTEST_SKIP() << "runs only as the child process of the TrainerTest.Killed* tests";
  const std::string s = env;
  const size_t a = s.find(';'), b = s.find(';', a + 1);
  const std::string dir = s.substr(0, a);
  const int64_t interval = std::stoll(s.substr(a + 1, b - a - 1));
  const int64_t kill_at = std::stoll(s.substr(b + 1));
  TrainerOptions o = quiet(dir);
  int64_t temps = 0;
  o.hooks.after_temp_written = [&](const std::string&) {
    if (++temps == kill_at) ::kill(::getpid(), SIGKILL);
  };
  Trainer(kill_config(interval), o).run();
}

// What a killed run must leave: a checkpoint that loads (trainer state and HF weights) and resumes
// to the same weights and optimizer state as the uninterrupted run.
void check_recovers(const fs::path& dir, int64_t expect_step) {
  const TrainerCheckpoint ck = read_trainer_checkpoint(dir.string());
  if (expect_step >= 0) EXPECT_EQ(ck.step, expect_step);
  const TrainConfig cfg = kill_config(2);
  HybridModel m(cfg.model, {});
  EXPECT_NO_THROW(checkpoint::load_module(dir.string(), m));
  EXPECT_TRUE(ModelConfig::load(dir.string()) == cfg.model);
  TrainerOptions o = quiet(dir);
  o.resume = true;
  Trainer t(cfg, o);
  EXPECT_EQ(t.step(), ck.step);
  t.run();
  EXPECT_TRUE(same_state(reference_run(), t));
  // The interrupted save's temporaries are gone.
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
}

int wait_child(pid_t pid) {
  int st = 0;
  ::waitpid(pid, &st, 0);
  return st;
}

TEST_F(TrainerTest, KilledWhileWritingTheTrainerState) {
  // Checkpoints at 2, 4, ...: each writes 3 temporaries (trainer state, model, config.json).
  // Temporary 4 is the trainer state of step 4: killed before its rename, step 2 stays.
  const int st = wait_child(spawn_child(dir_, 2, 4));
  ASSERT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL) << "status " << st;
  bool stale = false;
  for (const auto& e : fs::directory_iterator(dir_))
    stale |= e.path().filename().string().find(".trainer_state.safetensors.tmp.") == 0;
  EXPECT_TRUE(stale) << "the kill should leave the temporary of the interrupted write";
  check_recovers(dir_, 2);
}

TEST_F(TrainerTest, KilledWhileWritingTheWeights) {
  // Temporary 5: the trainer state of step 4 is committed, model.safetensors is still step 2's.
  const int st = wait_child(spawn_child(dir_, 2, 5));
  ASSERT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL) << "status " << st;
  const auto w = safetensors::load((dir_ / "model.safetensors").string());
  EXPECT_EQ(w.metadata.at("hlm_train_step"), "2");
  check_recovers(dir_, 4);
}

TEST_F(TrainerTest, KilledAtARandomMoment) {
  // A checkpoint after every step; killed at a random moment after the first one exists. The
  // first checkpoint is complete once all three of its files exist: the trainer state (the
  // commit point, written first), then the HF weights and config.json. A kill in between would
  // leave no HF weights yet, which check_recovers' load_module rightly rejects.
  std::mt19937_64 rng(::testing::UnitTest::GetInstance()->random_seed() + uint64_t(::getpid()));
  const pid_t pid = spawn_child(dir_, 1, 0);
  const auto t0 = std::chrono::steady_clock::now();
  auto first_complete = [&] {
    return fs::exists(dir_ / kTrainerStateFile) && fs::exists(dir_ / checkpoint::kSingleFile) &&
           fs::exists(dir_ / checkpoint::kConfigFile);
  };
  while (!first_complete() && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60))
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::this_thread::sleep_for(std::chrono::microseconds(rng() % 100000));
  ::kill(pid, SIGKILL);
  const int st = wait_child(pid);
  EXPECT_TRUE(WIFSIGNALED(st) || (WIFEXITED(st) && WEXITSTATUS(st) == 0)) << "status " << st;
  check_recovers(dir_, -1);
}

// ---- robustness (docs/robustness.md)
// -------------------------------------------------------------

// Item 4: a training step too large for memory is refused in the constructor, before the run
// directory exists (it used to be created, then the first forward failed with bad_alloc).
TEST_F(TrainerTest, AStepTooLargeForMemoryIsRefusedBeforeTheDirectoryExists) {
  // A fixed limit (the machine's memory varies): 10^7 tokens need far more than 4 GiB.
  ::setenv("HLM_MEMORY_LIMIT", "4G", 1);
  struct Unset {
    ~Unset() { ::unsetenv("HLM_MEMORY_LIMIT"); }
  } unset;
  json j = small_train(2);
  j["tokens_per_step"] = 10000000;
  j["mqar"]["max_pairs"] = 4;
  const TrainConfig c = TrainConfig::from_json(j);
  const std::string e = testing::error_of([&] { Trainer t(c, quiet(dir_ / "run")); });
  EXPECT_NE(e.find("a training step of 10000000 tokens needs at least"), std::string::npos) << e;
  EXPECT_NE(e.find("memory limit of 4294967296 bytes"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(dir_ / "run"));
  j["tokens_per_step"] = 64;
  j["steps"] = int64_t(1) << 40;
  const std::string e2 =
      testing::error_of([&] { Trainer t(TrainConfig::from_json(j), quiet(dir_ / "r")); });
  EXPECT_NE(e2.find("'steps' is 1099511627776, more than the limit of 1000000000"),
            std::string::npos)
      << e2;
  EXPECT_FALSE(fs::exists(dir_ / "r"));
}

// Item 5: a bit flip in the optimizer state of trainer_state.safetensors is caught at resume.
TEST_F(TrainerTest, ABitFlipInTheTrainerStateIsCaughtAtResume) {
  const TrainConfig cfg = TrainConfig::from_json(small_train(2));
  Trainer(cfg, quiet(dir_)).run();
  const std::string path = (dir_ / kTrainerStateFile).string();
  const safetensors::Header h = safetensors::read_header(path);
  const safetensors::TensorInfo& m = h.tensors.begin()->second;  // an optimizer tensor
  ASSERT_EQ(h.tensors.begin()->first.rfind("optimizer.", 0), 0u);
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    const auto at = std::streamoff(h.data_begin + m.begin + (m.end - m.begin) / 2);
    f.seekg(at);
    char c = 0;
    f.read(&c, 1);
    c = char(c ^ 0x10);
    f.seekp(at);
    f.write(&c, 1);
  }
  TrainerOptions o = quiet(dir_);
  o.resume = true;
  const std::string e = testing::error_of([&] { Trainer t(cfg, o); });
  EXPECT_NE(e.find("checksum mismatch"), std::string::npos) << e;
  EXPECT_NE(e.find(kTrainerStateFile), std::string::npos) << e;
}

// Item 6: a run directory in use by another run is refused, naming the holder, and nothing in it
// is touched.
TEST_F(TrainerTest, ARunDirectoryInUseIsRefusedNamingTheHolder) {
  const TrainConfig cfg = TrainConfig::from_json(small_train(2));
  Trainer(cfg, quiet(dir_)).run();
  const std::string before =
      safetensors::load((dir_ / kTrainerStateFile).string()).metadata.at(safetensors::kChecksumKey);
  std::ofstream(dir_ / ".trainer_state.safetensors.tmp.1.0") << "another run's temporary";
  {
    RunLock held(dir_.string());  // as another run would hold it
    EXPECT_EQ(RunLock::holder(dir_.string()), long(::getpid()));
    Trainer fresh(cfg, quiet(dir_));
    const std::string e = testing::error_of([&] { fresh.run(); });
    EXPECT_NE(e.find("is in use by another training run"), std::string::npos) << e;
    EXPECT_NE(e.find(fmt::format("process {}", ::getpid())), std::string::npos) << e;
    TrainerOptions o = quiet(dir_);
    o.resume = true;
    EXPECT_NE(testing::error_of([&] { Trainer t(cfg, o); }).find("in use"), std::string::npos);
    EXPECT_TRUE(fs::exists(dir_ / ".trainer_state.safetensors.tmp.1.0"));
    EXPECT_EQ(safetensors::load((dir_ / kTrainerStateFile).string())
                  .metadata.at(safetensors::kChecksumKey),
              before);
  }
  // Released: the next run goes ahead (and clears the stale temporary).
  TrainerOptions o = quiet(dir_);
  o.resume = true;
  TrainConfig longer = make_train_config(small_train(2), {"steps=3"}, "cfg", "");
  Trainer t(longer, o);
  t.run();
  EXPECT_EQ(t.step(), 3);
  EXPECT_FALSE(fs::exists(dir_ / ".trainer_state.safetensors.tmp.1.0"));
}

// Item 7: a SIGINT during a step finishes it, checkpoints and returns; the resumed run continues
// bit-exactly. --stop-after 0 checkpoints the initialised model.
TEST_F(TrainerTest, ASignalFinishesTheStepAndCheckpoints) {
  const TrainConfig cfg = TrainConfig::from_json(small_train(5));
  Trainer straight(cfg, quiet(dir_ / "straight"));
  straight.run();

  TrainerOptions o = quiet(dir_ / "split");
  o.handle_signals = true;
  o.hooks.after_backward = [](int64_t step, HybridModel&) {
    if (step == 2) ::raise(SIGINT);  // delivered now; the trainer sees it after the step
  };
  Trainer first(cfg, o);
  const TrainSummary s = first.run();
  EXPECT_EQ(s.interrupted_by, SIGINT);
  EXPECT_EQ(first.step(), 2);
  EXPECT_EQ(read_trainer_checkpoint((dir_ / "split").string()).step, 2);
  // The handlers are restored afterwards.
  struct sigaction now = {};
  ::sigaction(SIGINT, nullptr, &now);
  EXPECT_EQ(now.sa_handler, SIG_DFL);

  TrainerOptions r = quiet(dir_ / "split");
  r.resume = true;
  Trainer second(cfg, r);
  second.run();
  EXPECT_TRUE(same_state(straight, second));

  // Stopped before the first step: a resumable checkpoint of step 0.
  TrainerOptions z = quiet(dir_ / "zero");
  z.stop_after = 0;
  Trainer none(cfg, z);
  none.run();
  EXPECT_EQ(read_trainer_checkpoint((dir_ / "zero").string()).step, 0);
  TrainerOptions rz = quiet(dir_ / "zero");
  rz.resume = true;
  Trainer from_zero(cfg, rz);
  from_zero.run();
  EXPECT_TRUE(same_state(straight, from_zero));
}

TEST(TrainerInterrupt, ASecondSignalEndsTheProcessAtOnce) {
  EXPECT_EXIT(
      {
        InterruptGuard g;
        ::raise(SIGINT);
        if (InterruptGuard::pending() != SIGINT) std::_Exit(3);
        ::raise(SIGINT);  // the default action: the process ends here
        std::_Exit(4);
      },
      ::testing::KilledBySignal(SIGINT), "");
  EXPECT_EXIT(
      {
        InterruptGuard g;
        ::raise(SIGTERM);
        ::raise(SIGINT);
        std::_Exit(4);
      },
      ::testing::KilledBySignal(SIGINT), "");
  EXPECT_STREQ(signal_name(SIGTERM), "SIGTERM");
}

}  // namespace
}  // namespace hlm::train
