// The pre-tokenizers' patterns, run by PCRE2 (Debian's libpcre2-8) in UTF mode with Unicode
// properties for \d, \w and the POSIX classes (PCRE2_UCP), JIT-compiled where PCRE2 has a JIT
// for the machine. Hugging Face `tokenizers` runs these patterns with Oniguruma (Ruby syntax); the
// constructs of the byte-level BPE pre-tokenizers (\p{L}, \p{N}, classes, (?i:...), {m,n},
// look-ahead) mean the same in both, \s and \S are rewritten to Oniguruma's meaning (the Unicode
// White_Space property, see oniguruma_spaces), and ^ and $ match at line boundaries as in Ruby.
// Ruby-only syntax (\h as a hex digit, (?m) as dot-all) is not translated. docs/tokenizer.md.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace hlm::tokenizer {

// `pattern` with \s and \S written as \p{White_Space} and \P{White_Space} (outside \Q...\E).
std::string oniguruma_spaces(const std::string& pattern);

class Regex {
 public:
  // `literal`: the pattern is a plain string to look for. A pattern PCRE2 does not compile is an
  // hlm::Error naming `what`, PCRE2's message and the offset.
  Regex(const std::string& pattern, bool literal, const std::string& what);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // The [begin, end) byte spans of the successive matches in `text` (well-formed UTF-8: the
  // caller checked), appended to `out`. An empty match is kept unless it ends where the previous
  // match ended, and the search goes on one character after it.
  void find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const;

  bool jit() const { return jit_; }
  const std::string& pattern() const { return pattern_; }

 private:
  struct Code;
  std::unique_ptr<Code> code_;
  std::string pattern_, what_;
  bool jit_ = false;
};

}  // namespace hlm::tokenizer
