// Linear (layers/linear.h): native and bf16 against an FP64 matmul, gradients against central
// finite differences (native f64), and the fp8_block path bit for bit against a slow FP64
// emulation of the contract written here (docs/fp8.md): its own quantizer (FP64 amax, grid
// rounding), zero padding to multiples of 128, FP32 block partial sums and promotion, each FP32
// step emulated as one correctly rounded operation on exact FP64 values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/rng.h"
#include "layers/linear.h"
#include "testing.h"

namespace hlm {
namespace {

using Mat = std::vector<double>;  // row-major

Mat values(const Tensor& t) {
  return t.to_f64_vector();
}

// y[T, N] = x[T, K] W[N, K]^T in FP64 (operands optionally rounded to bf16 first).
Mat ref_linear(const Mat& x, const Mat& w, int64_t T, int64_t K, int64_t N, bool bf16) {
  Mat y(size_t(T * N), 0.0);
  auto r = [&](double v) { return bf16 ? double(round_bf16(float(v))) : v; };
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += r(x[size_t(t * K + k)]) * r(w[size_t(n * K + k)]);
      y[size_t(t * N + n)] = s;
    }
  return y;
}

Tensor from_mat(const Mat& m, const Shape& s, DType dt) {
  return Tensor::from_values(s, m, dt);
}

void init_linear(Linear& l, Rng& rng, double std = 0.5) {
  rng.fill_normal(l.weight().value, 0.0, std);
  if (l.bias()) rng.fill_normal(l.bias()->value, 0.0, std);
}

TEST(LinearNative, ForwardMatchesFp64) {
  Rng rng(testing::test_seed());
  for (DType dt : {DType::f64, DType::f32}) {
    const int64_t T = 9, K = 33, N = 17;
    Linear l(K, N, true, GemmPrecision{GemmKind::native}, dt);
    init_linear(l, rng);
    const Tensor x = randn({T, K}, dt, rng);
    const Tensor y = l.forward(Context{}, x, nullptr);
    ASSERT_EQ(y.dtype(), dt);
    Mat ref = ref_linear(values(x), values(l.weight().value), T, K, N, false);
    const Mat b = values(l.bias()->value);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < N; ++n) ref[size_t(t * N + n)] += b[size_t(n)];
    EXPECT_TRUE(testing::close(y, from_mat(ref, {T, N}, DType::f64), testing::tolerance_for(dt)));
  }
}

TEST(LinearBf16, ForwardAndBackwardMatchFp64OfBf16Operands) {
  Rng rng(testing::test_seed());
  const int64_t T = 12, K = 70, N = 21;
  Linear l(K, N, false, GemmPrecision{GemmKind::bf16}, DType::f32);
  init_linear(l, rng);
  const Tensor x = randn({T, K}, DType::f32, rng);
  Linear::Saved s;
  const Tensor y = l.forward(Context{}, x, &s);
  const Mat ref = ref_linear(values(x), values(l.weight().value), T, K, N, true);
  const testing::Tolerance tol{1e-6, 1e-5};  // FP32 accumulation of exact bf16 products
  EXPECT_TRUE(testing::close(y, from_mat(ref, {T, N}, DType::f64), tol));
  // and it differs from the exact product by bf16 rounding: the operands really were rounded
  const Mat exact = ref_linear(values(x), values(l.weight().value), T, K, N, false);
  EXPECT_FALSE(testing::close(y, from_mat(exact, {T, N}, DType::f64), tol));

  const Tensor dy = randn({T, N}, DType::f32, rng);
  l.zero_grad();
  const Tensor dx = l.backward(Context{}, dy, s);
  // dx = dy W: [T, N] x [N, K]; as ref_linear with W^T
  const Mat w = values(l.weight().value), dyv = values(dy), xv = values(x);
  Mat wt(size_t(K * N));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) wt[size_t(k * N + n)] = w[size_t(n * K + k)];
  EXPECT_TRUE(
      testing::close(dx, from_mat(ref_linear(dyv, wt, T, N, K, true), {T, K}, DType::f64), tol));
  Mat dyt(size_t(N * T)), xt(size_t(K * T));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t n = 0; n < N; ++n) dyt[size_t(n * T + t)] = dyv[size_t(t * N + n)];
    for (int64_t k = 0; k < K; ++k) xt[size_t(k * T + t)] = xv[size_t(t * K + k)];
  }
  EXPECT_TRUE(testing::close(
      l.weight().grad, from_mat(ref_linear(dyt, xt, N, T, K, true), {N, K}, DType::f64), tol));
}

// forward_into: forward's values written into a view; under a bf16 GEMM with x given in bf16 (the
// rounding forward applies) and out in f32 or bf16, directly, the same bits as forward's output
// (converted to out's dtype).
TEST(Linear, ForwardIntoEqualsForward) {
  Rng rng(testing::test_seed());
  const int64_t T = 5, K = 40, N = 13;
  for (bool bias : {false, true})
    for (GemmKind kind : {GemmKind::bf16, GemmKind::native}) {
      Linear l(K, N, bias, GemmPrecision{kind}, DType::f32);
      init_linear(l, rng);
      const Tensor x = randn({T, K}, DType::f32, rng);
      const Tensor y = l.forward(Context{false, false}, x, nullptr);
      for (DType xdt : {DType::f32, DType::bf16})
        for (DType odt : {DType::f32, DType::bf16}) {
          if (kind == GemmKind::native && xdt == DType::bf16) continue;
          EXPECT_EQ(l.writes_directly(xdt, odt),
                    !bias && (kind == GemmKind::bf16 || (xdt == DType::f32 && odt == DType::f32)));
          Tensor wide = Tensor::full({T, N + 7}, 3.0, odt);
          Tensor out = wide.slice(1, 4, 4 + N);
          l.forward_into(x.to(xdt), out);
          EXPECT_TRUE(testing::bit_equal(out.contiguous(), y.to(odt)))
              << "bias " << bias << " x " << dtype_name(xdt) << " out " << dtype_name(odt);
          EXPECT_EQ(wide.slice(1, 0, 4).to_f64_vector(), std::vector<double>(size_t(T * 4), 3.0));
          EXPECT_EQ(wide.slice(1, 4 + N, N + 7).to_f64_vector(),
                    std::vector<double>(size_t(T * 3), 3.0));
        }
      Tensor bad = Tensor::empty({T, N + 1}, DType::f32);
      EXPECT_THROW(l.forward_into(x, bad), Error);
    }
}

TEST(LinearNative, GradientsMatchFiniteDifferences) {
  Rng rng(testing::test_seed());
  const int64_t T = 5, K = 7, N = 4;
  Linear l(K, N, true, GemmPrecision{GemmKind::native}, DType::f64);
  init_linear(l, rng);
  Tensor x = randn({T, K}, DType::f64, rng);
  const Tensor probe = randn({T, N}, DType::f64, rng);
  auto loss = [&] { return testing::dot(l.forward(Context{}, x, nullptr), probe); };
  Linear::Saved s;
  l.forward(Context{}, x, &s);
  l.zero_grad();
  const Tensor dx = l.backward(Context{}, probe, s);
  EXPECT_TRUE(testing::grad_check(loss, x, dx));
  const Tensor gw = l.weight().grad.clone(), gb = l.bias()->grad.clone();
  EXPECT_TRUE(testing::grad_check(loss, l.weight().value, gw));
  EXPECT_TRUE(testing::grad_check(loss, l.bias()->value, gb));
  // parameter gradients accumulate
  l.backward(Context{}, probe, s);
  const auto g1 = gw.to_f64_vector(), g2 = l.weight().grad.to_f64_vector();
  for (size_t i = 0; i < g1.size(); ++i) EXPECT_DOUBLE_EQ(g2[i], 2 * g1[i]);
}

// ---- the fp8 emulation --------------------------------------------------------------------------

const std::vector<double>& grid(Fp8Format f) {
  static const std::vector<double> g4 = [] {
    std::vector<double> v;
    for (int c = 0; c < 127; ++c) {
      const int e = c >> 3, m = c & 7;
      v.push_back(e == 0 ? m * std::ldexp(1.0, -9) : (8 + m) * std::ldexp(1.0, e - 10));
    }
    return v;
  }();
  static const std::vector<double> g5 = [] {
    std::vector<double> v;
    for (int c = 0; c < 124; ++c) {
      const int e = c >> 2, m = c & 3;
      v.push_back(e == 0 ? m * std::ldexp(1.0, -16) : (4 + m) * std::ldexp(1.0, e - 17));
    }
    return v;
  }();
  return f == Fp8Format::e4m3 ? g4 : g5;
}

// Nearest grid value, ties to the even code, saturating: the fp8 VALUE (as a double).
double q_value(double x, Fp8Format f) {
  const auto& v = grid(f);
  const double a = std::min(std::fabs(x), v.back());
  size_t hi = size_t(std::lower_bound(v.begin(), v.end(), a) - v.begin());
  double r;
  if (v[hi] == a) {
    r = a;
  } else {
    const size_t lo = hi - 1;
    const double dl = a - v[lo], dh = v[hi] - a;
    r = v[dl < dh ? lo : dh < dl ? hi : (lo % 2 == 0 ? lo : hi)];
  }
  return std::signbit(x) ? -r : r;
}

double f32(double v) {
  return double(float(v));
}  // one FP32 rounding

// A quantized [R, C] matrix (C padded to 128): fp8 values and one scale per element's tile.
struct QMat {
  int64_t R, C;
  Mat v;                  // fp8 values
  std::vector<double> s;  // scale_inv per element (of its tile), FP32 values
};
QMat ref_quant(const Mat& x, int64_t R, int64_t C, bool block128, Fp8Format f, bool pow2) {
  const int64_t Cp = (C + 127) / 128 * 128;
  QMat q{R, Cp, Mat(size_t(R * Cp), 0.0), std::vector<double>(size_t(R * Cp), 0.0)};
  const int64_t th = block128 ? 128 : 1;
  const double mx = f == Fp8Format::e4m3 ? 448.0 : 57344.0;
  for (int64_t r0 = 0; r0 < R; r0 += th)
    for (int64_t c0 = 0; c0 < Cp; c0 += 128) {
      const int64_t r1 = std::min(R, r0 + th), c1 = std::min(C, c0 + 128);
      double amax = 0;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c)
          amax = std::max(amax, std::fabs(f32(x[size_t(r * C + c)])));
      double s = f32(std::max(amax, double(1e-12f)) / mx);
      if (pow2) s = std::exp2(std::ceil(std::log2(s)));
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c0 + 128; ++c) {
          const double xv = c < C ? f32(x[size_t(r * C + c)]) : 0.0;
          q.v[size_t(r * Cp + c)] = q_value(f32(xv / s), f);
          q.s[size_t(r * Cp + c)] = s;
        }
    }
  return q;
}

// C[M, N] = A B^T, both [*, K] quantized along K: FP32 partial sum per 128-block (ascending k),
// scale = FP32(sa * sb), acc = FP32(acc + FP32(p * scale)).
Mat ref_block_gemm(const QMat& a, const QMat& b) {
  const int64_t M = a.R, N = b.R, K = a.C;
  Mat c(size_t(M * N));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t k0 = 0; k0 < K; k0 += 128) {
        double p = 0;
        for (int64_t k = k0; k < k0 + 128; ++k)
          p = f32(p + a.v[size_t(m * K + k)] * b.v[size_t(n * K + k)]);
        const double s = f32(a.s[size_t(m * K + k0)] * b.s[size_t(n * K + k0)]);
        acc = f32(acc + f32(p * s));
      }
      c[size_t(m * N + n)] = acc;
    }
  return c;
}

Mat transpose(const Mat& x, int64_t R, int64_t C) {
  Mat t(size_t(R * C));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) t[size_t(c * R + r)] = x[size_t(r * C + c)];
  return t;
}

// Transpose a QMat quantized with 128x128 blocks into [C, pad(R)] (zero values in the padding).
QMat transpose_q(const QMat& q) {
  const int64_t Rp = (q.R + 127) / 128 * 128;
  QMat t{q.C, Rp, Mat(size_t(q.C * Rp), 0.0), std::vector<double>(size_t(q.C * Rp), 0.0)};
  for (int64_t r = 0; r < Rp; ++r)
    for (int64_t c = 0; c < q.C; ++c) {
      const int64_t rr = std::min(r, q.R - 1) / 128 * 128;  // padding rows take their block's scale
      t.v[size_t(c * Rp + r)] = r < q.R ? q.v[size_t(r * q.C + c)] : 0.0;
      t.s[size_t(c * Rp + r)] = q.s[size_t((r < q.R ? r : rr) * q.C + c)];
    }
  return t;
}

struct Fp8Case {
  int64_t T, K, N;
  Fp8Format grad;
  bool pow2;
  bool zero_blocks;
};

void check_fp8_linear(const Fp8Case& c, Rng& rng) {
  const int64_t T = c.T, K = c.K, N = c.N;
  GemmPrecision prec{GemmKind::fp8_block, c.grad, c.pow2};
  Linear l(K, N, true, prec, DType::f32);
  init_linear(l, rng, 0.05);
  Tensor x = randn({T, K}, DType::f32, rng, 3.0);
  Tensor dy = randn({T, N}, DType::f32, rng, 1e-3);
  if (c.zero_blocks) {
    // all-zero input tiles, an all-zero weight block, all-zero gradient rows and T-blocks
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < std::min<int64_t>(K, 128); ++k) x.data<float>()[t * K + k] = 0;
    for (int64_t n = 0; n < std::min<int64_t>(N, 128); ++n)
      for (int64_t k = 0; k < std::min<int64_t>(K, 128); ++k)
        l.weight().value.data<float>()[n * K + k] = 0;
    for (int64_t t = 0; t < std::min<int64_t>(T, 128); ++t)
      for (int64_t n = 0; n < N; ++n) dy.data<float>()[t * N + n] = 0;
  }
  Linear::Saved s;
  const Tensor y = l.forward(Context{}, x, &s);
  l.zero_grad();
  const Tensor dx = l.backward(Context{}, dy, s);

  const Mat xv = values(x), wv = values(l.weight().value), bv = values(l.bias()->value),
            dyv = values(dy);
  // fprop
  const QMat qx = ref_quant(xv, T, K, false, Fp8Format::e4m3, c.pow2);
  const QMat qw = ref_quant(wv, N, K, true, Fp8Format::e4m3, c.pow2);
  Mat ry = ref_block_gemm(qx, qw);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n)
      ry[size_t(t * N + n)] = f32(ry[size_t(t * N + n)] + bv[size_t(n)]);
  // dgrad: dy 1x128 along N, W^T from the same 128x128 quantization
  const QMat qdy = ref_quant(dyv, T, N, false, c.grad, c.pow2);
  const Mat rdx_p = ref_block_gemm(qdy, transpose_q(qw));  // [T, pad(K)]
  Mat rdx(size_t(T * K));
  const int64_t Kp = qw.C;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) rdx[size_t(t * K + k)] = rdx_p[size_t(t * Kp + k)];
  // wgrad: dy^T and x^T quantized 1x128 along T
  const QMat qdyt = ref_quant(transpose(dyv, T, N), N, T, false, c.grad, c.pow2);
  const QMat qxt = ref_quant(transpose(xv, T, K), K, T, false, Fp8Format::e4m3, c.pow2);
  const Mat rdw = ref_block_gemm(qdyt, qxt);
  Mat rdb(size_t(N), 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) rdb[size_t(n)] = f32(rdb[size_t(n)] + dyv[size_t(t * N + n)]);

  const std::string what =
      fmt::format("T={} K={} N={} grad={} pow2={} zero_blocks={}", T, K, N,
                  c.grad == Fp8Format::e4m3 ? "e4m3" : "e5m2", c.pow2, c.zero_blocks);
  EXPECT_TRUE(testing::bit_equal(y, from_mat(ry, {T, N}, DType::f32))) << what << " (y)";
  EXPECT_TRUE(testing::bit_equal(dx, from_mat(rdx, {T, K}, DType::f32))) << what << " (dx)";
  EXPECT_TRUE(testing::bit_equal(l.weight().grad, from_mat(rdw, {N, K}, DType::f32)))
      << what << " (dW)";
  EXPECT_TRUE(testing::bit_equal(l.bias()->grad, from_mat(rdb, {N}, DType::f32)))
      << what << " (db)";
  for (const Tensor* t : {&y, &dx, static_cast<const Tensor*>(&l.weight().grad)})
    for (double v : t->to_f64_vector()) ASSERT_TRUE(std::isfinite(v)) << what;

  // FP8 is close to, but not equal to, the exact product
  const Mat exact = ref_linear(xv, wv, T, K, N, false);
  double num = 0, den = 0;
  for (int64_t i = 0; i < T * N; ++i) {
    const double e = exact[size_t(i)] + bv[size_t(i % N)];
    num += (y.to_f64_vector()[size_t(i)] - e) * (y.to_f64_vector()[size_t(i)] - e);
    den += e * e;
  }
  EXPECT_LT(std::sqrt(num / den), 0.1) << what;

  // recompute (W re-quantized in backward) gives the same bits
  Linear::Saved s2;
  l.forward(Context{true, true}, x, &s2);
  EXPECT_FALSE(s2.w_q.q.defined());
  const Tensor g1 = l.weight().grad.clone();
  l.zero_grad();
  const Tensor dx2 = l.backward(Context{true, true}, dy, s2);
  EXPECT_TRUE(testing::bit_equal(dx2, dx)) << what;
  EXPECT_TRUE(testing::bit_equal(l.weight().grad, g1)) << what;
}

TEST(LinearFp8, BitExactAgainstTheFp64Emulation) {
  Rng rng(testing::test_seed());
  const Fp8Case cases[] = {
      {64, 128, 128, Fp8Format::e4m3, false, false},  // aligned
      {70, 200, 130, Fp8Format::e4m3, false, false},  // in, out, T not multiples of 128
      {130, 256, 90, Fp8Format::e5m2, false, false},  // hybrid recipe
      {33, 300, 140, Fp8Format::e5m2, true, false},   // pow2 scales
      {150, 200, 130, Fp8Format::e4m3, true, true},   // all-zero blocks everywhere
      {1, 5, 3, Fp8Format::e4m3, false, false},       // tiny
  };
  for (const Fp8Case& c : cases) check_fp8_linear(c, rng);
}

TEST(LinearFp8, AllZeroGradientGivesZerosNotNaN) {
  for (Fp8Format g : {Fp8Format::e4m3, Fp8Format::e5m2}) {
    Rng rng(testing::test_seed());
    Linear l(256, 128, false, GemmPrecision{GemmKind::fp8_block, g, true}, DType::f32);
    init_linear(l, rng);
    const Tensor x = randn({40, 256}, DType::f32, rng);
    Linear::Saved s;
    l.forward(Context{}, x, &s);
    l.zero_grad();
    const Tensor dx = l.backward(Context{}, Tensor::zeros({40, 128}, DType::f32), s);
    for (double v : dx.to_f64_vector()) ASSERT_EQ(v, 0.0);
    for (double v : l.weight().grad.to_f64_vector()) ASSERT_EQ(v, 0.0);
  }
}

TEST(Linear, BadInputIsAClearError) {
  Linear l(16, 8, false, GemmPrecision{GemmKind::native}, DType::f32);
  EXPECT_THROW(l.forward(Context{}, Tensor::zeros({4, 15}, DType::f32), nullptr), Error);
  EXPECT_THROW(l.forward(Context{}, Tensor::zeros({4, 16, 1}, DType::f32), nullptr), Error);
  EXPECT_THROW(l.forward(Context{}, Tensor::zeros({4, 16}, DType::i32), nullptr), Error);
  Linear::Saved s;
  l.forward(Context{}, Tensor::zeros({4, 16}, DType::f32), &s);
  EXPECT_THROW(l.backward(Context{}, Tensor::zeros({4, 9}, DType::f32), s), Error);
  EXPECT_THROW(l.backward(Context{}, Tensor::zeros({4, 8}, DType::f32), Linear::Saved{}), Error);
  EXPECT_THROW(Linear(0, 8, false, GemmPrecision{}), Error);
  EXPECT_THROW(l.init(16, 8, false, GemmPrecision{}), Error);
}

}  // namespace
}  // namespace hlm
