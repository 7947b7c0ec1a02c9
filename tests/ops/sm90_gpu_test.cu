// Hopper's asynchronous primitives (src/ops/cuda/sm90.cuh) against FP64 and against the layouts
// the PTX ISA documents, on the GPU and on the CPU emulation alike, so a run on an H100 / H200
// checks the emulation's wgmma, mbarrier and TMA:
//   - Sm90Gpu.WgmmaFollowsTheDocumentedLayouts: one warpgroup's wgmma over tiles a kernel wrote
//     into shared memory in each canonical layout (K-major and M/N-major, no swizzle and spans of
//     32, 64 and 128 bytes), bf16 and tf32, A from shared memory and from registers, several K
//     steps, negated operands, accumulate on and off, N from 8 to 256, against FP64 products of
//     the rounded operands;
//   - Sm90Gpu.TmaPlacesBoxesAsTheSwizzleSays: tensor loads of boxes partly outside a tensor (zeros
//     there), in every swizzle, the shared bytes read back; tensor stores that write only inside
//     (rows in whole 16-byte units), at the coordinates the hardware allows (docs/cuda_emu.md);
//   - Sm90Gpu.PipelinedGemm: a TMA producer warp and a wgmma consumer warpgroup through a ring of
//     shared-memory stages with full / empty mbarriers, against FP64.
// Skips when no GPU is present (the emulation build runs it on the CPU).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/device.h"
#include "core/rng.h"
#include "ops/cuda/sm90.cuh"
#include "testing.h"

namespace hlm {
namespace {

namespace sm = ops::cuda::sm90;

uint16_t bf16_bits(float x) {  // round to nearest even (finite values)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
float bf16_value(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
float tf32_value(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u &= 0xffffe000u;
  std::memcpy(&x, &u, 4);
  return x;
}

template <class T>
struct DeviceBuffer {
  T* p = nullptr;
  explicit DeviceBuffer(size_t n) { EXPECT_EQ(cudaMalloc(&p, n * sizeof(T) + 16), cudaSuccess); }
  DeviceBuffer(const std::vector<T>& h) : DeviceBuffer(h.size()) {
    EXPECT_EQ(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(p); }
  std::vector<T> read(size_t n) const {
    std::vector<T> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
};

// ---------------------------------------------------------------- wgmma layouts

// A canonical operand layout (what the kernel below writes, what the descriptors describe).
struct Layout {
  int span = 0;  // swizzle span in bytes: 0 (none), 32, 64, 128
  bool mn_major = false;
  uint32_t lbo = 0, sbo = 0;  // bytes
  __host__ __device__ sm::Swizzle mode() const {
    return span == 128  ? sm::Swizzle::b128
           : span == 64 ? sm::Swizzle::b64
           : span == 32 ? sm::Swizzle::b32
                        : sm::Swizzle::none;
  }
};

// The byte offset of element (mn, k) of an operand tile from its 1024-byte aligned start: the
// layouts as the PTX ISA's "Shared memory matrix layout" section draws them.
__host__ __device__ uint32_t layout_offset(const Layout& L, int mn, int k, int esz) {
  uint32_t a;
  if (!L.mn_major) {
    const uint32_t kb = uint32_t(k * esz), r = uint32_t(mn);
    if (L.span == 0)
      a = (r % 8) * 16 + (r / 8) * L.sbo + (kb / 16) * L.lbo + kb % 16;
    else  // K beyond one span row lies in the next atom along K, placed after all M/N atoms
      a = (r % 8) * L.span + (r / 8) * L.sbo + kb % L.span + (kb / L.span) * L.lbo;
  } else {
    const uint32_t mb = uint32_t(mn * esz), r = uint32_t(k);
    if (L.span == 0)
      a = (r % 8) * 16 + (r / 8) * L.lbo + (mb / 16) * L.sbo + mb % 16;
    else
      a = (r % 8) * L.span + (r / 8) * L.sbo + (mb / L.span) * L.lbo + mb % L.span;
  }
  const uint32_t bits = L.span == 128 ? 7u : L.span == 64 ? 3u : L.span == 32 ? 1u : 0u;
  return a ^ (((a >> 7) & bits) << 4);
}

// The descriptor start of K step s (16 bf16 or 8 tf32 elements: 32 bytes of K).
__host__ __device__ uint32_t step_offset(const Layout& L, int s) {
  if (!L.mn_major)
    return L.span == 0 ? 2 * s * L.lbo : (32 * s) % L.span + (32 * s / L.span) * L.lbo;
  return 2 * s * (L.span == 0 ? L.lbo : L.sbo);  // two 8-row groups of K per step
}

struct WgCase {
  Layout a, b;
  int n = 0, k = 0;                   // the product's N and K (K a multiple of the instruction's)
  uint32_t a_bytes = 0, b_bytes = 0;  // the tiles' extents in shared memory
  bool accumulate = true;             // the first step adds to the initial D
};

// One warpgroup: writes A [64 x K] and B [K x N] (row-major in global memory, bf16 bits or f32)
// into shared memory in their layouts, runs the K steps, and writes D [64 x N] (row-major) from
// the fragment. kRegsA: A from registers (loaded from global memory in the fragment's layout).
template <int N, bool kTf32, int kTransA, int kTransB, bool kRegsA, int kScaleA, int kScaleB>
__global__ void wgmma_case_kernel(WgCase c, const void* A, const void* B, const float* D0,
                                  float* D) {
  extern __shared__ unsigned char smem_raw[];
  using E = std::conditional_t<kTf32, uint32_t, uint16_t>;
  constexpr int esz = sizeof(E), kStep = kTf32 ? 8 : 16;
  unsigned char* base = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  unsigned char* sa = base;
  unsigned char* sb = base + ((c.a_bytes + 1023) & ~1023u);
  const int tid = int(threadIdx.x);
  const E* a = static_cast<const E*>(A);
  const E* b = static_cast<const E*>(B);
  if (!kRegsA)
    for (int i = tid; i < 64 * c.k; i += 128)
      *reinterpret_cast<E*>(sa + layout_offset(c.a, i / c.k, i % c.k, esz)) = a[i];
  for (int i = tid; i < c.k * N; i += 128)  // B [K x N] row-major: element (k, n) has mn = n
    *reinterpret_cast<E*>(sb + layout_offset(c.b, i % N, i / N, esz)) = b[i];
  sm::fence_proxy_async();
  __syncthreads();
  const int w = tid / 32, g = (tid % 32) >> 2, t = tid & 3;
  float d[N / 2];
  for (int r = 0; r < N / 2; ++r)
    d[r] = D0[(16 * w + g + 8 * ((r >> 1) & 1)) * N + 8 * (r >> 2) + 2 * t + (r & 1)];
  sm::wgmma_fence();
  for (int s = 0; s < c.k / kStep; ++s) {
    const uint64_t db = sm::smem_desc(sb + step_offset(c.b, s), c.b.mode(), c.b.lbo, c.b.sbo);
    const bool acc = s > 0 || c.accumulate;
    if constexpr (kRegsA) {
      uint32_t ar[4];
      for (int r = 0; r < 4; ++r) {
        const int row = 16 * w + g + 8 * (r & 1);
        if constexpr (kTf32) {
          ar[r] = a[row * c.k + s * 8 + t + 4 * (r >> 1)];
        } else {
          const int col = s * 16 + 2 * t + 8 * (r >> 1);
          ar[r] = uint32_t(a[row * c.k + col]) | (uint32_t(a[row * c.k + col + 1]) << 16);
        }
      }
      if constexpr (kTf32)
        sm::wgmma_tf32<N, kScaleA, kScaleB>(d, ar, db, acc);
      else
        sm::wgmma_bf16<N, kScaleA, kScaleB, kTransB>(d, ar, db, acc);
    } else {
      const uint64_t da = sm::smem_desc(sa + step_offset(c.a, s), c.a.mode(), c.a.lbo, c.a.sbo);
      if constexpr (kTf32)
        sm::wgmma_tf32<N, kScaleA, kScaleB>(d, da, db, acc);
      else
        sm::wgmma_bf16<N, kScaleA, kScaleB, kTransA, kTransB>(d, da, db, acc);
    }
  }
  sm::wgmma_commit();
  sm::wgmma_wait<0>();
  for (int r = 0; r < N / 2; ++r)
    D[(16 * w + g + 8 * ((r >> 1) & 1)) * N + 8 * (r >> 2) + 2 * t + (r & 1)] = d[r];
}

// Runs one case on random operands and compares D with FP64 products of the rounded operands.
template <int N, bool kTf32, int kTransA, int kTransB, bool kRegsA, int kScaleA = 1,
          int kScaleB = 1>
void check_wgmma(const char* name, WgCase c, uint64_t seed) {
  SCOPED_TRACE(name);
  c.n = N;
  Rng rng(seed);
  const int M = 64, K = c.k;
  std::vector<double> a(size_t(M) * K), b(size_t(K) * N), d0(size_t(M) * N);
  std::vector<uint16_t> ah(a.size()), bh(b.size());
  std::vector<float> af(a.size()), bf(b.size()), d0f(d0.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const float x = float(rng.uniform() * 2 - 1);
    ah[i] = bf16_bits(x);
    af[i] = x;
    a[i] = kTf32 ? tf32_value(x) : bf16_value(ah[i]);
  }
  for (size_t i = 0; i < b.size(); ++i) {
    const float x = float(rng.uniform() * 2 - 1);
    bh[i] = bf16_bits(x);
    bf[i] = x;
    b[i] = kTf32 ? tf32_value(x) : bf16_value(bh[i]);
  }
  for (size_t i = 0; i < d0.size(); ++i) d0[i] = d0f[i] = float(rng.uniform() * 4 - 2);
  DeviceBuffer<float> dA(af), dB(bf), dD0(d0f), dD(d0.size());
  DeviceBuffer<uint16_t> hA(ah), hB(bh);
  const void* pa = kTf32 ? static_cast<const void*>(dA.p) : hA.p;
  const void* pb = kTf32 ? static_cast<const void*>(dB.p) : hB.p;
  const size_t smem = 1024 + ((c.a_bytes + 1023) & ~1023u) + c.b_bytes;
  auto kernel = wgmma_case_kernel<N, kTf32, kTransA, kTransB, kRegsA, kScaleA, kScaleB>;
  ASSERT_EQ(cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
            cudaSuccess);
  kernel<<<1, 128, smem>>>(c, pa, pb, dD0.p, dD.p);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<float> got = dD.read(d0.size());
  double worst = 0;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double ref = c.accumulate ? d0[size_t(m) * N + n] : 0.0;
      for (int k = 0; k < K; ++k)
        ref += (kScaleA * a[size_t(m) * K + k]) * (kScaleB * b[size_t(k) * N + n]);
      worst = std::max(worst, std::abs(double(got[size_t(m) * N + n]) - ref));
    }
  // FP32 accumulation of K products of magnitude <= 1 (the hardware's order is not documented).
  EXPECT_LT(worst, 2e-5 * K) << name << ": worst |D - FP64| " << worst;
}

Layout k_major(int span, int rows, int esz, int k) {
  Layout L;
  L.span = span;
  if (span == 0) {
    L.lbo = 128;                           // core matrices along K next to each other
    L.sbo = uint32_t(k * esz / 16) * 128;  // then the next 8 rows
  } else {
    L.sbo = uint32_t(8 * span);                     // 8-row atoms one after another
    L.lbo = uint32_t(((rows + 7) / 8) * 8 * span);  // a second K atom after all of them
  }
  return L;
}
Layout mn_major(int span, int mn, int esz, int k) {
  Layout L;
  L.span = span;
  L.mn_major = true;
  if (span == 0) {
    L.sbo = 128;                            // core matrices along M/N next to each other
    L.lbo = uint32_t(mn * esz / 16) * 128;  // then the next 8 k-rows
  } else {
    L.sbo = uint32_t(8 * span);            // 8 k-rows of one M/N atom
    L.lbo = uint32_t((k / 8) * 8 * span);  // the next atom along M/N
  }
  return L;
}

TEST(Sm90Gpu, WgmmaFollowsTheDocumentedLayouts) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  const uint64_t seed = testing::test_seed();
  const auto tiles = [](WgCase c, int n, int esz) {
    c.a_bytes = uint32_t(64 * c.k * esz) + 1024;
    c.b_bytes = uint32_t(n * c.k * esz) + 1024;
    return c;
  };
  {  // bf16, K-major, 128-byte swizzle: 4 K steps inside one 128-byte row
    WgCase c;
    c.k = 64;
    c.a = k_major(128, 64, 2, c.k);
    c.b = k_major(128, 64, 2, c.k);
    check_wgmma<64, false, 0, 0, false>("bf16 K-major sw128 N64", tiles(c, 64, 2), seed);
  }
  {  // bf16, K-major, no swizzle, N = 8, D not accumulated
    WgCase c;
    c.k = 32;
    c.accumulate = false;
    c.a = k_major(0, 64, 2, c.k);
    c.b = k_major(0, 8, 2, c.k);
    check_wgmma<8, false, 0, 0, false>("bf16 K-major none N8", tiles(c, 8, 2), seed + 1);
  }
  {  // bf16, K-major 32-byte swizzle (one K step per atom: the next K atom at LBO), N = 256
    WgCase c;
    c.k = 32;
    c.a = k_major(32, 64, 2, c.k);
    c.b = k_major(32, 256, 2, c.k);
    check_wgmma<256, false, 0, 0, false>("bf16 K-major sw32 N256", tiles(c, 256, 2), seed + 2);
  }
  {  // bf16, M/N-major A and B, 128-byte swizzle: N = 128 is two atoms along N (LBO)
    WgCase c;
    c.k = 32;
    c.a = mn_major(128, 64, 2, c.k);
    c.b = mn_major(128, 128, 2, c.k);
    check_wgmma<128, false, 1, 1, false>("bf16 MN-major sw128 N128", tiles(c, 128, 2), seed + 3);
  }
  {  // bf16, M/N-major, no swizzle, A negated
    WgCase c;
    c.k = 32;
    c.a = mn_major(0, 64, 2, c.k);
    c.b = mn_major(0, 16, 2, c.k);
    check_wgmma<16, false, 1, 1, false, -1>("bf16 MN-major none N16 -A", tiles(c, 16, 2), seed + 4);
  }
  {  // bf16, 64-byte swizzle, A K-major, B M/N-major
    WgCase c;
    c.k = 32;
    c.a = k_major(64, 64, 2, c.k);
    c.b = mn_major(64, 32, 2, c.k);
    check_wgmma<32, false, 0, 1, false>("bf16 K/MN sw64 N32", tiles(c, 32, 2), seed + 5);
  }
  {  // bf16, A from registers, B K-major 64-byte swizzle, B negated
    WgCase c;
    c.k = 32;
    c.a = k_major(0, 64, 2, c.k);  // unused
    c.b = k_major(64, 64, 2, c.k);
    check_wgmma<64, false, 0, 0, true, 1, -1>("bf16 regs A, sw64 B N64 -B", tiles(c, 64, 2),
                                              seed + 6);
  }
  {  // tf32, K-major 128-byte swizzle: 4 K steps of 8
    WgCase c;
    c.k = 32;
    c.a = k_major(128, 64, 4, c.k);
    c.b = k_major(128, 32, 4, c.k);
    check_wgmma<32, true, 0, 0, false>("tf32 K-major sw128 N32", tiles(c, 32, 4), seed + 7);
  }
  {  // tf32, K-major no swizzle, A from registers
    WgCase c;
    c.k = 16;
    c.a = k_major(0, 64, 4, c.k);
    c.b = k_major(0, 64, 4, c.k);
    check_wgmma<64, true, 0, 0, true>("tf32 regs A, none B N64", tiles(c, 64, 4), seed + 8);
  }
}

// ---------------------------------------------------------------- TMA

// Loads the box at (c0, c1) of the map into shared memory and copies the shared bytes out as they
// are; then stores the same box to (s0, s1) of the second map.
__global__ void tma_box_kernel(const __grid_constant__ CUtensorMap in,
                               const __grid_constant__ CUtensorMap out, int c0, int c1, int s0,
                               int s1, uint32_t box_bytes, unsigned char* raw) {
  extern __shared__ unsigned char smem_raw[];
  unsigned char* base = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  auto* bar = reinterpret_cast<uint64_t*>(base + box_bytes);
  if (threadIdx.x == 0) {
    sm::mbarrier_init(bar, 1);
    sm::fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    sm::mbarrier_arrive_expect_tx(bar, box_bytes);
    sm::tma_load<2>(base, &in, {c0, c1}, bar);
  }
  sm::mbarrier_wait(bar, 0);
  for (uint32_t i = threadIdx.x; i < box_bytes; i += blockDim.x) raw[i] = base[i];
  __syncthreads();
  if (threadIdx.x == 0) {
    sm::tma_store<2>(&out, {s0, s1}, base);
    sm::bulk_commit();
    sm::bulk_wait<0>();
  }
}

TEST(Sm90Gpu, TmaPlacesBoxesAsTheSwizzleSays) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  // A bf16 tensor of 100 x 37 (inner dimension 100, rows padded to 112 elements = 224 bytes).
  const int W = 100, H = 37, pitch = 112;
  std::vector<uint16_t> t(size_t(pitch) * H);
  for (size_t i = 0; i < t.size(); ++i) t[i] = uint16_t(i * 7 + 3);
  DeviceBuffer<uint16_t> src(t);
  struct Mode {
    CUtensorMapSwizzle swz;
    int span;
  };
  for (const Mode md :
       {Mode{CU_TENSOR_MAP_SWIZZLE_NONE, 0}, Mode{CU_TENSOR_MAP_SWIZZLE_32B, 32},
        Mode{CU_TENSOR_MAP_SWIZZLE_64B, 64}, Mode{CU_TENSOR_MAP_SWIZZLE_128B, 128}}) {
    SCOPED_TRACE(md.span);
    const int bw = md.span ? md.span / 2 : 24, bh = 16;  // box inner elements fill the span
    const uint32_t box_bytes = uint32_t(bw * bh * 2);
    std::vector<uint16_t> o(size_t(pitch) * H, 0xbeef);
    DeviceBuffer<uint16_t> dst(o);
    const CUtensorMap in =
        sm::tensor_map(src.p, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, {uint64_t(W), uint64_t(H)},
                       {uint64_t(pitch * 2)}, {uint32_t(bw), uint32_t(bh)}, md.swz);
    const CUtensorMap out =
        sm::tensor_map(dst.p, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, {uint64_t(W), uint64_t(H)},
                       {uint64_t(pitch * 2)}, {uint32_t(bw), uint32_t(bh)}, md.swz);
    DeviceBuffer<unsigned char> raw(box_bytes);
    // Inner coordinates on 16-byte boundaries (8 bf16), and stores at no negative coordinate, as
    // the hardware requires (docs/cuda_emu.md).
    const int c0 = (W - bw / 2) / 8 * 8, c1 = -5;  // past the right edge and above the top
    const int s0 = c0, s1 = H - 9;                 // past the right edge and the bottom
    const size_t smem = 1024 + box_bytes + 16;
    ASSERT_EQ(cudaFuncSetAttribute(reinterpret_cast<const void*>(tma_box_kernel),
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
              cudaSuccess);
    tma_box_kernel<<<1, 64, smem>>>(in, out, c0, c1, s0, s1, box_bytes, raw.p);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    const std::vector<unsigned char> r = raw.read(box_bytes);
    const std::vector<uint16_t> stored = dst.read(o.size());
    int bad = 0;
    for (int y = 0; y < bh; ++y)
      for (int x = 0; x < bw; ++x) {
        // The box is dense (x fastest), then swizzled by the shared address.
        uint32_t off = uint32_t((y * bw + x) * 2);
        const uint32_t bits = md.span == 128 ? 7u : md.span == 64 ? 3u : md.span == 32 ? 1u : 0u;
        off ^= ((off >> 7) & bits) << 4;
        uint16_t v;
        std::memcpy(&v, r.data() + off, 2);
        const int gx = c0 + x, gy = c1 + y;
        const bool inside = gx >= 0 && gx < W && gy >= 0 && gy < H;
        const uint16_t want = inside ? t[size_t(gy) * pitch + gx] : 0;
        bad += v != want;
      }
    EXPECT_EQ(bad, 0) << "box elements misplaced";
    // The store wrote the box's elements that fall inside the tensor, with its rows' last 16-byte
    // units whole (elements 100 to 103 of each row: a GPU writes them), nothing else.
    int bad_store = 0;
    for (int y = 0; y < H; ++y)
      for (int x = 0; x < pitch; ++x) {
        const int bx = x - s0, by = y - s1;
        const bool in_box = x < (W + 7) / 8 * 8 && bx >= 0 && bx < bw && by >= 0 && by < bh;
        uint16_t want = 0xbeef;
        if (in_box) {
          const int gx = c0 + bx, gy = c1 + by;
          want = gx >= 0 && gx < W && gy >= 0 && gy < H ? t[size_t(gy) * pitch + gx] : 0;
        }
        const uint16_t got = stored[size_t(y) * pitch + x];
        if (got != want && ++bad_store <= 4)
          ADD_FAILURE() << "tensor store: element (" << x << ", " << y << ") holds " << got
                        << ", expected " << want;
      }
    EXPECT_EQ(bad_store, 0) << "tensor store";
  }
  // A map the driver refuses: a swizzled box wider than its span.
  testing::expect_error(
      [&] {
        sm::tensor_map(src.p, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, {uint64_t(W), uint64_t(H)},
                       {uint64_t(pitch * 2)}, {128u, 8u}, CU_TENSOR_MAP_SWIZZLE_128B);
      },
      "refused");
}

// ---------------------------------------------------------------- a pipelined GEMM

// C [64 x 128] = A [64 x K] B^T with A [64][K] and Bt [128][K] row-major bf16 (both K-major),
// K in tiles of 64 through kStages shared-memory stages. Warps 0-3 (a warpgroup) consume with
// wgmma; warp 4's first thread produces with TMA. full[s]: the stage's bytes have landed; empty[s]:
// the consumers are done with it.
constexpr int kStages = 3, kBK = 64, kBN = 128;
__global__ void pipelined_gemm_kernel(const __grid_constant__ CUtensorMap ma,
                                      const __grid_constant__ CUtensorMap mb, int K, float* C) {
  extern __shared__ unsigned char smem_raw[];
  unsigned char* base = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  constexpr uint32_t a_bytes = 64 * kBK * 2, b_bytes = kBN * kBK * 2;
  auto* full = reinterpret_cast<uint64_t*>(base + kStages * (a_bytes + b_bytes));
  uint64_t* empty = full + kStages;
  const int tid = int(threadIdx.x), tiles = K / kBK;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm::mbarrier_init(&full[s], 1);
      sm::mbarrier_init(&empty[s], 128);
    }
    sm::fence_mbarrier_init();
  }
  __syncthreads();
  if (tid >= 128) {  // the producer warp
    if (tid == 128)
      for (int i = 0; i < tiles; ++i) {
        const int s = i % kStages;
        if (i >= kStages) sm::mbarrier_wait(&empty[s], uint32_t((i / kStages - 1) & 1));
        unsigned char* st = base + s * (a_bytes + b_bytes);
        sm::mbarrier_arrive_expect_tx(&full[s], a_bytes + b_bytes);
        sm::tma_load<2>(st, &ma, {i * kBK, 0}, &full[s]);
        sm::tma_load<2>(st + a_bytes, &mb, {i * kBK, 0}, &full[s]);
      }
    return;
  }
  float d[kBN / 2];
  for (float& x : d) x = 0.f;
  for (int i = 0; i < tiles; ++i) {
    const int s = i % kStages;
    sm::mbarrier_wait(&full[s], uint32_t((i / kStages) & 1));
    unsigned char* st = base + s * (a_bytes + b_bytes);
    sm::wgmma_fence();
    for (int k = 0; k < kBK / 16; ++k) {  // 128-byte swizzled rows, 8-row atoms 1024 bytes apart
      const uint64_t da = sm::smem_desc(st + 32 * k, sm::Swizzle::b128, 16, 1024);
      const uint64_t db = sm::smem_desc(st + a_bytes + 32 * k, sm::Swizzle::b128, 16, 1024);
      sm::wgmma_bf16<kBN>(d, da, db, true);
    }
    sm::wgmma_commit();
    sm::wgmma_wait<0>();
    sm::mbarrier_arrive(&empty[s]);
  }
  const int w = tid / 32, g = (tid % 32) >> 2, t = tid & 3;
  for (int r = 0; r < kBN / 2; ++r)
    C[(16 * w + g + 8 * ((r >> 1) & 1)) * kBN + 8 * (r >> 2) + 2 * t + (r & 1)] = d[r];
}

TEST(Sm90Gpu, PipelinedGemm) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  const int M = 64, N = kBN, K = cuda_emulated() ? 320 : 4096;  // 5 tiles: the ring wraps
  Rng rng(testing::test_seed());
  std::vector<uint16_t> a(size_t(M) * K), b(size_t(N) * K);
  for (auto& x : a) x = bf16_bits(float(rng.uniform() * 2 - 1));
  for (auto& x : b) x = bf16_bits(float(rng.uniform() * 2 - 1));
  DeviceBuffer<uint16_t> da(a), db(b);
  DeviceBuffer<float> dc(size_t(M) * N);
  const CUtensorMap ma =
      sm::tensor_map(da.p, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, {uint64_t(K), uint64_t(M)},
                     {uint64_t(K) * 2}, {uint32_t(kBK), 64u}, CU_TENSOR_MAP_SWIZZLE_128B);
  const CUtensorMap mb =
      sm::tensor_map(db.p, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, {uint64_t(K), uint64_t(N)},
                     {uint64_t(K) * 2}, {uint32_t(kBK), uint32_t(kBN)}, CU_TENSOR_MAP_SWIZZLE_128B);
  const size_t smem = 1024 + kStages * (64 + kBN) * kBK * 2 + 2 * kStages * 8;
  ASSERT_EQ(cudaFuncSetAttribute(reinterpret_cast<const void*>(pipelined_gemm_kernel),
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
            cudaSuccess);
  pipelined_gemm_kernel<<<1, 160, smem>>>(ma, mb, K, dc.p);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<float> c = dc.read(size_t(M) * N);
  double worst = 0;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double ref = 0;
      for (int k = 0; k < K; ++k)
        ref += double(bf16_value(a[size_t(m) * K + k])) * bf16_value(b[size_t(n) * K + k]);
      worst = std::max(worst, std::abs(c[size_t(m) * N + n] - ref));
    }
  EXPECT_LT(worst, 2e-5 * K) << "worst |C - FP64| " << worst;
}

}  // namespace
}  // namespace hlm
