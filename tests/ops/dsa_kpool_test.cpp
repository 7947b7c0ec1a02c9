// KPool ops (ops/dsa_kpool.h): compression and its backward, pooled scoring, selection with the
// tail, document restarts, and the pool-level KL chain (our own design: docs/dsa.md, "Pool-level KL
// for KPool: our design"), against plain FP64 references.
#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "core/rng.h"
#include "ops/dsa_indexer.h"
#include "ops/dsa_indexer_loss.h"
#include "ops/dsa_kpool.h"
#include "testing.h"

namespace hlm::ops {
namespace {

using hlm::testing::seqs_of;
using hlm::testing::total;

using hlm::testing::bit_equal;
using hlm::testing::close;
using hlm::testing::grad_check;
using hlm::testing::test_seed;

IndexerScoreOptions pooled(int64_t P) {
  IndexerScoreOptions o;
  o.pool = P;
  return o;
}

// Plain FP64 pooled keys: pools restart at every document start; partial pools are dropped.
std::vector<double> ref_compress(const std::vector<int64_t>& lens, int64_t P, int64_t D,
                                 const std::vector<double>& k, const std::vector<double>& g,
                                 const std::vector<double>& A) {
  std::vector<double> out;
  int64_t s0 = 0;
  for (int64_t L : lens) {
    for (int64_t p = 0; p + 1 <= L / P; ++p)
      for (int64_t c = 0; c < D; ++c) {
        double m = -INFINITY, z = 0, acc = 0;
        for (int64_t j = 0; j < P; ++j)
          m = std::max(m, g[size_t((s0 + p * P + j) * D + c)] + A[size_t(j * D + c)]);
        for (int64_t j = 0; j < P; ++j)
          z += std::exp(g[size_t((s0 + p * P + j) * D + c)] + A[size_t(j * D + c)] - m);
        for (int64_t j = 0; j < P; ++j)
          acc += std::exp(g[size_t((s0 + p * P + j) * D + c)] + A[size_t(j * D + c)] - m) / z *
                 k[size_t((s0 + p * P + j) * D + c)];
        out.push_back(acc);
      }
    s0 += L;
  }
  return out;
}

TEST(DsaKPool, CompressMatchesFp64Reference) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{9, 3, 2, 8};  // 2 + 1 + 0 + 2 pools at P = 3... (P = 3 below)
  const int64_t T = total(lens), D = 8;
  for (int64_t P : {1, 3, 4})
    for (DType dt : {DType::f64, DType::f32}) {
      const Tensor k = randn({T, D}, dt, rng), g = randn({T, D}, dt, rng, 2.0),
                   A = randn({P, D}, dt, rng);
      const Tensor out = kpool_compress(k, g, A, seqs_of(lens));
      const auto ref =
          ref_compress(lens, P, D, k.to_f64_vector(), g.to_f64_vector(), A.to_f64_vector());
      const int64_t NP = int64_t(ref.size()) / D;
      ASSERT_EQ(out.shape(), (Shape{NP, D}));
      EXPECT_TRUE(close(out, Tensor::from_values({NP, D}, ref, DType::f64),
                        hlm::testing::tolerance_for(dt)))
          << "P " << P << " " << dtype_name(dt);
      if (P == 1) EXPECT_TRUE(close(out, k, {0, 0}));  // a pool of one token is the token
    }
  const auto off = kpool_pool_offsets(seqs_of(lens), T, 3).to_f64_vector();
  EXPECT_EQ(off, (std::vector<double>{0, 3, 4, 4, 6}));
}

TEST(DsaKPool, CompressBackwardMatchesFiniteDifferences) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{9, 6};
  const int64_t T = 15, D = 6, P = 4;
  Tensor k = randn({T, D}, DType::f64, rng), g = randn({T, D}, DType::f64, rng),
         A = randn({P, D}, DType::f64, rng);
  const SeqLayout cu = seqs_of(lens);
  const Tensor r = randn({3, D}, DType::f64, rng);
  const KPoolCompressGrads gr = kpool_compress_backward(k, g, A, cu, r);
  auto loss = [&] { return hlm::testing::dot(kpool_compress(k, g, A, cu), r); };
  EXPECT_TRUE(grad_check(loss, k, gr.dk, 1e-6, 1e-7, 200));
  EXPECT_TRUE(grad_check(loss, g, gr.dgate, 1e-6, 1e-7, 200));
  EXPECT_TRUE(grad_check(loss, A, gr.dape, 1e-6, 1e-7, 200));
  // Tokens outside complete pools (8 of doc 0, 4 and 5 of doc 1) get exactly zero.
  for (int64_t t : {8, 13, 14})
    for (int64_t c = 0; c < D; ++c) {
      EXPECT_EQ(gr.dk.at({t, c}), 0.0);
      EXPECT_EQ(gr.dgate.at({t, c}), 0.0);
    }
}

// Brute force of the KPool selection as sets: selected pools (higher score, lower id on ties)
// expanded to tokens, plus the tail tokens.
TEST(DsaKPool, SelectMatchesBruteForceWithTailAndRestarts) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{13, 2, 7, 10};
  const int64_t T = total(lens);
  for (int64_t P : {1, 2, 3, 4})
    for (int64_t K : {P, 2 * P, 3 * P})
      for (bool tail : {true, false}) {
        const SeqLayout cu = seqs_of(lens);
        int64_t Wp = 0;
        for (int64_t L : lens) Wp = std::max(Wp, L / P);
        std::vector<double> v(size_t(T * Wp));
        for (auto& x : v) x = double(rng.below(3));
        const Tensor ps = Tensor::from_values({T, Wp}, v, DType::f32);
        const KPoolSelection sel = kpool_select(ps, cu, K, P, tail);
        const int64_t W = K + (tail ? P - 1 : 0);
        ASSERT_EQ(sel.indices.shape(), (Shape{T, W}));
        ASSERT_EQ(sel.pools.shape(), (Shape{T, K / P}));
        const auto o = sel.indices.to_f64_vector(), pl = sel.pools.to_f64_vector();
        const auto off = kpool_pool_offsets(cu, T, P).to_f64_vector();
        int64_t s0 = 0, d = 0;
        for (int64_t L : lens) {
          for (int64_t r = 0; r < L; ++r) {
            const int64_t t = s0 + r, n = (r + 1) / P;
            std::vector<std::pair<double, int64_t>> cand;
            for (int64_t p = 0; p < n; ++p) cand.push_back({-v[size_t(t * Wp + p)], p});
            std::sort(cand.begin(), cand.end());
            std::set<int64_t> want, got, want_pools, got_pools;
            for (int64_t j = 0; j < std::min<int64_t>(K / P, n); ++j) {
              const int64_t p = cand[size_t(j)].second;
              want_pools.insert(int64_t(off[size_t(d)]) + p);
              for (int64_t i = 0; i < P; ++i) want.insert(s0 + p * P + i);
            }
            if (tail)
              for (int64_t s = n * P; s <= r; ++s) want.insert(s0 + s);
            for (int64_t j = 0; j < W; ++j)
              if (o[size_t(t * W + j)] >= 0) {
                EXPECT_TRUE(got.insert(int64_t(o[size_t(t * W + j)])).second) << "duplicate";
                if (j >= K) EXPECT_GE(int64_t(o[size_t(t * W + j)]), s0 + n * P) << "tail slot";
              }
            for (int64_t j = 0; j < K / P; ++j)
              if (pl[size_t(t * (K / P) + j)] >= 0)
                got_pools.insert(int64_t(pl[size_t(t * (K / P) + j)]));
            EXPECT_EQ(got, want) << "P " << P << " K " << K << " t " << t;
            EXPECT_EQ(got_pools, want_pools) << "P " << P << " K " << K << " t " << t;
            // With the tail and a prefix not longer than K: dense causal attention.
            if (tail && r + 1 <= K) EXPECT_EQ(int64_t(got.size()), r + 1);
          }
          s0 += L, ++d;
        }
      }
}

TEST(DsaKPool, SelectLayoutExample) {
  // One document of 7 tokens, P = 2, K = 4: pools {0,1}, {2,3}, {4,5}; token 6 is a tail.
  // Scores favour pool 2, then pool 0.
  const Tensor ps = Tensor::from_values(
      {7, 3}, {0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 2, 1, 0, 2, 1, 0, 2}, DType::f64);
  const KPoolSelection sel = kpool_select(ps, seqs_of({7}), 4, 2, true);
  const std::vector<double> want{
      -1, -1, -1, -1, 0,   // t 0: no pool, tail {0}
      0,  1,  -1, -1, -1,  // t 1: pool 0, tail empty
      0,  1,  -1, -1, 2,   // t 2
      0,  1,  2,  3,  -1,  // t 3: pools 0, 1 (all candidates)
      0,  1,  2,  3,  4,   // t 4
      0,  1,  4,  5,  -1,  // t 5: pools 2 and 0 beat 1; token 5 attended only as pool 2
      0,  1,  4,  5,  6};  // t 6
  EXPECT_EQ(sel.indices.to_f64_vector(), want);
  EXPECT_EQ(sel.pools.to_f64_vector(),
            (std::vector<double>{-1, -1, 0, -1, 0, -1, 0, 1, 0, 1, 0, 2, 0, 2}));
}

TEST(DsaKPool, PackedBatchEqualsSequencesBitwise) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{11, 3, 8};
  const int64_t T = total(lens), H = 2, D = 8, P = 4, K = 4;
  const Tensor q = randn({T, H, D}, DType::f32, rng), k = randn({T, D}, DType::f32, rng),
               g = randn({T, D}, DType::f32, rng), A = randn({P, D}, DType::f32, rng),
               w = randn({T, H}, DType::f32, rng);
  const SeqLayout cu = seqs_of(lens);
  const Tensor pk = kpool_compress(k, g, A, cu);
  const Tensor ps = indexer_scores(q, pk, w, cu, pooled(P));
  const KPoolSelection sel = kpool_select(ps, cu, K, P);
  const Tensor dpk = randn(pk.shape(), DType::f32, rng);
  const KPoolCompressGrads gr = kpool_compress_backward(k, g, A, cu, dpk);
  int64_t s0 = 0, p0 = 0;
  Tensor dape_sum = Tensor::zeros({P, D}, DType::f32);
  for (int64_t L : lens) {
    const SeqLayout cu1 = seqs_of({L});
    auto part = [&](const Tensor& x) { return x.slice(0, s0, s0 + L).contiguous(); };
    const int64_t np = L / P;
    const Tensor pk1 = kpool_compress(part(k), part(g), A, cu1);
    EXPECT_TRUE(bit_equal(pk1, pk.slice(0, p0, p0 + np).contiguous()));
    const Tensor ps1 = indexer_scores(part(q), pk1, part(w), cu1, pooled(P));
    EXPECT_TRUE(bit_equal(ps1, part(ps).slice(1, 0, np).contiguous()));
    const auto a = kpool_select(ps1, cu1, K, P).indices.to_f64_vector();
    const auto b = part(sel.indices).to_f64_vector();
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i] < 0 ? -1 : a[i] + double(s0), b[i]);
    const KPoolCompressGrads g1 =
        kpool_compress_backward(part(k), part(g), A, cu1, dpk.slice(0, p0, p0 + np).contiguous());
    EXPECT_TRUE(bit_equal(g1.dk, part(gr.dk)));
    EXPECT_TRUE(bit_equal(g1.dgate, part(gr.dgate)));
    s0 += L, p0 += np;
  }
}

// Pool-level KL (docs/dsa.md, "Pool-level KL for KPool: our design") through the whole chain: KL ->
// pooled scores -> pooled keys -> (k, gate, ape), plus q and w; dense warm-up and sparse stage.
TEST(DsaKPool, PoolLevelKlGradientsMatchFiniteDifferences) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{10, 7};
  const int64_t T = 17, HI = 2, DI = 8, H = 2, Dqk = 6, P = 2, K = 4;
  const double scale = 0.4;
  Tensor qi = randn({T, HI, DI}, DType::f64, rng), k = randn({T, DI}, DType::f64, rng),
         g = randn({T, DI}, DType::f64, rng), A = randn({P, DI}, DType::f64, rng),
         w = randn({T, HI}, DType::f64, rng);
  const Tensor qm = randn({T, H, Dqk}, DType::f64, rng), kv = randn({T, Dqk}, DType::f64, rng);
  const SeqLayout cu = seqs_of(lens);
  // Dense warm-up.
  {
    const Tensor tok = attention_target(qm, kv, cu, scale);
    const Tensor tgt = kpool_pool_target_dense(tok, cu, P);
    auto run = [&] {
      const Tensor ps = indexer_scores(qi, kpool_compress(k, g, A, cu), w, cu, pooled(P));
      return indexer_kl_loss(ps, tgt, 0.9);
    };
    const IndexerKl kl = run();
    EXPECT_EQ(kl.rows, T - 2);  // the first token of each document has no complete pool
    const Tensor pk = kpool_compress(k, g, A, cu);
    const IndexerScoreGrads gs = indexer_scores_backward(qi, pk, w, cu, kl.d_scores, pooled(P));
    const KPoolCompressGrads gc = kpool_compress_backward(k, g, A, cu, gs.dk);
    auto loss = [&] { return run().loss; };
    EXPECT_TRUE(grad_check(loss, qi, gs.dq, 1e-6, 1e-6, 200));
    EXPECT_TRUE(grad_check(loss, w, gs.dw, 1e-6, 1e-6, 200));
    EXPECT_TRUE(grad_check(loss, k, gc.dk, 1e-6, 1e-6, 200));
    EXPECT_TRUE(grad_check(loss, g, gc.dgate, 1e-6, 1e-6, 200));
    EXPECT_TRUE(grad_check(loss, A, gc.dape, 1e-6, 1e-6, 200));
    // Target rows: pool sums of p*, renormalised over the candidate pools.
    const auto tv = tok.to_f64_vector(), pv = tgt.to_f64_vector();
    const int64_t Wt = tok.size(1), Wp = tgt.size(1);
    for (int64_t t : {5, 9, 16}) {
      const int64_t r = t < 10 ? t : t - 10, s0 = t < 10 ? 0 : 10, n = (r + 1) / P;
      double tot = 0;
      for (int64_t s = 0; s < n * P; ++s) tot += tv[size_t(t * Wt + s)];
      for (int64_t p = 0; p < n; ++p)
        EXPECT_NEAR(pv[size_t(t * Wp + p)],
                    (tv[size_t(t * Wt + p * P)] + tv[size_t(t * Wt + p * P + 1)]) / tot, 1e-14)
            << t << " " << s0;
    }
  }
  // Sparse stage: the selection is fixed (discrete); the main attention runs over pools + tail.
  {
    const KPoolSelection sel = kpool_select(
        indexer_scores(qi, kpool_compress(k, g, A, cu), w, cu, pooled(P)), cu, K, P, true);
    const Tensor tok = attention_target_at(qm, kv, cu, sel.indices, scale);
    const Tensor tgt = kpool_pool_target_sparse(tok, sel.pools, P);
    auto run = [&] {
      const Tensor ps =
          indexer_scores_at(qi, kpool_compress(k, g, A, cu), w, cu, sel.pools, pooled(P));
      return indexer_kl_loss(ps, tgt);
    };
    const IndexerKl kl = run();
    const Tensor pk = kpool_compress(k, g, A, cu);
    const IndexerScoreGrads gs =
        indexer_scores_at_backward(qi, pk, w, cu, sel.pools, kl.d_scores, pooled(P));
    const KPoolCompressGrads gc = kpool_compress_backward(k, g, A, cu, gs.dk);
    auto loss = [&] { return run().loss; };
    EXPECT_GT(kl.loss, 0.0);
    EXPECT_TRUE(grad_check(loss, qi, gs.dq, 1e-6, 1e-6, 200));
    EXPECT_TRUE(grad_check(loss, w, gs.dw, 1e-6, 1e-6, 200));
    EXPECT_TRUE(grad_check(loss, k, gc.dk, 1e-6, 1e-6, 200));
    EXPECT_TRUE(grad_check(loss, g, gc.dgate, 1e-6, 1e-6, 200));
    EXPECT_TRUE(grad_check(loss, A, gc.dape, 1e-6, 1e-6, 200));
  }
}

TEST(DsaKPool, BadInputThrows) {
  Rng rng(test_seed());
  const Tensor ps = randn({8, 2}, DType::f32, rng);
  const SeqLayout cu = seqs_of({8});
  EXPECT_THROW(kpool_select(ps, cu, 6, 4), Error);  // K % P != 0
  EXPECT_THROW(kpool_select(ps, cu, 4, 0), Error);  // P < 1
  EXPECT_THROW(kpool_select(ps, cu, 4, -2), Error);
  EXPECT_THROW(kpool_select(ps, cu, 0, 4), Error);               // K < 1
  EXPECT_THROW(kpool_select(ps, seqs_of({4, 3}), 4, 4), Error);  // cu does not end at T
  EXPECT_THROW(kpool_select(ps.slice(1, 0, 1).contiguous(), cu, 4, 4), Error);  // W < 2 pools
  const Tensor k = randn({8, 4}, DType::f32, rng), g = randn({8, 4}, DType::f32, rng);
  EXPECT_THROW(kpool_compress(k, g, randn({4, 3}, DType::f32, rng), cu), Error);     // ape width
  EXPECT_THROW(kpool_compress(k, g, Tensor::zeros({0, 4}, DType::f32), cu), Error);  // P = 0
  EXPECT_THROW(kpool_compress(k, g, randn({4, 4}, DType::f64, rng), cu), Error);     // dtype
  EXPECT_THROW(kpool_compress(k, g.slice(0, 0, 7), randn({4, 4}, DType::f32, rng), cu), Error);
  EXPECT_THROW(kpool_compress(k, g, randn({4, 4}, DType::f32, rng),
                              seqs_of({6, 3})),  // covers 9 of the 8 tokens
               Error);
  // Pooled scoring: k must have one row per pool.
  const Tensor q = randn({8, 2, 4}, DType::f32, rng), w = randn({8, 2}, DType::f32, rng);
  EXPECT_THROW(indexer_scores(q, k, w, cu, pooled(4)), Error);
  EXPECT_THROW(indexer_scores(q, k.slice(0, 0, 2), w, cu, pooled(0)), Error);
  EXPECT_NO_THROW(indexer_scores(q, k.slice(0, 0, 2), w, cu, pooled(4)));
}

}  // namespace
}  // namespace hlm::ops
