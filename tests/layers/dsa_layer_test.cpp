// DsaLayer (layers/dsa/dsa_layer.h): short sequences equal dense MLA; the sparse output against a
// brute-force masked dense attention in FP64 written here (expanded keys/values, softmax over
// exactly the selected set); finite-difference gradients through the sparse path with the
// selection checked unchanged; packed == documents (token-level and KPool); the indexer loss
// against a naive FP64 KL written here; detachment of the indexer; recompute; bad input.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "core/rng.h"
#include "layers/dsa/dsa_layer.h"
#include "testing.h"

namespace hlm {
namespace {

using hlm::testing::cu_of;
using hlm::testing::total;

using hlm::testing::bit_equal;
using hlm::testing::close;
using hlm::testing::grad_check;
using hlm::testing::test_seed;
using Vec = std::vector<double>;

std::vector<int64_t> starts_of(const std::vector<int64_t>& lens) {
  std::vector<int64_t> st;
  int64_t s = 0;
  for (int64_t L : lens) {
    for (int64_t j = 0; j < L; ++j) st.push_back(s);
    s += L;
  }
  return st;
}

PrecisionPolicy native_policy() {
  PrecisionPolicy p;
  p.default_kind = GemmKind::native;
  return p;
}

// MLA D = 16, H = 2, q_lora 8, kv_lora 8, d_nope 4, d_rope dr, d_v 4; indexer H_I = 2, d_I = 4.
DsaLayerConfig tiny(int64_t dr, int64_t K, int64_t P, DType dt = DType::f64, bool indexer = true) {
  DsaLayerConfig c;
  c.mla.hidden_size = 16;
  c.mla.num_heads = 2;
  c.mla.q_lora_rank = 8;
  c.mla.kv_lora_rank = 8;
  c.mla.qk_nope_head_dim = 4;
  c.mla.qk_rope_head_dim = dr;
  c.mla.v_head_dim = 4;
  c.mla.rope_theta = 10.0;
  c.mla.param_dtype = dt;
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
    ic.dtype = dt;
    ic.seed = 3;
    c.indexer = ic;
  }
  c.indexer_loss_coeff = 0.7;
  return c;
}

// Random parameters (MLA and indexer) of unit-scale activations, so that the selection and the
// KL are far from degenerate.
void randomize(Module& m, Rng& rng) {
  for (auto& [name, p] : m.named_parameters()) {
    const Shape& s = p->value.shape();
    Tensor t = randn(s, DType::f64, rng, 1.0);
    auto v = t.to_f64_vector();
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
    p->value.copy_(Tensor::from_values(s, v, DType::f64));
  }
}

bool is_indexer_param(const std::string& name) {
  return name.rfind("indexer.", 0) == 0;
}

struct LayerRun {
  DsaLayer::Output out;
  Tensor dx;
  std::vector<std::pair<std::string, Tensor>> grads;
};

LayerRun run(DsaLayer& l, const Tensor& x, const Tensor& cu, const Tensor& dy,
             Context ctx = Context{}, double grad_scale = 1.0) {
  l.zero_grad();
  DsaLayer::Saved s;
  LayerRun r;
  r.out = l.forward(ctx, x, cu, &s);
  r.dx = l.backward(ctx, dy, s, grad_scale);
  for (auto& [name, p] : l.named_parameters()) r.grads.emplace_back(name, p->grad.clone());
  return r;
}

// ---- naive FP64 references ----------------------------------------------------------------------

// Per-head attention logits of query t against key s in the EXPANDED form, from the layer's
// projections: k_nope_h(s) = W_UK_h c_kv(s), score = scale (q_nope . k_nope + q_pe . k_pe).
struct Expanded {
  int64_t T, H, dn, dr, dv, rkv;
  double scale;
  Vec q, kv, wkvb;
  double logit(int64_t t, int64_t s, int64_t h) const {
    double acc = 0;
    for (int64_t i = 0; i < dn; ++i) {
      double k = 0;
      for (int64_t c = 0; c < rkv; ++c)
        k += wkvb[size_t((h * (dn + dv) + i) * rkv + c)] * kv[size_t(s * (rkv + dr) + c)];
      acc += q[size_t((t * H + h) * (dn + dr) + i)] * k;
    }
    for (int64_t i = 0; i < dr; ++i)
      acc += q[size_t((t * H + h) * (dn + dr) + dn + i)] * kv[size_t(s * (rkv + dr) + rkv + i)];
    return scale * acc;
  }
  double value(int64_t s, int64_t h, int64_t c2) const {
    double v = 0;
    for (int64_t c = 0; c < rkv; ++c)
      v += wkvb[size_t((h * (dn + dv) + dn + c2) * rkv + c)] * kv[size_t(s * (rkv + dr) + c)];
    return v;
  }
};

Expanded expanded_of(DsaLayer& l, const Tensor& x, const Tensor& cu) {
  const MlaConfig& c = l.config();
  const Mla::Projected p =
      l.project(Context{false}, x, SeqLayout::from_tensor(cu, x.size(0)), nullptr);
  return Expanded{x.size(0),
                  c.num_heads,
                  c.qk_nope_head_dim,
                  c.qk_rope_head_dim,
                  c.v_head_dim,
                  c.kv_lora_rank,
                  c.softmax_scale_value(),
                  p.q.to_f64_vector(),
                  p.kv.to_f64_vector(),
                  l.kv_b_proj().weight_value().to_f64_vector()};
}

std::vector<std::vector<int64_t>> rows_of(const Tensor& indices) {
  const int64_t T = indices.size(0), W = indices.size(1);
  const auto v = indices.to_f64_vector();
  std::vector<std::vector<int64_t>> r(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < W; ++j)
      if (v[size_t(t * W + j)] >= 0) r[size_t(t)].push_back(int64_t(v[size_t(t * W + j)]));
  return r;
}

// Per-head softmax over `set`, head-summed and L1-normalised (the target p*).
Vec target_over(const Expanded& e, int64_t t, const std::vector<int64_t>& set) {
  Vec acc(set.size(), 0.0);
  for (int64_t h = 0; h < e.H; ++h) {
    Vec l;
    double m = -INFINITY;
    for (int64_t s : set) l.push_back(e.logit(t, s, h)), m = std::max(m, l.back());
    double z = 0;
    for (double a : l) z += std::exp(a - m);
    for (size_t j = 0; j < set.size(); ++j) acc[j] += std::exp(l[j] - m) / z;
  }
  double tot = 0;
  for (double a : acc) tot += a;
  for (double& a : acc) a /= tot;
  return acc;
}

double kl(const Vec& p, const Vec& scores) {
  double m = -INFINITY, z = 0, r = 0;
  for (double s : scores) m = std::max(m, s);
  for (double s : scores) z += std::exp(s - m);
  for (size_t j = 0; j < p.size(); ++j)
    r += p[j] * (std::log(p[j] + 1e-10) - std::log(std::exp(scores[j] - m) / z + 1e-10));
  return r;
}

// The indexer loss (docs/dsa.md, "Indexer KL loss" and "Pool-level KL for KPool: our design") from
// scratch: p* over the set the main attention attends, pooled for KPool, the KL against the softmax
// of the indexer's scores (dense layout, from the indexer module), coeff * mean over non-empty
// rows.
double naive_indexer_loss(DsaLayer& l, const Tensor& x, const std::vector<int64_t>& lens,
                          const Tensor& attended, DsaStage stage) {
  const Tensor cu = cu_of(lens);
  const Expanded e = expanded_of(l, x, cu);
  const IndexerConfig& ic = *l.layer_config().indexer;
  const int64_t P = ic.kpool;
  const Mla::Projected p =
      l.project(Context{false}, x, SeqLayout::from_tensor(cu, x.size(0)), nullptr);
  const Tensor sc = l.indexer().forward(Context{false}, x, p.c_q, cu, nullptr).scores;
  const int64_t W = sc.size(1);
  const auto scores = sc.to_f64_vector();
  const auto st = starts_of(lens);
  const auto rows = rows_of(attended);
  double sum = 0;
  int64_t used = 0;
  for (int64_t t = 0; t < e.T; ++t) {
    const int64_t s0 = st[size_t(t)], r = t - s0;
    std::vector<int64_t> set = rows[size_t(t)];
    if (stage == DsaStage::dense_warmup) {
      set.clear();
      for (int64_t s = s0; s <= t; ++s) set.push_back(s);
    }
    const Vec pstar = target_over(e, t, set);
    Vec tgt, isc;
    if (P == 1) {
      tgt = pstar;
      for (int64_t s : set) isc.push_back(scores[size_t(t * W + (s - s0))]);
    } else {
      // pools of the set: complete pools p < floor((r + 1) / P) whose tokens are attended
      std::set<int64_t> pools;
      for (int64_t s : set)
        if ((s - s0) / P < (r + 1) / P) pools.insert((s - s0) / P);
      double tot = 0;
      for (int64_t pl : pools) {
        double m = 0;
        for (size_t j = 0; j < set.size(); ++j)
          if ((set[j] - s0) / P == pl) m += pstar[j];
        tgt.push_back(m);
        tot += m;
        isc.push_back(scores[size_t(t * W + pl)]);
      }
      for (double& a : tgt) a /= tot;
    }
    if (tgt.empty()) continue;
    sum += kl(tgt, isc);
    ++used;
  }
  return l.layer_config().indexer_loss_coeff * sum / double(used);
}

// One OpenMP thread for the duration of a test (restored on exit). These shapes are tiny: a
// parallel region costs more than it saves, far more when the 2 CI cores are shared, and finite
// differences run thousands of forwards. The packed == documents tests keep the default thread
// count, so the layers also run multi-threaded here; the ops' own tests check thread-count
// independence.
struct OneThread {
  int saved = omp_get_max_threads();
  OneThread() { omp_set_num_threads(1); }
  ~OneThread() { omp_set_num_threads(saved); }
};

// ---- tests --------------------------------------------------------------------------------------

TEST(DsaLayer, ConfigValidation) {
  const OneThread one_thread;
  auto expect_error = [](const std::function<void(DsaLayerConfig&)>& edit,
                         const std::string& what) {
    DsaLayerConfig c = tiny(0, 4, 1);
    edit(c);
    try {
      DsaLayer l(c, native_policy());
      ADD_FAILURE() << "no error for " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  expect_error([](DsaLayerConfig& c) { c.indexer->hidden_size = 12; }, "indexer.hidden_size");
  expect_error([](DsaLayerConfig& c) { c.indexer->q_lora_rank = 6; }, "indexer.q_lora_rank");
  expect_error([](DsaLayerConfig& c) { c.mla.q_lora_rank = 0; }, "q_lora_rank is 0");
  expect_error([](DsaLayerConfig& c) { c.indexer->dtype = DType::f32; }, "both be f64");
  expect_error([](DsaLayerConfig& c) { c.indexer_loss_coeff = -1; }, "indexer_loss_coeff");
  expect_error([](DsaLayerConfig& c) { c.mla.v_head_dim = 0; }, "v_head_dim");
  expect_error([](DsaLayerConfig& c) { c.indexer->topk = 5, c.indexer->kpool = 2; }, "divisible");
  DsaLayer dense(tiny(0, 4, 1, DType::f64, false), native_policy());
  EXPECT_FALSE(dense.has_indexer());
  EXPECT_THROW(dense.indexer(), Error);
}

TEST(DsaLayer, ParameterNamesAndPrecision) {
  const OneThread one_thread;
  PrecisionPolicy pol;
  pol.default_kind = GemmKind::fp8_block;
  pol.mla_proj_disable_quantization = true;
  DsaLayer l(tiny(2, 4, 2), pol, "model.layers.3.self_attn");
  std::set<std::string> names;
  for (auto& [n, p] : l.named_parameters()) names.insert(n);
  const std::set<std::string> expected{"q_a_layernorm.weight",
                                       "kv_a_layernorm.weight",
                                       "q_a_proj.weight",
                                       "q_b_proj.weight",
                                       "kv_a_proj_with_mqa.weight",
                                       "kv_b_proj.weight",
                                       "o_proj.weight",
                                       "indexer.wq_b.weight",
                                       "indexer.wk.weight",
                                       "indexer.k_norm.weight",
                                       "indexer.k_norm.bias",
                                       "indexer.weights_proj.weight",
                                       "indexer.index_kpool_compress_gate",
                                       "indexer.index_kpool_compress_ape"};
  EXPECT_EQ(names, expected);
  for (Linear* m :
       {&l.q_a_proj(), &l.q_b_proj(), &l.kv_a_proj_with_mqa(), &l.kv_b_proj(), &l.o_proj()})
    EXPECT_EQ(m->precision().kind, GemmKind::bf16);
  // the indexer's q/k projections have their own flag
  EXPECT_EQ(l.indexer().wq_b().precision().kind, GemmKind::fp8_block);
  EXPECT_EQ(l.indexer().path(), "model.layers.3.self_attn.indexer");
  // init_weights re-initialises MLA only: the indexer keeps its own init (ape stays zero)
  l.init_weights(11);
  for (double v : l.indexer().kpool_ape()->value.to_f64_vector()) EXPECT_EQ(v, 0.0);
  for (double v : l.find_parameter("kv_a_layernorm.weight")->value.to_f64_vector())
    EXPECT_EQ(v, 1.0);
}

TEST(DsaLayer, ShortSequencesEqualDenseMla) {
  const OneThread one_thread;
  // Every document no longer than K: the indexer selects all causal tokens, so the sparse layer
  // is dense absorbed MLA, bit for bit (same sparse_attention entries in the same order), and
  // equals the expanded form to ~1e-12.
  Rng rng(test_seed());
  const std::vector<int64_t> lens{3, 1, 4, 2};
  const Tensor cu = cu_of(lens);
  const int64_t T = total(lens);
  for (int64_t P : {1, 2})
    for (DType dt : {DType::f64, DType::f32}) {
      SCOPED_TRACE(fmt::format("P {} {}", P, dtype_name(dt)));
      DsaLayer l(tiny(2, 4, P, dt), native_policy());
      randomize(l, rng);
      const Tensor x = randn({T, 16}, dt, rng), dy = randn({T, 16}, dt, rng);
      const LayerRun r = run(l, x, cu, dy);
      // reference: the MLA forward/backward of the same parameters
      l.zero_grad();
      Mla::Saved ms;
      const Tensor y = l.mla().forward(Context{}, x, cu, &ms);
      const Tensor dx = l.mla().backward(Context{}, dy, ms);
      EXPECT_TRUE(bit_equal(r.out.y, y));
      EXPECT_TRUE(bit_equal(r.dx, dx));
      for (auto& [name, g] : r.grads)
        if (!is_indexer_param(name))
          EXPECT_TRUE(bit_equal(g, l.find_parameter(name)->grad)) << name;
      if (dt == DType::f64) {
        l.mla().set_form(MlaForm::expanded);
        const Tensor ye = l.mla().forward(Context{false}, x, cu, nullptr);
        const testing::ErrorStats st = testing::compare(r.out.y, ye);
        EXPECT_LT(st.rel_l2, 1e-13) << st.report(ye);
        l.mla().set_form(MlaForm::absorbed);
      }
      // the attended set is every causal token
      const auto rows = rows_of(r.out.indices);
      const auto st = starts_of(lens);
      for (int64_t t = 0; t < T; ++t)
        EXPECT_EQ(int64_t(rows[size_t(t)].size()), t - st[size_t(t)] + 1) << t;
    }
  // No indexer: dense attention for any length, bit for bit the absorbed MLA.
  DsaLayer d(tiny(0, 4, 1, DType::f32, false), native_policy());
  randomize(d, rng);
  const std::vector<int64_t> long_lens{11, 9};
  const Tensor x = randn({20, 16}, DType::f32, rng);
  EXPECT_TRUE(bit_equal(d.forward(Context{false}, x, cu_of(long_lens), nullptr).y,
                        d.mla().forward(Context{false}, x, cu_of(long_lens), nullptr)));
}

TEST(DsaLayer, SparseMatchesMaskedDenseFp64) {
  const OneThread one_thread;
  Rng rng(test_seed());
  const std::vector<int64_t> lens{9, 1, 12};
  const Tensor cu = cu_of(lens);
  const int64_t T = total(lens);
  const auto st = starts_of(lens);
  for (int64_t dr : {0, 2})
    for (int64_t P : {1, 2}) {
      SCOPED_TRACE(fmt::format("d_r {} P {}", dr, P));
      DsaLayer l(tiny(dr, 4, P), native_policy());
      randomize(l, rng);
      const Tensor x = randn({T, 16}, DType::f64, rng);
      const DsaLayer::Output out = l.forward(Context{false}, x, cu, nullptr);
      const auto rows = rows_of(out.indices);
      // really sparse: long rows attend fewer than their causal tokens
      int64_t sparse_rows = 0;
      for (int64_t t = 0; t < T; ++t) {
        EXPECT_LE(int64_t(rows[size_t(t)].size()), 4 + P - 1);
        sparse_rows += int64_t(rows[size_t(t)].size()) < t - st[size_t(t)] + 1;
      }
      EXPECT_GE(sparse_rows, 10);
      // brute force: expanded per-head keys/values, softmax over exactly the selected set
      const Expanded e = expanded_of(l, x, cu);
      Vec o(size_t(T * e.H * e.dv), 0.0);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < e.H; ++h) {
          Vec lg;
          double m = -INFINITY, z = 0;
          for (int64_t s : rows[size_t(t)])
            lg.push_back(e.logit(t, s, h)), m = std::max(m, lg.back());
          for (double a : lg) z += std::exp(a - m);
          for (size_t j = 0; j < lg.size(); ++j)
            for (int64_t c = 0; c < e.dv; ++c)
              o[size_t((t * e.H + h) * e.dv + c)] +=
                  std::exp(lg[j] - m) / z * e.value(rows[size_t(t)][j], h, c);
        }
      const Vec wo = l.o_proj().weight_value().to_f64_vector();
      Vec y(size_t(T * 16), 0.0);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t d = 0; d < 16; ++d)
          for (int64_t j = 0; j < e.H * e.dv; ++j)
            y[size_t(t * 16 + d)] += wo[size_t(d * e.H * e.dv + j)] * o[size_t(t * e.H * e.dv + j)];
      EXPECT_TRUE(close(out.y, Tensor::from_values({T, 16}, y, DType::f64),
                        testing::tolerance_for(DType::f64)));
      // and it is not the dense result
      const Tensor dense = l.mla().forward(Context{false}, x, cu, nullptr);
      EXPECT_GT(testing::compare(out.y, dense).rel_l2, 1e-3);
    }
}

TEST(DsaLayer, GradientsMatchFiniteDifferences) {
  const OneThread one_thread;
  // Through the sparse path with the indices fixed by the forward: every probe re-runs the
  // forward and checks that the selection did not change. MLA parameters and x against
  // d(probe . y); indexer parameters against d(indexer loss) (the target is detached, so the two
  // losses have disjoint parameter sets).
  Rng rng(test_seed());
  const std::vector<int64_t> lens{8, 1, 9};
  const Tensor cu = cu_of(lens);
  const int64_t T = total(lens);
  struct Case {
    int64_t dr, P;
    DsaStage stage;
  };
  for (const Case& k : {Case{0, 1, DsaStage::sparse}, Case{2, 2, DsaStage::sparse},
                        Case{0, 2, DsaStage::dense_warmup}}) {
    SCOPED_TRACE(fmt::format("d_r {} P {} {}", k.dr, k.P,
                             k.stage == DsaStage::sparse ? "sparse" : "dense_warmup"));
    DsaLayerConfig cfg = tiny(k.dr, 4, k.P);
    cfg.stage = k.stage;
    DsaLayer l(cfg, native_policy());
    randomize(l, rng);
    Tensor x = randn({T, 16}, DType::f64, rng);
    const Tensor probe = randn({T, 16}, DType::f64, rng);
    const LayerRun r = run(l, x, cu, probe);
    ASSERT_TRUE(r.out.has_indexer_loss);
    bool changed = false;
    auto lm_loss = [&] {
      const DsaLayer::Output o = l.forward(Context{false}, x, cu, nullptr);
      if (!bit_equal(o.indices, r.out.indices)) changed = true;
      return testing::dot(o.y, probe);
    };
    auto ix_loss = [&] {
      DsaLayer::Saved s;
      const DsaLayer::Output o = l.forward(Context{}, x, cu, &s);
      if (!bit_equal(o.indices, r.out.indices)) changed = true;
      return o.indexer_loss;
    };
    EXPECT_TRUE(grad_check(lm_loss, x, r.dx, 1e-6, 1e-7, 48)) << "dx";
    for (auto& [name, g] : r.grads) {
      if (is_indexer_param(name))
        EXPECT_TRUE(grad_check(ix_loss, l.find_parameter(name)->value, g, 1e-6, 1e-7, 48)) << name;
      else
        EXPECT_TRUE(grad_check(lm_loss, l.find_parameter(name)->value, g, 1e-6, 1e-7, 48)) << name;
    }
    EXPECT_FALSE(changed) << "a finite-difference probe changed the selection";
  }
}

TEST(DsaLayer, IndexerLossMatchesNaiveKl) {
  const OneThread one_thread;
  Rng rng(test_seed());
  const std::vector<int64_t> lens{9, 2, 11};
  const Tensor cu = cu_of(lens);
  const int64_t T = total(lens);
  for (int64_t P : {1, 2})
    for (DsaStage stage : {DsaStage::dense_warmup, DsaStage::sparse}) {
      SCOPED_TRACE(fmt::format("P {} {}", P, stage == DsaStage::sparse ? "sparse" : "dense"));
      DsaLayerConfig cfg = tiny(2, 4, P);
      cfg.stage = stage;
      DsaLayer l(cfg, native_policy());
      randomize(l, rng);
      const Tensor x = randn({T, 16}, DType::f64, rng);
      DsaLayer::Saved s;
      const DsaLayer::Output out = l.forward(Context{}, x, cu, &s);
      ASSERT_TRUE(out.has_indexer_loss);
      // the sparse stage's set is the indexer's selection; the dense stage attends everything
      const Tensor sel = l.indexer().forward(Context{false}, x, s.p.c_q, cu, nullptr).indices;
      const double ref = naive_indexer_loss(l, x, lens, sel, stage);
      EXPECT_NEAR(out.indexer_loss, ref, 1e-12 * std::fabs(ref)) << out.indexer_loss;
      EXPECT_GT(ref, 1e-3);
      EXPECT_EQ(out.indexer_loss_rows, P == 1 ? T : T - 3);  // KPool: rows with a pool
      // the loss is not computed outside training
      EXPECT_FALSE(l.forward(Context{false}, x, cu, nullptr).has_indexer_loss);
    }
}

TEST(DsaLayer, PackedEqualsDocumentsBitwise) {
  // y and dx per document bit for bit, indices shifted by the document start (KPool pools and the
  // tail restart per document); with the per-token (sum) reduction the loss and the indexer
  // gradients are the sums over documents (to rounding of that sum).
  Rng rng(test_seed());
  const std::vector<int64_t> lens{9, 1, 6, 11};
  const int64_t T = total(lens);
  for (auto [P, dt] : {std::pair{int64_t(1), DType::f32}, std::pair{int64_t(2), DType::f64},
                       std::pair{int64_t(2), DType::f32}}) {
    SCOPED_TRACE(fmt::format("P {} {}", P, dtype_name(dt)));
    DsaLayerConfig cfg = tiny(2, 4, P, dt);
    cfg.indexer_loss_reduction = ops::KlReduction::sum;
    DsaLayer l(cfg, native_policy());
    randomize(l, rng);
    const Tensor x = randn({T, 16}, dt, rng), dy = randn({T, 16}, dt, rng);
    const LayerRun r = run(l, x, cu_of(lens), dy);
    double loss_sum = 0;
    std::vector<Vec> gsum(r.grads.size());
    for (size_t i = 0; i < gsum.size(); ++i) gsum[i].assign(size_t(r.grads[i].second.numel()), 0);
    int64_t s0 = 0;
    for (int64_t L : lens) {
      auto part = [&](const Tensor& t) { return t.slice(0, s0, s0 + L).contiguous(); };
      const LayerRun d = run(l, part(x), cu_of({L}), part(dy));
      EXPECT_TRUE(bit_equal(d.out.y, part(r.out.y))) << "y at " << s0;
      EXPECT_TRUE(bit_equal(d.dx, part(r.dx))) << "dx at " << s0;
      auto iv = d.out.indices.to_f64_vector();
      for (double& v : iv) v = v < 0 ? -1 : v + double(s0);
      const Tensor packed_rows = part(r.out.indices);
      EXPECT_EQ(iv, packed_rows.to_f64_vector()) << "indices at " << s0;
      loss_sum += d.out.indexer_loss;
      for (size_t i = 0; i < gsum.size(); ++i) {
        const auto g = d.grads[i].second.to_f64_vector();
        for (size_t j = 0; j < g.size(); ++j) gsum[i][j] += g[j];
      }
      s0 += L;
    }
    EXPECT_NEAR(r.out.indexer_loss, loss_sum, (dt == DType::f64 ? 1e-12 : 1e-5) * loss_sum);
    for (size_t i = 0; i < gsum.size(); ++i)
      EXPECT_TRUE(close(r.grads[i].second,
                        Tensor::from_values(r.grads[i].second.shape(), gsum[i], DType::f64),
                        testing::tolerance_for(dt)))
          << r.grads[i].first;
  }
}

TEST(DsaLayer, IndexerIsDetachedAndLossScaled) {
  const OneThread one_thread;
  Rng rng(test_seed());
  const std::vector<int64_t> lens{10, 7};
  const Tensor cu = cu_of(lens);
  const int64_t T = total(lens);
  DsaLayer l(tiny(0, 4, 2, DType::f32), native_policy());
  randomize(l, rng);
  const Tensor x = randn({T, 16}, DType::f32, rng), dy = randn({T, 16}, DType::f32, rng);
  const LayerRun with = run(l, x, cu, dy, Context{}, 1.0);
  const LayerRun without = run(l, x, cu, dy, Context{}, 0.0);  // indexer backward skipped
  const LayerRun no_dy = run(l, x, cu, Tensor::zeros({T, 16}, DType::f32), Context{}, 1.0);
  const LayerRun doubled = run(l, x, cu, dy, Context{}, 2.0);
  // The indexer loss changes nothing outside the indexer (its inputs are detached) ...
  EXPECT_TRUE(bit_equal(with.dx, without.dx));
  for (size_t i = 0; i < with.grads.size(); ++i) {
    const std::string& n = with.grads[i].first;
    const auto g = with.grads[i].second.to_f64_vector();
    double norm = 0;
    for (double v : g) norm += v * v;
    EXPECT_GT(norm, 0) << n;
    if (!is_indexer_param(n)) {
      EXPECT_TRUE(bit_equal(with.grads[i].second, without.grads[i].second)) << n;
      for (double v : no_dy.grads[i].second.to_f64_vector()) ASSERT_EQ(v, 0.0) << n;
    } else {
      // ... and the LM gradient never reaches the indexer
      for (double v : without.grads[i].second.to_f64_vector()) ASSERT_EQ(v, 0.0) << n;
      EXPECT_TRUE(bit_equal(with.grads[i].second, no_dy.grads[i].second)) << n;
      // grad_scale multiplies the indexer gradient (exactly, a power of two), not the loss
      const auto g2 = doubled.grads[i].second.to_f64_vector();
      for (size_t j = 0; j < g.size(); ++j) ASSERT_EQ(g2[j], 2 * g[j]) << n;
    }
  }
  for (double v : no_dy.dx.to_f64_vector()) ASSERT_EQ(v, 0.0);
  EXPECT_EQ(doubled.out.indexer_loss, with.out.indexer_loss);
  // indexer_loss = false: no loss, no indexer gradient
  DsaLayerConfig off = tiny(0, 4, 2, DType::f32);
  off.indexer_loss = false;
  DsaLayer lo(off, native_policy());
  for (auto& [n, p] : lo.named_parameters()) p->value.copy_(l.find_parameter(n)->value);
  const LayerRun r = run(lo, x, cu, dy);
  EXPECT_FALSE(r.out.has_indexer_loss);
  EXPECT_TRUE(bit_equal(r.out.y, with.out.y));
  EXPECT_TRUE(bit_equal(r.dx, with.dx));
  for (auto& [n, g] : r.grads)
    if (is_indexer_param(n))
      for (double v : g.to_f64_vector()) ASSERT_EQ(v, 0.0) << n;
}

TEST(DsaLayer, RecomputeIsBitIdentical) {
  const OneThread one_thread;
  Rng rng(test_seed());
  const std::vector<int64_t> lens{12, 5};
  const Tensor cu = cu_of(lens);
  const int64_t T = total(lens);
  for (DsaStage stage : {DsaStage::sparse, DsaStage::dense_warmup}) {
    DsaLayerConfig cfg = tiny(2, 4, 2, DType::f32);
    cfg.stage = stage;
    DsaLayer l(cfg, native_policy());
    randomize(l, rng);
    const Tensor x = randn({T, 16}, DType::f32, rng), dy = randn({T, 16}, DType::f32, rng);
    const LayerRun a = run(l, x, cu, dy);
    Context rc;
    rc.recompute = true;
    l.zero_grad();
    DsaLayer::Saved s;
    const DsaLayer::Output o = l.forward(rc, x, cu, &s);
    EXPECT_FALSE(s.full);
    EXPECT_FALSE(s.q_abs.defined());
    EXPECT_TRUE(bit_equal(o.y, a.out.y));
    EXPECT_EQ(o.indexer_loss, a.out.indexer_loss);
    const Tensor dx = l.backward(rc, dy, s);
    EXPECT_TRUE(bit_equal(dx, a.dx));
    for (auto& [n, g] : a.grads) EXPECT_TRUE(bit_equal(l.find_parameter(n)->grad, g)) << n;
  }
}

TEST(DsaLayer, Bf16ParametersRun) {
  const OneThread one_thread;
  Rng rng(test_seed());
  const std::vector<int64_t> lens{10, 7};
  const int64_t T = total(lens);
  PrecisionPolicy pol;
  pol.default_kind = GemmKind::bf16;
  DsaLayer l(tiny(0, 4, 2, DType::bf16), pol);
  randomize(l, rng);
  EXPECT_EQ(l.indexer().kpool_ape()->value.dtype(), DType::f32);  // keep-in-FP32
  const Tensor x = randn({T, 16}, DType::bf16, rng), dy = randn({T, 16}, DType::bf16, rng);
  const LayerRun r = run(l, x, cu_of(lens), dy);
  EXPECT_EQ(r.out.y.dtype(), DType::bf16);
  EXPECT_EQ(r.dx.dtype(), DType::bf16);
  EXPECT_TRUE(std::isfinite(r.out.indexer_loss));
  for (auto& [n, g] : r.grads) {
    EXPECT_EQ(g.dtype(), DType::f32) << n;
    for (double v : g.to_f64_vector()) ASSERT_TRUE(std::isfinite(v)) << n;
  }
}

TEST(DsaLayer, BadInput) {
  const OneThread one_thread;
  Rng rng(test_seed());
  DsaLayer l(tiny(0, 4, 1), native_policy());
  randomize(l, rng);
  const Tensor x = randn({10, 16}, DType::f64, rng);
  auto expect_error = [](const std::function<void()>& f, const std::string& what) {
    try {
      f();
      ADD_FAILURE() << "no error, expected one mentioning '" << what << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  DsaLayer::Saved s;
  const Context ctx;
  expect_error(
      [&] {
        l.forward(ctx, randn({10, 12}, DType::f64, rng), cu_of({10}), &s);
      },
      "hidden_size");
  expect_error([&] { l.forward(ctx, Tensor(), cu_of({10}), &s); }, "x must be");
  expect_error([&] { l.forward(ctx, x, cu_of({4, 5}), &s); }, "cu_seqlens");
  expect_error([&] { l.backward(ctx, x, DsaLayer::Saved{}); }, "Saved is empty");
  l.forward(ctx, x, cu_of({10}), &s);
  expect_error([&] { l.backward(ctx, randn({10, 15}, DType::f64, rng), s); }, "dy");
  expect_error([&] { l.backward(ctx, x, s, NAN); }, "indexer_grad_scale");
}

}  // namespace
}  // namespace hlm
