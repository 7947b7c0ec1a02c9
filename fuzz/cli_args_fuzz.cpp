// libFuzzer target: the `hybridlm` argument parser (cli/app.h), exactly as the command builds it.
// The input is argv[1..], split at NUL bytes. Parsing must succeed or raise CLI11's ParseError
// (which the command prints as one line and exits 2); the selected command is not run. Anything
// else (another exception from a validator, a crash) is a bug. scripts/fuzz.sh runs it.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "cli/app.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> args{"hybridlm"};
  std::string cur;
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == 0) {
      args.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(char(data[i]));
    }
  }
  if (!cur.empty()) args.push_back(cur);
  if (args.size() > 64) return 0;
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  CLI::App app{"hybridlm"};
  std::function<void()> action;
  hlm::cli::build_app(app, &action);
  try {
    app.parse(int(argv.size()), argv.data());
  } catch (const CLI::ParseError&) {  // --help and friends are ParseErrors too
  }
  return 0;
}
