// Query windows of the DSA ops (context parallelism, ops/dsa_common.h): an op given q0 computes the
// queries of global tokens [q0, q0 + T) of the packed batch over all of its keys. Each window's
// rows must be the whole batch's rows of the same op (the same bits: a query's sums run in the
// same order), and the key gradients of the windows that tile the batch must sum to the whole
// batch's (f64, within 1e-13 relative L2: their partial sums are added in another order).
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <vector>

#include "core/rng.h"
#include "ops/dsa_indexer.h"
#include "ops/dsa_indexer_loss.h"
#include "ops/dsa_kpool.h"
#include "ops/dsa_sparse_attention.h"
#include "ops/tensor_ops.h"
#include "testing.h"

namespace hlm {
namespace {

constexpr double kKeyTol = 1e-13;

Tensor rows(const Tensor& t, int64_t b, int64_t e) {
  return t.slice(0, b, e).contiguous();
}

// Windows that tile a batch of T tokens: cut at `cuts` (inside documents, at their edges, one
// token long).
std::vector<std::pair<int64_t, int64_t>> tiles(const std::vector<int64_t>& cuts, int64_t T) {
  std::vector<std::pair<int64_t, int64_t>> w;
  int64_t b = 0;
  for (int64_t c : cuts) {
    w.push_back({b, c});
    b = c;
  }
  w.push_back({b, T});
  return w;
}

double rel(const Tensor& a, const Tensor& b) {
  return testing::compare(a, b).rel_l2;
}

struct Batch {
  SeqLayout seqs;
  int64_t T = 0;
  std::vector<std::pair<int64_t, int64_t>> windows;
};

Batch batch() {
  Batch b;
  b.seqs = testing::seqs_of({23, 1, 40, 9});
  b.T = b.seqs.total_tokens();
  // A cut inside the first document, a one-token window at the one-token document, one at the
  // start of the third, two inside it, and the last document whole.
  b.windows = tiles({10, 23, 24, 30, 31, 64}, b.T);
  return b;
}

TEST(DsaQueryWindow, AttentionRowsAndKeyGradients) {
  const Batch b = batch();
  Rng rng(testing::test_seed(), 1);
  const int64_t H = 3, D = 10, dv = 6;
  const double scale = 0.3;
  const Tensor q = randn({b.T, H, D}, DType::f64, rng), kv = randn({b.T, D}, DType::f64, rng);
  const Tensor dout = randn({b.T, H, dv}, DType::f64, rng);
  // A selection of every other causal token (and the token itself) as explicit rows.
  const std::vector<int64_t>& cu = b.seqs.offsets();
  const int64_t W = 40;
  std::vector<int32_t> sel(size_t(b.T * W), -1);
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int64_t t = cu[d]; t < cu[d + 1]; ++t) {
      int64_t j = 0;
      for (int64_t s = cu[d]; s <= t; ++s)
        if ((s - cu[d]) % 2 == 0 || s == t) sel[size_t(t * W + j++)] = int32_t(s);
    }
  const Tensor idx = Tensor::from_vector<int32_t>({b.T, W}, sel);

  for (const bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal_attention" : "sparse_attention");
    const ops::SparseAttentionOut whole =
        causal ? ops::causal_attention(q, kv, b.seqs, dv, scale)
               : ops::sparse_attention(q, kv, idx, b.seqs, dv, scale);
    const ops::SparseAttentionGrads gw =
        causal
            ? ops::causal_attention_backward(q, kv, b.seqs, dv, scale, whole.out, whole.lse, dout)
            : ops::sparse_attention_backward(q, kv, idx, b.seqs, dv, scale, whole.out, whole.lse,
                                             dout);
    Tensor dkv = Tensor::zeros(kv.shape(), DType::f64);
    for (const auto& [b0, b1] : b.windows) {
      SCOPED_TRACE(::testing::Message() << "window [" << b0 << ", " << b1 << ")");
      const Tensor qw = rows(q, b0, b1), iw = rows(idx, b0, b1), dw = rows(dout, b0, b1);
      const ops::SparseAttentionOut o =
          causal ? ops::causal_attention(qw, kv, b.seqs, dv, scale, b0)
                 : ops::sparse_attention(qw, kv, iw, b.seqs, dv, scale, b0);
      EXPECT_TRUE(testing::bit_equal(o.out, rows(whole.out, b0, b1)));
      EXPECT_TRUE(testing::bit_equal(o.lse, rows(whole.lse, b0, b1)));
      const ops::SparseAttentionGrads g =
          causal
              ? ops::causal_attention_backward(qw, kv, b.seqs, dv, scale, o.out, o.lse, dw, b0)
              : ops::sparse_attention_backward(qw, kv, iw, b.seqs, dv, scale, o.out, o.lse, dw, b0);
      EXPECT_TRUE(testing::bit_equal(g.dq, rows(gw.dq, b0, b1)));
      ops::add_(dkv, g.dkv);
    }
    EXPECT_LT(rel(dkv, gw.dkv), kKeyTol);
  }
  // The targets of the indexer loss, dense and over the selection.
  const Tensor tw = ops::attention_target(q, kv, b.seqs, scale);
  const ops::SparseAttentionOut sw = ops::sparse_attention(q, kv, idx, b.seqs, dv, scale);
  const Tensor ta = ops::attention_target_at(q, kv, b.seqs, idx, scale, sw.lse);
  for (const auto& [b0, b1] : b.windows) {
    const Tensor qw = rows(q, b0, b1);
    EXPECT_TRUE(
        testing::bit_equal(ops::attention_target(qw, kv, b.seqs, scale, 0, b0), rows(tw, b0, b1)));
    EXPECT_TRUE(testing::bit_equal(ops::attention_target_at(qw, kv, b.seqs, rows(idx, b0, b1),
                                                            scale, rows(sw.lse, b0, b1), b0),
                                   rows(ta, b0, b1)));
  }
}

TEST(DsaQueryWindow, IndexerScoresSelectionAndKeyGradients) {
  const Batch b = batch();
  Rng rng(testing::test_seed(), 2);
  const int64_t H = 2, d = 8;
  for (const int64_t P : {int64_t(1), int64_t(4)}) {
    SCOPED_TRACE(::testing::Message() << "pool " << P);
    const int64_t nk =
        P == 1 ? b.T : ops::kpool_pool_offsets(b.seqs, b.T, P).to_i64_vector().back();
    const Tensor q = randn({b.T, H, d}, DType::f64, rng), k = randn({nk, d}, DType::f64, rng);
    const Tensor w = randn({b.T, H}, DType::f64, rng);
    ops::IndexerScoreOptions so;
    so.pool = P;
    const Tensor sc = ops::indexer_scores(q, k, w, b.seqs, so);
    const int64_t K = 8;
    Tensor sel;
    Tensor pools;
    if (P == 1) {
      sel = ops::topk_select(sc, b.seqs, K, 1);
    } else {
      const ops::KPoolSelection s = ops::kpool_select(sc, b.seqs, K, P, true);
      sel = s.indices;
      pools = s.pools;
    }
    const Tensor at_rows = P == 1 ? sel : pools;
    const Tensor sa = ops::indexer_scores_at(q, k, w, b.seqs, at_rows, so);
    const Tensor ds = randn(sc.shape(), DType::f64, rng), dsa = randn(sa.shape(), DType::f64, rng);
    const ops::IndexerScoreGrads gd = ops::indexer_scores_backward(q, k, w, b.seqs, ds, so);
    const ops::IndexerScoreGrads ga =
        ops::indexer_scores_at_backward(q, k, w, b.seqs, at_rows, dsa, so);
    // A dense token-level target for the pool target (any [T, W] values will do).
    const Tensor tt = ops::attention_target(randn({b.T, 2, 6}, DType::f64, rng),
                                            randn({b.T, 6}, DType::f64, rng), b.seqs, 0.5);
    const Tensor pt = P > 1 ? ops::kpool_pool_target_dense(tt, b.seqs, P) : Tensor();
    Tensor dk_d = Tensor::zeros(k.shape(), DType::f64), dk_a = Tensor::zeros(k.shape(), DType::f64);
    for (const auto& [b0, b1] : b.windows) {
      SCOPED_TRACE(::testing::Message() << "window [" << b0 << ", " << b1 << ")");
      const Tensor qw = rows(q, b0, b1), ww = rows(w, b0, b1), rw = rows(at_rows, b0, b1);
      const Tensor s = ops::indexer_scores(qw, k, ww, b.seqs, so, 0, b0);
      EXPECT_TRUE(testing::bit_equal(s, rows(sc, b0, b1)));
      if (P == 1) {
        EXPECT_TRUE(testing::bit_equal(ops::topk_select(s, b.seqs, K, 1, b0), rows(sel, b0, b1)));
      } else {
        const ops::KPoolSelection ks = ops::kpool_select(s, b.seqs, K, P, true, b0);
        EXPECT_TRUE(testing::bit_equal(ks.indices, rows(sel, b0, b1)));
        EXPECT_TRUE(testing::bit_equal(ks.pools, rows(pools, b0, b1)));
        EXPECT_TRUE(testing::bit_equal(
            ops::kpool_pool_target_dense(rows(tt, b0, b1), b.seqs, P, 0, b0), rows(pt, b0, b1)));
      }
      EXPECT_TRUE(testing::bit_equal(ops::indexer_scores_at(qw, k, ww, b.seqs, rw, so, b0),
                                     rows(sa, b0, b1)));
      const ops::IndexerScoreGrads g =
          ops::indexer_scores_backward(qw, k, ww, b.seqs, rows(ds, b0, b1), so, b0);
      EXPECT_TRUE(testing::bit_equal(g.dq, rows(gd.dq, b0, b1)));
      EXPECT_TRUE(testing::bit_equal(g.dw, rows(gd.dw, b0, b1)));
      ops::add_(dk_d, g.dk);
      const ops::IndexerScoreGrads h =
          ops::indexer_scores_at_backward(qw, k, ww, b.seqs, rw, rows(dsa, b0, b1), so, b0);
      EXPECT_TRUE(testing::bit_equal(h.dq, rows(ga.dq, b0, b1)));
      ops::add_(dk_a, h.dk);
    }
    EXPECT_LT(rel(dk_d, gd.dk), kKeyTol);
    EXPECT_LT(rel(dk_a, ga.dk), kKeyTol);
  }
}

TEST(DsaQueryWindow, RefusesRowsOutsideTheBatchAndKeysOfTheWrongLength) {
  const Batch b = batch();
  Rng rng(testing::test_seed(), 3);
  const Tensor q = randn({5, 2, 4}, DType::f64, rng), kv = randn({b.T, 4}, DType::f64, rng);
  testing::expect_error([&] { ops::causal_attention(q, kv, b.seqs, 4, 0.5, b.T - 4); },
                        "query rows [69, 74) are not inside the sequence layout's 73 tokens");
  testing::expect_error([&] { ops::causal_attention(q, kv, b.seqs, 4, 0.5, -1); },
                        "are not inside");
  testing::expect_error([&] { ops::causal_attention(q, rows(kv, 0, 5), b.seqs, 4, 0.5, 0); },
                        "kv (the latent cache rows [T, D_qk])");
  // A selected token after the query (global position 12 for the window's query at 11).
  const Tensor idx = Tensor::from_vector<int32_t>({5, 1}, {10, 12, -1, -1, -1});
  testing::expect_error([&] { ops::sparse_attention(q, kv, idx, b.seqs, 4, 0.5, 10); },
                        "is not a causal token of query 11's document");
}

}  // namespace
}  // namespace hlm
