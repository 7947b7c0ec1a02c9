// The KDA layer on the GPU (layers/kda/kda_layer.h with CUDA parameters and inputs) against the
// same layer on the CPU: a layer built and initialised on the CPU in f32, copied to the GPU with
// Module::to(Device::cuda), run forward and backward on packed sequences of lengths
// {1, 63, 65, 300} with initial states and final-state gradients. Compared: y, both final
// states, dx, both initial-state gradients and every parameter gradient, by relative L2 error
// (<= 2e-5 with f32 parameters and native f32 GEMMs; <= 3e-3 with bf16 parameters, bf16 GEMMs
// and bf16 x). Also: the GPU run is bit-identical run to run and with selective recompute.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "core/rng.h"
#include "core/seq_layout.h"
#include "layers/kda/kda_layer.h"
#include "testing.h"

namespace hlm {
namespace {

using ops::KdaGateKind;

const char* kPath = "model.layers.0.self_attn";

// D = 256, H = 2, HV = 4 (GVA), K = V = 64, conv 4.
KdaConfig gpu_config(KdaGateKind gate, int64_t rank, KdaNaming naming, bool gate_bias) {
  KdaConfig c;
  c.hidden_size = 256;
  c.num_heads = 2;
  c.num_v_heads = 4;
  c.head_k_dim = 64;
  c.head_v_dim = 64;
  c.conv_kernel = 4;
  c.decay_rank = rank;
  c.output_gate_rank = rank;
  c.output_gate_bias = gate_bias;
  c.gate = gate;
  c.lower_bound = -5.0;
  c.norm_eps = 1e-5;
  c.naming = naming;
  return c;
}

using testing::cpu;
using testing::gpu;

struct Problem {
  Tensor x;
  SeqLayout cu;
  KdaState init;
  Tensor dy;
  KdaState dfin;
};

Problem make_problem(const KdaConfig& c, const std::vector<int64_t>& lens, DType x_dt, Rng& rng) {
  int64_t T = 0;
  for (int64_t l : lens) T += l;
  const int64_t N = int64_t(lens.size());
  Problem p;
  p.x = randn({T, c.hidden_size}, DType::f32, rng).to(x_dt);
  p.cu = SeqLayout::from_lengths(lens);
  p.init.conv = randn({N, c.conv_kernel - 1, c.conv_dim()}, DType::f32, rng, 0.5);
  p.init.recurrent = randn({N, c.num_v_heads, c.head_k_dim, c.head_v_dim}, DType::f32, rng, 0.5);
  p.dy = randn({T, c.hidden_size}, DType::f32, rng).to(x_dt);
  p.dfin.conv = randn({N, c.conv_kernel - 1, c.conv_dim()}, DType::f32, rng);
  p.dfin.recurrent = randn({N, c.num_v_heads, c.head_k_dim, c.head_v_dim}, DType::f32, rng);
  return p;
}

Problem to_gpu(const Problem& p) {
  Problem g;
  g.x = gpu(p.x);
  g.cu = p.cu;  // the layout lives on the host either way
  g.init = {gpu(p.init.conv), gpu(p.init.recurrent)};
  g.dy = gpu(p.dy);
  g.dfin = {gpu(p.dfin.conv), gpu(p.dfin.recurrent)};
  return g;
}

struct RunResult {
  Tensor y;
  KdaState fin;
  KdaLayer::Grads g;
  std::vector<std::pair<std::string, Tensor>> param_grads;  // CPU copies, named_parameters order
};

RunResult run(KdaLayer& l, const Problem& p, bool recompute = false) {
  RunResult r;
  Context ctx;
  ctx.recompute = recompute;
  KdaLayer::Saved s;
  r.y = cpu(l.forward(ctx, p.x, p.cu, &p.init, &s, &r.fin));
  l.zero_grad();
  r.g = l.backward(ctx, p.dy, s, &p.dfin);
  r.g.dx = cpu(r.g.dx);
  r.g.dinitial = {cpu(r.g.dinitial.conv), cpu(r.g.dinitial.recurrent)};
  r.fin = {cpu(r.fin.conv), cpu(r.fin.recurrent)};
  for (auto& [n, prm] : l.named_parameters()) r.param_grads.emplace_back(n, cpu(prm->grad));
  return r;
}

void check(const std::string& what, const Tensor& out, const Tensor& ref, double tol) {
  ASSERT_TRUE(out.defined() && ref.defined()) << what << ": undefined";
  ASSERT_EQ(out.shape(), ref.shape()) << what;
  const testing::ErrorStats e = testing::compare(out.to(DType::f64), ref.to(DType::f64));
  std::printf("  %-34s rel_l2 %.3e  max_abs %.3e\n", what.c_str(), e.rel_l2, e.max_abs);
  EXPECT_EQ(e.nan_mismatch, 0) << what;
  EXPECT_LE(e.rel_l2, tol) << what << " " << e.report(ref);
}

void bit_equal_runs(const RunResult& a, const RunResult& b, const std::string& what) {
  EXPECT_TRUE(testing::bit_equal(a.y, b.y)) << what << " y";
  EXPECT_TRUE(testing::bit_equal(a.g.dx, b.g.dx)) << what << " dx";
  EXPECT_TRUE(testing::bit_equal(a.g.dinitial.recurrent, b.g.dinitial.recurrent)) << what << " dS0";
  EXPECT_TRUE(testing::bit_equal(a.g.dinitial.conv, b.g.dinitial.conv)) << what << " dconv0";
  ASSERT_EQ(a.param_grads.size(), b.param_grads.size());
  for (size_t i = 0; i < a.param_grads.size(); ++i)
    EXPECT_TRUE(testing::bit_equal(a.param_grads[i].second, b.param_grads[i].second))
        << what << " " << a.param_grads[i].first;
}

// Builds the layer on the CPU in f32, randomises it, casts it to param_dt, copies it to the GPU;
// runs both and compares everything at relative L2 tolerance tol.
void cpu_vs_gpu(const KdaConfig& cfg, GemmKind kind, DType param_dt, DType x_dt, double tol) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  PrecisionPolicy policy;
  policy.default_kind = kind;
  KdaLayer ref(cfg, policy, kPath, DType::f32);
  ref.init_weights(rng.next_u64());
  rng.fill_uniform(ref.A_log().value, -0.5, 1.0);
  rng.fill_uniform(ref.dt_bias().value, -1.0, 1.0);
  rng.fill_uniform(ref.o_norm_weight().value, 0.5, 1.5);
  for (auto& [name, lin] : ref.linears())
    if (lin->bias()) rng.fill_uniform(lin->bias()->value, -0.5, 0.5);
  if (param_dt != DType::f32) ref.to_dtype(param_dt);

  // A GPU copy of ref under config c.
  auto device_copy_of = [&](const KdaConfig& c) {
    auto d = std::make_unique<KdaLayer>(c, policy, kPath, param_dt);
    auto a = ref.named_parameters(), b = d->named_parameters();
    EXPECT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
      EXPECT_EQ(a[i].first, b[i].first);
      EXPECT_EQ(a[i].second->value.dtype(), b[i].second->value.dtype()) << a[i].first;
      b[i].second->value.copy_(a[i].second->value);
    }
    d->to(Device::cuda);
    for (auto& [n, prm] : d->named_parameters()) EXPECT_EQ(prm->value.device(), Device::cuda) << n;
    return d;
  };
  const std::unique_ptr<KdaLayer> devp = device_copy_of(cfg);
  KdaLayer& dev = *devp;
  if (::testing::Test::HasFailure()) return;

  const Problem p = make_problem(cfg, {1, 63, 65, 300}, x_dt, rng);
  const Problem pg = to_gpu(p);
  const RunResult rc = run(ref, p);
  const RunResult rg = run(dev, pg);
  std::printf("KDA layer gate %s rank %lld params %s x %s gemm %s\n",
              cfg.gate == KdaGateKind::lower_bound ? "lower_bound" : "standard",
              (long long)cfg.decay_rank, dtype_name(param_dt), dtype_name(x_dt),
              gemm_kind_name(kind));
  EXPECT_EQ(rg.y.dtype(), x_dt);
  EXPECT_EQ(rg.g.dx.dtype(), x_dt);
  check("y", rg.y, rc.y, tol);
  check("final conv state", rg.fin.conv, rc.fin.conv, tol);
  check("final recurrent state", rg.fin.recurrent, rc.fin.recurrent, tol);
  check("dx", rg.g.dx, rc.g.dx, tol);
  check("d initial conv state", rg.g.dinitial.conv, rc.g.dinitial.conv, tol);
  check("d initial recurrent state", rg.g.dinitial.recurrent, rc.g.dinitial.recurrent, tol);
  ASSERT_EQ(rg.param_grads.size(), rc.param_grads.size());
  for (size_t i = 0; i < rc.param_grads.size(); ++i) {
    ASSERT_EQ(rg.param_grads[i].first, rc.param_grads[i].first);
    check("d " + rc.param_grads[i].first, rg.param_grads[i].second, rc.param_grads[i].second, tol);
  }
  // Deterministic: the same bits run to run, and with selective recompute.
  bit_equal_runs(run(dev, pg), rg, "rerun");
  bit_equal_runs(run(dev, pg, /*recompute=*/true), rg, "recompute");
  // What the core's forward keeps (core_save; `dev` has the default, kept): the same bits
  // with all of its intermediates and with none.
  for (const KdaCoreSave cs_kind : {KdaCoreSave::all, KdaCoreSave::none}) {
    const std::string what = cs_kind == KdaCoreSave::all ? "all" : "none";
    KdaConfig cs = cfg;
    cs.core_save = cs_kind;
    const std::unique_ptr<KdaLayer> dev_saved = device_copy_of(cs);
    bit_equal_runs(run(*dev_saved, pg), rg, "core_save " + what);
    bit_equal_runs(run(*dev_saved, pg, /*recompute=*/true), rg,
                   "core_save " + what + ", recompute");
  }
}

TEST(KdaLayerGpu, LowerBoundGateLowRankF32) {
  cpu_vs_gpu(gpu_config(KdaGateKind::lower_bound, 32, KdaNaming::glm5_next, false),
             GemmKind::native, DType::f32, DType::f32, 2e-5);
}
TEST(KdaLayerGpu, StandardGateFullRankGateBiasF32) {
  cpu_vs_gpu(gpu_config(KdaGateKind::standard, 0, KdaNaming::kimi_linear, true), GemmKind::native,
             DType::f32, DType::f32, 2e-5);
}
TEST(KdaLayerGpu, LowerBoundGateBf16) {
  cpu_vs_gpu(gpu_config(KdaGateKind::lower_bound, 32, KdaNaming::glm5_next, false), GemmKind::bf16,
             DType::bf16, DType::bf16, 3e-3);
}
TEST(KdaLayerGpu, StandardGateBf16) {
  cpu_vs_gpu(gpu_config(KdaGateKind::standard, 32, KdaNaming::glm5_next_transformers, true),
             GemmKind::bf16, DType::bf16, DType::f32, 3e-3);
}

TEST(KdaLayerGpu, DeviceMismatchErrors) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  const KdaConfig cfg = gpu_config(KdaGateKind::lower_bound, 32, KdaNaming::glm5_next, false);
  PrecisionPolicy policy;
  policy.default_kind = GemmKind::native;
  KdaLayer l(cfg, policy, kPath, DType::f32);
  l.init_weights(rng.next_u64());
  l.to(Device::cuda);
  const Problem p = make_problem(cfg, {5, 7}, DType::f32, rng);
  KdaLayer::Saved s;
  EXPECT_THROW(l.forward(Context{}, p.x, p.cu, nullptr, &s), Error);  // x on the CPU
  const Problem g = to_gpu(p);
  KdaState bad{p.init.conv, Tensor()};  // a CPU state next to CUDA x
  EXPECT_THROW(l.forward(Context{}, g.x, g.cu, &bad, &s), Error);
  l.forward(Context{}, g.x, g.cu, &g.init, &s);
  EXPECT_THROW(l.backward(Context{}, p.dy, s), Error);  // dy on the CPU
}

}  // namespace
}  // namespace hlm
