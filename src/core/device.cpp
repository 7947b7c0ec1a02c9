#include "core/device.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <vector>

#include "core/cuda_cache.h"
#include "core/error.h"
#include "core/memory.h"

#ifdef HLM_HAVE_CUDA
#include <cuda_runtime.h>
#ifndef HLM_CUDA_EMU
#include <cuda_profiler_api.h>
#endif
#define HLM_CUDA_CHECK(expr)                                                                 \
  do {                                                                                       \
    cudaError_t err_ = (expr);                                                               \
    HLM_CHECK(err_ == cudaSuccess, "CUDA error in {}: {}", #expr, cudaGetErrorString(err_)); \
  } while (0)
#endif

namespace hlm {

int cuda_device_count() {
#ifdef HLM_HAVE_CUDA
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return n;
  }();
  return count;
#else
  return 0;
#endif
}

bool cuda_available() {
  return cuda_device_count() > 0;
}

void cuda_select_device(int index) {
  HLM_CHECK(index >= 0 && index < cuda_device_count(), "CUDA device {} does not exist ({} present)",
            index, cuda_device_count());
#ifdef HLM_HAVE_CUDA
  const cudaError_t e = cudaSetDevice(index);
  HLM_CHECK(e == cudaSuccess, "cudaSetDevice({}): {}", index, cudaGetErrorString(e));
#endif
}

bool cuda_emulated() {
#ifdef HLM_CUDA_EMU
  return true;
#else
  return false;
#endif
}

namespace {

// The memory under the CUDA caching allocator: null when the device is out of memory.
void* cuda_block_alloc(size_t bytes) {
#ifdef HLM_HAVE_CUDA
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // not left for the next launch's check to find
    return nullptr;
  }
  HLM_CUDA_CHECK(err);
  return p;
#else
  HLM_FAIL("a CUDA tensor of {} bytes was requested but this build has no CUDA support", bytes);
#endif
}

void cuda_block_free([[maybe_unused]] void* p) {
#ifdef HLM_HAVE_CUDA
  cudaFree(p);
#endif
}

}  // namespace

CachingAllocator& cuda_caching_allocator() {
  // Never destroyed: the cached blocks are left to the process's exit, after which the CUDA
  // runtime may be gone.
  static CachingAllocator* const allocator = [] {
    const bool on = cuda_caching_from_env();
    const bool emu = cuda_emulated();
    auto* a = new CachingAllocator({&cuda_block_alloc, &cuda_block_free}, emu,
                                   emu ? CachingAllocator::kEmulatedCacheBytes : SIZE_MAX);
    a->set_enabled(on);
    return a;
  }();
  return *allocator;
}

CudaMemoryStats cuda_memory_stats() {
  return cuda_caching_allocator().stats();
}

void cuda_reset_peak_memory() {
  cuda_caching_allocator().reset_peak();
}

void cuda_empty_cache() {
  cuda_caching_allocator().empty_cache();
}

void cuda_set_caching(bool on) {
  cuda_caching_allocator().set_enabled(on);
}

bool cuda_caching() {
  return cuda_caching_allocator().enabled();
}

void* device_alloc(Device d, size_t nbytes) {
  if (nbytes == 0) nbytes = 1;
  if (d == Device::cpu) {
    // One allocation above the memory limit is refused before it is tried (a request the
    // kernel would grant lazily would fail later, when it is touched).
    check_memory(nbytes, "a tensor");
    HLM_CHECK(nbytes <= SIZE_MAX - 63, "a tensor of {} bytes cannot be allocated", nbytes);
    void* p = std::aligned_alloc(64, (nbytes + 63) / 64 * 64);
    HLM_CHECK(p != nullptr, "out of memory: a tensor of {} bytes ({}) could not be allocated",
              nbytes, format_bytes(double(nbytes)));
    return p;
  }
#ifdef HLM_HAVE_CUDA
  HLM_CHECK(cuda_available(), "a CUDA tensor was requested but no CUDA device is available");
  return cuda_caching_allocator().allocate(nbytes);
#else
  HLM_FAIL("a CUDA tensor was requested but this build has no CUDA support");
#endif
}

void device_free(Device d, void* p) {
  if (!p) return;
  if (d == Device::cpu) {
    std::free(p);
    return;
  }
  cuda_caching_allocator().free(p);
}

#ifdef HLM_HAVE_CUDA
namespace {

// Small host-to-device copies through rings of pinned staging buffers: the bytes are copied into
// pinned memory and cudaMemcpyAsync'd on the default stream, so the host goes on without waiting
// for the device (a copy from pageable memory first waits for the stream: a decode step uploads a
// few small tables per layer, and each such wait drained the device's queue). A slot is reused
// once the event recorded behind its copy has passed; the stream orders the copy before every
// later kernel, and a copy back to the host (synchronous) after it. Two rings: copies of up to
// 64 KiB (a decode step's hundred-odd tables) take one of 256 small slots, so the host may run a
// whole step ahead of the device before it waits for one; larger copies up to 1 MiB one of 16.
// A reuse that finds its slot's copy still pending waits for it, and is counted
// (TransferStats::staging_waits).
class H2dStaging {
 public:
  static constexpr size_t kSmallBytes = size_t(64) << 10, kLargeBytes = size_t(1) << 20;
  static constexpr int kSmallSlots = 256, kLargeSlots = 16;

  static H2dStaging& get() {
    static H2dStaging* s = new H2dStaging;  // never freed: the CUDA runtime may be gone at exit
    return *s;
  }

  // Copies when n fits a slot; false (nothing done) otherwise, or always with HLM_H2D_STAGING=0
  // in the environment (every copy then synchronous, as cudaMemcpy makes it). *waited: whether
  // the slot's previous copy was still pending.
  bool copy(void* dst, const void* src, size_t n, bool* waited) {
    static const bool on = [] {
      const char* e = std::getenv("HLM_H2D_STAGING");
      return !(e && std::strcmp(e, "0") == 0);
    }();
    *waited = false;
    if (!on || n > kLargeBytes) return false;
    std::lock_guard<std::mutex> lock(mu_);
    Ring& ring = n <= kSmallBytes ? small_ : large_;
    Slot& s = ring.slots[size_t(ring.next)];
    ring.next = (ring.next + 1) % int(ring.slots.size());
    if (!s.host) {
      HLM_CUDA_CHECK(cudaMallocHost(&s.host, ring.bytes));
      HLM_CUDA_CHECK(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming));
    } else {
      const cudaError_t q = cudaEventQuery(s.done);
      if (q == cudaErrorNotReady) {
        *waited = true;
        HLM_CUDA_CHECK(cudaEventSynchronize(s.done));
      } else {
        HLM_CUDA_CHECK(q);
      }
    }
    std::memcpy(s.host, src, n);
    HLM_CUDA_CHECK(cudaMemcpyAsync(dst, s.host, n, cudaMemcpyHostToDevice, nullptr));
    HLM_CUDA_CHECK(cudaEventRecord(s.done, nullptr));
    return true;
  }

 private:
  struct Slot {
    void* host = nullptr;
    cudaEvent_t done = nullptr;
  };
  struct Ring {
    Ring(int slots, size_t b) : slots(size_t(slots)), bytes(b) {}
    std::vector<Slot> slots;
    size_t bytes;
    int next = 0;
  };
  std::mutex mu_;
  Ring small_{kSmallSlots, kSmallBytes}, large_{kLargeSlots, kLargeBytes};
};

}  // namespace
#endif

namespace {

struct TransferCounters {
  std::atomic<uint64_t> to_host{0}, to_host_bytes{0}, to_device{0}, to_device_staged{0},
      to_device_bytes{0}, synchronizes{0}, staging_waits{0};
};
TransferCounters& transfer_counters() {
  static TransferCounters c;
  return c;
}

}  // namespace

TransferStats transfer_stats() {
  const TransferCounters& c = transfer_counters();
  return {c.to_host.load(),          c.to_host_bytes.load(),   c.to_device.load(),
          c.to_device_staged.load(), c.to_device_bytes.load(), c.synchronizes.load(),
          c.staging_waits.load()};
}

void reset_transfer_stats() {
  TransferCounters& c = transfer_counters();
  for (std::atomic<uint64_t>* v : {&c.to_host, &c.to_host_bytes, &c.to_device, &c.to_device_staged,
                                   &c.to_device_bytes, &c.synchronizes, &c.staging_waits})
    v->store(0);
}

void device_copy(void* dst, Device dd, const void* src, Device sd, size_t nbytes) {
  if (nbytes == 0) return;
  if (dd == Device::cpu && sd == Device::cpu) {
    std::memcpy(dst, src, nbytes);
    return;
  }
#ifdef HLM_HAVE_CUDA
  TransferCounters& tc = transfer_counters();
  if (dd == Device::cpu) {
    ++tc.to_host;
    tc.to_host_bytes += nbytes;
  } else if (sd == Device::cpu) {
    tc.to_device_bytes += nbytes;
    bool waited = false;
    if (H2dStaging::get().copy(dst, src, nbytes, &waited)) {
      ++tc.to_device_staged;
      if (waited) ++tc.staging_waits;
      return;
    }
    ++tc.to_device;
  }
  HLM_CUDA_CHECK(cudaMemcpy(dst, src, nbytes, cudaMemcpyDefault));
#else
  HLM_FAIL("device copy to or from CUDA in a build without CUDA support");
#endif
}

void device_memset_zero(Device d, void* p, size_t nbytes) {
  device_memset(d, p, 0, nbytes);
}

void device_memset(Device d, void* p, int byte, size_t nbytes) {
  if (d == Device::cpu) {
    std::memset(p, byte, nbytes);
    return;
  }
#ifdef HLM_HAVE_CUDA
  HLM_CUDA_CHECK(cudaMemset(p, byte, nbytes));
#endif
}

void device_synchronize() {
#ifdef HLM_HAVE_CUDA
  if (!cuda_available()) return;
  ++transfer_counters().synchronizes;
  HLM_CUDA_CHECK(cudaDeviceSynchronize());
#endif
}

void cuda_profiler_collect(bool on) {
#if defined(HLM_HAVE_CUDA) && !defined(HLM_CUDA_EMU)
  if (!cuda_available()) return;
  HLM_CUDA_CHECK(on ? cudaProfilerStart() : cudaProfilerStop());
#else
  (void)on;
#endif
}

}  // namespace hlm
