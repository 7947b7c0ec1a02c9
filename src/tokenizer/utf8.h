// UTF-8 helpers of the tokenizer: validation, walking code points, and the lossy conversion of
// arbitrary bytes to text that Hugging Face `tokenizers` applies when it decodes (Rust's
// String::from_utf8_lossy: each maximal ill-formed subsequence becomes one U+FFFD).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace hlm::tokenizer {

// Length of the well-formed UTF-8 sequence at s[i] (RFC 3629: no overlong forms, no surrogates,
// nothing above U+10FFFF), or 0 when the bytes there are not one. i < s.size().
size_t utf8_sequence_length(std::string_view s, size_t i);

// Byte offset of the first byte that is not part of a well-formed sequence, or -1.
int64_t first_invalid_utf8(std::string_view s);

// The code point of the well-formed sequence of `len` bytes at s[i].
uint32_t utf8_decode(std::string_view s, size_t i, size_t len);

// Appends the UTF-8 encoding of the code point cp (<= U+10FFFF, not a surrogate).
void utf8_append(std::string& out, uint32_t cp);

// `bytes` as text: well-formed sequences as they are, each maximal ill-formed subsequence (the
// longest prefix of a well-formed sequence, at least one byte) replaced by U+FFFD.
std::string utf8_lossy(std::string_view bytes);

}  // namespace hlm::tokenizer
