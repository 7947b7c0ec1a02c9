// ops::gemm / ops::matmul against a naive FP64 triple loop: all transpose combinations, f32 and
// f64, odd sizes, strided and transposed views, alpha / beta, the bf16 rounding option, bad input.
#include <cmath>
#include <limits>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "ops/gemm.h"
#include "testing.h"

namespace hlm {
namespace {

using testing::close;
using testing::test_seed;
using testing::tolerance_for;

// ref = alpha * op(A) op(B) + beta * C0 in FP64, elementwise from the views (any strides).
Tensor gemm_ref(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& c0, double alpha,
                double beta, bool round_bf16 = false) {
  Tensor a64 = (round_bf16 ? a.to(DType::bf16) : a).to(DType::f64);
  Tensor b64 = (round_bf16 ? b.to(DType::bf16) : b).to(DType::f64);
  const int64_t m = ta ? a.size(1) : a.size(0), k = ta ? a.size(0) : a.size(1);
  const int64_t n = tb ? b.size(0) : b.size(1);
  const auto va = a64.to_f64_vector(), vb = b64.to_f64_vector(), vc = c0.to_f64_vector();
  std::vector<double> out(size_t(m * n));
  const int64_t lda = a.size(1), ldb = b.size(1);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double x = ta ? va[size_t(p * lda + i)] : va[size_t(i * lda + p)];
        const double y = tb ? vb[size_t(j * ldb + p)] : vb[size_t(p * ldb + j)];
        s += x * y;
      }
      out[size_t(i * n + j)] = alpha * s + (beta != 0 ? beta * vc[size_t(i * n + j)] : 0.0);
    }
  return Tensor::from_values({m, n}, out, DType::f64);
}

Tensor operand(int64_t rows, int64_t cols, bool trans, DType dt, Rng& rng) {
  return trans ? randn({cols, rows}, dt, rng) : randn({rows, cols}, dt, rng);
}

// Runs the enclosing test body once per backend and restores the default afterwards.
struct BackendScope {
  ops::GemmBackend saved = ops::gemm_backend();
  explicit BackendScope(ops::GemmBackend b) { ops::set_gemm_backend(b); }
  ~BackendScope() { ops::set_gemm_backend(saved); }
};

TEST(OpsGemm, AllTransposeCombosOddSizes) {
  for (ops::GemmBackend backend : {ops::GemmBackend::invariant, ops::GemmBackend::blas}) {
    SCOPED_TRACE(ops::gemm_backend_name(backend));
    BackendScope scope(backend);
    Rng rng(test_seed());
    const int64_t sizes[][3] = {{1, 1, 1}, {7, 5, 3}, {33, 17, 65}, {64, 1, 9}, {1, 63, 130}};
    for (DType dt : {DType::f32, DType::f64})
      for (auto& s : sizes)
        for (int ta = 0; ta < 2; ++ta)
          for (int tb = 0; tb < 2; ++tb) {
            const int64_t m = s[0], n = s[1], k = s[2];
            Tensor a = operand(m, k, ta, dt, rng), b = operand(k, n, tb, dt, rng);
            Tensor c = randn({m, n}, dt, rng);
            Tensor ref = gemm_ref(a, ta, b, tb, c, 0.75, -1.25);
            ops::gemm(a, ta, b, tb, c, 0.75, -1.25);
            EXPECT_TRUE(close(c, ref, tolerance_for(dt)))
                << dtype_name(dt) << " m=" << m << " n=" << n << " k=" << k << " ta=" << ta
                << " tb=" << tb;
          }
  }
}

TEST(OpsGemm, MatmulShapeAndDtype) {
  Rng rng(test_seed());
  for (DType dt : {DType::f32, DType::f64}) {
    Tensor a = randn({9, 5}, dt, rng), b = randn({11, 9}, dt, rng);
    Tensor c = ops::matmul(a, true, b, true);  // [5, 9] x [9, 11]
    ASSERT_EQ(c.shape(), (Shape{5, 11}));
    EXPECT_EQ(c.dtype(), dt);
    EXPECT_TRUE(
        close(c, gemm_ref(a, true, b, true, Tensor::zeros({5, 11}, dt), 1, 0), tolerance_for(dt)));
  }
}

TEST(OpsGemm, StridedAndTransposedViews) {
  Rng rng(test_seed());
  for (DType dt : {DType::f32, DType::f64}) {
    // A: a column slice of a wider matrix (row stride 20 > 6 columns).
    Tensor abig = randn({13, 20}, dt, rng);
    Tensor a = abig.slice(1, 3, 9);  // [13, 6]
    // B: a transposed view of a contiguous [7, 6] matrix -> [6, 7], column-major.
    Tensor bbase = randn({7, 6}, dt, rng);
    Tensor b = bbase.transpose(0, 1);
    // B2: last dimension not contiguous at all (stride 2): must be copied internally.
    Tensor b3 = randn({6, 7, 2}, dt, rng);
    Tensor b2 = b3.select(2, 1);  // [6, 7], strides [14, 2]
    // C: a row/column window of a bigger matrix, and a transposed C.
    Tensor cbig = randn({20, 30}, dt, rng);
    Tensor c = cbig.slice(0, 2, 15).slice(1, 5, 12);  // [13, 7]
    Tensor cbig_before = cbig.clone();
    for (const Tensor* bb : {&b, &b2}) {
      cbig.copy_(cbig_before);
      Tensor ref = gemm_ref(a, false, *bb, false, c, 1.5, 0.5);
      ops::gemm(a, false, *bb, false, c, 1.5, 0.5);
      EXPECT_TRUE(close(c, ref, tolerance_for(dt))) << dtype_name(dt);
      // Elements of cbig outside the window are untouched.
      auto before = cbig_before.to_f64_vector(), after = cbig.to_f64_vector();
      for (int64_t i = 0; i < 20; ++i)
        for (int64_t j = 0; j < 30; ++j)
          if (!(i >= 2 && i < 15 && j >= 5 && j < 12))
            ASSERT_EQ(before[size_t(i * 30 + j)], after[size_t(i * 30 + j)]);
    }
    // Transposed C (column-major output).
    Tensor ct_base = randn({7, 13}, dt, rng);
    Tensor ct = ct_base.transpose(0, 1);  // [13, 7]
    Tensor ref = gemm_ref(a, false, b, false, ct, 1.0, 1.0);
    ops::gemm(a, false, b, false, ct, 1.0, 1.0);
    EXPECT_TRUE(close(ct, ref, tolerance_for(dt)));
    // Transposed view of A combined with trans_a (A^T^T = A).
    Tensor at = a.contiguous().transpose(0, 1);  // [6, 13], column-major
    Tensor c2 = Tensor::empty({13, 7}, dt);
    ops::gemm(at, true, b, false, c2);
    EXPECT_TRUE(close(c2, gemm_ref(a, false, b, false, c2, 1, 0), tolerance_for(dt)));
  }
}

TEST(OpsGemm, BetaZeroIgnoresNanPoisonAndKZero) {
  Rng rng(test_seed());
  Tensor a = randn({5, 4}, DType::f32, rng), b = randn({4, 3}, DType::f32, rng);
  Tensor c = Tensor::full({5, 3}, std::numeric_limits<double>::quiet_NaN(), DType::f32);
  ops::gemm(a, false, b, false, c, 2.0, 0.0);
  EXPECT_TRUE(close(c, gemm_ref(a, false, b, false, c, 2.0, 0.0), tolerance_for(DType::f32)));
  // K = 0: C = beta * C, and C = 0 for beta = 0 even over a NaN poison.
  Tensor a0 = Tensor::empty({5, 0}, DType::f64), b0 = Tensor::empty({0, 3}, DType::f64);
  Tensor c0 = randn({5, 3}, DType::f64, rng);
  Tensor expect = c0.clone();
  {
    double* p = expect.data<double>();
    for (int i = 0; i < 15; ++i) p[i] *= -3.0;
  }
  ops::gemm(a0, false, b0, false, c0, 1.0, -3.0);
  EXPECT_TRUE(close(c0, expect, tolerance_for(DType::f64)));
  c0.fill_(std::numeric_limits<double>::quiet_NaN());
  ops::gemm(a0, false, b0, false, c0, 1.0, 0.0);
  EXPECT_TRUE(close(c0, Tensor::zeros({5, 3}, DType::f64), tolerance_for(DType::f64)));
}

TEST(OpsGemm, RoundBf16) {
  Rng rng(test_seed());
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      const int64_t m = 19, n = 23, k = 77;
      Tensor a = operand(m, k, ta, DType::f32, rng), b = operand(k, n, tb, DType::f32, rng);
      Tensor c = randn({m, n}, DType::f32, rng);
      Tensor c_plain = c.clone();
      Tensor ref = gemm_ref(a, ta, b, tb, c, 0.5, 2.0, /*round_bf16=*/true);
      ops::gemm(a, ta, b, tb, c, 0.5, 2.0, {.round_bf16 = true});
      // Exact bf16 products, FP32 accumulation: f32 tolerance against the rounded-operand FP64 ref.
      EXPECT_TRUE(close(c, ref, tolerance_for(DType::f32)));
      // And clearly not the unrounded result.
      ops::gemm(a, ta, b, tb, c_plain, 0.5, 2.0);
      EXPECT_GT(testing::compare(c, c_plain).max_abs, 1e-4);
    }
  // f64 output and f64 operands with rounding.
  Tensor a = randn({6, 10}, DType::f64, rng), b = randn({10, 4}, DType::f64, rng);
  Tensor c = randn({6, 4}, DType::f64, rng);
  Tensor ref = gemm_ref(a, false, b, false, c, 1.0, 1.0, true);
  ops::gemm(a, false, b, false, c, 1.0, 1.0, {.round_bf16 = true});
  EXPECT_TRUE(close(c, ref, tolerance_for(DType::f32)));
  // matmul of bf16 tensors returns bf16.
  Tensor a16 = a.to(DType::bf16), b16 = b.to(DType::bf16);
  Tensor c16 = ops::matmul(a16, false, b16, false, {.round_bf16 = true});
  EXPECT_EQ(c16.dtype(), DType::bf16);
  EXPECT_TRUE(
      close(c16, gemm_ref(a, false, b, false, c16, 1, 0, true), tolerance_for(DType::bf16)));
}

TEST(OpsGemm, Deterministic) {
  Rng rng(test_seed());
  Tensor a = randn({130, 257}, DType::f32, rng), b = randn({257, 99}, DType::f32, rng);
  Tensor c1 = ops::matmul(a, false, b, false), c2 = ops::matmul(a, false, b, false);
  EXPECT_TRUE(testing::bit_equal(c1, c2));
}

// The invariant backend's contract: each element is the sequential sum over k (bit-equal to a
// naive float loop), so rows do not depend on how many rows the product has or on the threads.
TEST(OpsGemm, InvariantBackendIsBatchAndThreadInvariant) {
  BackendScope scope(ops::GemmBackend::invariant);
  Rng rng(test_seed());
  const int64_t m = 130, k = 300, n = 77;
  for (int tb = 0; tb < 2; ++tb) {
    Tensor a = randn({m, k}, DType::f32, rng), b = operand(k, n, tb, DType::f32, rng);
    Tensor full = ops::matmul(a, false, b, tb);
    // The same rows computed as separate, smaller products (a packed batch split in sequences).
    int64_t row = 0;
    for (int64_t len : {70, 1, 3, 56}) {
      Tensor part = ops::matmul(a.slice(0, row, row + len), false, b, tb);
      EXPECT_TRUE(testing::bit_equal(part, full.slice(0, row, row + len).contiguous()))
          << "rows " << row << ".." << row + len;
      row += len;
    }
    ASSERT_EQ(row, m);
    // The sequential sum, element by element.
    const float* pa = a.data<float>();
    const Tensor bc = b.contiguous();
    const float* pb = bc.data<float>();
    const float* pc = full.data<float>();
    int64_t mismatches = 0;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        float s = 0;
        for (int64_t p = 0; p < k; ++p) s += pa[i * k + p] * (tb ? pb[j * k + p] : pb[p * n + j]);
        mismatches += s != pc[i * n + j];
      }
    EXPECT_EQ(mismatches, 0);
#ifdef _OPENMP
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    Tensor one = ops::matmul(a, false, b, tb);
    omp_set_num_threads(3);
    Tensor three = ops::matmul(a, false, b, tb);
    omp_set_num_threads(threads);
    EXPECT_TRUE(testing::bit_equal(one, full));
    EXPECT_TRUE(testing::bit_equal(three, full));
#endif
  }
}

TEST(OpsGemm, BadInputs) {
  Rng rng(test_seed());
  Tensor a = randn({4, 5}, DType::f32, rng), b = randn({6, 3}, DType::f32, rng);
  Tensor c = Tensor::empty({4, 3}, DType::f32);
  EXPECT_THROW(ops::gemm(a, false, b, false, c), Error);  // K 5 vs 6
  Tensor b5 = randn({5, 3}, DType::f32, rng);
  Tensor cbad = Tensor::empty({3, 4}, DType::f32);
  EXPECT_THROW(ops::gemm(a, false, b5, false, cbad), Error);  // C shape
  Tensor b64 = randn({5, 3}, DType::f64, rng);
  EXPECT_THROW(ops::gemm(a, false, b64, false, c), Error);  // dtype mismatch
  Tensor v = randn({5}, DType::f32, rng);
  EXPECT_THROW(ops::matmul(a, false, v, false), Error);  // 1-D
  Tensor ai = Tensor::zeros({4, 5}, DType::i32), bi = Tensor::zeros({5, 3}, DType::i32);
  Tensor ci = Tensor::zeros({4, 3}, DType::i32);
  EXPECT_THROW(ops::gemm(ai, false, bi, false, ci), Error);  // integer dtype
  EXPECT_THROW(ops::gemm(ai, false, bi, false, ci, 1, 0, {.round_bf16 = true}), Error);
  try {
    ops::gemm(a, false, b, false, c);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("inner dimensions"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace hlm
