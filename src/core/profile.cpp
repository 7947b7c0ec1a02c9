#include "core/profile.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "core/device.h"

#ifdef HLM_CUDA_EMU
#include "cuda_emu.h"  // the emulation's launch and cuBLAS counters
#endif

namespace hlm::profile {
namespace {

struct Node {
  const char* name = "";
  int parent = -1, depth = 0;
  std::vector<int> children;
  int64_t calls = 0, total_ns = 0;
  int64_t launches = 0, blas = 0;                        // CUDA emulation only
  std::vector<std::pair<std::string, int64_t>> kernels;  // by name (HLM_PROFILE_KERNELS=1)
};

// Whether scopes also keep their launches by kernel name (the emulation, HLM_PROFILE_KERNELS=1).
bool keeps_kernels() {
  static const bool on = [] {
    const char* v = std::getenv("HLM_PROFILE_KERNELS");
    return counts_launches() && v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return on;
}

struct State {
  int mode = -1;  // a Mode, or -1: HLM_PROFILE not read yet
  std::thread::id owner;
  bool owned = false;
  std::vector<Node> nodes;
  std::vector<int> roots;
  int current = -1;
};

State& state() {
  static State s;
  return s;
}

// Kernel launches and cuBLAS calls so far (the CUDA emulation counts them; elsewhere 0).
void counters(int64_t& launches, int64_t& blas) {
#ifdef HLM_CUDA_EMU
  launches = int64_t(::hlm::emu::kernel_launches());
  blas = int64_t(::hlm::emu::blas_calls());
#else
  launches = blas = 0;
#endif
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The child of `parent` (-1: a root) named `name`, created on first use. Names compare by content:
// the same literal may have several addresses across translation units.
int child(State& s, int parent, const char* name) {
  std::vector<int>& list = parent < 0 ? s.roots : s.nodes[parent].children;
  for (int i : list)
    if (std::strcmp(s.nodes[i].name, name) == 0) return i;
  Node n;
  n.name = name;
  n.parent = parent;
  n.depth = parent < 0 ? 0 : s.nodes[parent].depth + 1;
  s.nodes.push_back(n);
  const int id = static_cast<int>(s.nodes.size()) - 1;
  (parent < 0 ? s.roots : s.nodes[parent].children).push_back(id);
  return id;
}

void add_kernel(std::vector<std::pair<std::string, int64_t>>& list, const std::string& name,
                int64_t n) {
  for (auto& [k, c] : list)
    if (k == name) {
      c += n;
      return;
    }
  list.emplace_back(name, n);
}

void walk(const State& s, int id, const std::string& prefix, std::vector<Entry>& out) {
  const Node& n = s.nodes[id];
  Entry e;
  e.path = prefix.empty() ? n.name : prefix + "/" + n.name;
  e.depth = n.depth;
  e.calls = n.calls;
  e.total_ms = n.total_ns * 1e-6;
  e.launches = n.launches;
  e.blas = n.blas;
  int64_t kids = 0;
  for (int c : n.children) kids += s.nodes[c].total_ns;
  e.self_ms = (n.total_ns - kids) * 1e-6;
  // Own launches: the scope's less its children's.
  e.self_kernels = n.kernels;
  for (int c : n.children)
    for (const auto& [name, k] : s.nodes[c].kernels) add_kernel(e.self_kernels, name, -k);
  e.self_kernels.erase(std::remove_if(e.self_kernels.begin(), e.self_kernels.end(),
                                      [](const auto& p) { return p.second <= 0; }),
                       e.self_kernels.end());
  std::stable_sort(e.self_kernels.begin(), e.self_kernels.end(),
                   [](const auto& a, const auto& b) { return a.second > b.second; });
  out.push_back(e);
  for (int c : n.children) walk(s, c, e.path, out);
}

}  // namespace

Mode mode() {
  State& s = state();
  if (s.mode < 0) {
    const char* v = std::getenv("HLM_PROFILE");
    const Mode m = v == nullptr                  ? Mode::off
                   : std::strcmp(v, "1") == 0    ? Mode::device
                   : std::strcmp(v, "host") == 0 ? Mode::host
                                                 : Mode::off;
    s.mode = int(m);
  }
  return Mode(s.mode);
}

void set_mode(Mode m) {
  state().mode = int(m);
}

bool enabled() {
  return mode() != Mode::off;
}

void set_enabled(bool on) {
  set_mode(on ? Mode::device : Mode::off);
}

bool counts_launches() {
#ifdef HLM_CUDA_EMU
  return true;
#else
  return false;
#endif
}

Scope::Scope(const char* name) {
  if (!enabled()) return;
  State& s = state();
  // The first thread that records owns the tree; scopes on other threads are not recorded.
  if (!s.owned) {
    s.owner = std::this_thread::get_id();
    s.owned = true;
  } else if (s.owner != std::this_thread::get_id()) {
    return;
  }
  if (Mode(s.mode) == Mode::device) device_synchronize();
  node_ = child(s, s.current, name);
  s.current = node_;
  active_ = true;
  counters(start_launches_, start_blas_);
  if (keeps_kernels()) start_kernels_ = launches_by_kernel();
  start_ns_ = now_ns();
}

void Scope::end() {
  if (!active_) return;
  active_ = false;
  State& s = state();
  if (Mode(s.mode) == Mode::device) device_synchronize();
  Node& n = s.nodes[node_];
  n.total_ns += now_ns() - start_ns_;
  n.calls += 1;
  int64_t launches = 0, blas = 0;
  counters(launches, blas);
  n.launches += launches - start_launches_;
  n.blas += blas - start_blas_;
  if (keeps_kernels()) {
    for (const auto& [name, c] : launches_by_kernel()) {
      int64_t was = 0;
      for (const auto& [bn, bc] : start_kernels_)
        if (bn == name) was = bc;
      if (c > was) add_kernel(n.kernels, name, c - was);
    }
    start_kernels_.clear();
  }
  s.current = n.parent;
}

std::vector<Entry> entries() {
  const State& s = state();
  std::vector<Entry> out;
  for (int r : s.roots) walk(s, r, "", out);
  return out;
}

std::vector<std::pair<std::string, int64_t>> launches_by_kernel() {
  std::vector<std::pair<std::string, int64_t>> out;
#ifdef HLM_CUDA_EMU
  for (const auto& [name, n] : ::hlm::emu::kernel_launches_by_name())
    out.emplace_back(name, int64_t(n));
#endif
  return out;
}

std::string launch_report(const std::vector<std::pair<std::string, int64_t>>& before,
                          const std::vector<std::pair<std::string, int64_t>>& after,
                          int64_t steps) {
  std::vector<std::pair<std::string, int64_t>> d;
  int64_t total = 0;
  for (const auto& [name, n] : after) {
    int64_t was = 0;
    for (const auto& [bn, bc] : before)
      if (bn == name) was = bc;
    if (n > was) d.emplace_back(name, n - was), total += n - was;
  }
  std::stable_sort(d.begin(), d.end(),
                   [](const auto& a, const auto& b) { return a.second > b.second; });
  const double per = steps > 0 ? 1.0 / double(steps) : 1.0;
  std::string out = fmt::format("{:>10} {:>10}  kernel\n", "launches", "per step");
  for (const auto& [name, n] : d) out += fmt::format("{:>10} {:>10.1f}  {}\n", n, n * per, name);
  out += fmt::format("{:>10} {:>10.1f}  (all)\n", total, total * per);
  return out;
}

std::string report() {
  const std::vector<Entry> es = entries();
  double root_ms = 0;
  for (const Entry& e : es)
    if (e.depth == 0) root_ms += e.total_ms;
  const bool counted = counts_launches();
  std::string out = fmt::format("{:<52} {:>11} {:>11} {:>8} {:>7}", "scope", "total ms", "self ms",
                                "calls", "share");
  out += counted ? fmt::format(" {:>9} {:>7}\n", "kernels", "cuBLAS") : "\n";
  for (const Entry& e : es) {
    const size_t slash = e.path.rfind('/');
    const std::string name = std::string(2 * e.depth, ' ') +
                             (slash == std::string::npos ? e.path : e.path.substr(slash + 1));
    out += fmt::format("{:<52} {:>11.3f} {:>11.3f} {:>8} {:>6.1f}%", name, e.total_ms, e.self_ms,
                       e.calls, root_ms > 0 ? 100.0 * e.total_ms / root_ms : 0.0);
    out += counted ? fmt::format(" {:>9} {:>7}\n", e.launches, e.blas) : "\n";
    for (const auto& [kname, k] : e.self_kernels)
      out += fmt::format("{:<52} {:>9} x {}\n", std::string(2 * e.depth + 4, ' ') + "(kernel)", k,
                         kname);
  }
  return out;
}

void reset() {
  State& s = state();
  // Scopes open now keep their nodes: times are zeroed, the tree is kept while one is open.
  if (s.current >= 0) {
    for (Node& n : s.nodes) {
      n.calls = n.total_ns = n.launches = n.blas = 0;
      n.kernels.clear();
    }
    return;
  }
  s.nodes.clear();
  s.roots.clear();
}

}  // namespace hlm::profile
