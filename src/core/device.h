// Device memory and device queries. CUDA calls live behind these functions so that the rest of the
// library compiles the same with and without CUDA.
#pragma once

#include <cstddef>

#include "core/dtype.h"

namespace hlm {

// Number of usable CUDA devices (0 in a CPU-only build or when no GPU/driver is present).
int cuda_device_count();
bool cuda_available();
// True in the build whose CUDA device is the CPU emulation (HLM_CUDA_EMU, tools/cuda_emu): its
// kernels compute what they compute on a GPU, but their timings mean nothing.
bool cuda_emulated();

void* device_alloc(Device d, size_t nbytes);  // 64-byte aligned on the CPU; never returns null
void device_free(Device d, void* p);
// Copy nbytes between any two devices (synchronous).
void device_copy(void* dst, Device dst_dev, const void* src, Device src_dev, size_t nbytes);
void device_memset_zero(Device d, void* p, size_t nbytes);
// Every byte of [p, p + nbytes) set to `byte` (e.g. 0xFF: the NaN poison of the tests).
void device_memset(Device d, void* p, int byte, size_t nbytes);
void device_synchronize();

}  // namespace hlm
