// Number formats: bf16, f16, fp8 E4M3 (e4m3fn) and E5M2, with exact conversions.
//
// Conventions (they match cuda_fp8.h / cuda_bf16.h / cuda_fp16.h bit for bit, and PyTorch except
// for NaN payloads; verified in tests/core/formats_test.cpp):
//  - float -> bf16 / f16: round to nearest, ties to even; NaN gives the canonical NaN 0x7fff of
//    cuda_bf16.h / cuda_fp16.h (PyTorch writes 0x7fc0 / 0x7e00: same NaN, other payload bits).
//  - float -> fp8: round to nearest even. Two saturation modes, as in cuda_fp8.h:
//      Saturate::finite  (__NV_SATFINITE): |x| beyond the largest finite value, and +-inf, give
//                        +-max (448 for E4M3, 57344 for E5M2). NaN gives NaN.
//      Saturate::none    (__NV_NOSAT, PyTorch's .to(float8_*)): overflow gives NaN for E4M3
//                        (which has no inf) and +-inf for E5M2.
//    E4M3: bias 7, max 448, no inf, NaN = 0x7f / 0xff. E5M2: bias 15, max 57344, inf 0x7c / 0xfc,
//    NaN 0x7d..0x7f / 0xfd..0xff. A NaN input gives 0x7f in both formats (cuda_fp8.h canonicalises
//    float NaN and drops its sign). Ties at the overflow edge follow cuda_fp8.h: 464 -> 448 in E4M3
//    in both modes (a tie to the even code; PyTorch agrees), anything above 464 overflows (NaN
//    with Saturate::none and in PyTorch, 448 with finite); 61440 overflows in E5M2.
#pragma once

#include <cstdint>
#include <cstring>

namespace hlm {

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A 16-bit float held as its bit pattern; Self (bf16 or f16) keeps the formats distinct types.
template <class Self>
struct Float16Bits {
  uint16_t bits = 0;
  static Self from_bits(uint16_t b) {
    Self h;
    h.bits = b;
    return h;
  }
};

// ---- bf16 ------------------------------------------------------------------------------------
struct bf16 : Float16Bits<bf16> {};

inline float bf16_to_float(bf16 h) {
  return f32_from_bits(uint32_t(h.bits) << 16);
}
inline bf16 float_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16::from_bits(0x7fffu);  // canonical NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                       // round to nearest even
  return bf16::from_bits(uint16_t(u >> 16));
}
// Round a float to the nearest bf16 value and return it as a float.
inline float round_bf16(float f) {
  return bf16_to_float(float_to_bf16(f));
}

// ---- f16 (IEEE binary16), needed for safetensors F16 --------------------------------------------
struct f16 : Float16Bits<f16> {};
float f16_to_float(f16 h);
f16 float_to_f16(float f);

// ---- fp8 -------------------------------------------------------------------------------------
enum class Fp8Format : uint8_t { e4m3, e5m2 };
enum class Saturate : uint8_t { finite, none };

struct e4m3 {
  uint8_t bits = 0;
};
struct e5m2 {
  uint8_t bits = 0;
};

constexpr float fp8_max(Fp8Format f) {
  return f == Fp8Format::e4m3 ? 448.0f : 57344.0f;
}

// Decode one fp8 code to float (exact).
float fp8_to_float(uint8_t code, Fp8Format fmt);
// Encode a float as an fp8 code (round to nearest even, saturation as above).
uint8_t float_to_fp8(float x, Fp8Format fmt, Saturate sat = Saturate::finite);
// Round a float to the nearest representable fp8 value and return it as a float.
inline float round_fp8(float x, Fp8Format fmt, Saturate sat = Saturate::finite) {
  return fp8_to_float(float_to_fp8(x, fmt, sat), fmt);
}

inline float to_float(e4m3 v) {
  return fp8_to_float(v.bits, Fp8Format::e4m3);
}
inline float to_float(e5m2 v) {
  return fp8_to_float(v.bits, Fp8Format::e5m2);
}

}  // namespace hlm
