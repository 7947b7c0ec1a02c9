// Hopper's asynchronous primitives (sm_90a): warpgroup tensor-core products (wgmma), mbarrier
// objects, and the tensor memory accelerator (TMA: cp.async.bulk.tensor). Internal. Each has its
// PTX and, under HLM_CUDA_EMU, the CPU emulation's form (tools/cuda_emu, docs/cuda_emu.md), so a
// kernel built from them is made correct on the emulation and timed on the GPU.
//
// wgmma (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"): the 128 threads of a
// warpgroup (warps 4 j .. 4 j + 3) compute D [64 x N] (+)= A [64 x K] B [K x N] together, K = 16
// (bf16) or 8 (tf32), N a multiple of 8 up to 256. A and B come from shared memory through 64-bit
// descriptors (smem_desc), or A from registers. The products are asynchronous:
//   wgmma_fence();                      // before the first wgmma, and after registers changed
//   wgmma_bf16<N>(d, desc_a, desc_b, accumulate) ...;   // several, e.g. along K
//   wgmma_commit();                     // the issued ones become one group
//   wgmma_wait<0>();                    // until at most 0 groups are pending: d is ready
// Fragments (lane = 4 g + t of warp j of the warpgroup):
//   D, f32 d[N / 2]: register 4 c + e holds row 16 j + g + 8 (e / 2), column 8 c + 2 t + e % 2.
//   A from registers, uint32_t a[4]: rows 16 j .. 16 j + 15 as mma.sync's A fragment; bf16
//   a_r = (g + 8 (r % 2), columns 2 t + 8 (r / 2) and + 1, the lower in the low half); tf32
//   a_r = (g + 8 (r % 2), t + 4 (r / 2)).
// Shared-memory layouts (the descriptor's LBO / SBO in bytes, multiples of 16; rows of A are m,
// rows of B are n; "K-major": a row's K elements contiguous; kTrans = 1: M/N-major, bf16 only):
//   K-major, Swizzle::none: core matrices of 8 rows x 16 bytes (row r at 16 r), along M/N every
//     SBO bytes, along K every LBO bytes.
//   K-major, swizzle span S (32, 64, 128 bytes): atoms of 8 rows x S bytes (row r at S r), along
//     M/N every SBO bytes; an instruction's 32 bytes of K are contiguous from the start (advance
//     the descriptor's start by 32 bytes per K step within a row); LBO unused.
//   M/N-major, Swizzle::none: core matrices of 8 k-rows x 16 bytes (8 M/N elements), along K every
//     LBO bytes, along M/N every SBO bytes.
//   M/N-major, span S: atoms of 8 k-rows x S bytes, along K every SBO bytes, along M/N every LBO.
//   The swizzle XORs bits 4..6 of the shared address with bits 7..9 (span 128; 64: two bits, 32:
//   one), so swizzled tiles start at 1024-byte boundaries (the descriptor's base offset 0).
//
// mbarrier (8 bytes of shared memory): init with an arrival count; each phase completes when
// that many arrivals have come and the expected transaction bytes (arrive_expect_tx) have landed;
// wait on a phase by its parity (the first phase has parity 0).
//
// TMA: tma_load copies a box of a global tensor, described by a CUtensorMap (tensor_map on the
// host; pass it to the kernel as a `const __grid_constant__ CUtensorMap` parameter), into shared
// memory (128-byte aligned; swizzled as the map says, with the same pattern as wgmma's) and
// completes its bytes on an mbarrier; elements outside the tensor read as zeros. tma_store copies
// a box back (elements outside the tensor are not written), in bulk groups: bulk_commit, then
// bulk_wait<0>() before the shared memory is reused. Two rules no check of the map tells (an
// illegal instruction on an H100 otherwise; the emulation aborts): the innermost coordinate of a
// load or a store is a multiple of 16 bytes, and a store's coordinates are not negative (a load's
// may be; a store may run past the tensor's end). A store writes the innermost dimension in whole
// 16-byte units: elements past its extent, up to the next 16-byte boundary, are written too.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "core/error.h"

#ifndef HLM_CUDA_EMU
#include "ops/cuda/sm90_wgmma_ptx.cuh"
#endif

namespace hlm::ops::cuda::sm90 {

// The descriptor's swizzle field (bits 62..63).
enum class Swizzle : uint32_t { none = 0, b128 = 1, b64 = 2, b32 = 3 };

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The shared-memory matrix descriptor of a wgmma operand starting at p (PTX ISA, "Matrix
// Descriptor Format": start address, LBO and SBO in 16-byte units, base offset 0, swizzle mode).
__device__ __forceinline__ uint64_t smem_desc(const void* p, Swizzle s, uint32_t lbo_bytes,
                                              uint32_t sbo_bytes) {
  return uint64_t((smem_u32(p) >> 4) & 0x3fff) | (uint64_t((lbo_bytes >> 4) & 0x3fff) << 16) |
         (uint64_t((sbo_bytes >> 4) & 0x3fff) << 32) | (uint64_t(s) << 62);
}

// ---------------------------------------------------------------- wgmma

__device__ __forceinline__ void wgmma_fence() {
#ifdef HLM_CUDA_EMU
  ::hlm::emu::wgmma_fence();
#else
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef HLM_CUDA_EMU
  ::hlm::emu::wgmma_commit();
#else
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Waits until at most N committed groups of this warpgroup are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifdef HLM_CUDA_EMU
  ::hlm::emu::wgmma_wait(N);
#else
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// D [64 x N] = A B + (accumulate ? D : 0), bf16 A [64 x 16] and B [16 x N] from shared memory;
// kScaleA / kScaleB = -1 negate an operand; kTransA / kTransB = 1: that operand is M/N-major.
template <int N, int kScaleA = 1, int kScaleB = 1, int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void wgmma_bf16(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                           bool accumulate) {
#ifdef HLM_CUDA_EMU
  ::hlm::emu::wgmma(::hlm::emu::WgmmaType::bf16, N, d, desc_a, nullptr, desc_b, accumulate, kScaleA,
                    kScaleB, kTransA, kTransB);
#else
  detail::Wgmma<N>::template bf16_ss<kScaleA, kScaleB, kTransA, kTransB>(d, desc_a, desc_b,
                                                                         accumulate ? 1 : 0);
#endif
}
// The same with A from registers (the fragment at the top).
template <int N, int kScaleA = 1, int kScaleB = 1, int kTransB = 0>
__device__ __forceinline__ void wgmma_bf16(float (&d)[N / 2], const uint32_t (&a)[4],
                                           uint64_t desc_b, bool accumulate) {
#ifdef HLM_CUDA_EMU
  ::hlm::emu::wgmma(::hlm::emu::WgmmaType::bf16, N, d, 0, a, desc_b, accumulate, kScaleA, kScaleB,
                    0, kTransB);
#else
  detail::Wgmma<N>::template bf16_rs<kScaleA, kScaleB, kTransB>(d, a, desc_b, accumulate ? 1 : 0);
#endif
}
// D [64 x N] = A B + (accumulate ? D : 0), TF32 A [64 x 8] and B [8 x N] (f32 values whose low 13
// bits the tensor cores ignore), both K-major, from shared memory.
template <int N, int kScaleA = 1, int kScaleB = 1>
__device__ __forceinline__ void wgmma_tf32(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                           bool accumulate) {
#ifdef HLM_CUDA_EMU
  ::hlm::emu::wgmma(::hlm::emu::WgmmaType::tf32, N, d, desc_a, nullptr, desc_b, accumulate, kScaleA,
                    kScaleB, 0, 0);
#else
  detail::Wgmma<N>::template tf32_ss<kScaleA, kScaleB>(d, desc_a, desc_b, accumulate ? 1 : 0);
#endif
}
// The same with A from registers.
template <int N, int kScaleA = 1, int kScaleB = 1>
__device__ __forceinline__ void wgmma_tf32(float (&d)[N / 2], const uint32_t (&a)[4],
                                           uint64_t desc_b, bool accumulate) {
#ifdef HLM_CUDA_EMU
  ::hlm::emu::wgmma(::hlm::emu::WgmmaType::tf32, N, d, 0, a, desc_b, accumulate, kScaleA, kScaleB,
                    0, 0);
#else
  detail::Wgmma<N>::template tf32_rs<kScaleA, kScaleB>(d, a, desc_b, accumulate ? 1 : 0);
#endif
}

// ---------------------------------------------------------------- mbarrier

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
#ifdef HLM_CUDA_EMU
  ::hlm::emu::mbarrier_init(bar, count);
#else
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count)
               : "memory");
#endif
}
// Makes initialised mbarriers visible to the async proxy (TMA): after the inits, before a
// __syncthreads and their first use.
__device__ __forceinline__ void fence_mbarrier_init() {
#ifndef HLM_CUDA_EMU
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
// Orders this thread's generic-proxy shared-memory writes before later async-proxy accesses
// (wgmma operands written by threads, a TMA store of them).
__device__ __forceinline__ void fence_proxy_async() {
#ifndef HLM_CUDA_EMU
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
#ifdef HLM_CUDA_EMU
  (void)::hlm::emu::mbarrier_arrive(bar, 0);
#else
  asm volatile("{\n.reg .b64 s;\nmbarrier.arrive.shared::cta.b64 s, [%0];\n}\n" ::"r"(smem_u32(bar))
               : "memory");
#endif
}
// Arrives and expects `bytes` more transaction bytes in the current phase (a TMA's box).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#ifdef HLM_CUDA_EMU
  (void)::hlm::emu::mbarrier_arrive(bar, bytes);
#else
  asm volatile("{\n.reg .b64 s;\nmbarrier.arrive.expect_tx.shared::cta.b64 s, [%0], %1;\n}\n" ::"r"(
                   smem_u32(bar)),
               "r"(bytes)
               : "memory");
#endif
}
// Whether the phase of parity `parity` has completed (without waiting long).
__device__ __forceinline__ bool mbarrier_try_wait(uint64_t* bar, uint32_t parity) {
#ifdef HLM_CUDA_EMU
  return ::hlm::emu::mbarrier_try_wait_parity(bar, parity);
#else
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, "
      "0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return done != 0;
#endif
}
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  while (!mbarrier_try_wait(bar, parity)) {
  }
}

// ---------------------------------------------------------------- TMA

// Loads the box at coordinates c (innermost first, elements; c[0] on a 16-byte boundary; may lie
// partly outside the tensor) into dst and completes its bytes on bar. Rank 1 to 3.
template <int kRank>
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map,
                                         const int32_t (&c)[kRank], uint64_t* bar) {
  static_assert(kRank >= 1 && kRank <= 3, "tma_load: rank 1 to 3");
#ifdef HLM_CUDA_EMU
  ::hlm::emu::tma_load(dst, map, c, kRank, bar);
#else
  const uint32_t d = smem_u32(dst), b = smem_u32(bar);
  const auto m = reinterpret_cast<uint64_t>(map);
  if constexpr (kRank == 1)
    asm volatile(
        "cp.async.bulk.tensor.1d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], "
        "[%1, {%2}], [%3];\n" ::"r"(d),
        "l"(m), "r"(c[0]), "r"(b)
        : "memory");
  else if constexpr (kRank == 2)
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], "
        "[%1, {%2, %3}], [%4];\n" ::"r"(d),
        "l"(m), "r"(c[0]), "r"(c[1]), "r"(b)
        : "memory");
  else
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], "
        "[%1, {%2, %3, %4}], [%5];\n" ::"r"(d),
        "l"(m), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(b)
        : "memory");
#endif
}
// Stores the box at src (128-byte aligned) to coordinates c of the tensor (c[0] on a 16-byte
// boundary, none negative); the elements outside it are not written. Call fence_proxy_async()
// first if threads wrote src.
template <int kRank>
__device__ __forceinline__ void tma_store(const CUtensorMap* map, const int32_t (&c)[kRank],
                                          const void* src) {
  static_assert(kRank >= 1 && kRank <= 3, "tma_store: rank 1 to 3");
#ifdef HLM_CUDA_EMU
  ::hlm::emu::tma_store(map, c, kRank, src);
#else
  const uint32_t s = smem_u32(src);
  const auto m = reinterpret_cast<uint64_t>(map);
  if constexpr (kRank == 1)
    asm volatile(
        "cp.async.bulk.tensor.1d.global.shared::cta.bulk_group [%0, {%1}], [%2];\n" ::"l"(m),
        "r"(c[0]), "r"(s)
        : "memory");
  else if constexpr (kRank == 2)
    asm volatile(
        "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(m),
        "r"(c[0]), "r"(c[1]), "r"(s)
        : "memory");
  else
    asm volatile(
        "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(
            m),
        "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(s)
        : "memory");
#endif
}
__device__ __forceinline__ void bulk_commit() {
#ifdef HLM_CUDA_EMU
  ::hlm::emu::bulk_commit();
#else
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
// Waits until at most N of this thread's bulk groups are pending (their global writes done).
template <int N>
__device__ __forceinline__ void bulk_wait() {
#ifdef HLM_CUDA_EMU
  ::hlm::emu::bulk_wait(N);
#else
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// The tensor map of a row-major global tensor for tma_load / tma_store (host). dims and
// box: innermost first (elements); row_bytes: the byte strides of dims 1.. (multiples of 16);
// swizzle: CU_TENSOR_MAP_SWIZZLE_NONE / _32B / _64B / _128B (a swizzled box's inner dimension
// fills the span). Throws hlm::Error when the driver refuses it.
inline CUtensorMap tensor_map(const void* base, CUtensorMapDataType type,
                              std::initializer_list<uint64_t> dims,
                              std::initializer_list<uint64_t> row_bytes,
                              std::initializer_list<uint32_t> box, CUtensorMapSwizzle swizzle) {
  using Encode =
      CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                           cudaEnableDefault, &q);
    HLM_CHECK(e == cudaSuccess && q == cudaDriverEntryPointSuccess && fn,
              "tensor_map: the driver has no cuTensorMapEncodeTiled ({})", cudaGetErrorString(e));
    return reinterpret_cast<Encode>(fn);
  }();
  const auto rank = uint32_t(dims.size());
  HLM_CHECK(rank >= 1 && rank <= 5 && box.size() == rank && row_bytes.size() + 1 == rank,
            "tensor_map: {} dims, {} row strides and {} box sizes do not describe one tensor", rank,
            row_bytes.size(), box.size());
  const cuuint32_t ones[5] = {1, 1, 1, 1, 1};
  CUtensorMap m{};
  const CUresult r =
      encode(&m, type, rank, const_cast<void*>(base), dims.begin(), row_bytes.begin(), box.begin(),
             ones, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  HLM_CHECK(r == CUDA_SUCCESS, "tensor_map: cuTensorMapEncodeTiled refused the map (error {})",
            int(r));
  return m;
}

}  // namespace hlm::ops::cuda::sm90
