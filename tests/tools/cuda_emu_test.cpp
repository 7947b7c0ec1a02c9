// The CPU emulation of CUDA (tools/cuda_emu), in the HLM_CUDA_EMU build only: the tensor-core
// products against the fragment layouts of the PTX ISA (mma.m16n8k8 .tf32, mma.m16n8k16 .bf16 and
// ldmatrix.x4, plain and transposed) and a 64 x 64 x 32 product through mma_tf32.cuh against FP64,
// shuffles in every mode, ballot / any / all (also on two disjoint half-warp masks at once),
// barrier counts, cp.async copies that land only at the wait, wgmma products and TMA loads that
// land at their waits, mbarrier phases, and the checks that abort a faulty kernel: a deadlocked
// barrier, a race (HLM_EMU_RACECHECK), an access past an allocation (also one reused from the CUDA
// allocator's cache), a bad launch configuration, wgmma and mbarrier misuse. (The layouts of
// wgmma and TMA are tested in tests/ops/sm90_gpu_test.cu, on the GPU too.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/rng.h"
#include "cuda_emu.h"
#include "ops/cuda/mma_tf32.cuh"
#include "ops/cuda/sm90.cuh"
#include "testing.h"

namespace hlm {
namespace {

template <class T>
T* device_array(size_t n) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
  return static_cast<T*>(p);
}

// A random float with all 23 mantissa bits random (so TF32 truncation matters).
float rand_float(Rng& rng) {
  return float(rng.uniform() * 2.0 - 1.0);
}

float tf32_trunc(float x) {
  return __uint_as_float(__float_as_uint(x) & 0xffffe000u);
}

// The fragment layout as the PTX ISA states it (lane = 4 g + t): A a0 (g, t), a1 (g + 8, t),
// a2 (g, t + 4), a3 (g + 8, t + 4); B b0 (t, g), b1 (t + 4, g); C / D c0 (g, 2t), c1 (g, 2t + 1),
// c2 (g + 8, 2t), c3 (g + 8, 2t + 1). D = A B + C with TF32 operands (low 13 bits ignored).
TEST(CudaEmu, MmaFragmentsFollowThePtxLayout) {
  Rng rng(testing::test_seed());
  float A[16][8], B[8][8], C[16][8];
  for (auto& r : A)
    for (float& x : r) x = rand_float(rng);
  for (auto& r : B)
    for (float& x : r) x = rand_float(rng);
  for (auto& r : C)
    for (float& x : r) x = rand_float(rng);
  float* D = device_array<float>(16 * 8);
  emu::launch(emu::LaunchConfig(1, 32), [&]() {
    const int l = int(threadIdx.x), g = l >> 2, t = l & 3;
    const uint32_t a[4] = {__float_as_uint(A[g][t]), __float_as_uint(A[g + 8][t]),
                           __float_as_uint(A[g][t + 4]), __float_as_uint(A[g + 8][t + 4])};
    const uint32_t b[2] = {__float_as_uint(B[t][g]), __float_as_uint(B[t + 4][g])};
    float d[4] = {C[g][2 * t], C[g][2 * t + 1], C[g + 8][2 * t], C[g + 8][2 * t + 1]};
    emu::mma_m16n8k8_tf32(d, a, b);
    D[g * 8 + 2 * t] = d[0], D[g * 8 + 2 * t + 1] = d[1];
    D[(g + 8) * 8 + 2 * t] = d[2], D[(g + 8) * 8 + 2 * t + 1] = d[3];
  });
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 8; ++j) {
      double ref = C[i][j];
      for (int k = 0; k < 8; ++k) ref += double(tf32_trunc(A[i][k])) * tf32_trunc(B[k][j]);
      EXPECT_NEAR(D[i * 8 + j], ref, 1e-6 * (1 + std::fabs(ref))) << "element " << i << ", " << j;
    }
  cudaFree(D);
}

// bf16 of x's top 16 bits (x rounded by truncation: exact for the values below).
uint16_t bf16_bits(float x) {
  return uint16_t(__float_as_uint(x) >> 16);
}
float bf16_value(uint16_t b) {
  return __uint_as_float(uint32_t(b) << 16);
}

// mma.m16n8k16 .bf16 with the fragments of the PTX ISA (lane = 4 g + t, two values per register,
// the lower index in the low half): A a0 (g, 2t..2t+1), a1 (g + 8, 2t..), a2 (g, 2t + 8..),
// a3 (g + 8, 2t + 8..); B b0 (2t..2t+1, g), b1 (2t + 8..2t + 9, g); C / D as for m16n8k8.
// The A and B fragments come from ldmatrix.x4 of row-major A [16][16] and of X = B^T [8][16] (the
// rows the attention kernels load that way), and the transposed load of B itself [16][8] padded
// to 16 columns must give the same B fragment: D = A B + C against FP64.
TEST(CudaEmu, Bf16MmaAndLdmatrixFollowThePtxLayout) {
  Rng rng(testing::test_seed());
  alignas(16) uint16_t A[16][16], X[8][16], B[16][16];
  float C[16][8];
  for (auto& r : A)
    for (uint16_t& x : r) x = bf16_bits(rand_float(rng));
  for (int n = 0; n < 8; ++n)
    for (int k = 0; k < 16; ++k) X[n][k] = bf16_bits(rand_float(rng));
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 16; ++n) B[k][n] = n < 8 ? X[n][k] : uint16_t(0);
  for (auto& r : C)
    for (float& x : r) x = rand_float(rng);
  float* D = device_array<float>(2 * 16 * 8);
  uint32_t* frag = device_array<uint32_t>(32 * 8);
  emu::launch(emu::LaunchConfig(1, 32), [&]() {
    const int l = int(threadIdx.x), g = l >> 2, t = l & 3;
    uint32_t a[4], x[4], bt[4];
    // A: lane l addresses row l % 16, column 8 (l / 16); X rows: row l % 8, column 8 (l / 8);
    // B (k x n) transposed: row l % 8 + 8 ((l / 8) % 2), column 8 (l / 16).
    emu::ldmatrix_x4(a, &A[l & 15][8 * (l >> 4)], false);
    emu::ldmatrix_x4(x, &X[l & 7][8 * (l >> 3) % 16], false);
    emu::ldmatrix_x4(bt, &B[(l & 7) + 8 * ((l >> 3) & 1)][8 * (l >> 4)], true);
    for (int r = 0; r < 4; ++r) frag[l * 8 + r] = a[r];
    frag[l * 8 + 4] = x[0], frag[l * 8 + 5] = x[1], frag[l * 8 + 6] = bt[0],
                 frag[l * 8 + 7] = bt[1];
    const uint32_t b1[2] = {x[0], x[1]}, b2[2] = {bt[0], bt[1]};
    float d1[4] = {C[g][2 * t], C[g][2 * t + 1], C[g + 8][2 * t], C[g + 8][2 * t + 1]};
    float d2[4] = {d1[0], d1[1], d1[2], d1[3]};
    emu::mma_m16n8k16_bf16(d1, a, b1);
    emu::mma_m16n8k16_bf16(d2, a, b2);
    for (int e = 0; e < 4; ++e) {
      const int i = g + 8 * (e >> 1), j = 2 * t + (e & 1);
      D[i * 8 + j] = d1[e];
      D[128 + i * 8 + j] = d2[e];
    }
  });
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const auto pair = [](uint16_t lo, uint16_t hi) { return uint32_t(lo) | (uint32_t(hi) << 16); };
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    EXPECT_EQ(frag[l * 8 + 0], pair(A[g][2 * t], A[g][2 * t + 1])) << "lane " << l;
    EXPECT_EQ(frag[l * 8 + 1], pair(A[g + 8][2 * t], A[g + 8][2 * t + 1])) << "lane " << l;
    EXPECT_EQ(frag[l * 8 + 2], pair(A[g][2 * t + 8], A[g][2 * t + 9])) << "lane " << l;
    EXPECT_EQ(frag[l * 8 + 3], pair(A[g + 8][2 * t + 8], A[g + 8][2 * t + 9])) << "lane " << l;
    EXPECT_EQ(frag[l * 8 + 4], pair(X[g][2 * t], X[g][2 * t + 1])) << "lane " << l;
    EXPECT_EQ(frag[l * 8 + 5], pair(X[g][2 * t + 8], X[g][2 * t + 9])) << "lane " << l;
    EXPECT_EQ(frag[l * 8 + 6], frag[l * 8 + 4]) << "lane " << l << ": transposed load";
    EXPECT_EQ(frag[l * 8 + 7], frag[l * 8 + 5]) << "lane " << l << ": transposed load";
  }
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 8; ++j) {
      double ref = C[i][j];
      for (int k = 0; k < 16; ++k) ref += double(bf16_value(A[i][k])) * bf16_value(X[j][k]);
      EXPECT_NEAR(D[i * 8 + j], ref, 1e-6 * (1 + std::fabs(ref))) << "element " << i << ", " << j;
      EXPECT_EQ(D[128 + i * 8 + j], D[i * 8 + j]) << "element " << i << ", " << j;
    }
  cudaFree(D);
  cudaFree(frag);
}

// The project's warp products (mma_tf32.cuh) on the emulated tensor cores: a 64 x 64 product over
// k = 32 by 8 warps, in TF32 (rounded operands: ~1e-3 relative per product) and 3xTF32 (~1e-6),
// against FP64.
TEST(CudaEmu, WarpMmaProductsAgainstFp64) {
  using namespace ops::mma_cu;
  constexpr int M = 64, N = 64, Kd = 32, LD = Kd + 4;
  Rng rng(testing::test_seed());
  std::vector<float> a(M * LD), b(N * LD);  // A [M][Kd], B^T [N][Kd], row-major, padded
  for (float& x : a) x = rand_float(rng);
  for (float& x : b) x = rand_float(rng);
  std::vector<double> ref(M * N);
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j)
      for (int k = 0; k < Kd; ++k) ref[i * N + j] += double(a[i * LD + k]) * b[j * LD + k];
  double norm = 0;
  for (double r : ref) norm += r * r;
  for (int prec = 0; prec < 2; ++prec) {
    float* out = device_array<float>(M * N);
    emu::launch(emu::LaunchConfig(1, 256), [&]() {
      auto store = [&](int r, int c, float x) { out[r * N + c] = x; };
      if (prec == 0)
        block_mma<Prec::tf32, 1, 4>(M, N, Kd, Mat{a.data(), LD}, MatT{b.data(), LD}, store);
      else
        block_mma<Prec::tf32x3, 1, 4>(M, N, Kd, Mat{a.data(), LD}, MatT{b.data(), LD}, store);
    });
    double err = 0;
    for (int i = 0; i < M * N; ++i) err += (out[i] - ref[i]) * (out[i] - ref[i]);
    const double rel = std::sqrt(err / norm);
    std::printf("  %s: rel_l2 %.3e\n", prec ? "3xTF32" : "TF32", rel);
    if (prec == 0) {
      EXPECT_LT(rel, 2e-3);
      EXPECT_GT(rel, 1e-5);  // the operands were rounded: TF32 is not FP32
    } else {
      EXPECT_LT(rel, 3e-6);
    }
    cudaFree(out);
  }
}

TEST(CudaEmu, ShufflesInEveryMode) {
  int* out = device_array<int>(4 * 64);
  emu::launch(emu::LaunchConfig(1, 64), [&]() {
    const int t = int(threadIdx.x), v = 1000 + t;
    out[t] = __shfl_xor_sync(0xffffffffu, v, 5);
    out[64 + t] = __shfl_sync(0xffffffffu, v, 3, 16);
    out[128 + t] = __shfl_up_sync(0xffffffffu, v, 2, 8);
    out[192 + t] = __shfl_down_sync(0xffffffffu, v, 1);
  });
  for (int t = 0; t < 64; ++t) {
    const int w = t & ~31, l = t & 31;
    EXPECT_EQ(out[t], 1000 + w + (l ^ 5)) << t;
    EXPECT_EQ(out[64 + t], 1000 + w + (l & ~15) + 3) << t;
    EXPECT_EQ(out[128 + t], 1000 + t - ((l & 7) >= 2 ? 2 : 0)) << t;
    EXPECT_EQ(out[192 + t], 1000 + t + (l < 31 ? 1 : 0)) << t;
  }
  cudaFree(out);
}

TEST(CudaEmu, BallotAnyAll) {
  unsigned* out = device_array<unsigned>(4 * 64);
  emu::launch(emu::LaunchConfig(1, 64), [&]() {
    const int t = int(threadIdx.x), l = t & 31;
    out[t] = __ballot_sync(0xffffffffu, l % 3 == 0);
    out[64 + t] = unsigned(__any_sync(0xffffffffu, t == 40));              // only in warp 1
    out[128 + t] = unsigned(__all_sync(0xffffffffu, t < 60));              // warp 1 has 60..63
    out[192 + t] = unsigned(__all_sync(0x0000ffffu << (l & 16), l < 60));  // half-warp masks
  });
  unsigned every_third = 0;
  for (int l = 0; l < 32; l += 3) every_third |= 1u << l;
  for (int t = 0; t < 64; ++t) {
    EXPECT_EQ(out[t], every_third) << t;
    EXPECT_EQ(out[64 + t], t >= 32 ? 1u : 0u) << t;
    EXPECT_EQ(out[128 + t], t < 32 ? 1u : 0u) << t;
    EXPECT_EQ(out[192 + t], 1u) << t;
  }
  cudaFree(out);
}

TEST(CudaEmu, BarrierCountsAndExitedThreads) {
  int* out = device_array<int>(3 * 96);
  emu::launch(emu::LaunchConfig(2, 96), [&]() {
    const int t = int(threadIdx.x), b = int(blockIdx.x);
    const int n = __syncthreads_count(t % 3 == 0);
    const int any = __syncthreads_or(t == 95 && b == 1);
    if (t >= 64) return;  // exited threads do not hold the next barrier
    const int all = __syncthreads_and(1);
    if (b == 1) out[t] = n, out[96 + t] = any, out[192 + t] = all;
  });
  for (int t = 0; t < 64; ++t) {
    EXPECT_EQ(out[t], 32) << t;
    EXPECT_EQ(out[96 + t], 1) << t;
    EXPECT_EQ(out[192 + t], 1) << t;
  }
  cudaFree(out);
}

// cp.async lands when the thread waits for its group: before the wait the destination still
// holds what it held (shared memory starts as NaN bytes).
TEST(CudaEmu, CpAsyncLandsAtTheWait) {
  float* src = device_array<float>(8);
  for (int i = 0; i < 8; ++i) src[i] = float(i + 1);
  float* out = device_array<float>(3 * 8);
  emu::launch(emu::LaunchConfig(1, 2, 64), [&]() {
    float* sm = static_cast<float*>(emu::dynamic_smem());
    const int t = int(threadIdx.x);
    emu::cp_async(sm + 4 * t, src + 4 * t, 16);
    emu::cp_async_commit();
    out[4 * t] = sm[4 * t];  // not landed yet
    emu::cp_async(sm + 8 + 4 * t, src + 4 * t, 16);
    emu::cp_async_commit();
    emu::cp_async_wait(1);  // the first group landed, the second may not have
    out[8 + 4 * t] = sm[4 * t];
    out[16 + 4 * t] = sm[8 + 4 * t];
    emu::cp_async_wait(0);
  });
  for (int t = 0; t < 2; ++t) {
    EXPECT_TRUE(std::isnan(out[4 * t])) << t;
    EXPECT_EQ(out[8 + 4 * t], float(4 * t + 1)) << t;
    EXPECT_TRUE(std::isnan(out[16 + 4 * t])) << t;
  }
  cudaFree(src);
  cudaFree(out);
}

// ---------------------------------------------------------------- Hopper: wgmma, mbarrier, TMA

namespace sm = ops::cuda::sm90;

// A [64 x 16] and B [16 x 8] (bf16, K-major, no swizzle: core matrices along K 128 bytes apart,
// along M/N 256) in the block's dynamic shared memory from offset 0 (A) and 4096 (B).
void fill_wgmma_tiles(unsigned char* sm, int b_value) {
  const int t = int(threadIdx.x);
  for (int i = t; i < 64 * 16; i += 128) {
    const int m = i / 16, k = i % 16;
    const uint16_t one = 0x3f80;  // 1.0 in bf16
    std::memcpy(sm + (m % 8) * 16 + (m / 8) * 256 + (k / 8) * 128 + (k % 8) * 2, &one, 2);
  }
  for (int i = t; i < 8 * 16; i += 128) {
    const int n = i / 16, k = i % 16;
    const uint16_t v = uint16_t(__float_as_uint(float(b_value)) >> 16);
    std::memcpy(sm + 4096 + (n % 8) * 16 + (k / 8) * 128 + (k % 8) * 2, &v, 2);
  }
}

// The product is formed when its group is retired: the accumulators hold the old values before
// the wait, and the shared memory is read then (a kernel that overwrites an operand before the
// wait sees the new values used, which a GPU does not promise either).
TEST(CudaEmu, WgmmaLandsAtTheWait) {
  float* out = device_array<float>(128 * 3);
  emu::launch(emu::LaunchConfig(1, 128, 8192), [&]() {
    auto* sm = static_cast<unsigned char*>(emu::dynamic_smem());
    fill_wgmma_tiles(sm, 1);
    __syncthreads();
    const uint64_t da = sm::smem_desc(sm, sm::Swizzle::none, 128, 256);
    const uint64_t db = sm::smem_desc(sm + 4096, sm::Swizzle::none, 128, 256);
    float d[4] = {7.f, 7.f, 7.f, 7.f}, e[4] = {0.f, 0.f, 0.f, 0.f};
    sm::wgmma_fence();
    sm::wgmma_bf16<8>(d, da, db, false);
    sm::wgmma_commit();
    sm::wgmma_bf16<8>(e, da, db, true);
    sm::wgmma_commit();
    const int t = int(threadIdx.x);
    out[t] = d[0];        // not retired yet
    sm::wgmma_wait<1>();  // the first group only
    out[128 + t] = d[0] + 100.f * e[0];
    __syncthreads();
    fill_wgmma_tiles(sm, 2);  // B changes before the second group is retired
    __syncthreads();
    sm::wgmma_wait<0>();
    out[256 + t] = e[0];
  });
  for (int t = 0; t < 128; ++t) {
    EXPECT_EQ(out[t], 7.f) << t;
    EXPECT_EQ(out[128 + t], 16.f) << t;  // sum over 16 of 1 x 1; e untouched
    EXPECT_EQ(out[256 + t], 32.f) << t;  // read at the wait: 1 x 2
  }
  cudaFree(out);
}

// Phases complete on arrivals and transaction bytes; a tensor load lands when its barrier is
// waited on (before, its destination holds what it held).
TEST(CudaEmu, MbarrierPhasesAndTensorLoads) {
  float* src = device_array<float>(64);
  for (int i = 0; i < 64; ++i) src[i] = float(i);
  const CUtensorMap map = sm::tensor_map(src, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, {8, 8}, {32}, {8, 8},
                                         CU_TENSOR_MAP_SWIZZLE_NONE);
  float* out = device_array<float>(8);
  emu::launch(emu::LaunchConfig(1, 1, 1024), [&]() {
    auto* sm = static_cast<unsigned char*>(emu::dynamic_smem());
    auto* dst = reinterpret_cast<float*>(sm);
    auto* bar = reinterpret_cast<uint64_t*>(sm + 512);
    sm::mbarrier_init(bar, 1);
    sm::mbarrier_arrive_expect_tx(bar, 256);
    sm::tma_load<2>(dst, &map, {0, 0}, bar);
    out[0] = dst[9];  // not landed: the 0xff fill of shared memory
    out[1] = sm::mbarrier_try_wait(bar, 0) ? 1.f : 0.f;
    out[2] = dst[9];
    out[3] = sm::mbarrier_try_wait(bar, 1) ? 1.f : 0.f;  // phase 1 is in progress
    sm::mbarrier_arrive(bar);                            // completes it (no bytes expected)
    out[4] = sm::mbarrier_try_wait(bar, 1) ? 1.f : 0.f;
    out[5] = sm::mbarrier_try_wait(bar, 0) ? 1.f : 0.f;  // phase 2 (parity 0) is in progress
  });
  EXPECT_TRUE(std::isnan(out[0]));
  EXPECT_EQ(out[1], 1.f);
  EXPECT_EQ(out[2], 9.f);
  EXPECT_EQ(out[3], 0.f);
  EXPECT_EQ(out[4], 1.f);
  EXPECT_EQ(out[5], 0.f);
  cudaFree(src);
  cudaFree(out);
}

TEST(CudaEmuDeathTest, WgmmaMisuseAborts) {
  const auto product = [](bool wait, bool same_b, unsigned threads) {
    emu::launch(emu::LaunchConfig(1, threads, 8192), [=]() {
      auto* sm = static_cast<unsigned char*>(emu::dynamic_smem());
      float d[4] = {};
      const uint64_t db =
          sm::smem_desc(sm + (same_b || threadIdx.x ? 4096 : 6144), sm::Swizzle::none, 128, 256);
      sm::wgmma_bf16<8>(d, sm::smem_desc(sm, sm::Swizzle::none, 128, 256), db, false);
      sm::wgmma_commit();
      if (wait) sm::wgmma_wait<0>();
    });
  };
  EXPECT_DEATH(product(false, true, 128), "not retired");
  EXPECT_DEATH(product(true, false, 128), "different");
  EXPECT_DEATH(product(true, true, 64), "fewer than 128");
}

// A tensor copy whose innermost coordinate is off a 16-byte boundary, and a tensor store at a
// negative coordinate, abort (illegal instructions on an H100); a load at negative coordinates on
// the boundary does not.
TEST(CudaEmuDeathTest, TensorCopyOffSixteenBytesAborts) {
  float* src = device_array<float>(64);
  const CUtensorMap map = sm::tensor_map(src, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, {8, 8}, {32}, {8, 8},
                                         CU_TENSOR_MAP_SWIZZLE_NONE);
  const auto copy = [&](int32_t c0, int32_t c1, bool store) {
    emu::launch(emu::LaunchConfig(1, 1, 1024), [&]() {
      auto* sm = static_cast<unsigned char*>(emu::dynamic_smem());
      if (store) {
        sm::tma_store<2>(&map, {c0, c1}, sm);
        sm::bulk_commit();
        sm::bulk_wait<0>();
        return;
      }
      auto* bar = reinterpret_cast<uint64_t*>(sm + 512);
      sm::mbarrier_init(bar, 1);
      sm::mbarrier_arrive_expect_tx(bar, 256);
      sm::tma_load<2>(sm, &map, {c0, c1}, bar);
      sm::mbarrier_wait(bar, 0);
    });
  };
  copy(-4, -3, false);  // 16 bytes left of the tensor, rows above it: fine
  EXPECT_DEATH(copy(2, 0, false), "not on a 16-byte boundary");
  EXPECT_DEATH(copy(3, 0, true), "not on a 16-byte boundary");
  EXPECT_DEATH(copy(0, -3, true), "negative coordinate -3 of dimension 1");
  EXPECT_DEATH(copy(-4, 0, true), "negative coordinate -4 of dimension 0");
  cudaFree(src);
}

TEST(CudaEmuDeathTest, MbarrierMisuseAborts) {
  // Two arrivals expected, one comes: every thread polls forever.
  EXPECT_DEATH(emu::launch(emu::LaunchConfig(1, 64, 64),
                           []() {
                             auto* bar = static_cast<uint64_t*>(emu::dynamic_smem());
                             if (threadIdx.x == 0) sm::mbarrier_init(bar, 2);
                             __syncthreads();
                             if (threadIdx.x == 0) sm::mbarrier_arrive(bar);
                             sm::mbarrier_wait(bar, 0);
                           }),
               "cannot proceed");
  EXPECT_DEATH(emu::launch(emu::LaunchConfig(1, 32, 64),
                           []() {
                             auto* bar = static_cast<uint64_t*>(emu::dynamic_smem());
                             sm::mbarrier_arrive(bar);
                           }),
               "before mbarrier.init");
}

TEST(CudaEmu, BadLaunchConfigurationIsAnError) {
  (void)cudaGetLastError();
  emu::launch(emu::LaunchConfig(1, 2048), []() {});
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  emu::launch(emu::LaunchConfig(1, 32, 300000), []() {});
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

using CudaEmuDeathTest = ::testing::Test;

TEST(CudaEmuDeathTest, DivergentBarrierAborts) {
  EXPECT_DEATH(emu::launch(emu::LaunchConfig(1, 64),
                           []() {
                             if (threadIdx.x == 0)
                               (void)__shfl_xor_sync(0xffffffffu, 1, 1);
                             else
                               __syncthreads();
                           }),
               "cannot proceed");
}

// Thread t writes shared element t and reads t + 1 with no barrier between: the value read
// depends on the order the threads run in, which the race check finds.
void racy_neighbour(int* out, bool barrier) {
  emu::launch(emu::LaunchConfig(2, 64, 64 * sizeof(int)), [=]() {
    int* sm = static_cast<int*>(emu::dynamic_smem());
    const int t = int(threadIdx.x);
    sm[t] = t;
    if (barrier) __syncthreads();
    out[blockIdx.x * 64 + t] = sm[(t + 1) % 64];
  });
}

TEST(CudaEmuDeathTest, RaceCheckFindsAMissingBarrier) {
  int* out = device_array<int>(128);
  EXPECT_DEATH(
      {
        setenv("HLM_EMU_RACECHECK", "1", 1);
        racy_neighbour(out, false);
      },
      "race check");
  const char* was = std::getenv("HLM_EMU_RACECHECK");
  const std::string before = was ? was : "";
  setenv("HLM_EMU_RACECHECK", "1", 1);
  racy_neighbour(out, true);
  if (was)
    setenv("HLM_EMU_RACECHECK", before.c_str(), 1);
  else
    unsetenv("HLM_EMU_RACECHECK");
  for (int t = 0; t < 128; ++t) EXPECT_EQ(out[t], (t % 64 + 1) % 64) << t;
  cudaFree(out);
}

TEST(CudaEmuDeathTest, AccessPastAnAllocationFaults) {
  float* p = device_array<float>(64);  // 256 bytes, the allocation granule
  EXPECT_DEATH(emu::launch(emu::LaunchConfig(1, 65), [=]() { p[threadIdx.x] = 1.f; }), "");
  emu::launch(emu::LaunchConfig(1, 64), [=]() { p[threadIdx.x] = 1.f; });
  EXPECT_EQ(p[63], 1.f);
  cudaFree(p);
}

// The caching allocator (core/cuda_cache.h) reuses a block only for a request of its 256-byte
// class, so a tensor from the cache still ends at the guard page: an access past it faults.
TEST(CudaEmuDeathTest, AccessPastABlockFromTheCacheFaults) {
  const bool was_on = cuda_caching();
  cuda_set_caching(true);
  cuda_empty_cache();
  void* small = device_alloc(Device::cuda, 256);
  void* large = device_alloc(Device::cuda, 512);
  device_free(Device::cuda, small);
  device_free(Device::cuda, large);
  float* p = static_cast<float*>(device_alloc(Device::cuda, 200));  // the cached 256-byte block
  EXPECT_EQ(p, small);
  EXPECT_DEATH(emu::launch(emu::LaunchConfig(1, 65), [=]() { p[threadIdx.x] = 1.f; }), "");
  float* q = static_cast<float*>(device_alloc(Device::cuda, 256));  // not the 512-byte block
  EXPECT_NE(q, large);
  EXPECT_DEATH(emu::launch(emu::LaunchConfig(1, 65), [=]() { q[threadIdx.x] = 1.f; }), "");
  device_free(Device::cuda, p);
  device_free(Device::cuda, q);
  cuda_set_caching(was_on);
}

}  // namespace
}  // namespace hlm
