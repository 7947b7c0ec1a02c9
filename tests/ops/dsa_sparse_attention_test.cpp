// Sparse MLA attention (ops/dsa_sparse_attention.h) against a plain FP64 dense causal attention,
// finite differences, packing and bad input.
#include <omp.h>

#include <cmath>
#include <limits>

#include "core/rng.h"
#include "ops/dsa_indexer.h"
#include "ops/dsa_sparse_attention.h"
#include "testing.h"

namespace hlm::ops {
namespace {

using hlm::testing::seqs_of;

using hlm::testing::bit_equal;
using hlm::testing::close;
using hlm::testing::grad_check;
using hlm::testing::test_seed;

std::vector<int64_t> starts(const std::vector<int64_t>& lens) {
  std::vector<int64_t> st;
  int64_t s = 0;
  for (int64_t L : lens) {
    for (int64_t j = 0; j < L; ++j) st.push_back(s);
    s += L;
  }
  return st;
}

// Every causal token, ascending, -1 padded to W.
Tensor all_causal(const std::vector<int64_t>& lens, int64_t W) {
  const auto st = starts(lens);
  const int64_t T = int64_t(st.size());
  std::vector<int32_t> v(size_t(T * W), -1);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = st[size_t(t)]; s <= t; ++s) v[size_t(t * W + s - st[size_t(t)])] = int32_t(s);
  return Tensor::from_vector<int32_t>({T, W}, v);
}

// A random subset of the causal tokens at random slots (at least one per row).
Tensor random_rows(const std::vector<int64_t>& lens, int64_t W, Rng& rng) {
  const auto st = starts(lens);
  const int64_t T = int64_t(st.size());
  std::vector<int32_t> v(size_t(T * W), -1);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int64_t> cand, slots;
    for (int64_t s = st[size_t(t)]; s <= t; ++s) cand.push_back(s);
    for (int64_t j = 0; j < W; ++j) slots.push_back(j);
    for (int64_t j = W - 1; j > 0; --j)
      std::swap(slots[size_t(j)], slots[rng.below(uint64_t(j + 1))]);
    for (int64_t j = int64_t(cand.size()) - 1; j > 0; --j)
      std::swap(cand[size_t(j)], cand[rng.below(uint64_t(j + 1))]);
    const int64_t n = std::min<int64_t>(int64_t(cand.size()), 1 + int64_t(rng.below(uint64_t(W))));
    for (int64_t j = 0; j < n; ++j) v[size_t(t * W + slots[size_t(j)])] = int32_t(cand[size_t(j)]);
  }
  return Tensor::from_vector<int32_t>({T, W}, v);
}

TEST(DsaSparseAttention, AllCausalSelectionEqualsDenseCausalAttention) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{7, 1, 12};
  const auto st = starts(lens);
  const int64_t T = 20, H = 3, D = 24, dv = 16;
  const double scale = 1.0 / std::sqrt(double(D));
  for (DType dt : {DType::f64, DType::f32}) {
    const Tensor q = randn({T, H, D}, dt, rng), kv = randn({T, D}, dt, rng);
    // The indices as the top-k op gives them when K >= the prefix (all causal tokens).
    const Tensor sel = topk_select(randn({T, 12}, DType::f32, rng), seqs_of(lens), 16);
    EXPECT_TRUE(bit_equal(sel, all_causal(lens, 16)));
    const SparseAttentionOut r = sparse_attention(q, kv, sel, seqs_of(lens), dv, scale);
    const auto qv = q.to_f64_vector(), kvv = kv.to_f64_vector();
    std::vector<double> out(size_t(T * H * dv), 0.0), lse(size_t(T * H));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        std::vector<double> l;
        double m = -INFINITY, z = 0;
        for (int64_t s = st[size_t(t)]; s <= t; ++s) {
          double d = 0;
          for (int64_t c = 0; c < D; ++c)
            d += qv[size_t((t * H + h) * D + c)] * kvv[size_t(s * D + c)];
          l.push_back(scale * d);
          m = std::max(m, scale * d);
        }
        for (double x : l) z += std::exp(x - m);
        for (int64_t s = st[size_t(t)], j = 0; s <= t; ++s, ++j)
          for (int64_t c = 0; c < dv; ++c)
            out[size_t((t * H + h) * dv + c)] +=
                std::exp(l[size_t(j)] - m) / z * kvv[size_t(s * D + c)];
        lse[size_t(t * H + h)] = m + std::log(z);
      }
    EXPECT_TRUE(close(r.out, Tensor::from_values({T, H, dv}, out, DType::f64),
                      hlm::testing::tolerance_for(dt)));
    EXPECT_TRUE(close(r.lse, Tensor::from_values({T, H}, lse, DType::f64),
                      hlm::testing::tolerance_for(dt)));
  }
}

TEST(DsaSparseAttention, BackwardMatchesFiniteDifferences) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{6, 9};
  const int64_t T = 15, H = 2, D = 10, dv = 6, W = 5;
  const double scale = 0.3;
  Tensor q = randn({T, H, D}, DType::f64, rng), kv = randn({T, D}, DType::f64, rng);
  const SeqLayout cu = seqs_of(lens);
  const Tensor idx = random_rows(lens, W, rng);
  const Tensor r = randn({T, H, dv}, DType::f64, rng);
  const SparseAttentionOut f = sparse_attention(q, kv, idx, cu, dv, scale);
  const SparseAttentionGrads g =
      sparse_attention_backward(q, kv, idx, cu, dv, scale, f.out, f.lse, r);
  auto loss = [&] { return hlm::testing::dot(sparse_attention(q, kv, idx, cu, dv, scale).out, r); };
  EXPECT_TRUE(grad_check(loss, q, g.dq, 1e-6, 1e-7, 300));
  EXPECT_TRUE(grad_check(loss, kv, g.dkv, 1e-6, 1e-7, 300));
  // Full latent as the value (NoPE absorbed form: d_v = D_qk).
  const SparseAttentionOut f2 = sparse_attention(q, kv, idx, cu, D, scale);
  const Tensor r2 = randn({T, H, D}, DType::f64, rng);
  const SparseAttentionGrads g2 =
      sparse_attention_backward(q, kv, idx, cu, D, scale, f2.out, f2.lse, r2);
  auto loss2 = [&] {
    return hlm::testing::dot(sparse_attention(q, kv, idx, cu, D, scale).out, r2);
  };
  EXPECT_TRUE(grad_check(loss2, kv, g2.dkv, 1e-6, 1e-7, 300));
}

TEST(DsaSparseAttention, PackedEqualsSequencesAndThreadCountBitwise) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{9, 4, 11};
  const int64_t T = 24, H = 4, D = 16, dv = 8, W = 6;
  const double scale = 0.25;
  const Tensor q = randn({T, H, D}, DType::f32, rng), kv = randn({T, D}, DType::f32, rng);
  const SeqLayout cu = seqs_of(lens);
  const Tensor idx = random_rows(lens, W, rng);
  const Tensor dout = randn({T, H, dv}, DType::f32, rng);
  const SparseAttentionOut f = sparse_attention(q, kv, idx, cu, dv, scale);
  const SparseAttentionGrads g =
      sparse_attention_backward(q, kv, idx, cu, dv, scale, f.out, f.lse, dout);
  int64_t s0 = 0;
  for (int64_t L : lens) {
    auto part = [&](const Tensor& x) { return x.slice(0, s0, s0 + L).contiguous(); };
    std::vector<double> iv = part(idx).to_f64_vector();
    for (double& x : iv) x = x < 0 ? -1 : x - double(s0);
    const Tensor idx1 = Tensor::from_values({L, W}, iv, DType::i32);
    const SeqLayout cu1 = seqs_of({L});
    const SparseAttentionOut f1 = sparse_attention(part(q), part(kv), idx1, cu1, dv, scale);
    EXPECT_TRUE(bit_equal(f1.out, part(f.out)));
    EXPECT_TRUE(bit_equal(f1.lse, part(f.lse)));
    const SparseAttentionGrads g1 = sparse_attention_backward(part(q), part(kv), idx1, cu1, dv,
                                                              scale, f1.out, f1.lse, part(dout));
    EXPECT_TRUE(bit_equal(g1.dq, part(g.dq)));
    EXPECT_TRUE(bit_equal(g1.dkv, part(g.dkv)));
    s0 += L;
  }
  const int nt = omp_get_max_threads();
  omp_set_num_threads(1);
  const SparseAttentionGrads g_1 =
      sparse_attention_backward(q, kv, idx, cu, dv, scale, f.out, f.lse, dout);
  omp_set_num_threads(std::max(nt, 3));
  const SparseAttentionGrads g_3 =
      sparse_attention_backward(q, kv, idx, cu, dv, scale, f.out, f.lse, dout);
  omp_set_num_threads(nt);
  EXPECT_TRUE(bit_equal(g_1.dkv, g.dkv));
  EXPECT_TRUE(bit_equal(g_3.dkv, g.dkv));
  EXPECT_TRUE(bit_equal(g_3.dq, g.dq));
}

// The f32 path (f32 softmax and accumulation) against the f64 path on the same inputs, forward and
// backward, for the attention and for the indexer scoring.
TEST(DsaSparseAttention, F32MatchesF64ForwardAndBackward) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{13, 6};
  const int64_t T = 19, H = 4, D = 32, dv = 16, W = 8;
  const SeqLayout cu = seqs_of(lens);
  const Tensor q = randn({T, H, D}, DType::f64, rng), kv = randn({T, D}, DType::f64, rng);
  const Tensor idx = random_rows(lens, W, rng);
  const Tensor dout = randn({T, H, dv}, DType::f64, rng);
  const double scale = 1.0 / std::sqrt(double(D));
  const SparseAttentionOut f = sparse_attention(q, kv, idx, cu, dv, scale);
  const SparseAttentionGrads g =
      sparse_attention_backward(q, kv, idx, cu, dv, scale, f.out, f.lse, dout);
  const Tensor q32 = q.to(DType::f32), kv32 = kv.to(DType::f32), do32 = dout.to(DType::f32);
  const SparseAttentionOut f32 = sparse_attention(q32, kv32, idx, cu, dv, scale);
  const SparseAttentionGrads g32 =
      sparse_attention_backward(q32, kv32, idx, cu, dv, scale, f32.out, f32.lse, do32);
  const auto tol = hlm::testing::tolerance_for(DType::f32);
  EXPECT_TRUE(close(f32.out, f.out, tol));
  EXPECT_TRUE(close(f32.lse, f.lse, tol));
  EXPECT_TRUE(close(g32.dq, g.dq, tol));
  EXPECT_TRUE(close(g32.dkv, g.dkv, tol));
  const Tensor w = randn({T, H}, DType::f64, rng);
  const Tensor ds = randn({T, W}, DType::f64, rng);
  const IndexerScoreGrads gi = indexer_scores_at_backward(q, kv, w, cu, idx, ds);
  const IndexerScoreGrads gi32 =
      indexer_scores_at_backward(q32, kv32, w.to(DType::f32), cu, idx, ds.to(DType::f32));
  EXPECT_TRUE(close(gi32.dq, gi.dq, tol));
  EXPECT_TRUE(close(gi32.dk, gi.dk, tol));
  EXPECT_TRUE(close(gi32.dw, gi.dw, tol));
}

TEST(DsaSparseAttention, EmptyRowGivesZeroOutputAndNegInfLse) {
  Rng rng(test_seed());
  const Tensor q = randn({3, 2, 4}, DType::f64, rng), kv = randn({3, 4}, DType::f64, rng);
  const Tensor idx = Tensor::from_vector<int32_t>({3, 2}, {0, -1, -1, -1, 2, 0});
  const SparseAttentionOut f = sparse_attention(q, kv, idx, seqs_of({3}), 4, 0.5);
  for (int64_t h = 0; h < 2; ++h) {
    EXPECT_EQ(f.lse.at({1, h}), -INFINITY);
    for (int64_t c = 0; c < 4; ++c) {
      EXPECT_EQ(f.out.at({1, h, c}), 0.0);
      EXPECT_DOUBLE_EQ(f.out.at({0, h, c}), kv.at({0, c}));  // one key: its value
    }
  }
  const SparseAttentionGrads g = sparse_attention_backward(
      q, kv, idx, seqs_of({3}), 4, 0.5, f.out, f.lse, randn({3, 2, 4}, DType::f64, rng));
  for (int64_t c = 0; c < 4; ++c) {
    EXPECT_EQ(g.dq.at({1, 0, c}), 0.0);
    EXPECT_EQ(g.dkv.at({1, c}), 0.0);  // token 1 is read by nobody
  }
}

TEST(DsaSparseAttention, BadInputThrows) {
  Rng rng(test_seed());
  const Tensor q = randn({4, 2, 4}, DType::f32, rng), kv = randn({4, 4}, DType::f32, rng);
  const SeqLayout cu = seqs_of({2, 2});
  auto idx = [](std::vector<int32_t> v) { return Tensor::from_vector<int32_t>({4, 2}, v); };
  EXPECT_NO_THROW(sparse_attention(q, kv, idx({0, -1, 0, 1, 2, -1, -1, 3}), cu, 4, 0.5));
  EXPECT_THROW(sparse_attention(q, kv, idx({0, 0, 0, 1, 2, -1, 2, 3}), cu, 4, 0.5), Error);  // dup
  EXPECT_THROW(sparse_attention(q, kv, idx({0, 1, 0, 1, 2, -1, 2, 3}), cu, 4, 0.5),
               Error);  // future
  EXPECT_THROW(sparse_attention(q, kv, idx({0, -1, 0, 1, 1, -1, 2, 3}), cu, 4, 0.5),
               Error);  // other doc
  EXPECT_THROW(sparse_attention(q, kv, idx({0, -1, 0, 1, 2, -1, 7, 3}), cu, 4, 0.5),
               Error);  // range
  EXPECT_THROW(sparse_attention(q, kv, idx({0, -1, 0, 1, 2, -1, -3, 3}), cu, 4, 0.5), Error);
  const Tensor good = idx({0, -1, 0, 1, 2, -1, 2, 3});
  EXPECT_THROW(sparse_attention(q, kv, good, cu, 5, 0.5), Error);  // d_v > D_qk
  EXPECT_THROW(sparse_attention(q, kv, good, cu, 4, 0.0), Error);  // scale
  EXPECT_THROW(sparse_attention(q, kv.slice(1, 0, 3), good, cu, 3, 0.5), Error);
  EXPECT_THROW(sparse_attention(q, kv.to(DType::f64), good, cu, 4, 0.5), Error);
  EXPECT_THROW(sparse_attention(q, kv, good, seqs_of({2, 1}), 4, 0.5), Error);
  EXPECT_THROW(sparse_attention(q, kv, good.to(DType::f32), cu, 4, 0.5), Error);
}

// causal_attention (no index tensor) is sparse_attention over every causal token ascending, bit
// for bit, forward and backward, on packed documents (with a 1-token one), whatever padding the
// index tensor has; its argument checks are sparse_attention's.
TEST(DsaSparseAttention, CausalAttentionEqualsAllCausalSelectionBitwise) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{9, 1, 14, 5};
  const int64_t T = 29, H = 3, D = 20, dv = 12;
  const SeqLayout cu = seqs_of(lens);
  const double scale = 1.0 / std::sqrt(double(D));
  for (DType dt : {DType::f64, DType::f32}) {
    const Tensor q = randn({T, H, D}, dt, rng), kv = randn({T, D}, dt, rng);
    const Tensor dout = randn({T, H, dv}, dt, rng);
    const SparseAttentionOut c = causal_attention(q, kv, cu, dv, scale);
    const SparseAttentionGrads gc =
        causal_attention_backward(q, kv, cu, dv, scale, c.out, c.lse, dout);
    for (int64_t W : {14, 17}) {
      const Tensor idx = all_causal(lens, W);
      const SparseAttentionOut s = sparse_attention(q, kv, idx, cu, dv, scale);
      EXPECT_TRUE(bit_equal(c.out, s.out)) << dtype_name(dt) << " W " << W;
      EXPECT_TRUE(bit_equal(c.lse, s.lse)) << dtype_name(dt) << " W " << W;
      const SparseAttentionGrads gs =
          sparse_attention_backward(q, kv, idx, cu, dv, scale, s.out, s.lse, dout);
      EXPECT_TRUE(bit_equal(gc.dq, gs.dq)) << dtype_name(dt) << " W " << W;
      EXPECT_TRUE(bit_equal(gc.dkv, gs.dkv)) << dtype_name(dt) << " W " << W;
    }
    // A strided q goes through .contiguous(): the same bits.
    const Tensor qw = randn({T, H, 2 * D}, dt, rng);
    qw.slice(2, 0, D).copy_(q);
    const SparseAttentionOut cs = causal_attention(qw.slice(2, 0, D), kv, cu, dv, scale);
    EXPECT_TRUE(bit_equal(cs.out, c.out));
  }
  const Tensor q = randn({4, 2, 4}, DType::f32, rng), kv = randn({4, 4}, DType::f32, rng);
  const SeqLayout cu2 = seqs_of({2, 2});
  const SparseAttentionOut f = causal_attention(q, kv, cu2, 4, 0.5);
  const Tensor dout = randn({4, 2, 4}, DType::f32, rng);
  EXPECT_NO_THROW(causal_attention_backward(q, kv, cu2, 4, 0.5, f.out, f.lse, dout));
  hlm::testing::expect_error([&] { causal_attention(q, kv, cu2, 5, 0.5); },
                             "causal_attention: d_v must be in [1, D_qk = 4]");
  hlm::testing::expect_error([&] { causal_attention(q, kv, cu2, 4, 0.0); },
                             "causal_attention: scale");
  hlm::testing::expect_error([&] { causal_attention(q, kv.to(DType::f64), cu2, 4, 0.5); },
                             "causal_attention: kv");
  EXPECT_THROW(causal_attention(q, kv, seqs_of({2, 1}), 4, 0.5), Error);
  EXPECT_THROW(causal_attention(q.to(DType::bf16), kv.to(DType::bf16), cu2, 4, 0.5), Error);
  hlm::testing::expect_error(
      [&] { causal_attention_backward(q, kv, cu2, 4, 0.5, f.out, f.lse.to(DType::f64), dout); },
      "causal_attention_backward: lse");
  hlm::testing::expect_error(
      [&] {
        causal_attention_backward(q, kv, cu2, 4, 0.5, f.out, f.lse,
                                  randn({4, 2, 3}, DType::f32, rng));
      },
      "causal_attention_backward: d_out must have shape");
}

}  // namespace
}  // namespace hlm::ops
