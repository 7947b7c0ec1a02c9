// The DSA layer on the GPU (layers/dsa/dsa_layer.h with CUDA parameters and inputs) against the
// same layer on the CPU: a layer built and randomised on the CPU, copied with
// Module::to(Device::cuda), run forward and backward on packed documents {1, 63, 65, 40} (T = 169,
// top-k 16 below most lengths, KPool pools cut by document ends). f32 parameters and native f32
// GEMMs: the selection identical to the CPU's; y, the indexer loss, dx and every parameter gradient
// within relative L2 2e-5 of the CPU's. bf16 parameters, bf16 GEMMs and bf16 x: >= 90% of the rows
// select the CPU's set; then, over the CPU's selection, y, dx and every MLA gradient are as close
// to the exact (f64) function of the same values as the CPU path is (within 1.25x its error plus
// 5e-4). Stages: sparse with token-level and KPool indexers, the dense warm-up (its causal
// attention without an index tensor on CUDA), and MLA alone. The GPU run is bit-identical run to
// run and under selective recompute; inputs on the wrong device are refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/rng.h"
#include "core/seq_layout.h"
#include "layers/dsa/dsa_layer.h"
#include "testing.h"

namespace hlm {
namespace {

using testing::cpu;
using testing::gpu;

const char* kPath = "model.layers.1.self_attn";

// MLA D = 64, H = 16 (one tensor-core head group), q_lora 32, kv_lora 64, NoPE d_nope 32, d_v 32
// (GLM-5.3-Flash's layout at a small width); indexer H_I = 4, d_I = 32 (Hadamard), top-k 16.
DsaLayerConfig config(int64_t P, DType dt, bool indexer, DsaStage stage) {
  DsaLayerConfig c;
  c.mla.hidden_size = 64;
  c.mla.num_heads = 16;
  c.mla.q_lora_rank = 32;
  c.mla.kv_lora_rank = 64;
  c.mla.qk_nope_head_dim = 32;
  c.mla.qk_rope_head_dim = 0;
  c.mla.v_head_dim = 32;
  c.mla.param_dtype = dt;
  if (indexer) {
    IndexerConfig ic;
    ic.hidden_size = 64;
    ic.q_lora_rank = 32;
    ic.n_heads = 4;
    ic.head_dim = 32;
    ic.topk = 16;
    ic.kpool = P;
    ic.dtype = dt;
    ic.seed = 5;
    c.indexer = ic;
  }
  c.stage = stage;
  c.indexer_loss_coeff = 0.7;
  return c;
}

PrecisionPolicy policy_for(DType dt) {
  PrecisionPolicy p;
  p.default_kind = dt == DType::bf16 ? GemmKind::bf16 : GemmKind::native;
  return p;
}

// Unit-scale activations: norms near 1, projections ~ 1.5 / sqrt(fan_in), so that the selection
// and the KL are far from degenerate.
void randomize(Module& m, Rng& rng) {
  for (auto& [name, p] : m.named_parameters()) {
    const Shape& s = p->value.shape();
    std::vector<double> v = randn(s, DType::f64, rng, 1.0).to_f64_vector();
    const bool norm_w = name.find("layernorm") != std::string::npos ||
                        name.find("k_norm.weight") != std::string::npos;
    for (double& e : v) {
      if (norm_w)
        e = 1.0 + 0.3 * e;
      else if (name.find("k_norm.bias") != std::string::npos)
        e = 0.3 * e;
      else if (name.find("ape") != std::string::npos)
        e = 0.5 * e;
      else
        e = e * 1.5 / std::sqrt(double(s.back()));
    }
    p->value = Tensor::from_values(s, v, DType::f64).to(p->value.dtype());
  }
}

struct RunResult {
  DsaLayer::Output out;
  Tensor y, dx, indices;  // CPU copies
  std::vector<std::pair<std::string, Tensor>> grads;
};

RunResult run(DsaLayer& l, const Tensor& x, const SeqLayout& seqs, const Tensor& dy,
              const Tensor& given = {}, bool recompute = false) {
  Context ctx;
  ctx.recompute = recompute;
  DsaLayer::Saved s;
  RunResult r;
  l.zero_grad();
  r.out = l.forward(ctx, x, seqs, &s, given);
  r.y = cpu(r.out.y);
  if (r.out.indices.defined()) r.indices = cpu(r.out.indices);
  r.dx = cpu(l.backward(ctx, dy, s, 1.0));
  for (auto& [n, p] : l.named_parameters()) r.grads.emplace_back(n, cpu(p->grad));
  return r;
}

void check(const std::string& what, const Tensor& out, const Tensor& ref, double tol) {
  ASSERT_TRUE(out.defined() && ref.defined()) << what << ": undefined";
  ASSERT_EQ(out.shape(), ref.shape()) << what;
  const testing::ErrorStats e = testing::compare(out.to(DType::f64), ref.to(DType::f64));
  std::printf("  %-44s rel_l2 %.3e  max_abs %.3e\n", what.c_str(), e.rel_l2, e.max_abs);
  EXPECT_EQ(e.nan_mismatch, 0) << what;
  EXPECT_LE(e.rel_l2, tol) << what << " " << e.report(ref);
}

void compare_runs(const RunResult& g, const RunResult& c, double tol) {
  if (c.indices.defined() && g.indices.defined())
    EXPECT_TRUE(testing::bit_equal(g.indices, c.indices)) << "selection";
  EXPECT_EQ(g.out.has_indexer_loss, c.out.has_indexer_loss);
  if (c.out.has_indexer_loss) {
    std::printf("  indexer loss: GPU %.9g  CPU %.9g\n", g.out.indexer_loss, c.out.indexer_loss);
    EXPECT_NEAR(g.out.indexer_loss, c.out.indexer_loss, tol * std::fabs(c.out.indexer_loss));
    EXPECT_EQ(g.out.indexer_loss_rows, c.out.indexer_loss_rows);
  }
  check("y", g.y, c.y, tol);
  check("dx", g.dx, c.dx, tol);
  ASSERT_EQ(g.grads.size(), c.grads.size());
  for (size_t i = 0; i < g.grads.size(); ++i) {
    if (!c.grads[i].second.defined()) {
      EXPECT_FALSE(g.grads[i].second.defined()) << g.grads[i].first;
      continue;
    }
    check("grad " + c.grads[i].first, g.grads[i].second, c.grads[i].second, tol);
  }
}

void bit_equal_runs(const RunResult& a, const RunResult& b, const char* what) {
  EXPECT_TRUE(testing::bit_equal(a.y, b.y)) << what << " y";
  EXPECT_TRUE(testing::bit_equal(a.dx, b.dx)) << what << " dx";
  EXPECT_EQ(a.out.indexer_loss, b.out.indexer_loss) << what << " loss";
  if (a.indices.defined()) EXPECT_TRUE(testing::bit_equal(a.indices, b.indices)) << what;
  for (size_t i = 0; i < a.grads.size(); ++i)
    if (a.grads[i].second.defined())
      EXPECT_TRUE(testing::bit_equal(a.grads[i].second, b.grads[i].second))
          << what << " " << a.grads[i].first;
}

const std::vector<int64_t> kLens = {1, 63, 65, 40};

struct Case {
  const char* name;
  int64_t P;
  bool indexer;
  DsaStage stage;
};

void run_f32_case(const Case& k) {
  SCOPED_TRACE(k.name);
  std::printf("%s\n", k.name);
  Rng rng(testing::test_seed(), 71);
  const DsaLayerConfig cfg = config(k.P, DType::f32, k.indexer, k.stage);
  DsaLayer ref(cfg, policy_for(DType::f32), kPath);
  randomize(ref, rng);
  DsaLayer dev(cfg, policy_for(DType::f32), kPath);
  {
    auto a = ref.named_parameters(), b = dev.named_parameters();
    for (size_t i = 0; i < a.size(); ++i) b[i].second->value = a[i].second->value.clone();
  }
  dev.to(Device::cuda);
  const SeqLayout seqs = SeqLayout::from_lengths(kLens);
  const int64_t T = seqs.total_tokens();
  const Tensor x = randn({T, 64}, DType::f32, rng), dy = randn({T, 64}, DType::f32, rng);
  const RunResult c = run(ref, x, seqs, dy);
  const RunResult g = run(dev, gpu(x), seqs, gpu(dy));
  compare_runs(g, c, 2e-5);
  // Reruns and selective recompute: the same bits.
  bit_equal_runs(g, run(dev, gpu(x), seqs, gpu(dy)), "rerun");
  bit_equal_runs(g, run(dev, gpu(x), seqs, gpu(dy), {}, true), "recompute");
}

TEST(DsaLayerGpu, SparseTokenLevelMatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  run_f32_case({"sparse, token-level indexer, f32", 1, true, DsaStage::sparse});
}

TEST(DsaLayerGpu, SparseKPoolMatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  run_f32_case({"sparse, KPool 4, f32", 4, true, DsaStage::sparse});
}

TEST(DsaLayerGpu, DenseWarmupMatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  run_f32_case({"dense warm-up, KPool 4, f32", 4, true, DsaStage::dense_warmup});
}

TEST(DsaLayerGpu, DenseMlaMatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  run_f32_case({"MLA alone (no indexer), f32", 1, false, DsaStage::sparse});
}

// bf16 parameters, bf16 GEMMs and bf16 x (so bf16 attention operands: Mla::attention_operand): at
// least 90% of the rows select the CPU's set (bf16 scores may order near-ties differently); then
// the CPU's selection is given to both runs (the indexer loss off) and both are held against the
// exact function. (GPU and CPU each round in a dozen places, so their distance from each other,
// 3e-3 to 4e-3 here, is about the sum of their errors, not a measure of either.)
TEST(DsaLayerGpu, Bf16MatchesCpuOverTheSameSelection) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed(), 72);
  DsaLayerConfig cfg = config(4, DType::bf16, true, DsaStage::sparse);
  cfg.indexer_loss = false;
  DsaLayer ref(cfg, policy_for(DType::bf16), kPath);
  randomize(ref, rng);
  DsaLayer dev(cfg, policy_for(DType::bf16), kPath);
  {
    auto a = ref.named_parameters(), b = dev.named_parameters();
    for (size_t i = 0; i < a.size(); ++i) b[i].second->value = a[i].second->value.clone();
  }
  dev.to(Device::cuda);
  const SeqLayout seqs = SeqLayout::from_lengths(kLens);
  const int64_t T = seqs.total_tokens();
  const Tensor x = randn({T, 64}, DType::f32, rng).to(DType::bf16);
  const Tensor dy = randn({T, 64}, DType::f32, rng).to(DType::bf16);
  const RunResult c0 = run(ref, x, seqs, dy);
  const RunResult g0 = run(dev, gpu(x), seqs, gpu(dy));
  {
    // bf16 GEMMs: the attention takes bf16 queries and latent rows (the tensor-core kernels).
    DsaLayer::Saved s;
    dev.forward(Context{}, gpu(x), seqs, &s);
    EXPECT_EQ(s.q_abs.dtype(), DType::bf16);
  }
  // The GPU's own selection: rows that differ from the CPU's are rows with near-tied scores.
  int64_t same_rows = 0;
  {
    const std::vector<double> a = c0.indices.to_f64_vector(), b = g0.indices.to_f64_vector();
    const int64_t W = c0.indices.size(1);
    for (int64_t t = 0; t < T; ++t) {
      bool same = true;
      for (int64_t w = 0; w < W; ++w) same = same && a[size_t(t * W + w)] == b[size_t(t * W + w)];
      same_rows += same;
    }
  }
  std::printf("bf16: %lld of %lld rows select the same set as the CPU\n", (long long)same_rows,
              (long long)T);
  EXPECT_GE(same_rows, T * 9 / 10);
  // Both runs against the exact function of the same values: the layer in f64 with native
  // products (the bf16 parameters, x and dy are exact in f64), over the same selection. The GPU
  // path rounds where the CPU's does (bf16 GEMM operands, attention operands and gradients) and
  // also rounds the softmax weights to bf16 in the forward's value product (tensor cores), so it
  // may be a little less exact than the CPU path, never much: its error is at most 1.25x the
  // CPU's plus 5e-4, for every output and gradient.
  const RunResult c = run(ref, x.to(DType::f32), seqs, dy.to(DType::f32), c0.indices);
  const RunResult g = run(dev, gpu(x), seqs, gpu(dy), gpu(c0.indices));
  DsaLayerConfig cfg64 = cfg;
  cfg64.mla.param_dtype = DType::f64;
  cfg64.indexer->dtype = DType::f64;
  DsaLayer exact(cfg64, policy_for(DType::f64), kPath);
  {
    auto a = ref.named_parameters(), b = exact.named_parameters();
    for (size_t i = 0; i < a.size(); ++i) b[i].second->value = a[i].second->value.to(DType::f64);
  }
  const RunResult e = run(exact, x.to(DType::f64), seqs, dy.to(DType::f64), c0.indices);
  auto against_exact = [&](const std::string& what, const Tensor& gv, const Tensor& cv,
                           const Tensor& ev) {
    const double eg = testing::compare(gv.to(DType::f64), ev).rel_l2;
    const double ec = testing::compare(cv.to(DType::f64), ev).rel_l2;
    std::printf("  %-40s vs exact: GPU %.3e  CPU %.3e\n", what.c_str(), eg, ec);
    EXPECT_LE(eg, 1.25 * ec + 5e-4) << what;
  };
  against_exact("y", g.y, c.y, e.y);
  against_exact("dx", g.dx, c.dx, e.dx);
  for (size_t i = 0; i < g.grads.size(); ++i)
    if (e.grads[i].second.defined() && e.grads[i].first.rfind("indexer.", 0) != 0)
      against_exact("grad " + e.grads[i].first, g.grads[i].second, c.grads[i].second,
                    e.grads[i].second);
  bit_equal_runs(g, run(dev, gpu(x), seqs, gpu(dy), gpu(c0.indices)), "bf16 rerun");
}

// The plain MLA module (Kimi-Linear's layers; RoPE on 16 channels here) configured in the expanded
// form: on CUDA it runs the absorbed form, the same function, against the CPU's expanded run.
TEST(DsaLayerGpu, MlaModuleExpandedConfigMatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed(), 74);
  MlaConfig mc = config(1, DType::f32, false, DsaStage::sparse).mla;
  mc.qk_rope_head_dim = 16;
  mc.form = MlaForm::expanded;
  Mla ref(mc, policy_for(DType::f32), kPath);
  randomize(ref, rng);
  Mla dev(mc, policy_for(DType::f32), kPath);
  {
    auto a = ref.named_parameters(), b = dev.named_parameters();
    for (size_t i = 0; i < a.size(); ++i) b[i].second->value = a[i].second->value.clone();
  }
  dev.to(Device::cuda);
  const SeqLayout seqs = SeqLayout::from_lengths(kLens);
  const int64_t T = seqs.total_tokens();
  const Tensor x = randn({T, 64}, DType::f32, rng), dy = randn({T, 64}, DType::f32, rng);
  auto run_mla = [&](Mla& m, const Tensor& xx, const Tensor& dyy, RunResult& r) {
    Mla::Saved s;
    m.zero_grad();
    r.y = cpu(m.forward(Context{}, xx, seqs, &s));
    r.dx = cpu(m.backward(Context{}, dyy, s));
    for (auto& [n, p] : m.named_parameters()) r.grads.emplace_back(n, cpu(p->grad));
  };
  RunResult c, g, g2;
  run_mla(ref, x, dy, c);
  run_mla(dev, gpu(x), gpu(dy), g);
  compare_runs(g, c, 2e-5);
  run_mla(dev, gpu(x), gpu(dy), g2);
  bit_equal_runs(g, g2, "rerun");
}

TEST(DsaLayerGpu, InputsOnTheWrongDeviceAreRefused) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  DsaLayer dev(config(1, DType::f32, true, DsaStage::sparse), policy_for(DType::f32), kPath);
  dev.to(Device::cuda);
  const SeqLayout seqs = SeqLayout::from_lengths({8});
  Rng rng(testing::test_seed(), 73);
  const Tensor x = randn({8, 64}, DType::f32, rng);
  DsaLayer::Saved s;
  testing::expect_error([&] { dev.forward(Context{}, x, seqs, &s); }, "parameters' device");
  dev.forward(Context{}, gpu(x), seqs, &s);
  testing::expect_error([&] { dev.backward(Context{}, x, s); }, "on x's device");
  const Tensor given = Tensor::full({8, 2}, -1.0, DType::i32);
  testing::expect_error([&] { dev.forward(Context{}, gpu(x), seqs, &s, given); },
                        "given_indices must be on x's device");
  // A bad given selection on the device is refused before anything is computed from it.
  Tensor bad = Tensor::full({8, 2}, -1.0, DType::i32);
  bad.data<int32_t>()[3 * 2] = 5;  // query 3 selects the future token 5
  EXPECT_ANY_THROW(dev.forward(Context{}, gpu(x), seqs, &s, gpu(bad)));
  Tensor bad64 = Tensor::full({8, 2}, -1.0, DType::i64);
  bad64.data<int64_t>()[3 * 2] = (int64_t(1) << 32) + 1;  // would narrow to the causal token 1
  testing::expect_error([&] { dev.forward(Context{}, gpu(x), seqs, &s, gpu(bad64)); },
                        "is neither -1");
}

}  // namespace
}  // namespace hlm
