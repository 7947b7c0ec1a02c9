// A scoped wall-clock profiler for whole steps: where the time of a training step or a layer goes,
// op by op. Off by default (a Scope then costs one load of a flag); on, each Scope synchronises the
// device at entry and exit (device_synchronize: a CUDA step's kernels are asynchronous) and adds
// its time to its path in the tree of nested scopes ("step/forward/layer 3 kda/chunk"). The
// synchronisation serialises the device with the host, so a profiled run is slower than an
// unprofiled one: its table says where the time goes, the unprofiled run how much there is. In
// the CUDA emulation build each scope also counts its kernel launches and cuBLAS calls (two more
// columns of the report), so a step's launch budget can be read without a GPU.
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
#include <vector>

namespace hlm::profile {

// Whether scopes record. The first call reads HLM_PROFILE (1: on); set_enabled overrides it.
bool enabled();
void set_enabled(bool on);
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
};
// The tree depth-first (children in the order they first ran).
std::vector<Entry> entries();
// A table of entries(): total, self, calls and the share of the root scopes' time.
std::string report();
// Every recorded time dropped (the tree is rebuilt as scopes run again).
void reset();

}  // namespace hlm::profile

#define HLM_PROFILE_CAT2(a, b) a##b
#define HLM_PROFILE_CAT(a, b) HLM_PROFILE_CAT2(a, b)
// A scope to the end of the enclosing block.
#define HLM_PROFILE(name) ::hlm::profile::Scope HLM_PROFILE_CAT(hlm_profile_scope_, __LINE__)(name)
