// FP8 blockwise quantizer and block GEMM (ops/fp8_quant.h) against an independent FP64 reference
// written here: amax in FP64, the scale rule and the division done in FP64 and rounded once to
// FP32 (= the correctly rounded FP32 operation), the fp8 code found as the nearest value of the
// format's enumerated grid (ties to the even code, saturating).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/rng.h"
#include "ops/fp8_quant.h"
#include "testing.h"

namespace hlm {
namespace {

using ops::Fp8Tensor;
using ops::QuantRecipe;
using ops::TileShape;

// Sorted non-negative finite values of the format (the code of values[i] is i).
const std::vector<double>& grid(Fp8Format f) {
  static const std::vector<double> g4 = [] {
    std::vector<double> v;
    for (int e = 0; e < 16; ++e)
      for (int m = 0; m < 8; ++m) {
        if (e == 15 && m == 7) continue;  // NaN
        v.push_back(e == 0 ? m / 8.0 * std::ldexp(1.0, -6)
                           : (1 + m / 8.0) * std::ldexp(1.0, e - 7));
      }
    return v;
  }();
  static const std::vector<double> g5 = [] {
    std::vector<double> v;
    for (int e = 0; e < 31; ++e)
      for (int m = 0; m < 4; ++m)
        v.push_back(e == 0 ? m / 4.0 * std::ldexp(1.0, -14)
                           : (1 + m / 4.0) * std::ldexp(1.0, e - 15));
    return v;
  }();
  return f == Fp8Format::e4m3 ? g4 : g5;
}

// Saturating round-to-nearest-even encode of a finite double.
uint8_t ref_encode(double x, Fp8Format f) {
  const auto& v = grid(f);
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::min(std::fabs(x), v.back());
  size_t hi = size_t(std::lower_bound(v.begin(), v.end(), a) - v.begin());
  if (v[hi] == a) return uint8_t(sign | hi);
  const size_t lo = hi - 1;
  const double dl = a - v[lo], dh = v[hi] - a;
  const size_t pick = dl < dh ? lo : dh < dl ? hi : (lo % 2 == 0 ? lo : hi);
  return uint8_t(sign | pick);
}
double ref_value(uint8_t c, Fp8Format f) {
  const double v = grid(f)[c & 0x7f];
  return (c & 0x80) ? -v : v;
}

float ref_scale_inv(double amax, Fp8Format f, bool pow2) {
  const double amax_g = std::max(amax, double(1e-12f));
  const float r = float(amax_g / (f == Fp8Format::e4m3 ? 448.0 : 57344.0));
  if (!pow2) return r;
  double p = 1.0;  // the smallest power of two >= r
  while (p < r) p *= 2.0;
  while (p / 2.0 >= r) p /= 2.0;
  return float(p);
}

struct RefQuant {
  std::vector<uint8_t> q;  // [rows, cols]
  std::vector<float> s;    // scale_inv shape of the recipe
};
RefQuant ref_quantize(const std::vector<double>& x, int64_t rows, int64_t cols,
                      const QuantRecipe& rc) {
  RefQuant r;
  r.q.resize(size_t(rows * cols));
  const int64_t cb = cols / 128;
  const int64_t th = rc.tile == TileShape::t1x128 ? 1 : 128;
  const int64_t rb = (rows + th - 1) / th;
  r.s.resize(size_t(rb * cb));
  for (int64_t br = 0; br < rb; ++br)
    for (int64_t bc = 0; bc < cb; ++bc) {
      const int64_t r0 = br * th, r1 = std::min(rows, r0 + th);
      double amax = 0;
      for (int64_t i = r0; i < r1; ++i)
        for (int64_t j = bc * 128; j < bc * 128 + 128; ++j)
          amax = std::max(amax, std::fabs(x[size_t(i * cols + j)]));
      const float s = ref_scale_inv(amax, rc.format, rc.pow2);
      r.s[size_t(br * cb + bc)] = s;
      for (int64_t i = r0; i < r1; ++i)
        for (int64_t j = bc * 128; j < bc * 128 + 128; ++j) {
          const float xf = float(x[size_t(i * cols + j)]);
          const float d = float(double(xf) / double(s));  // correctly rounded FP32 division
          r.q[size_t(i * cols + j)] = ref_encode(d, rc.format);
        }
    }
  return r;
}

// Random matrix with a wide dynamic range per row, some all-zero tiles, exact halfway values.
Tensor random_input(int64_t rows, int64_t cols, Rng& rng) {
  Tensor x = Tensor::empty({rows, cols}, DType::f32);
  float* p = x.data<float>();
  for (int64_t i = 0; i < rows; ++i) {
    const double row_scale = std::ldexp(1.0, int(rng.below(40)) - 20);
    for (int64_t j = 0; j < cols; ++j) p[i * cols + j] = float(rng.normal() * row_scale);
  }
  if (rows > 2 && cols >= 256)
    for (int64_t j = 128; j < 256; ++j) p[1 * cols + j] = 0.0f;  // one all-zero 1x128 tile
  return x;
}

std::vector<QuantRecipe> all_recipes() {
  std::vector<QuantRecipe> v;
  for (Fp8Format f : {Fp8Format::e4m3, Fp8Format::e5m2})
    for (TileShape t : {TileShape::t1x128, TileShape::t128x128})
      for (bool p2 : {false, true}) v.push_back({f, t, p2});
  return v;
}

TEST(Fp8Quant, MatchesTheFp64ReferenceBitForBit) {
  Rng rng(testing::test_seed());
  for (auto [rows, cols] :
       {std::pair<int64_t, int64_t>{1, 128}, {5, 256}, {127, 128}, {129, 384}, {300, 256}}) {
    const Tensor x = random_input(rows, cols, rng);
    const auto xv = x.to_f64_vector();
    for (const QuantRecipe& rc : all_recipes()) {
      const Fp8Tensor q = ops::fp8_quantize(x, rc);
      const RefQuant ref = ref_quantize(xv, rows, cols, rc);
      ASSERT_EQ(q.q.dtype(), rc.format == Fp8Format::e4m3 ? DType::e4m3 : DType::e5m2);
      ASSERT_EQ(q.scale_inv.shape(), ops::fp8_scale_shape(rows, cols, rc.tile));
      const uint8_t* qp = static_cast<const uint8_t*>(q.q.raw());
      const float* sp = q.scale_inv.data<float>();
      int64_t bad = 0;
      for (size_t i = 0; i < ref.s.size(); ++i)
        if (f32_bits(sp[i]) != f32_bits(ref.s[i]) && bad++ < 3)
          ADD_FAILURE() << ops::recipe_str(rc) << " [" << rows << ", " << cols << "] scale " << i
                        << ": " << sp[i] << " vs reference " << ref.s[i];
      for (size_t i = 0; i < ref.q.size(); ++i)
        if (qp[i] != ref.q[i] && bad++ < 3)
          ADD_FAILURE() << ops::recipe_str(rc) << " [" << rows << ", " << cols << "] element " << i
                        << ": code " << int(qp[i]) << " vs reference " << int(ref.q[i]);
      ASSERT_EQ(bad, 0);
      // dequantize = value * scale_inv in FP32
      const Tensor dq = ops::fp8_dequantize(q);
      const float* dp = dq.data<float>();
      const int64_t cb = cols / 128;
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) {
          const int64_t sr = rc.tile == TileShape::t1x128 ? i : i / 128;
          const float e = float(ref_value(ref.q[size_t(i * cols + j)], rc.format) *
                                double(ref.s[size_t(sr * cb + j / 128)]));
          ASSERT_EQ(f32_bits(dp[i * cols + j]), f32_bits(e)) << i << ", " << j;
        }
    }
  }
}

TEST(Fp8Quant, AmaxMapsToFp8MaxAndNothingIsNaN) {
  Rng rng(testing::test_seed());
  const int64_t rows = 200, cols = 384;
  const Tensor x = random_input(rows, cols, rng);
  const float* xp = x.data<float>();
  for (const QuantRecipe& rc : all_recipes()) {
    const Fp8Tensor q = ops::fp8_quantize(x, rc);
    const Tensor v = ops::fp8_values(q);
    const float* vp = v.data<float>();
    const float mx = fp8_max(rc.format);
    for (int64_t i = 0; i < rows * cols; ++i) {
      ASSERT_TRUE(std::isfinite(vp[i])) << ops::recipe_str(rc) << " element " << i;
      ASSERT_LE(std::fabs(vp[i]), mx);
    }
    const Tensor s = q.scale_inv;
    for (int64_t i = 0; i < s.numel(); ++i) {
      const float si = s.data<float>()[i];
      ASSERT_TRUE(std::isfinite(si) && si > 0) << ops::recipe_str(rc) << " scale " << i;
      if (rc.pow2) {
        int e;
        ASSERT_EQ(std::frexp(si, &e), 0.5f) << "scale " << si << " is not a power of two";
      }
    }
    if (rc.pow2 || rc.tile != TileShape::t1x128) continue;
    // per 1x128 tile, the element of largest magnitude maps to exactly +-fp8_max
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t b = 0; b < cols / 128; ++b) {
        int64_t arg = i * cols + b * 128;
        for (int64_t j = b * 128; j < b * 128 + 128; ++j)
          if (std::fabs(xp[i * cols + j]) > std::fabs(xp[arg])) arg = i * cols + j;
        if (xp[arg] == 0.0f) continue;
        ASSERT_EQ(vp[arg], std::copysign(mx, xp[arg])) << ops::recipe_str(rc) << " row " << i;
      }
  }
  // and for 128x128 blocks: the block amax element
  for (Fp8Format f : {Fp8Format::e4m3, Fp8Format::e5m2}) {
    const Fp8Tensor q = ops::fp8_quantize(x, {f, TileShape::t128x128, false});
    const Tensor v = ops::fp8_values(q);
    for (int64_t br = 0; br < 2; ++br)
      for (int64_t bc = 0; bc < 3; ++bc) {
        int64_t arg = -1;
        for (int64_t i = br * 128; i < std::min<int64_t>(rows, br * 128 + 128); ++i)
          for (int64_t j = bc * 128; j < bc * 128 + 128; ++j)
            if (arg < 0 || std::fabs(xp[i * cols + j]) > std::fabs(xp[arg])) arg = i * cols + j;
        EXPECT_EQ(v.data<float>()[arg], std::copysign(fp8_max(f), xp[arg]));
      }
  }
}

TEST(Fp8Quant, AllZeroTilesGiveZerosAndAFiniteScale) {
  const Tensor x = Tensor::zeros({130, 256}, DType::f32);
  for (const QuantRecipe& rc : all_recipes()) {
    const Fp8Tensor q = ops::fp8_quantize(x, rc);
    const Tensor v = ops::fp8_dequantize(q);
    for (int64_t i = 0; i < v.numel(); ++i) ASSERT_EQ(f32_bits(v.data<float>()[i]), 0u);
    const float expect = ref_scale_inv(0.0, rc.format, rc.pow2);
    for (int64_t i = 0; i < q.scale_inv.numel(); ++i)
      ASSERT_EQ(q.scale_inv.data<float>()[i], expect) << ops::recipe_str(rc);
    EXPECT_TRUE(std::isfinite(expect) && expect > 0);
  }
  EXPECT_EQ(ops::fp8_scale_inv(0.0f, Fp8Format::e4m3, false), 1e-12f / 448.0f);
  EXPECT_EQ(ops::fp8_scale_inv(0.0f, Fp8Format::e4m3, true), std::ldexp(1.0f, -48));
  EXPECT_EQ(ops::fp8_scale_inv(448.0f, Fp8Format::e4m3, true), 1.0f);
  EXPECT_EQ(ops::fp8_scale_inv(449.0f, Fp8Format::e4m3, true), 2.0f);
  EXPECT_EQ(ops::fp8_scale_inv(57344.0f, Fp8Format::e5m2, false), 1.0f);
}

TEST(Fp8Quant, BadInputIsAClearError) {
  EXPECT_THROW(ops::fp8_quantize(Tensor::zeros({4, 100}, DType::f32), {}), Error);
  EXPECT_THROW(ops::fp8_quantize(Tensor::zeros({4, 128, 1}, DType::f32), {}), Error);
  EXPECT_THROW(ops::fp8_quantize(Tensor::zeros({4, 128}, DType::i32), {}), Error);
  Tensor x = Tensor::zeros({4, 128}, DType::f32);
  x.data<float>()[130 % 128 + 128 * 2] = NAN;
  try {
    ops::fp8_quantize(x, {});
    FAIL() << "NaN accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("x[2, 2]"), std::string::npos) << e.what();
  }
  x.data<float>()[258] = INFINITY;
  EXPECT_THROW(ops::fp8_quantize(x, {}), Error);
  EXPECT_THROW(ops::parse_tile_shape("128x1"), Error);
  EXPECT_THROW(ops::parse_fp8_format("e3m4"), Error);
  try {
    ops::fp8_quantize(Tensor::zeros({4, 100}, DType::f32), {});
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of 128"), std::string::npos) << e.what();
  }
}

TEST(Fp8Quant, F64InputIsRoundedToF32First) {
  Rng rng(testing::test_seed());
  Tensor x = randn({3, 128}, DType::f64, rng);
  const auto a = ops::fp8_quantize(x, {}), b = ops::fp8_quantize(x.to(DType::f32), {});
  EXPECT_TRUE(testing::bit_equal(a.q, b.q));
  EXPECT_TRUE(testing::bit_equal(a.scale_inv, b.scale_inv));
  // strided (transposed) views quantize like their contiguous copies
  Tensor y = randn({256, 3}, DType::f32, rng);
  const auto c = ops::fp8_quantize(y.transpose(0, 1), {}),
             d = ops::fp8_quantize(y.transpose(0, 1).contiguous(), {});
  EXPECT_TRUE(testing::bit_equal(c.q, d.q));
}

TEST(Fp8Quant, TransposeBlocksIsExact) {
  Rng rng(testing::test_seed());
  const Tensor w = random_input(200, 256, rng);  // 200 rows: a partial last block row
  const auto q = ops::fp8_quantize(w, {Fp8Format::e4m3, TileShape::t128x128, false});
  const auto t = ops::fp8_transpose_blocks(q);
  ASSERT_EQ(t.q.shape(), (Shape{256, 256}));
  ASSERT_EQ(t.scale_inv.shape(), (Shape{2, 2}));
  const Tensor dq = ops::fp8_dequantize(q), dt = ops::fp8_dequantize(t);
  for (int64_t i = 0; i < 256; ++i)
    for (int64_t j = 0; j < 256; ++j) {
      const float e = j < 200 ? dq.data<float>()[j * 256 + i] : 0.0f;
      ASSERT_EQ(f32_bits(dt.data<float>()[i * 256 + j]), f32_bits(e)) << i << ", " << j;
    }
}

// The block GEMM against an FP64 emulation: every FP32 step rounded once from an exact FP64 value.
TEST(Fp8Quant, BlockGemmMatchesTheEmulation) {
  Rng rng(testing::test_seed());
  const int64_t M = 37, N = 150, K = 384;
  const Tensor a = random_input(M, K, rng), b = random_input(N, K, rng);
  for (TileShape bt : {TileShape::t1x128, TileShape::t128x128})
    for (Fp8Format fa : {Fp8Format::e4m3, Fp8Format::e5m2}) {
      const QuantRecipe ra{fa, TileShape::t1x128, false}, rb{Fp8Format::e4m3, bt, true};
      const auto qa = ops::fp8_quantize(a, ra), qb = ops::fp8_quantize(b, rb);
      const RefQuant ea = ref_quantize(a.to_f64_vector(), M, K, ra);
      const RefQuant eb = ref_quantize(b.to_f64_vector(), N, K, rb);
      const Tensor c = ops::fp8_gemm_tn(qa, qb);
      ASSERT_EQ(c.shape(), (Shape{M, N}));
      const int64_t KB = K / 128;
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          float acc = 0;
          for (int64_t kb = 0; kb < KB; ++kb) {
            float p = 0;
            for (int64_t k = kb * 128; k < kb * 128 + 128; ++k)
              p = float(double(p) + ref_value(ea.q[size_t(m * K + k)], fa) *
                                        ref_value(eb.q[size_t(n * K + k)], Fp8Format::e4m3));
            const float sa = ea.s[size_t(m * KB + kb)];
            const float sb = eb.s[size_t((bt == TileShape::t1x128 ? n : n / 128) * KB + kb)];
            const float s = float(double(sa) * double(sb));
            acc = float(double(acc) + double(float(double(p) * double(s))));
          }
          ASSERT_EQ(f32_bits(c.data<float>()[m * N + n]), f32_bits(acc))
              << "C[" << m << ", " << n << "] " << c.data<float>()[m * N + n] << " vs " << acc;
        }
    }
}

}  // namespace
}  // namespace hlm
