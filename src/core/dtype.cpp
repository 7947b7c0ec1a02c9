#include "core/dtype.h"

#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "core/enum_names.h"
#include "core/error.h"

namespace hlm {

size_t dtype_size(DType dt) {
  switch (dt) {
    case DType::f64:
    case DType::i64:
      return 8;
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::bf16:
    case DType::f16:
      return 2;
    case DType::e4m3:
    case DType::e5m2:
    case DType::u8:
      return 1;
  }
  HLM_FAIL("unknown dtype {}", int(dt));
}

namespace {

constexpr auto kDTypeNames =
    enum_names<DType::u8>({"f64", "f32", "bf16", "f16", "e4m3", "e5m2", "i64", "i32", "u8"});

}  // namespace

const char* dtype_name(DType dt) {
  return kDTypeNames.name(dt);
}

DType parse_dtype(std::string_view n) {
  // Other spellings (PyTorch's, numpy's) besides our names.
  static constexpr std::pair<const char*, DType> kAliases[] = {
      {"float64", DType::f64},   {"fp64", DType::f64},
      {"float32", DType::f32},   {"fp32", DType::f32},
      {"float", DType::f32},     {"bfloat16", DType::bf16},
      {"float16", DType::f16},   {"fp16", DType::f16},
      {"half", DType::f16},      {"float8_e4m3fn", DType::e4m3},
      {"fp8_e4m3", DType::e4m3}, {"float8_e5m2", DType::e5m2},
      {"fp8_e5m2", DType::e5m2}, {"int64", DType::i64},
      {"int32", DType::i32},     {"uint8", DType::u8}};
  for (const auto& [alias, dt] : kAliases)
    if (n == alias) return dt;
  return kDTypeNames.parse(n, "dtype");
}

bool is_floating(DType dt) {
  return dt != DType::i64 && dt != DType::i32 && dt != DType::u8;
}

const char* device_name(Device d) {
  return d == Device::cpu ? "cpu" : "cuda";
}

namespace {

double load(const void* p, DType dt, size_t i) {
  switch (dt) {
    case DType::f64:
      return static_cast<const double*>(p)[i];
    case DType::f32:
      return static_cast<const float*>(p)[i];
    case DType::bf16:
      return bf16_to_float(static_cast<const bf16*>(p)[i]);
    case DType::f16:
      return f16_to_float(static_cast<const f16*>(p)[i]);
    case DType::e4m3:
      return fp8_to_float(static_cast<const uint8_t*>(p)[i], Fp8Format::e4m3);
    case DType::e5m2:
      return fp8_to_float(static_cast<const uint8_t*>(p)[i], Fp8Format::e5m2);
    case DType::i64:
      return double(static_cast<const int64_t*>(p)[i]);
    case DType::i32:
      return static_cast<const int32_t*>(p)[i];
    case DType::u8:
      return static_cast<const uint8_t*>(p)[i];
  }
  return 0;
}

// A float -> integer conversion truncates toward zero; a value that is NaN or whose truncation
// lies outside the integer type (lo < v < hi, exclusive) has no defined result and is an error.
void check_integral(double v, double lo, double hi, DType dt) {
  HLM_CHECK(v > lo && v < hi, "cannot convert {} to {}: outside the range of the integer type", v,
            dtype_name(dt));
}

// Store a value. Rounding to a narrow float goes through f32 first except for f64 -> f32 itself,
// which is one correctly rounded step; f64 -> bf16 is double-rounded only when the f64 value is
// not an f32 value, which the library never relies on.
void store(void* p, DType dt, size_t i, double v) {
  switch (dt) {
    case DType::f64:
      static_cast<double*>(p)[i] = v;
      break;
    case DType::f32:
      static_cast<float*>(p)[i] = float(v);
      break;
    case DType::bf16:
      static_cast<bf16*>(p)[i] = float_to_bf16(float(v));
      break;
    case DType::f16:
      static_cast<f16*>(p)[i] = float_to_f16(float(v));
      break;
    case DType::e4m3:
      static_cast<uint8_t*>(p)[i] = float_to_fp8(float(v), Fp8Format::e4m3);
      break;
    case DType::e5m2:
      static_cast<uint8_t*>(p)[i] = float_to_fp8(float(v), Fp8Format::e5m2);
      break;
    case DType::i64:
      // 2^63 is the first double above every int64 value.
      check_integral(v, -9223372036854775808.0, 9223372036854775808.0, dt);
      static_cast<int64_t*>(p)[i] = int64_t(v);
      break;
    case DType::i32:
      check_integral(v, -2147483649.0, 2147483648.0, dt);
      static_cast<int32_t*>(p)[i] = int32_t(v);
      break;
    case DType::u8:
      check_integral(v, -1.0, 256.0, dt);
      static_cast<uint8_t*>(p)[i] = uint8_t(v);
      break;
  }
}

}  // namespace

void convert_elements(const void* src, DType sdt, void* dst, DType ddt, size_t n) {
  if (n == 0) return;
  if (sdt == ddt) {
    std::memcpy(dst, src, n * dtype_size(sdt));
    return;
  }
  if (sdt == DType::i64 && ddt == DType::i32) {
    auto s = static_cast<const int64_t*>(src);
    auto d = static_cast<int32_t*>(dst);
    for (size_t i = 0; i < n; ++i) {
      HLM_CHECK(s[i] >= INT32_MIN && s[i] <= INT32_MAX,
                "cannot convert {} to i32: outside the range of the integer type", s[i]);
      d[i] = int32_t(s[i]);
    }
    return;
  }
  if (sdt == DType::i32 && ddt == DType::i64) {
    auto s = static_cast<const int32_t*>(src);
    auto d = static_cast<int64_t*>(dst);
    for (size_t i = 0; i < n; ++i) d[i] = s[i];
    return;
  }
  for (size_t i = 0; i < n; ++i) store(dst, ddt, i, load(src, sdt, i));
}

}  // namespace hlm
