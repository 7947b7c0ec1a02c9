#include "core/checksum.h"

#include <fmt/format.h>

#include <array>
#include <cstring>

namespace hlm {
namespace {

constexpr uint64_t kPoly = 0xc96c5795d7870f42ull;  // 0x42f0e1eba9ea3693 bit-reversed

// tables[k][b]: the CRC contribution of byte b followed by k zero bytes (slicing by 8).
struct Tables {
  std::array<std::array<uint64_t, 256>, 8> t{};
  Tables() {
    for (uint64_t b = 0; b < 256; ++b) {
      uint64_t c = b;
      for (int i = 0; i < 8; ++i) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][b] = c;
    }
    for (int k = 1; k < 8; ++k)
      for (int b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xff];
  }
};

const Tables& tables() {
  static const Tables tb;
  return tb;
}

}  // namespace

uint64_t crc64(const void* data, size_t n, uint64_t crc) {
  const auto& t = tables().t;
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t c = ~crc;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);  // little-endian hosts (x86-64, aarch64)
    c ^= w;
    c = t[7][c & 0xff] ^ t[6][(c >> 8) & 0xff] ^ t[5][(c >> 16) & 0xff] ^ t[4][(c >> 24) & 0xff] ^
        t[3][(c >> 32) & 0xff] ^ t[2][(c >> 40) & 0xff] ^ t[1][(c >> 48) & 0xff] ^
        t[0][(c >> 56) & 0xff];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xff];
  return ~c;
}

std::string crc64_hex(uint64_t crc) {
  return fmt::format("{:016x}", crc);
}

}  // namespace hlm
