// DType: the element types a Tensor can hold, and Device: where its storage lives.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/formats.h"

namespace hlm {

enum class DType : uint8_t { f64, f32, bf16, f16, e4m3, e5m2, i64, i32, u8 };
enum class Device : uint8_t { cpu, cuda };

size_t dtype_size(DType dt);
const char* dtype_name(DType dt);          // "f64", "f32", "bf16", ...
DType parse_dtype(std::string_view name);  // accepts our names and "float32", "bfloat16", ...
bool is_floating(DType dt);                // f64, f32, bf16, f16, e4m3, e5m2
// The dtype arithmetic on `dt` runs in: f64 stays f64, every other dtype computes in f32 (the
// rule of every op, layer, gradient and optimizer state).
inline DType compute_dtype(DType dt) {
  return dt == DType::f64 ? DType::f64 : DType::f32;
}
const char* device_name(Device d);

// The C++ element type of each DType, for Tensor::data<T>().
template <class T>
struct dtype_of;
template <>
struct dtype_of<double> {
  static constexpr DType value = DType::f64;
};
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::f32;
};
template <>
struct dtype_of<bf16> {
  static constexpr DType value = DType::bf16;
};
template <>
struct dtype_of<f16> {
  static constexpr DType value = DType::f16;
};
template <>
struct dtype_of<e4m3> {
  static constexpr DType value = DType::e4m3;
};
template <>
struct dtype_of<e5m2> {
  static constexpr DType value = DType::e5m2;
};
template <>
struct dtype_of<int64_t> {
  static constexpr DType value = DType::i64;
};
template <>
struct dtype_of<int32_t> {
  static constexpr DType value = DType::i32;
};
template <>
struct dtype_of<uint8_t> {
  static constexpr DType value = DType::u8;
};

// Convert n contiguous elements between any two dtypes (CPU memory). Floating conversions round to
// nearest even (fp8 saturating to finite); float -> integer truncates toward zero.
void convert_elements(const void* src, DType src_dt, void* dst, DType dst_dt, size_t n);

}  // namespace hlm
