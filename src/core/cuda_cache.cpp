// The caching allocator of CUDA memory (core/cuda_cache.h).
#include "core/cuda_cache.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "core/memory.h"

namespace hlm {

namespace {

constexpr size_t kKiB = 1024, kMiB = 1024 * kKiB;
constexpr size_t kSmallLimit = 1 * kMiB;  // requests up to this size are small
constexpr size_t kSmallStep = 512;        // small classes: multiples of this
constexpr size_t kLargeStep = 2 * kMiB;   // large classes: multiples of this
constexpr size_t kExactStep = 256;        // the emulation's classes (cudaMalloc's granule)

size_t round_up(size_t n, size_t m) {
  return (n + m - 1) / m * m;
}

}  // namespace

bool cuda_caching_from_env() {
  const char* e = std::getenv("HLM_CUDA_CACHE");
  const std::string v = e ? e : "";
  HLM_CHECK(v.empty() || v == "0" || v == "1", "HLM_CUDA_CACHE must be 0 or 1, not '{}'",
            printable(v));
  return v != "0";
}

size_t CachingAllocator::size_class(size_t nbytes, bool exact) {
  const size_t n = std::max<size_t>(nbytes, 1);
  HLM_CHECK(n <= SIZE_MAX - kLargeStep, "a CUDA tensor of {} bytes cannot be allocated", nbytes);
  if (exact) return round_up(n, kExactStep);
  return n <= kSmallLimit ? round_up(n, kSmallStep) : round_up(n, kLargeStep);
}

CachingAllocator::CachingAllocator(Backend backend, bool exact, size_t max_cached_bytes)
    : backend_(backend), exact_(exact), max_cached_(max_cached_bytes) {}

void CachingAllocator::add_in_use(size_t bytes, size_t requested) {
  stats_.in_use_bytes += bytes;
  stats_.requested_bytes += requested;
  stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
}

void* CachingAllocator::try_backend_alloc(size_t bytes) {
  if (fail_next_ > 0) {
    --fail_next_;
    return nullptr;
  }
  void* p = backend_.alloc(bytes);
  if (p) {
    ++stats_.cuda_malloc_count;
    stats_.reserved_bytes += bytes;
    stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
  }
  return p;
}

void* CachingAllocator::backend_alloc(size_t bytes, size_t requested) {
  if (void* p = try_backend_alloc(bytes)) return p;
  const uint64_t released = stats_.reserved_bytes - stats_.in_use_bytes;
  release_cached();
  if (void* p = try_backend_alloc(bytes)) return p;
  HLM_FAIL(
      "out of CUDA memory: a tensor of {} bytes ({}) could not be allocated ({} in use by other "
      "tensors, {} of cached blocks released before the retry)",
      requested, format_bytes(double(requested)), format_bytes(double(stats_.in_use_bytes)),
      format_bytes(double(released)));
}

void* CachingAllocator::allocate(size_t nbytes) {
  const size_t n = std::max<size_t>(nbytes, 1);
  std::lock_guard<std::mutex> lock(mu_);
  if (!enabled_) {
    void* p = backend_alloc(n, n);
    live_.emplace(p, Live{n, n, false});
    add_in_use(n, n);
    return p;
  }
  const size_t c = size_class(n, exact_);
  const size_t most = exact_ ? c : c + c / 4;
  void* p = nullptr;
  size_t bytes = c;
  if (auto it = cached_.lower_bound(c); it != cached_.end() && it->first <= most) {
    bytes = it->first;
    p = it->second.back();
    it->second.pop_back();
    if (it->second.empty()) cached_.erase(it);
    ++stats_.cache_hits;
  } else {
    p = backend_alloc(c, n);
  }
  live_.emplace(p, Live{bytes, n, true});
  add_in_use(bytes, n);
  return p;
}

void CachingAllocator::free(void* p) {
  if (!p) return;
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = live_.find(p);
  HLM_CHECK(it != live_.end(), "a CUDA block freed twice, or not from the allocator: {}", p);
  const Live block = it->second;
  live_.erase(it);
  stats_.in_use_bytes -= block.bytes;
  stats_.requested_bytes -= block.requested;
  if (enabled_ && block.cacheable && block.bytes <= max_cached_) {
    // reserved - in use counts this block as cached already: past the limit, the rest goes.
    if (stats_.reserved_bytes - stats_.in_use_bytes > max_cached_) release_cached();
    cached_[block.bytes].push_back(p);
    return;
  }
  backend_.release(p);
  ++stats_.cuda_free_count;
  stats_.reserved_bytes -= block.bytes;
}

void CachingAllocator::release_cached() {
  for (auto& [bytes, blocks] : cached_) {
    for (void* p : blocks) {
      backend_.release(p);
      ++stats_.cuda_free_count;
      stats_.reserved_bytes -= bytes;
    }
  }
  cached_.clear();
}

void CachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  release_cached();
}

void CachingAllocator::set_enabled(bool on) {
  std::lock_guard<std::mutex> lock(mu_);
  enabled_ = on;
  if (!on) release_cached();
}

bool CachingAllocator::enabled() const {
  std::lock_guard<std::mutex> lock(mu_);
  return enabled_;
}

CudaMemoryStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void CachingAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak_in_use_bytes = stats_.in_use_bytes;
  stats_.peak_reserved_bytes = stats_.reserved_bytes;
}

void CachingAllocator::fail_next_backend_allocs(int n) {
  std::lock_guard<std::mutex> lock(mu_);
  fail_next_ = std::max(n, 0);
}

}  // namespace hlm
