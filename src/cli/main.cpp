// hybridlm: the command. `hybridlm --help` lists the commands; every error a user can cause
// (bad options, bad files, bad shapes) prints one line and exits with status 2.
#include <cstdio>
#include <exception>

#include "cli/command.h"
#include "core/error.h"

namespace hlm::cli {

std::vector<Entry>& commands() {
  static std::vector<Entry> list;
  return list;
}
std::vector<Entry>& ops() {
  static std::vector<Entry> list;
  return list;
}

OpInputs::OpInputs(const std::string& path) : path_(path), c_(safetensors::load(path)) {}

const Tensor& OpInputs::get(const std::string& name) const {
  auto it = c_.tensors.find(name);
  HLM_CHECK(it != c_.tensors.end(), "{}: missing input tensor '{}'", path_, name);
  return it->second;
}

Tensor OpInputs::floating(const std::string& name) const {
  const Tensor& t = get(name);
  HLM_CHECK(is_floating(t.dtype()), "{}: tensor '{}' must be floating point, got {}", path_, name,
            dtype_name(t.dtype()));
  return t.dtype() == DType::f64 ? t.contiguous() : t.to(DType::f32);
}

}  // namespace hlm::cli

int main(int argc, char** argv) {
  using namespace hlm::cli;
  CLI::App app{"hybridlm: train and run hybrid KDA / DSA language models"};
  app.require_subcommand(0, 1);
  std::function<void()> action;

  for (auto& e : commands()) {
    CLI::App* sub = app.add_subcommand(e.name, e.help);
    auto run = e.setup(*sub);
    sub->callback([&action, run] { action = run; });
  }
  CLI::App* op = app.add_subcommand("op", "run one op on tensors from a safetensors file");
  op->require_subcommand(1);
  for (auto& e : ops()) {
    CLI::App* sub = op->add_subcommand(e.name, e.help);
    auto run = e.setup(*sub);
    sub->callback([&action, run] { action = run; });
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::Success& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "hybridlm: %s\n", e.what());
    return 2;
  }
  if (!action) {
    // No command: the built-in main job (see README), `hybridlm train` on its defaults.
    for (auto& e : commands())
      if (e.name == "train") {
        CLI::App tmp;
        action = e.setup(tmp);
      }
    if (!action) {
      std::puts(app.help().c_str());
      return 0;
    }
  }
  try {
    action();
  } catch (const hlm::Error& e) {
    std::fprintf(stderr, "hybridlm: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hybridlm: internal error: %s\n", e.what());
    return 1;
  }
  return 0;
}
