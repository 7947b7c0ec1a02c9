// cuda_emu.h: CUDA C++ device code compiled by the host compiler and run on the CPU.
//
// The emulation build (CMake option HLM_CUDA_EMU) compiles every .cu file of src/ as C++ (after
// tools/cuda_emu/rewrite.cpp has turned its kernel launches into calls of hlm::emu::launch) with
// this header first, and links tools/cuda_emu/runtime.cpp in place of the CUDA runtime and
// cuBLAS. The GPU tests then run on a machine without a GPU, against the same CPU references.
//
// What is emulated, and how:
//   - A launch runs its blocks one after another. The threads of a block are fibers (each its own
//     stack) on one OS thread; a thread runs until it reaches a barrier (__syncthreads*), a warp
//     collective (__shfl*_sync, __syncwarp, __ballot_sync, mma.sync, ldmatrix) or its end, then the
//     next runnable thread runs. A barrier releases when every thread of the block that has not
//     exited waits at it; a warp collective when every lane of its mask waits at the same kind.
//     A barrier that can never release (divergent __syncthreads, a collective missing a lane)
//     aborts with the waiting threads listed.
//   - Memory is host memory: device allocations end at a guard page (a kernel that writes or
//     reads past the end of its allocation faults), dynamic shared memory too; dynamic shared
//     memory is filled with NaN bytes (0xff) before each block, as shared memory is garbage on a
//     GPU.
//   - cp.async copies are performed when the thread waits for their group (cp.async.wait_group),
//     not when issued: reading the destination before the wait reads the stale contents, as a
//     GPU may.
//   - mma.sync.m16n8k8 (TF32): the operands' low 13 bits are ignored as the tensor core ignores
//     them; m16n8k16 (BF16) and ldmatrix.x4 (.trans) for the BF16 kernels. The products and their
//     sum with the accumulator are formed in FP64 and rounded once
//     (the hardware's internal rounding is not documented: results agree to FP32 rounding, not
//     to the bit). ex2.approx / rcp.approx: exp2f and IEEE division with subnormals flushed.
//   - Hopper (sm_90a): wgmma is a warpgroup collective whose product is formed when its group is
//     retired (wgmma_wait); mbarrier state lives in its 8 bytes; a TMA tensor load lands when a
//     thread waits on its mbarrier, a tensor store when its bulk group is waited for;
//     cuTensorMapEncodeTiled writes the emulation's own map (docs/cuda_emu.md).
//   - HLM_EMU_REVERSE=1 runs the threads of each block and the blocks of each grid in reverse
//     order.
//   - Race check (HLM_EMU_RACECHECK=1): every launch runs twice from the same device memory,
//     threads and blocks in forward and then in reverse order, and the two must leave every
//     device allocation with the same bytes; a difference (a missing barrier, a read of memory
//     another block writes) aborts with the allocation and offset.
// Not emulated: timing, streams (everything is synchronous), atomics other than the integer
// atomicAdd, textures, and the interleaving of a warp's lanes between two collectives (they run
// one after another).
#pragma once

// CUDA's host headers define __shared__ only when it is not defined yet: per-block arrays
// declared in device code become thread-local statics (blocks run one at a time per OS thread).
#define __shared__ static thread_local

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#ifndef HLM_CUDA_EMU
#define HLM_CUDA_EMU 1
#endif

#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __forceinline__
#define __forceinline__ inline
#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __host__
#define __host__

namespace hlm::emu {

// The launch configuration of <<<grid, block, smem, stream>>>.
struct LaunchConfig {
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  LaunchConfig(dim3 g, dim3 b, size_t s = 0, cudaStream_t st = nullptr)
      : grid(g), block(b), smem(s), stream(st) {}
};

// Runs body(ctx) as every thread of every block of the launch; returns when all have ended.
// An invalid configuration sets the error that cudaGetLastError returns. `kernel` names the
// kernel as the launch spelled it (a literal).
void launch_impl(const char* kernel, const LaunchConfig& cfg, void (*body)(void*), void* ctx);

// Counts since the process started: kernel launches that ran (a race-check run counts once), and
// cuBLAS GEMM calls (a grouped call counts once). For tests that hold a step to a kernel budget.
uint64_t kernel_launches();
uint64_t blas_calls();
// The launches that ran, per kernel name as the launch spelled it (template arguments included),
// in the order the names first ran.
std::vector<std::pair<std::string, uint64_t>> kernel_launches_by_name();

template <class F>
void launch(const char* kernel, const LaunchConfig& cfg, F&& body) {
  using Fn = std::remove_reference_t<F>;
  launch_impl(
      kernel, cfg, [](void* c) { (*static_cast<Fn*>(c))(); }, &body);
}
// A launch of a body written in place (the emulation's own tests): named "(body)".
template <class F>
void launch(const LaunchConfig& cfg, F&& body) {
  launch("(body)", cfg, std::forward<F>(body));
}

// The running thread's coordinates (set by the scheduler before it resumes a thread). Inline
// variables of a type without a constructor (blockDim and gridDim are dim3 in CUDA: the same
// three fields), so that no TU reaches them through a thread_local initialisation wrapper (g++ 12
// with -fsanitize=undefined reports a null pointer on such accesses).
inline thread_local uint3 t_thread_idx, t_block_idx, t_block_dim, t_grid_dim;

void* dynamic_smem();

// Barriers and warp collectives.
int syncthreads_count(int pred);
void syncwarp(unsigned mask);
enum class Shfl { idx, up, down, bfly };
uint64_t shfl(unsigned mask, uint64_t value, Shfl mode, int arg, int width);
unsigned ballot(unsigned mask, int pred);
// d += a b for one m16n8k8 tile, TF32 operands, FP32 accumulators: the fragments of
// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32.
void mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);
// d += a b for one m16n8k16 tile, BF16 operands (two per register), FP32 accumulators:
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32.
void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);
// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: `row` is this lane's row address.
void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans);

// cp.async: the copy is recorded, and performed by cp_async_wait (or at the thread's end).
void cp_async(void* dst, const void* src, int bytes);
void cp_async_commit();
void cp_async_wait(int pending_groups);

// ---- Hopper (sm_90a): wgmma, mbarrier and TMA, as src/ops/cuda/sm90.cuh issues them.
// The shared-window address of a byte of the block's dynamic shared memory (what
// __cvta_generic_to_shared gives on a GPU; wgmma descriptors hold it), and back. Congruent with
// the generic address modulo 1024, so that aligning either aligns both (the swizzle patterns are
// functions of the shared address's bits 4 to 9).
uint32_t smem_address(const void* p);
void* smem_pointer(uint32_t address, size_t bytes);
// wgmma.mma_async.sync.aligned.m64nNk16 (bf16) / m64nNk8 (tf32), f32 accumulators d[N / 2]; A from
// the shared-memory descriptor desc_a, or (a != nullptr) from the registers a[4]; B from desc_b.
// A warpgroup collective (the 128 threads of warps 4 j .. 4 j + 3). The product is deferred: it is
// formed, reading the shared memory then, when wgmma_wait retires its group.
enum class WgmmaType : uint8_t { bf16, tf32 };
void wgmma(WgmmaType type, int n, float* d, uint64_t desc_a, const uint32_t* a, uint64_t desc_b,
           bool accumulate, int scale_a, int scale_b, int trans_a, int trans_b);
void wgmma_fence();
void wgmma_commit();
void wgmma_wait(int pending_groups);
// mbarrier objects (8 bytes of shared memory: the state lives in them). arrive returns the
// state token (its phase bit); tx_bytes > 0 is arrive.expect_tx.
void mbarrier_init(uint64_t* bar, uint32_t count);
uint64_t mbarrier_arrive(uint64_t* bar, uint32_t tx_bytes);
void mbarrier_expect_tx(uint64_t* bar, uint32_t tx_bytes);
// Whether the phase of parity `parity` has completed. Performs the tensor loads queued on bar
// first; a false result lets the other threads run.
bool mbarrier_try_wait_parity(uint64_t* bar, uint32_t parity);
// cp.async.bulk.tensor.{1-5}d tile loads (global -> shared, complete_tx on bar: queued, performed
// when a thread waits on bar) and stores (shared -> global, bulk groups per thread: performed at
// bulk_wait or the thread's end). map: a CUtensorMap from the emulated cuTensorMapEncodeTiled.
void tma_load(void* dst, const void* map, const int32_t* coords, int rank, uint64_t* bar);
void tma_store(const void* map, const int32_t* coords, int rank, const void* src);
void bulk_commit();
void bulk_wait(int pending_groups);

inline float flush_subnormal(float x) {
  return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.f, x) : x;
}
// ex2.approx.ftz.f32 and rcp.approx.ftz.f32 (exact rather than approximate: within their bounds).
inline float ex2_approx_ftz(float x) {
  return flush_subnormal(std::exp2(flush_subnormal(x)));
}
inline float rcp_approx_ftz(float x) {
  return flush_subnormal(1.f / flush_subnormal(x));
}

template <class T>
uint64_t to_bits(const T& v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffles move 8 bytes at most");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <class T>
T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

}  // namespace hlm::emu

#define threadIdx (::hlm::emu::t_thread_idx)
#define blockIdx (::hlm::emu::t_block_idx)
#define blockDim (::hlm::emu::t_block_dim)
#define gridDim (::hlm::emu::t_grid_dim)
#ifndef warpSize
#define warpSize 32
#endif

// ---- intrinsics of device code, as host functions

inline void __syncthreads() {
  (void)::hlm::emu::syncthreads_count(0);
}
inline int __syncthreads_count(int p) {
  return ::hlm::emu::syncthreads_count(p != 0);
}
inline int __syncthreads_or(int p) {
  return ::hlm::emu::syncthreads_count(p != 0) != 0;
}
inline int __syncthreads_and(int p) {
  return ::hlm::emu::syncthreads_count(p == 0) == 0;
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::hlm::emu::syncwarp(mask);
}
template <class T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  using namespace ::hlm::emu;
  return from_bits<T>(shfl(mask, to_bits(v), Shfl::idx, src, width));
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
  using namespace ::hlm::emu;
  return from_bits<T>(shfl(mask, to_bits(v), Shfl::up, int(d), width));
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
  using namespace ::hlm::emu;
  return from_bits<T>(shfl(mask, to_bits(v), Shfl::down, int(d), width));
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  using namespace ::hlm::emu;
  return from_bits<T>(shfl(mask, to_bits(v), Shfl::bfly, lane_mask, width));
}
inline unsigned __ballot_sync(unsigned mask, int p) {
  return ::hlm::emu::ballot(mask, p != 0);
}
inline int __any_sync(unsigned mask, int p) {
  return ::hlm::emu::ballot(mask, p != 0) != 0;
}
inline int __all_sync(unsigned mask, int p) {
  return ::hlm::emu::ballot(mask, p != 0) == mask;
}

inline unsigned __float_as_uint(float x) {
  return ::hlm::emu::from_bits<unsigned>(::hlm::emu::to_bits(x));
}
inline float __uint_as_float(unsigned x) {
  return ::hlm::emu::from_bits<float>(::hlm::emu::to_bits(x));
}
inline int __float_as_int(float x) {
  return ::hlm::emu::from_bits<int>(::hlm::emu::to_bits(x));
}
inline float __int_as_float(int x) {
  return ::hlm::emu::from_bits<float>(::hlm::emu::to_bits(x));
}
inline long long __double_as_longlong(double x) {
  return ::hlm::emu::from_bits<long long>(::hlm::emu::to_bits(x));
}
inline double __longlong_as_double(long long x) {
  return ::hlm::emu::from_bits<double>(::hlm::emu::to_bits(x));
}
inline float __expf(float x) {
  return std::exp(x);
}
inline float __logf(float x) {
  return std::log(x);
}
inline float __fdividef(float a, float b) {
  return a / b;
}
inline float __frcp_rn(float x) {
  return 1.f / x;
}
inline float __fmaf_rn(float a, float b, float c) {
  return std::fma(a, b, c);
}
inline float __fadd_rn(float a, float b) {
  return a + b;
}
inline float __fmul_rn(float a, float b) {
  return a * b;
}
inline double __dadd_rn(double a, double b) {
  return a + b;
}
inline double __dmul_rn(double a, double b) {
  return a * b;
}
inline double __ddiv_rn(double a, double b) {
  return a / b;
}
inline double __dsqrt_rn(double x) {
  return std::sqrt(x);
}
inline float __saturatef(float x) {
  return x < 0.f ? 0.f : (x > 1.f ? 1.f : x);
}
inline float rsqrtf(float x) {
  return 1.f / std::sqrt(x);
}
inline double rsqrt(double x) {
  return 1.0 / std::sqrt(x);
}
inline int __popc(unsigned x) {
  return __builtin_popcount(x);
}
inline int __clz(int x) {
  return x == 0 ? 32 : __builtin_clz(unsigned(x));
}
inline int __ffs(int x) {
  return __builtin_ffs(x);
}
template <class T>
T __ldg(const T* p) {
  return *p;
}
// Integer atomicAdd (the old value back), on shared or global memory. Integer sums do not depend
// on the order of the adds, so the race check's two orders leave the same bytes.
template <class T>
requires(std::is_same_v<T, int> || std::is_same_v<T, unsigned> ||
         std::is_same_v<T, unsigned long long>) T atomicAdd(T* p, T v) {
  return std::atomic_ref<T>(*p).fetch_add(v);
}
// Dynamic shared memory only (static __shared__ arrays are thread-local host statics here).
inline size_t __cvta_generic_to_shared(const void* p) {
  return ::hlm::emu::smem_address(p);
}
#undef __grid_constant__
#define __grid_constant__
