// A scoped wall-clock profiler for whole steps: where the time of a training step or a layer goes,
// op by op. Off by default (a Scope then costs one load of a flag); on, each Scope synchronises the
// device at entry and exit (device_synchronize: a CUDA step's kernels are asynchronous) and adds
// its time to its path in the tree of nested scopes ("step/forward/layer 3 kda/chunk"). The
// synchronisation serialises the device with the host, so a profiled run is slower than an
// unprofiled one: its table says where the time goes, the unprofiled run how much there is.
// In host mode (HLM_PROFILE=host) the scopes do not synchronise: each records how long the host
// took to issue its work (launches, allocations, the host's own code), which, set against the
// unprofiled step time, says whether a step is bound by the host or by the device. In
// the CUDA emulation build each scope also counts its kernel launches and cuBLAS calls (two more
// columns of the report), so a step's launch budget can be read without a GPU; with
// HLM_PROFILE_KERNELS=1 there the report also lists each scope's own launches by kernel name.
// One thread: scopes opened by OpenMP workers are not recorded (they are not the step's
// structure).
//
//   profile::set_enabled(true);            // or HLM_PROFILE=1 in the environment
//   { profile::Scope s("forward"); ... }
//   profile::Scope p("project"); Tensor y = project(x); p.end();
//   std::printf("%s", profile::report().c_str());
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace hlm::profile {

// Whether scopes record, and how. The first call reads HLM_PROFILE ("1": device, "host": host;
// anything else: off); set_enabled / set_mode override it.
enum class Mode { off, device, host };
Mode mode();
void set_mode(Mode m);
bool enabled();             // mode() != off
void set_enabled(bool on);  // device or off
// Whether scopes also count the kernel launches and cuBLAS calls they make: in the CUDA
// emulation build (which counts both), where a step's launch budget is measured without a GPU.
bool counts_launches();

class Scope {
 public:
  // name must outlive the scope (a literal, or a string the caller keeps).
  explicit Scope(const char* name);
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;
  ~Scope() { end(); }
  // Closes the scope now (for sequential code whose results outlive it); later calls do nothing.
  // Scopes close in the reverse order of opening.
  void end();

 private:
  bool active_ = false;
  int node_ = -1;
  int64_t start_ns_ = 0, start_launches_ = 0, start_blas_ = 0;
  std::vector<std::pair<std::string, int64_t>> start_kernels_;  // HLM_PROFILE_KERNELS=1 only
};

// One node of the tree: a path of scope names, how often it ran, its total and its self time
// (total less its children's totals).
struct Entry {
  std::string path;  // names joined by '/'
  int depth = 0;
  int64_t calls = 0;
  double total_ms = 0, self_ms = 0;
  // The kernel launches and cuBLAS calls inside the scope, its children's included, where they
  // are counted (counts_launches(): the CUDA emulation build), else 0.
  int64_t launches = 0, blas = 0;
  // HLM_PROFILE_KERNELS=1 in the emulation build: the scope's launches by kernel name, its
  // children's excluded, most first.
  std::vector<std::pair<std::string, int64_t>> self_kernels;
};
// The tree depth-first (children in the order they first ran).
std::vector<Entry> entries();
// Kernel launches per kernel name since the process started, where they are counted
// (counts_launches()), else empty: a step's launches by kernel are the difference of two calls.
std::vector<std::pair<std::string, int64_t>> launches_by_kernel();
// A table of the launches by kernel between `before` and `after` (two launches_by_kernel()),
// most first, each with its count per `steps`.
std::string launch_report(const std::vector<std::pair<std::string, int64_t>>& before,
                          const std::vector<std::pair<std::string, int64_t>>& after, int64_t steps);
// A table of entries(): total, self, calls and the share of the root scopes' time.
std::string report();
// Every recorded time dropped (the tree is rebuilt as scopes run again).
void reset();

}  // namespace hlm::profile

#define HLM_PROFILE_CAT2(a, b) a##b
#define HLM_PROFILE_CAT(a, b) HLM_PROFILE_CAT2(a, b)
// A scope to the end of the enclosing block.
#define HLM_PROFILE(name) ::hlm::profile::Scope HLM_PROFILE_CAT(hlm_profile_scope_, __LINE__)(name)
