// Tests of the KDA layer (layers/kda/kda_layer.h): every gradient against central finite
// differences (FP64), the chunked core against the FP64 recurrence, packed == one by one,
// recompute, the precision policy (kda_disable_fp8, FP8 vs BF16), BF16 parameters with FP32
// A_log / dt_bias through safetensors, prefill split through the returned states, saturated
// lower-bound gates over long sequences, and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "core/rng.h"
#include "core/safetensors.h"
#include "core/seq_layout.h"
#include "layers/kda/kda_layer.h"
#include "testing.h"

namespace hlm {
namespace {

using ops::KdaGateKind;

const char* kPath = "model.layers.0.self_attn";

// D = 16, H = 2, HV = 4 (GVA 2:4), K = V = 8, conv 4.
KdaConfig small_config(KdaGateKind gate, int64_t rank, KdaNaming naming = KdaNaming::glm5_next) {
  KdaConfig c;
  c.hidden_size = 16;
  c.num_heads = 2;
  c.num_v_heads = 4;
  c.head_k_dim = 8;
  c.head_v_dim = 8;
  c.conv_kernel = 4;
  c.decay_rank = rank;
  c.output_gate_rank = rank;
  c.gate = gate;
  c.lower_bound = -5.0;
  c.norm_eps = 1e-5;
  c.naming = naming;
  return c;
}

PrecisionPolicy policy_of(GemmKind k) {
  PrecisionPolicy p;
  p.default_kind = k;
  return p;
}

// A random layer: init_weights, then generic values for the parameters that init to constants.
void randomize(KdaLayer& l, Rng& rng) {
  l.init_weights(rng.next_u64());
  rng.fill_uniform(l.A_log().value, -0.5, 1.0);
  rng.fill_uniform(l.dt_bias().value, -1.0, 1.0);
  rng.fill_uniform(l.o_norm_weight().value, 0.5, 1.5);
  for (auto& [name, lin] : l.linears())
    if (lin->bias()) rng.fill_uniform(lin->bias()->value, -0.5, 0.5);
}

void copy_params(KdaLayer& src, KdaLayer& dst) {
  auto a = src.named_parameters(), b = dst.named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].first, b[i].first);
    b[i].second->value.copy_(a[i].second->value);
  }
}

Tensor cu_of(const std::vector<int64_t>& cu) {
  return Tensor::from_vector<int64_t>({int64_t(cu.size())}, cu);
}

// A problem: input, initial states, output and final-state probes (the upstream gradients).
struct Problem {
  Tensor x, cu;
  KdaState init;
  Tensor dy;
  KdaState dfin;
};

Problem make_problem(const KdaConfig& c, const std::vector<int64_t>& cu, DType dt, Rng& rng,
                     bool states = true) {
  const int64_t T = cu.back(), N = int64_t(cu.size()) - 1;
  Problem p;
  p.x = randn({T, c.hidden_size}, dt, rng);
  p.cu = cu_of(cu);
  if (states) {
    p.init.conv = randn({N, c.conv_kernel - 1, c.conv_dim()}, dt, rng, 0.5);
    p.init.recurrent = randn({N, c.num_v_heads, c.head_k_dim, c.head_v_dim}, dt, rng, 0.5);
  }
  p.dy = randn({T, c.hidden_size}, dt, rng);
  p.dfin.conv = randn({N, c.conv_kernel - 1, c.conv_dim()}, dt, rng);
  p.dfin.recurrent = randn({N, c.num_v_heads, c.head_k_dim, c.head_v_dim}, dt, rng);
  return p;
}

struct RunResult {
  Tensor y;
  KdaState fin;
  KdaLayer::Grads g;
  std::vector<Tensor> param_grads;  // in named_parameters order
};

// Forward + backward from zero gradients.
RunResult run(KdaLayer& l, const Problem& p, bool recompute = false, bool states = true) {
  RunResult r;
  Context ctx;
  ctx.recompute = recompute;
  KdaLayer::Saved s;
  r.y = l.forward(ctx, p.x, p.cu, states ? &p.init : nullptr, &s, &r.fin);
  l.zero_grad();
  r.g = l.backward(ctx, p.dy, s, &p.dfin);
  for (auto& [n, prm] : l.named_parameters()) r.param_grads.push_back(prm->grad.clone());
  return r;
}

// The gradient of parameter `name` in a RunResult of layer l.
const Tensor& grad_of(KdaLayer& l, const RunResult& r, const std::string& name) {
  auto params = l.named_parameters();
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].first == name) return r.param_grads[i];
  HLM_FAIL("no parameter {}", name);
}

double rel(const Tensor& a, const Tensor& b) {
  return testing::compare(a, b).rel_l2;
}

::testing::AssertionResult rel_close(const Tensor& out, const Tensor& ref, double tol,
                                     const std::string& what) {
  if (!out.defined() || !ref.defined())
    return ::testing::AssertionFailure() << what << ": undefined tensor";
  auto r = testing::close(out, ref, {tol, 1e30});
  if (!r) r << " [" << what << "]";
  return r;
}

// ---- gradients against finite differences ------------------------------------------------------

// L = <y, dy> + <conv state', dfin.conv> + <S', dfin.recurrent>; every parameter, x and both
// initial states probed (12 elements each, spread over the tensor) with h = 1e-6.
void finite_difference_check(const KdaConfig& cfg) {
  Rng rng(testing::test_seed());
  KdaLayer l(cfg, policy_of(GemmKind::native), kPath, DType::f64);
  randomize(l, rng);
  // 66 tokens (crosses the 64-token chunk boundary), an empty sequence (its final states are its
  // initial states), 1 token, 4 tokens.
  Problem p = make_problem(cfg, {0, 66, 66, 67, 71}, DType::f64, rng);
  auto loss = [&] {
    KdaState fin;
    const Tensor y = l.forward(Context{false, false}, p.x, p.cu, &p.init, nullptr, &fin);
    return testing::dot(y, p.dy) + testing::dot(fin.conv, p.dfin.conv) +
           testing::dot(fin.recurrent, p.dfin.recurrent);
  };
  const RunResult r = run(l, p);
  ASSERT_EQ(r.y.dtype(), DType::f64);
  const int64_t probes = 12;
  EXPECT_TRUE(testing::grad_check(loss, p.x, r.g.dx, 1e-6, 1e-6, probes)) << "dx";
  EXPECT_TRUE(testing::grad_check(loss, p.init.conv, r.g.dinitial.conv, 1e-6, 1e-6, probes))
      << "d initial conv state";
  EXPECT_TRUE(
      testing::grad_check(loss, p.init.recurrent, r.g.dinitial.recurrent, 1e-6, 1e-6, probes))
      << "d initial recurrent state";
  auto params = l.named_parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    Param* prm = params[i].second;
    ASSERT_EQ(prm->value.dtype(), DType::f64) << params[i].first;
    // the gradient is not trivially zero
    double mx = 0;
    for (double v : r.param_grads[i].to_f64_vector()) mx = std::max(mx, std::fabs(v));
    EXPECT_GT(mx, 1e-4) << params[i].first;
    EXPECT_TRUE(testing::grad_check(loss, prm->value, r.param_grads[i], 1e-6, 1e-6, probes))
        << params[i].first;
  }
  // Parameter gradients accumulate: a second backward doubles them.
  KdaLayer::Saved s;
  l.forward(Context{}, p.x, p.cu, &p.init, &s);
  l.backward(Context{}, p.dy, s, &p.dfin);
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor twice = r.param_grads[i].clone();
    double* d = twice.data<double>();
    for (int64_t j = 0; j < twice.numel(); ++j) d[j] *= 2;
    EXPECT_TRUE(rel_close(params[i].second->grad, twice, 1e-14, params[i].first + " (+=)"));
  }
}

TEST(KdaLayerGrad, LowerBoundGateLowRank) {
  finite_difference_check(small_config(KdaGateKind::lower_bound, 4));
}
TEST(KdaLayerGrad, StandardGateLowRank) {
  finite_difference_check(small_config(KdaGateKind::standard, 4, KdaNaming::kimi_linear));
}
TEST(KdaLayerGrad, LowerBoundGateFullRank) {
  finite_difference_check(small_config(KdaGateKind::lower_bound, 0));
}
TEST(KdaLayerGrad, StandardGateFullRankWithGateBias) {
  KdaConfig c = small_config(KdaGateKind::standard, 0, KdaNaming::glm5_next_transformers);
  c.output_gate_bias = true;
  c.lower_bound = -7.0;  // ignored by the standard gate
  finite_difference_check(c);
}

// ---- chunked core vs the FP64 recurrence --------------------------------------------------------

TEST(KdaLayer, ChunkedMatchesRecurrentF64) {
  Rng rng(testing::test_seed());
  for (KdaGateKind gate : {KdaGateKind::lower_bound, KdaGateKind::standard}) {
    KdaConfig c = small_config(gate, 6);
    c.hidden_size = 24;
    c.head_k_dim = 16;
    c.head_v_dim = 12;
    KdaLayer chunk(c, policy_of(GemmKind::native), kPath, DType::f64);
    randomize(chunk, rng);
    c.core = KdaCoreImpl::recurrent;
    KdaLayer rec(c, policy_of(GemmKind::native), kPath, DType::f64);
    copy_params(chunk, rec);
    // 130 (three chunks, the last partial), 1, 69 tokens
    const Problem p = make_problem(c, {0, 130, 131, 200}, DType::f64, rng);
    const RunResult a = run(chunk, p), b = run(rec, p);
    double worst = 0;
    auto cmp = [&](const Tensor& x, const Tensor& y, const std::string& what) {
      worst = std::max(worst, rel(x, y));
      EXPECT_TRUE(rel_close(x, y, 1e-12, what));
    };
    cmp(a.y, b.y, "y");
    cmp(a.fin.conv, b.fin.conv, "final conv state");
    cmp(a.fin.recurrent, b.fin.recurrent, "final recurrent state");
    cmp(a.g.dx, b.g.dx, "dx");
    cmp(a.g.dinitial.conv, b.g.dinitial.conv, "d initial conv state");
    cmp(a.g.dinitial.recurrent, b.g.dinitial.recurrent, "d initial recurrent state");
    auto names = chunk.named_parameters();
    for (size_t i = 0; i < names.size(); ++i)
      cmp(a.param_grads[i], b.param_grads[i], "grad " + names[i].first);
    std::printf("[measured] chunk vs recurrent f64 (%s gate): worst rel_l2 %.2e\n",
                gate == KdaGateKind::standard ? "standard" : "lower-bound", worst);
  }
}

// ---- packed == one by one -----------------------------------------------------------------------

// With GEMMs that are row-invariant (ops::gemm gives a row the same bits whatever the row count):
// outputs, final states, dx and the initial-state gradients are bit-identical, and so are the
// conv weight gradients (summed per sequence in token order, sequences in order); the other
// parameter gradients (one GEMM or reduction over all tokens) agree to rel_l2 <= tol_params.
// OpenBLAS 0.3.21 (the CPU GEMM) is row-invariant here only for reduction dims <= 16 (measured:
// at K = 32 the rows of a 70-row product differ in the last bit from the same rows of a 130-row
// product, single-threaded too), so `bitwise` runs use D = 16, K = V = 4 (every GEMM reduces over
// <= 16) and the other runs compare to rel_l2 <= tol_out (docs/kda.md "The layer").
void packed_vs_sequential(DType dt, bool bitwise, double tol_out, double tol_params) {
  Rng rng(testing::test_seed());
  KdaConfig c = small_config(KdaGateKind::lower_bound, 4);
  if (bitwise) c.head_k_dim = c.head_v_dim = 4;
  KdaLayer l(c, policy_of(GemmKind::native), kPath, dt);
  randomize(l, rng);
  const std::vector<int64_t> cu{0, 70, 71, 130};
  const Problem p = make_problem(c, cu, dt, rng);
  const RunResult packed = run(l, p);
  l.zero_grad();
  double worst_out = 0, worst = 0;
  auto same = [&](const Tensor& a, const Tensor& b, const std::string& what) {
    worst_out = std::max(worst_out, rel(a, b));
    if (bitwise)
      EXPECT_TRUE(testing::bit_equal(a, b)) << what;
    else
      EXPECT_TRUE(rel_close(a, b, tol_out, what));
  };
  for (size_t n = 0; n + 1 < cu.size(); ++n) {
    const int64_t b = cu[n], e = cu[n + 1], ni = int64_t(n);
    Problem q;
    q.x = p.x.slice(0, b, e).contiguous();
    q.cu = cu_of({0, e - b});
    q.init.conv = p.init.conv.slice(0, ni, ni + 1).contiguous();
    q.init.recurrent = p.init.recurrent.slice(0, ni, ni + 1).contiguous();
    q.dy = p.dy.slice(0, b, e).contiguous();
    q.dfin.conv = p.dfin.conv.slice(0, ni, ni + 1).contiguous();
    q.dfin.recurrent = p.dfin.recurrent.slice(0, ni, ni + 1).contiguous();
    KdaLayer::Saved s;
    KdaState fin;
    const Tensor y = l.forward(Context{}, q.x, q.cu, &q.init, &s, &fin);
    const KdaLayer::Grads g = l.backward(Context{}, q.dy, s, &q.dfin);  // grads accumulate
    const std::string w = fmt::format("sequence {} ({}): ", n, dtype_name(dt));
    same(y, packed.y.slice(0, b, e), w + "y");
    same(fin.conv, packed.fin.conv.slice(0, ni, ni + 1), w + "final conv state");
    same(fin.recurrent, packed.fin.recurrent.slice(0, ni, ni + 1), w + "final recurrent state");
    same(g.dx, packed.g.dx.slice(0, b, e), w + "dx");
    same(g.dinitial.conv, packed.g.dinitial.conv.slice(0, ni, ni + 1), w + "d initial conv");
    same(g.dinitial.recurrent, packed.g.dinitial.recurrent.slice(0, ni, ni + 1),
         w + "d initial recurrent");
  }
  auto params = l.named_parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& g = params[i].second->grad;
    if (bitwise && params[i].first == "conv1d.weight") {
      EXPECT_TRUE(testing::bit_equal(g, packed.param_grads[i])) << params[i].first;
    } else {
      worst = std::max(worst, rel(g, packed.param_grads[i]));
      EXPECT_TRUE(rel_close(g, packed.param_grads[i], tol_params, params[i].first));
    }
  }
  std::printf(
      "[measured] packed vs one by one (%s, %s): outputs/dx/states worst rel_l2 %.2e, "
      "parameter grads %.2e\n",
      dtype_name(dt), bitwise ? "K = V = 4, bitwise" : "K = V = 8", worst_out, worst);
}

TEST(KdaLayer, PackedEqualsOneByOneBitwiseF64) {
  packed_vs_sequential(DType::f64, true, 0, 1e-14);
}
TEST(KdaLayer, PackedEqualsOneByOneBitwiseF32) {
  packed_vs_sequential(DType::f32, true, 0, 1e-6);
}
TEST(KdaLayer, PackedMatchesOneByOneWideGemmsF64) {
  packed_vs_sequential(DType::f64, false, 1e-15, 1e-14);
}
TEST(KdaLayer, PackedMatchesOneByOneWideGemmsF32) {
  packed_vs_sequential(DType::f32, false, 1e-6, 1e-6);
}

// ---- recompute ---------------------------------------------------------------------------------

TEST(KdaLayer, RecomputeGivesBitIdenticalGradients) {
  Rng rng(testing::test_seed());
  for (GemmKind kind : {GemmKind::bf16, GemmKind::fp8_block}) {
    const KdaConfig c = small_config(KdaGateKind::lower_bound, 4);
    KdaLayer l(c, policy_of(kind), kPath, DType::f32);
    randomize(l, rng);
    const Problem p = make_problem(c, {0, 66, 67, 90}, DType::f32, rng);
    const RunResult a = run(l, p, false), b = run(l, p, true);
    // under recompute only the input is kept
    KdaLayer::Saved s;
    Context rc;
    rc.recompute = true;
    l.forward(rc, p.x, p.cu, &p.init, &s);
    EXPECT_TRUE(s.recompute);
    EXPECT_TRUE(s.x.defined());
    EXPECT_FALSE(s.o.defined());
    EXPECT_FALSE(s.q_proj.x.defined());
    const char* k = gemm_kind_name(kind);
    EXPECT_TRUE(testing::bit_equal(a.y, b.y)) << k;
    EXPECT_TRUE(testing::bit_equal(a.g.dx, b.g.dx)) << k;
    EXPECT_TRUE(testing::bit_equal(a.g.dinitial.conv, b.g.dinitial.conv)) << k;
    EXPECT_TRUE(testing::bit_equal(a.g.dinitial.recurrent, b.g.dinitial.recurrent)) << k;
    auto names = l.named_parameters();
    for (size_t i = 0; i < names.size(); ++i)
      EXPECT_TRUE(testing::bit_equal(a.param_grads[i], b.param_grads[i]))
          << k << " " << names[i].first;
    // and a second run without recompute repeats the first bit for bit (determinism)
    const RunResult a2 = run(l, p, false);
    EXPECT_TRUE(testing::bit_equal(a.g.dx, a2.g.dx)) << k;
  }
}

// ---- precision policy ---------------------------------------------------------------------------

TEST(KdaLayer, KdaDisableFp8TakesEveryKdaGemmOutOfFp8) {
  const KdaConfig c = small_config(KdaGateKind::lower_bound, 4);
  auto kinds = [&](const PrecisionPolicy& pol) {
    KdaLayer l(c, pol, kPath, DType::f32);
    std::vector<std::pair<std::string, GemmKind>> out;
    for (auto& [n, lin] : l.linears()) out.emplace_back(n, lin->precision().kind);
    return out;
  };
  auto is_proj = [](const std::string& n) {
    return n == "q_proj" || n == "k_proj" || n == "v_proj" || n == "o_proj";
  };
  PrecisionPolicy fp8 = policy_of(GemmKind::fp8_block);
  const auto a = kinds(fp8);
  ASSERT_EQ(a.size(), 9u);  // q, k, v, f_a, f_b, b, g_a, g_b, o
  for (auto& [n, k] : a) EXPECT_EQ(k, is_proj(n) ? GemmKind::fp8_block : GemmKind::bf16) << n;
  PrecisionPolicy off = fp8;
  off.kda_disable_fp8 = true;
  for (auto& [n, k] : kinds(off)) EXPECT_EQ(k, GemmKind::bf16) << n << " with kda_disable_fp8";
  // modules_to_not_convert: the full path of one projection, or an ancestor of the layer
  PrecisionPolicy one = fp8;
  one.modules_to_not_convert = {std::string(kPath) + ".k_proj"};
  for (auto& [n, k] : kinds(one))
    EXPECT_EQ(k, is_proj(n) && n != "k_proj" ? GemmKind::fp8_block : GemmKind::bf16) << n;
  PrecisionPolicy anc = fp8;
  anc.modules_to_not_convert = {"model.layers.0"};
  for (auto& [n, k] : kinds(anc)) EXPECT_EQ(k, GemmKind::bf16) << n;
  PrecisionPolicy other = fp8;
  other.modules_to_not_convert = {"model.layers.1"};
  for (auto& [n, k] : kinds(other))
    EXPECT_EQ(k, is_proj(n) ? GemmKind::fp8_block : GemmKind::bf16) << n;

  // An fp8_block run differs from the bf16 one (kda_disable_fp8) but stays close.
  Rng rng(testing::test_seed());
  KdaConfig c2 = c;
  c2.hidden_size = 64;
  c2.head_k_dim = c2.head_v_dim = 16;
  KdaLayer l8(c2, fp8, kPath, DType::f32), l16(c2, off, kPath, DType::f32),
      lref(c2, policy_of(GemmKind::native), kPath, DType::f64);
  randomize(l8, rng);
  copy_params(l8, l16);
  copy_params(l8, lref);
  const Problem p = make_problem(c2, {0, 100, 130}, DType::f32, rng);
  Problem p64 = p;
  p64.x = p.x.to(DType::f64);
  p64.init = {p.init.conv.to(DType::f64), p.init.recurrent.to(DType::f64)};
  p64.dy = p.dy.to(DType::f64);
  p64.dfin = {p.dfin.conv.to(DType::f64), p.dfin.recurrent.to(DType::f64)};
  const RunResult r8 = run(l8, p), r16 = run(l16, p), rref = run(lref, p64);
  const double y_8_16 = rel(r8.y, r16.y), dx_8_16 = rel(r8.g.dx, r16.g.dx);
  const double y_8 = rel(r8.y, rref.y), y_16 = rel(r16.y, rref.y);
  const double dx_8 = rel(r8.g.dx, rref.g.dx), dx_16 = rel(r16.g.dx, rref.g.dx);
  const double dwq_8 = rel(grad_of(l8, r8, "q_proj.weight"), grad_of(lref, rref, "q_proj.weight"));
  std::printf(
      "[measured] fp8_block vs bf16: y %.2e dx %.2e; vs f64: y fp8 %.2e bf16 %.2e, dx fp8 %.2e "
      "bf16 %.2e, dWq fp8 %.2e\n",
      y_8_16, dx_8_16, y_8, y_16, dx_8, dx_16, dwq_8);
  EXPECT_GT(y_8_16, 1e-4);  // FP8 really ran
  EXPECT_GT(dx_8_16, 1e-4);
  // measured: y 7.4e-2, dx 1.4e-1 (E4M3 keeps 3 mantissa bits, ~5% per quantized GEMM, 16x the
  // bf16 error, and dx goes through three FP8 GEMMs: o_proj dgrad, q/k/v fprop and dgrad)
  EXPECT_LT(y_8_16, 0.15);
  EXPECT_LT(dx_8_16, 0.25);
  EXPECT_LT(y_8, 0.15);
  EXPECT_LT(dx_8, 0.25);
  EXPECT_LT(y_16, 2e-2);  // bf16 operands: ~2^-9 relative per operand
  EXPECT_LT(dx_16, 2e-2);
  EXPECT_LT(y_16, y_8);  // and FP8 is the coarser of the two
}

// ---- bf16 parameters, keep_fp32, safetensors ---------------------------------------------------

TEST(KdaLayer, Bf16KeepsAlogDtBiasFp32ThroughSafetensors) {
  Rng rng(testing::test_seed());
  const KdaConfig c = small_config(KdaGateKind::lower_bound, 4);
  KdaLayer f32(c, policy_of(GemmKind::native), kPath, DType::f32);
  randomize(f32, rng);
  KdaLayer b16(c, policy_of(GemmKind::native), kPath, DType::f32);
  copy_params(f32, b16);
  b16.to_dtype(DType::bf16);
  for (auto& [n, p] : b16.named_parameters()) {
    EXPECT_EQ(p->keep_fp32, is_keep_fp32_name(n)) << n;
    if (n == "A_log" || n == "dt_bias") {
      EXPECT_TRUE(p->keep_fp32 && p->no_weight_decay) << n;
      EXPECT_EQ(p->value.dtype(), DType::f32) << n;
      EXPECT_TRUE(testing::bit_equal(p->value, f32.find_parameter(n)->value)) << n;
    } else {
      EXPECT_EQ(p->value.dtype(), DType::bf16) << n;
    }
    if (n == "o_norm.weight") EXPECT_TRUE(p->no_weight_decay);
    if (n == "q_proj.weight") EXPECT_FALSE(p->no_weight_decay);
  }
  // Save under the full checkpoint names, load into a fresh bf16 layer.
  safetensors::TensorMap m;
  for (auto& [n, p] : b16.named_parameters(std::string(kPath) + ".")) m[n] = p->value;
  const std::string file = ::testing::TempDir() + "/kda_layer.safetensors";
  safetensors::save(file, m);
  const safetensors::Contents loaded = safetensors::load(file);
  EXPECT_EQ(loaded.tensors.size(), m.size());
  KdaLayer back(c, policy_of(GemmKind::native), kPath, DType::bf16);
  for (auto& [n, p] : back.named_parameters(std::string(kPath) + ".")) {
    auto it = loaded.tensors.find(n);
    ASSERT_NE(it, loaded.tensors.end()) << n;
    ASSERT_EQ(it->second.dtype(), p->value.dtype()) << n;
    ASSERT_EQ(it->second.shape(), p->value.shape()) << n;
    p->value.copy_(it->second);
    EXPECT_TRUE(testing::bit_equal(p->value, m.at(n))) << n;
  }
  EXPECT_EQ(back.A_log().value.dtype(), DType::f32);
  EXPECT_EQ(back.dt_bias().value.dtype(), DType::f32);
  // The bf16 layer's output is close to the f32 layer's; the reloaded one is identical.
  const Problem p = make_problem(c, {0, 50, 80}, DType::f32, rng);
  const RunResult rf = run(f32, p), rb = run(b16, p), rl = run(back, p);
  EXPECT_TRUE(testing::bit_equal(rb.y, rl.y));
  EXPECT_TRUE(testing::bit_equal(rb.g.dx, rl.g.dx));
  const double ey = rel(rb.y, rf.y), edx = rel(rb.g.dx, rf.g.dx);
  std::printf("[measured] bf16 parameters vs f32: y rel_l2 %.2e, dx rel_l2 %.2e\n", ey, edx);
  EXPECT_GT(ey, 1e-5);  // the weights really were rounded
  EXPECT_LT(ey, 2e-2);
  EXPECT_LT(edx, 2e-2);
  for (auto& g : rb.param_grads) EXPECT_EQ(g.dtype(), DType::f32);
  // A bf16 input is computed in f32 and gives a bf16 output.
  const Tensor yb = b16.forward(Context{false, false}, p.x.to(DType::bf16), p.cu, &p.init, nullptr);
  EXPECT_EQ(yb.dtype(), DType::bf16);
  EXPECT_LT(rel(yb, rb.y), 2e-2);
}

// ---- prefill split through the returned states
// ---------------------------------------------------

// T tokens at once == the first part, then the rest from the returned conv + recurrent states;
// and backward through the split (the second part's initial-state gradients fed to the first
// part as final-state gradients) gives the same dx, initial-state and parameter gradients.
void prefill_split(DType dt, double tol_fwd, double tol_bwd) {
  Rng rng(testing::test_seed());
  const KdaConfig c = small_config(KdaGateKind::lower_bound, 4);
  KdaLayer l(c, policy_of(GemmKind::native), kPath, dt);
  randomize(l, rng);
  // Sequences of 70, 5, 40 tokens split after 30, 1 (shorter than W-1: its conv state reaches
  // into the initial state) and 38 (the second part, 2 tokens, is shorter than W-1).
  const std::vector<int64_t> len{70, 5, 40}, first{30, 1, 38};
  std::vector<int64_t> cu{0}, cu1{0}, cu2{0};
  for (size_t n = 0; n < len.size(); ++n) {
    cu.push_back(cu.back() + len[n]);
    cu1.push_back(cu1.back() + first[n]);
    cu2.push_back(cu2.back() + len[n] - first[n]);
  }
  const Problem p = make_problem(c, cu, dt, rng);
  const RunResult full = run(l, p);
  // gather rows of the first / second parts
  auto part = [&](const Tensor& t, bool second) {
    std::vector<Tensor> rows;
    int64_t total = 0;
    for (size_t n = 0; n < len.size(); ++n) {
      const int64_t b = cu[n] + (second ? first[n] : 0), e = second ? cu[n + 1] : cu[n] + first[n];
      rows.push_back(t.slice(0, b, e));
      total += e - b;
    }
    Tensor out = Tensor::empty({total, t.size(1)}, t.dtype());
    int64_t o = 0;
    for (const Tensor& r : rows) {
      out.slice(0, o, o + r.size(0)).copy_(r);
      o += r.size(0);
    }
    return out;
  };
  Problem p1, p2;
  p1.x = part(p.x, false);
  p1.cu = cu_of(cu1);
  p1.init = p.init;
  p1.dy = part(p.dy, false);
  p2.x = part(p.x, true);
  p2.cu = cu_of(cu2);
  p2.dy = part(p.dy, true);
  p2.dfin = p.dfin;
  KdaLayer::Saved s1, s2;
  KdaState fin1;
  const Tensor y1 = l.forward(Context{}, p1.x, p1.cu, &p1.init, &s1, &fin1);
  p2.init = fin1;
  KdaState fin2;
  const Tensor y2 = l.forward(Context{}, p2.x, p2.cu, &p2.init, &s2, &fin2);
  double worst_fwd = 0, worst_bwd = 0;
  auto check = [&](const Tensor& a, const Tensor& b, bool fwd, const std::string& what) {
    double& w = fwd ? worst_fwd : worst_bwd;
    w = std::max(w, rel(a, b));
    EXPECT_TRUE(rel_close(a, b, fwd ? tol_fwd : tol_bwd, what));
  };
  check(y1, part(full.y, false), true, "y (first part)");
  check(y2, part(full.y, true), true, "y (second part)");
  check(fin2.conv, full.fin.conv, true, "final conv state");
  check(fin2.recurrent, full.fin.recurrent, true, "final recurrent state");
  l.zero_grad();
  const KdaLayer::Grads g2 = l.backward(Context{}, p2.dy, s2, &p2.dfin);
  const KdaLayer::Grads g1 = l.backward(Context{}, p1.dy, s1, &g2.dinitial);
  check(g1.dx, part(full.g.dx, false), false, "dx (first part)");
  check(g2.dx, part(full.g.dx, true), false, "dx (second part)");
  check(g1.dinitial.conv, full.g.dinitial.conv, false, "d initial conv state");
  check(g1.dinitial.recurrent, full.g.dinitial.recurrent, false, "d initial recurrent state");
  auto params = l.named_parameters();
  for (size_t i = 0; i < params.size(); ++i)
    check(params[i].second->grad, full.param_grads[i], false, params[i].first);
  std::printf("[measured] prefill split (%s): outputs/states worst rel_l2 %.2e, gradients %.2e\n",
              dtype_name(dt), worst_fwd, worst_bwd);
}

TEST(KdaLayer, PrefillSplitMatchesFullRunF64) {
  prefill_split(DType::f64, 1e-12, 1e-12);
}
TEST(KdaLayer, PrefillSplitMatchesFullRunF32) {
  prefill_split(DType::f32, 2e-6, 1e-5);
}

// ---- saturated lower-bound gates over long sequences --------------------------------------------

// z + dt_bias = +-40 with exp(A_log) = e^2: the sigmoid saturates, g = -5 exactly (strongest
// forgetting) on value heads 0 and 2, and g -> 0 (no decay: the state integrates 600 tokens) on
// heads 1 and 3. Outputs and every gradient stay finite, and the f32 chunked layer agrees with the
// layer run on the FP64 recurrence.
TEST(KdaLayer, SaturatedLowerBoundGatesLongSequencesStayFinite) {
  Rng rng(testing::test_seed());
  KdaConfig c = small_config(KdaGateKind::lower_bound, 4);
  KdaLayer l(c, policy_of(GemmKind::native), kPath, DType::f32);
  randomize(l, rng);
  l.A_log().value.fill_(2.0);
  float* db = l.dt_bias().value.data<float>();
  for (int64_t h = 0; h < c.num_v_heads; ++h)
    for (int64_t k = 0; k < c.head_k_dim; ++k) db[h * c.head_k_dim + k] = h % 2 ? -40.f : 40.f;
  c.core = KdaCoreImpl::recurrent;
  KdaLayer ref(c, policy_of(GemmKind::native), kPath, DType::f32);
  copy_params(l, ref);
  const Problem p = make_problem(c, {0, 600, 1000}, DType::f32, rng);
  const RunResult a = run(l, p), b = run(ref, p);
  auto finite = [](const Tensor& t, const std::string& what) {
    for (double v : t.to_f64_vector())
      if (!std::isfinite(v)) return ::testing::AssertionFailure() << what << " has " << v;
    return ::testing::AssertionSuccess();
  };
  EXPECT_TRUE(finite(a.y, "y"));
  EXPECT_TRUE(finite(a.fin.recurrent, "final state"));
  EXPECT_TRUE(finite(a.g.dx, "dx"));
  EXPECT_TRUE(finite(a.g.dinitial.recurrent, "d initial state"));
  auto names = l.named_parameters();
  for (size_t i = 0; i < names.size(); ++i) EXPECT_TRUE(finite(a.param_grads[i], names[i].first));
  const double ey = rel(a.y, b.y), edx = rel(a.g.dx, b.g.dx),
               es = rel(a.fin.recurrent, b.fin.recurrent);
  std::printf(
      "[measured] saturated gates T=1000 f32 chunk vs f64 recurrence: y %.2e dx %.2e "
      "S_T %.2e\n",
      ey, edx, es);
  EXPECT_LT(ey, 1e-5);
  EXPECT_LT(edx, 1e-5);
  EXPECT_LT(es, 1e-5);
  // saturated sigmoid: no gradient reaches A_log / dt_bias through the gate
  for (double v : grad_of(l, a, "A_log").to_f64_vector()) EXPECT_EQ(v, 0.0);
}

// ---- checkpoint names, init ---------------------------------------------------------------------

TEST(KdaLayer, CheckpointNamesAndShapes) {
  const KdaConfig c = small_config(KdaGateKind::lower_bound, 4);
  auto names = [&](KdaNaming nm, int64_t rank) {
    KdaConfig cc = c;
    cc.naming = nm;
    cc.decay_rank = cc.output_gate_rank = rank;
    KdaLayer l(cc, policy_of(GemmKind::native), kPath, DType::f32);
    std::vector<std::string> out;
    for (auto& [n, p] : l.named_parameters()) out.push_back(n + shape_str(p->value.shape()));
    return out;
  };
  const std::vector<std::string> glm{"conv1d.weight[64, 1, 4]",
                                     "A_log[4]",
                                     "dt_bias[32]",
                                     "o_norm.weight[8]",
                                     "q_proj.weight[16, 16]",
                                     "k_proj.weight[16, 16]",
                                     "v_proj.weight[32, 16]",
                                     "f_a_proj.weight[4, 16]",
                                     "f_b_proj.weight[32, 4]",
                                     "b_proj.weight[4, 16]",
                                     "g_a_proj.weight[4, 16]",
                                     "g_b_proj.weight[32, 4]",
                                     "o_proj.weight[16, 32]"};
  EXPECT_EQ(names(KdaNaming::glm5_next, 4), glm);
  const std::vector<std::string> hf{"conv1d.weight[64, 1, 4]",
                                    "forget_gate.A_log[4]",
                                    "forget_gate.dt_bias[32]",
                                    "o_norm.weight[8]",
                                    "q_proj.weight[16, 16]",
                                    "k_proj.weight[16, 16]",
                                    "v_proj.weight[32, 16]",
                                    "forget_gate.f_a_proj.weight[4, 16]",
                                    "forget_gate.f_b_proj.weight[32, 4]",
                                    "b_proj.weight[4, 16]",
                                    "g_a_proj.weight[4, 16]",
                                    "g_b_proj.weight[32, 4]",
                                    "o_proj.weight[16, 32]"};
  EXPECT_EQ(names(KdaNaming::glm5_next_transformers, 4), hf);
  const std::vector<std::string> kimi{"q_conv1d.weight[16, 1, 4]",
                                      "k_conv1d.weight[16, 1, 4]",
                                      "v_conv1d.weight[32, 1, 4]",
                                      "A_log[4]",
                                      "dt_bias[32]",
                                      "o_norm.weight[8]",
                                      "q_proj.weight[16, 16]",
                                      "k_proj.weight[16, 16]",
                                      "v_proj.weight[32, 16]",
                                      "f_proj.weight[32, 16]",
                                      "b_proj.weight[4, 16]",
                                      "g_proj.weight[32, 16]",
                                      "o_proj.weight[16, 32]"};
  EXPECT_EQ(names(KdaNaming::kimi_linear, 0), kimi);

  // The same seed gives the same layer under every naming (fused or separate conv).
  Rng rng(testing::test_seed());
  const Problem p = make_problem(c, {0, 20, 45}, DType::f32, rng);
  Tensor y0;
  for (KdaNaming nm :
       {KdaNaming::glm5_next, KdaNaming::glm5_next_transformers, KdaNaming::kimi_linear}) {
    KdaConfig cc = c;
    cc.naming = nm;
    KdaLayer l(cc, policy_of(GemmKind::native), kPath, DType::f32);
    l.init_weights(1234);
    const Tensor y = l.forward(Context{false, false}, p.x, p.cu, &p.init, nullptr);
    if (!y0.defined())
      y0 = y;
    else
      EXPECT_TRUE(testing::bit_equal(y, y0)) << kda_naming_name(nm);
  }

  // init_weights: deterministic, and the reference ranges.
  for (KdaGateKind gate : {KdaGateKind::lower_bound, KdaGateKind::standard}) {
    KdaConfig cc = c;
    cc.gate = gate;
    KdaLayer a(cc, policy_of(GemmKind::native), kPath, DType::f32),
        b(cc, policy_of(GemmKind::native), kPath, DType::f32);
    a.init_weights(7);
    b.init_weights(7);
    auto pa = a.named_parameters(), pb = b.named_parameters();
    for (size_t i = 0; i < pa.size(); ++i)
      EXPECT_TRUE(testing::bit_equal(pa[i].second->value, pb[i].second->value)) << pa[i].first;
    for (double v : a.A_log().value.to_f64_vector()) {
      if (gate == KdaGateKind::standard) {
        EXPECT_GE(v, 0.0);
        EXPECT_LT(v, std::log(16.0) + 1e-6);
      } else {
        EXPECT_EQ(v, 0.0);
      }
    }
    for (double v : a.dt_bias().value.to_f64_vector()) {
      const double dt = std::log1p(std::exp(v));  // softplus(dt_bias) = dt
      EXPECT_GE(dt, 1e-3 * (1 - 1e-5));
      EXPECT_LE(dt, 1e-1 * (1 + 1e-5));
    }
    const double bound = 1.0 / std::sqrt(16.0);
    for (double v : a.linears()[0].second->weight().value.to_f64_vector())
      EXPECT_LE(std::fabs(v), bound);
    for (double v : a.o_norm_weight().value.to_f64_vector()) EXPECT_EQ(v, 1.0);
  }
}

// ---- errors -------------------------------------------------------------------------------------

TEST(KdaLayer, BadConfigAndInputAreClearErrors) {
  const KdaConfig c = small_config(KdaGateKind::lower_bound, 4);
  const PrecisionPolicy pol = policy_of(GemmKind::native);
  auto build = [&](KdaConfig cc) { KdaLayer l(cc, pol, kPath); };
  for (double lb : {-6.0, 0.0, 0.5}) {
    KdaConfig cc = c;
    cc.lower_bound = lb;
    EXPECT_THROW(build(cc), Error);
    const std::string m = testing::error_of([&] { build(cc); });
    EXPECT_NE(m.find("lower_bound"), std::string::npos) << m;
    EXPECT_NE(m.find("[-5, 0)"), std::string::npos) << m;
  }
  {
    KdaConfig cc = c;
    cc.lower_bound = -5.0;  // the edge is allowed
    EXPECT_NO_THROW(build(cc));
  }
  struct Bad {
    const char* field;
    void (*set)(KdaConfig&);
  };
  const Bad bad[] = {
      {"num_v_heads", [](KdaConfig& k) { k.num_v_heads = 3; }},
      {"hidden_size", [](KdaConfig& k) { k.hidden_size = 0; }},
      {"head_k_dim", [](KdaConfig& k) { k.head_k_dim = -1; }},
      {"conv_kernel", [](KdaConfig& k) { k.conv_kernel = 0; }},
      {"decay_rank", [](KdaConfig& k) { k.decay_rank = -2; }},
      {"norm_eps", [](KdaConfig& k) { k.norm_eps = 0; }},
  };
  for (const Bad& b : bad) {
    KdaConfig cc = c;
    b.set(cc);
    const std::string m = testing::error_of([&] { build(cc); });
    EXPECT_NE(m.find(b.field), std::string::npos) << b.field << ": " << m;
  }

  KdaLayer l(c, pol, kPath);
  l.init_weights(3);
  Rng rng(testing::test_seed());
  const Tensor x = randn({10, 16}, DType::f32, rng);
  const Tensor cu = cu_of({0, 4, 10});
  {  // wrong x width
    const std::string m = testing::error_of([&] {
      l.forward(Context{}, randn({10, 15}, DType::f32, rng), cu, nullptr, nullptr);
    });
    EXPECT_NE(m.find("x must be [T, hidden_size = 16]"), std::string::npos) << m;
    EXPECT_NE(m.find(kPath), std::string::npos) << m;
  }
  {  // cu_seqlens not ending at T
    const std::string m = testing::error_of([&] {
      l.forward(Context{}, x, cu_of({0, 4, 9}), nullptr, nullptr);
    });
    EXPECT_NE(m.find("cu_seqlens must end at the token count T = 10"), std::string::npos) << m;
  }
  {  // a layout covering 9 of the 10 tokens, and one of no sequences
    const std::string m = testing::error_of([&] {
      l.forward(Context{}, x, SeqLayout::from_lengths({4, 5}), nullptr, nullptr);
    });
    EXPECT_NE(m.find("the sequence layout covers 9 tokens, x has 10"), std::string::npos) << m;
    EXPECT_NE(m.find(kPath), std::string::npos) << m;
    const std::string m0 = testing::error_of([&] {
      l.forward(Context{}, Tensor::zeros({0, 16}, DType::f32), SeqLayout::from_lengths({}), nullptr,
                nullptr);
    });
    EXPECT_NE(m0.find("must hold N >= 1 sequences"), std::string::npos) << m0;
  }
  {  // the layout and its cu_seqlens tensor give the same bits
    const Tensor y_t = l.forward(Context{}, x, cu, nullptr, nullptr);
    const Tensor y_s = l.forward(Context{}, x, SeqLayout::from_lengths({4, 6}), nullptr, nullptr);
    EXPECT_TRUE(testing::bit_equal(y_t, y_s));
  }
  {  // cu_seqlens decreasing
    const std::string m = testing::error_of([&] {
      l.forward(Context{}, x, cu_of({0, 6, 4, 10}), nullptr, nullptr);
    });
    EXPECT_NE(m.find("non-decreasing"), std::string::npos) << m;
  }
  {  // a state for the wrong number of sequences
    KdaState st;
    st.recurrent = Tensor::zeros({3, 4, 8, 8}, DType::f32);
    const std::string m = testing::error_of([&] { l.forward(Context{}, x, cu, &st, nullptr); });
    EXPECT_NE(m.find("initial recurrent state"), std::string::npos) << m;
    st.recurrent = Tensor();
    st.conv = Tensor::zeros({2, 4, 40}, DType::f32);
    const std::string m2 = testing::error_of([&] { l.forward(Context{}, x, cu, &st, nullptr); });
    EXPECT_NE(m2.find("initial conv state"), std::string::npos) << m2;
  }
  {  // backward: wrong dy, empty Saved
    KdaLayer::Saved s;
    l.forward(Context{}, x, cu, nullptr, &s);
    const std::string m = testing::error_of([&] { l.backward(Context{}, x.slice(0, 0, 9), s); });
    EXPECT_NE(m.find("dy must be [T = 10, hidden_size = 16]"), std::string::npos) << m;
    const std::string m2 = testing::error_of([&] { l.backward(Context{}, x, KdaLayer::Saved{}); });
    EXPECT_NE(m2.find("Saved"), std::string::npos) << m2;
  }
  EXPECT_THROW(KdaLayer(c, pol, kPath, DType::i32), Error);
}

}  // namespace
}  // namespace hlm
