#include "core/profile.h"

#include <fmt/format.h>

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
  int64_t launches = 0, blas = 0;  // CUDA emulation only
};

struct State {
  int enabled = -1;  // -1: HLM_PROFILE not read yet
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
  out.push_back(e);
  for (int c : n.children) walk(s, c, e.path, out);
}

}  // namespace

bool enabled() {
  State& s = state();
  if (s.enabled < 0) {
    const char* v = std::getenv("HLM_PROFILE");
    s.enabled = v != nullptr && std::strcmp(v, "1") == 0 ? 1 : 0;
  }
  return s.enabled == 1;
}

void set_enabled(bool on) {
  state().enabled = on ? 1 : 0;
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
  device_synchronize();
  node_ = child(s, s.current, name);
  s.current = node_;
  active_ = true;
  counters(start_launches_, start_blas_);
  start_ns_ = now_ns();
}

void Scope::end() {
  if (!active_) return;
  active_ = false;
  device_synchronize();
  State& s = state();
  Node& n = s.nodes[node_];
  n.total_ns += now_ns() - start_ns_;
  n.calls += 1;
  int64_t launches = 0, blas = 0;
  counters(launches, blas);
  n.launches += launches - start_launches_;
  n.blas += blas - start_blas_;
  s.current = n.parent;
}

std::vector<Entry> entries() {
  const State& s = state();
  std::vector<Entry> out;
  for (int r : s.roots) walk(s, r, "", out);
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
  }
  return out;
}

void reset() {
  State& s = state();
  // Scopes open now keep their nodes: times are zeroed, the tree is kept while one is open.
  if (s.current >= 0) {
    for (Node& n : s.nodes) n.calls = n.total_ns = n.launches = n.blas = 0;
    return;
  }
  s.nodes.clear();
  s.roots.clear();
}

}  // namespace hlm::profile
