// The `hybridlm` command's plumbing. Each subcommand file registers itself with a static
// Registrar, so adding a command is adding one file to src/cli/.
//   - top-level commands (train, generate, forward, bench, op, inspect, ...): register_command
//   - `hybridlm op NAME`: register_op; NAME reads --in IN.safetensors and writes --out OUT.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

#include "core/safetensors.h"

namespace hlm::cli {

// A command adds its options to `app` and returns the action to run when it was selected.
using Setup = std::function<std::function<void()>(CLI::App& app)>;

struct Entry {
  std::string name, help;
  Setup setup;
};
std::vector<Entry>& commands();
std::vector<Entry>& ops();

struct Registrar {
  Registrar(std::vector<Entry>& (*list)(), std::string name, std::string help, Setup setup) {
    list().push_back({std::move(name), std::move(help), std::move(setup)});
  }
};

#define HLM_CONCAT2(a, b) a##b
#define HLM_CONCAT(a, b) HLM_CONCAT2(a, b)
#define HLM_REGISTER_COMMAND(name, help, setup)                                                  \
  static ::hlm::cli::Registrar HLM_CONCAT(hlm_cmd_, __LINE__)(&::hlm::cli::commands, name, help, \
                                                              setup)
#define HLM_REGISTER_OP(name, help, setup) \
  static ::hlm::cli::Registrar HLM_CONCAT(hlm_op_, __LINE__)(&::hlm::cli::ops, name, help, setup)

// Thrown by an action to end the command with this exit status (after its own message), e.g. 130
// when a training run was interrupted by Ctrl-C and checkpointed.
struct ExitStatus {
  int code;
};

// --option validators (CLI11 runs them on the text, before the conversion):
//   count_range(lo, hi): a decimal integer in [lo, hi]; a number that does not fit, or one out of
//     range, is refused with both bounds (instead of CLI11's saturation at INT64_MAX).
//   input_file(): an existing path must be a regular file (a FIFO, device, socket or directory is
//     refused at once instead of blocking or failing later); a missing one is left to the command.
CLI::Validator count_range(int64_t lo, int64_t hi);
CLI::Validator input_file();

// ---- helpers for `hybridlm op` ----
// The input tensors of an op, with checks that name the tensor and the file.
class OpInputs {
 public:
  OpInputs(const std::string& path);
  const Tensor& get(const std::string& name) const;  // error if missing
  bool has(const std::string& name) const { return c_.tensors.count(name) > 0; }
  // The tensor as a contiguous f32 or f64 CPU tensor (f64 stays f64; everything else -> f32).
  Tensor floating(const std::string& name) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  safetensors::Contents c_;
};

}  // namespace hlm::cli
