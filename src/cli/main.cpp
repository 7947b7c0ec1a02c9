// hybridlm: the command. `hybridlm --help` lists the commands; every error a user can cause
// (bad options, bad files, bad shapes, I/O and memory failures) prints one line and exits with
// status 2 (cli/app.h, docs/robustness.md).
#include "cli/app.h"

int main(int argc, char** argv) {
  using namespace hlm::cli;
  CLI::App app{"hybridlm: train and run hybrid KDA / DSA language models"};
  std::function<void()> action;
  build_app(app, &action);
  const int parsed = parse_command_line(app, argc, argv, &action);
  if (parsed >= 0) return parsed;
  return run_action(action);
}
