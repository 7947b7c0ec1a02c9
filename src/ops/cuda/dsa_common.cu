// Device copies of the DSA ops' host-built patterns and layouts, and the pattern of an explicit
// selection built on the device (ops/cuda/dsa_common.cuh).
//
// device_rows_pattern builds what dsa_detail::rows_pattern builds on the host, from the rows
// [T, W] on the device. No atomics anywhere (integer sums only, each in a fixed order), so every
// array repeats bit for bit and equals the host's:
//   1. rows_check_kernel, a warp per query row t: the visible keys [lo, hi) of t (its document
//      from a binary search of cu_seqlens, lo = the document's first key, hi = lo + (r + 1) / P),
//      then the row in slices of 32 columns (four slices loaded ahead): the first column out of
//      range (a ballot), the number of entries before it, and whether those entries are strictly
//      ascending (each above the running maximum of the entries before it: a shuffle scan,
//      skipped once the row is known not to be).
//      Writes count[t] and flag[t] (the bad column, or -1 ascending, -2 not ascending).
//   2. row_ptr = the exclusive scan of count (below), its total E into the summary.
//   3. Two minima over the rows (below): the first bad row with its column, and the first row that
//      is not ascending. The host reads E and these two numbers (one copy): a bad row before every
//      non-ascending row is the error (a strictly ascending row holds no repeat).
//   4. rows_compact_kernel, a warp per row: its entries in slot order at row_ptr[t] (a ballot and
//      a prefix count per slice): slot, key, query, and the key as a 32-bit sort key.
//   5. Only for the inverse map, or when a row that is not ascending comes before the first bad
//      row: a stable LSD radix sort of the entries by key (below), whose values start as the entry
//      numbers: the sorted values are key_entry (each key's readers in increasing entry order =
//      increasing (t, slot)), and key_ptr[k] is the first sorted position with a key >= k (a
//      binary search per key).
//      A key held twice by row t shows up as two neighbours of the sorted list with that key and
//      the same query; the smallest (t, key) over all neighbours is the first repeat the host's
//      sequential scan reports (its sort of the row finds the smallest repeated value). The host
//      reads it (a second copy) and throws the earlier of that repeat and the first bad row.
//
// Shared pieces, each deterministic:
//   exclusive_scan: tiles of 2048 values (8 consecutive per thread); a block sums each tile, one
//     block scans the tile sums in order, then each tile writes its prefix sums (thread totals
//     scanned by a warp shuffle scan and the 8 warp totals in warp order).
//   min_reduce: a grid-stride pass, the minimum over each block by an xor butterfly and the warps
//     in order, then one block over the blocks' minima (minima are exact in any order anyway).
//   radix sort: 8 bits or fewer per pass (13-bit keys, e.g. 8192 tokens: two passes of 7 and 6
//     bits). Each warp owns a chunk of 1024 consecutive elements and walks it 32 at a time in
//     order; the lanes holding one digit find each other with one ballot per digit bit
//     (peers()), the lowest of them adds the group's size to the warp's counter of that digit in
//     shared memory. The count kernel writes each chunk's digit counts digit-major, [digit][chunk];
//     their exclusive scan gives every (digit, chunk) its first output position; the scatter
//     kernel walks the chunk again and places each element at its digit's next position plus its
//     rank among the earlier lanes of its group. Stable: within a digit, chunks in order, and in
//     a chunk, elements in order.
// The host uploads cu_seqlens and the pool offsets (a number per document) and reads back once
// (twice when the repeat check runs, once more for the value an error message quotes); nothing of
// size T or E goes through it.
// What would make it faster: the scatter writes up to 32 places per warp instruction; a block-wide
// reordering of each tile in shared memory before the write would coalesce it. The dup check
// gathers query[] through the sorted order; carrying the query along the last pass would avoid
// that. A forward pass with non-ascending rows could check each row on its own (a sort of the row
// in shared memory) instead of sorting all entries.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "core/device.h"
#include "ops/cuda/dsa_common.cuh"
#include "ops/cuda/layer_ops_common.cuh"
#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace hlm::ops::cuda {

DsaPatternDev upload_pattern(const dsa_detail::Pattern& p, bool with_inverse) {
  DsaPatternDev d;
  d.T = p.T, d.W = p.W, d.nkeys = p.nkeys, d.entries = p.entries();
  d.row_ptr = to_device(p.row_ptr);
  d.slot = to_device(p.slot);
  d.key = to_device(p.key);
  d.query = to_device(p.query);
  if (with_inverse) {
    d.key_ptr = to_device(p.key_ptr);
    d.key_entry = to_device(p.key_entry);
  }
  return d;
}

DsaPatternDev pattern_for_entries(int64_t T, int64_t W, int64_t nkeys,
                                  const std::vector<int64_t>& row_ptr) {
  DsaPatternDev d;
  d.T = T, d.W = W, d.nkeys = nkeys, d.entries = row_ptr.back();
  d.row_ptr = to_device(row_ptr);
  d.slot = detail::new_output({d.entries}, DType::i32, Device::cuda);
  d.key = detail::new_output({d.entries}, DType::i64, Device::cuda);
  d.query = detail::new_output({d.entries}, DType::i64, Device::cuda);
  return d;
}

Tensor upload_page_table(const std::vector<const std::vector<int64_t>*>& pages) {
  const dsa_detail::PageTable pt = dsa_detail::page_table(pages);
  return Tensor::from_vector<int64_t>({int64_t(pages.size()), pt.max_pages}, pt.flat)
      .to(Device::cuda);
}

DsaLayoutDev upload_layout(const dsa_detail::QueryWindow& w, int64_t P) {
  DsaLayoutDev d;
  d.T = w.T, d.P = P, d.q0 = w.q0;
  const std::vector<int64_t>& cu = w.cu;
  const std::vector<int64_t> cp = dsa_detail::pool_offsets(cu, P);
  d.nkeys = cp.back();
  std::vector<int64_t> start(size_t(d.T)), base(size_t(d.T));
  for (size_t m = 0; m < w.docs(); ++m)
    for (int64_t t = w.qcu[m]; t < w.qcu[m + 1]; ++t) {
      start[size_t(t)] = w.first(m) - w.q0;
      base[size_t(t)] = cp[size_t(w.doc[m])];
    }
  d.doc_start = to_device(start);
  d.key_base = to_device(base);
  if (P != 1) return d;
  const bool whole = w.q0 == 0 && w.T == cu.back();
  std::vector<int64_t> end(size_t(cu.back()));
  std::vector<int64_t> kstart;
  if (!whole) kstart.resize(size_t(cu.back()));
  for (size_t i = 0; i + 1 < cu.size(); ++i)
    for (int64_t s = cu[i]; s < cu[i + 1]; ++s) {
      end[size_t(s)] = cu[i + 1];
      if (!whole) kstart[size_t(s)] = cu[i];
    }
  d.key_start = whole ? d.doc_start : to_device(kstart);
  d.key_end = to_device(end);
  return d;
}

// ---- the pattern of explicit rows, on the device ----

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kSlices = 4;  // 32-column slices a row warp loads ahead
constexpr int kScanItems = 8;
constexpr int64_t kScanTile = int64_t(kThreads) * kScanItems;
constexpr int kMinBlocks = 1024;  // most blocks of a min_reduce pass
constexpr int kChunk = 1024;      // radix sort: elements per warp
constexpr int kMaxDigitBits = 8;
constexpr uint64_t kNone = ~uint64_t(0);

// flag[t] of a row without a bad column.
constexpr int32_t kAscending = -1, kNotAscending = -2;

__device__ __forceinline__ unsigned lanes_below(int lane) {
  return (1u << lane) - 1u;
}

// Minimum over the 32 lanes by an xor butterfly, the same value in every lane.
__device__ __forceinline__ uint64_t warp_min_u64(uint64_t x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const uint64_t y = __shfl_xor_sync(0xffffffffu, x, off);
    x = y < x ? y : x;
  }
  return x;
}

// The keys query t may read: [lo, hi).
struct RowBounds {
  int64_t lo, hi;
};
__device__ __forceinline__ RowBounds row_bounds(const int64_t* cu, const int64_t* cp, int64_t ndocs,
                                                int64_t pool, int64_t t) {
  const int64_t d = last_le(cu, ndocs, t);
  return {cp[d], cp[d] + (t - cu[d] + 1) / pool};
}

// (Row t of a window is the query of global token q0 + t.)
template <class I>
__global__ void __launch_bounds__(kThreads)
    rows_check_kernel(const I* __restrict__ rows, int64_t T, int64_t W,
                      const int64_t* __restrict__ cu, const int64_t* __restrict__ cp, int64_t ndocs,
                      int64_t pool, int64_t q0, int32_t* __restrict__ count,
                      int32_t* __restrict__ flag) {
  const int lane = int(threadIdx.x & 31);
  const int64_t t = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= T) return;  // the whole warp
  const RowBounds b = row_bounds(cu, cp, ndocs, pool, q0 + t);
  const I* row = rows + t * W;
  int64_t n = 0;     // entries so far
  int32_t top = -1;  // the largest of them (keys are < 2^31)
  bool ascending = true;
  int64_t bad = -1;
  for (int64_t j0 = 0; j0 < W && bad < 0; j0 += 32 * kSlices) {
    int64_t v[kSlices];
#pragma unroll
    for (int u = 0; u < kSlices; ++u) {
      const int64_t j = j0 + u * 32 + lane;
      v[u] = j < W ? int64_t(row[j]) : -1;
    }
#pragma unroll
    for (int u = 0; u < kSlices; ++u) {
      const int64_t r = v[u];
      const bool outside = r != -1 && (r < b.lo || r >= b.hi);
      const unsigned badm = __ballot_sync(0xffffffffu, outside);
      const unsigned before = badm ? lanes_below(__ffs(int(badm)) - 1) : 0xffffffffu;
      const bool keep = r != -1 && !outside && ((before >> lane) & 1u);
      if (ascending) {  // (warp-uniform) each kept entry must exceed all kept before it
        int32_t x = keep ? int32_t(r) : -1;  // inclusive prefix maximum over the lanes
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
          const int32_t y = __shfl_up_sync(0xffffffffu, x, off);
          if (lane >= off) x = y > x ? y : x;
        }
        int32_t prev = __shfl_up_sync(0xffffffffu, x, 1);
        prev = lane == 0 || top > prev ? top : prev;
        ascending = !__any_sync(0xffffffffu, keep && r <= prev);
        const int32_t last = __shfl_sync(0xffffffffu, x, 31);
        top = last > top ? last : top;
      }
      n += __popc(__ballot_sync(0xffffffffu, keep));
      if (badm) {
        bad = j0 + u * 32 + __ffs(int(badm)) - 1;
        break;
      }
    }
  }
  if (lane == 0) {
    count[t] = int32_t(n);
    flag[t] = bad >= 0 ? int32_t(bad) : ascending ? kAscending : kNotAscending;
  }
}

// The entries of row t (the columns before its bad column, if any) in slot order at row_ptr[t].
template <class I>
__global__ void __launch_bounds__(kThreads)
    rows_compact_kernel(const I* __restrict__ rows, int64_t T, int64_t W,
                        const int32_t* __restrict__ flag, const int64_t* __restrict__ row_ptr,
                        int32_t* __restrict__ slot, int64_t* __restrict__ key,
                        int64_t* __restrict__ query, uint32_t* __restrict__ sort_key) {
  const int lane = int(threadIdx.x & 31);
  const int64_t t = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= T) return;
  const int64_t end = flag[t] >= 0 ? int64_t(flag[t]) : W;
  const I* row = rows + t * W;
  int64_t e = row_ptr[t];
  for (int64_t j0 = 0; j0 < end; j0 += 32 * kSlices) {
    int64_t v[kSlices];
#pragma unroll
    for (int u = 0; u < kSlices; ++u) {
      const int64_t j = j0 + u * 32 + lane;
      v[u] = j < end ? int64_t(row[j]) : -1;
    }
#pragma unroll
    for (int u = 0; u < kSlices; ++u) {
      const unsigned m = __ballot_sync(0xffffffffu, v[u] != -1);
      if (v[u] != -1) {
        const int64_t at = e + __popc(m & lanes_below(lane));
        slot[at] = int32_t(j0 + u * 32 + lane);
        key[at] = v[u];
        query[at] = t;
        if (sort_key) sort_key[at] = uint32_t(v[u]);
      }
      e += __popc(m);
    }
  }
}

// ---- exclusive scan ----

// The exclusive prefix of v over the block in thread order; total: the block's sum. sh: kWarps.
__device__ __forceinline__ int64_t block_exclusive_scan(int64_t v, int64_t* sh, int64_t& total) {
  const int lane = int(threadIdx.x & 31), warp = int(threadIdx.x >> 5);
  int64_t x = v;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int64_t y = __shfl_up_sync(0xffffffffu, x, off);
    if (lane >= off) x += y;
  }
  __syncthreads();  // sh may still be read by a previous scan
  if (lane == 31) sh[warp] = x;
  __syncthreads();
  int64_t before = 0;
  total = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before += sh[w];
    total += sh[w];
  }
  return before + x - v;
}

// sums[b] = the sum of tile b of in.
template <class I>
__global__ void __launch_bounds__(kThreads)
    scan_reduce_kernel(const I* __restrict__ in, int64_t n, int64_t* __restrict__ sums) {
  __shared__ int64_t sh[kWarps];
  const int64_t base = int64_t(blockIdx.x) * kScanTile + int64_t(threadIdx.x) * kScanItems;
  int64_t s = 0;
#pragma unroll
  for (int k = 0; k < kScanItems; ++k)
    if (base + k < n) s += int64_t(in[base + k]);
  int64_t total = 0;
  (void)block_exclusive_scan(s, sh, total);
  if (threadIdx.x == 0) sums[blockIdx.x] = total;
}

// One block: sums[0 .. nb) become their exclusive prefix, in order; the total goes to *end and,
// if given, to *copy.
__global__ void __launch_bounds__(kThreads)
    scan_sums_kernel(int64_t* __restrict__ sums, int64_t nb, int64_t* __restrict__ end,
                     int64_t* __restrict__ copy) {
  __shared__ int64_t sh[kWarps];
  int64_t carry = 0;
  for (int64_t b0 = 0; b0 < nb; b0 += kThreads) {
    const int64_t i = b0 + threadIdx.x;
    const int64_t v = i < nb ? sums[i] : 0;
    int64_t total = 0;
    const int64_t pre = block_exclusive_scan(v, sh, total);
    if (i < nb) sums[i] = carry + pre;
    carry += total;
  }
  if (threadIdx.x == 0) {
    *end = carry;
    if (copy) *copy = carry;
  }
}

// out[i] = sums[tile of i] + the sum of the tile's values before i.
template <class I>
__global__ void __launch_bounds__(kThreads)
    scan_write_kernel(const I* __restrict__ in, int64_t n, const int64_t* __restrict__ sums,
                      int64_t* __restrict__ out) {
  __shared__ int64_t sh[kWarps];
  const int64_t base = int64_t(blockIdx.x) * kScanTile + int64_t(threadIdx.x) * kScanItems;
  int64_t v[kScanItems], s = 0;
#pragma unroll
  for (int k = 0; k < kScanItems; ++k) {
    v[k] = base + k < n ? int64_t(in[base + k]) : 0;
    s += v[k];
  }
  int64_t total = 0;
  int64_t run = sums[blockIdx.x] + block_exclusive_scan(s, sh, total);
#pragma unroll
  for (int k = 0; k < kScanItems; ++k) {
    if (base + k < n) out[base + k] = run;
    run += v[k];
  }
}

// out[0 .. n] = the exclusive prefix sums of in[0 .. n) and their total (out has n + 1 elements);
// the total also goes to *total_copy if given.
template <class I>
void exclusive_scan(const I* in, int64_t n, int64_t* out, int64_t* total_copy, const char* what) {
  const int64_t nb = std::max<int64_t>(1, (n + kScanTile - 1) / kScanTile);
  Tensor sums = alloc({nb}, DType::i64);
  scan_reduce_kernel<I><<<unsigned(nb), kThreads>>>(in, n, mptr<int64_t>(sums));
  check_launch(what);
  scan_sums_kernel<<<1, kThreads>>>(mptr<int64_t>(sums), nb, out + n, total_copy);
  check_launch(what);
  if (n > 0) {
    scan_write_kernel<I><<<unsigned(nb), kThreads>>>(in, n, cptr<int64_t>(sums), out);
    check_launch(what);
  }
}

// ---- minima ----

// f(i, a, b) lowers a and b by what element i contributes; (a, b) = the minima over [0, n).
template <class F>
__global__ void __launch_bounds__(kThreads)
    min_partial_kernel(F f, int64_t n, uint64_t* __restrict__ partial) {
  __shared__ uint64_t sh[2][kWarps];
  uint64_t a = kNone, b = kNone;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * kThreads)
    f(i, a, b);
  a = warp_min_u64(a);
  b = warp_min_u64(b);
  if ((threadIdx.x & 31) == 0) sh[0][threadIdx.x >> 5] = a, sh[1][threadIdx.x >> 5] = b;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) {
      a = sh[0][w] < a ? sh[0][w] : a;
      b = sh[1][w] < b ? sh[1][w] : b;
    }
    partial[2 * blockIdx.x] = a;
    partial[2 * blockIdx.x + 1] = b;
  }
}

// One block: out[0], out[1] = the minima of the nparts pairs of partial.
__global__ void __launch_bounds__(kThreads)
    min_final_kernel(const uint64_t* __restrict__ partial, int64_t nparts,
                     uint64_t* __restrict__ out) {
  __shared__ uint64_t sh[2][kWarps];
  uint64_t a = kNone, b = kNone;
  for (int64_t i = threadIdx.x; i < nparts; i += kThreads) {
    a = partial[2 * i] < a ? partial[2 * i] : a;
    b = partial[2 * i + 1] < b ? partial[2 * i + 1] : b;
  }
  a = warp_min_u64(a);
  b = warp_min_u64(b);
  if ((threadIdx.x & 31) == 0) sh[0][threadIdx.x >> 5] = a, sh[1][threadIdx.x >> 5] = b;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) {
      a = sh[0][w] < a ? sh[0][w] : a;
      b = sh[1][w] < b ? sh[1][w] : b;
    }
    out[0] = a;
    out[1] = b;
  }
}

template <class F>
void min_reduce(F f, int64_t n, uint64_t* out, const char* what) {
  const int64_t nb = std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, kMinBlocks);
  Tensor partial = alloc({2 * nb}, DType::i64);
  min_partial_kernel<F><<<unsigned(nb), kThreads>>>(f, n, mptr<uint64_t>(partial));
  check_launch(what);
  min_final_kernel<<<1, kThreads>>>(cptr<uint64_t>(partial), nb, out);
  check_launch(what);
}

// The problems of the rows: a = (t << 32 | column) of the first row with a bad column, b = the
// first row that is not strictly ascending.
struct RowProblems {
  const int32_t* flag;
  __device__ void operator()(int64_t t, uint64_t& a, uint64_t& b) const {
    const int32_t f = flag[t];
    if (f >= 0) {
      const uint64_t v = (uint64_t(t) << 32) | uint32_t(f);
      a = v < a ? v : a;
    } else if (f == kNotAscending) {
      b = uint64_t(t) < b ? uint64_t(t) : b;
    }
  }
};

// Repeats in the entries sorted by key: a = (t << 32 | key) of the first row holding a key twice.
struct SortedRepeats {
  const uint32_t* key;   // sorted keys
  const int64_t* entry;  // the entry at each sorted position
  const int64_t* query;  // [E]
  __device__ void operator()(int64_t i, uint64_t& a, uint64_t&) const {
    if (i == 0 || key[i] != key[i - 1]) return;
    const int64_t t = query[entry[i]];
    if (t != query[entry[i - 1]]) return;
    const uint64_t v = (uint64_t(t) << 32) | key[i];
    a = v < a ? v : a;
  }
};

// ---- stable radix sort of (32-bit key, entry) pairs ----

// The lanes of `active` whose digit d (nbits bits) equals this lane's.
__device__ __forceinline__ unsigned peers(unsigned active, unsigned d, int nbits) {
  unsigned m = active;
  for (int b = 0; b < nbits; ++b) {
    const bool bit = (d >> b) & 1u;
    const unsigned on = __ballot_sync(0xffffffffu, bit);
    m &= bit ? on : ~on;
  }
  return m;
}

// counts[digit * nchunks + chunk] = how many keys of the chunk have that digit.
__global__ void __launch_bounds__(kThreads)
    radix_count_kernel(const uint32_t* __restrict__ keys, int64_t n, int shift, int nbits,
                       int64_t nchunks, int32_t* __restrict__ counts) {
  __shared__ int32_t cnt[kWarps][1 << kMaxDigitBits];
  const int lane = int(threadIdx.x & 31), warp = int(threadIdx.x >> 5);
  const int64_t chunk = int64_t(blockIdx.x) * kWarps + warp;
  if (chunk >= nchunks) return;  // the whole warp
  const int nd = 1 << nbits;
  for (int d = lane; d < nd; d += 32) cnt[warp][d] = 0;
  __syncwarp();
  const int64_t begin = chunk * kChunk, end = n < begin + kChunk ? n : begin + kChunk;
  for (int64_t i0 = begin; i0 < end; i0 += 32) {
    const int64_t i = i0 + lane;
    const bool valid = i < end;
    const unsigned d = valid ? (keys[i] >> shift) & unsigned(nd - 1) : 0u;
    const unsigned m = peers(__ballot_sync(0xffffffffu, valid), d, nbits);
    if (valid && (m & lanes_below(lane)) == 0) cnt[warp][d] += __popc(m);
    __syncwarp();
  }
  for (int d = lane; d < nd; d += 32) counts[d * nchunks + chunk] = cnt[warp][d];
}

// Each element of the chunk to offsets[digit * nchunks + chunk] + its rank among the chunk's
// earlier elements of its digit. kFirst: the values are the element numbers (vin unused).
template <bool kFirst>
__global__ void __launch_bounds__(kThreads)
    radix_scatter_kernel(const uint32_t* __restrict__ kin, const int64_t* __restrict__ vin,
                         uint32_t* __restrict__ kout, int64_t* __restrict__ vout, int64_t n,
                         int shift, int nbits, int64_t nchunks,
                         const int64_t* __restrict__ offsets) {
  __shared__ int64_t next[kWarps][1 << kMaxDigitBits];
  const int lane = int(threadIdx.x & 31), warp = int(threadIdx.x >> 5);
  const int64_t chunk = int64_t(blockIdx.x) * kWarps + warp;
  if (chunk >= nchunks) return;
  const int nd = 1 << nbits;
  for (int d = lane; d < nd; d += 32) next[warp][d] = offsets[d * nchunks + chunk];
  __syncwarp();
  const int64_t begin = chunk * kChunk, end = n < begin + kChunk ? n : begin + kChunk;
  for (int64_t i0 = begin; i0 < end; i0 += 32) {
    const int64_t i = i0 + lane;
    const bool valid = i < end;
    const uint32_t k = valid ? kin[i] : 0u;
    const unsigned d = (k >> shift) & unsigned(nd - 1);
    const unsigned m = peers(__ballot_sync(0xffffffffu, valid), d, nbits);
    const unsigned below = m & lanes_below(lane);
    if (valid) {
      const int64_t at = next[warp][d] + __popc(below);
      kout[at] = k;
      vout[at] = kFirst ? i : vin[i];
    }
    __syncwarp();
    if (valid && below == 0) next[warp][d] += __popc(m);
    __syncwarp();
  }
}

// key_ptr[k] = the first sorted position whose key is >= k, k = 0 .. nkeys.
__global__ void __launch_bounds__(kThreads)
    key_ptr_kernel(const uint32_t* __restrict__ sorted, int64_t n, int64_t nkeys,
                   int64_t* __restrict__ key_ptr) {
  const int64_t k = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (k > nkeys) return;
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (int64_t(sorted[mid]) < k)
      lo = mid + 1;
    else
      hi = mid;
  }
  key_ptr[k] = lo;
}

// Stable sort of the n keys of keys[0] (< 2^bits) with their element numbers: returns the buffer
// of keys[] holding the sorted keys; the sorted element numbers land in vals[0].
uint32_t* radix_sort(uint32_t* const (&keys)[2], int64_t* const (&vals)[2], int64_t n, int bits,
                     const char* what) {
  const int passes = (bits + kMaxDigitBits - 1) / kMaxDigitBits;
  const int dbits = (bits + passes - 1) / passes;
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  const unsigned blocks = unsigned((nchunks + kWarps - 1) / kWarps);
  const int64_t ncounts = (int64_t(1) << dbits) * nchunks;
  Tensor counts = alloc({ncounts}, DType::i32), offsets = alloc({ncounts + 1}, DType::i64);
  for (int p = 0; p < passes; ++p) {
    const int shift = p * dbits, nbits = std::min(dbits, bits - shift);
    const uint32_t* kin = keys[p & 1];
    uint32_t* kout = keys[(p + 1) & 1];
    // The last pass writes vals[0].
    const int64_t* vin = vals[(passes - p) & 1];
    int64_t* vout = vals[(passes - 1 - p) & 1];
    radix_count_kernel<<<blocks, kThreads>>>(kin, n, shift, nbits, nchunks, mptr<int32_t>(counts));
    check_launch(what);
    const int64_t nc = (int64_t(1) << nbits) * nchunks;
    exclusive_scan(cptr<int32_t>(counts), nc, mptr<int64_t>(offsets), nullptr, what);
    if (p == 0)
      radix_scatter_kernel<true><<<blocks, kThreads>>>(kin, nullptr, kout, vout, n, shift, nbits,
                                                       nchunks, cptr<int64_t>(offsets));
    else
      radix_scatter_kernel<false><<<blocks, kThreads>>>(kin, vin, kout, vout, n, shift, nbits,
                                                        nchunks, cptr<int64_t>(offsets));
    check_launch(what);
  }
  return keys[passes & 1];
}

void read_back(void* dst, const void* src, size_t bytes) {
  device_copy(dst, Device::cpu, src, Device::cuda, bytes);
}

}  // namespace

DsaPatternDev device_rows_pattern(const Tensor& rows_, const dsa_detail::QueryWindow& win,
                                  int64_t pool, const char* op, const char* what,
                                  bool with_inverse) {
  detail::require_int(rows_, op, what);
  const Tensor rows = rows_.contiguous();  // a strided view: gathered through the host
  const std::vector<int64_t>& cu = win.cu;
  const int64_t T = win.T, q0 = win.q0;
  HLM_CHECK(rows.dim() == 2 && rows.size(0) == T, "{}: {} must be [T = {}, W], got {}", op, what, T,
            rows.describe());
  HLM_CHECK(rows.device() == Device::cuda, "{}: {} must be on CUDA here, got {}", op, what,
            rows.describe());
  const std::vector<int64_t> cp = dsa_detail::pool_offsets(cu, pool);
  DsaPatternDev d;
  d.T = T, d.W = rows.size(1), d.nkeys = cp.back(), d.q0 = q0;
  const int64_t W = d.W, NK = d.nkeys, ndocs = int64_t(cu.size()) - 1;
  constexpr int64_t kLimit = int64_t(1) << 31;
  HLM_CHECK(T < kLimit && W < kLimit && NK < kLimit,
            "{}: {} {} is too large for the CUDA pattern (T, W and the key count must be < 2^31)",
            op, what, rows.describe());
  const char* kname = "device_rows_pattern";

  // 1-3: per-row checks and counts, row_ptr, the summary [E, first bad row, first row not
  // ascending, first repeat, -].
  d.row_ptr = alloc({T + 1}, DType::i64);
  Tensor count = alloc({T}, DType::i32), flag = alloc({T}, DType::i32);
  Tensor summary = alloc({5}, DType::i64);
  int64_t* sm = mptr<int64_t>(summary);
  const Tensor cu_dev = to_device(cu), cp_dev = to_device(cp);
  const unsigned row_blocks = unsigned((T + kWarps - 1) / kWarps);
  auto by_index = [&](auto&& f) {
    if (rows.dtype() == DType::i64)
      f(cptr<int64_t>(rows));
    else
      f(cptr<int32_t>(rows));
  };
  if (T > 0)
    by_index([&](const auto* r) {
      rows_check_kernel<<<row_blocks, kThreads>>>(r, T, W, cptr<int64_t>(cu_dev),
                                                  cptr<int64_t>(cp_dev), ndocs, pool, q0,
                                                  mptr<int32_t>(count), mptr<int32_t>(flag));
      check_launch(kname);
    });
  exclusive_scan(cptr<int32_t>(count), T, mptr<int64_t>(d.row_ptr), sm, kname);
  min_reduce(RowProblems{cptr<int32_t>(flag)}, T, reinterpret_cast<uint64_t*>(sm + 1), kname);
  uint64_t head[3];
  read_back(head, sm, sizeof(head));
  const int64_t E = int64_t(head[0]);
  d.entries = E;
  const int64_t bad_t = head[1] == kNone ? T : int64_t(head[1] >> 32);
  const int64_t bad_j = head[1] == kNone ? -1 : int64_t(head[1] & 0xffffffffu);
  const int64_t unsorted_t = head[2] == kNone ? T : int64_t(head[2]);

  auto fail_bad = [&] {
    const size_t es = rows.element_size();
    int64_t v = 0;
    if (rows.dtype() == DType::i64) {
      read_back(&v, static_cast<const char*>(rows.raw()) + size_t(bad_t * W + bad_j) * es, es);
    } else {
      int32_t v32 = 0;
      read_back(&v32, static_cast<const char*>(rows.raw()) + size_t(bad_t * W + bad_j) * es, es);
      v = v32;
    }
    const int64_t g = q0 + bad_t;  // the query's global token
    const size_t doc = size_t(std::upper_bound(cu.begin(), cu.end(), g) - cu.begin()) - 1;
    const int64_t lo = cp[doc], hi = cp[doc] + (g - cu[doc] + 1) / pool;
    HLM_FAIL(
        "{}: {}[{}, {}] = {} is not a causal {} of query {}'s document (expected -1 or a value in "
        "[{}, {}))",
        op, what, bad_t, bad_j, v, pool == 1 ? "token" : "pool", g, lo, hi);
  };
  // Rows before the first bad one are all strictly ascending: no repeat can come first.
  const bool check_repeats = unsorted_t < bad_t;
  if (bad_t < T && !check_repeats) fail_bad();

  // 4: the entries.
  const bool sort = check_repeats || with_inverse;
  d.slot = alloc({E}, DType::i32);
  d.key = alloc({E}, DType::i64);
  d.query = alloc({E}, DType::i64);
  Tensor sort_keys[2];
  if (sort) sort_keys[0] = alloc({E}, DType::i32);
  if (T > 0 && E > 0)
    by_index([&](const auto* r) {
      rows_compact_kernel<<<row_blocks, kThreads>>>(r, T, W, cptr<int32_t>(flag),
                                                    cptr<int64_t>(d.row_ptr), mptr<int32_t>(d.slot),
                                                    mptr<int64_t>(d.key), mptr<int64_t>(d.query),
                                                    sort ? mptr<uint32_t>(sort_keys[0]) : nullptr);
      check_launch(kname);
    });
  if (!sort) return d;

  // 5: the entries sorted by key: the repeats, the inverse map.
  int bits = 1;
  while (bits < 32 && (int64_t(1) << bits) < NK) ++bits;
  d.key_entry = alloc({E}, DType::i64);
  const uint32_t* sorted = cptr<uint32_t>(sort_keys[0]);
  if (E > 0) {
    sort_keys[1] = alloc({E}, DType::i32);
    Tensor vals1 = alloc({E}, DType::i64);
    uint32_t* const kbuf[2] = {mptr<uint32_t>(sort_keys[0]), mptr<uint32_t>(sort_keys[1])};
    int64_t* const vbuf[2] = {mptr<int64_t>(d.key_entry), mptr<int64_t>(vals1)};
    sorted = radix_sort(kbuf, vbuf, E, bits, kname);
  }
  if (check_repeats) {
    min_reduce(SortedRepeats{sorted, cptr<int64_t>(d.key_entry), cptr<int64_t>(d.query)}, E,
               reinterpret_cast<uint64_t*>(sm + 3), kname);
    uint64_t rep = kNone;
    read_back(&rep, sm + 3, sizeof(rep));
    if (rep != kNone && int64_t(rep >> 32) < bad_t)
      HLM_FAIL("{}: {} row {} holds index {} more than once", op, what, int64_t(rep >> 32),
               int64_t(rep & 0xffffffffu));
    if (bad_t < T) fail_bad();
  }
  if (!with_inverse) {
    d.key_entry = Tensor();
    return d;
  }
  d.key_ptr = alloc({NK + 1}, DType::i64);
  key_ptr_kernel<<<blocks_for(NK + 1, kThreads), kThreads>>>(sorted, E, NK,
                                                             mptr<int64_t>(d.key_ptr));
  check_launch(kname);
  return d;
}

}  // namespace hlm::ops::cuda
