// The layout of a parallel training step (model/parallel_plan.h) on GLM-5.3-Flash's shapes: one
// GPU is the unsharded training estimate; over a layout the shards add up to the whole (every
// parameter held by its ep group, every optimizer state once per tp rank); the groups partition
// the ranks; the traffic of a parallelism is zero when it is off and follows the ring volumes;
// layouts that do not fit the model or the step are refused, naming the reason.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>

#include "model/config.h"
#include "model/config_limits.h"
#include "model/parallel_plan.h"
#include "testing.h"

namespace hlm {
namespace {

ModelConfig flash() {
  return ModelConfig::load(std::string(HLM_SOURCE_DIR) + "/configs/glm5_3_flash.json");
}

TEST(ParallelPlan, OneGpuIsTheUnshardedEstimate) {
  const ModelConfig c = flash();
  const ParallelPlan p = plan_parallel(c, {}, 4096, 4096, true);
  const int64_t P = parameter_count(c, true);
  EXPECT_EQ(p.held_dense + p.held_experts, P);
  EXPECT_EQ(p.weights, uint64_t(2 * P));
  EXPECT_EQ(p.gradients, uint64_t(4 * P));
  EXPECT_EQ(p.optimizer, uint64_t(12 * P));
  Workload w;
  w.tokens = 4096;
  w.max_seq_len = 4096;
  w.training = true;
  w.dtype = DType::bf16;
  EXPECT_EQ(p.activations, estimate_memory(c, w).activations);
  EXPECT_EQ(p.traffic(), 0u);
  // 288 experts of 3 x 4096 x moe_intermediate_size in every MoE layer and the MTP block's.
  EXPECT_EQ(routed_expert_parameter_count(c, true),
            (c.num_hidden_layers - 3 + 1) * 288 * 3 * c.hidden_size * c.moe.moe_intermediate_size);
}

TEST(ParallelPlan, ShardsAddUpAndGroupsPartitionTheRanks) {
  const ModelConfig c = flash();
  const int64_t P = parameter_count(c, true), Pe = routed_expert_parameter_count(c, true);
  // What tp splits: the attention layers' per-head projections and the dense MLPs (most of the
  // non-expert parameters; the embedding and head, MoE routers and shared experts stay whole).
  const int64_t S = tensor_parallel_split_count(c, true);
  EXPECT_GT(S, 0);
  EXPECT_LT(S, P - Pe);
  for (const char* spec : {"dp=8,ep=8,cp=2", "dp=4,ep=2", "dp=2,cp=2,tp=2,ep=4", "tp=4"}) {
    SCOPED_TRACE(spec);
    const ParallelLayout l = ParallelLayout::parse(spec);
    const ParallelPlan p = plan_parallel(c, l, l.dp * 8192, 8192, true);
    EXPECT_EQ(p.held_experts * l.ep, Pe);
    // A tp group holds the split parameters once and the rest on every rank.
    EXPECT_NEAR(double(p.held_dense * l.tp), double(S) + double(P - Pe - S) * double(l.tp),
                double(l.tp));  // rounded down
    EXPECT_EQ(p.tokens_per_gpu * l.dp * l.cp, p.tokens);
    // Over all the GPUs: the split parameters' optimizer state once, every other parameter's once
    // per tp rank (to rounding).
    const double states = double(p.optimizer) * double(l.world()) / 12.0;
    EXPECT_NEAR(states, double(S) + double(P - S) * double(l.tp), 1e-9 * double(P) + l.world());
    // Each kind of group partitions the world; a rank's groups hold it.
    for (auto group : {&ParallelPlan::tp_group, &ParallelPlan::cp_group, &ParallelPlan::dp_group,
                       &ParallelPlan::ep_group}) {
      std::multiset<int64_t> seen;
      for (int64_t r = 0; r < l.world(); ++r) {
        const std::vector<int64_t> g = (p.*group)(r);
        EXPECT_TRUE(std::find(g.begin(), g.end(), r) != g.end()) << r;
        if (g.front() == r) seen.insert(g.begin(), g.end());
      }
      EXPECT_EQ(int64_t(seen.size()), l.world());
      EXPECT_EQ(int64_t(std::set<int64_t>(seen.begin(), seen.end()).size()), l.world());
    }
    EXPECT_EQ(int64_t(p.ep_group(0).size()), l.ep);
    EXPECT_EQ(int64_t(p.dp_group(0).size()), l.dp);
  }
}

TEST(ParallelPlan, TrafficFollowsTheRingVolumes) {
  const ModelConfig c = flash();
  // Expert all-to-all: 4 t k D 2 (ep - 1) / ep per MoE layer (46 with the MTP block's).
  const ParallelPlan a = plan_parallel(c, ParallelLayout::parse("dp=4,ep=4"), 4 * 8192, 8192, true);
  EXPECT_EQ(a.ep_alltoall, uint64_t(4.0 * 8192 * 8 * 4096 * 2 * 0.75 * 43 + 0.5));
  EXPECT_EQ(a.cp_exchange, 0u);
  EXPECT_EQ(a.tp_allreduce, 0u);
  // Twice the ranks per expert group: (n - 1) / n goes from 3/4 to 7/8.
  const ParallelPlan b = plan_parallel(c, ParallelLayout::parse("dp=8,ep=8"), 8 * 8192, 8192, true);
  EXPECT_NEAR(double(b.ep_alltoall) / double(a.ep_alltoall), (7.0 / 8) / (3.0 / 4), 1e-9);
  // Gradients: FP32 reduce-scatter, twice the BF16 all-gather of the parameters.
  EXPECT_NEAR(double(a.dp_gradients), 2.0 * double(a.dp_parameters), 2.0);
  // Context parallelism moves states and key rows; tensor parallelism activations.
  const ParallelPlan d = plan_parallel(c, ParallelLayout::parse("cp=2,tp=2"), 8192, 8192, true);
  EXPECT_GT(d.cp_exchange, 0u);
  // Per DSA layer (the MTP block's too), as DsaLayer exchanges under context parallelism: the
  // t = 4096 tokens' BF16 latent rows and FP32 indexer keys and KPool gates gathered, their FP32
  // gradients reduce-scattered: (cp - 1) t (6 (r_kv + d_r) + 8 x 2 d_I). The KDA part as below.
  {
    const KdaHparams& k = c.kda;
    const double kda =
        4.0 * (double(k.num_v_heads * k.head_dim) * (2 * k.v_head_dim + k.head_dim) +
               2.0 * double(k.conv_kernel - 1) *
                   double(2 * k.num_heads * k.head_dim + k.num_v_heads * k.v_head_dim));
    ASSERT_GT(c.indexer.kpool, 1);
    const double dsa = 4096.0 * (6.0 * double(c.mla.kv_lora_rank + c.mla.qk_rope_head_dim) +
                                 16.0 * double(c.indexer.head_dim));
    EXPECT_NEAR(double(d.cp_exchange),
                kda * double(c.count_layers(LayerKind::kda)) +
                    dsa * double(c.count_layers(LayerKind::dsa) + 1),
                2.0);
  }
  // The KDA part, per layer: 4 (cp - 1) (HV K (2V + K) + 2 (W - 1) (2 H K + HV V)); a model of
  // KDA layers only moves nothing else.
  ModelConfig kda_only = c;
  kda_only.layer_kinds.assign(size_t(kda_only.num_hidden_layers), LayerKind::kda);
  const ParallelPlan e = plan_parallel(kda_only, ParallelLayout::parse("cp=4"), 8192, 8192, false);
  const double per_layer = 4.0 * 3 * (64.0 * 128 * (2 * 128 + 128) + 2.0 * 3 * (3 * 64 * 128));
  EXPECT_EQ(e.cp_exchange, uint64_t(per_layer * double(kda_only.num_hidden_layers) + 0.5));
  // Tensor parallelism, as the model exchanges (t = 4096 tokens per GPU, D = 4096, (tp-1)/tp =
  // 1/2): all-reduces of the BF16 [t, D] outputs and input gradients of the 46 attention layers
  // and the 3 dense MLPs, all-gathers of the 43 MoE layers' rows forward and backward; with the
  // indexer loss on, also each DSA layer's FP32 indexer-loss target [t, index_topk] once.
  const double act = 4096.0 * 4096 * 2;
  EXPECT_NEAR(double(d.tp_allreduce), 0.5 * (4 * act * (46 + 3) + 2 * act * 43), 1.0);
  int64_t loss_layers = 1;  // the MTP block's
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    loss_layers += c.layer_kind(i) == LayerKind::dsa &&
                   (c.indexer_kinds.empty() || c.indexer_kinds[size_t(i)] == IndexerKind::full);
  ModelConfig with_loss = c;
  with_loss.indexer.loss_coeff = 0.1;
  const ParallelPlan dl =
      plan_parallel(with_loss, ParallelLayout::parse("cp=2,tp=2"), 8192, 8192, true);
  EXPECT_GT(loss_layers, 1);
  EXPECT_NEAR(double(dl.tp_allreduce) - double(d.tp_allreduce),
              0.5 * 2 * 4096.0 * double(c.indexer.topk) * 4 * double(loss_layers), 2.0);
}

TEST(ParallelPlan, LayoutsThatDoNotFitAreRefused) {
  const ModelConfig c = flash();
  auto plan = [&](const char* spec, int64_t T, int64_t L) {
    plan_parallel(c, ParallelLayout::parse(spec), T, L, true);
  };
  testing::expect_error([&] { plan("dp=3,ep=2", 3 * 4096, 4096); }, "must divide dp x cp = 3");
  testing::expect_error([&] { plan("dp=64,ep=64", 64 * 4096, 4096); }, "the 288 routed experts");
  testing::expect_error([&] { plan("tp=3", 4096, 4096); }, "tp = 3 must divide");
  testing::expect_error([&] { plan("cp=3", 4096, 4096); }, "cp = 3 must divide the sequence");
  testing::expect_error([&] { plan("dp=2", 4096, 4096); }, "whole sequences");
  for (const char* bad : {"dp=0", "dp=x", "dp", "zz=2", "dp=2,dp=2", "", "dp=2,", "tp=-1"})
    testing::expect_error([&] { ParallelLayout::parse(bad); }, "--parallel");
}

}  // namespace
}  // namespace hlm
