// The byte-level alphabet of GPT-2 style BPE: each of the 256 byte values is written as one
// printable Unicode character, so that any byte string is a string of "characters" a BPE
// vocabulary can hold. By definition (Radford et al. 2019, the GPT-2 encoder):
//   the bytes '!'..'~' (0x21..0x7E), 0xA1..0xAC and 0xAE..0xFF stand for the code point of the
//   same value; the other 68 bytes (0x00..0x20, 0x7F..0xA0, 0xAD), in increasing order, stand for
//   U+0100, U+0101, ... U+0143 (so the space 0x20 is U+0120 'Ġ' and the newline 0x0A is U+010A
//   'Ċ').
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace hlm::tokenizer {

class ByteLevelAlphabet {
 public:
  static const ByteLevelAlphabet& get();

  // The code point byte b stands for.
  uint32_t code_point(uint8_t b) const { return cp_[b]; }
  // The byte the code point cp stands for, or nullopt when cp is not in the alphabet.
  std::optional<uint8_t> byte_of(uint32_t cp) const {
    if (cp >= byte_of_.size() || byte_of_[cp] < 0) return std::nullopt;
    return uint8_t(byte_of_[cp]);
  }
  // Appends the characters (UTF-8) of every byte of `bytes` to `out`.
  void encode(std::string_view bytes, std::string& out) const;
  // The bytes the characters of the UTF-8 string `text` stand for; nullopt when one of them is
  // not in the alphabet (or `text` is not well-formed UTF-8).
  std::optional<std::string> decode(std::string_view text) const;

 private:
  ByteLevelAlphabet();
  std::array<uint32_t, 256> cp_{};
  std::array<std::string, 256> utf8_;  // cp_[b] as UTF-8
  std::array<int16_t, 0x144> byte_of_{};
};

}  // namespace hlm::tokenizer
