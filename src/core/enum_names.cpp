#include "core/enum_names.h"

#include <fmt/format.h>

#include <string>

#include "core/error.h"

namespace hlm::detail {

void enum_parse_fail(std::string_view what, std::string_view s, const char* const* names,
                     size_t n) {
  std::string list;
  for (size_t i = 0; i < n; ++i) {
    if (i) list += ", ";
    list += names[i];
  }
  HLM_FAIL("unknown {} '{}': expected one of {}", what, s, list);
}

}  // namespace hlm::detail
