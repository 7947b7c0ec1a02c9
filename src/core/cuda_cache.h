// The caching allocator behind device_alloc / device_free for Device::cuda (core/device.h).
//
// cudaMalloc and cudaFree cost microseconds to milliseconds each, cudaFree synchronises the
// device, and every op call allocates its outputs and workspaces. So a freed block goes to a
// cache, and the next allocation that fits takes it back without calling CUDA:
//
// - Size classes. A request of n bytes (n = 0 counts as 1) is rounded up to its class: a
//   multiple of 512 bytes when n <= 1 MiB, a multiple of 2 MiB above. An allocation takes the
//   cached block of the smallest size between its class c and c + c / 4 (best fit among blocks at
//   most 25% larger, so that a small request never pins a large block), most recently freed first;
//   when there is none it cudaMallocs a block of exactly c bytes. Blocks are never split or merged.
//   Waste bound: the block holding n bytes has at most 1.25 * class(n) bytes, where
//   class(n) < n + 512 for n <= 1 MiB and class(n) < n + 2 MiB (so < 2 n) above.
// - The CPU emulation of CUDA (`exact`: tools/cuda_emu, docs/cuda_emu.md) ends every allocation
//   at an inaccessible guard page. There the class is n rounded up to 256 bytes (cudaMalloc's
//   granule, the emulator's rounding) and only a block of the same class is reused: a block from
//   the cache ends at its guard page exactly where a fresh cudaMalloc of n bytes would, and an
//   access past n (rounded up to 256) faults as before. The emulation's cache also holds at most
//   kEmulatedCacheBytes: its race check (HLM_EMU_RACECHECK) copies every allocation, cached
//   blocks included, around each launch, and a cache that kept the blocks of every earlier test
//   would make the test suite several times slower. A free that would take the cache past its
//   limit empties it first.
// - Stream order. Every kernel, cuBLAS call and device-to-device copy of hybridlm runs on the
//   default (legacy) stream, and every host <-> device copy is a synchronous cudaMemcpy, so
//   whatever work uses a block that the host frees is queued before any work of its next owner: a
//   freed block is handed out again at once, with no synchronisation. A future user of other
//   streams must record an event on the stream that used a block when freeing it, and make the
//   next owner's stream wait on that event (not done here).
//   Likewise one device is assumed (the current one): several devices would need a cache each.
// - Out of memory. When cudaMalloc fails, every cached block is released (cudaFree) and the
//   cudaMalloc is tried once more; if it fails again, hlm::Error names the request and the bytes
//   in use and released.
// - Caching off (HLM_CUDA_CACHE=0 in the environment, read when the allocator is first used, or
//   cuda_set_caching(false)): every allocation is a cudaMalloc of the requested size, every free a
//   cudaFree, so that compute-sanitizer's memcheck sees each tensor's exact bounds.
// - Cached blocks are not freed at process exit (the process releases them with its context; the
//   allocator stays reachable, so LeakSanitizer reports nothing). compute-sanitizer's
//   --leak-check would list them: run it with HLM_CUDA_CACHE=0.
//
// Thread safe (one mutex). The cache decides which address an allocation gets, never what a
// kernel computes: results do not depend on it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/device.h"

namespace hlm {

class CachingAllocator {
 public:
  // The memory underneath: `alloc` returns null when the device is out of memory (and throws
  // hlm::Error on any other failure); `release` returns a block.
  struct Backend {
    void* (*alloc)(size_t bytes);
    void (*release)(void* p);
  };

  // exact: the emulation's size classes and exact reuse; max_cached_bytes: the cache's limit
  // (above).
  CachingAllocator(Backend backend, bool exact, size_t max_cached_bytes = SIZE_MAX);
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // Never null; hlm::Error when the memory is exhausted.
  void* allocate(size_t nbytes);
  // p from allocate() (null is ignored): to the cache, or to the backend when caching is off.
  void free(void* p);
  // Releases every cached block to the backend.
  void empty_cache();

  // Off: the cache is emptied, and from then on every allocation and free goes to the backend.
  void set_enabled(bool on);
  bool enabled() const;

  CudaMemoryStats stats() const;
  void reset_peak();

  // For the tests: the next n calls of the backend's alloc are treated as failures (out of
  // memory) without calling it.
  void fail_next_backend_allocs(int n);

  // The size class of a request (above).
  static size_t size_class(size_t nbytes, bool exact);
  // The limit of the cache in the CPU emulation.
  static constexpr size_t kEmulatedCacheBytes = size_t(4) << 20;

 private:
  struct Live {
    size_t bytes;      // the block
    size_t requested;  // what the allocation asked for
    bool cacheable;    // a size-class block (false: allocated while caching was off)
  };

  void* backend_alloc(size_t bytes, size_t requested);  // releases the cache and retries on failure
  void* try_backend_alloc(size_t bytes);
  void release_cached();
  void add_in_use(size_t bytes, size_t requested);

  const Backend backend_;
  const bool exact_;
  const size_t max_cached_;
  bool enabled_ = true;
  int fail_next_ = 0;
  mutable std::mutex mu_;
  std::map<size_t, std::vector<void*>> cached_;  // free blocks by size, most recent last
  std::unordered_map<void*, Live> live_;         // blocks handed out
  CudaMemoryStats stats_;
};

// HLM_CUDA_CACHE from the environment, read now: unset, empty or 1: caching on; 0: off; anything
// else is an hlm::Error.
bool cuda_caching_from_env();

// The allocator of Device::cuda tensors (created at first use; HLM_CUDA_CACHE read then).
CachingAllocator& cuda_caching_allocator();

}  // namespace hlm
