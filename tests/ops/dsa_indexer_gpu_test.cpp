// DSA lightning-indexer scoring (dense causal and explicit rows, token and KPool pooled keys, FP8
// emulation on and off, ReLU on and off) and KPool compression on CUDA, against the CPU ops on the
// same inputs: f32 (max error / max |ref| <= 2e-5), f64 (<= 1e-12), bf16 (GPU on bf16 inputs vs the
// CPU f32 op on the bf16-rounded inputs: f32 outputs such as the scores at the f32 bound, bf16
// outputs at relative L2 <= 2e-3). Lengths 1, 63, 65 and packed documents (pools cut by document
// ends), dense rows wider than needed, explicit rows with -1 holes, d_scores NaN outside the set
// (must be ignored), outputs NaN-poisoned, every result bit-identical on a second run, and bad
// arguments refused. Every comparison prints its errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/rng.h"
#include "core/seq_layout.h"
#include "ops/cuda/dsa_common.cuh"
#include "ops/dispatch.h"
#include "ops/dsa_common.h"
#include "ops/dsa_indexer.h"
#include "ops/dsa_kpool.h"
#include "testing.h"

namespace hlm {
namespace {

using testing::cpu;
using testing::gpu;

using Poison = testing::PoisonOutputs;
using testing::round_bf16;
// A GPU output against the CPU reference, at the bound of the GPU output's dtype; non-finite
// values (the -inf outside the set) must sit at the same places with the same values.
void check(const std::string& what, const Tensor& out_gpu, const Tensor& ref) {
  const DType dt = out_gpu.dtype();
  const Tensor o = cpu(out_gpu).to(ref.dtype());
  ASSERT_EQ(o.shape(), ref.shape()) << what;
  const testing::ErrorStats e = testing::compare(o, ref);
  double mref = 0;
  int64_t nonfinite_diff = 0;
  const std::vector<double> ov = o.to_f64_vector(), rv = ref.to_f64_vector();
  for (size_t i = 0; i < rv.size(); ++i) {
    if (std::isfinite(rv[i]))
      mref = std::max(mref, std::fabs(rv[i]));
    else if (!(ov[i] == rv[i]))
      ++nonfinite_diff;
  }
  const double maxrel = mref > 0 ? e.max_abs / mref : e.max_abs;
  std::printf("  %-34s %-5s max_err/max|ref| %.3e  rel_l2 %.3e\n", what.c_str(), dtype_name(dt),
              maxrel, e.rel_l2);
  EXPECT_EQ(e.nan_mismatch, 0) << what << " " << e.report(ref);
  EXPECT_EQ(nonfinite_diff, 0) << what;
  if (dt == DType::f32) {
    EXPECT_LE(maxrel, 2e-5) << what << " " << e.report(ref);
  } else if (dt == DType::f64) {
    EXPECT_LE(maxrel, 1e-12) << what << " " << e.report(ref);
  } else {
    EXPECT_LE(e.rel_l2, 2e-3) << what << " " << e.report(ref);
  }
}

// Inputs of dtype dt: the CPU reference sees x (f32 / f64) or the bf16-rounded x in f32.
struct Pair {
  Tensor ref, dev;
};
Pair make(const Shape& s, DType dt, Rng& rng, double std = 1.0) {
  const Tensor x = randn(s, dt == DType::f64 ? DType::f64 : DType::f32, rng, std);
  if (dt == DType::bf16) return {round_bf16(x), gpu(x.to(DType::bf16))};
  return {x, gpu(x)};
}

DType compute_of(DType dt) {
  return dt == DType::f64 ? DType::f64 : DType::f32;
}

// d_scores [T, W] in the dense layout: random inside the visible set, NaN outside (ignored).
Tensor dense_dscores(const std::vector<int64_t>& cu, int64_t P, int64_t W, DType cdt, Rng& rng) {
  const int64_t T = cu.back();
  std::vector<double> v = randn({T, W}, DType::f64, rng).to_f64_vector();
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int64_t t = cu[d]; t < cu[d + 1]; ++t)
      for (int64_t j = (t - cu[d] + 1) / P; j < W; ++j) v[size_t(t * W + j)] = NAN;
  return Tensor::from_values({T, W}, v, cdt);
}

// Explicit rows [T, W] (i32 or i64): each query keeps a random subset (possibly empty) of its
// visible keys at random slots, -1 elsewhere.
Tensor random_rows(const std::vector<int64_t>& cu, int64_t P, int64_t W, DType it, Rng& rng) {
  const std::vector<int64_t> cp = ops::dsa_detail::pool_offsets(cu, P);
  const int64_t T = cu.back();
  std::vector<double> v(size_t(T * W), -1);
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int64_t t = cu[d]; t < cu[d + 1]; ++t) {
      std::vector<int64_t> cand, slots;
      for (int64_t j = 0; j < (t - cu[d] + 1) / P; ++j) cand.push_back(cp[d] + j);
      for (int64_t j = 0; j < W; ++j) slots.push_back(j);
      for (int64_t j = int64_t(cand.size()) - 1; j > 0; --j)
        std::swap(cand[size_t(j)], cand[rng.below(uint64_t(j + 1))]);
      for (int64_t j = W - 1; j > 0; --j)
        std::swap(slots[size_t(j)], slots[rng.below(uint64_t(j + 1))]);
      const int64_t n =
          std::min<int64_t>(int64_t(cand.size()), int64_t(rng.below(uint64_t(W + 1))));
      for (int64_t j = 0; j < n; ++j) v[size_t(t * W + slots[size_t(j)])] = double(cand[size_t(j)]);
    }
  return Tensor::from_values({T, W}, v, it);
}

// d_scores at explicit rows: random at the entries, NaN at the -1 holes (ignored).
Tensor rows_dscores(const Tensor& rows, DType cdt, Rng& rng) {
  std::vector<double> v = randn(rows.shape(), DType::f64, rng).to_f64_vector();
  const std::vector<double> r = rows.to_f64_vector();
  for (size_t i = 0; i < v.size(); ++i)
    if (r[i] < 0) v[i] = NAN;
  return Tensor::from_values(rows.shape(), v, cdt);
}

void expect_same_bits(const std::string& what, const Tensor& a, const Tensor& b) {
  EXPECT_TRUE(testing::bit_equal(cpu(a), cpu(b))) << what << ": second run differs";
}

struct ScoreCase {
  std::vector<int64_t> lens;
  int64_t P, H, D;
  DType dt;
  bool relu, fp8;
};

void run_score_case(const ScoreCase& c, Rng& rng) {
  const SeqLayout seqs = SeqLayout::from_lengths(c.lens);
  const std::vector<int64_t>& cu = seqs.offsets();
  const int64_t T = cu.back(), nkeys = ops::dsa_detail::pool_offsets(cu, c.P).back();
  const int64_t need = ops::dsa_detail::max_keys_per_doc(cu, c.P);
  const DType cdt = compute_of(c.dt);
  std::string lens;
  for (int64_t l : c.lens) lens += (lens.empty() ? "" : ",") + std::to_string(l);
  std::printf("indexer %s lens={%s} P=%lld H=%lld D=%lld relu=%d fp8=%d\n", dtype_name(c.dt),
              lens.c_str(), (long long)c.P, (long long)c.H, (long long)c.D, int(c.relu),
              int(c.fp8));
  const Pair q = make({T, c.H, c.D}, c.dt, rng), k = make({nkeys, c.D}, c.dt, rng);
  const Pair w = make({T, c.H}, c.dt, rng, 0.5);
  ops::IndexerScoreOptions opt;
  opt.pool = c.P, opt.relu = c.relu, opt.fp8 = c.fp8;

  // Dense layout, rows wider than needed.
  const int64_t W = need + 5;
  const Tensor sc_ref = ops::indexer_scores(q.ref, k.ref, w.ref, seqs, opt, W);
  const Tensor sc_dev = ops::indexer_scores(q.dev, k.dev, w.dev, seqs, opt, W);
  EXPECT_EQ(sc_dev.dtype(), cdt);
  check("dense scores", sc_dev, sc_ref);
  const Tensor dsc = dense_dscores(cu, c.P, W, cdt, rng);
  const auto g_ref = ops::indexer_scores_backward(q.ref, k.ref, w.ref, seqs, dsc, opt);
  const auto g_dev = ops::indexer_scores_backward(q.dev, k.dev, w.dev, seqs, gpu(dsc), opt);
  check("dense dq", g_dev.dq, g_ref.dq);
  check("dense dk", g_dev.dk, g_ref.dk);
  check("dense dw", g_dev.dw, g_ref.dw);
  expect_same_bits("dense scores", sc_dev, ops::indexer_scores(q.dev, k.dev, w.dev, seqs, opt, W));
  const auto g2 = ops::indexer_scores_backward(q.dev, k.dev, w.dev, seqs, gpu(dsc), opt);
  expect_same_bits("dense dq", g_dev.dq, g2.dq);
  expect_same_bits("dense dk", g_dev.dk, g2.dk);
  expect_same_bits("dense dw", g_dev.dw, g2.dw);

  // Explicit rows with -1 holes (i64 rows for pooled keys, i32 for tokens).
  const Tensor rows = random_rows(cu, c.P, 7, c.P == 1 ? DType::i32 : DType::i64, rng);
  const Tensor at_ref = ops::indexer_scores_at(q.ref, k.ref, w.ref, seqs, rows, opt);
  const Tensor at_dev = ops::indexer_scores_at(q.dev, k.dev, w.dev, seqs, gpu(rows), opt);
  check("rows scores", at_dev, at_ref);
  const Tensor dat = rows_dscores(rows, cdt, rng);
  const auto ga_ref = ops::indexer_scores_at_backward(q.ref, k.ref, w.ref, seqs, rows, dat, opt);
  const auto ga_dev =
      ops::indexer_scores_at_backward(q.dev, k.dev, w.dev, seqs, gpu(rows), gpu(dat), opt);
  check("rows dq", ga_dev.dq, ga_ref.dq);
  check("rows dk", ga_dev.dk, ga_ref.dk);
  check("rows dw", ga_dev.dw, ga_ref.dw);
  expect_same_bits("rows scores", at_dev,
                   ops::indexer_scores_at(q.dev, k.dev, w.dev, seqs, gpu(rows), opt));
  const auto ga2 =
      ops::indexer_scores_at_backward(q.dev, k.dev, w.dev, seqs, gpu(rows), gpu(dat), opt);
  expect_same_bits("rows dq", ga_dev.dq, ga2.dq);
  expect_same_bits("rows dk", ga_dev.dk, ga2.dk);
  expect_same_bits("rows dw", ga_dev.dw, ga2.dw);
}

// Every dtype meets every (d_I, ReLU, FP8) combination once across its (lengths, pool) cases:
// d_I = 40 (one partial FP8 block) or 136 (a full block and a partial one, two gradient parts).
TEST(DsaIndexerGpu, ScoresAndGradientsMatchCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Poison poison;
  Rng rng(testing::test_seed());
  const std::vector<std::vector<int64_t>> cases = {{1}, {63}, {65}, {1, 63, 65}};
  for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
    int v = 0;
    for (const auto& lens : cases)
      for (int64_t P : {1, 4}) {
        ScoreCase c{lens, P, 3, (v & 1) ? 136 : 40, dt, (v & 2) == 0, (v & 4) != 0};
        run_score_case(c, rng);
        ++v;
      }
  }
}

// The scoring over an inference cache from its page tables (ops::indexer_scores_cached): the
// same bits as indexer_scores_pattern over the host-built list of each query's candidate rows, on
// the CPU and on CUDA (where the device builds the entries), tokens (P = 1) and pools (P = 4),
// shuffled page tables, queries of three sequences at different positions, and the FP8 emulation;
// CUDA against the CPU within the dtype's tolerance. Refused: a page past the key rows, a wrong
// candidate count.
TEST(DsaIndexerGpu, CachedScoresFromPageTables) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Poison poison;
  Rng rng(testing::test_seed());
  const int64_t page = 8, H = 3, D = 40, npages = 24;
  for (DType dt : {DType::f32, DType::bf16})
    for (int64_t P : {1, 4})
      for (bool fp8 : {false, true}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " P " << P << " fp8 " << fp8);
        // Three sequences' page tables: a shuffle of the pages.
        std::vector<int64_t> perm(npages);
        for (int64_t i = 0; i < npages; ++i) perm[size_t(i)] = i;
        for (int64_t i = npages - 1; i > 0; --i)
          std::swap(perm[size_t(i)], perm[size_t(rng.next_u64() % uint64_t(i + 1))]);
        const std::vector<std::vector<int64_t>> tables = {{perm.begin(), perm.begin() + 10},
                                                          {perm.begin() + 10, perm.begin() + 13},
                                                          {perm.begin() + 13, perm.end()}};
        ops::CachedSelection cs;
        cs.page = page, cs.P = P, cs.K = 4 * P;
        for (const auto& t : tables) cs.pages.push_back(&t);
        const std::vector<std::pair<int64_t, int64_t>> queries = {
            {0, 79}, {1, 0}, {2, 50}, {0, 3}, {2, 87}, {1, 23}};  // (sequence, position)
        for (const auto& [n, p] : queries) {
          cs.seq_of.push_back(n);
          cs.pos.push_back(p);
          cs.ncand.push_back((p + 1) / P);
        }
        const int64_t T = int64_t(queries.size()), R = npages * page / P;
        const Tensor q = randn({T, H, D}, DType::f32, rng).to(dt);
        const Tensor k = randn({R, D}, DType::f32, rng).to(dt);
        const Tensor w = randn({T, H}, DType::f32, rng).to(dt);
        ops::IndexerScoreOptions opt;
        opt.pool = P;
        opt.fp8 = fp8;
        // The host list of each query's candidate rows.
        ops::dsa_detail::Pattern pat;
        pat.T = T, pat.W = 1;
        pat.row_ptr.push_back(0);
        for (int64_t t = 0; t < T; ++t) {
          const auto& pg = tables[size_t(cs.seq_of[size_t(t)])];
          for (int64_t j = 0; j < cs.ncand[size_t(t)]; ++j) {
            pat.slot.push_back(int32_t(j));
            pat.key.push_back((pg[size_t(j * P / page)] * page + j * P % page) / P);
            pat.query.push_back(t);
          }
          pat.row_ptr.push_back(pat.entries());
          pat.W = std::max(pat.W, cs.ncand[size_t(t)]);
        }
        // The CPU takes f32 / f64: bf16 inputs as their f32 values.
        const Tensor qc = q.to(dt == DType::bf16 ? DType::f32 : dt);
        const Tensor kc = k.to(dt == DType::bf16 ? DType::f32 : dt);
        const Tensor wc = w.to(dt == DType::bf16 ? DType::f32 : dt);
        const Tensor want = ops::indexer_scores_pattern(qc, kc, wc, pat, opt);
        EXPECT_TRUE(testing::bit_equal(ops::indexer_scores_cached(qc, kc, wc, cs, opt), want));
        const Tensor got_dev = ops::indexer_scores_cached(gpu(q), gpu(k), gpu(w), cs, opt);
        EXPECT_TRUE(testing::bit_equal(
            cpu(got_dev), cpu(ops::indexer_scores_pattern(gpu(q), gpu(k), gpu(w), pat, opt))));
        check("cached scores", got_dev, want);
      }
  // Refusals (on the host, before anything runs).
  const std::vector<int64_t> table = {0, 5};
  ops::CachedSelection cs;
  cs.page = 8, cs.P = 1, cs.K = 4, cs.pages = {&table}, cs.seq_of = {0}, cs.pos = {9},
  cs.ncand = {10};
  const Tensor q = Tensor::zeros({1, 2, 8}, DType::f32), w = Tensor::zeros({1, 2}, DType::f32);
  testing::expect_error(
      [&] {
        ops::indexer_scores_cached(q, Tensor::zeros({40, 8}, DType::f32), w, cs, {});
      },
      "holds key rows outside");
  cs.ncand = {9};
  testing::expect_error(
      [&] {
        ops::indexer_scores_cached(q, Tensor::zeros({48, 8}, DType::f32), w, cs, {});
      },
      "wrong candidate count");
}

// More heads than one 32-head tile (the 64-row tile of the explicit-rows kernels), one head (the
// dense dk kernel without head groups), and a head count that leaves partial row groups.
TEST(DsaIndexerGpu, HeadCounts) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Poison poison;
  Rng rng(testing::test_seed());
  run_score_case({{20, 45}, 1, 33, 24, DType::f32, true, false}, rng);
  run_score_case({{9, 40}, 1, 1, 16, DType::f64, true, false}, rng);
  run_score_case({{70}, 4, 5, 16, DType::f32, true, true}, rng);
}

// The FP8 emulation on the device quantises exactly as the CPU does: with one head, w = 1, no
// ReLU and unit scale, a score is the dot product of the dequantised rows, and with one-hot keys
// it is a single dequantised q value, which must match the CPU to the bit.
TEST(DsaIndexerGpu, Fp8DequantisedValuesAreBitExact) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  const int64_t D = 136, T = D;
  for (bool pow2 : {true, false}) {
    // q: a wide range of magnitudes, one tiny block (below the amax floor).
    std::vector<double> qv = randn({T, 1, D}, DType::f64, rng, 3.0).to_f64_vector();
    for (size_t i = 0; i < qv.size(); ++i) qv[i] *= std::pow(2.0, double(int64_t(i % 23) - 11));
    for (int64_t c = 0; c < 128; ++c) qv[size_t(5 * D + c)] *= 1e-9;
    const Tensor q = Tensor::from_values({T, 1, D}, qv, DType::f32);
    std::vector<double> kv(size_t(T * D), 0.0);
    for (int64_t s = 0; s < T; ++s) kv[size_t(s * D + s)] = 1.0;  // key s = e_s
    const Tensor k = Tensor::from_values({T, D}, kv, DType::f32);
    const Tensor w = Tensor::full({T, 1}, 1.0, DType::f32);
    ops::IndexerScoreOptions opt;
    opt.fp8 = true, opt.fp8_pow2 = pow2, opt.relu = false, opt.scale = 1.0;
    const SeqLayout seqs = SeqLayout::single(T);
    const Tensor ref = ops::indexer_scores(q, k, w, seqs, opt);
    const Tensor dev = ops::indexer_scores(gpu(q), gpu(k), gpu(w), seqs, opt);
    EXPECT_TRUE(testing::bit_equal(cpu(dev), ref)) << "pow2 " << pow2;
  }
}

TEST(DsaIndexerGpu, GlmShapesMatchCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  if (cuda_emulated()) GTEST_SKIP() << "the CUDA device is the CPU emulation: large shapes skipped";
  Rng rng(testing::test_seed());
  // GLM-5.3-Flash indexer heads: H_I = 32, d_I = 128.
  const int64_t H = 32, D = 128;
  for (int64_t P : {1, 4}) {
    const std::vector<int64_t> lens{700, 1348};
    // No ReLU in f32: among ~10^7 logits a few sit within rounding of 0, where the CPU and the GPU
    // may take different sides of the ReLU (an O(1) difference in a gradient entry).
    run_score_case({lens, P, H, D, DType::f32, false, false}, rng);
    run_score_case({lens, P, H, D, DType::bf16, true, true}, rng);
  }
}

// Timings at GLM-5.3-Flash indexer shapes (run with --gtest_also_run_disabled_tests): bf16 inputs,
// one document of T tokens, dense layout and explicit rows of 2048 / P keys per query.
TEST(DsaIndexerGpu, DISABLED_Timing) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  if (cuda_emulated()) GTEST_SKIP() << "the CUDA device is the CPU emulation: no timings";
  Rng rng(testing::test_seed());
  const int64_t H = 32, D = 128;
  auto time_ms = [](const auto& f) {
    f();
    device_synchronize();
    std::vector<double> ms;
    for (int i = 0; i < 3; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      f();
      device_synchronize();
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    return ms[1];
  };
  for (int64_t T : {8192}) {
    const SeqLayout seqs = SeqLayout::single(T);
    for (int64_t P : {1, 4}) {
      const int64_t nk = T / P;
      const Tensor q = gpu(randn({T, H, D}, DType::bf16, rng)),
                   k = gpu(randn({nk, D}, DType::bf16, rng));
      const Tensor w = gpu(randn({T, H}, DType::bf16, rng));
      ops::IndexerScoreOptions opt;
      opt.pool = P;
      Tensor sc;
      const double f = time_ms([&] { sc = ops::indexer_scores(q, k, w, seqs, opt); });
      const Tensor dsc = gpu(Tensor::full({T, sc.size(1)}, 1e-3, DType::f32));
      const double b =
          time_ms([&] { (void)ops::indexer_scores_backward(q, k, w, seqs, dsc, opt); });
      const double flop = 2.0 * double(T) * double(nk) / 2 * double(H) * double(D);
      std::printf(
          "dense bf16 T=%lld H=%lld D=%lld P=%lld: fwd %.2f ms (%.1f TFLOP/s), bwd %.2f ms\n",
          (long long)T, (long long)H, (long long)D, (long long)P, f, flop / f / 1e9, b);
      // Explicit rows: 2048 / P keys per query (the causal prefix when shorter).
      const int64_t K = std::min<int64_t>(2048 / P, nk);
      std::vector<int32_t> rv(size_t(T * K), -1);
      for (int64_t t = 0; t < T; ++t) {
        const int64_t n = (t + 1) / P;
        for (int64_t j = 0; j < std::min(K, n); ++j) rv[size_t(t * K + j)] = int32_t(n - 1 - j);
      }
      const Tensor rows = gpu(Tensor::from_vector<int32_t>({T, K}, rv));
      // The host side of the explicit-rows ops: reading and validating the rows, the pattern and
      // its upload (with the inverse map for backward).
      const double host = time_ms([&] {
        const ops::dsa_detail::Pattern p =
            ops::dsa_detail::rows_pattern(rows, seqs.offsets(), P, "timing", "rows");
        (void)ops::cuda::upload_pattern(p, true);
      });
      Tensor at;
      const double fa = time_ms([&] { at = ops::indexer_scores_at(q, k, w, seqs, rows, opt); });
      const Tensor dat = gpu(Tensor::full({T, K}, 1e-3, DType::f32));
      const double ba =
          time_ms([&] { (void)ops::indexer_scores_at_backward(q, k, w, seqs, rows, dat, opt); });
      std::printf(
          "rows  bf16 T=%lld K=%lld P=%lld: fwd %.2f ms, bwd %.2f ms (each with the host pattern "
          "and upload: %.2f ms)\n",
          (long long)T, (long long)K, (long long)P, fa, ba, host);
    }
  }
}

// ---- KPool compression ----
TEST(DsaKPoolGpu, CompressAndBackwardMatchCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Poison poison;
  Rng rng(testing::test_seed());
  const std::vector<std::vector<int64_t>> cases = {{1}, {63}, {65}, {1, 63, 65}, {4, 0, 9, 3}};
  struct Dt {
    DType x, ape;
  };
  for (const Dt dts : {Dt{DType::f32, DType::f32}, Dt{DType::f64, DType::f64},
                       Dt{DType::bf16, DType::bf16}, Dt{DType::bf16, DType::f32}})
    for (const auto& lens : cases)
      for (int64_t P : {1, 4, 5}) {
        const int64_t D = P == 4 ? 37 : 64;
        const SeqLayout seqs = SeqLayout::from_lengths(lens);
        const int64_t T = seqs.total_tokens();
        const int64_t NP = ops::dsa_detail::pool_offsets(seqs.offsets(), P).back();
        std::printf("kpool x=%s ape=%s T=%lld docs=%lld P=%lld D=%lld\n", dtype_name(dts.x),
                    dtype_name(dts.ape), (long long)T, (long long)lens.size(), (long long)P,
                    (long long)D);
        const Pair k = make({T, D}, dts.x, rng), gate = make({T, D}, dts.x, rng, 2.0);
        const Pair ape = make({P, D}, dts.ape, rng, 0.5), dp = make({NP, D}, dts.x, rng);
        const Tensor pk_ref = ops::kpool_compress(k.ref, gate.ref, ape.ref, seqs);
        const Tensor pk_dev = ops::kpool_compress(k.dev, gate.dev, ape.dev, seqs);
        check("pooled", pk_dev, pk_ref);
        const auto g_ref = ops::kpool_compress_backward(k.ref, gate.ref, ape.ref, seqs, dp.ref);
        const auto g_dev = ops::kpool_compress_backward(k.dev, gate.dev, ape.dev, seqs, dp.dev);
        EXPECT_EQ(g_dev.dape.dtype(), dts.ape);
        check("dk", g_dev.dk, g_ref.dk);
        check("dgate", g_dev.dgate, g_ref.dgate);
        check("dape", g_dev.dape, g_ref.dape);
        expect_same_bits("pooled", pk_dev, ops::kpool_compress(k.dev, gate.dev, ape.dev, seqs));
        const auto g2 = ops::kpool_compress_backward(k.dev, gate.dev, ape.dev, seqs, dp.dev);
        expect_same_bits("dk", g_dev.dk, g2.dk);
        expect_same_bits("dgate", g_dev.dgate, g2.dgate);
        expect_same_bits("dape", g_dev.dape, g2.dape);
      }
}

// ---- argument checks on CUDA ----

TEST(DsaIndexerGpu, BadArgumentsAreRefused) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  const SeqLayout seqs = SeqLayout::from_lengths({3, 5});
  const int64_t T = 8, H = 2, D = 8;
  const Tensor q = gpu(randn({T, H, D}, DType::bf16, rng)),
               k = gpu(randn({T, D}, DType::bf16, rng));
  const Tensor w = gpu(randn({T, H}, DType::bf16, rng));
  EXPECT_NO_THROW(ops::indexer_scores(q, k, w, seqs));
  testing::expect_error(
      [&] {
        ops::indexer_scores(q, gpu(randn({T, D}, DType::f32, rng)), w, seqs);
      },
      "indexer_scores: k (token keys [T, d_I]) must have the dtype of q");
  const Tensor q32 = gpu(randn({T, H, D}, DType::f32, rng)),
               w32 = gpu(randn({T, H}, DType::f32, rng));
  testing::expect_error(
      [&] {
        ops::indexer_scores(q32, randn({T, D}, DType::f32, rng), w32, seqs);
      },
      "indexer_scores: k (token keys [T, d_I]) must be on the device of q");
  testing::expect_error(
      [&] {
        ops::indexer_scores(q, k, gpu(randn({T, H + 1}, DType::bf16, rng)), seqs);
      },
      "indexer_scores: w must have shape");
  testing::expect_error(
      [&] {
        ops::indexer_scores(gpu(randn({T, H, D}, DType::f16, rng)), k, w, seqs);
      },
      "must be f32, f64 or bf16 on CUDA");
  // d_scores: the computation dtype (f32 for bf16 inputs), the dense width at least.
  const Tensor d_bf16 = gpu(randn({T, 5}, DType::bf16, rng));
  testing::expect_error([&] { ops::indexer_scores_backward(q, k, w, seqs, d_bf16); },
                        "indexer_scores_backward: d_scores must be f32");
  testing::expect_error(
      [&] {
        ops::indexer_scores_backward(q, k, w, seqs, gpu(randn({T, 4}, DType::f32, rng)));
      },
      "d_scores must have W >= 5");
  const Tensor rows = gpu(Tensor::from_vector<int64_t>({T, 1}, {0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_NO_THROW(ops::indexer_scores_at(q, k, w, seqs, rows));
  testing::expect_error(
      [&] {
        ops::indexer_scores_at(
            q, k, w, seqs, gpu(Tensor::from_vector<int64_t>({T - 1, 1}, {0, 1, 2, 3, 4, 5, 6})));
      },
      "rows must be [T = 8, W]");
  testing::expect_error(
      [&] {
        ops::indexer_scores_at_backward(q, k, w, seqs, rows, gpu(randn({T, 2}, DType::f32, rng)));
      },
      "d_scores must have shape");
  // The FP8 emulation refuses a non-finite input, as on the CPU.
  std::vector<double> bad = cpu(q).to_f64_vector();
  bad[size_t(3 * D + 5)] = INFINITY;
  ops::IndexerScoreOptions o8;
  o8.fp8 = true;
  testing::expect_error(
      [&] {
        ops::indexer_scores(gpu(Tensor::from_values({T, H, D}, bad, DType::bf16)), k, w, seqs, o8);
      },
      "fp8 emulation: q holds a non-finite value at row 3, channel 5");
  // KPool: ape in k's dtype or f32 next to bf16; gate and d_pooled in k's dtype.
  const Tensor gate = gpu(randn({T, D}, DType::bf16, rng));
  EXPECT_NO_THROW(ops::kpool_compress(k, gate, gpu(randn({2, D}, DType::f32, rng)), seqs));
  testing::expect_error(
      [&] {
        ops::kpool_compress(k, gate, gpu(randn({2, D}, DType::f64, rng)), seqs);
      },
      "kpool_compress: ape must have the dtype of k (bf16) or f32");
  testing::expect_error(
      [&] {
        ops::kpool_compress(k, gpu(randn({T, D}, DType::f32, rng)),
                            gpu(randn({2, D}, DType::f32, rng)), seqs);
      },
      "kpool_compress: gate must have the dtype of k");
  testing::expect_error(
      [&] {
        ops::kpool_compress_backward(k, gate, gpu(randn({2, D}, DType::bf16, rng)), seqs,
                                     gpu(randn({3, D}, DType::f32, rng)));
      },
      "kpool_compress_backward: d_pooled must have the dtype of k");
  // The CPU still takes f32 / f64 only.
  testing::expect_error([&] { ops::indexer_scores(cpu(q), cpu(k), cpu(w), seqs); },
                        "indexer_scores: q must be f32 or f64");
}

// The FP8 emulation with a non-finite flag: the values of the checking call for finite input, the
// flag set (not thrown) for a non-finite one, nothing read back; the CPU still throws.
TEST(DsaIndexerGpu, Fp8EmulationFlagsNonFiniteWithoutReadingBack) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  ops::IndexerScoreOptions o8;
  o8.fp8 = true;
  const Tensor x = randn({6, 2, 128}, DType::f32, rng);
  Tensor flag = gpu(Tensor::zeros({1}, DType::i32));
  reset_transfer_stats();
  const Tensor got = ops::indexer_fp8_emulate(gpu(x), o8, "test", "q", flag);
  EXPECT_EQ(transfer_stats().to_host, 0u);
  EXPECT_TRUE(testing::bit_equal(cpu(got), ops::indexer_fp8_emulate(x, o8, "test", "q")));
  EXPECT_EQ(cpu(flag).data<int32_t>()[0], 0);
  std::vector<double> v = x.to_f64_vector();
  v[300] = std::numeric_limits<double>::quiet_NaN();
  const Tensor bad = Tensor::from_values({6, 2, 128}, v, DType::f32);
  EXPECT_NO_THROW(ops::indexer_fp8_emulate(gpu(bad), o8, "test", "k", flag));
  EXPECT_EQ(cpu(flag).data<int32_t>()[0], 1);
  Tensor cpu_flag = Tensor::zeros({1}, DType::i32);
  testing::expect_error([&] { ops::indexer_fp8_emulate(bad, o8, "test", "k", cpu_flag); },
                        "fp8 emulation: k holds a non-finite value at row 2, channel 44");
  testing::expect_error([&] { ops::indexer_fp8_emulate(gpu(x), o8, "test", "q", cpu_flag); },
                        "the non-finite flag must be an i32 [1] tensor on x's device");
}

}  // namespace
}  // namespace hlm
