// The embedding on CUDA (ops/cuda/embedding.cuh), the math of ops/cpu/embedding.cpp:
//   forward:  out[t] = table[id_t]
//   backward: dtable[v] += dy[t] for the tokens t with id_t = v, in increasing t order
//
// Forward: a gather in units of the widest of 16 / 8 / 4 / 2 / 1 bytes that divides the row and
// both base addresses; one thread per unit of the output, consecutive threads on consecutive
// units of a row (coalesced). Bit-exact for any dtype.
//
// Backward, with no float atomics and the CPU's bits:
//  1. a stable sort of the token positions t by id (LSD radix sort, 8-bit digits, as many passes
//     as V - 1 has bytes: 3 for a vocabulary of up to 2^24). Each pass: per chunk of 1024 tokens,
//     the count of every digit (thread j of 256 counts digit j over the chunk, reading the digits
//     from shared memory); an exclusive scan of the counts in (digit, chunk) order; the scatter,
//     thread j of each chunk writing its digit's tokens in chunk order from its scanned offset.
//     Stable, so equal ids keep increasing t. (CUB's DeviceRadixSort would do on a GPU, but its
//     headers do not compile in the CUDA emulation build: it needs the PTX special registers.)
//  2. the start of every run of equal ids in the sorted order (a flag per position, the same
//     scan, a compaction);
//  3. one block per run and tile of 128 columns: each thread loads dtable[v, c], adds dy[t, c]
//     for the run's tokens in increasing t, and stores once. Each touched element is written by
//     exactly one thread, in the CPU reference's order of additions, so f32 and f64 results are
//     bit-identical to the CPU and run to run.
// All counts and offsets are integers (exact in any order); no atomics anywhere.
#include <cuda_runtime.h>

#include <algorithm>

#include "ops/cuda/embedding.cuh"
#include "ops/cuda/layer_ops_common.cuh"

namespace hlm::ops::cuda {
namespace {

constexpr int kThreads = 256;       // gather, element-wise kernels
constexpr int kBins = 256;          // radix digit of 8 bits; threads of the count / scatter blocks
constexpr int kChunk = 1024;        // tokens per chunk of the radix sort
constexpr int kScanThreads = 1024;  // the one block of the scans
constexpr int kAccThreads = 128;    // columns per accumulation block
constexpr unsigned kMaxBlocks = 65535;

unsigned grid_for(int64_t n) {
  return std::max<unsigned>(1, std::min<unsigned>(blocks_for(n, kThreads), kMaxBlocks));
}

// ---- forward ----

// out[t * upr + u] = table[ids[t] * upr + u], upr units of type U per row.
template <class U, class I>
__global__ void __launch_bounds__(kThreads)
    gather_kernel(const U* __restrict__ table, const I* __restrict__ ids, U* __restrict__ out,
                  int64_t n, int64_t upr) {
  const int64_t total = n * upr;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / upr, u = i - t * upr;
    out[i] = table[int64_t(ids[t]) * upr + u];
  }
}

template <class I>
void gather(const Tensor& table, const Tensor& ids, Tensor& out, int64_t n, size_t row_bytes) {
  const auto a = reinterpret_cast<uintptr_t>(table.raw()) | reinterpret_cast<uintptr_t>(out.raw());
  auto fits = [&](size_t w) { return row_bytes % w == 0 && a % w == 0; };
  auto run = [&](auto unit) {
    using U = decltype(unit);
    const int64_t upr = int64_t(row_bytes / sizeof(U));
    gather_kernel<U, I><<<grid_for(n * upr), kThreads>>>(
        static_cast<const U*>(table.raw()), cptr<I>(ids), static_cast<U*>(out.raw()), n, upr);
  };
  if (fits(16))
    run(uint4{});
  else if (fits(8))
    run(uint2{});
  else if (fits(4))
    run(uint32_t{});
  else if (fits(2))
    run(uint16_t{});
  else
    run(uint8_t{});
  check_launch("embedding_forward");
}

// ---- backward: the stable sort ----

// keys[t] = ids[t], vals[t] = t.
template <class I>
__global__ void __launch_bounds__(kThreads)
    init_kernel(const I* __restrict__ ids, int32_t* __restrict__ keys, int32_t* __restrict__ vals,
                int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    keys[i] = int32_t(ids[i]);
    vals[i] = int32_t(i);
  }
}

// The digits of chunk blockIdx.x into dig; returns the chunk's length.
__device__ __forceinline__ int load_digits(const int32_t* __restrict__ keys, int64_t n, int shift,
                                           uint8_t* dig) {
  const int64_t start = int64_t(blockIdx.x) * kChunk;
  const int len = int(n - start < kChunk ? n - start : int64_t(kChunk));
  for (int k = threadIdx.x; k < len; k += kBins)
    dig[k] = uint8_t(uint32_t(keys[start + k]) >> shift);
  __syncthreads();
  return len;
}

// cnt[d * nchunks + c] = #{tokens of chunk c whose digit is d}.
__global__ void __launch_bounds__(kBins)
    count_kernel(const int32_t* __restrict__ keys, int64_t n, int shift, int64_t nchunks,
                 int32_t* __restrict__ cnt) {
  __shared__ uint8_t dig[kChunk];
  const int len = load_digits(keys, n, shift, dig);
  const unsigned j = threadIdx.x;
  int32_t c = 0;
  for (int k = 0; k < len; ++k) c += dig[k] == j;
  cnt[int64_t(j) * nchunks + blockIdx.x] = c;
}

// Thread j of chunk c writes the chunk's tokens of digit j, in chunk order, from off[j, c] on.
__global__ void __launch_bounds__(kBins)
    scatter_kernel(const int32_t* __restrict__ keys, const int32_t* __restrict__ vals, int64_t n,
                   int shift, int64_t nchunks, const int32_t* __restrict__ off,
                   int32_t* __restrict__ okeys, int32_t* __restrict__ ovals) {
  __shared__ uint8_t dig[kChunk];
  const int len = load_digits(keys, n, shift, dig);
  const unsigned j = threadIdx.x;
  const int64_t start = int64_t(blockIdx.x) * kChunk;
  int64_t o = off[int64_t(j) * nchunks + blockIdx.x];
  for (int k = 0; k < len; ++k)
    if (dig[k] == j) {
      okeys[o] = keys[start + k];
      ovals[o] = vals[start + k];
      ++o;
    }
}

// In place: a[i] = a[0] + ... + a[i - 1] over m entries (integers), one block. Thread j scans the
// j-th of kScanThreads contiguous segments; the segment totals are scanned by warp shuffles.
__global__ void __launch_bounds__(kScanThreads) exclusive_scan_kernel(int32_t* a, int64_t m) {
  __shared__ int32_t wsum[kScanThreads / 32];
  const int64_t per = (m + kScanThreads - 1) / kScanThreads;
  const int64_t b0 = int64_t(threadIdx.x) * per;
  const int64_t b = b0 < m ? b0 : m, e = b + per < m ? b + per : m;
  int32_t s = 0;
  for (int64_t i = b; i < e; ++i) s += a[i];
  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  int32_t inc = s;  // inclusive scan over the warp
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int32_t y = __shfl_up_sync(0xffffffffu, inc, d);
    if (lane >= d) inc += y;
  }
  if (lane == 31) wsum[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    const int32_t w = wsum[lane];
    int32_t wi = w;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int32_t y = __shfl_up_sync(0xffffffffu, wi, d);
      if (lane >= d) wi += y;
    }
    wsum[lane] = wi - w;
  }
  __syncthreads();
  int32_t run = wsum[warp] + inc - s;
  for (int64_t i = b; i < e; ++i) {
    const int32_t v = a[i];
    a[i] = run;
    run += v;
  }
}

// ---- backward: the runs of equal ids and the sums ----

__device__ __forceinline__ bool run_start(const int32_t* keys, int64_t i) {
  return i == 0 || keys[i] != keys[i - 1];
}

__global__ void __launch_bounds__(kThreads)
    mark_kernel(const int32_t* __restrict__ keys, int64_t n, int32_t* __restrict__ flag) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    flag[i] = run_start(keys, i) ? 1 : 0;
}

// starts[r] = the sorted position where run r begins, starts[R] = n, nruns[0] = R (pos: the
// exclusive scan of the run-start flags).
__global__ void __launch_bounds__(kThreads)
    compact_kernel(const int32_t* __restrict__ keys, const int32_t* __restrict__ pos, int64_t n,
                   int32_t* __restrict__ starts, int32_t* __restrict__ nruns) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const bool s = run_start(keys, i);
    if (s) starts[pos[i]] = int32_t(i);
    if (i == n - 1) {
      const int32_t r = pos[i] + (s ? 1 : 0);
      starts[r] = int32_t(n);
      nruns[0] = r;
    }
  }
}

// Runs r = blockIdx.x, + gridDim.x, ...; columns blockIdx.y * kAccThreads + threadIdx.x.
template <class T>
__global__ void __launch_bounds__(kAccThreads)
    accumulate_kernel(const int32_t* __restrict__ keys, const int32_t* __restrict__ vals,
                      const int32_t* __restrict__ starts, const int32_t* __restrict__ nruns,
                      const T* __restrict__ dy, T* __restrict__ dtable, int64_t d) {
  const int64_t c = int64_t(blockIdx.y) * kAccThreads + threadIdx.x;
  if (c >= d) return;
  const int64_t nr = nruns[0];
  for (int64_t r = blockIdx.x; r < nr; r += gridDim.x) {
    const int64_t b = starts[r], e = starts[r + 1];
    T* row = dtable + int64_t(keys[b]) * d;
    T acc = row[c];
    for (int64_t j = b; j < e; ++j) acc += dy[int64_t(vals[j]) * d + c];
    row[c] = acc;
  }
}

}  // namespace

void embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out) {
  const int64_t n = ids.numel();
  const size_t row_bytes = size_t(table.size(1)) * table.element_size();
  if (n == 0 || row_bytes == 0) return;
  if (ids.dtype() == DType::i64)
    gather<int64_t>(table, ids, out, n, row_bytes);
  else
    gather<int32_t>(table, ids, out, n, row_bytes);
}

void embedding_backward(const Tensor& dy, const Tensor& ids, Tensor& dtable) {
  const int64_t n = ids.numel(), v = dtable.size(0), d = dtable.size(1);
  if (n == 0 || d == 0) return;
  HLM_CHECK(n < (int64_t(1) << 31) - 1 && v <= (int64_t(1) << 31),
            "embedding_backward: {} tokens and a vocabulary of {} exceed the CUDA kernel's 2^31", n,
            v);
  HLM_CHECK(d <= int64_t(kAccThreads) * kMaxBlocks, "embedding_backward: D = {} is too large", d);
  Tensor keys[2] = {alloc({n}, DType::i32), alloc({n}, DType::i32)};
  Tensor vals[2] = {alloc({n}, DType::i32), alloc({n}, DType::i32)};
  if (ids.dtype() == DType::i64)
    init_kernel<<<grid_for(n), kThreads>>>(cptr<int64_t>(ids), mptr<int32_t>(keys[0]),
                                           mptr<int32_t>(vals[0]), n);
  else
    init_kernel<<<grid_for(n), kThreads>>>(cptr<int32_t>(ids), mptr<int32_t>(keys[0]),
                                           mptr<int32_t>(vals[0]), n);
  check_launch("embedding_backward init");

  // Stable LSD radix sort of (key, val) by key over the bytes that V - 1 occupies.
  int bits = 0;
  while (bits < 32 && (uint64_t(v - 1) >> bits) != 0) ++bits;
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  HLM_CHECK(nchunks <= kMaxBlocks, "embedding_backward: {} tokens exceed the sort's {}", n,
            int64_t(kMaxBlocks) * kChunk);
  Tensor cnt = alloc({kBins * nchunks}, DType::i32);
  int cur = 0;
  for (int shift = 0; shift < bits; shift += 8) {
    count_kernel<<<unsigned(nchunks), kBins>>>(cptr<int32_t>(keys[cur]), n, shift, nchunks,
                                               mptr<int32_t>(cnt));
    check_launch("embedding_backward count");
    exclusive_scan_kernel<<<1, kScanThreads>>>(mptr<int32_t>(cnt), kBins * nchunks);
    check_launch("embedding_backward scan");
    scatter_kernel<<<unsigned(nchunks), kBins>>>(
        cptr<int32_t>(keys[cur]), cptr<int32_t>(vals[cur]), n, shift, nchunks, cptr<int32_t>(cnt),
        mptr<int32_t>(keys[1 - cur]), mptr<int32_t>(vals[1 - cur]));
    check_launch("embedding_backward scatter");
    cur = 1 - cur;
  }

  // The runs of equal ids.
  Tensor pos = alloc({n}, DType::i32), starts = alloc({n + 1}, DType::i32);
  Tensor nruns = alloc({1}, DType::i32);
  mark_kernel<<<grid_for(n), kThreads>>>(cptr<int32_t>(keys[cur]), n, mptr<int32_t>(pos));
  check_launch("embedding_backward mark");
  exclusive_scan_kernel<<<1, kScanThreads>>>(mptr<int32_t>(pos), n);
  check_launch("embedding_backward scan");
  compact_kernel<<<grid_for(n), kThreads>>>(cptr<int32_t>(keys[cur]), cptr<int32_t>(pos), n,
                                            mptr<int32_t>(starts), mptr<int32_t>(nruns));
  check_launch("embedding_backward compact");

  // The sums. Runs are spread over at most 2048 x-blocks (a block takes several runs when there
  // are more), column tiles over y.
  const dim3 grid(unsigned(std::min<int64_t>(n, 2048)),
                  unsigned((d + kAccThreads - 1) / kAccThreads));
  dispatch_storage(dtable.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, nv_bf16>) {
      HLM_FAIL("embedding_backward: dtable must be f32 or f64 on CUDA");
    } else {
      accumulate_kernel<T><<<grid, kAccThreads>>>(
          cptr<int32_t>(keys[cur]), cptr<int32_t>(vals[cur]), cptr<int32_t>(starts),
          cptr<int32_t>(nruns), cptr<T>(dy), mptr<T>(dtable), d);
    }
  });
  check_launch("embedding_backward accumulate");
}

}  // namespace hlm::ops::cuda
