// cp.async (sm_80 and later): 16-byte copies global -> shared that bypass the registers, grouped
// and waited for per thread. Internal. The CPU emulation build (HLM_CUDA_EMU) performs a copy when
// its group is waited for, so a read of the destination before the wait sees the old contents, as
// it may on a GPU.
#pragma once

#include <cuda_runtime.h>

namespace hlm::ops::cuda {

// 16 bytes, both addresses 16-byte aligned.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
#ifdef HLM_CUDA_EMU
  ::hlm::emu::cp_async(smem, gmem, 16);
#else
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifdef HLM_CUDA_EMU
  ::hlm::emu::cp_async_commit();
#else
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Wait until at most N of this thread's most recent groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef HLM_CUDA_EMU
  ::hlm::emu::cp_async_wait(N);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

}  // namespace hlm::ops::cuda
