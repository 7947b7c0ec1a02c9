// The trainer with --device cuda (TrainerOptions::device): a small GLM-5.3-Flash-shaped hybrid
// (KDA, DSA with KPool, MoE, mHC, MTP; head dims of 32, the CUDA KDA kernels' least) trained on
// MQAR. On CUDA the first step's loss equals the CPU run's within 1e-6 and the second within 1e-3
// (Adam's early steps turn last-place gradient differences of near-zero gradients into full
// steps); a CUDA run stopped after step 1 and resumed on CUDA ends bit-identical to an
// uninterrupted CUDA run of 3 steps (parameters and optimizer state); its checkpoint also resumes
// on the CPU.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/device.h"
#include "testing.h"
#include "train/trainer.h"

namespace hlm::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

json gpu_small_train(int64_t steps) {
  const json model = json::parse(R"({
    "model_type": "glm5_next_text", "vocab_size": 40, "hidden_size": 32,
    "num_hidden_layers": 2, "layer_pattern": "KD", "first_k_dense_replace": 1,
    "intermediate_size": 48, "initializer_range": 0.2,
    "linear_num_heads": 2, "linear_head_dim": 32, "linear_conv_kernel_dim": 4,
    "linear_lower_bound": -5.0,
    "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 0, "v_head_dim": 8,
    "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4, "index_kpool": 2,
    "dsa_indexer_loss_coeff": 0.1,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "moe_intermediate_size": 16, "router_aux_loss_coef": 0.01,
    "mhc": true, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "num_nextn_predict_layers": 1, "mtp_loss_scaling_factor": 0.3,
    "gemm_precision": "native"
  })");
  return json{{"model", model},
              {"steps", steps},
              {"tokens_per_step", 64},
              {"lr", 1e-2},
              {"warmup_steps", 1},
              {"eval_interval", 0},
              {"eval_batches", 1},
              {"log_interval", 1},
              {"checkpoint_interval", 0},
              {"dsa_dense_warmup_steps", 1},
              {"mqar", {{"min_pairs", 2}, {"max_pairs", 4}}}};
}

class TrainerGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ =
        fs::temp_directory_path() / fmt::format("hlm_trainer_gpu_{}_{}", ::getpid(), info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  TrainerOptions opts(const std::string& name, Device dev) const {
    TrainerOptions o;
    o.out_dir = (dir_ / name).string();
    o.log = nullptr;
    o.plot = false;
    o.print_summary = false;
    o.device = dev;
    return o;
  }
  fs::path dir_;
};

bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor x = testing::cpu(a).contiguous(), y = testing::cpu(b).contiguous();
  return x.dtype() == y.dtype() && x.shape() == y.shape() &&
         std::memcmp(x.raw(), y.raw(), x.nbytes()) == 0;
}

TEST_F(TrainerGpu, StepsOnCudaFollowTheCpuRun) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  const TrainConfig cfg = TrainConfig::from_json(gpu_small_train(2), "test");
  std::vector<double> first, last;
  for (Device dev : {Device::cpu, Device::cuda}) {
    TrainConfig c1 = cfg;
    c1.steps = 1;
    Trainer t1(c1, opts(std::string("one_") + device_name(dev), dev));
    first.push_back(t1.run().final_loss);
    Trainer t3(cfg, opts(std::string("two_") + device_name(dev), dev));
    last.push_back(t3.run().final_loss);
    if (dev == Device::cuda) EXPECT_FALSE(t3.model().named_parameters()[0].second->value.is_cpu());
  }
  std::printf("  loss of step 1: CPU %.9g  CUDA %.9g; of step 2: CPU %.9g  CUDA %.9g\n", first[0],
              first[1], last[0], last[1]);
  EXPECT_NEAR(first[1], first[0], 1e-6 * first[0]);
  EXPECT_NEAR(last[1], last[0], 1e-3 * last[0]);
}

TEST_F(TrainerGpu, ResumesBitExactlyOnCudaAndOnTheCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  const TrainConfig cfg = TrainConfig::from_json(gpu_small_train(3), "test");
  Trainer whole(cfg, opts("whole", Device::cuda));
  whole.run();
  TrainerOptions o = opts("split", Device::cuda);
  o.stop_after = 1;
  Trainer first(cfg, o);
  first.run();
  TrainerOptions r = opts("split", Device::cuda);
  r.resume = true;
  Trainer second(cfg, r);
  second.run();
  ASSERT_EQ(second.step(), whole.step());
  auto pa = whole.model().named_parameters(), pb = second.model().named_parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_TRUE(same_bits(pa[i].second->value, pb[i].second->value)) << pa[i].first;
  const auto sa = whole.optimizer().state_dict(), sb = second.optimizer().state_dict();
  for (const auto& [name, t] : sa) EXPECT_TRUE(same_bits(t, sb.at(name))) << name;
  // The checkpoint of a CUDA run continues on the CPU.
  TrainConfig more = cfg;
  more.steps = 4;
  TrainerOptions c = opts("split", Device::cpu);
  c.resume = true;
  Trainer on_cpu(more, c);
  const TrainSummary s = on_cpu.run();
  EXPECT_EQ(on_cpu.step(), 4);
  EXPECT_TRUE(std::isfinite(s.final_loss));
}

}  // namespace
}  // namespace hlm::train
