// Tensor parallelism (layers/tensor_parallel.h): the parameter slicing and its inverse, and, in one
// process, the n ranks' layers of a KDA layer and of an MLP built from the whole layer's slices:
// their outputs and input gradients summed in rank order are the whole layer's, each sliced
// parameter's gradient is the slice of the whole layer's, and each replicated parameter's
// gradients sum to the whole layer's (f64, so the only difference is the order of the sums). The
// same over 2 and 4 processes with the group's own all-reduce, DSA's indexer loss included, runs
// through `hlm_dist_check --tp` (tests/dist/dist_check.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/rng.h"
#include "dist/comm.h"
#include "dist/context_parallel.h"
#include "layers/dsa/dsa_layer.h"
#include "layers/kda/kda_layer.h"
#include "layers/mlp.h"
#include "layers/tensor_parallel.h"
#include "model/config_limits.h"
#include "model/hybrid_model.h"
#include "ops/tensor_ops.h"
#include "testing.h"

namespace hlm {
namespace {

Tensor iota(const Shape& shape) {
  Tensor t = Tensor::empty(shape, DType::f64);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<double>()[i] = double(i);
  return t;
}

// A fused conv weight [2 * 4 + 8, 1, 3] split as q | k | v: rank r holds rows [2r, 2r + 2) of q
// and of k and [4r, 4r + 4) of v; the parts put back give the whole.
TEST(TensorParallelSlices, SegmentsRowsAndColumnsRoundTrip) {
  const TpParam conv{"conv1d.weight", TpSplit::rows, {4, 4, 8}};
  const Tensor w = iota({16, 1, 3});
  std::vector<Tensor> parts;
  for (int r = 0; r < 2; ++r) parts.push_back(tp_shard(w, conv, r, 2));
  ASSERT_EQ(parts[1].shape(), (Shape{8, 1, 3}));
  // Rank 1: q rows 2, 3; k rows 6, 7; v rows 12..15.
  const int64_t want_rows[8] = {2, 3, 6, 7, 12, 13, 14, 15};
  for (int64_t i = 0; i < 8; ++i)
    for (int64_t j = 0; j < 3; ++j)
      EXPECT_EQ(parts[1].data<double>()[i * 3 + j], double(want_rows[i] * 3 + j));
  EXPECT_TRUE(testing::bit_equal(tp_unshard(parts, conv), w));

  // Columns of [3, 8] over 4 ranks: rank r holds columns [2r, 2r + 2).
  const TpParam o{"o_proj.weight", TpSplit::cols, {8}};
  const Tensor m = iota({3, 8});
  std::vector<Tensor> cols;
  for (int r = 0; r < 4; ++r) cols.push_back(tp_shard(m, o, r, 4));
  EXPECT_EQ(cols[2].shape(), (Shape{3, 2}));
  EXPECT_EQ(cols[2].data<double>()[2], 12.0);  // row 1, column 4
  EXPECT_TRUE(testing::bit_equal(tp_unshard(cols, o), m));
  // A replicated parameter is whole on every rank, a copy.
  const TpParam rep{"o_norm.weight", TpSplit::replicated, {}};
  const Tensor part = tp_shard(m, rep, 3, 4);
  EXPECT_TRUE(testing::bit_equal(part, m));
  EXPECT_NE(part.raw(), m.raw());

  testing::expect_error([&] { tp_shard(w, conv, 0, 3); },
                        "'conv1d.weight': a segment of 4 does not split over 3 ranks");
  testing::expect_error(
      [&] {
        tp_shard(iota({15, 1, 3}), conv, 0, 2);
      },
      "'conv1d.weight' has 15 along dimension 0, its segments sum to 16");
  testing::expect_error([&] { tp_shard(w, conv, 2, 2); }, "rank 2 is not in a group of 2");
  testing::expect_error([&] { tp_shard(iota({8}), o, 0, 2); },
                        "'o_proj.weight' has 1 dimensions, too few to split dimension 1");
  testing::expect_error(
      [&] {
        tp_unshard({parts[0], cols[0]}, conv);
      },
      "the parts of parameter 'conv1d.weight' differ");
}

Tensor random_rows(int64_t T, int64_t D, Rng& rng) {
  Tensor t = Tensor::empty({T, D}, DType::f64);
  rng.fill_uniform(t, -1, 1);
  return t;
}

// The whole layer's parameter gradients against the n parts' (sliced: put back together;
// replicated: summed in rank order).
void expect_grads_match(Module& whole, std::vector<Module*>& parts,
                        const std::vector<TpParam>& layouts, double tol) {
  for (const TpParam& p : layouts) {
    SCOPED_TRACE(p.name);
    Param* w = whole.find_parameter(p.name);
    ASSERT_NE(w, nullptr);
    std::vector<Tensor> g;
    for (Module* m : parts) g.push_back(m->find_parameter(p.name)->grad);
    Tensor got;
    if (p.split == TpSplit::replicated) {
      got = g[0].clone();
      for (size_t r = 1; r < g.size(); ++r) ops::add_(got, g[r]);
    } else {
      got = tp_unshard(g, p);
    }
    EXPECT_LE(testing::compare(got, w->grad).rel_l2, tol);
    EXPECT_LE(testing::compare(got, w->grad).max_abs, tol);
  }
}

struct KdaCase {
  const char* name;
  KdaConfig c;
};

std::vector<KdaCase> kda_cases() {
  KdaConfig a;  // GLM naming, low-rank gates, the lower-bound gate, GQA (2 value heads per head)
  a.hidden_size = 24;
  a.num_heads = 4;
  a.num_v_heads = 8;
  a.head_k_dim = 8;
  a.head_v_dim = 12;
  a.conv_kernel = 3;
  a.decay_rank = a.output_gate_rank = 5;
  KdaConfig b = a;  // Kimi naming (three convs), full-rank gates, a gate bias, the standard gate
  b.naming = KdaNaming::kimi_linear;
  b.decay_rank = b.output_gate_rank = 0;
  b.output_gate_bias = true;
  b.gate = ops::KdaGateKind::standard;
  b.num_v_heads = 4;
  KdaConfig t = a;  // transformers' naming (the forget_gate child)
  t.naming = KdaNaming::glm5_next_transformers;
  return {{"glm5_next, low rank", a}, {"kimi_linear, full rank", b}, {"transformers", t}};
}

// n KDA layers of 1/n of the heads each, loaded from the whole layer: the sum of their outputs
// and input gradients is the whole layer's, and their gradients are its gradients (f64).
TEST(KdaTensorParallel, PartsSumToTheWholeLayer) {
  PrecisionPolicy policy;
  policy.default_kind = GemmKind::native;
  for (const KdaCase& kc : kda_cases()) {
    SCOPED_TRACE(kc.name);
    KdaLayer whole(kc.c, policy, "kda", DType::f64);
    Rng rng(testing::test_seed(), 41);
    whole.init_weights(rng.next_u64());
    rng.fill_uniform(whole.A_log().value, -0.5, 1.0);
    rng.fill_uniform(whole.dt_bias().value, -1.0, 1.0);
    rng.fill_uniform(whole.o_norm_weight().value, 0.5, 1.5);
    for (auto& [name, p] : whole.named_parameters())
      if (name.find("bias") != std::string::npos && name.find("dt_bias") == std::string::npos)
        rng.fill_uniform(p->value, -0.5, 0.5);
    const std::vector<TpParam> layouts = kda_tp_params(kc.c);
    ASSERT_EQ(layouts.size(), whole.named_parameters().size());
    const SeqLayout seqs = testing::seqs_of({37, 5, 70});
    const Tensor x = random_rows(seqs.total_tokens(), kc.c.hidden_size, rng);
    const Tensor dy = random_rows(seqs.total_tokens(), kc.c.hidden_size, rng);
    const Context ctx{true, false};
    whole.zero_grad();
    KdaLayer::Saved sw;
    const Tensor y = whole.forward(ctx, x, seqs, nullptr, &sw);
    const Tensor dx = whole.backward(ctx, dy, sw).dx;
    for (int n : {1, 2, 4}) {
      SCOPED_TRACE("n = " + std::to_string(n));
      const KdaConfig pc = kda_tp_config(kc.c, n);
      std::vector<std::unique_ptr<KdaLayer>> parts;
      std::vector<Module*> mods;
      Tensor ys, dxs;
      for (int r = 0; r < n; ++r) {
        parts.push_back(std::make_unique<KdaLayer>(pc, policy, "kda", DType::f64));
        KdaLayer& l = *parts.back();
        tp_load_shard(whole, l, layouts, r, n);
        l.zero_grad();
        KdaLayer::Saved s;
        const Tensor yr = l.forward(ctx, x, seqs, nullptr, &s);
        const Tensor dxr = l.backward(ctx, dy, s).dx;
        if (r == 0)
          ys = yr.clone();
        else
          ops::add_(ys, yr);
        if (r == 0)
          dxs = dxr.clone();
        else
          ops::add_(dxs, dxr);
        mods.push_back(&l);
      }
      if (n == 1) {  // one rank is the whole layer, bit for bit
        EXPECT_TRUE(testing::bit_equal(ys, y));
        EXPECT_TRUE(testing::bit_equal(dxs, dx));
      }
      EXPECT_LE(testing::compare(ys, y).rel_l2, 1e-13);
      EXPECT_LE(testing::compare(dxs, dx).rel_l2, 1e-13);
      expect_grads_match(whole, mods, layouts, 1e-12);
    }
    testing::expect_error([&] { kda_tp_config(kc.c, 3); },
                          "a KDA layer's 4 heads do not split over 3 ranks");
  }
}

// The same for the SwiGLU MLP (gate_proj and up_proj column-parallel, down_proj row-parallel),
// with the clamp active on some channels.
TEST(MlpTensorParallel, PartsSumToTheWholeLayer) {
  PrecisionPolicy policy;
  policy.default_kind = GemmKind::native;
  DenseMlpConfig c;
  c.hidden_size = 20;
  c.intermediate_size = 24;
  c.swiglu_limit = 0.6;
  c.dtype = DType::f64;
  c.seed = 7;
  c.init_std = 0.3;
  DenseMlp whole(c, policy, "mlp");
  Rng rng(testing::test_seed(), 42);
  const Tensor x = random_rows(33, c.hidden_size, rng), dy = random_rows(33, c.hidden_size, rng);
  const Context ctx{true, false};
  whole.zero_grad();
  DenseMlp::Saved sw;
  const Tensor y = whole.forward(ctx, x, &sw);
  const Tensor dx = whole.backward(ctx, dy, sw);
  const std::vector<TpParam> layouts = mlp_tp_params(c);
  for (int n : {1, 2, 3, 4}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    std::vector<std::unique_ptr<DenseMlp>> parts;
    std::vector<Module*> mods;
    Tensor ys, dxs;
    for (int r = 0; r < n; ++r) {
      parts.push_back(std::make_unique<DenseMlp>(mlp_tp_config(c, n), policy, "mlp"));
      DenseMlp& l = *parts.back();
      tp_load_shard(whole, l, layouts, r, n);
      l.zero_grad();
      DenseMlp::Saved s;
      const Tensor yr = l.forward(ctx, x, &s);
      const Tensor dxr = l.backward(ctx, dy, s);
      if (r == 0)
        ys = yr.clone();
      else
        ops::add_(ys, yr);
      if (r == 0)
        dxs = dxr.clone();
      else
        ops::add_(dxs, dxr);
      mods.push_back(&l);
    }
    if (n == 1) {
      EXPECT_TRUE(testing::bit_equal(ys, y));
      EXPECT_TRUE(testing::bit_equal(dxs, dx));
    }
    EXPECT_LE(testing::compare(ys, y).rel_l2, 1e-13);
    EXPECT_LE(testing::compare(dxs, dx).rel_l2, 1e-13);
    expect_grads_match(whole, mods, layouts, 1e-12);
  }
  testing::expect_error([&] { mlp_tp_config(c, 5); },
                        "an MLP's 24 intermediate channels do not split over 5 ranks");
}

// MLA D = 16, H = 4, q_lora 8, kv_lora 8, d_nope 4, d_rope dr, d_v 4; indexer (2 heads of 4,
// top-K of pools of P) or none.
DsaLayerConfig tiny_dsa(int64_t dr, int64_t K, int64_t P, bool indexer) {
  DsaLayerConfig c;
  c.mla.hidden_size = 16;
  c.mla.num_heads = 4;
  c.mla.q_lora_rank = 8;
  c.mla.kv_lora_rank = 8;
  c.mla.qk_nope_head_dim = 4;
  c.mla.qk_rope_head_dim = dr;
  c.mla.v_head_dim = 4;
  c.mla.rope_theta = 10.0;
  c.mla.param_dtype = DType::f64;
  if (indexer) {
    IndexerConfig ic;
    ic.hidden_size = 16;
    ic.q_lora_rank = 8;
    ic.n_heads = 2;
    ic.head_dim = 4;
    ic.topk = K;
    ic.rope_dim = dr;
    ic.rope_theta = 10.0;
    ic.kpool = P;
    ic.dtype = DType::f64;
    ic.seed = 3;
    c.indexer = ic;
  }
  c.indexer_loss = false;  // its target needs the group's sum: tests/dist/dist_check.cpp --tp
  return c;
}

// Unit-scale activations: weights N(0, 1.5^2 / fan_in), norm weights 1 + N(0, 0.3^2).
void randomize(Module& m, Rng& rng) {
  for (auto& [name, p] : m.named_parameters()) {
    Tensor t = Tensor::empty(p->value.shape(), DType::f64);
    rng.fill_normal(t, 0, 1);
    const bool norm = name.find("layernorm") != std::string::npos ||
                      name.find("k_norm.weight") != std::string::npos;
    const double fan_in = double(p->value.shape().back());
    for (int64_t i = 0; i < t.numel(); ++i) {
      double& e = t.data<double>()[i];
      e = norm ? 1.0 + 0.3 * e : e * 1.5 / std::sqrt(fan_in);
    }
    p->value.copy_(t.to(p->value.dtype()));
  }
}

// The DSA layer's heads over 2 and 4 ranks: no indexer (dense causal attention), the indexer's
// top-k of tokens with RoPE, KPool's top-k of pools, and the dense warm-up stage; each against
// the whole layer (f64). The indexer is identical on every rank: each rank's indexer gradients
// would be the whole layer's (here none: the loss is off).
TEST(DsaTensorParallel, PartsSumToTheWholeLayer) {
  PrecisionPolicy policy;
  policy.default_kind = GemmKind::native;
  struct Case {
    const char* name;
    DsaLayerConfig c;
  };
  DsaLayerConfig warm = tiny_dsa(0, 6, 2, true);
  warm.stage = DsaStage::dense_warmup;
  const std::vector<Case> cases = {{"no indexer", tiny_dsa(0, 6, 1, false)},
                                   {"top-k tokens, RoPE", tiny_dsa(2, 6, 1, true)},
                                   {"KPool", tiny_dsa(0, 6, 2, true)},
                                   {"dense warm-up", warm}};
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    DsaLayer whole(k.c, policy, "attn");
    Rng rng(testing::test_seed(), 43);
    randomize(whole, rng);
    const std::vector<TpParam> layouts = dsa_tp_params(whole);
    ASSERT_EQ(layouts.size(), whole.named_parameters().size());
    const SeqLayout seqs = testing::seqs_of({23, 4, 30});
    const Tensor x = random_rows(seqs.total_tokens(), 16, rng);
    const Tensor dy = random_rows(seqs.total_tokens(), 16, rng);
    const Context ctx{true, false};
    whole.zero_grad();
    DsaLayer::Saved sw;
    const DsaLayer::Output yw = whole.forward(ctx, x, seqs, &sw);
    const Tensor dx = whole.backward(ctx, dy, sw);
    for (int n : {1, 2, 4}) {
      SCOPED_TRACE("n = " + std::to_string(n));
      std::vector<std::unique_ptr<DsaLayer>> parts;
      std::vector<Module*> mods;
      Tensor ys, dxs;
      for (int r = 0; r < n; ++r) {
        parts.push_back(std::make_unique<DsaLayer>(dsa_tp_config(k.c, n), policy, "attn"));
        DsaLayer& l = *parts.back();
        tp_load_shard(whole, l, layouts, r, n);
        l.zero_grad();
        DsaLayer::Saved s;
        const DsaLayer::Output o = l.forward(ctx, x, seqs, &s);
        // Every rank selects the same sets.
        if (yw.indices.defined()) EXPECT_TRUE(testing::bit_equal(o.indices, yw.indices));
        const Tensor dxr = l.backward(ctx, dy, s);
        if (r == 0)
          ys = o.y.clone();
        else
          ops::add_(ys, o.y);
        if (r == 0)
          dxs = dxr.clone();
        else
          ops::add_(dxs, dxr);
        mods.push_back(&l);
      }
      if (n == 1) {
        EXPECT_TRUE(testing::bit_equal(ys, yw.y));
        EXPECT_TRUE(testing::bit_equal(dxs, dx));
      }
      EXPECT_LE(testing::compare(ys, yw.y).rel_l2, 1e-13);
      EXPECT_LE(testing::compare(dxs, dx).rel_l2, 1e-13);
      std::vector<TpParam> mla_layouts;
      for (const TpParam& p : layouts)
        if (p.split != TpSplit::identical) mla_layouts.push_back(p);
      expect_grads_match(whole, mods, mla_layouts, 1e-12);
    }
    testing::expect_error([&] { dsa_tp_config(k.c, 3); },
                          "an MLA layer's 4 heads do not split over 3 ranks");
  }
}

// A rank's layer that does not fit the layout, or a layout that misses a parameter: refused,
// nothing set.
TEST(TensorParallelSlices, LoadRefusesWhatDoesNotFit) {
  PrecisionPolicy policy;
  DenseMlpConfig c;
  c.hidden_size = 8;
  c.intermediate_size = 12;
  c.seed = 1;
  DenseMlp whole(c, policy, "mlp");
  DenseMlp part(mlp_tp_config(c, 2), policy, "mlp");
  const Tensor before = part.down_proj().weight().value.clone();
  testing::expect_error([&] { tp_load_shard(whole, part, mlp_tp_params(c), 0, 3); },
                        "rank 0's part of 'gate_proj.weight' is");
  std::vector<TpParam> missing = mlp_tp_params(c);
  missing.pop_back();
  testing::expect_error([&] { tp_load_shard(whole, part, missing, 0, 2); },
                        "parameter 'down_proj.weight' of the rank's layer has no tensor-parallel "
                        "layout");
  EXPECT_TRUE(testing::bit_equal(part.down_proj().weight().value, before));
}

// A model built for rank 1 of a tensor-parallel group of 2 (construction exchanges nothing):
// its parameters are its parts of the one-process model's, bit for bit, under the layouts
// tensor_parallel_params gives (sliced attention and dense-MLP weights, the KDA low-rank gates
// and the MoE layers replicated, the DSA indexer and everything outside those layers identical);
// and a context-parallel forward is refused.
TEST(ModelTensorParallel, PartsOfTheWholeModelAndRefusals) {
  nlohmann::json j = nlohmann::json::parse(testing::kSmallModelJson);
  const ModelConfig mc = ModelConfig::from_json(j);
  HybridModelOptions o;
  o.seed = 11;
  HybridModel whole(mc, o);
  testing::FakeGroup g(1, 2);
  HybridModelOptions po = o;
  po.tensor_comm = &g;
  HybridModel part(mc, po);
  const std::vector<TpParam> layouts = part.tensor_parallel_params();
  ASSERT_EQ(layouts.size(), part.named_parameters().size());
  std::map<std::string, TpSplit> kind;
  for (const TpParam& p : layouts) {
    SCOPED_TRACE(p.name);
    kind[p.name] = p.split;
    EXPECT_TRUE(testing::bit_equal(part.find_parameter(p.name)->value,
                                   tp_shard(whole.find_parameter(p.name)->value, p, 1, 2)));
  }
  EXPECT_EQ(kind["model.layers.0.self_attn.q_proj.weight"], TpSplit::rows);
  EXPECT_EQ(kind["model.layers.0.self_attn.o_proj.weight"], TpSplit::cols);
  EXPECT_EQ(kind["model.layers.0.self_attn.forget_gate.f_a_proj.weight"], TpSplit::replicated);
  EXPECT_EQ(kind["model.layers.0.mlp.down_proj.weight"], TpSplit::cols);
  EXPECT_EQ(kind["model.layers.1.self_attn.kv_b_proj.weight"], TpSplit::rows);
  EXPECT_EQ(kind["model.layers.1.self_attn.indexer.wk.weight"], TpSplit::identical);
  EXPECT_EQ(kind["model.layers.1.mlp.gate.weight"], TpSplit::replicated);
  EXPECT_EQ(kind["model.layers.1.mlp.experts.gate_up_proj"], TpSplit::replicated);
  EXPECT_EQ(kind["model.layers.2.self_attn.o_proj.weight"], TpSplit::cols);  // the MTP block's
  EXPECT_EQ(kind["model.embed_tokens.weight"], TpSplit::identical);
  EXPECT_EQ(kind["model.layers.0.attn_hc.fn"], TpSplit::identical);
  // The split parameters, whole, are what the layout plan counts as split
  // (tensor_parallel_split_count, model/config_limits.h).
  int64_t split = 0;
  for (const TpParam& p : layouts)
    if (p.split == TpSplit::rows || p.split == TpSplit::cols)
      split += part.find_parameter(p.name)->value.numel() * 2;
  EXPECT_EQ(split, tensor_parallel_split_count(mc, true));
  // Without a group every parameter is identical.
  for (const TpParam& p : whole.tensor_parallel_params())
    EXPECT_EQ(p.split, TpSplit::identical) << p.name;

  // Refused: context parallel without the tensor-context group.
  const SeqLayout seqs = testing::seqs_of({6});
  const dist::CpSlice slice(g, seqs, {0, 3, 6});
  ModelInputs in;
  in.tokens = Tensor::from_vector<int64_t>({3}, {1, 2, 3});
  in.cp = &slice;
  testing::expect_error(
      [&] {
        part.forward(Context{false, false}, in);
      },
      "tensor and context parallelism together need HybridModelOptions::tensor_context_comm: "
      "the 2 x 2 ranks");
  testing::expect_error([&] { kda_tp_config(kda_layer_config(mc), 3); },
                        "a KDA layer's 2 heads do not split over 3 ranks");
}

// The whole model over 2 and 4 processes (tests/dist/dist_check.cpp, --model-tp): KDA and DSA
// layers (KPool, the indexer loss), a dense MLP and MoE layers with the aux loss, mHC and MTP;
// the loss terms and every gradient against the one-process model, without and with full
// recompute; f64 on 2 and 4 ranks, f32 on 4.
TEST(ModelTensorParallel, MatchesTheWholeModelOnTwoAndFourRanks) {
  if (!dist::have_mpi()) GTEST_SKIP() << "this build has no MPI backend";
  for (const auto& [dt, n] : {std::pair{"f64", 2}, {"f64", 4}, {"f32", 4}}) {
    SCOPED_TRACE(std::string(dt) + " x " + std::to_string(n));
    testing::expect_dist_check(n, std::string("--model-tp ") + dt + " cpu");
  }
}

// Tensor and context parallelism together, tp 2 x cp 2 over 4 processes (tests/dist/dist_check.cpp,
// --model-tpcp): the model's loss terms and gradients against the whole model on the whole batch,
// chunkwise and headwise; f64 and f32.
TEST(TensorParallel, WithContextParallelMatchesTheWholeModel) {
  if (!dist::have_mpi()) GTEST_SKIP() << "this build has no MPI backend";
  for (const char* dt : {"f64", "f32"}) {
    SCOPED_TRACE(dt);
    testing::expect_dist_check(4, std::string("--model-tpcp ") + dt + " cpu");
  }
}

// The layers over 2 and 4 processes with the group's all-reduce (tests/dist/dist_check.cpp,
// --tp): KDA, the MLP, and DSA with KPool and the indexer loss (its target summed over the
// group), sparse and dense warm-up; f64 on 2 and 4 ranks, f32 on 4.
TEST(TensorParallel, MatchesTheWholeLayerOnTwoAndFourRanks) {
  if (!dist::have_mpi()) GTEST_SKIP() << "this build has no MPI backend";
  for (const auto& [dt, n] : {std::pair{"f64", 2}, {"f64", 4}, {"f32", 4}}) {
    SCOPED_TRACE(std::string(dt) + " x " + std::to_string(n));
    testing::expect_dist_check(n, std::string("--tp ") + dt + " cpu");
  }
}

}  // namespace
}  // namespace hlm
