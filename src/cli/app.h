// The `hybridlm` command line, apart from main() so that the fuzz target of the argument parser
// (fuzz/cli_args_fuzz.cpp) parses exactly what the command parses.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace hlm::cli {

// Adds every registered command and op to `app`; selecting one stores its action in *action.
void build_app(CLI::App& app, std::function<void()>* action);

// Parses argv. Returns -1 when an action is to run (*action set: the selected command, or
// `hybridlm train` on its defaults when none was named), else the exit status (0 after --help,
// 2 after a parse error, with its one-line message on stderr).
int parse_command_line(CLI::App& app, int argc, const char* const* argv,
                       std::function<void()>* action);

// Runs the action and maps what it throws to the exit status (docs/robustness.md, "Exit
// status"): 0 done; 2 with one line "hybridlm: error: ..." for every error a user can cause (bad
// input, an I/O or file-system failure, not enough memory); ExitStatus's code (130 / 143 after an
// interrupted training run); 1 with "hybridlm: internal error: ..." for anything else, a bug.
int run_action(const std::function<void()>& action);

}  // namespace hlm::cli
