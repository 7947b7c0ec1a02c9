#include "core/error.h"

#include <cstring>

namespace hlm {

void throw_error(const char* file, int line, const std::string& msg) {
  const char* base = std::strrchr(file, '/');
  throw Error(fmt::format("{}:{}: {}", base ? base + 1 : file, line, msg));
}

}  // namespace hlm
