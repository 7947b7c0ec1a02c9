// CRC-64/XZ (ECMA-182 polynomial, reflected, initial value and final xor all ones; the check
// value of "123456789" is 0x995dc9bbdf1939fa): the checksum every safetensors file hybridlm
// writes carries (core/safetensors.h, docs/robustness.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace hlm {

// The CRC of `n` bytes, continuing from `crc`, the CRC of the bytes before them (0 for none):
// crc64(b, nb, crc64(a, na)) == crc64 of a followed by b.
uint64_t crc64(const void* data, size_t n, uint64_t crc = 0);
// 16 lower-case hex digits.
std::string crc64_hex(uint64_t crc);

}  // namespace hlm
