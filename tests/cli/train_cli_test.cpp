// `hybridlm train` run as a user runs it (the built binary): a short run writes its files and a
// summary, --stop-after + --resume continues to the same weights as a straight run, and bad
// requests (--device cuda, an unknown --set key, an occupied --out, a NaN-producing lr, a damaged
// config, bad --steps / --seed values) exit with status 2 and a clear message. Skips when the
// binary has not been built.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/device.h"
#include "core/safetensors.h"
#include "model/checkpoint.h"
#include "testing.h"

namespace hlm {
namespace {

namespace fs = std::filesystem;

const char* const kModel = testing::kSmallModelJson;

const char* kTrain = R"({
  "model": "small_model.json", "steps": 6, "tokens_per_step": 64, "lr": 0.01,
  "warmup_steps": 2, "eval_interval": 3, "eval_batches": 1, "log_interval": 1,
  "checkpoint_interval": 2, "dsa_dense_warmup_steps": 2,
  "mqar": {"min_pairs": 2, "max_pairs": 4}
})";

class TrainCli : public ::testing::Test {
 protected:
  void SetUp() override {
    bin_ = std::string(HLM_BINARY_DIR) + "/hybridlm";
    if (!fs::exists(bin_)) GTEST_SKIP() << "binary " << bin_ << " not built (ninja hybridlm)";
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / fmt::format("hlm_train_cli_{}_{}", ::getpid(), info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::ofstream(path("small_model.json")) << kModel;
    std::ofstream(path("train.json")) << kTrain;
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  std::string path(const std::string& n) const { return (dir_ / n).string(); }
  int run(const std::string& args) {
    const std::string cmd = "cd " + dir_.string() + " && OMP_NUM_THREADS=1 " + bin_ + " train " +
                            args + " > out.txt 2> err.txt";
    const int st = std::system(cmd.c_str());
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  }
  std::string read(const std::string& n) const {
    std::ifstream f(path(n));
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
  std::string bin_;
  fs::path dir_;
};

TEST_F(TrainCli, ShortRunWritesItsFilesAndASummary) {
  ASSERT_EQ(run("--config train.json --out run"), 0) << read("err.txt");
  const std::string out = read("out.txt");
  EXPECT_NE(out.find("training summary"), std::string::npos) << out;
  EXPECT_NE(out.find("eval accuracy"), std::string::npos) << out;
  EXPECT_NE(out.find("chance 0.0833"), std::string::npos) << out;
  EXPECT_NE(out.find("tokens/s"), std::string::npos) << out;
  for (const char* f : {"model.safetensors", "config.json", "trainer_state.safetensors",
                        "train_config.json", "metrics.jsonl", "parameters.txt"})
    EXPECT_TRUE(fs::exists(dir_ / "run" / f)) << f;
  EXPECT_TRUE(fs::exists(dir_ / "run" / "metrics.png") || fs::exists(dir_ / "run" / "metrics.svg"));
  // The same --out again is refused (a run is there), --overwrite replaces it.
  EXPECT_EQ(run("--config train.json --out run"), 2);
  EXPECT_NE(read("err.txt").find("holds a training run already"), std::string::npos);
  EXPECT_EQ(run("--config train.json --out run --overwrite --steps 2"), 0) << read("err.txt");
  // The written train_config.json is itself a valid --config.
  EXPECT_EQ(run("--config run/train_config.json --out again --steps 1"), 0) << read("err.txt");
}

TEST_F(TrainCli, StopAndResumeGiveTheStraightRunsWeights) {
  ASSERT_EQ(run("--config train.json --out straight"), 0) << read("err.txt");
  ASSERT_EQ(run("--config train.json --out split --stop-after 3"), 0) << read("err.txt");
  ASSERT_EQ(run("--resume split --steps 6"), 0) << read("err.txt");
  EXPECT_NE(read("out.txt").find("resumed from split at step 3"), std::string::npos);
  const auto a = safetensors::load(path("straight/model.safetensors"));
  const auto b = safetensors::load(path("split/model.safetensors"));
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (const auto& [name, t] : a.tensors) {
    const Tensor& u = b.tensors.at(name);
    ASSERT_EQ(t.nbytes(), u.nbytes()) << name;
    EXPECT_EQ(std::memcmp(t.raw(), u.raw(), t.nbytes()), 0) << name;
  }
  // The model of a checkpoint cannot change on resume.
  EXPECT_EQ(run("--resume split --steps 8 --set model.hidden_size=32"), 2);
  EXPECT_NE(read("err.txt").find("cannot change"), std::string::npos) << read("err.txt");
}

TEST_F(TrainCli, BadRequestsExitWithStatus2) {
  if (!cuda_available()) {
    // No GPU here: refused before anything is written.
    EXPECT_EQ(run("--config train.json --out r1 --device cuda"), 2);
    EXPECT_NE(read("err.txt").find("--device cuda: no CUDA device is present"), std::string::npos)
        << read("err.txt");
    EXPECT_FALSE(fs::exists(dir_ / "r1"));
  }
  EXPECT_EQ(run("--config train.json --out r1b --device tpu"), 2);
  EXPECT_NE(read("err.txt").find("--device must be cpu or cuda, got 'tpu'"), std::string::npos);
  EXPECT_EQ(run("--config train.json --out r2 --set no_such_key=1"), 2);
  EXPECT_NE(read("err.txt").find("no_such_key"), std::string::npos) << read("err.txt");
  EXPECT_EQ(run("--config train.json --out r3 --set lr=1e30 --set grad_clip=0"), 2);
  EXPECT_NE(read("err.txt").find("step "), std::string::npos) << read("err.txt");
  EXPECT_NE(read("err.txt").find("not finite"), std::string::npos) << read("err.txt");
  // The typed options are validated like the file's keys, and win over --set.
  EXPECT_EQ(run("--config train.json --out r6 --set steps=4 --steps 0"), 2);
  EXPECT_NE(read("err.txt").find("--steps: 0 is out of range"), std::string::npos)
      << read("err.txt");
  EXPECT_EQ(run("--config train.json --out r7 --seed -1"), 2);
  EXPECT_NE(read("err.txt").find("--seed: -1 is out of range"), std::string::npos)
      << read("err.txt");
  EXPECT_EQ(run("--config train.json --out r8 --set steps=2.5"), 2);
  EXPECT_NE(read("err.txt").find("'steps' must be an integer, got 2.5"), std::string::npos)
      << read("err.txt");
  EXPECT_EQ(run("--resume nowhere"), 2);
  EXPECT_NE(read("err.txt").find("no training run to resume"), std::string::npos);
  std::ofstream(path("broken.json")) << R"({"model": "small_model.json", "steps": 2, "lrate": 1})";
  EXPECT_EQ(run("--config broken.json --out r4"), 2);
  EXPECT_NE(read("err.txt").find("unknown key 'lrate'"), std::string::npos) << read("err.txt");
  std::ofstream(path("bad_json.json")) << R"({"steps": 2,)";
  EXPECT_EQ(run("--config bad_json.json --out r5"), 2);
  EXPECT_NE(read("err.txt").find("bad_json.json"), std::string::npos) << read("err.txt");
}

}  // namespace
}  // namespace hlm
