// Device memory and device queries. CUDA calls live behind these functions so that the rest of the
// library compiles the same with and without CUDA.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace hlm {

// Number of usable CUDA devices (0 in a CPU-only build or when no GPU/driver is present).
int cuda_device_count();
bool cuda_available();
// True in the build whose CUDA device is the CPU emulation (HLM_CUDA_EMU, tools/cuda_emu): its
// kernels compute what they compute on a GPU, but their timings mean nothing.
bool cuda_emulated();
// Makes GPU `index` the current device of this process (each process of a job on one host takes
// its own: dist::local_rank() % cuda_device_count()). Call before anything is allocated on CUDA.
void cuda_select_device(int index);

// 64-byte aligned on the CPU, 256-byte aligned on CUDA; never returns null. CUDA memory comes from
// a caching allocator (core/cuda_cache.h): a freed block is kept and handed to a later allocation
// of its size class, without cudaMalloc / cudaFree.
void* device_alloc(Device d, size_t nbytes);
void device_free(Device d, void* p);

// The CUDA allocator's counts (all zero in a build without CUDA). "In use" counts the blocks held
// by live allocations, "reserved" what has been obtained from cudaMalloc and not yet freed: the
// blocks in use and those cached. reserved_bytes - in_use_bytes is the cache.
struct CudaMemoryStats {
  uint64_t requested_bytes = 0;      // the live allocations, as requested
  uint64_t in_use_bytes = 0;         // the blocks that hold them (rounded to size classes)
  uint64_t peak_in_use_bytes = 0;    // the most in_use_bytes since start or the last reset
  uint64_t reserved_bytes = 0;       // in use + cached
  uint64_t peak_reserved_bytes = 0;  // the most reserved_bytes since start or the last reset
  uint64_t cuda_malloc_count = 0;    // successful cudaMalloc calls
  uint64_t cuda_free_count = 0;      // cudaFree calls
  uint64_t cache_hits = 0;           // allocations served from the cache
};
CudaMemoryStats cuda_memory_stats();
// The peaks set to the current values.
void cuda_reset_peak_memory();
// Every cached block freed (cudaFree): reserved_bytes drops to in_use_bytes.
void cuda_empty_cache();
// Caching on or off. HLM_CUDA_CACHE=0 in the environment turns it off (read when the allocator is
// first used); this overrides it. Off: the cache is emptied, and from then on every allocation is a
// cudaMalloc of the requested size and every free a cudaFree (for compute-sanitizer runs).
void cuda_set_caching(bool on);
bool cuda_caching();

// Copy nbytes between any two devices. Synchronous, but for host-to-device copies of up to 1 MiB:
// those return once the bytes are staged in pinned memory, and reach the device in the default
// stream's order (before any later kernel or copy).
void device_copy(void* dst, Device dst_dev, const void* src, Device src_dev, size_t nbytes);
void device_memset_zero(Device d, void* p, size_t nbytes);
// Every byte of [p, p + nbytes) set to `byte` (e.g. 0xFF: the NaN poison of the tests).
void device_memset(Device d, void* p, int byte, size_t nbytes);
void device_synchronize();
// Starts / stops the collection of a CUDA profiler attached to the process (cudaProfilerStart /
// Stop): under `ncu --profile-from-start off` only the kernels launched between the two are
// profiled. Nothing without a profiler, in a build without CUDA, or in the emulation.
void cuda_profiler_collect(bool on);

// Counts of the copies between the host and CUDA since start or the last reset. A copy to the host
// waits for the device (the default stream drains first): `to_host` counts the places where the
// host waits for the device, and a decode step's count of them is part of its contract
// (docs/inference.md). `to_device_staged` are the host-to-device copies that went through the
// pinned staging rings (no wait for the device, unless `staging_waits`: the ring's slot still
// held an earlier copy the device had not made, so the host waited for it); `to_device` those
// that did not (cudaMemcpy: the host waits).
struct TransferStats {
  uint64_t to_host = 0, to_host_bytes = 0;
  uint64_t to_device = 0, to_device_staged = 0, to_device_bytes = 0;
  uint64_t synchronizes = 0;   // device_synchronize calls
  uint64_t staging_waits = 0;  // staged copies that waited for their slot
};
TransferStats transfer_stats();
void reset_transfer_stats();

}  // namespace hlm
