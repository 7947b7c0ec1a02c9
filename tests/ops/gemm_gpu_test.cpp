// cuBLAS GEMM (ops/gemm.h on CUDA tensors) against the CPU gemm on the same inputs: all four
// trans combinations, odd sizes, alpha / beta (accumulate), f32 (no TF32: max error / max |ref|
// <= 1e-6 scale), f64, round_bf16 with f32 / bf16 operands and f32 / bf16 / f64 C, strided and
// transposed views, a C that is not row-major, NaN-poisoned C under beta = 0, K = 0,
// bit-identical run to run, and the argument errors. The grouped GEMM (gemm_grouped) against the
// CPU's group-by-group gemm: f32, f64 and round_bf16 (f32 and bf16 operands), all four trans
// combinations, accumulation, groups of different sizes, k = 0 groups, blocks outside a tensor.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "core/rng.h"
#include "ops/gemm.h"
#include "ops/tensor_ops.h"
#include "testing.h"

namespace hlm {
namespace {

using testing::cpu;
using testing::gpu;

// max |out - ref| / max |ref| and ||out - ref|| / ||ref||, printed.
void check(const std::string& what, const Tensor& out_gpu, const Tensor& ref, double max_rel,
           double rel_l2) {
  const Tensor o = cpu(out_gpu).to(DType::f64);
  const Tensor r = ref.to(DType::f64);
  const testing::ErrorStats e = testing::compare(o, r);
  double mref = 0;
  for (double v : r.to_f64_vector()) mref = std::max(mref, std::fabs(v));
  const double mr = mref > 0 ? e.max_abs / mref : e.max_abs;
  std::printf("  %-44s max_err/max|ref| %.3e  rel_l2 %.3e\n", what.c_str(), mr, e.rel_l2);
  EXPECT_EQ(e.nan_mismatch, 0) << what;
  EXPECT_LE(mr, max_rel) << what << " " << e.report(r);
  EXPECT_LE(e.rel_l2, rel_l2) << what << " " << e.report(r);
}

struct Case {
  int64_t m, n, k;
};
const Case kCases[] = {{1, 1, 1},   {37, 53, 71}, {129, 65, 300},
                       {5, 300, 1}, {64, 1, 129}, {1, 77, 1000}};

// A stored as [M, K] (or [K, M] with trans_a); B as [K, N] (or [N, K]).
Shape a_shape(const Case& c, bool ta) {
  return ta ? Shape{c.k, c.m} : Shape{c.m, c.k};
}
Shape b_shape(const Case& c, bool tb) {
  return tb ? Shape{c.n, c.k} : Shape{c.k, c.n};
}

TEST(GemmGpu, F32AllTransAccumulate) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  for (const Case& c : kCases)
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (double beta : {0.0, 1.0, -0.5}) {
          const double alpha = beta == 0.0 ? 1.0 : 0.75;
          const Tensor a = randn(a_shape(c, ta), DType::f32, rng);
          const Tensor b = randn(b_shape(c, tb), DType::f32, rng);
          const Tensor c0 = randn({c.m, c.n}, DType::f32, rng);
          Tensor ref = c0.clone();
          ops::gemm(a, ta, b, tb, ref, alpha, beta);
          Tensor out =
              beta == 0.0 ? Tensor::full({c.m, c.n}, NAN, DType::f32).to(Device::cuda) : gpu(c0);
          ops::gemm(gpu(a), ta, gpu(b), tb, out, alpha, beta);
          const std::string what = fmt::format("f32 m{} n{} k{} ta{} tb{} beta {}", c.m, c.n, c.k,
                                               int(ta), int(tb), beta);
          check(what, out, ref, 1e-5, 2e-6);
          // Same bits run to run.
          Tensor out2 = beta == 0.0 ? Tensor::zeros({c.m, c.n}, DType::f32, Device::cuda) : gpu(c0);
          ops::gemm(gpu(a), ta, gpu(b), tb, out2, alpha, beta);
          EXPECT_TRUE(testing::bit_equal(cpu(out2), cpu(out))) << what;
        }
}

TEST(GemmGpu, F64AndMatmul) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  for (const Case& c : kCases)
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        const Tensor a = randn(a_shape(c, ta), DType::f64, rng);
        const Tensor b = randn(b_shape(c, tb), DType::f64, rng);
        const Tensor ref = ops::matmul(a, ta, b, tb);
        const Tensor out = ops::matmul(gpu(a), ta, gpu(b), tb);
        EXPECT_EQ(out.device(), Device::cuda);
        EXPECT_EQ(out.dtype(), DType::f64);
        check(fmt::format("f64 matmul m{} n{} k{} ta{} tb{}", c.m, c.n, c.k, int(ta), int(tb)), out,
              ref, 1e-13, 1e-14);
      }
}

TEST(GemmGpu, RoundBf16) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  const ops::GemmOptions bf{true};
  for (const Case& c : kCases)
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (DType op_dt : {DType::f32, DType::bf16})
          for (DType c_dt : {DType::f32, DType::bf16, DType::f64}) {
            const double beta = c_dt == DType::f32 ? 1.0 : 0.5, alpha = 1.25;
            const Tensor a = randn(a_shape(c, ta), DType::f32, rng).to(op_dt);
            const Tensor b = randn(b_shape(c, tb), DType::f32, rng).to(op_dt);
            const Tensor c0 = randn({c.m, c.n}, DType::f32, rng).to(c_dt);
            Tensor ref = c0.clone();
            ops::gemm(a, ta, b, tb, ref, alpha, beta, bf);
            Tensor out = gpu(c0);
            ops::gemm(gpu(a), ta, gpu(b), tb, out, alpha, beta, bf);
            EXPECT_EQ(out.dtype(), c_dt);
            const std::string what =
                fmt::format("bf16 ops {} C {} m{} n{} k{} ta{} tb{}", dtype_name(op_dt),
                            dtype_name(c_dt), c.m, c.n, c.k, int(ta), int(tb));
            // The operands are rounded identically; only the FP32 accumulation order differs
            // (and, for a bf16 C, the final rounding may land one bf16 step away).
            if (c_dt == DType::bf16)
              check(what, out, ref, 1.6e-2, 3e-3);
            else
              check(what, out, ref, 1e-5, 2e-6);
          }
}

TEST(GemmGpu, StridedViewsAndNonRowMajorC) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  const int64_t M = 45, N = 70, K = 33;
  // A as a column slice of a wider matrix (ld > K), B as a transpose view of [N, K] (column-major),
  // C as the transpose view of a [N, M] buffer (not row-major), and a fully strided A (every
  // other column: copied).
  const Tensor abig = randn({M, K + 9}, DType::f32, rng);
  const Tensor bnk = randn({N, K}, DType::f32, rng);
  const Tensor aodd = randn({M, 2 * K}, DType::f32, rng);
  const Tensor c0 = randn({N, M}, DType::f32, rng);
  for (int variant = 0; variant < 3; ++variant) {
    auto a_of = [&](const Tensor& big, const Tensor& odd) {
      if (variant == 2) return odd.view({M, K, 2}).select(2, 0);
      return big.slice(1, 2, 2 + K);
    };
    const Tensor a_c = a_of(abig, aodd);
    const Tensor b_c = bnk.transpose(0, 1);  // [K, N] column-major
    Tensor cbuf_c = c0.clone();
    Tensor cv_c = cbuf_c.transpose(0, 1);  // [M, N] column-major
    ops::gemm(a_c, false, b_c, false, cv_c, 1.0, variant == 1 ? 0.0 : 1.0);

    const Tensor abig_g = gpu(abig), aodd_g = gpu(aodd), bnk_g = gpu(bnk);
    const Tensor a_g = a_of(abig_g, aodd_g);
    const Tensor b_g = bnk_g.transpose(0, 1);
    Tensor cbuf_g = gpu(c0);
    Tensor cv_g = cbuf_g.transpose(0, 1);
    ops::gemm(a_g, false, b_g, false, cv_g, 1.0, variant == 1 ? 0.0 : 1.0);
    check(fmt::format("strided variant {}", variant), cbuf_g, cbuf_c, 1e-5, 2e-6);
  }
}

TEST(GemmGpu, ZeroKAndErrors) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  const Tensor a = gpu(Tensor::zeros({4, 0}, DType::f32));
  const Tensor b = gpu(Tensor::zeros({0, 5}, DType::f32));
  const Tensor c0 = randn({4, 5}, DType::f32, rng);
  Tensor c = gpu(c0);
  ops::gemm(a, false, b, false, c, 1.0, 0.5);
  Tensor ref = c0.clone();
  ops::gemm(Tensor::zeros({4, 0}, DType::f32), false, Tensor::zeros({0, 5}, DType::f32), false, ref,
            1.0, 0.5);
  EXPECT_TRUE(testing::bit_equal(cpu(c), ref));
  Tensor z = gpu(c0);
  ops::gemm(a, false, b, false, z, 1.0, 0.0);
  for (double v : cpu(z).to_f64_vector()) EXPECT_EQ(v, 0.0);

  const Tensor x = gpu(randn({4, 6}, DType::f32, rng));
  const Tensor y = gpu(randn({7, 5}, DType::f32, rng));
  Tensor out = Tensor::zeros({4, 5}, DType::f32, Device::cuda);
  EXPECT_THROW(ops::gemm(x, false, y, false, out), Error);       // K mismatch
  EXPECT_THROW(ops::gemm(x, false, cpu(y), false, out), Error);  // mixed devices
  const Tensor y6 = gpu(randn({6, 5}, DType::f32, rng));
  Tensor bad = Tensor::zeros({5, 4}, DType::f32, Device::cuda);
  EXPECT_THROW(ops::gemm(x, false, y6, false, bad), Error);  // C shape
  Tensor o64 = Tensor::zeros({4, 5}, DType::f64, Device::cuda);
  EXPECT_THROW(ops::gemm(x, false, y6, false, o64), Error);  // dtype mix
  EXPECT_THROW(ops::gemm(x.to(DType::f32), false,
                         gpu(randn({6, 5}, DType::f32, rng).to(DType::bf16)), false, out),
               Error);  // bf16 without round_bf16
  ops::gemm(x, false, y6, false, out);
  Tensor ref2 = Tensor::zeros({4, 5}, DType::f32);
  ops::gemm(cpu(x), false, cpu(y6), false, ref2);
  check("small after errors", out, ref2, 1e-5, 2e-6);
}

TEST(GemmGroupedGpu, MatchesCpuGroupByGroup) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed(), 41);
  // Experts of an MoE layer: rows per group 5, 0 (left out by the caller), 1, 33; n = 24, k = 40.
  const std::vector<int64_t> rows = {5, 1, 33};
  const int64_t N = 39, n = 24, k = 40, G = 3;
  for (DType dt : {DType::f32, DType::f64, DType::bf16})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        const bool round = dt == DType::bf16;
        const DType cdt = dt == DType::f64 ? DType::f64 : DType::f32;
        SCOPED_TRACE(std::string(dtype_name(dt)) + (ta ? " A^T" : "") + (tb ? " B^T" : ""));
        // A: the groups' [m, k] (or [k, m]) blocks back to back; B: one [k, n] block per group.
        const Tensor a = randn({N * k}, cdt, rng).to(dt), b = randn({G * k * n}, cdt, rng).to(dt);
        const Tensor c0 = randn({N * n}, cdt, rng);
        std::vector<ops::GemmGroup> groups;
        for (int64_t g = 0, off = 0; g < G; off += rows[size_t(g)], ++g)
          groups.push_back({rows[size_t(g)], n, k, off * k, g * k * n, off * n});
        for (double beta : {0.0, 1.0}) {
          Tensor cc = c0.clone(), cg = gpu(c0);
          ops::gemm_grouped(a, ta, b, tb, cc, groups, 1.5, beta, ops::GemmOptions{round});
          ops::gemm_grouped(gpu(a), ta, gpu(b), tb, cg, groups, 1.5, beta, ops::GemmOptions{round});
          check("grouped beta " + std::to_string(int(beta)), cg, cc,
                dt == DType::f64 ? 1e-13 : 1e-6, dt == DType::f64 ? 1e-14 : 1e-6);
          Tensor cg2 = gpu(c0);
          ops::gemm_grouped(gpu(a), ta, gpu(b), tb, cg2, groups, 1.5, beta,
                            ops::GemmOptions{round});
          EXPECT_TRUE(testing::bit_equal(cpu(cg), cpu(cg2)));
        }
        // Against one plain gemm per group on the device (the CPU side is built the same way).
        Tensor one = gpu(c0);
        for (const ops::GemmGroup& q : groups) {
          Tensor cq = one.view({N * n}).slice(0, q.c_off, q.c_off + q.m * q.n).view({q.m, q.n});
          const Tensor aq = gpu(a)
                                .slice(0, q.a_off, q.a_off + q.m * q.k)
                                .view(ta ? Shape{q.k, q.m} : Shape{q.m, q.k});
          const Tensor bq = gpu(b)
                                .slice(0, q.b_off, q.b_off + q.k * q.n)
                                .view(tb ? Shape{q.n, q.k} : Shape{q.k, q.n});
          ops::gemm(aq, ta, bq, tb, cq, 1.5, 0.0, ops::GemmOptions{round});
        }
        Tensor grouped = gpu(c0);
        ops::gemm_grouped(gpu(a), ta, gpu(b), tb, grouped, groups, 1.5, 0.0,
                          ops::GemmOptions{round});
        check("grouped vs per-group gemm", grouped, cpu(one), dt == DType::f64 ? 1e-13 : 1e-6,
              1e-6);
      }
}

// Groups whose blocks are rows of wider tensors (lda / ldc: a head's columns of [T, H, d]), on the
// CPU and the GPU, against one gemm per group on the strided views; the columns between the
// groups' blocks are left as they were.
TEST(GemmGroupedGpu, StridedRows) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed(), 7);
  const int64_t T = 5, H = 3, k = 6, kb = 8, n = 4, nb = 7;  // a [T, H, kb], c [T, H, nb]
  for (bool round : {false, true}) {
    const Tensor a = randn({T * H * kb}, DType::f32, rng), w = randn({H * n * k}, DType::f32, rng);
    const Tensor c0 = randn({T * H * nb}, DType::f32, rng);
    std::vector<ops::GemmGroup> groups;
    for (int64_t h = 0; h < H; ++h)
      groups.push_back({T, n, k, h * kb + 1, h * n * k, h * nb + 2, H * kb, 0, H * nb});
    Tensor want = c0.clone();
    for (const ops::GemmGroup& q : groups) {
      Tensor cq = want.as_strided({T, n}, {H * nb, 1}, q.c_off);
      ops::gemm(a.as_strided({T, k}, {H * kb, 1}, q.a_off), false,
                w.as_strided({n, k}, {k, 1}, q.b_off), true, cq, 1.0, 0.0, ops::GemmOptions{round});
    }
    Tensor on_cpu = c0.clone(), on_gpu = gpu(c0);
    ops::gemm_grouped(a, false, w, true, on_cpu, groups, 1.0, 0.0, ops::GemmOptions{round});
    // One shape at constant strides (the per-head pattern): one strided batched call.
    const ops::GemmGroupedCounts before = ops::gemm_grouped_counts();
    ops::gemm_grouped(gpu(a), false, gpu(w), true, on_gpu, groups, 1.0, 0.0,
                      ops::GemmOptions{round});
    EXPECT_EQ(ops::gemm_grouped_counts().strided, before.strided + 1);
    EXPECT_TRUE(testing::bit_equal(on_cpu, want)) << "round " << round;
    check("strided groups", on_gpu, want, 1e-6, 1e-6);
    // The heads in another order: not constant strides, a grouped call; the same products.
    std::vector<ops::GemmGroup> shuffled = {groups[1], groups[0], groups[2]};
    Tensor on_gpu2 = gpu(c0);
    const ops::GemmGroupedCounts before2 = ops::gemm_grouped_counts();
    ops::gemm_grouped(gpu(a), false, gpu(w), true, on_gpu2, shuffled, 1.0, 0.0,
                      ops::GemmOptions{round});
    EXPECT_EQ(ops::gemm_grouped_counts().strided, before2.strided);
    check("strided groups, shuffled", on_gpu2, want, 1e-6, 1e-6);
    // Outside the blocks: c0's values, on both.
    const std::vector<double> g = cpu(on_gpu).to_f64_vector(), c = c0.to_f64_vector();
    for (int64_t i = 0; i < T * H * nb; ++i) {
      const int64_t col = i % nb;
      if (col < 2 || col >= 2 + n) EXPECT_EQ(g[size_t(i)], c[size_t(i)]) << i;
    }
  }
}

// Several products of one A (gemm_multi): on the GPU one grouped call, each product equal to its
// own gemm within rounding (round_bf16 into f32 and into bf16 outputs, and f32; outputs as
// column slices of a wider tensor); on the CPU the bits of the separate gemms.
TEST(GemmMultiGpu, MatchesSeparateGemms) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed(), 9);
  const int64_t m = 3, k = 40;
  const std::vector<int64_t> ns = {16, 7, 33};
  for (int mode = 0; mode < 3; ++mode) {
    const bool round = mode > 0;
    const DType cd = mode == 2 ? DType::bf16 : DType::f32;
    const Tensor a = randn({m, k}, DType::f32, rng);
    std::vector<Tensor> b, want, on_cpu;
    Tensor wide = Tensor::zeros({m, 100}, cd, Device::cuda);
    std::vector<Tensor> on_gpu;
    int64_t off = 0;
    for (int64_t n : ns) {
      b.push_back(randn({n, k}, DType::f32, rng));
      want.push_back(Tensor::empty({m, n}, cd));
      ops::gemm(a, false, b.back(), true, want.back(), 1.0, 0.0, ops::GemmOptions{round});
      on_cpu.push_back(Tensor::empty({m, n}, cd));
      on_gpu.push_back(wide.slice(1, off, off + n));
      off += n + 2;
    }
    ops::gemm_multi(a, false, b, true, on_cpu, ops::GemmOptions{round});
    std::vector<Tensor> bg;
    for (const Tensor& t : b) bg.push_back(gpu(round ? t.to(DType::bf16) : t));
    const ops::GemmGroupedCounts before = ops::gemm_grouped_counts();
    ops::gemm_multi(gpu(a), false, bg, true, on_gpu, ops::GemmOptions{round});
    EXPECT_EQ(ops::gemm_grouped_counts().calls, before.calls + 1);
    for (size_t i = 0; i < ns.size(); ++i) {
      EXPECT_TRUE(testing::bit_equal(on_cpu[i], want[i])) << "mode " << mode << " product " << i;
      check("gemm_multi product", ops::contiguous(on_gpu[i]), want[i],
            cd == DType::bf16 ? 8e-3 : 1e-6, cd == DType::bf16 ? 4e-3 : 1e-6);
    }
    // The columns between the products stay zero.
    const std::vector<double> w = cpu(wide).to_f64_vector();
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c : {16, 17, 25, 26}) EXPECT_EQ(w[size_t(r * 100 + c)], 0.0) << r << "," << c;
  }
  // Bad input: B for a different k, no products.
  const Tensor a = gpu(randn({2, 8}, DType::f32, rng));
  std::vector<Tensor> c1 = {Tensor::empty({2, 4}, DType::f32, Device::cuda)};
  EXPECT_THROW(ops::gemm_multi(a, false, {gpu(randn({4, 9}, DType::f32, rng))}, true, c1), Error);
  std::vector<Tensor> c2 = {Tensor::empty({2, 4}, DType::f32, Device::cuda)};
  EXPECT_THROW(ops::gemm_multi(a, false, {}, true, c2), Error);
}

TEST(GemmGroupedGpu, ZeroKAndErrors) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed(), 42);
  const Tensor a = gpu(randn({20}, DType::f32, rng)), b = gpu(randn({20}, DType::f32, rng));
  const Tensor c0 = randn({12}, DType::f32, rng);
  // k = 0: C = beta C.
  Tensor c = gpu(c0);
  ops::gemm_grouped(a, false, b, false, c, {{3, 4, 0, 0, 0, 0}}, 1.0, 0.5);
  const std::vector<double> got = cpu(c).to_f64_vector(), want = c0.to_f64_vector();
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i], float(0.5 * want[i])) << i;
  // The counts: one per launch (the k = 0 group above launched nothing).
  const ops::GemmGroupedCounts before = ops::gemm_grouped_counts();
  ops::gemm_grouped(a, false, b, false, c, {{3, 4, 1, 0, 0, 0}});
  const ops::GemmGroupedCounts after = ops::gemm_grouped_counts();
  EXPECT_EQ(after.calls, before.calls + 1);
  EXPECT_LE(after.per_group_loops - before.per_group_loops, 1);
  testing::expect_error(
      [&] {
        ops::gemm_grouped(a, false, b, false, c, {{3, 4, 5, 10, 0, 0}});
      },
      "group 0's block of A (3 x 5 from 10, rows 5 apart) is outside");
  testing::expect_error(
      [&] {
        ops::gemm_grouped(a, false, b, false, c, {{3, 4, 5, 0, 0, 0, 2, 0, 0}});
      },
      "group 0's A rows are 2 apart, shorter than 5");
  testing::expect_error(
      [&] {
        ops::gemm_grouped(a, false, b, false, c, {{0, 4, 1, 0, 0, 0}});
      },
      "group 0 has [m, n, k] = [0, 4, 1]");
  Tensor c64 = gpu(c0.to(DType::f64));
  testing::expect_error(
      [&] {
        ops::gemm_grouped(a, false, b, false, c64, {{3, 4, 1, 0, 0, 0}});
      },
      "gemm_grouped: A must");
  testing::expect_error(
      [&] {
        ops::gemm_grouped(a, false, b, false, c64, {{3, 4, 1, 0, 0, 0}}, 1, 0, {true});
      },
      "C must be f32");
  testing::expect_error(
      [&] {
        ops::gemm_grouped(cpu(a), false, b, false, c, {{3, 4, 1, 0, 0, 0}});
      },
      "must be on the device of A");
}

}  // namespace
}  // namespace hlm
