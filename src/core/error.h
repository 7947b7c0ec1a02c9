// hlm::Error and the check macros. Every invalid input the library sees is reported by throwing
// hlm::Error with a message that names the argument and what was expected; the CLI prints it and
// exits with status 2.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace hlm {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

[[noreturn]] void throw_error(const char* file, int line, const std::string& msg);

// `text` made safe for one line of a terminal: valid UTF-8 stays as it is; bytes that are not
// part of a well-formed UTF-8 sequence, control characters (newlines too, and the C1 controls
// U+0080..U+009F) and DEL are written as \xNN, byte by byte. Error messages quote file contents and
// names; the command prints them through this.
std::string printable(const std::string& text);

}  // namespace hlm

// HLM_CHECK(cond, "fmt", args...): throws hlm::Error("file:line: message") when cond is false.
#define HLM_CHECK(cond, ...)                                                       \
  do {                                                                             \
    if (!(cond)) ::hlm::throw_error(__FILE__, __LINE__, fmt::format(__VA_ARGS__)); \
  } while (0)

// HLM_FAIL("fmt", args...): throws unconditionally.
#define HLM_FAIL(...) ::hlm::throw_error(__FILE__, __LINE__, fmt::format(__VA_ARGS__))
