// The checks of the DSA ops' query windows, shared by ops/dsa_window_test.cpp (CPU, f64) and
// ops/dsa_window_gpu_test.cpp (CUDA, f32 and f64), and their batch: four documents of 23, 1, 40 and
// 9 tokens, tiled by windows cut inside the first document, at the one-token document (a one-token
// window), at the start of the third, twice inside it (one a one-token window), and before the
// last.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "core/seq_layout.h"
#include "core/tensor.h"
#include "ops/dsa_indexer.h"
#include "ops/dsa_indexer_loss.h"
#include "ops/dsa_kpool.h"
#include "ops/dsa_sparse_attention.h"
#include "ops/tensor_ops.h"
#include "testing.h"

namespace hlm::testing {

struct WindowBatch {
  SeqLayout seqs;
  int64_t T = 0;
  std::vector<std::pair<int64_t, int64_t>> windows;  // [begin, end), tiling [0, T)
};

inline WindowBatch window_batch() {
  WindowBatch b;
  b.seqs = seqs_of({23, 1, 40, 9});
  b.T = b.seqs.total_tokens();
  int64_t at = 0;
  for (const int64_t cut : {10, 23, 24, 30, 31, 64}) {
    b.windows.push_back({at, cut});
    at = cut;
  }
  b.windows.push_back({at, b.T});
  return b;
}

// Rows [b, e) of t as a contiguous tensor.
inline Tensor rows(const Tensor& t, int64_t b, int64_t e) {
  return t.slice(0, b, e).contiguous();
}

// Every windowed attention op on `dev` in `dt` (inputs drawn in f64, converted): each window's
// rows equal the whole batch's rows of the same op on the same device, bit for bit; the key
// gradients of the windows sum to the whole batch's within key_tol (relative L2).
// D, dv: the head widths (the tensor-core path of bf16 on CUDA takes D a multiple of 32).
inline void check_attention_windows(Device dev, DType dt, double key_tol, int64_t D = 10,
                                    int64_t dv = 6) {
  auto on = [&](const Tensor& t) { return dev == Device::cpu ? t : gpu(t); };
  auto host = [&](const Tensor& t) { return dev == Device::cpu ? t : cpu(t); };
  auto same = [&](const Tensor& a, const Tensor& b) { return bit_equal(host(a), host(b)); };
  const WindowBatch b = window_batch();
  Rng rng(test_seed(), 1);
  const int64_t H = 3;
  const double scale = 0.3;
  const Tensor q = on(randn({b.T, H, D}, DType::f64, rng).to(dt));
  const Tensor kv = on(randn({b.T, D}, DType::f64, rng).to(dt));
  const Tensor dout = on(randn({b.T, H, dv}, DType::f64, rng).to(dt));
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
  const Tensor idx = on(Tensor::from_vector<int32_t>({b.T, W}, sel));

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
    Tensor dkv = Tensor::zeros(kv.shape(), DType::f64);  // on the host
    for (const auto& [b0, b1] : b.windows) {
      SCOPED_TRACE(::testing::Message() << "window [" << b0 << ", " << b1 << ")");
      const Tensor qw = rows(q, b0, b1), iw = rows(idx, b0, b1), dw = rows(dout, b0, b1);
      const ops::SparseAttentionOut o =
          causal ? ops::causal_attention(qw, kv, b.seqs, dv, scale, b0)
                 : ops::sparse_attention(qw, kv, iw, b.seqs, dv, scale, b0);
      EXPECT_TRUE(same(o.out, rows(whole.out, b0, b1)));
      EXPECT_TRUE(same(o.lse, rows(whole.lse, b0, b1)));
      const ops::SparseAttentionGrads g =
          causal
              ? ops::causal_attention_backward(qw, kv, b.seqs, dv, scale, o.out, o.lse, dw, b0)
              : ops::sparse_attention_backward(qw, kv, iw, b.seqs, dv, scale, o.out, o.lse, dw, b0);
      EXPECT_TRUE(same(g.dq, rows(gw.dq, b0, b1)));
      ops::add_(dkv, host(g.dkv).to(DType::f64));
    }
    EXPECT_LT(compare(dkv, host(gw.dkv).to(DType::f64)).rel_l2, key_tol);
  }
  // The targets of the indexer loss, dense and over the selection.
  const Tensor tw = ops::attention_target(q, kv, b.seqs, scale);
  const ops::SparseAttentionOut sw = ops::sparse_attention(q, kv, idx, b.seqs, dv, scale);
  const Tensor ta = ops::attention_target_at(q, kv, b.seqs, idx, scale, sw.lse);
  for (const auto& [b0, b1] : b.windows) {
    const Tensor qw = rows(q, b0, b1);
    EXPECT_TRUE(same(ops::attention_target(qw, kv, b.seqs, scale, 0, b0), rows(tw, b0, b1)));
    EXPECT_TRUE(same(ops::attention_target_at(qw, kv, b.seqs, rows(idx, b0, b1), scale,
                                              rows(sw.lse, b0, b1), b0),
                     rows(ta, b0, b1)));
  }
}

// The same for the indexer's windowed ops (scores, selection, pool targets, their gradients).
inline void check_indexer_windows(Device dev, DType dt, double key_tol) {
  auto on = [&](const Tensor& t) { return dev == Device::cpu ? t : gpu(t); };
  auto host = [&](const Tensor& t) { return dev == Device::cpu ? t : cpu(t); };
  auto same = [&](const Tensor& a, const Tensor& b) { return bit_equal(host(a), host(b)); };
  const WindowBatch b = window_batch();
  Rng rng(test_seed(), 2);
  const int64_t H = 2, d = 8;
  for (const int64_t P : {int64_t(1), int64_t(4)}) {
    SCOPED_TRACE(::testing::Message() << "pool " << P);
    const int64_t nk =
        P == 1 ? b.T : ops::kpool_pool_offsets(b.seqs, b.T, P).to_i64_vector().back();
    const Tensor q = on(randn({b.T, H, d}, DType::f64, rng).to(dt));
    const Tensor k = on(randn({nk, d}, DType::f64, rng).to(dt));
    const Tensor w = on(randn({b.T, H}, DType::f64, rng).to(dt));
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
    const Tensor ds = on(randn(sc.shape(), DType::f64, rng).to(sc.dtype()));
    const Tensor dsa = on(randn(sa.shape(), DType::f64, rng).to(sa.dtype()));
    const ops::IndexerScoreGrads gd = ops::indexer_scores_backward(q, k, w, b.seqs, ds, so);
    const ops::IndexerScoreGrads ga =
        ops::indexer_scores_at_backward(q, k, w, b.seqs, at_rows, dsa, so);
    // A dense token-level target for the pool target (any [T, W] values will do).
    const Tensor tt =
        ops::attention_target(on(randn({b.T, 2, 6}, DType::f64, rng).to(dt)),
                              on(randn({b.T, 6}, DType::f64, rng).to(dt)), b.seqs, 0.5);
    const Tensor pt = P > 1 ? ops::kpool_pool_target_dense(tt, b.seqs, P) : Tensor();
    Tensor dk_d = Tensor::zeros(k.shape(), DType::f64), dk_a = Tensor::zeros(k.shape(), DType::f64);
    for (const auto& [b0, b1] : b.windows) {
      SCOPED_TRACE(::testing::Message() << "window [" << b0 << ", " << b1 << ")");
      const Tensor qw = rows(q, b0, b1), ww = rows(w, b0, b1), rw = rows(at_rows, b0, b1);
      const Tensor s = ops::indexer_scores(qw, k, ww, b.seqs, so, 0, b0);
      EXPECT_TRUE(same(s, rows(sc, b0, b1)));
      if (P == 1) {
        EXPECT_TRUE(same(ops::topk_select(s, b.seqs, K, 1, b0), rows(sel, b0, b1)));
      } else {
        const ops::KPoolSelection ks = ops::kpool_select(s, b.seqs, K, P, true, b0);
        EXPECT_TRUE(same(ks.indices, rows(sel, b0, b1)));
        EXPECT_TRUE(same(ks.pools, rows(pools, b0, b1)));
        EXPECT_TRUE(same(ops::kpool_pool_target_dense(rows(tt, b0, b1), b.seqs, P, 0, b0),
                         rows(pt, b0, b1)));
      }
      EXPECT_TRUE(same(ops::indexer_scores_at(qw, k, ww, b.seqs, rw, so, b0), rows(sa, b0, b1)));
      const ops::IndexerScoreGrads g =
          ops::indexer_scores_backward(qw, k, ww, b.seqs, rows(ds, b0, b1), so, b0);
      EXPECT_TRUE(same(g.dq, rows(gd.dq, b0, b1)));
      EXPECT_TRUE(same(g.dw, rows(gd.dw, b0, b1)));
      ops::add_(dk_d, host(g.dk).to(DType::f64));
      const ops::IndexerScoreGrads h =
          ops::indexer_scores_at_backward(qw, k, ww, b.seqs, rw, rows(dsa, b0, b1), so, b0);
      EXPECT_TRUE(same(h.dq, rows(ga.dq, b0, b1)));
      ops::add_(dk_a, host(h.dk).to(DType::f64));
    }
    EXPECT_LT(compare(dk_d, host(gd.dk).to(DType::f64)).rel_l2, key_tol);
    EXPECT_LT(compare(dk_a, host(ga.dk).to(DType::f64)).rel_l2, key_tol);
  }
}

}  // namespace hlm::testing
