#include "core/memory.h"

#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <fstream>
#include <limits>

#include "core/error.h"

namespace hlm {

int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  HLM_CHECK(a >= 0 && b >= 0, "{}: negative operand in {} * {}", what, a, b);
  int64_t r = 0;
  HLM_CHECK(!__builtin_mul_overflow(a, b, &r), "{} overflows: {} * {} exceeds 2^63", what, a, b);
  return r;
}

int64_t checked_add(int64_t a, int64_t b, const char* what) {
  HLM_CHECK(a >= 0 && b >= 0, "{}: negative operand in {} + {}", what, a, b);
  int64_t r = 0;
  HLM_CHECK(!__builtin_add_overflow(a, b, &r), "{} overflows: {} + {} exceeds 2^63", what, a, b);
  return r;
}

uint64_t checked_mul_u(uint64_t a, uint64_t b, const char* what) {
  uint64_t r = 0;
  HLM_CHECK(!__builtin_mul_overflow(a, b, &r), "{} overflows: {} * {} exceeds 2^64", what, a, b);
  return r;
}

uint64_t checked_add_u(uint64_t a, uint64_t b, const char* what) {
  uint64_t r = 0;
  HLM_CHECK(!__builtin_add_overflow(a, b, &r), "{} overflows: {} + {} exceeds 2^64", what, a, b);
  return r;
}

uint64_t parse_byte_size(const std::string& text, const std::string& what) {
  size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  const size_t start = i;
  uint64_t v = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
    v = checked_add_u(checked_mul_u(v, 10, what.c_str()), uint64_t(text[i] - '0'), what.c_str());
    ++i;
  }
  HLM_CHECK(i > start, "{}: '{}' is not a byte count (expected e.g. 16G, 512M or 1073741824)", what,
            text);
  uint64_t mult = 1;
  if (i < text.size()) {
    switch (std::toupper(static_cast<unsigned char>(text[i]))) {
      case 'K':
        mult = uint64_t(1) << 10;
        break;
      case 'M':
        mult = uint64_t(1) << 20;
        break;
      case 'G':
        mult = uint64_t(1) << 30;
        break;
      case 'T':
        mult = uint64_t(1) << 40;
        break;
      default:
        HLM_FAIL("{}: '{}' has an unknown unit (expected K, M, G or T)", what, text);
    }
    ++i;
    if (i < text.size() && (text[i] == 'i' || text[i] == 'I')) ++i;
    if (i < text.size() && (text[i] == 'b' || text[i] == 'B')) ++i;
  }
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  HLM_CHECK(i == text.size(), "{}: '{}' is not a byte count (expected e.g. 16G, 512M)", what, text);
  const uint64_t r = checked_mul_u(v, mult, what.c_str());
  HLM_CHECK(r > 0, "{}: the limit must be > 0, got '{}'", what, text);
  return r;
}

namespace {

uint64_t physical_memory() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return std::numeric_limits<uint64_t>::max();
  return uint64_t(pages) * uint64_t(page);
}

// cgroup v2 memory.max of this process ("max" or unreadable: no limit).
uint64_t cgroup_memory_max() {
  std::ifstream f("/sys/fs/cgroup/memory.max");
  std::string s;
  if (!(f >> s) || s.empty() || s == "max") return std::numeric_limits<uint64_t>::max();
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::numeric_limits<uint64_t>::max();
    if (v > (std::numeric_limits<uint64_t>::max() - 9) / 10)
      return std::numeric_limits<uint64_t>::max();
    v = v * 10 + uint64_t(c - '0');
  }
  return v > 0 ? v : std::numeric_limits<uint64_t>::max();
}

uint64_t system_limit() {
  const uint64_t a = physical_memory(), b = cgroup_memory_max();
  return a < b ? a : b;
}

}  // namespace

uint64_t memory_limit() {
  // The environment is read on every call (cheap next to an allocation), the system once.
  if (const char* env = std::getenv("HLM_MEMORY_LIMIT"); env && *env)
    return parse_byte_size(env, "HLM_MEMORY_LIMIT");
  static const uint64_t limit = system_limit();
  return limit;
}

std::string format_bytes(double bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 6) bytes /= 1024.0, ++u;
  return u == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.2f} {}", bytes, units[u]);
}

void check_memory(uint64_t bytes, const std::string& what) {
  const uint64_t limit = memory_limit();
  HLM_CHECK(bytes <= limit,
            "{} needs {} bytes ({}), more than the memory limit of {} bytes ({}; set "
            "HLM_MEMORY_LIMIT to change it)",
            what, bytes, format_bytes(double(bytes)), limit, format_bytes(double(limit)));
}

}  // namespace hlm
