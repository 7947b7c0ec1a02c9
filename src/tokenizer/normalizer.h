// The normalizers of a tokenizer.json this tokenizer runs: none, or Unicode NFC (canonical
// decomposition, then canonical composition), computed by ICU (Debian's libicu-dev).
#pragma once

#include <string>
#include <string_view>

namespace hlm::tokenizer {

// `text` (well-formed UTF-8) in Normalization Form C.
std::string nfc(std::string_view text);

}  // namespace hlm::tokenizer
