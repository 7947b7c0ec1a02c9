#include "tokenizer/normalizer.h"

#include <unicode/normalizer2.h>
#include <unicode/unistr.h>

#include "core/error.h"

namespace hlm::tokenizer {

std::string nfc(std::string_view text) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* n = icu::Normalizer2::getNFCInstance(status);
  if (U_FAILURE(status))
    throw Error(
        fmt::format("tokenizer: ICU's NFC normalizer is not available ({})", u_errorName(status)));
  const icu::UnicodeString in =
      icu::UnicodeString::fromUTF8(icu::StringPiece(text.data(), int32_t(text.size())));
  // Most text is in NFC already: then it is returned as it is.
  if (n->quickCheck(in, status) == UNORM_YES && U_SUCCESS(status)) return std::string(text);
  status = U_ZERO_ERROR;
  const icu::UnicodeString out = n->normalize(in, status);
  if (U_FAILURE(status))
    throw Error(fmt::format("tokenizer: NFC normalization failed ({})", u_errorName(status)));
  std::string s;
  out.toUTF8String(s);
  return s;
}

}  // namespace hlm::tokenizer
