// DSA selection and the indexer loss on CUDA against the CPU ops on the same inputs: top-k and
// KPool selections identical to the CPU's (ties, NaN, -0 / +0, -inf, rows shorter and longer
// than k, pools cut by document ends), pool targets and the KL loss within f32 / f64 rounding,
// outputs NaN-poisoned, bit-identical run to run.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>

#include "core/rng.h"
#include "ops/dispatch.h"
#include "ops/dsa_indexer.h"
#include "ops/dsa_indexer_loss.h"
#include "ops/dsa_kpool.h"
#include "testing.h"

namespace hlm {
namespace {

using testing::bit_equal;
using testing::cpu;
using testing::gpu;
using testing::seqs_of;
using testing::test_seed;

using Poison = testing::PoisonOutputs;
// Max |out - ref| / max |ref| of a GPU output against its CPU reference, checked against the
// dtype's bound and printed.
void expect_close(const char* what, const Tensor& out_gpu, const Tensor& ref) {
  const testing::ErrorStats e = testing::compare(cpu(out_gpu), ref);
  double mref = 0;
  for (double v : ref.to_f64_vector())
    if (std::isfinite(v)) mref = std::max(mref, std::fabs(v));
  const double rel = mref > 0 ? e.max_abs / mref : e.max_abs;
  std::printf("  %-34s %-4s max_err/max|ref| %.3e\n", what, dtype_name(ref.dtype()), rel);
  EXPECT_EQ(e.nan_mismatch, 0) << what;
  EXPECT_LE(rel, ref.dtype() == DType::f64 ? 1e-12 : 2e-5) << what << " " << e.report(ref);
}

// Scores [T, W] full of ties (a few distinct values), with NaN, -0 / +0 and -inf sprinkled in.
Tensor tied_scores(int64_t T, int64_t W, DType dt, Rng& rng) {
  std::vector<double> v(size_t(T * W));
  for (double& x : v) {
    const uint64_t r = rng.below(64);
    if (r == 0)
      x = std::numeric_limits<double>::quiet_NaN();
    else if (r == 1)
      x = -0.0;
    else if (r == 2)
      x = -std::numeric_limits<double>::infinity();
    else if (r < 40)
      x = double(rng.below(5)) - 2.0;  // -2 .. 2, ties everywhere, +0 among them
    else
      x = rng.normal();
  }
  return Tensor::from_values({T, W}, v, dt);
}

const std::vector<std::vector<int64_t>> kLayouts = {{1}, {63}, {65}, {1, 63, 65, 5}, {130}};

TEST(DsaSelectGpu, TopkEqualsTheCpuSelection) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Poison poison;
  Rng rng(test_seed());
  for (DType dt : {DType::f32, DType::f64})
    for (const auto& lens : kLayouts)
      for (int64_t pool : {1, 4}) {
        const SeqLayout seqs = seqs_of(lens);
        int64_t W = 0;
        for (int64_t l : lens) W = std::max(W, l / pool);
        W = std::max<int64_t>(W, 1) + 3;  // wider than needed: the extra columns are ignored
        const int64_t T = testing::total(lens);
        const Tensor sc = tied_scores(T, W, dt, rng);
        for (int64_t k : {1, 7, 64, 200}) {
          const Tensor want = ops::topk_select(sc, seqs, k, pool);
          const Tensor got = ops::topk_select(gpu(sc), seqs, k, pool);
          EXPECT_TRUE(bit_equal(got, want))
              << dtype_name(dt) << " T " << T << " pool " << pool << " k " << k;
          EXPECT_TRUE(bit_equal(ops::topk_select(gpu(sc), seqs, k, pool), got)) << "rerun";
        }
      }
}

// Rows of up to 700 candidates: several chunks of the block's compaction pass, distinct scores
// and all-equal scores (the lower indices win).
TEST(DsaSelectGpu, TopkOnLongRowsEqualsTheCpuSelection) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Poison poison;
  Rng rng(test_seed());
  const std::vector<int64_t> lens{700};
  const SeqLayout seqs = seqs_of(lens);
  for (DType dt : {DType::f32, DType::f64}) {
    const Tensor distinct = randn({700, 700}, dt, rng);
    const Tensor equal = Tensor::full({700, 700}, 0.5, dt);
    for (const Tensor* sc : {&distinct, &equal})
      for (int64_t k : {37, 300}) {
        const Tensor want = ops::topk_select(*sc, seqs, k);
        EXPECT_TRUE(bit_equal(ops::topk_select(gpu(*sc), seqs, k), want))
            << dtype_name(dt) << " k " << k;
      }
  }
}

TEST(DsaSelectGpu, KPoolSelectionEqualsTheCpuSelection) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Poison poison;
  Rng rng(test_seed());
  const int64_t P = 4;
  for (const auto& lens : std::vector<std::vector<int64_t>>{{63}, {1, 63, 65, 5}, {6, 3, 30}}) {
    const SeqLayout seqs = seqs_of(lens);
    int64_t Wp = 1;
    for (int64_t l : lens) Wp = std::max(Wp, l / P);
    const Tensor sc = tied_scores(testing::total(lens), Wp, DType::f32, rng);
    for (int64_t K : {4, 12, 64})
      for (bool tail : {true, false}) {
        const ops::KPoolSelection want = ops::kpool_select(sc, seqs, K, P, tail);
        const ops::KPoolSelection got = ops::kpool_select(gpu(sc), seqs, K, P, tail);
        EXPECT_TRUE(bit_equal(got.pools, want.pools)) << "K " << K << " tail " << tail;
        EXPECT_TRUE(bit_equal(got.indices, want.indices)) << "K " << K << " tail " << tail;
      }
  }
}

TEST(DsaSelectGpu, PoolTargetsMatchTheCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Poison poison;
  Rng rng(test_seed());
  const int64_t P = 4, K = 8, H = 2, D = 12;
  const std::vector<int64_t> lens{1, 63, 65, 6};
  const SeqLayout seqs = seqs_of(lens);
  const int64_t T = testing::total(lens);
  for (DType dt : {DType::f32, DType::f64}) {
    const Tensor q = randn({T, H, D}, dt, rng), kv = randn({T, D}, dt, rng);
    const Tensor dense = ops::attention_target(q, kv, seqs, 0.3);
    expect_close("pool target, dense", ops::kpool_pool_target_dense(gpu(dense), seqs, P),
                 ops::kpool_pool_target_dense(dense, seqs, P));
    expect_close("pool target, dense, Wp 40", ops::kpool_pool_target_dense(gpu(dense), seqs, P, 40),
                 ops::kpool_pool_target_dense(dense, seqs, P, 40));
    const Tensor sc = randn({T, 65 / P}, dt, rng);
    const ops::KPoolSelection sel = ops::kpool_select(sc, seqs, K, P);
    const Tensor tt = ops::attention_target_at(q, kv, seqs, sel.indices, 0.3);
    const Tensor want = ops::kpool_pool_target_sparse(tt, sel.pools, P);
    const Tensor got = ops::kpool_pool_target_sparse(gpu(tt), gpu(sel.pools), P);
    expect_close("pool target, sparse", got, want);
    expect_close("pool target, sparse, i64 pools",
                 ops::kpool_pool_target_sparse(gpu(tt), gpu(sel.pools.to(DType::i64)), P), want);
    EXPECT_TRUE(bit_equal(ops::kpool_pool_target_sparse(gpu(tt), gpu(sel.pools), P), got));
  }
}

TEST(DsaSelectGpu, IndexerKlLossMatchesTheCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Poison poison;
  Rng rng(test_seed());
  const int64_t H = 3, D = 16, HI = 2, DI = 8;
  const std::vector<int64_t> lens{1, 63, 65};
  const SeqLayout seqs = seqs_of(lens);
  const int64_t T = testing::total(lens);
  for (DType dt : {DType::f32, DType::f64}) {
    const Tensor q = randn({T, H, D}, dt, rng), kv = randn({T, D}, dt, rng);
    const Tensor qi = randn({T, HI, DI}, dt, rng), ki = randn({T, DI}, dt, rng),
                 w = randn({T, HI}, dt, rng, 0.5);
    const Tensor scores = ops::indexer_scores(qi, ki, w, seqs, {}, 70);  // wider than needed
    const Tensor target = ops::attention_target(q, kv, seqs, 0.25, 70);
    for (ops::KlReduction red : {ops::KlReduction::mean, ops::KlReduction::sum}) {
      const ops::IndexerKl want = ops::indexer_kl_loss(scores, target, 0.7, red);
      const ops::IndexerKl got = ops::indexer_kl_loss(gpu(scores), gpu(target), 0.7, red);
      const double rel = std::fabs(got.loss - want.loss) / std::fabs(want.loss);
      std::printf("  KL loss %-4s %s: cpu %.9g gpu %.9g rel %.2e\n", dtype_name(dt),
                  red == ops::KlReduction::mean ? "mean" : "sum", want.loss, got.loss, rel);
      EXPECT_LE(rel, dt == DType::f64 ? 1e-12 : 1e-5);
      EXPECT_EQ(got.rows, want.rows);
      expect_close("KL d_scores", got.d_scores, want.d_scores);
      const ops::IndexerKl again = ops::indexer_kl_loss(gpu(scores), gpu(target), 0.7, red);
      EXPECT_EQ(again.loss, got.loss);
      EXPECT_TRUE(bit_equal(again.d_scores, got.d_scores));
    }
  }
  // Empty input, and target mass outside the set: refused as on the CPU.
  const Tensor none = Tensor::zeros({0, 4}, DType::f32);
  EXPECT_EQ(ops::indexer_kl_loss(gpu(none), gpu(none)).rows, 0);
  Tensor sc = Tensor::from_values({1, 2}, {0.0, -INFINITY}, DType::f32);
  Tensor tg = Tensor::from_values({1, 2}, {0.5, 0.5}, DType::f32);
  testing::expect_error([&] { ops::indexer_kl_loss(gpu(sc), gpu(tg)); }, "outside the row's set");
}

TEST(DsaSelectGpu, BadArgumentsAreRefused) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  const SeqLayout seqs = seqs_of({4});
  const Tensor sc = Tensor::zeros({4, 4}, DType::f32);
  testing::expect_error([&] { ops::topk_select(gpu(sc.to(DType::bf16)), seqs, 2); }, "f32 or f64");
  testing::expect_error([&] { ops::indexer_kl_loss(gpu(sc), sc); }, "device");
  const ops::KPoolSelection sel = ops::kpool_select(gpu(sc), seqs, 4, 4);
  testing::expect_error(
      [&] { ops::kpool_pool_target_sparse(gpu(sc), sel.pools.to(Device::cpu), 4); }, "device");
}

}  // namespace
}  // namespace hlm
