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
#define HLM_DTYPE_OF(T, DT)                   \
  template <>                                 \
  struct dtype_of<T> {                        \
    static constexpr DType value = DType::DT; \
  }
HLM_DTYPE_OF(double, f64);
HLM_DTYPE_OF(float, f32);
HLM_DTYPE_OF(bf16, bf16);
HLM_DTYPE_OF(f16, f16);
HLM_DTYPE_OF(e4m3, e4m3);
HLM_DTYPE_OF(e5m2, e5m2);
HLM_DTYPE_OF(int64_t, i64);
HLM_DTYPE_OF(int32_t, i32);
HLM_DTYPE_OF(uint8_t, u8);
#undef HLM_DTYPE_OF

// Convert n contiguous elements between any two dtypes (CPU memory). Floating conversions round to
// nearest even (fp8 saturating to finite); float -> integer truncates toward zero.
void convert_elements(const void* src, DType src_dt, void* dst, DType dst_dt, size_t n);

}  // namespace hlm
