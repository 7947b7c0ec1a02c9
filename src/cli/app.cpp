#include "cli/app.h"

#include <charconv>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <new>
#include <nlohmann/json.hpp>
#include <system_error>

#include "cli/command.h"
#include "core/error.h"
#include "core/file_io.h"
#include "dist/comm.h"

namespace hlm::cli {

std::vector<Entry>& commands() {
  static std::vector<Entry> list;
  return list;
}
std::vector<Entry>& ops() {
  static std::vector<Entry> list;
  return list;
}

CLI::Validator count_range(int64_t lo, int64_t hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        int64_t v = 0;
        const char* b = text.data();
        const char* e = b + text.size();
        const auto [p, ec] = std::from_chars(b, e, v);
        if (ec == std::errc::result_out_of_range)
          return fmt::format("{} is out of range: expected an integer in [{}, {}]", text, lo, hi);
        if (ec != std::errc() || p != e || text.empty())
          return fmt::format("{} is not an integer (expected one in [{}, {}])", text, lo, hi);
        if (v < lo || v > hi)
          return fmt::format("{} is out of range: expected an integer in [{}, {}]", text, lo, hi);
        return std::string();
      },
      fmt::format("INT in [{}, {}]", lo, hi));
}

CLI::Validator input_file() {
  return CLI::Validator(
      [](std::string& path) -> std::string {
        const std::string kind = file_kind(path);
        if (kind == "missing" || kind == "a regular file") return std::string();
        try {
          check_regular_input(path, "input");
        } catch (const Error& e) {
          // The library's message without its file:line prefix.
          const std::string m = e.what();
          const size_t colon = m.find(": ");
          return colon == std::string::npos ? m : m.substr(colon + 2);
        }
        return std::string();
      },
      "FILE");
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

namespace {
void print_error(const char* kind, const std::string& what) {
  std::fprintf(stderr, "hybridlm: %s%s\n", kind, printable(what).c_str());
}
}  // namespace

void build_app(CLI::App& app, std::function<void()>* action) {
  app.require_subcommand(0, 1);
  for (auto& e : commands()) {
    CLI::App* sub = app.add_subcommand(e.name, e.help);
    auto run = e.setup(*sub);
    sub->callback([action, run] { *action = run; });
  }
  CLI::App* op = app.add_subcommand("op", "run one op on tensors from a safetensors file");
  op->require_subcommand(1);
  for (auto& e : ops()) {
    CLI::App* sub = op->add_subcommand(e.name, e.help);
    auto run = e.setup(*sub);
    sub->callback([action, run] { *action = run; });
  }
}

int parse_command_line(CLI::App& app, int argc, const char* const* argv,
                       std::function<void()>* action) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::Success& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    print_error("", e.what());
    return 2;
  }
  if (!*action) {
    // No command: the built-in main job (see README), `hybridlm train` on its defaults.
    for (auto& e : commands())
      if (e.name == "train") {
        CLI::App tmp;
        *action = e.setup(tmp);
      }
    if (!*action) {
      std::puts(app.help().c_str());
      return 0;
    }
  }
  return -1;
}

namespace {
int run_action_in_process(const std::function<void()>& action) {
  try {
    action();
  } catch (const ExitStatus& e) {
    return e.code;
  } catch (const hlm::Error& e) {
    print_error("error: ", e.what());
    return 2;
  } catch (const std::bad_alloc&) {
    print_error("error: ",
                "out of memory: an allocation failed (lower the sizes, or see HLM_MEMORY_LIMIT "
                "in docs/robustness.md)");
    return 2;
  } catch (const std::filesystem::filesystem_error& e) {
    print_error("error: ", e.what());
    return 2;
  } catch (const std::system_error& e) {  // I/O and other operating-system failures
    print_error("error: ", e.what());
    return 2;
  } catch (const nlohmann::json::exception& e) {  // a JSON value of an unexpected type
    print_error("error: ", e.what());
    return 2;
  } catch (const std::exception& e) {
    print_error("internal error: ", e.what());
    return 1;
  }
  return 0;
}

}  // namespace

int run_action(const std::function<void()>& action) {
  const int status = run_action_in_process(action);
  // An error in one process of an MPI job ends them all (the others may wait in a collective);
  // an interrupt (128 + signal) reaches every rank at the same step and ends each one normally.
  if (status == 1 || status == 2) dist::end_job_on_error(status);
  return status;
}

}  // namespace hlm::cli
