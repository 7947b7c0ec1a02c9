#include "tokenizer/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "core/error.h"
#include "tokenizer/utf8.h"

namespace hlm::tokenizer {

struct Regex::Code {
  pcre2_code* code = nullptr;
  ~Code() {
    if (code) pcre2_code_free(code);
  }
};

namespace {
std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  const int n = pcre2_get_error_message(code, buf, sizeof(buf));
  return n < 0 ? fmt::format("PCRE2 error {}", code) : std::string(reinterpret_cast<char*>(buf));
}

struct MatchData {
  pcre2_match_data* md;
  explicit MatchData(const pcre2_code* c) : md(pcre2_match_data_create_from_pattern(c, nullptr)) {
    if (!md) throw std::bad_alloc();
  }
  ~MatchData() { pcre2_match_data_free(md); }
};
}  // namespace

Regex::Regex(const std::string& pattern, bool literal, const std::string& what)
    : code_(std::make_unique<Code>()), pattern_(pattern), what_(what), literal_(literal) {
  if (literal && pattern.empty()) return;  // matches nothing (see find_all)
  uint32_t opts = PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE;
  if (literal) opts = PCRE2_UTF | PCRE2_LITERAL;
  int err = 0;
  PCRE2_SIZE off = 0;
  code_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), opts,
                              &err, &off, nullptr);
  if (!code_->code)
    throw Error(fmt::format("{}: the pattern \"{}\" does not compile: {} (at offset {})", what,
                            printable(pattern), pcre2_message(err), off));
  jit_ = pcre2_jit_compile(code_->code, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() = default;

void Regex::find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const {
  if (!code_->code) return;
  MatchData m(code_->code);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t start = 0, last_end = std::string_view::npos;
  while (start <= text.size()) {
    const int rc =
        pcre2_match(code_->code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, m.md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0)
      throw Error(fmt::format("{}: matching the pattern \"{}\" failed: {}", what_,
                              printable(pattern_), pcre2_message(rc)));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(m.md);
    const size_t b = ov[0], e = ov[1];
    if (b == e) {
      if (e != last_end) out.emplace_back(b, e);
      if (e >= text.size()) break;
      const size_t n = utf8_sequence_length(text, e);
      start = e + (n == 0 ? 1 : n);
    } else {
      out.emplace_back(b, e);
      start = e;
    }
    last_end = e;
  }
}

}  // namespace hlm::tokenizer
