// Tests of ops/moe.h: plain-loop FP64 references written here from docs/mhc_moe.md ("MoE"),
// brute-force top-k and group enumeration, finite differences of every input and parameter.
#include "ops/moe.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <set>
#include <vector>

#include "core/seq_layout.h"
#include "testing.h"

namespace hlm::ops {
namespace {

using hlm::testing::close;
using hlm::testing::dot;
using hlm::testing::grad_check;
using hlm::testing::test_seed;

double sigm(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

std::vector<int64_t> row(const Tensor& idx, int64_t t) {
  const auto v = idx.to_f64_vector();
  const int64_t K = idx.size(1);
  std::vector<int64_t> r;
  for (int64_t k = 0; k < K; ++k) r.push_back(int64_t(v[size_t(t * K + k)]));
  return r;
}

// Brute-force selection: all experts ordered by (s_sel desc, index asc) via a full stable sort,
// restricted to `allowed`.
std::vector<int64_t> brute_topk(const std::vector<double>& sel, const std::vector<bool>& allowed,
                                int64_t K) {
  std::vector<int64_t> e;
  for (size_t i = 0; i < sel.size(); ++i)
    if (allowed[i]) e.push_back(int64_t(i));
  std::stable_sort(e.begin(), e.end(), [&](int64_t a, int64_t b) { return sel[a] > sel[b]; });
  e.resize(size_t(K));
  return e;
}

TEST(MoeRouter, MatchesBruteForceReference) {
  Rng rng(test_seed());
  MoeRouterConfig c;
  c.n_experts = 16;
  c.top_k = 4;
  const int64_t T = 11;
  Tensor logits = randn({T, 16}, DType::f64, rng, 2.0), bias = randn({16}, DType::f64, rng, 0.3);
  for (bool norm : {true, false}) {
    c.norm_topk_prob = norm;
    MoeRouterResult r = moe_router_forward(logits, bias, c);
    ASSERT_EQ(r.topk_idx.shape(), Shape({T, 4}));
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> s(16), sel(16);
      for (int e = 0; e < 16; ++e) s[e] = sigm(logits.at({t, e})), sel[e] = s[e] + bias.at({e});
      const auto want = brute_topk(sel, std::vector<bool>(16, true), 4);
      const auto got = row(r.topk_idx, t);
      EXPECT_EQ(std::set<int64_t>(got.begin(), got.end()),
                std::set<int64_t>(want.begin(), want.end()));
      double sum = 0;
      for (int64_t e : got) sum += s[size_t(e)];
      for (int k = 0; k < 4; ++k) {
        const double w = s[size_t(got[k])] / (norm ? sum + 1e-20 : 1.0) * 2.5;
        EXPECT_NEAR(r.topk_weight.at({t, k}), w, 1e-14);
      }
    }
  }
  // f32 path agrees
  c.norm_topk_prob = true;
  MoeRouterResult r64 = moe_router_forward(logits, bias, c);
  MoeRouterResult r32 = moe_router_forward(logits.to(DType::f32), bias.to(DType::f32), c);
  EXPECT_EQ(r32.topk_weight.dtype(), DType::f32);
  EXPECT_TRUE(close(r32.topk_weight, r64.topk_weight, {1e-6, 1e-6}));
}

TEST(MoeRouter, TiesGoToTheLowerIndex) {
  MoeRouterConfig c;
  c.n_experts = 8;
  c.top_k = 3;
  // token 0: all equal -> 0, 1, 2; token 1: experts 5 and 2 tie above the rest, then 1 and 7 tie
  std::vector<double> l(16, 0.0);
  l[8 + 5] = l[8 + 2] = 1.0;
  l[8 + 7] = l[8 + 1] = 0.5;
  Tensor logits = Tensor::from_values({2, 8}, l, DType::f64);
  MoeRouterResult r = moe_router_forward(logits, Tensor(), c);
  EXPECT_EQ(row(r.topk_idx, 0), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(row(r.topk_idx, 1), (std::vector<int64_t>{2, 5, 1}));
  // the bias breaks the tie and only the selection: the weights stay unbiased
  Tensor bias = Tensor::from_values({8}, {0, 0, 0, 0, 0, 0, 0, 1e-3}, DType::f64);
  MoeRouterResult rb = moe_router_forward(logits, bias, c);
  EXPECT_EQ(row(rb.topk_idx, 1), (std::vector<int64_t>{2, 5, 7}));
  const double s1 = sigm(1.0), s2 = sigm(0.5);
  EXPECT_NEAR(rb.topk_weight.at({1, 2}), s2 / (2 * s1 + s2) * 2.5, 1e-15);
  // random ties: values on a coarse grid, compare with the brute force as ordered lists
  Rng rng(test_seed());
  c.n_experts = 12;
  c.top_k = 5;
  Tensor q = rand_uniform({20, 12}, DType::f64, rng, 0, 3);
  std::vector<double> qv = q.to_f64_vector();
  for (double& v : qv) v = std::floor(v);
  Tensor ql = Tensor::from_values({20, 12}, qv, DType::f64);
  MoeRouterResult rq = moe_router_forward(ql, Tensor(), c);
  for (int64_t t = 0; t < 20; ++t) {
    std::vector<double> sel(12);
    for (int e = 0; e < 12; ++e) sel[e] = sigm(qv[t * 12 + e]);
    EXPECT_EQ(row(rq.topk_idx, t), brute_topk(sel, std::vector<bool>(12, true), 5));
  }
}

TEST(MoeRouter, GroupLimitedMatchesEnumeration) {
  Rng rng(test_seed());
  MoeRouterConfig c;
  c.n_experts = 24;
  c.n_group = 6;
  c.topk_group = 3;
  c.top_k = 5;
  const int64_t T = 30, gs = 4;
  Tensor logits = randn({T, 24}, DType::f64, rng, 2.0), bias = randn({24}, DType::f64, rng, 0.2);
  MoeRouterResult r = moe_router_forward(logits, bias, c);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> sel(24);
    for (int e = 0; e < 24; ++e) sel[e] = sigm(logits.at({t, e})) + bias.at({e});
    std::vector<double> gscore(6);
    for (int g = 0; g < 6; ++g) {
      std::vector<double> v(sel.begin() + g * gs, sel.begin() + (g + 1) * gs);
      std::sort(v.rbegin(), v.rend());
      gscore[g] = v[0] + v[1];
    }
    // every subset of 3 of the 6 groups: the best total group score wins
    double best = -1e300;
    int best_mask = 0;
    for (int mask = 0; mask < 64; ++mask) {
      if (__builtin_popcount(mask) != 3) continue;
      double tot = 0;
      for (int g = 0; g < 6; ++g)
        if (mask >> g & 1) tot += gscore[g];
      if (tot > best) best = tot, best_mask = mask;
    }
    std::vector<bool> allowed(24);
    for (int e = 0; e < 24; ++e) allowed[e] = (best_mask >> (e / gs)) & 1;
    const auto want = brute_topk(sel, allowed, 5);
    const auto got = row(r.topk_idx, t);
    EXPECT_EQ(std::set<int64_t>(got.begin(), got.end()),
              std::set<int64_t>(want.begin(), want.end()))
        << "token " << t;
  }
}

TEST(MoeRouter, ReplayUsesGivenExpertsWithScoreWeights) {
  Rng rng(test_seed());
  MoeRouterConfig c;
  c.n_experts = 10;
  c.top_k = 3;
  const int64_t T = 6;
  Tensor logits = randn({T, 10}, DType::f64, rng);
  std::vector<int64_t> rep;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int64_t> p(10);
    std::iota(p.begin(), p.end(), 0);
    for (int64_t i = 9; i > 0; --i) std::swap(p[size_t(i)], p[rng.below(uint64_t(i + 1))]);
    rep.insert(rep.end(), p.begin(), p.begin() + 3);
  }
  Tensor ri = Tensor::from_vector<int64_t>({T, 3}, rep);
  MoeRouterResult r = moe_router_forward(logits, Tensor(), c, ri);
  EXPECT_TRUE(testing::bit_equal(r.topk_idx, ri));
  for (int64_t t = 0; t < T; ++t) {
    double sum = 0;
    for (int k = 0; k < 3; ++k) sum += sigm(logits.at({t, rep[size_t(t * 3 + k)]}));
    for (int k = 0; k < 3; ++k)
      EXPECT_NEAR(r.topk_weight.at({t, k}),
                  sigm(logits.at({t, rep[size_t(t * 3 + k)]})) / sum * 2.5, 1e-14);
  }
  // the router still gets its gradient under replay
  Tensor G = randn({T, 3}, DType::f64, rng);
  Tensor dl = moe_router_backward(logits, r, c, G);
  auto loss = [&] { return dot(moe_router_forward(logits, Tensor(), c, ri).topk_weight, G); };
  EXPECT_TRUE(grad_check(loss, logits, dl));
  // i32 replay works too; bad replays throw
  Tensor ri32 = ri.to(DType::i32);
  EXPECT_TRUE(testing::bit_equal(moe_router_forward(logits, Tensor(), c, ri32).topk_idx, ri));
  std::vector<int64_t> dup = rep;
  dup[1] = dup[0];
  EXPECT_THROW(moe_router_forward(logits, Tensor(), c, Tensor::from_vector<int64_t>({T, 3}, dup)),
               Error);
  std::vector<int64_t> oob = rep;
  oob[4] = 10;
  EXPECT_THROW(moe_router_forward(logits, Tensor(), c, Tensor::from_vector<int64_t>({T, 3}, oob)),
               Error);
  EXPECT_THROW(moe_router_forward(logits, Tensor(), c, Tensor::zeros({T, 2}, DType::i64)), Error);
}

TEST(MoeRouter, BackwardFiniteDifferences) {
  Rng rng(test_seed());
  MoeRouterConfig c;
  c.n_experts = 12;
  c.top_k = 4;
  c.n_group = 3;
  c.topk_group = 2;
  Tensor bias = randn({12}, DType::f64, rng, 0.2);
  for (bool norm : {true, false}) {
    c.norm_topk_prob = norm;
    Tensor logits = randn({7, 12}, DType::f64, rng, 1.5);
    Tensor G = randn({7, 4}, DType::f64, rng);
    MoeRouterResult r = moe_router_forward(logits, bias, c);
    Tensor dl = moe_router_backward(logits, r, c, G);
    // the selection is piecewise constant: a probe of 1e-6 does not move it
    auto loss = [&] { return dot(moe_router_forward(logits, bias, c).topk_weight, G); };
    EXPECT_TRUE(grad_check(loss, logits, dl, 1e-6, 1e-7, 84)) << "norm " << norm;
  }
}

TEST(MoeBalance, BiasUpdateSignRule) {
  Tensor bias = Tensor::from_values({4}, {0.1, 0.0, -0.2, 0.3}, DType::f32);
  Tensor idx = Tensor::from_vector<int64_t>({4, 2}, {0, 1, 0, 2, 0, 1, 3, 0});  // loads 4,2,1,1
  Tensor load = moe_expert_load(idx, 4);
  EXPECT_EQ(load.to_f64_vector(), (std::vector<double>{4, 2, 1, 1}));
  moe_bias_update(bias, load, 1e-3);  // mean 2: over-loaded down, under-loaded up, equal stays
  const auto b = bias.to_f64_vector();
  EXPECT_EQ(float(b[0]), float(0.1) - float(1e-3));
  EXPECT_EQ(float(b[1]), 0.0f);
  EXPECT_EQ(float(b[2]), float(-0.2) + float(1e-3));
  EXPECT_EQ(float(b[3]), float(0.3) + float(1e-3));
  EXPECT_THROW(moe_bias_update(bias, Tensor::zeros({3}, DType::i64), 1e-3), Error);
  EXPECT_THROW(moe_expert_load(idx, 3), Error);  // expert 3 out of range
}

double ref_aux(const Tensor& logits, const Tensor& idx, const std::vector<int64_t>& lens,
               double coeff) {
  const int64_t E = logits.size(1), K = idx.size(1);
  double tot = 0;
  int64_t n = 0, t0 = 0;
  for (int64_t L : lens) {
    if (L == 0) continue;
    double s = 0;
    for (int64_t i = 0; i < E; ++i) {
      double cnt = 0, P = 0;
      for (int64_t t = t0; t < t0 + L; ++t) {
        for (int64_t k = 0; k < K; ++k) cnt += idx.at({t, k}) == double(i) ? 1 : 0;
        double S = 0;
        for (int64_t j = 0; j < E; ++j) S += sigm(logits.at({t, j}));
        P += sigm(logits.at({t, i})) / S;
      }
      s += (double(E) / double(K * L) * cnt) * (P / double(L));
    }
    tot += coeff * s;
    ++n;
    t0 += L;
  }
  return tot / double(n);
}

TEST(MoeBalance, SeqAuxLossMatchesReferenceAndGradient) {
  Rng rng(test_seed());
  MoeRouterConfig c;
  c.n_experts = 8;
  c.top_k = 2;
  const std::vector<int64_t> lens{3, 0, 5, 1};
  const SeqLayout cu = SeqLayout::from_lengths(lens);
  Tensor logits = randn({9, 8}, DType::f64, rng, 1.5);
  MoeRouterResult r = moe_router_forward(logits, Tensor(), c);
  const double coeff = 1e-3;
  EXPECT_NEAR(moe_seq_aux_loss(logits, r.topk_idx, cu, coeff),
              ref_aux(logits, r.topk_idx, lens, coeff), 1e-16);
  // perfectly balanced uniform routing gives coeff * 1
  Tensor z = Tensor::zeros({8, 8}, DType::f64);
  std::vector<int64_t> bal;
  for (int t = 0; t < 8; ++t) bal.push_back(t), bal.push_back((t + 4) % 8);
  EXPECT_NEAR(moe_seq_aux_loss(z, Tensor::from_vector<int64_t>({8, 2}, bal),
                               SeqLayout::from_lengths({8}), coeff),
              coeff, 1e-16);
  const Tensor idx = r.topk_idx;  // f uses the fixed selection
  Tensor dl = moe_seq_aux_loss_backward(logits, idx, cu, coeff, 2.0);
  auto loss = [&] { return 2.0 * moe_seq_aux_loss(logits, idx, cu, coeff); };
  EXPECT_TRUE(grad_check(loss, logits, dl, 1e-5, 1e-9, 72));
  EXPECT_THROW(moe_seq_aux_loss(logits, idx, SeqLayout::from_lengths({3, 5}), coeff), Error);
}

// Context parallelism cuts sequences into pieces on different ranks: each piece's loss, given its
// whole sequence's length and counts, is its share, so the pieces' losses (each call's mean
// rescaled to the whole batch's sequences) sum to the whole batch's loss, and every token's
// gradient is the whole batch's (FP64, pieces cut inside sequences, one piece a single token).
TEST(MoeBalance, SeqAuxLossOfPiecesSumsToTheWhole) {
  Rng rng(test_seed());
  MoeRouterConfig c;
  c.n_experts = 8;
  c.top_k = 3;
  const std::vector<int64_t> lens{7, 12, 0, 1, 9};
  const SeqLayout seqs = SeqLayout::from_lengths(lens);
  const Tensor logits = randn({29, 8}, DType::f64, rng, 1.5);
  const Tensor idx = moe_router_forward(logits, Tensor(), c).topk_idx;
  const double coeff = 1e-2;
  const double whole = moe_seq_aux_loss(logits, idx, seqs, coeff);
  const Tensor dwhole = moe_seq_aux_loss_backward(logits, idx, seqs, coeff, 1.0);
  const double n_whole = 4;  // non-empty sequences
  double dmax = 0;
  for (double v : dwhole.to_f64_vector()) dmax = std::max(dmax, std::abs(v));
  for (const std::vector<int64_t>& bounds :
       std::vector<std::vector<int64_t>>{{0, 10, 29}, {0, 3, 4, 20, 29}, {0, 19, 20, 21, 29}}) {
    double sum = 0, worst = 0;
    for (const testing::AuxPiece& p : testing::aux_pieces(seqs, idx, 8, bounds)) {
      const Tensor l = logits.slice(0, p.begin, p.end).contiguous();
      const Tensor i = idx.slice(0, p.begin, p.end).contiguous();
      const double share = double(p.seqs.num_seqs()) / n_whole;
      sum += moe_seq_aux_loss(l, i, p.seqs, coeff, &p.whole) * share;
      const Tensor d = moe_seq_aux_loss_backward(l, i, p.seqs, coeff, share, &p.whole);
      const Tensor want = dwhole.slice(0, p.begin, p.end).contiguous();
      for (int64_t e = 0; e < d.numel(); ++e)
        worst = std::max(worst, std::abs(d.data<double>()[e] - want.data<double>()[e]));
    }
    EXPECT_NEAR(sum, whole, 1e-15 * std::abs(whole)) << bounds.size() - 1 << " pieces";
    EXPECT_LE(worst, 1e-15 * dmax) << bounds.size() - 1 << " pieces";
  }
  // The batch's own lengths and counts as `whole`: the same bits as without.
  const testing::AuxPiece all = testing::aux_pieces(seqs, idx, 8, {0, 29})[0];
  const SeqLayout nonempty = SeqLayout::from_lengths({7, 12, 1, 9});
  EXPECT_EQ(moe_seq_aux_loss(logits, idx, nonempty, coeff, &all.whole), whole);
  // A whole that does not describe the sequences is refused.
  ops::MoeAuxWhole bad = all.whole;
  bad.lengths[0] = 6;  // shorter than the piece
  EXPECT_THROW(moe_seq_aux_loss(logits, idx, nonempty, coeff, &bad), Error);
  bad = all.whole;
  bad.counts[0] += 1;  // counts no longer K per token
  EXPECT_THROW(moe_seq_aux_loss(logits, idx, nonempty, coeff, &bad), Error);
  bad = all.whole;
  bad.lengths.pop_back();
  EXPECT_THROW(moe_seq_aux_loss_backward(logits, idx, nonempty, coeff, 1.0, &bad), Error);
}

// Item 8 of the hardening list: with very negative router logits every sigmoid underflows (FP32:
// below -88.7), the sum of the scores is 0 and s / sum(s) was 0 / 0; the aux loss (and so the
// whole objective) became NaN while the main losses were finite. The normalised scores are the
// same ratios, computed without the underflow.
TEST(MoeBalance, SeqAuxLossIsFiniteWhenEverySigmoidUnderflows) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{4, 3};
  const SeqLayout cu = SeqLayout::from_lengths(lens);
  Tensor offsets = randn({7, 8}, DType::f64, rng, 2.0);
  Tensor l64 = offsets.clone();
  double* p = l64.data<double>();
  for (int64_t i = 0; i < l64.numel(); ++i) p[i] -= 200.0;
  Tensor l32 = l64.to(DType::f32);
  MoeRouterConfig c;
  c.n_experts = 8;
  c.top_k = 2;
  const Tensor idx = moe_router_forward(l64, Tensor(), c).topk_idx;
  const double coeff = 1e-3;
  // f64 does not underflow at -200: the plain formula is the reference.
  const double ref = ref_aux(l32.to(DType::f64), idx, lens, coeff);
  const double got = moe_seq_aux_loss(l32, idx, cu, coeff);
  ASSERT_TRUE(std::isfinite(got));
  EXPECT_NEAR(got, ref, 1e-5 * ref);
  const Tensor d32 = moe_seq_aux_loss_backward(l32, idx, cu, coeff);
  const Tensor d64 = moe_seq_aux_loss_backward(l32.to(DType::f64), idx, cu, coeff);
  EXPECT_TRUE(close(d32, d64, {1e-5, 1e-9}));
  // In f64 the sum underflows below about -745: there sigmoid(x) = exp(x) to double precision,
  // so s / sum(s) is a softmax of the logits, the independent reference.
  Tensor deep = offsets.clone();
  double* q = deep.data<double>();
  for (int64_t i = 0; i < deep.numel(); ++i) q[i] -= 1000.0;
  const double want = [&] {
    const int64_t E = 8, K = 2;
    double tot = 0;
    int64_t t0 = 0;
    for (int64_t L : lens) {
      std::vector<double> f(E, 0.0), P(E, 0.0);
      for (int64_t t = t0; t < t0 + L; ++t) {
        for (int64_t k = 0; k < K; ++k) f[size_t(idx.at({t, k}))] += 1;
        double m = -1e300, S = 0;
        for (int64_t e = 0; e < E; ++e) m = std::max(m, deep.at({t, e}));
        for (int64_t e = 0; e < E; ++e) S += std::exp(deep.at({t, e}) - m);
        for (int64_t e = 0; e < E; ++e) P[size_t(e)] += std::exp(deep.at({t, e}) - m) / S;
      }
      double Ls = 0;
      for (int64_t e = 0; e < E; ++e)
        Ls += double(E) / double(K * L) * f[size_t(e)] * P[size_t(e)] / double(L);
      tot += coeff * Ls;
      t0 += L;
    }
    return tot / 2.0;
  }();
  EXPECT_NEAR(moe_seq_aux_loss(deep, idx, cu, coeff), want, 1e-14);
  const Tensor dd = moe_seq_aux_loss_backward(deep, idx, cu, coeff, 2.0);
  auto loss = [&] { return 2.0 * moe_seq_aux_loss(deep, idx, cu, coeff); };
  EXPECT_TRUE(grad_check(loss, deep, dd, 1e-5, 1e-9, 56));
  // Every logit -inf: the uniform limit, L = coeff.
  const Tensor ninf = Tensor::full({7, 8}, -std::numeric_limits<double>::infinity(), DType::f32);
  EXPECT_NEAR(moe_seq_aux_loss(ninf, idx, cu, coeff), coeff, 1e-9);
}

// ---- experts
// -------------------------------------------------------------------------------------
double ref_swiglu(double g, double u, double lim) {
  if (lim > 0) g = std::min(g, lim), u = std::clamp(u, -lim, lim);
  return g * sigm(g) * u;
}

TEST(MoeSwiglu, ClampForwardAndBackward) {
  Rng rng(test_seed());
  Tensor gu = randn({5, 2, 12}, DType::f64, rng, 3.0);  // [..., 2I] with I = 6
  for (double lim : {10.0, 1.5, 0.0}) {
    Tensor h = swiglu_clamped_forward(gu, lim);
    ASSERT_EQ(h.shape(), Shape({5, 2, 6}));
    std::vector<double> ref;
    for (int64_t r = 0; r < 10; ++r)
      for (int64_t i = 0; i < 6; ++i)
        ref.push_back(ref_swiglu(gu.at({r / 2, r % 2, i}), gu.at({r / 2, r % 2, 6 + i}), lim));
    EXPECT_TRUE(close(h, Tensor::from_values({5, 2, 6}, ref, DType::f64), {1e-15, 1e-14}));
    Tensor G = randn({5, 2, 6}, DType::f64, rng);
    auto loss = [&] { return dot(swiglu_clamped_forward(gu, lim), G); };
    EXPECT_TRUE(grad_check(loss, gu, swiglu_clamped_backward(gu, G, lim), 1e-6, 1e-7, 120))
        << "limit " << lim;
  }
  // the clamp is gate <= limit one-sided, up two-sided
  Tensor e = Tensor::from_values({1, 4}, {20.0, -20.0, 20.0, -20.0}, DType::f64);
  const auto h = swiglu_clamped_forward(e, 10.0).to_f64_vector();
  EXPECT_NEAR(h[0], ref_swiglu(10.0, 10.0, 0), 1e-12);
  EXPECT_NEAR(h[1], ref_swiglu(-20.0, -10.0, 0), 1e-12);
  // h in bf16 from an f32 gu: the f32 h rounded once; other dtype pairs refused.
  const Tensor g32 = randn({3, 16}, DType::f32, rng, 3.0);
  const Tensor hb = swiglu_clamped_forward(g32, 2.0, DType::bf16);
  EXPECT_EQ(hb.dtype(), DType::bf16);
  EXPECT_TRUE(testing::bit_equal(hb, swiglu_clamped_forward(g32, 2.0).to(DType::bf16)));
  EXPECT_THROW(swiglu_clamped_forward(gu, 2.0, DType::bf16), Error);
  EXPECT_THROW(swiglu_clamped_forward(g32, 2.0, DType::f64), Error);
}

struct MoeCase {
  Tensor x, gate_up, down, sgu, sdown, idx, w;
  int64_t T, D, E, I, K, Is;
};
MoeCase make_moe(int64_t T, int64_t D, int64_t E, int64_t I, int64_t K, int64_t Is, DType dt,
                 Rng& rng) {
  MoeCase m{};
  m.T = T, m.D = D, m.E = E, m.I = I, m.K = K, m.Is = Is;
  m.x = randn({T, D}, dt, rng);
  m.gate_up = randn({E, 2 * I, D}, dt, rng, 0.7);
  m.down = randn({E, D, I}, dt, rng, 0.7);
  m.sgu = randn({2 * Is, D}, dt, rng, 0.7);
  m.sdown = randn({D, Is}, dt, rng, 0.7);
  MoeRouterConfig c;
  c.n_experts = E;
  c.top_k = K;
  MoeRouterResult r = moe_router_forward(randn({T, E}, DType::f64, rng), Tensor(), c);
  m.idx = r.topk_idx;
  m.w = r.topk_weight.to(dt);
  return m;
}

std::vector<double> ref_ffn(const std::vector<double>& x, const Tensor& gu, const Tensor& dn,
                            int64_t e, int64_t I, int64_t D, double lim) {
  // gu [.., 2I, D] / dn [.., D, I]; e < 0: 2-D shared weights
  auto G = [&](int64_t r, int64_t c) { return e < 0 ? gu.at({r, c}) : gu.at({e, r, c}); };
  auto W = [&](int64_t r, int64_t c) { return e < 0 ? dn.at({r, c}) : dn.at({e, r, c}); };
  std::vector<double> h(I), o(D, 0);
  for (int64_t i = 0; i < I; ++i) {
    double g = 0, u = 0;
    for (int64_t d = 0; d < D; ++d) g += G(i, d) * x[d], u += G(I + i, d) * x[d];
    h[i] = ref_swiglu(g, u, lim);
  }
  for (int64_t d = 0; d < D; ++d)
    for (int64_t i = 0; i < I; ++i) o[d] += W(d, i) * h[i];
  return o;
}

TEST(MoeExperts, ForwardMatchesReference) {
  Rng rng(test_seed());
  for (DType dt : {DType::f64, DType::f32}) {
    MoeCase m = make_moe(9, 6, 5, 4, 2, 3, dt, rng);
    MoeWeights w{m.gate_up, m.down, m.sgu, m.sdown};
    MoeSaved s;
    const double lim = 1.5;  // small, so the clamp is exercised
    Tensor out = moe_experts_forward(m.x, w, m.idx, m.w, lim, s);
    std::vector<double> ref;
    for (int64_t t = 0; t < m.T; ++t) {
      std::vector<double> xt(size_t(m.D));
      for (int64_t d = 0; d < m.D; ++d) xt[size_t(d)] = m.x.at({t, d});
      std::vector<double> o = ref_ffn(xt, m.sgu, m.sdown, -1, m.Is, m.D, lim);
      for (int64_t k = 0; k < m.K; ++k) {
        const auto eo = ref_ffn(xt, m.gate_up, m.down, int64_t(m.idx.at({t, k})), m.I, m.D, lim);
        for (int64_t d = 0; d < m.D; ++d) o[size_t(d)] += m.w.at({t, k}) * eo[size_t(d)];
      }
      ref.insert(ref.end(), o.begin(), o.end());
    }
    const auto tol =
        dt == DType::f64 ? testing::tolerance_for(DType::f64) : testing::Tolerance{1e-5, 1e-4};
    EXPECT_TRUE(close(out, Tensor::from_values({m.T, m.D}, ref, DType::f64), tol))
        << dtype_name(dt);
    // no shared expert
    MoeSaved s2;
    Tensor routed =
        moe_experts_forward(m.x, MoeWeights{m.gate_up, m.down, {}, {}}, m.idx, m.w, lim, s2);
    EXPECT_EQ(routed.shape(), Shape({m.T, m.D}));
  }
}

TEST(MoeExperts, BackwardFiniteDifferencesAllInputsAndWeights) {
  Rng rng(test_seed());
  MoeCase m = make_moe(7, 5, 4, 3, 2, 2, DType::f64, rng);
  const double lim = 2.0;
  MoeWeights w{m.gate_up, m.down, m.sgu, m.sdown};
  Tensor G = randn({m.T, m.D}, DType::f64, rng);
  auto loss = [&] {
    MoeSaved s;
    return dot(moe_experts_forward(m.x, w, m.idx, m.w, lim, s), G);
  };
  MoeSaved s;
  moe_experts_forward(m.x, w, m.idx, m.w, lim, s);
  MoeWeightGrads g{
      Tensor::zeros(m.gate_up.shape(), DType::f64), Tensor::zeros(m.down.shape(), DType::f64),
      Tensor::zeros(m.sgu.shape(), DType::f64), Tensor::zeros(m.sdown.shape(), DType::f64)};
  MoeGrads r = moe_experts_backward(s, w, G, g);
  EXPECT_TRUE(grad_check(loss, m.x, r.dx)) << "dx";
  EXPECT_TRUE(grad_check(loss, m.w, r.dtopk_weight)) << "dtopk_weight";
  EXPECT_TRUE(grad_check(loss, m.gate_up, g.dgate_up, 1e-6, 1e-6, 120)) << "dgate_up";
  EXPECT_TRUE(grad_check(loss, m.down, g.ddown, 1e-6, 1e-6, 60)) << "ddown";
  EXPECT_TRUE(grad_check(loss, m.sgu, g.dshared_gate_up)) << "dshared_gate_up";
  EXPECT_TRUE(grad_check(loss, m.sdown, g.dshared_down)) << "dshared_down";
  // accumulation (+=)
  Tensor d1 = g.ddown.clone();
  moe_experts_backward(s, w, G, g);
  const auto a = g.ddown.to_f64_vector(), b = d1.to_f64_vector();
  for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], 2 * b[i], 1e-12 * (1 + std::fabs(b[i])));
}

TEST(MoeExperts, RouterToExpertsChainGradient) {
  // logits -> router weights -> experts: the router gets its gradient through dtopk_weight.
  Rng rng(test_seed());
  MoeCase m = make_moe(6, 4, 6, 3, 2, 2, DType::f64, rng);
  MoeRouterConfig c;
  c.n_experts = 6;
  c.top_k = 2;
  c.n_group = 3;
  c.topk_group = 2;
  Tensor logits = randn({6, 6}, DType::f64, rng);
  MoeWeights w{m.gate_up, m.down, m.sgu, m.sdown};
  Tensor G = randn({6, 4}, DType::f64, rng);
  auto loss = [&] {
    MoeRouterResult r = moe_router_forward(logits, Tensor(), c);
    MoeSaved s;
    return dot(moe_experts_forward(m.x, w, r.topk_idx, r.topk_weight, 10.0, s), G);
  };
  MoeRouterResult r = moe_router_forward(logits, Tensor(), c);
  MoeSaved s;
  moe_experts_forward(m.x, w, r.topk_idx, r.topk_weight, 10.0, s);
  MoeWeightGrads g{
      Tensor::zeros(m.gate_up.shape(), DType::f64), Tensor::zeros(m.down.shape(), DType::f64),
      Tensor::zeros(m.sgu.shape(), DType::f64), Tensor::zeros(m.sdown.shape(), DType::f64)};
  MoeGrads eg = moe_experts_backward(s, w, G, g);
  Tensor dl = moe_router_backward(logits, r, c, eg.dtopk_weight);
  EXPECT_TRUE(grad_check(loss, logits, dl));
}

TEST(MoeExperts, DeterministicBitIdentical) {
  Rng rng(test_seed());
  MoeCase m = make_moe(33, 16, 8, 8, 3, 8, DType::f32, rng);
  MoeWeights w{m.gate_up, m.down, m.sgu, m.sdown};
  Tensor G = randn({m.T, m.D}, DType::f32, rng);
  Tensor out[2], dx[2], dgu[2];
  for (int rep = 0; rep < 2; ++rep) {
    MoeSaved s;
    out[rep] = moe_experts_forward(m.x, w, m.idx, m.w, 10.0, s);
    MoeWeightGrads g{
        Tensor::zeros(m.gate_up.shape(), DType::f32), Tensor::zeros(m.down.shape(), DType::f32),
        Tensor::zeros(m.sgu.shape(), DType::f32), Tensor::zeros(m.sdown.shape(), DType::f32)};
    dx[rep] = moe_experts_backward(s, w, G, g).dx;
    dgu[rep] = g.dgate_up;
  }
  EXPECT_TRUE(testing::bit_equal(out[0], out[1]));
  EXPECT_TRUE(testing::bit_equal(dx[0], dx[1]));
  EXPECT_TRUE(testing::bit_equal(dgu[0], dgu[1]));
}

TEST(MoeRouter, BadInputThrows) {
  Rng rng(test_seed());
  Tensor logits = randn({3, 8}, DType::f64, rng);
  MoeRouterConfig c;
  c.n_experts = 8;
  c.top_k = 9;  // topk > experts
  EXPECT_THROW(moe_router_forward(logits, Tensor(), c), Error);
  c.top_k = 2;
  c.n_group = 3;  // does not divide 8
  EXPECT_THROW(moe_router_forward(logits, Tensor(), c), Error);
  c.n_group = 4;
  c.topk_group = 5;  // more groups kept than exist
  EXPECT_THROW(moe_router_forward(logits, Tensor(), c), Error);
  c.topk_group = 1;
  c.top_k = 3;  // more than the 2 experts of one kept group
  EXPECT_THROW(moe_router_forward(logits, Tensor(), c), Error);
  c.n_group = 8;  // groups of 1: no top-2 group score
  c.topk_group = 4;
  c.top_k = 2;
  EXPECT_THROW(moe_router_forward(logits, Tensor(), c), Error);
  c.n_group = 1;
  c.topk_group = 1;
  EXPECT_THROW(moe_router_forward(randn({3, 7}, DType::f64, rng), Tensor(), c), Error);
  EXPECT_THROW(moe_router_forward(logits, randn({7}, DType::f64, rng), c), Error);
  EXPECT_THROW(moe_router_forward(Tensor::zeros({3, 8}, DType::i64), Tensor(), c), Error);
  MoeRouterResult r = moe_router_forward(logits, Tensor(), c);
  EXPECT_THROW(moe_router_backward(logits, r, c, randn({3, 3}, DType::f64, rng)), Error);
}

TEST(MoeExperts, BadInputThrows) {
  Rng rng(test_seed());
  MoeCase m = make_moe(4, 5, 3, 2, 2, 2, DType::f64, rng);
  MoeSaved s;
  MoeWeights w{m.gate_up, m.down, m.sgu, m.sdown};
  EXPECT_THROW(moe_experts_forward(randn({4, 6}, DType::f64, rng), w, m.idx, m.w, 10, s), Error);
  MoeWeights bad = w;
  bad.down = randn({3, 5, 3}, DType::f64, rng);
  EXPECT_THROW(moe_experts_forward(m.x, bad, m.idx, m.w, 10, s), Error);
  bad = w;
  bad.shared_down = Tensor();
  EXPECT_THROW(moe_experts_forward(m.x, bad, m.idx, m.w, 10, s), Error);
  Tensor oob = Tensor::from_vector<int64_t>({4, 2}, {0, 1, 2, 3, 0, 1, 1, 2});
  EXPECT_THROW(moe_experts_forward(m.x, w, oob, m.w, 10, s), Error);
  EXPECT_THROW(moe_experts_forward(m.x, w, m.idx, randn({4, 3}, DType::f64, rng), 10, s), Error);
  moe_experts_forward(m.x, w, m.idx, m.w, 10, s);
  MoeWeightGrads g;  // undefined accumulators
  EXPECT_THROW(moe_experts_backward(s, w, randn({4, 5}, DType::f64, rng), g), Error);
  EXPECT_THROW(swiglu_clamped_forward(randn({3, 5}, DType::f64, rng), 10), Error);
}

// moe_routed_experts on the CPU against an FP64 reference written here (ref_ffn over the operands
// the op takes: bf16-rounded under round_bf16), and against moe_experts_forward's unweighted eo.
TEST(MoeRoutedExperts, MatchesReference) {
  Rng rng(test_seed());
  auto rounded = [](const Tensor& t) { return t.to(DType::bf16).to(DType::f64); };
  for (const bool rb : {false, true})
    for (DType dt : {DType::f64, DType::f32}) {
      if (rb && dt == DType::f64) continue;
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << (rb ? " round_bf16" : ""));
      const MoeCase m = make_moe(7, 40, 5, 9, 2, 3, dt, rng);
      const double lim = 1.5;
      const Tensor eo = moe_routed_experts(m.x, m.gate_up, m.down, m.idx, lim, rb);
      ASSERT_EQ(eo.shape(), Shape({7 * 2, 40}));
      ASSERT_EQ(eo.dtype(), dt);
      const Tensor x64 = rb ? rounded(m.x) : m.x.to(DType::f64);
      const Tensor gu64 = rb ? rounded(m.gate_up) : m.gate_up.to(DType::f64);
      const Tensor dn64 = rb ? rounded(m.down) : m.down.to(DType::f64);
      double worst = 0, scale = 0;
      for (int64_t a = 0; a < 14; ++a) {
        const int64_t t = a / 2, e = m.idx.to_i64_vector()[size_t(a)];
        std::vector<double> xt(40);
        for (int64_t d = 0; d < 40; ++d) xt[size_t(d)] = x64.at({t, d});
        // h rounded to bf16 under round_bf16 is inside ref_ffn's tolerance below (a 2^-9
        // relative change of one h feeds a sum of 9 terms).
        const std::vector<double> o = ref_ffn(xt, gu64, dn64, e, 9, 40, lim);
        for (int64_t d = 0; d < 40; ++d) {
          worst = std::max(worst, std::fabs(eo.at({a, d}) - o[size_t(d)]));
          scale = std::max(scale, std::fabs(o[size_t(d)]));
        }
      }
      EXPECT_LE(worst / scale, rb ? 5e-3 : dt == DType::f64 ? 1e-13 : 2e-6);
      if (rb) continue;
      // The same rows as moe_experts_forward's saved eo (another code path, per expert GEMMs).
      MoeSaved s;
      moe_experts_forward(m.x, MoeWeights{m.gate_up, m.down, {}, {}}, m.idx, m.w, lim, s);
      const Tensor want = s.eo.reshape({14, 40});
      const double tol = dt == DType::f64 ? 1e-12 : 1e-5;
      EXPECT_TRUE(close(eo.to(DType::f64), want.to(DType::f64), {tol, tol}));
    }
  // Weights stored in bf16 under round_bf16: the same values as f32 weights rounded there.
  const MoeCase m = make_moe(4, 16, 3, 5, 2, 3, DType::f32, rng);
  const Tensor a = moe_routed_experts(m.x, m.gate_up, m.down, m.idx, 10.0, true);
  const Tensor b =
      moe_routed_experts(m.x, m.gate_up.to(DType::bf16), m.down.to(DType::bf16), m.idx, 10.0, true);
  EXPECT_TRUE(testing::bit_equal(a, b));
}

TEST(MoeRoutedExperts, BadArguments) {
  Rng rng(test_seed());
  const MoeCase m = make_moe(3, 8, 4, 4, 2, 3, DType::f32, rng);
  const Tensor oob = Tensor::from_vector<int64_t>({3, 2}, {0, 1, 2, 4, 1, 3});
  testing::expect_error([&] { moe_routed_experts(m.x, m.gate_up, m.down, oob, 10, false); },
                        "topk_idx[1, 1] = 4 is outside [0, 4)");
  testing::expect_error(
      [&] { moe_routed_experts(m.x.to(DType::f64), m.gate_up, m.down, m.idx, 10, true); },
      "x must be f32");
  testing::expect_error(
      [&] { moe_routed_experts(m.x, m.gate_up.to(DType::f64), m.down, m.idx, 10, false); },
      "gate_up");
  testing::expect_error(
      [&] { moe_routed_experts(m.x, m.gate_up, m.down, m.idx.slice(0, 0, 2), 10, false); },
      "topk_idx must be [T = 3, K]");
  testing::expect_error(
      [&] { moe_routed_experts(m.x, m.gate_up, m.down, m.idx, std::nan(""), false); },
      "swiglu_limit must not be NaN");
}

}  // namespace
}  // namespace hlm::ops
