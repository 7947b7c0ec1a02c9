#include "core/error.h"

#include <cstdint>
#include <cstring>

namespace hlm {

void throw_error(const char* file, int line, const std::string& msg) {
  const char* base = std::strrchr(file, '/');
  throw Error(fmt::format("{}:{}: {}", base ? base + 1 : file, line, msg));
}

namespace {
// Length of the well-formed UTF-8 sequence at s[i] (RFC 3629: no overlong forms, no
// surrogates, nothing above U+10FFFF), 0 when there is none.
size_t utf8_length(const std::string& s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  size_t len;
  uint32_t cp;
  if (c < 0x80) return 1;
  if ((c & 0xe0) == 0xc0)
    len = 2, cp = c & 0x1f;
  else if ((c & 0xf0) == 0xe0)
    len = 3, cp = c & 0x0f;
  else if ((c & 0xf8) == 0xf0)
    len = 4, cp = c & 0x07;
  else
    return 0;
  if (i + len > s.size()) return 0;
  for (size_t k = 1; k < len; ++k) {
    if ((b(i + k) & 0xc0) != 0x80) return 0;
    cp = (cp << 6) | (b(i + k) & 0x3f);
  }
  const uint32_t min_cp = len == 2 ? 0x80 : len == 3 ? 0x800 : 0x10000;
  if (cp < min_cp || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
  return len;
}
}  // namespace

std::string printable(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    const size_t len = utf8_length(text, i);
    const bool c1 = len == 2 && c == 0xc2 && static_cast<unsigned char>(text[i + 1]) < 0xa0;
    if (len == 0 || c < 0x20 || c == 0x7f || c1) {
      for (size_t k = 0; k < (c1 ? 2 : 1); ++k)
        out += fmt::format("\\x{:02x}", static_cast<unsigned char>(text[i + k]));
      i += c1 ? 2 : 1;
    } else {
      out.append(text, i, len);
      i += len;
    }
  }
  return out;
}

}  // namespace hlm
