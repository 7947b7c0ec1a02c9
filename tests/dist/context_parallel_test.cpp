// Context parallelism (dist/context_parallel.h, KdaLayer's chunkwise CP): the slice description in
// this process, one rank against the plain layer bit for bit, and the layer over 2, 3 and 4
// processes (`mpirun --oversubscribe`) through `hlm_dist_check --kda-cp`, whose ranks compare
// their slices of the output and input gradient, and the parameter gradients summed over the
// ranks, with the whole batch run in each process (tests/dist/dist_check.cpp), chunkwise and
// headwise.
#include <gtest/gtest.h>

#include <string>

#include "core/rng.h"
#include "dist/comm.h"
#include "dist/context_parallel.h"
#include "layers/kda/kda_layer.h"
#include "model/hybrid_model.h"
#include "testing.h"

namespace hlm {
namespace {

using testing::FakeGroup;

TEST(CpSlice, DescribesEveryRanksSlice) {
  // Sequences [0, 70) [70, 73) [73, 173); ranks [0, 71) [71, 72) [72, 130) [130, 173).
  const SeqLayout seqs = SeqLayout::from_lengths({70, 3, 100});
  const std::vector<int64_t> bounds{0, 71, 72, 130, 173};
  FakeGroup g(2, 4);
  const dist::CpSlice s(g, seqs, bounds);
  EXPECT_EQ(s.size(), 4);
  EXPECT_EQ(s.rank(), 2);
  EXPECT_FALSE(s.continues(0));
  EXPECT_TRUE(s.continues(1));
  EXPECT_TRUE(s.continues(2));
  EXPECT_TRUE(s.continues(3));
  EXPECT_TRUE(s.goes_on(0) && s.goes_on(1) && s.goes_on(2));
  EXPECT_FALSE(s.goes_on(3));
  EXPECT_FALSE(s.single(0));  // [0, 71) crosses the start at 70
  EXPECT_TRUE(s.single(1));
  EXPECT_FALSE(s.single(2));
  EXPECT_TRUE(s.single(3));
  EXPECT_EQ(s.local().offsets(), (std::vector<int64_t>{0, 1, 58}));
  EXPECT_EQ(s.sequence_begin(72), 70);
  EXPECT_EQ(s.sequence_begin(73), 73);
  EXPECT_EQ(s.owner(71), 1);
  EXPECT_EQ(s.owner(172), 3);
  // A bound at a sequence start continues nothing; empty sequences are skipped.
  FakeGroup g1(1, 2);
  const dist::CpSlice t(g1, SeqLayout::from_lengths({70, 0, 3, 0}), {0, 70, 73});
  EXPECT_FALSE(t.continues(1));
  EXPECT_FALSE(t.goes_on(0));
  EXPECT_EQ(t.local().offsets(), (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(dist::CpSlice::even_bounds(10, 4), (std::vector<int64_t>{0, 2, 5, 7, 10}));
}

TEST(CpSlice, RefusesBoundsThatDoNotSplitTheBatch) {
  const SeqLayout seqs = SeqLayout::from_lengths({5, 5});
  FakeGroup g(0, 2);
  testing::expect_error([&] { dist::CpSlice(g, seqs, {0, 10}); }, "group size + 1 = 3 offsets");
  testing::expect_error([&] { dist::CpSlice(g, seqs, {0, 4, 9}); }, "from 0 to the batch's 10");
  testing::expect_error([&] { dist::CpSlice(g, seqs, {0, 0, 10}); }, "rank 0's slice [0, 0)");
  FakeGroup g3(0, 3);
  testing::expect_error([&] { dist::CpSlice(g3, seqs, {0, 7, 6, 10}); }, "rank 1's slice [7, 6)");
  testing::expect_error([] { dist::CpSlice::even_bounds(3, 4); }, "3 tokens cannot be split");
}

// The layer under a one-rank group: the plain layer's bits (y, dx, parameter gradients).
TEST(KdaContextParallel, OneRankIsThePlainLayer) {
  KdaConfig c;
  c.hidden_size = 24;
  c.num_heads = 2;
  c.num_v_heads = 2;
  c.head_k_dim = c.head_v_dim = 8;
  c.decay_rank = c.output_gate_rank = 4;
  PrecisionPolicy pol;
  pol.default_kind = GemmKind::native;
  KdaLayer l(c, pol, "kda", DType::f64);
  l.init_weights(5);
  const SeqLayout seqs = SeqLayout::from_lengths({40, 3, 90});
  Rng rng(9);
  Tensor x = Tensor::empty({133, 24}, DType::f64), dy = Tensor::empty({133, 24}, DType::f64);
  rng.fill_uniform(x, -1, 1);
  rng.fill_uniform(dy, -1, 1);
  const Context ctx{true, false};
  l.zero_grad();
  KdaLayer::Saved s;
  const Tensor y = l.forward(ctx, x, seqs, nullptr, &s);
  const Tensor dx = l.backward(ctx, dy, s).dx;
  std::vector<Tensor> g;
  for (auto& [n, p] : l.named_parameters()) g.push_back(p->grad.clone());
  std::unique_ptr<dist::Comm> one = dist::self_comm();
  const dist::CpSlice slice(*one, seqs, {0, 133});
  l.zero_grad();
  KdaLayer::Saved sc;
  EXPECT_TRUE(testing::bit_equal(l.forward(ctx, x, slice, &sc), y));
  EXPECT_TRUE(testing::bit_equal(l.backward(ctx, dy, sc).dx, dx));
  size_t i = 0;
  for (auto& [n, p] : l.named_parameters()) EXPECT_TRUE(testing::bit_equal(p->grad, g[i++])) << n;
  // Headwise on one rank: every head here, the same bits.
  l.zero_grad();
  EXPECT_TRUE(testing::bit_equal(l.forward(ctx, x, slice, &sc, KdaCpMode::headwise), y));
  EXPECT_TRUE(testing::bit_equal(l.backward(ctx, dy, sc).dx, dx));
  i = 0;
  for (auto& [n, p] : l.named_parameters()) EXPECT_TRUE(testing::bit_equal(p->grad, g[i++])) << n;
  // Bad input: rows that are not the slice, final-state gradients of a CP forward.
  testing::expect_error([&] { l.forward(ctx, x.slice(0, 0, 100).contiguous(), slice, &sc); },
                        "holds tokens [0, 133) of the batch, x has 100 rows");
  l.forward(ctx, x, slice, &sc);
  KdaState d_final;
  testing::expect_error([&] { l.backward(ctx, dy, sc, &d_final); }, "no final states");
}

// f64 on 2, 3 and 4 ranks (every path: headwise at 2 and 4), f32 on 4.
TEST(KdaContextParallel, MatchesTheWholeBatchOnTwoThreeAndFourRanks) {
  if (!dist::have_mpi()) GTEST_SKIP() << "this build has no MPI backend";
  for (const auto& [dt, n] : {std::pair{"f64", 2}, {"f64", 3}, {"f64", 4}, {"f32", 4}}) {
    SCOPED_TRACE(std::string(dt) + " x " + std::to_string(n));
    testing::expect_dist_check(n, std::string("--kda-cp ") + dt + " cpu");
  }
}

// The whole model (KDA layers, dense MLP, MoE with the sequence aux loss, mHC) over a slice per
// rank against the whole batch (tests/dist/dist_check.cpp, --model-cp): f64 on 2, 3 and 4 ranks
// (headwise at 2 and 4), f32 on 4; every recompute mode.
TEST(ModelContextParallel, MatchesTheWholeBatchOnTwoThreeAndFourRanks) {
  if (!dist::have_mpi()) GTEST_SKIP() << "this build has no MPI backend";
  for (const auto& [dt, n] : {std::pair{"f64", 2}, {"f64", 3}, {"f64", 4}, {"f32", 4}}) {
    SCOPED_TRACE(std::string(dt) + " x " + std::to_string(n));
    testing::expect_dist_check(n, std::string("--model-cp ") + dt + " cpu");
  }
}

// The model over a slice in one process (a group of one): the plain forward's loss and gradients,
// bit for bit (the KDA layers' one-rank path, the aux loss's whole counts from this slice alone);
// and the refusals: DSA layers and the MTP block, a slice of the wrong size, cu_seqlens that are
// not the slice's.
TEST(ModelContextParallel, OneRankIsThePlainModelAndRefusals) {
  nlohmann::json j = nlohmann::json::parse(testing::kSmallModelJson);
  j["layer_pattern"] = "KK";
  j["router_aux_loss_coef"] = 0.05;
  const ModelConfig kda_cfg = ModelConfig::from_json(j);
  j["layer_pattern"] = "KD";  // a DSA layer with the KPool indexer (CPU: context parallel too)
  j["dsa_indexer_loss_coeff"] = 0.5;
  const ModelConfig dsa_cfg = ModelConfig::from_json(j);
  const SeqLayout seqs = SeqLayout::from_lengths({9, 14});
  const Tensor tokens = Tensor::from_vector<int64_t>(
      {23}, {1, 5, 7, 2, 9, 11, 3, 3, 4, 8, 6, 0, 12, 13, 2, 7, 19, 21, 5, 5, 1, 17, 23});
  const Tensor targets = Tensor::from_vector<int64_t>(
      {23}, {5, 7, 2, 9, 11, 3, 3, 4, -100, 6, 0, 12, 13, 2, 7, 19, 21, 5, 5, 1, 17, 23, -100});
  const std::unique_ptr<dist::Comm> one = dist::self_comm();
  const dist::CpSlice slice(*one, seqs, {0, 23});
  const Context ctx{true, false};
  for (const ModelConfig* cfg : {&kda_cfg, &dsa_cfg})
    for (const KdaCpMode mode : {KdaCpMode::chunkwise, KdaCpMode::headwise}) {
      // The DSA model with its MTP block.
      HybridModel m(*cfg, {.dtype = DType::f64, .seed = 3, .mtp = cfg == &dsa_cfg});
      auto run = [&](bool cp) {
        m.zero_grad();
        ModelInputs in;
        in.tokens = tokens;
        in.targets = targets;
        if (cp) {
          in.cp = &slice;
          in.cp_mode = mode;
        } else {
          in.cu_seqlens = testing::cu_of({9, 14});
        }
        HybridModel::SavedPtr s;
        const ModelOutput o = m.forward(ctx, in, &s);
        m.backward(ctx, *s);
        std::vector<Tensor> g;
        for (const auto& [name, p] : m.named_parameters()) g.push_back(p->grad.clone());
        return std::pair{o, g};
      };
      const auto [plain, gp] = run(false);
      const auto [sliced, gs] = run(true);
      EXPECT_GT(plain.aux_loss, 0);
      EXPECT_EQ(sliced.loss, plain.loss);
      EXPECT_EQ(sliced.aux_loss, plain.aux_loss);
      if (cfg == &dsa_cfg) EXPECT_GT(plain.indexer_loss, 0);
      if (cfg == &dsa_cfg) EXPECT_GT(plain.mtp_loss, 0);
      EXPECT_EQ(sliced.indexer_loss, plain.indexer_loss);
      EXPECT_EQ(sliced.mtp_loss, plain.mtp_loss);
      for (size_t i = 0; i < gp.size(); ++i) EXPECT_TRUE(testing::bit_equal(gs[i], gp[i])) << i;
    }
  // Refusals.
  HybridModel kda(kda_cfg, {.dtype = DType::f64, .seed = 3, .mtp = false});
  auto forward = [&](HybridModel& m, const Tensor& t, const Tensor& cu) {
    ModelInputs in;
    in.tokens = t;
    in.targets = t.numel() == 23 ? targets : Tensor();
    in.cu_seqlens = cu;
    in.cp = &slice;
    HybridModel::SavedPtr s;
    m.forward(ctx, in, &s);
  };
  testing::expect_error([&] { forward(kda, tokens.slice(0, 0, 20).contiguous(), {}); },
                        "holds 23 tokens, tokens has 20");
  testing::expect_error([&] { forward(kda, tokens, testing::cu_of({23})); },
                        "cu_seqlens must be the slice's own layout");
}

}  // namespace
}  // namespace hlm
