#include "tokenizer/utf8.h"

namespace hlm::tokenizer {
namespace {

// The bytes a well-formed sequence starting with `lead` may have in its second position
// (Unicode 15, table 3-7); the later positions take 0x80..0xBF. len 0: `lead` starts none.
struct Lead {
  size_t len;
  uint8_t lo, hi;
};
Lead lead_of(uint8_t c) {
  if (c < 0x80) return {1, 0, 0};
  if (c >= 0xc2 && c <= 0xdf) return {2, 0x80, 0xbf};
  if (c == 0xe0) return {3, 0xa0, 0xbf};
  if (c == 0xed) return {3, 0x80, 0x9f};
  if (c >= 0xe1 && c <= 0xef) return {3, 0x80, 0xbf};
  if (c == 0xf0) return {4, 0x90, 0xbf};
  if (c >= 0xf1 && c <= 0xf3) return {4, 0x80, 0xbf};
  if (c == 0xf4) return {4, 0x80, 0x8f};
  return {0, 0, 0};
}

// Bytes of s from i that belong to the (possibly incomplete) sequence started there: the length
// of the well-formed sequence when there is one (*ok = true), else the length of the maximal
// ill-formed subsequence (>= 1).
size_t scan(std::string_view s, size_t i, bool* ok) {
  const Lead l = lead_of(uint8_t(s[i]));
  *ok = false;
  if (l.len == 0) return 1;
  if (l.len == 1) return *ok = true, 1;
  for (size_t k = 1; k < l.len; ++k) {
    if (i + k >= s.size()) return k;
    const uint8_t b = uint8_t(s[i + k]);
    const uint8_t lo = k == 1 ? l.lo : 0x80, hi = k == 1 ? l.hi : 0xbf;
    if (b < lo || b > hi) return k;
  }
  *ok = true;
  return l.len;
}

}  // namespace

size_t utf8_sequence_length(std::string_view s, size_t i) {
  bool ok;
  const size_t n = scan(s, i, &ok);
  return ok ? n : 0;
}

int64_t first_invalid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (uint8_t(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t n = utf8_sequence_length(s, i);
    if (n == 0) return int64_t(i);
    i += n;
  }
  return -1;
}

uint32_t utf8_decode(std::string_view s, size_t i, size_t len) {
  const uint8_t c = uint8_t(s[i]);
  if (len == 1) return c;
  uint32_t cp = c & (len == 2 ? 0x1f : len == 3 ? 0x0f : 0x07);
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (uint8_t(s[i + k]) & 0x3f);
  return cp;
}

void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xc0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += char(0xe0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3f));
    out += char(0x80 | (cp & 0x3f));
  } else {
    out += char(0xf0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3f));
    out += char(0x80 | ((cp >> 6) & 0x3f));
    out += char(0x80 | (cp & 0x3f));
  }
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    bool ok;
    const size_t n = scan(bytes, i, &ok);
    if (ok)
      out.append(bytes.data() + i, n);
    else
      out += "\xef\xbf\xbd";  // U+FFFD
    i += n;
  }
  return out;
}

}  // namespace hlm::tokenizer
