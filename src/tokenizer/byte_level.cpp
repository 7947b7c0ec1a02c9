#include "tokenizer/byte_level.h"

#include "tokenizer/utf8.h"

namespace hlm::tokenizer {

ByteLevelAlphabet::ByteLevelAlphabet() {
  byte_of_.fill(-1);
  const auto printable = [](unsigned b) {
    return (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
  };
  uint32_t next = 0x100;
  for (unsigned b = 0; b < 256; ++b) {
    cp_[b] = printable(b) ? b : next++;
    utf8_append(utf8_[b], cp_[b]);
    byte_of_[cp_[b]] = int16_t(b);
  }
}

const ByteLevelAlphabet& ByteLevelAlphabet::get() {
  static const ByteLevelAlphabet a;
  return a;
}

void ByteLevelAlphabet::encode(std::string_view bytes, std::string& out) const {
  for (char c : bytes) out += utf8_[uint8_t(c)];
}

std::optional<std::string> ByteLevelAlphabet::decode(std::string_view text) const {
  std::string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    const size_t n = utf8_sequence_length(text, i);
    if (n == 0) return std::nullopt;
    const auto b = byte_of(utf8_decode(text, i, n));
    if (!b) return std::nullopt;
    out += char(*b);
    i += n;
  }
  return out;
}

}  // namespace hlm::tokenizer
