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

std::string oniguruma_spaces(const std::string& pattern) {
  // Oniguruma's \s (Ruby syntax, UTF-8) is the Unicode White_Space property, which includes
  // U+0085; PCRE2's \s with UCP is the Z categories plus \t \n \v \f \r, which does not.
  // Both \s and \S become the property, inside classes too. \Q...\E stays literal.
  std::string out;
  out.reserve(pattern.size() + 32);
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c != '\\' || i + 1 >= pattern.size()) {
      out += c;
      continue;
    }
    const char n = pattern[++i];
    if (n == 's') {
      out += "\\p{White_Space}";
    } else if (n == 'S') {
      out += "\\P{White_Space}";
    } else if (n == 'Q') {
      const size_t e = pattern.find("\\E", i + 1);
      const size_t end = e == std::string::npos ? pattern.size() : e + 2;
      out.append(pattern, i - 1, end - (i - 1));
      i = end - 1;
    } else {
      out += c;
      out += n;
    }
  }
  return out;
}

Regex::Regex(const std::string& pattern, bool literal, const std::string& what)
    : code_(std::make_unique<Code>()), pattern_(pattern), what_(what) {
  if (literal && pattern.empty()) return;  // matches nothing (see find_all)
  uint32_t opts = PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE;
  if (literal) opts = PCRE2_UTF | PCRE2_LITERAL;
  const std::string compiled = literal ? pattern : oniguruma_spaces(pattern);
  int err = 0;
  PCRE2_SIZE off = 0;
  code_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(compiled.data()), compiled.size(), opts,
                              &err, &off, nullptr);
  if (!code_->code)
    throw Error(fmt::format("{}: the pattern \"{}\" does not compile: {} (at offset {} of \"{}\")",
                            what, printable(pattern), pcre2_message(err), off,
                            printable(compiled)));
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
