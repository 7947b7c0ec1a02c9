#include "core/formats.h"

#include <cmath>

namespace hlm {
namespace {

// Round |a| (finite, >= 0) to the grid of a binary format with `mbits` explicit mantissa bits and
// smallest normal exponent `emin` (subnormals below 2^emin), ties to even. Exact: every step is a
// scaling by a power of two or an integer rounding of a value that fits a double.
double round_to_grid(double a, int mbits, int emin) {
  if (a == 0.0 || !std::isfinite(a)) return a;
  int e = std::ilogb(a);
  if (e < emin) e = emin;
  const double ulp = std::ldexp(1.0, e - mbits);
  return std::nearbyint(a / ulp) * ulp;  // default rounding mode: to nearest, ties to even
}

// Encode a value already on the grid (finite, not above the format's max) into sign|exp|mantissa.
uint32_t encode_on_grid(double r, int mbits, int emin, int bias) {
  if (r == 0.0) return 0;
  if (r < std::ldexp(1.0, emin)) return uint32_t(r / std::ldexp(1.0, emin - mbits));  // subnormal
  const int e = std::ilogb(r);
  const uint32_t mant = uint32_t(r / std::ldexp(1.0, e - mbits)) - (1u << mbits);
  return (uint32_t(e + bias) << mbits) | mant;
}

double decode(uint32_t expf, uint32_t mant, int mbits, int bias) {
  if (expf == 0) return std::ldexp(double(mant), 1 - bias - mbits);
  return std::ldexp(double((1u << mbits) | mant), int(expf) - bias - mbits);
}

}  // namespace

float f16_to_float(f16 h) {
  const uint32_t sign = h.bits >> 15, expf = (h.bits >> 10) & 0x1f, mant = h.bits & 0x3ff;
  float v;
  if (expf == 0x1f) {
    v = mant ? f32_from_bits(0x7fc00000u | (mant << 13)) : INFINITY;
  } else {
    v = float(decode(expf, mant, 10, 15));
  }
  return sign ? -v : v;
}

f16 float_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return f16::from_bits(0x7fffu);  // canonical NaN
  if (std::isinf(f)) return f16::from_bits(uint16_t(sign | 0x7c00u));
  const double r = round_to_grid(std::fabs(double(f)), 10, -14);
  if (r > 65504.0) return f16::from_bits(uint16_t(sign | 0x7c00u));  // overflow (and inf) -> inf
  return f16::from_bits(uint16_t(sign | encode_on_grid(r, 10, -14, 15)));
}

float fp8_to_float(uint8_t code, Fp8Format fmt) {
  const bool neg = code & 0x80;
  const uint32_t a = code & 0x7f;
  float v;
  if (fmt == Fp8Format::e4m3) {
    if (a == 0x7f) return NAN;
    v = float(decode(a >> 3, a & 7, 3, 7));
  } else {
    if (a > 0x7c) return NAN;
    if (a == 0x7c) {
      v = INFINITY;
    } else {
      v = float(decode(a >> 2, a & 3, 2, 15));
    }
  }
  return neg ? -v : v;
}

uint8_t float_to_fp8(float x, Fp8Format fmt, Saturate sat) {
  if (std::isnan(x)) return 0x7f;
  const bool e4 = fmt == Fp8Format::e4m3;
  const int mbits = e4 ? 3 : 2, bias = e4 ? 7 : 15, emin = 1 - bias;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(double(x));
  const double r = std::isinf(a) ? INFINITY : round_to_grid(a, mbits, emin);
  if (r > double(fp8_max(fmt))) {
    if (sat == Saturate::finite) return uint8_t(sign | (e4 ? 0x7e : 0x7b));
    return uint8_t(sign | (e4 ? 0x7f : 0x7c));
  }
  return uint8_t(sign | encode_on_grid(r, mbits, emin, bias));
}

}  // namespace hlm
