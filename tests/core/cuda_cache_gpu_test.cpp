// The caching allocator of CUDA memory (core/cuda_cache.h). Its policy (size classes, best fit
// within a quarter, the emulation's exact reuse and limit, the release-and-retry when memory runs
// out) against a fake backend of host memory with a capacity, which needs no GPU; then the
// allocator behind device_alloc on the device: reuse, the statistics after a known sequence,
// empty_cache, caching off, the out-of-memory retry, data integrity of a reused block, and threads
// allocating concurrently.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "core/cuda_cache.h"
#include "core/device.h"
#include "core/error.h"
#include "core/rng.h"

namespace hlm {
namespace {

constexpr size_t kKiB = 1024, kMiB = 1024 * kKiB;

// ------------------------------------------------------------------ the policy, on host memory

// Host memory with a capacity: an allocation that would take the total past it fails.
struct FakeDevice {
  size_t capacity = SIZE_MAX;
  size_t used = 0;
  std::map<void*, size_t> blocks;
};
FakeDevice g_fake;

void* fake_alloc(size_t bytes) {
  if (bytes > g_fake.capacity - g_fake.used) return nullptr;
  void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  g_fake.used += bytes;
  g_fake.blocks[p] = bytes;
  return p;
}

void fake_release(void* p) {
  const auto it = g_fake.blocks.find(p);
  ASSERT_NE(it, g_fake.blocks.end());
  g_fake.used -= it->second;
  g_fake.blocks.erase(it);
  std::free(p);
}

class CudaCachePolicy : public ::testing::Test {
 protected:
  void SetUp() override { g_fake = FakeDevice{}; }
  void TearDown() override { EXPECT_TRUE(g_fake.blocks.empty()); }
  static CachingAllocator::Backend fake() { return {&fake_alloc, &fake_release}; }
};

TEST_F(CudaCachePolicy, SizeClasses) {
  const auto cls = [](size_t n) { return CachingAllocator::size_class(n, false); };
  EXPECT_EQ(cls(0), 512u);
  EXPECT_EQ(cls(1), 512u);
  EXPECT_EQ(cls(512), 512u);
  EXPECT_EQ(cls(513), 1024u);
  EXPECT_EQ(cls(1 * kMiB), 1 * kMiB);
  EXPECT_EQ(cls(1 * kMiB + 1), 2 * kMiB);
  EXPECT_EQ(cls(3 * kMiB), 4 * kMiB);
  EXPECT_EQ(cls(4 * kMiB), 4 * kMiB);
  const auto exact = [](size_t n) { return CachingAllocator::size_class(n, true); };
  EXPECT_EQ(exact(0), 256u);
  EXPECT_EQ(exact(256), 256u);
  EXPECT_EQ(exact(257), 512u);
  EXPECT_EQ(exact(3 * kMiB + 1), 3 * kMiB + 256);
  EXPECT_THROW(cls(SIZE_MAX - 5), Error);
  // The waste bound of the header: class(n) < n + 512 (small), < n + 2 MiB and < 2 n (large).
  for (size_t n = 1; n < 64 * kMiB; n = n * 3 / 2 + 7) {
    EXPECT_GE(cls(n), n);
    EXPECT_LT(cls(n), n <= kMiB ? n + 512 : std::min(n + 2 * kMiB, 2 * n)) << n;
  }
}

TEST_F(CudaCachePolicy, BestFitWithinAQuarter) {
  CachingAllocator a(fake(), false);
  void* b4096 = a.allocate(4096);
  void* b5120 = a.allocate(5120);
  void* b8192 = a.allocate(8192);
  void* b64k = a.allocate(64 * kKiB);
  for (void* p : {b4096, b5120, b8192, b64k}) a.free(p);
  EXPECT_EQ(a.stats().cuda_malloc_count, 4u);
  EXPECT_EQ(a.stats().reserved_bytes, 4096u + 5120 + 8192 + 64 * kKiB);
  EXPECT_EQ(a.allocate(4000), b4096);  // class 4096: its own block
  EXPECT_EQ(a.allocate(4097), b5120);  // class 4608 takes 5120 <= 4608 * 1.25
  void* p6000 = a.allocate(6000);      // class 6144: 8192 > 7680 is too large, a new block
  EXPECT_NE(p6000, b8192);
  void* p1k = a.allocate(1000);  // a small request does not take the 64 KiB block
  EXPECT_NE(p1k, b64k);
  const CudaMemoryStats s = a.stats();
  EXPECT_EQ(s.cache_hits, 2u);
  EXPECT_EQ(s.cuda_malloc_count, 6u);
  EXPECT_EQ(s.in_use_bytes, 4096u + 5120 + 6144 + 1024);
  EXPECT_EQ(s.requested_bytes, 4000u + 4097 + 6000 + 1000);
  EXPECT_EQ(s.reserved_bytes, s.in_use_bytes + 8192 + 64 * kKiB);
  for (void* p : {b4096, b5120, p6000, p1k}) a.free(p);
  a.empty_cache();
  EXPECT_EQ(a.stats().reserved_bytes, 0u);
  EXPECT_EQ(a.stats().cuda_free_count, 6u);
}

TEST_F(CudaCachePolicy, ExactClassesReuseOnlyTheSameClass) {
  CachingAllocator a(fake(), true);
  void* p512 = a.allocate(512);
  a.free(p512);
  void* p256 = a.allocate(256);  // 512 would hide an access past 256 bytes
  EXPECT_NE(p256, p512);
  EXPECT_EQ(a.allocate(300), p512);  // class 512
  EXPECT_EQ(a.stats().cache_hits, 1u);
  EXPECT_EQ(a.stats().in_use_bytes, 256u + 512);
  a.free(p256);
  a.free(p512);
  a.empty_cache();
}

TEST_F(CudaCachePolicy, ALimitedCacheIsEmptiedWhenFull) {
  CachingAllocator a(fake(), true, 4096);
  void* b1 = a.allocate(1024);
  void* b2 = a.allocate(2048);
  void* b3 = a.allocate(2048);
  void* big = a.allocate(8192);
  a.free(b1);
  a.free(b2);
  EXPECT_EQ(a.stats().reserved_bytes - a.stats().in_use_bytes, 3072u);
  a.free(b3);  // 5120 bytes would be cached: b1 and b2 go first
  CudaMemoryStats s = a.stats();
  EXPECT_EQ(s.cuda_free_count, 2u);
  EXPECT_EQ(s.reserved_bytes - s.in_use_bytes, 2048u);
  a.free(big);  // larger than the limit: never cached
  s = a.stats();
  EXPECT_EQ(s.cuda_free_count, 3u);
  EXPECT_EQ(s.reserved_bytes, 2048u);
  EXPECT_EQ(a.allocate(2048), b3);
  a.free(b3);
  a.empty_cache();
}

TEST_F(CudaCachePolicy, OutOfMemoryReleasesTheCacheAndRetries) {
  g_fake.capacity = 1 * kMiB;
  CachingAllocator a(fake(), false);
  a.free(a.allocate(600 * kKiB));
  EXPECT_EQ(a.stats().reserved_bytes, 600 * kKiB);
  // 600 KiB cached + 700 KiB does not fit: the cache is released, the retry succeeds.
  void* p = a.allocate(700 * kKiB);
  CudaMemoryStats s = a.stats();
  EXPECT_EQ(s.cuda_free_count, 1u);
  EXPECT_EQ(s.cuda_malloc_count, 2u);
  EXPECT_EQ(s.reserved_bytes, 700 * kKiB);
  EXPECT_EQ(s.in_use_bytes, 700 * kKiB);
  EXPECT_EQ(s.peak_reserved_bytes, 700 * kKiB);
  // 700 KiB in use + 400 KiB never fits: one line naming the request and the bytes in use.
  try {
    (void)a.allocate(400 * kKiB);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("out of CUDA memory: a tensor of 409600 bytes (400.00 KiB)"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("700.00 KiB in use"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  s = a.stats();
  EXPECT_EQ(s.in_use_bytes, 700 * kKiB);
  EXPECT_EQ(s.requested_bytes, 700 * kKiB);
  a.free(p);
  a.empty_cache();
}

TEST_F(CudaCachePolicy, CachingOffGoesToTheBackendWithTheRequestedSize) {
  CachingAllocator a(fake(), false);
  a.free(a.allocate(1000));
  EXPECT_EQ(a.stats().reserved_bytes, 1024u);
  a.set_enabled(false);  // empties the cache
  EXPECT_EQ(a.stats().reserved_bytes, 0u);
  void* p = a.allocate(1000);
  EXPECT_EQ(g_fake.blocks.at(p), 1000u);
  a.free(p);
  EXPECT_TRUE(g_fake.blocks.empty());
  const CudaMemoryStats s = a.stats();
  EXPECT_EQ(s.cuda_malloc_count, 2u);
  EXPECT_EQ(s.cuda_free_count, 2u);
  EXPECT_EQ(s.cache_hits, 0u);
  EXPECT_EQ(s.peak_in_use_bytes, 1024u);
  // A block allocated while caching was off is not cached when it is freed after it is back on.
  void* q = a.allocate(1000);
  a.set_enabled(true);
  a.free(q);
  EXPECT_TRUE(g_fake.blocks.empty());
  EXPECT_THROW(a.free(q), Error);  // freed twice
}

// ------------------------------------------------------------------ the allocator of device_alloc

// Caching on (whatever HLM_CUDA_CACHE says) and an empty cache for the test; the setting is
// restored after it.
class CudaCache : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
    was_on_ = cuda_caching();
    cuda_set_caching(true);
    cuda_empty_cache();
    cuda_reset_peak_memory();
    before_ = cuda_memory_stats();
  }
  void TearDown() override {
    if (!cuda_available()) return;
    cuda_set_caching(was_on_);
    cuda_empty_cache();
  }
  static size_t cls(size_t n) { return CachingAllocator::size_class(n, cuda_emulated()); }
  bool was_on_ = true;
  CudaMemoryStats before_;
};

void* alloc(size_t n) {
  return device_alloc(Device::cuda, n);
}
void release(void* p) {
  device_free(Device::cuda, p);
}

TEST_F(CudaCache, FreedBlockIsReused) {
  void* p = alloc(1000);
  release(p);
  void* q = alloc(1000);
  EXPECT_EQ(q, p);
  const CudaMemoryStats s = cuda_memory_stats();
  EXPECT_EQ(s.cuda_malloc_count, before_.cuda_malloc_count + 1);
  EXPECT_EQ(s.cache_hits, before_.cache_hits + 1);
  release(q);
}

TEST_F(CudaCache, StatisticsOfAKnownSequence) {
  // Sizes whose classes (emulated or not) never serve each other.
  void* a = alloc(1000);
  void* b = alloc(3 * kMiB);
  const size_t ca = cls(1000), cb = cls(3 * kMiB), cc = cls(100);
  release(a);
  void* c = alloc(100);
  CudaMemoryStats s = cuda_memory_stats();
  EXPECT_EQ(s.requested_bytes - before_.requested_bytes, 3 * kMiB + 100);
  EXPECT_EQ(s.in_use_bytes - before_.in_use_bytes, cb + cc);
  EXPECT_EQ(s.peak_in_use_bytes - before_.in_use_bytes, cb + std::max(ca, cc));
  EXPECT_EQ(s.reserved_bytes - before_.reserved_bytes, ca + cb + cc);
  EXPECT_EQ(s.peak_reserved_bytes - before_.reserved_bytes, ca + cb + cc);
  EXPECT_EQ(s.cuda_malloc_count - before_.cuda_malloc_count, 3u);
  EXPECT_EQ(s.cache_hits, before_.cache_hits);
  release(b);
  cuda_reset_peak_memory();
  s = cuda_memory_stats();
  EXPECT_EQ(s.peak_in_use_bytes, s.in_use_bytes);
  EXPECT_EQ(s.in_use_bytes - before_.in_use_bytes, cc);
  EXPECT_EQ(s.peak_reserved_bytes, s.reserved_bytes);
  release(c);
  s = cuda_memory_stats();
  EXPECT_EQ(s.requested_bytes, before_.requested_bytes);
  EXPECT_EQ(s.in_use_bytes, before_.in_use_bytes);
  EXPECT_EQ(s.reserved_bytes - s.in_use_bytes, ca + cb + cc);  // all cached
}

TEST_F(CudaCache, EmptyCacheReleasesEveryCachedBlock) {
  void* keep = alloc(5000);
  for (size_t n : {size_t(700), size_t(70000), 3 * kMiB}) release(alloc(n));
  CudaMemoryStats s = cuda_memory_stats();
  EXPECT_GT(s.reserved_bytes, s.in_use_bytes);
  cuda_empty_cache();
  s = cuda_memory_stats();
  EXPECT_EQ(s.reserved_bytes, s.in_use_bytes);
  EXPECT_EQ(s.cuda_free_count - before_.cuda_free_count, 3u);
  release(keep);
}

TEST_F(CudaCache, CachingOffMallocsAndFreesEveryBlock) {
  cuda_set_caching(false);
  EXPECT_FALSE(cuda_caching());
  void* p = alloc(1000);
  CudaMemoryStats s = cuda_memory_stats();
  EXPECT_EQ(s.reserved_bytes - before_.reserved_bytes, 1000u);  // the requested size
  EXPECT_EQ(s.in_use_bytes - before_.in_use_bytes, 1000u);
  release(p);
  release(alloc(1000));
  s = cuda_memory_stats();
  EXPECT_EQ(s.cuda_malloc_count - before_.cuda_malloc_count, 2u);
  EXPECT_EQ(s.cuda_free_count - before_.cuda_free_count, 2u);
  EXPECT_EQ(s.cache_hits, before_.cache_hits);
  EXPECT_EQ(s.reserved_bytes, before_.reserved_bytes);
}

TEST_F(CudaCache, EnvironmentSetting) {
  const char* was = std::getenv("HLM_CUDA_CACHE");
  const std::string before = was ? was : "";
  setenv("HLM_CUDA_CACHE", "0", 1);
  EXPECT_FALSE(cuda_caching_from_env());
  setenv("HLM_CUDA_CACHE", "1", 1);
  EXPECT_TRUE(cuda_caching_from_env());
  setenv("HLM_CUDA_CACHE", "off", 1);
  EXPECT_THROW(cuda_caching_from_env(), Error);
  unsetenv("HLM_CUDA_CACHE");
  EXPECT_TRUE(cuda_caching_from_env());
  if (was) setenv("HLM_CUDA_CACHE", before.c_str(), 1);
}

TEST_F(CudaCache, OutOfMemoryReleasesTheCacheAndRetries) {
  release(alloc(64 * kKiB));
  cuda_caching_allocator().fail_next_backend_allocs(1);
  void* p = alloc(128 * kKiB);  // the first cudaMalloc fails, the retry after the release succeeds
  CudaMemoryStats s = cuda_memory_stats();
  EXPECT_EQ(s.cuda_free_count - before_.cuda_free_count, 1u);
  EXPECT_EQ(s.reserved_bytes, s.in_use_bytes);
  cuda_caching_allocator().fail_next_backend_allocs(2);
  EXPECT_THROW(alloc(128 * kKiB), Error);
  // More than any device has: cudaMalloc itself fails, twice, and the error leaves no CUDA error
  // state behind for the next launch's check.
  try {
    (void)alloc(size_t(1) << 50);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("out of CUDA memory: a tensor of 1125899906842624 bytes (1.00 PiB)"),
              std::string::npos)
        << msg;
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  s = cuda_memory_stats();
  EXPECT_EQ(s.in_use_bytes - before_.in_use_bytes, cls(128 * kKiB));
  release(p);
  release(alloc(256));  // still works
}

TEST_F(CudaCache, ReusedBlockHoldsWhatIsWritten) {
  constexpr size_t n = 4000;
  std::vector<uint8_t> a_host(n), b_host(n), c_host(n), back(n);
  Rng rng(7);
  for (size_t i = 0; i < n; ++i) {
    a_host[i] = uint8_t(rng.next_u32());
    b_host[i] = uint8_t(rng.next_u32());
    c_host[i] = uint8_t(rng.next_u32());
  }
  void* a = alloc(n);
  void* b = alloc(n);
  device_copy(a, Device::cuda, a_host.data(), Device::cpu, n);
  device_copy(b, Device::cuda, b_host.data(), Device::cpu, n);
  release(b);
  void* c = alloc(n);  // b's block
  EXPECT_EQ(c, b);
  device_copy(c, Device::cuda, c_host.data(), Device::cpu, n);
  void* d = alloc(n);  // a new block, zeroed on the device
  device_memset_zero(Device::cuda, d, n);
  device_copy(back.data(), Device::cpu, c, Device::cuda, n);
  EXPECT_EQ(back, c_host);
  device_copy(back.data(), Device::cpu, a, Device::cuda, n);
  EXPECT_EQ(back, a_host);
  device_copy(back.data(), Device::cpu, d, Device::cuda, n);
  EXPECT_EQ(back, std::vector<uint8_t>(n, 0));
  for (void* p : {a, c, d}) release(p);
}

TEST_F(CudaCache, ThreadsAllocateConcurrently) {
  constexpr int kThreads = 4, kIters = 200;
  std::vector<int> failures(kThreads, 0);
  auto work = [&](int t) {
    Rng rng(100 + uint64_t(t));
    std::vector<std::pair<void*, size_t>> live;
    std::vector<uint8_t> back;
    for (int i = 0; i < kIters; ++i) {
      const size_t n = size_t(64) << rng.below(8);
      void* p = alloc(n);
      device_memset(Device::cuda, p, t + 1, n);
      live.emplace_back(p, n);
      if (live.size() > 3 || i == kIters - 1) {
        for (auto [q, m] : live) {
          back.assign(m, 0);
          device_copy(back.data(), Device::cpu, q, Device::cuda, m);
          if (back != std::vector<uint8_t>(m, uint8_t(t + 1))) ++failures[size_t(t)];
          release(q);
        }
        live.clear();
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(work, t);
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(failures[size_t(t)], 0) << t;
  const CudaMemoryStats s = cuda_memory_stats();
  EXPECT_EQ(s.requested_bytes, before_.requested_bytes);
  EXPECT_EQ(s.in_use_bytes, before_.in_use_bytes);
  EXPECT_EQ((s.cuda_malloc_count - before_.cuda_malloc_count) + (s.cache_hits - before_.cache_hits),
            uint64_t(kThreads) * kIters);
  EXPECT_EQ(s.cuda_free_count, before_.cuda_free_count);
  EXPECT_GT(s.cache_hits, before_.cache_hits);
  // Every block obtained is cached now: emptying the cache frees each of them once.
  cuda_empty_cache();
  const CudaMemoryStats e = cuda_memory_stats();
  EXPECT_EQ(e.cuda_free_count - before_.cuda_free_count,
            s.cuda_malloc_count - before_.cuda_malloc_count);
  EXPECT_EQ(e.reserved_bytes, e.in_use_bytes);
}

}  // namespace
}  // namespace hlm
