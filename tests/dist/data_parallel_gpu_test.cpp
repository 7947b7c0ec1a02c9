// Data parallelism on GPUs (train/data_parallel.h over dist/nccl_comm.h): the trainer in 2
// processes under mpirun on CUDA (`hlm_dist_check --train`, the trainer as `hybridlm train --device
// cuda` runs it) against one process on the same config. The gradients
// and values move over NCCL (in the emulation build, the NCCL stand-in over MPI); every loss term
// of the 3 steps (both indexer stages) within 1e-5 of the objective (FP32: the sums are taken in
// another order), the checkpoint written in the one-process layout. Then the same with the
// experts split over the two processes (expert parallelism: the MoE layers' all-to-alls over NCCL
// too), and with each part of the batch split along its tokens over the two (context
// parallelism: the same model, its DSA layer and MTP block too), and with the attention heads and
// dense MLP channels split over the two (tensor parallelism, its sums over NCCL). On GPUs each
// rank needs its own device.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/device.h"
#include "core/safetensors.h"
#include "dist/comm.h"
#include "dist/nccl_comm.h"
#include "testing.h"

namespace hlm {
namespace {

namespace fs = std::filesystem;

// The shared small model (testing::kSmallModelJson) at the sizes the CUDA kernels take (KDA head
// dim 32), with a KDA layer after its DSA layer and nonzero aux and indexer loss coefficients.
std::string model_json() {
  nlohmann::json m = nlohmann::json::parse(testing::kSmallModelJson);
  const nlohmann::json gpu = nlohmann::json::parse(R"({
    "vocab_size": 40, "hidden_size": 32, "num_hidden_layers": 3, "layer_pattern": "KDK",
    "intermediate_size": 48, "linear_head_dim": 32, "q_lora_rank": 16, "kv_lora_rank": 16,
    "qk_nope_head_dim": 8, "v_head_dim": 8, "index_head_dim": 16, "index_topk": 6,
    "moe_intermediate_size": 16, "dsa_indexer_loss_coeff": 0.1, "router_aux_loss_coef": 0.01
  })");
  m.update(gpu);
  return m.dump();
}

const char* kTrain = R"({
  "model": "model.json", "steps": 3, "tokens_per_step": 96, "lr": 0.01, "warmup_steps": 2,
  "eval_interval": 0, "eval_batches": 1, "log_interval": 1, "checkpoint_interval": 3,
  "dsa_dense_warmup_steps": 1, "mqar": {"min_pairs": 2, "max_pairs": 4}
})";

std::string read(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<nlohmann::json> metrics(const fs::path& run) {
  std::vector<nlohmann::json> v;
  std::istringstream in(read(run / "metrics.jsonl"));
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) v.push_back(nlohmann::json::parse(line));
  return v;
}

TEST(DataParallelGpu, TwoProcessesTrainAsOne) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  if (!dist::have_mpi() || !dist::have_nccl()) GTEST_SKIP() << "this build has no MPI or NCCL";
  if (!testing::mpirun_available()) GTEST_SKIP() << "no mpirun on this machine";
  if (!cuda_emulated() && cuda_device_count() < 2) GTEST_SKIP() << "one GPU: NCCL needs two";
  const fs::path dir = fs::temp_directory_path() / fmt::format("hlm_dp_gpu_{}", ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "model.json") << model_json();
  std::ofstream(dir / "train.json") << kTrain;
  auto train = [&](int n, const std::string& out, int ep = 1, int cp = 1,
                   const std::string& config = "train.json", int tp = 1) {
    std::string cmd = "cd " + dir.string() + " && OMP_NUM_THREADS=1 ";
    if (n > 1) cmd += testing::mpirun_prefix(n);
    cmd += testing::dist_check() + " --train " + config + " " + out + " cuda " +
           std::to_string(ep) + " " + std::to_string(cp) + " " + std::to_string(tp) +
           " > out.txt 2>&1";
    const int st = std::system(cmd.c_str());
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  };
  ASSERT_EQ(train(1, "one"), 0) << read(dir / "out.txt");
  ASSERT_EQ(train(2, "two"), 0) << read(dir / "out.txt");
  EXPECT_NE(read(dir / "out.txt").find("data parallel: 2 processes (mpi backend)"),
            std::string::npos);
  ASSERT_EQ(train(2, "ep", 2), 0) << read(dir / "out.txt");
  EXPECT_NE(read(dir / "out.txt").find("expert parallel: 1 groups of 2 processes"),
            std::string::npos);
  ASSERT_EQ(train(2, "tp", 1, 1, "train.json", 2), 0) << read(dir / "out.txt");
  EXPECT_NE(read(dir / "out.txt").find("tensor parallel: 1 groups of 2 processes (nccl backend)"),
            std::string::npos);
  ASSERT_EQ(train(2, "cp", 1, 2), 0) << read(dir / "out.txt");
  EXPECT_NE(read(dir / "out.txt").find("context parallel: 1 groups of 2 processes (nccl backend)"),
            std::string::npos);
  const auto first = metrics(dir / "one");
  ASSERT_EQ(first.size(), 3u);
  EXPECT_GT(double(first.back().at("indexer_loss")), 0);
  EXPECT_GT(double(first.back().at("aux_loss")), 0);
  EXPECT_GT(double(first.back().at("mtp_loss")), 0);
  const std::string ref = "one";
  for (const char* run : {"two", "ep", "cp", "tp"}) {
    const auto b = metrics(dir / ref);
    const auto a = metrics(dir / run);
    ASSERT_EQ(a.size(), 3u) << run;
    for (size_t i = 0; i < a.size(); ++i)
      for (const char* k : {"loss", "objective", "mtp_loss", "aux_loss", "indexer_loss"})
        EXPECT_LE(std::fabs(double(a[i].at(k)) - double(b[i].at(k))),
                  1e-5 * std::fabs(double(b[i].at("objective"))))
            << run << " step " << i + 1 << " " << k;
    // The checkpoint of two GPU processes holds the one-process layout (the experts whole).
    for (const char* file : {"trainer_state.safetensors", "model.safetensors"}) {
      const auto sa = safetensors::load((dir / run / file).string());
      const auto sb = safetensors::load((dir / ref / file).string());
      EXPECT_EQ(sa.tensors.size(), sb.tensors.size()) << run << " " << file;
      for (const auto& [name, t] : sb.tensors) {
        ASSERT_TRUE(sa.tensors.count(name)) << run << " " << name;
        EXPECT_EQ(sa.tensors.at(name).shape(), t.shape()) << run << " " << name;
      }
    }
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace hlm
