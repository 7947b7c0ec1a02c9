// DSA indexer scoring, top-k selection and the indexer KL loss (ops/dsa_indexer.h,
// ops/dsa_indexer_loss.h) against plain FP64 references written here.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "core/rng.h"
#include "ops/dsa_indexer.h"
#include "ops/dsa_indexer_loss.h"
#include "ops/fp8_quant.h"
#include "testing.h"

namespace hlm::ops {
namespace {

using hlm::testing::expect_error;
using hlm::testing::seqs_of;

using hlm::testing::bit_equal;
using hlm::testing::close;
using hlm::testing::grad_check;
using hlm::testing::test_seed;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

std::vector<int64_t> doc_of(const std::vector<int64_t>& lens, std::vector<int64_t>* start) {
  std::vector<int64_t> d;
  int64_t s = 0;
  for (size_t i = 0; i < lens.size(); ++i) {
    for (int64_t j = 0; j < lens[i]; ++j) d.push_back(int64_t(i)), start->push_back(s);
    s += lens[i];
  }
  return d;
}

// I(t, s) in FP64, written plainly.
double ref_score(const std::vector<double>& q, const std::vector<double>& k,
                 const std::vector<double>& w, int64_t H, int64_t D, int64_t t, int64_t s) {
  double sc = 0;
  for (int64_t h = 0; h < H; ++h) {
    double d = 0;
    for (int64_t c = 0; c < D; ++c) d += q[size_t((t * H + h) * D + c)] * k[size_t(s * D + c)];
    sc += w[size_t(t * H + h)] * std::max(0.0, d / std::sqrt(double(D)));
  }
  return sc;
}

// Random explicit rows: each query keeps a random subset of its causal tokens at random slots.
Tensor random_rows(const std::vector<int64_t>& lens, int64_t W, Rng& rng) {
  std::vector<int64_t> start;
  doc_of(lens, &start);
  const int64_t T = int64_t(start.size());
  std::vector<int32_t> v(size_t(T * W), -1);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int64_t> cand;
    for (int64_t s = start[size_t(t)]; s <= t; ++s) cand.push_back(s);
    std::vector<int64_t> slots(static_cast<size_t>(W));
    for (int64_t j = 0; j < W; ++j) slots[size_t(j)] = j;
    for (int64_t j = W - 1; j > 0; --j)
      std::swap(slots[size_t(j)], slots[rng.below(uint64_t(j + 1))]);
    for (int64_t j = int64_t(cand.size()) - 1; j > 0; --j)
      std::swap(cand[size_t(j)], cand[rng.below(uint64_t(j + 1))]);
    const int64_t n = std::min<int64_t>(int64_t(cand.size()), 1 + int64_t(rng.below(uint64_t(W))));
    for (int64_t j = 0; j < n; ++j) v[size_t(t * W + slots[size_t(j)])] = int32_t(cand[size_t(j)]);
  }
  return Tensor::from_vector<int32_t>({T, W}, v);
}

struct IdxInputs {
  Tensor q, k, w;
  SeqLayout cu;
  int64_t T, H, D;
};
IdxInputs make_inputs(const std::vector<int64_t>& lens, int64_t H, int64_t D, DType dt, Rng& rng) {
  IdxInputs in;
  in.T = 0;
  for (int64_t l : lens) in.T += l;
  in.H = H, in.D = D;
  in.q = randn({in.T, H, D}, dt, rng);
  in.k = randn({in.T, D}, dt, rng);
  in.w = randn({in.T, H}, dt, rng, 0.5);
  in.cu = seqs_of(lens);
  return in;
}

// sum of finite scores * r (the probe loss for the gradient checks).
double probe(const Tensor& scores, const Tensor& r) {
  const auto s = scores.to_f64_vector(), rv = r.to_f64_vector();
  double acc = 0;
  for (size_t i = 0; i < s.size(); ++i)
    if (std::isfinite(s[i])) acc += s[i] * rv[i];
  return acc;
}

TEST(DsaIndexer, ScoresMatchFp64Reference) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{5, 1, 7};
  for (DType dt : {DType::f64, DType::f32}) {
    IdxInputs in = make_inputs(lens, 3, 16, dt, rng);
    const Tensor sc = indexer_scores(in.q, in.k, in.w, in.cu);
    ASSERT_EQ(sc.shape(), (Shape{in.T, 7}));
    const auto q = in.q.to_f64_vector(), k = in.k.to_f64_vector(), w = in.w.to_f64_vector();
    std::vector<int64_t> start;
    doc_of(lens, &start);
    std::vector<double> ref(size_t(in.T * 7), kNegInf);
    for (int64_t t = 0; t < in.T; ++t)
      for (int64_t s = start[size_t(t)]; s <= t; ++s)
        ref[size_t(t * 7 + s - start[size_t(t)])] = ref_score(q, k, w, in.H, in.D, t, s);
    EXPECT_TRUE(
        close(sc, Tensor::from_values({in.T, 7}, ref, DType::f64), hlm::testing::tolerance_for(dt)))
        << dtype_name(dt);
  }
}

TEST(DsaIndexer, ScoresAtEqualDenseScoresBitwise) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{6, 9};
  IdxInputs in = make_inputs(lens, 4, 8, DType::f32, rng);
  const Tensor rows = random_rows(lens, 5, rng);
  const Tensor dense = indexer_scores(in.q, in.k, in.w, in.cu);
  const Tensor at = indexer_scores_at(in.q, in.k, in.w, in.cu, rows);
  std::vector<int64_t> start;
  doc_of(lens, &start);
  const auto rv = rows.to_f64_vector();
  const float* d = dense.data<float>();
  const float* a = at.data<float>();
  for (int64_t t = 0; t < in.T; ++t)
    for (int64_t j = 0; j < 5; ++j) {
      const int64_t s = int64_t(rv[size_t(t * 5 + j)]);
      if (s < 0)
        EXPECT_EQ(a[t * 5 + j], -std::numeric_limits<float>::infinity());
      else
        EXPECT_EQ(a[t * 5 + j], d[t * dense.size(1) + s - start[size_t(t)]]) << t << " " << j;
    }
}

TEST(DsaIndexer, BackwardMatchesFiniteDifferences) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{4, 6};
  IdxInputs in = make_inputs(lens, 3, 8, DType::f64, rng);
  const Tensor r = randn({in.T, 6}, DType::f64, rng);
  const IndexerScoreGrads g = indexer_scores_backward(in.q, in.k, in.w, in.cu, r);
  auto loss = [&] { return probe(indexer_scores(in.q, in.k, in.w, in.cu), r); };
  EXPECT_TRUE(grad_check(loss, in.q, g.dq, 1e-6, 1e-6, 200));
  EXPECT_TRUE(grad_check(loss, in.k, g.dk, 1e-6, 1e-6, 200));
  EXPECT_TRUE(grad_check(loss, in.w, g.dw, 1e-6, 1e-6, 200));
  // Without the ReLU too.
  IndexerScoreOptions lin;
  lin.relu = false;
  const IndexerScoreGrads gl = indexer_scores_backward(in.q, in.k, in.w, in.cu, r, lin);
  auto loss_l = [&] { return probe(indexer_scores(in.q, in.k, in.w, in.cu, lin), r); };
  EXPECT_TRUE(grad_check(loss_l, in.k, gl.dk, 1e-6, 1e-6, 200));
}

TEST(DsaIndexer, ScoresAtBackwardMatchesFiniteDifferences) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{7, 3};
  IdxInputs in = make_inputs(lens, 2, 8, DType::f64, rng);
  const Tensor rows = random_rows(lens, 4, rng);
  const Tensor r = randn({in.T, 4}, DType::f64, rng);
  const IndexerScoreGrads g = indexer_scores_at_backward(in.q, in.k, in.w, in.cu, rows, r);
  auto loss = [&] { return probe(indexer_scores_at(in.q, in.k, in.w, in.cu, rows), r); };
  EXPECT_TRUE(grad_check(loss, in.q, g.dq, 1e-6, 1e-6, 200));
  EXPECT_TRUE(grad_check(loss, in.k, g.dk, 1e-6, 1e-6, 200));
  EXPECT_TRUE(grad_check(loss, in.w, g.dw, 1e-6, 1e-6, 200));
}

TEST(DsaIndexer, PackedBatchEqualsSequencesBitwise) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{5, 8, 1, 6};
  IdxInputs in = make_inputs(lens, 3, 16, DType::f32, rng);
  const Tensor sc = indexer_scores(in.q, in.k, in.w, in.cu);
  const Tensor dsc = randn(sc.shape(), DType::f32, rng);
  const IndexerScoreGrads g = indexer_scores_backward(in.q, in.k, in.w, in.cu, dsc);
  const Tensor sel = topk_select(sc, in.cu, 3);
  int64_t s0 = 0;
  for (int64_t L : lens) {
    const SeqLayout cu1 = seqs_of({L});
    auto part = [&](const Tensor& x) { return x.slice(0, s0, s0 + L).contiguous(); };
    const Tensor q = part(in.q), k = part(in.k), w = part(in.w);
    const Tensor sc1 = indexer_scores(q, k, w, cu1);
    EXPECT_TRUE(bit_equal(sc1, part(sc).slice(1, 0, L).contiguous()));
    const IndexerScoreGrads g1 =
        indexer_scores_backward(q, k, w, cu1, part(dsc).slice(1, 0, L).contiguous());
    EXPECT_TRUE(bit_equal(g1.dq, part(g.dq)));
    EXPECT_TRUE(bit_equal(g1.dk, part(g.dk)));
    EXPECT_TRUE(bit_equal(g1.dw, part(g.dw)));
    // Top-k: indices are global, so the packed rows are the per-sequence rows + s0.
    const auto a = topk_select(sc1, cu1, 3).to_f64_vector(), b = part(sel).to_f64_vector();
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i] < 0 ? -1 : a[i] + double(s0), b[i]);
    s0 += L;
  }
  // Run to run, and whatever the thread count.
  EXPECT_TRUE(bit_equal(indexer_scores(in.q, in.k, in.w, in.cu), sc));
  const int nt = omp_get_max_threads();
  for (int threads : {1, 3}) {
    omp_set_num_threads(threads);
    const IndexerScoreGrads gt = indexer_scores_backward(in.q, in.k, in.w, in.cu, dsc);
    EXPECT_TRUE(bit_equal(gt.dk, g.dk)) << threads << " threads";
    EXPECT_TRUE(bit_equal(gt.dq, g.dq)) << threads << " threads";
  }
  omp_set_num_threads(nt);
}

// The FP8 emulation equals the plain scores of inputs quantised by hand (ue8m0 scale per 128).
TEST(DsaIndexer, Fp8EmulationQuantisesEach128Block) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{4, 5};
  IdxInputs in = make_inputs(lens, 2, 128, DType::f32, rng);
  auto quant = [](const Tensor& x) {
    std::vector<double> v = x.to_f64_vector();
    for (size_t r0 = 0; r0 < v.size(); r0 += 128) {
      float amax = 0;
      for (size_t c = 0; c < 128; ++c) amax = std::max(amax, std::fabs(float(v[r0 + c])));
      const float s = std::exp2(std::ceil(std::log2(std::max(amax, 1e-4f) / 448.0f)));
      for (size_t c = 0; c < 128; ++c)
        v[r0 + c] =
            fp8_to_float(float_to_fp8(float(v[r0 + c]) / s, Fp8Format::e4m3), Fp8Format::e4m3) * s;
    }
    return Tensor::from_values(x.shape(), v, x.dtype());
  };
  IndexerScoreOptions o8;
  o8.fp8 = true;
  const Tensor s8 = indexer_scores(in.q, in.k, in.w, in.cu, o8);
  const Tensor sq = indexer_scores(quant(in.q), quant(in.k), in.w, in.cu);
  EXPECT_TRUE(bit_equal(s8, sq));
  const Tensor s = indexer_scores(in.q, in.k, in.w, in.cu);
  EXPECT_TRUE(close(s8, s, {0.1, 1.0}));
  // Straight-through backward: the gradient of the scores of the quantised inputs.
  const Tensor r = randn(s.shape(), DType::f32, rng);
  const IndexerScoreGrads g8 = indexer_scores_backward(in.q, in.k, in.w, in.cu, r, o8);
  const IndexerScoreGrads gq = indexer_scores_backward(quant(in.q), quant(in.k), in.w, in.cu, r);
  EXPECT_TRUE(bit_equal(g8.dq, gq.dq));
  EXPECT_TRUE(bit_equal(g8.dk, gq.dk));
  EXPECT_TRUE(bit_equal(g8.dw, gq.dw));
}

// Top-k against brute force, as sets, with many ties.
TEST(DsaTopk, MatchesBruteForceAsSets) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{9, 1, 14, 5};
  std::vector<int64_t> start;
  doc_of(lens, &start);
  const int64_t T = int64_t(start.size()), W = 14;
  for (DType dt : {DType::f32, DType::f64})
    for (int64_t K : {1, 3, 5, 14, 20}) {
      std::vector<double> v(size_t(T * W));
      for (auto& x : v) x = double(rng.below(4));  // ties everywhere
      const Tensor sc = Tensor::from_values({T, W}, v, dt);
      const Tensor sel = topk_select(sc, seqs_of(lens), K);
      ASSERT_EQ(sel.shape(), (Shape{T, K}));
      const auto o = sel.to_f64_vector();
      for (int64_t t = 0; t < T; ++t) {
        std::vector<std::pair<double, int64_t>> cand;
        for (int64_t s = start[size_t(t)]; s <= t; ++s)
          cand.push_back({-v[size_t(t * W + s - start[size_t(t)])], s});
        std::sort(cand.begin(), cand.end());  // higher score, then lower index
        const int64_t m = std::min<int64_t>(K, int64_t(cand.size()));
        std::set<int64_t> want, got;
        for (int64_t j = 0; j < m; ++j) want.insert(cand[size_t(j)].second);
        for (int64_t j = 0; j < K; ++j) {
          const int64_t x = int64_t(o[size_t(t * K + j)]);
          if (j < m) {
            got.insert(x);
            if (j > 0) EXPECT_LT(o[size_t(t * K + j - 1)], double(x)) << "ascending order";
          } else {
            EXPECT_EQ(x, -1) << "padding";
          }
        }
        EXPECT_EQ(got, want) << "t " << t << " K " << K;
      }
    }
}

TEST(DsaTopk, ShortPrefixSelectsAllCausalTokens) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{4, 6};
  IdxInputs in = make_inputs(lens, 2, 8, DType::f32, rng);
  const Tensor sel = topk_select(indexer_scores(in.q, in.k, in.w, in.cu), in.cu, 6);
  const auto o = sel.to_f64_vector();
  std::vector<int64_t> start;
  doc_of(lens, &start);
  for (int64_t t = 0; t < in.T; ++t)
    for (int64_t j = 0; j < 6; ++j) {
      const int64_t want = start[size_t(t)] + j <= t ? start[size_t(t)] + j : -1;
      EXPECT_EQ(int64_t(o[size_t(t * 6 + j)]), want);
    }
  // NaN ranks below every number.
  const Tensor sc = Tensor::from_values({3, 3}, {0, 0, 0, NAN, -5, 0, 1, NAN, 2}, DType::f64);
  const auto o2 = topk_select(sc, seqs_of({3}), 1).to_f64_vector();
  EXPECT_EQ(o2, (std::vector<double>{0, 1, 2}));
}

TEST(DsaIndexer, BadInputThrows) {
  Rng rng(test_seed());
  IdxInputs in = make_inputs({3, 4}, 2, 8, DType::f64, rng);
  // Layouts that do not cover the T = 7 tokens (malformed offsets are rejected when the layout is
  // built: tests/core/seq_layout_test.cpp).
  expect_error(
      [&] {
        indexer_scores(in.q, in.k, in.w, seqs_of({3, 3}));
      },
      "the sequence layout covers 6 tokens");
  EXPECT_THROW(indexer_scores(in.q, in.k, in.w, seqs_of({3, 5})), Error);
  EXPECT_THROW(indexer_scores(in.q, in.k.slice(0, 0, 6), in.w, in.cu), Error);
  EXPECT_THROW(indexer_scores(in.q, in.k.to(DType::f32), in.w, in.cu), Error);
  EXPECT_THROW(indexer_scores(in.q, in.k, in.w, in.cu, {}, 3), Error);  // W too small
  // Rows: non-causal, other document, duplicate, out of range.
  auto rows = [&](int32_t t_row, int32_t a, int32_t b) {
    std::vector<int32_t> v(7 * 2, -1);
    v[size_t(t_row * 2)] = a, v[size_t(t_row * 2 + 1)] = b;
    return Tensor::from_vector<int32_t>({7, 2}, v);
  };
  EXPECT_NO_THROW(indexer_scores_at(in.q, in.k, in.w, in.cu, rows(4, 3, 4)));
  EXPECT_THROW(indexer_scores_at(in.q, in.k, in.w, in.cu, rows(4, 3, 5)), Error);  // future
  EXPECT_THROW(indexer_scores_at(in.q, in.k, in.w, in.cu, rows(4, 2, 3)), Error);  // other doc
  EXPECT_THROW(indexer_scores_at(in.q, in.k, in.w, in.cu, rows(5, 4, 4)), Error);  // duplicate
  EXPECT_THROW(indexer_scores_at(in.q, in.k, in.w, in.cu, rows(5, -2, 4)), Error);
  EXPECT_THROW(topk_select(indexer_scores(in.q, in.k, in.w, in.cu), in.cu, 0), Error);
}

// ---- indexer KL loss ---------------------------------------------------------------------

// Plain FP64 reference of p* over a per-row key list.
std::vector<double> ref_target_row(const std::vector<double>& q, const std::vector<double>& kv,
                                   int64_t H, int64_t D, double scale, int64_t t,
                                   const std::vector<int64_t>& keys) {
  std::vector<double> acc(keys.size(), 0.0);
  for (int64_t h = 0; h < H; ++h) {
    std::vector<double> l;
    double m = kNegInf, sum = 0;
    for (int64_t s : keys) {
      double d = 0;
      for (int64_t c = 0; c < D; ++c) d += q[size_t((t * H + h) * D + c)] * kv[size_t(s * D + c)];
      l.push_back(scale * d);
      m = std::max(m, scale * d);
    }
    for (double x : l) sum += std::exp(x - m);
    for (size_t j = 0; j < keys.size(); ++j) acc[j] += std::exp(l[j] - m) / sum;
  }
  for (double& a : acc) a /= double(H);
  return acc;
}

TEST(DsaIndexerLoss, DenseTargetAndLossMatchFp64Reference) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{6, 3};
  const int64_t T = 9, H = 3, D = 8, W = 6;
  const double scale = 0.4;
  const Tensor q = randn({T, H, D}, DType::f64, rng), kv = randn({T, D}, DType::f64, rng);
  IdxInputs in = make_inputs(lens, 2, 8, DType::f64, rng);
  const Tensor tgt = attention_target(q, kv, in.cu, scale);
  const Tensor sc = indexer_scores(in.q, in.k, in.w, in.cu);
  const IndexerKl kl = indexer_kl_loss(sc, tgt, 0.7);
  std::vector<int64_t> start;
  doc_of(lens, &start);
  const auto qv = q.to_f64_vector(), kvv = kv.to_f64_vector(), sv = sc.to_f64_vector();
  std::vector<double> ref_t(size_t(T * W), 0.0);
  double loss = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int64_t> keys;
    for (int64_t s = start[size_t(t)]; s <= t; ++s) keys.push_back(s);
    const auto p = ref_target_row(qv, kvv, H, D, scale, t, keys);
    double m = kNegInf, z = 0;
    for (size_t j = 0; j < keys.size(); ++j) m = std::max(m, sv[size_t(t * W) + j]);
    for (size_t j = 0; j < keys.size(); ++j) z += std::exp(sv[size_t(t * W) + j] - m);
    for (size_t j = 0; j < keys.size(); ++j) {
      ref_t[size_t(t * W) + j] = p[j];
      const double pi = std::exp(sv[size_t(t * W) + j] - m) / z;
      loss += p[j] * (std::log(p[j] + 1e-10) - std::log(pi + 1e-10));
    }
  }
  EXPECT_TRUE(close(tgt, Tensor::from_values({T, W}, ref_t, DType::f64), {1e-12, 1e-13}));
  EXPECT_NEAR(kl.loss, 0.7 * loss / double(T), 1e-12);
  EXPECT_EQ(kl.rows, T);
  const IndexerKl ks = indexer_kl_loss(sc, tgt, 0.7, KlReduction::sum);
  EXPECT_NEAR(ks.loss, 0.7 * loss, 1e-12);
  // f32 close to f64.
  const IndexerKl k32 = indexer_kl_loss(sc.to(DType::f32), tgt.to(DType::f32), 0.7);
  EXPECT_NEAR(k32.loss, kl.loss, 1e-5 * std::max(1.0, kl.loss));
  // Target mass outside the set is refused.
  Tensor bad = tgt.clone();
  bad.data<double>()[0 * W + 3] = 0.1;
  EXPECT_THROW(indexer_kl_loss(sc, bad), Error);
}

// The full chain: KL -> d scores -> (dq, dk, dw), dense warm-up and sparse stage, vs finite
// differences of the loss in FP64.
TEST(DsaIndexerLoss, GradientsMatchFiniteDifferences) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{7, 5};
  const int64_t T = 12, H = 2, D = 8;
  const Tensor q = randn({T, H, D}, DType::f64, rng), kv = randn({T, D}, DType::f64, rng);
  IdxInputs in = make_inputs(lens, 3, 8, DType::f64, rng);
  // Dense warm-up.
  {
    const Tensor tgt = attention_target(q, kv, in.cu, 0.35);
    const IndexerKl kl = indexer_kl_loss(indexer_scores(in.q, in.k, in.w, in.cu), tgt, 1.3);
    const IndexerScoreGrads g = indexer_scores_backward(in.q, in.k, in.w, in.cu, kl.d_scores);
    auto loss = [&] {
      return indexer_kl_loss(indexer_scores(in.q, in.k, in.w, in.cu), tgt, 1.3).loss;
    };
    EXPECT_TRUE(grad_check(loss, in.q, g.dq, 1e-6, 1e-6, 200));
    EXPECT_TRUE(grad_check(loss, in.k, g.dk, 1e-6, 1e-6, 200));
    EXPECT_TRUE(grad_check(loss, in.w, g.dw, 1e-6, 1e-6, 200));
  }
  // Sparse stage over a top-k selection (indices fixed: discrete, no gradient).
  {
    const Tensor sel = topk_select(indexer_scores(in.q, in.k, in.w, in.cu), in.cu, 3);
    const Tensor tgt = attention_target_at(q, kv, in.cu, sel, 0.35);
    const IndexerKl kl = indexer_kl_loss(indexer_scores_at(in.q, in.k, in.w, in.cu, sel), tgt);
    EXPECT_EQ(kl.rows, T);
    const IndexerScoreGrads g =
        indexer_scores_at_backward(in.q, in.k, in.w, in.cu, sel, kl.d_scores);
    auto loss = [&] {
      return indexer_kl_loss(indexer_scores_at(in.q, in.k, in.w, in.cu, sel), tgt).loss;
    };
    EXPECT_TRUE(grad_check(loss, in.q, g.dq, 1e-6, 1e-6, 200));
    EXPECT_TRUE(grad_check(loss, in.k, g.dk, 1e-6, 1e-6, 200));
    EXPECT_TRUE(grad_check(loss, in.w, g.dw, 1e-6, 1e-6, 200));
    // The sparse target over the selection equals the reference over that set.
    const auto qv = q.to_f64_vector(), kvv = kv.to_f64_vector(), sv = sel.to_f64_vector();
    const auto tv = tgt.to_f64_vector();
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int64_t> keys;
      for (int64_t j = 0; j < 3; ++j)
        if (sv[size_t(t * 3 + j)] >= 0) keys.push_back(int64_t(sv[size_t(t * 3 + j)]));
      const auto p = ref_target_row(qv, kvv, H, D, 0.35, t, keys);
      for (size_t j = 0; j < keys.size(); ++j) EXPECT_NEAR(tv[size_t(t * 3) + j], p[j], 1e-13);
    }
  }
}

}  // namespace
}  // namespace hlm::ops
