// Number formats (core/formats.h) against
//  (a) an independent FP64 reference written here: each format's value grid enumerated from its
//      definition (sign, exponent bias, mantissa bits), nearest grid value with ties to the even
//      code, and the overflow rules of cuda_fp8.h (SATFINITE / NOSAT);
//  (b) the host implementations of cuda_fp8.h / cuda_bf16.h / cuda_fp16.h, when the build has
//      them (HLM_TEST_CUDA_HEADERS: tests/CMakeLists.txt sets it in a CUDA-enabled configure).
// Float inputs: a structured sweep (every sign and exponent, the top 8 mantissa bits, and low bits
// giving exact ties and near-ties), random bit patterns, and the special values. With
// HLM_EXHAUSTIVE_FORMATS=1 in the environment every one of the 2^32 floats is checked.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <vector>

#include "core/formats.h"
#include "core/rng.h"

#if defined(HLM_TEST_CUDA_HEADERS)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#endif

namespace hlm {
namespace {

// ---- the independent reference ------------------------------------------------------------------

struct FormatDef {
  int ebits, mbits, bias;
  bool e4m3fn;  // E4M3 "fn": no infinities, only S.1111.111 is NaN; else IEEE-like (inf, NaNs)
};
constexpr FormatDef kE4M3{4, 3, 7, true};
constexpr FormatDef kE5M2{5, 2, 15, false};
constexpr FormatDef kBF16{8, 7, 127, false};
constexpr FormatDef kF16{5, 10, 15, false};

// Value of a code from the format definition (NaN for NaN codes, +-inf for inf codes).
double ref_decode(uint32_t code, const FormatDef& f) {
  const uint32_t nbits = 1 + f.ebits + f.mbits;
  const bool neg = (code >> (nbits - 1)) & 1;
  const uint32_t e = (code >> f.mbits) & ((1u << f.ebits) - 1), m = code & ((1u << f.mbits) - 1);
  const uint32_t emax_field = (1u << f.ebits) - 1;
  double v;
  if (f.e4m3fn && e == emax_field && m == (1u << f.mbits) - 1) return NAN;
  if (!f.e4m3fn && e == emax_field) {
    if (m != 0) return NAN;
    v = INFINITY;
  } else if (e == 0) {
    v = double(m) / double(1u << f.mbits) * std::pow(2.0, 1 - f.bias);
  } else {
    v = (1.0 + double(m) / double(1u << f.mbits)) * std::pow(2.0, int(e) - f.bias);
  }
  return neg ? -v : v;
}

// The non-negative finite grid (codes 0 .. max code in increasing order: the code order of a
// sign-magnitude format is the value order), plus the largest finite value's code.
struct Grid {
  std::vector<double> values;  // values[c] for codes c = 0 .. max_code
  uint32_t max_code;
  double next_above_max;  // max + one ulp of the top binade: where overflow starts to round
};
Grid make_grid(const FormatDef& f) {
  Grid g;
  const uint32_t nbits = 1 + f.ebits + f.mbits;
  for (uint32_t c = 0; c < (1u << (nbits - 1)); ++c) {
    const double v = ref_decode(c, f);
    if (!std::isfinite(v)) break;
    g.values.push_back(v);
  }
  g.max_code = uint32_t(g.values.size() - 1);
  const double mx = g.values.back();
  g.next_above_max = mx + (mx - g.values[g.values.size() - 2]);
  return g;
}

enum class Overflow { satfinite, nosat };

// Nearest grid value, ties to the even code; |x| rounding to next_above_max (or beyond) overflows.
uint32_t ref_encode(double x, const FormatDef& f, const Grid& g, Overflow ov) {
  const uint32_t nbits = 1 + f.ebits + f.mbits;
  const uint32_t sign = std::signbit(x) ? (1u << (nbits - 1)) : 0u;
  const uint32_t emax_field = (1u << f.ebits) - 1;
  const uint32_t nan_code = f.e4m3fn ? (1u << (nbits - 1)) - 1 : (emax_field << f.mbits) | 1u;
  const uint32_t inf_code = emax_field << f.mbits;
  if (std::isnan(x)) return nan_code;
  const double a = std::fabs(x);
  auto overflow = [&]() -> uint32_t {
    if (ov == Overflow::satfinite) return sign | g.max_code;
    return f.e4m3fn ? (sign | nan_code) : (sign | inf_code);
  };
  if (std::isinf(a)) return overflow();
  // Candidates: grid values plus the virtual next value (code max_code + 1, odd for E4M3 and even
  // for the others, which decides the tie at max + ulp/2).
  const auto& v = g.values;
  if (a >= g.next_above_max) return overflow();
  size_t hi = size_t(std::lower_bound(v.begin(), v.end(), a) - v.begin());
  if (hi < v.size() && v[hi] == a) return sign | uint32_t(hi);
  const double up = hi < v.size() ? v[hi] : g.next_above_max;
  const size_t lo = hi - 1;  // a > 0 = v[0]
  const double dlo = a - v[lo], dhi = up - a;
  size_t pick;
  if (dlo < dhi) {
    pick = lo;
  } else if (dhi < dlo) {
    pick = hi;
  } else {
    pick = (lo % 2 == 0) ? lo : hi;
  }
  if (pick > g.max_code) return overflow();
  return sign | uint32_t(pick);
}

// fp8 codes as cuda_fp8.h produces them for float NaN inputs: 0x7f in both formats.
uint32_t ref_fp8(float x, Fp8Format fmt, Saturate sat) {
  static const Grid g4 = make_grid(kE4M3), g5 = make_grid(kE5M2);
  if (std::isnan(x)) return 0x7f;
  const bool e4 = fmt == Fp8Format::e4m3;
  return ref_encode(double(x), e4 ? kE4M3 : kE5M2, e4 ? g4 : g5,
                    sat == Saturate::finite ? Overflow::satfinite : Overflow::nosat);
}
// bf16 / f16: IEEE overflow to inf (round to nearest); NaN -> canonical 0x7fff (cuda_bf16.h,
// cuda_fp16.h).
uint32_t ref_bf16(float x) {
  static const Grid g = make_grid(kBF16);
  if (std::isnan(x)) return 0x7fff;
  return ref_encode(double(x), kBF16, g, Overflow::nosat);
}
uint32_t ref_f16(float x) {
  static const Grid g = make_grid(kF16);
  if (std::isnan(x)) return 0x7fff;
  return ref_encode(double(x), kF16, g, Overflow::nosat);
}

bool same_value(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return a == b && std::signbit(a) == std::signbit(b);
}

// ---- the float inputs ---------------------------------------------------------------------------

std::vector<float> special_floats() {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          INFINITY,
                          -INFINITY,
                          NAN,
                          -NAN,
                          f32_from_bits(0x7f800001u),  // signalling NaN
                          f32_from_bits(0xffc12345u),
                          std::numeric_limits<float>::max(),
                          -std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::min(),
                          std::numeric_limits<float>::denorm_min(),
                          -std::numeric_limits<float>::denorm_min(),
                          448.0f,
                          464.0f,  // E4M3 tie at the edge: 448 (SATFINITE and NOSAT)
                          464.00003f,
                          479.0f,
                          480.0f,
                          -464.0f,
                          57344.0f,
                          61440.0f,  // E5M2 tie at the edge: rounds up, overflows
                          61439.996f,
                          65504.0f,
                          65519.996f,
                          65520.0f,  // f16 tie at the edge: inf
                          0x1p-9f,   // E4M3 min subnormal
                          0x1p-10f,  // half of it: tie to 0
                          0x1.000002p-10f,
                          0x1p-16f,  // E5M2 min subnormal
                          0x1p-17f,
                          0x1.8p-16f,  // tie between 1 and 2 subnormal units -> 2
                          0x1.4p-9f,
                          1.0625f,      // E4M3 tie between 1 and 1.125 -> 1
                          1.1875f,      // tie between 1.125 and 1.25 -> 1.25
                          1.00390625f,  // bf16 tie -> 1
                          1.01171875f,  // bf16 tie -> 1.015625
                          3.14159265f,
                          -2.71828183f,
                          1e-30f,
                          1e30f};
  return v;
}

// Every sign and exponent, every value of the top 8 mantissa bits, low 15 bits in a set that makes
// exact ties (0) and the floats on either side of them.
std::vector<float> sweep_floats() {
  std::vector<float> v;
  const uint32_t lows[] = {0u, 1u, 0x3fffu, 0x4000u, 0x4001u, 0x7fffu};
  for (uint32_t s = 0; s < 2; ++s)
    for (uint32_t e = 0; e < 256; ++e)
      for (uint32_t hi = 0; hi < 256; ++hi)
        for (uint32_t lo : lows)
          v.push_back(f32_from_bits((s << 31) | (e << 23) | (hi << 15) | lo));
  return v;
}

std::vector<float> random_floats(size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v;
  v.reserve(n);
  for (size_t i = 0; i < n / 2; ++i) v.push_back(f32_from_bits(rng.next_u32()));  // any bits
  // Values in and around the fp8 ranges, with random scale: normal, huge, tiny, subnormal.
  for (size_t i = n / 2; i < n; ++i)
    v.push_back(float(rng.normal() * std::ldexp(1.0, int(rng.below(60)) - 30)));
  return v;
}

std::vector<float> all_inputs() {
  auto v = special_floats();
  auto s = sweep_floats();
  auto r = random_floats(400000, 0x5eedf00dull);
  v.insert(v.end(), s.begin(), s.end());
  v.insert(v.end(), r.begin(), r.end());
  return v;
}

const char* fmt_name(Fp8Format f) {
  return f == Fp8Format::e4m3 ? "e4m3" : "e5m2";
}
const char* sat_name(Saturate s) {
  return s == Saturate::finite ? "finite" : "none";
}

#if defined(HLM_TEST_CUDA_HEADERS)
uint32_t cuda_fp8(float x, Fp8Format fmt, Saturate sat) {
  return __nv_cvt_float_to_fp8(x, sat == Saturate::finite ? __NV_SATFINITE : __NV_NOSAT,
                               fmt == Fp8Format::e4m3 ? __NV_E4M3 : __NV_E5M2);
}
double cuda_fp8_decode(uint8_t code, Fp8Format fmt) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(code, fmt == Fp8Format::e4m3 ? __NV_E4M3 : __NV_E5M2);
  return double(__half2float(__half(h)));
}
uint32_t cuda_bf16(float x) {
  __nv_bfloat16_raw r = __nv_bfloat16(__float2bfloat16_rn(x));
  return r.x;
}
uint32_t cuda_f16(float x) {
  __half_raw r = __float2half_rn(x);
  return r.x;
}
#endif

// ---- fp8 codes ----------------------------------------------------------------------------------

TEST(FormatsFp8, GridHasTheDocumentedShape) {
  const Grid g4 = make_grid(kE4M3), g5 = make_grid(kE5M2);
  EXPECT_EQ(g4.values.size(), 127u);  // 0x00..0x7e
  EXPECT_EQ(g4.values.back(), 448.0);
  EXPECT_EQ(g4.next_above_max, 480.0);
  EXPECT_EQ(g4.values[1], std::ldexp(1.0, -9));
  EXPECT_EQ(g5.values.size(), 124u);  // 0x00..0x7b
  EXPECT_EQ(g5.values.back(), 57344.0);
  EXPECT_EQ(g5.next_above_max, 65536.0);
  EXPECT_EQ(g5.values[1], std::ldexp(1.0, -16));
  EXPECT_EQ(fp8_max(Fp8Format::e4m3), 448.0f);
  EXPECT_EQ(fp8_max(Fp8Format::e5m2), 57344.0f);
}

TEST(FormatsFp8, EveryCodeDecodesAndReencodes) {
  for (Fp8Format fmt : {Fp8Format::e4m3, Fp8Format::e5m2}) {
    const FormatDef& def = fmt == Fp8Format::e4m3 ? kE4M3 : kE5M2;
    int nan_codes = 0;
    for (int c = 0; c < 256; ++c) {
      const uint8_t code = uint8_t(c);
      const float v = fp8_to_float(code, fmt);
      const double ref = ref_decode(code, def);
      ASSERT_TRUE(same_value(v, ref)) << fmt_name(fmt) << " code 0x" << std::hex << c << ": got "
                                      << v << ", definition gives " << ref;
#if defined(HLM_TEST_CUDA_HEADERS)
      ASSERT_TRUE(same_value(v, cuda_fp8_decode(code, fmt)))
          << fmt_name(fmt) << " code 0x" << std::hex << c << ": got " << v
          << ", __nv_cvt_fp8_to_halfraw gives " << cuda_fp8_decode(code, fmt);
#endif
      if (std::isnan(v)) {
        ++nan_codes;
        for (Saturate sat : {Saturate::finite, Saturate::none})
          EXPECT_EQ(float_to_fp8(v, fmt, sat), 0x7f) << "NaN code 0x" << std::hex << c;
        continue;
      }
      for (Saturate sat : {Saturate::finite, Saturate::none}) {
        // inf (E5M2 0x7c / 0xfc) saturates to max under SATFINITE
        const bool inf = std::isinf(v);
        const uint8_t expect = inf && sat == Saturate::finite ? uint8_t((c & 0x80) | 0x7b) : code;
        EXPECT_EQ(float_to_fp8(v, fmt, sat), expect)
            << fmt_name(fmt) << " " << sat_name(sat) << " code 0x" << std::hex << c;
      }
    }
    EXPECT_EQ(nan_codes, fmt == Fp8Format::e4m3 ? 2 : 6) << fmt_name(fmt);
  }
}

TEST(FormatsFp8, FloatsEncodeLikeTheReference) {
  const auto xs = all_inputs();
  for (Fp8Format fmt : {Fp8Format::e4m3, Fp8Format::e5m2})
    for (Saturate sat : {Saturate::finite, Saturate::none}) {
      int64_t bad = 0;
      for (float x : xs) {
        const uint32_t got = float_to_fp8(x, fmt, sat), ref = ref_fp8(x, fmt, sat);
        if (got != ref && bad++ < 5)
          ADD_FAILURE() << fmt_name(fmt) << " sat " << sat_name(sat) << " x = " << x << " (0x"
                        << std::hex << f32_bits(x) << "): got 0x" << got << ", reference 0x" << ref;
#if defined(HLM_TEST_CUDA_HEADERS)
        const uint32_t cu = cuda_fp8(x, fmt, sat);
        if (got != cu && bad++ < 5)
          ADD_FAILURE() << fmt_name(fmt) << " sat " << sat_name(sat) << " x = " << x << " (0x"
                        << std::hex << f32_bits(x) << "): got 0x" << got
                        << ", __nv_cvt_float_to_fp8 0x" << cu;
#endif
      }
      EXPECT_EQ(bad, 0) << fmt_name(fmt) << " " << sat_name(sat) << " over " << xs.size()
                        << " inputs";
    }
}

TEST(FormatsFp8, EdgeCasesFromTheHeader) {
  EXPECT_EQ(float_to_fp8(464.0f, Fp8Format::e4m3, Saturate::finite), 0x7e);
  EXPECT_EQ(float_to_fp8(464.0f, Fp8Format::e4m3, Saturate::none), 0x7e);  // tie -> 448
  EXPECT_EQ(float_to_fp8(465.0f, Fp8Format::e4m3, Saturate::none), 0x7f);  // NaN
  EXPECT_EQ(float_to_fp8(465.0f, Fp8Format::e4m3, Saturate::finite), 0x7e);
  EXPECT_EQ(float_to_fp8(-1e9f, Fp8Format::e4m3, Saturate::finite), 0xfe);
  EXPECT_EQ(float_to_fp8(INFINITY, Fp8Format::e4m3, Saturate::finite), 0x7e);
  EXPECT_EQ(float_to_fp8(INFINITY, Fp8Format::e4m3, Saturate::none), 0x7f);
  EXPECT_EQ(float_to_fp8(61440.0f, Fp8Format::e5m2, Saturate::none), 0x7c);
  EXPECT_EQ(float_to_fp8(61440.0f, Fp8Format::e5m2, Saturate::finite), 0x7b);
  EXPECT_EQ(float_to_fp8(-INFINITY, Fp8Format::e5m2, Saturate::none), 0xfc);
  EXPECT_EQ(float_to_fp8(-NAN, Fp8Format::e5m2, Saturate::none), 0x7f);
  EXPECT_EQ(float_to_fp8(-0.0f, Fp8Format::e4m3), 0x80);
  EXPECT_EQ(float_to_fp8(-1e-30f, Fp8Format::e4m3), 0x80);    // underflow keeps the sign
  EXPECT_EQ(float_to_fp8(0x1p-10f, Fp8Format::e4m3), 0x00);   // tie to even (0)
  EXPECT_EQ(float_to_fp8(0x1.8p-9f, Fp8Format::e4m3), 0x02);  // tie 1.5 units -> 2
  EXPECT_EQ(round_fp8(1.0625f, Fp8Format::e4m3), 1.0f);
  EXPECT_EQ(round_fp8(1.1875f, Fp8Format::e4m3), 1.25f);
}

// ---- bf16 and f16 -------------------------------------------------------------------------------

TEST(FormatsBf16, FloatsEncodeLikeTheReference) {
  const auto xs = all_inputs();
  int64_t bad = 0;
  for (float x : xs) {
    const uint32_t got = float_to_bf16(x).bits, ref = ref_bf16(x);
    if (got != ref && bad++ < 5)
      ADD_FAILURE() << "bf16 x = " << x << " (0x" << std::hex << f32_bits(x) << "): got 0x" << got
                    << ", reference 0x" << ref;
#if defined(HLM_TEST_CUDA_HEADERS)
    const uint32_t cu = cuda_bf16(x);
    if (got != cu && bad++ < 5)
      ADD_FAILURE() << "bf16 x = " << x << " (0x" << std::hex << f32_bits(x) << "): got 0x" << got
                    << ", __float2bfloat16_rn 0x" << cu;
#endif
  }
  EXPECT_EQ(bad, 0) << "over " << xs.size() << " inputs";
}

TEST(FormatsBf16, EveryCodeDecodes) {
  for (uint32_t c = 0; c < 65536; ++c) {
    const float v = bf16_to_float(bf16::from_bits(uint16_t(c)));
    ASSERT_TRUE(same_value(v, ref_decode(c, kBF16))) << "bf16 code 0x" << std::hex << c;
#if defined(HLM_TEST_CUDA_HEADERS)
    __nv_bfloat16_raw r;
    r.x = uint16_t(c);
    ASSERT_TRUE(same_value(v, __bfloat162float(__nv_bfloat16(r))))
        << "bf16 code 0x" << std::hex << c;
#endif
    if (!std::isnan(v))
      ASSERT_EQ(float_to_bf16(v).bits, c) << "bf16 round trip 0x" << std::hex << c;
  }
}

TEST(FormatsF16, FloatsEncodeLikeTheReference) {
  const auto xs = all_inputs();
  int64_t bad = 0;
  for (float x : xs) {
    const uint32_t got = float_to_f16(x).bits, ref = ref_f16(x);
    if (got != ref && bad++ < 5)
      ADD_FAILURE() << "f16 x = " << x << " (0x" << std::hex << f32_bits(x) << "): got 0x" << got
                    << ", reference 0x" << ref;
#if defined(HLM_TEST_CUDA_HEADERS)
    const uint32_t cu = cuda_f16(x);
    if (got != cu && bad++ < 5)
      ADD_FAILURE() << "f16 x = " << x << " (0x" << std::hex << f32_bits(x) << "): got 0x" << got
                    << ", __float2half_rn 0x" << cu;
#endif
  }
  EXPECT_EQ(bad, 0) << "over " << xs.size() << " inputs";
}

TEST(FormatsF16, EveryCodeDecodes) {
  for (uint32_t c = 0; c < 65536; ++c) {
    const float v = f16_to_float(f16::from_bits(uint16_t(c)));
    ASSERT_TRUE(same_value(v, ref_decode(c, kF16))) << "f16 code 0x" << std::hex << c;
#if defined(HLM_TEST_CUDA_HEADERS)
    __half_raw r;
    r.x = uint16_t(c);
    ASSERT_TRUE(same_value(v, __half2float(__half(r)))) << "f16 code 0x" << std::hex << c;
#endif
    if (!std::isnan(v)) ASSERT_EQ(float_to_f16(v).bits, c) << "f16 round trip 0x" << std::hex << c;
  }
}

// All 2^32 floats, every conversion (about a minute per format on one core): opt-in.
TEST(FormatsExhaustive, AllFloats) {
  const char* env = std::getenv("HLM_EXHAUSTIVE_FORMATS");
  if (!env || std::string(env) != "1") GTEST_SKIP() << "set HLM_EXHAUSTIVE_FORMATS=1 to run";
  int64_t bad = 0;
  for (uint64_t u = 0; u <= 0xffffffffull; ++u) {
    const float x = f32_from_bits(uint32_t(u));
    for (Fp8Format fmt : {Fp8Format::e4m3, Fp8Format::e5m2})
      for (Saturate sat : {Saturate::finite, Saturate::none}) {
        const uint32_t got = float_to_fp8(x, fmt, sat);
#if defined(HLM_TEST_CUDA_HEADERS)
        const uint32_t ref = cuda_fp8(x, fmt, sat);
#else
        const uint32_t ref = ref_fp8(x, fmt, sat);
#endif
        if (got != ref && bad++ < 10)
          ADD_FAILURE() << fmt_name(fmt) << " " << sat_name(sat) << " 0x" << std::hex << u;
      }
#if defined(HLM_TEST_CUDA_HEADERS)
    if (float_to_bf16(x).bits != cuda_bf16(x) && bad++ < 10)
      ADD_FAILURE() << "bf16 0x" << std::hex << u;
    if (float_to_f16(x).bits != cuda_f16(x) && bad++ < 10)
      ADD_FAILURE() << "f16 0x" << std::hex << u;
#else
    if (float_to_bf16(x).bits != ref_bf16(x) && bad++ < 10)
      ADD_FAILURE() << "bf16 0x" << std::hex << u;
    if (float_to_f16(x).bits != ref_f16(x) && bad++ < 10)
      ADD_FAILURE() << "f16 0x" << std::hex << u;
#endif
  }
  EXPECT_EQ(bad, 0);
}

}  // namespace
}  // namespace hlm
