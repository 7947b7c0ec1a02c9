// The token picks and scores on CUDA (ops/cuda/token_pick.cuh), the rule of ops/token_pick.h, in
// two kernels (score_tokens: the given token's log-probability, nothing picked).
//
// Every row (greedy or not) is first cut into slices of 4096 ids, a 512-thread block per (slice,
// row) (row_part_kernel; one block walking a 154880-id row took 168 us on an H100): thread j
// walks the slice's ids j, j + 512, ... keeping its largest finite logit (ties: the lower id,
// which it meets first) and its first non-finite id; the block merges the (value, id) pairs
// (larger value, then lower id: a total order, so any merge order gives the same pair) and the
// first bad ids (the minimum); then it sums exp(x_v - m_s) in FP64 over the slice, m_s its
// largest finite logit, each warp by an xor butterfly and the 16 warp sums in warp order. Then a
// 512-thread block per row (pick_kernel) merges its slices the same way: the pick's (value, id),
// the first bad id, m = the largest m_s, and lse = m + log(sum_s S_s exp(m_s - m)), the slices
// added in slice order by each lane and a butterfly over the lanes: a fixed order, so the same
// bits every run.
//
// A sampled row then selects by radix over the candidates' order. Each id v has the key
// (ord(x_v), 2^32 - 1 - v), ord mapping the logit's bits to an unsigned integer that grows with
// the value (-0 as +0: equal logits, which the id orders, as on the CPU); the keys are distinct
// and sort as the CPU's candidates do, the first candidate having the largest key. Its weight is
// W_v = rint(exp((x_v - m) / t) 2^s), an integer of at most 2^s, with s chosen so that
// V 2^s < 2^63: sums of weights are exact, so any order of adding them gives the same bits. A
// search finds, one 8-bit digit at a time from the most significant, the key at which a running
// total over the keys in decreasing order first meets a target: each digit takes a histogram of
// the candidates that match the digits found so far (counts, or weights), and one thread scans
// its 256 bins from the top. Three searches, each skipped when its setting is off:
//   top-k: the k-th largest key, by counts (the candidates from then on: keys >= it);
//   top-p: the key at which the weights' running sum first reaches ceil(top_p T), T the
//          candidates' total (the kept: keys >= it; kept = the sum up to and with it);
//   draw:  the key at which it first exceeds floor(u kept).
// T (and kept without top-p) is the total of the search's first histogram, which holds every
// candidate: no pass of its own.
// The histograms add with shared-memory integer atomics (a warp whose candidates share a bin adds
// once, by its leader): integer sums, so the result does not depend on the order.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "ops/cuda/layer_ops_common.cuh"
#include "ops/cuda/token_pick.cuh"

namespace hlm::ops::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 256;
constexpr int64_t kNone = INT64_MAX;
constexpr unsigned kFull = 0xffffffffu;

// (v, i) := the better of (v, i) and (v2, i2): the larger value, then the lower id.
__device__ __forceinline__ void better(double& v, int64_t& i, double v2, int64_t i2) {
  if (v2 > v || (v2 == v && i2 < i)) {
    v = v2;
    i = i2;
  }
}

// Every lane gets the warp's best (value, id) and its first bad id (xor butterflies).
__device__ __forceinline__ void warp_merge(double& best, int64_t& idx, int64_t& first_bad) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    better(best, idx, __shfl_xor_sync(kFull, best, off), __shfl_xor_sync(kFull, idx, off));
    const int64_t b2 = __shfl_xor_sync(kFull, first_bad, off);
    first_bad = b2 < first_bad ? b2 : first_bad;
  }
}

// The sort key of a logit: its value's order as an unsigned integer (finite values only), then
// the id reversed, so that a larger key comes first. Float and bf16 logits: 64-bit keys (the value
// as a float is exact); f64: 96 bits in 128.
template <class T>
struct KeyOf {
  using Key = unsigned long long;
  static constexpr int kDigits = 8;
  __device__ static Key of(const T* row, int64_t v) {
    unsigned b = __float_as_uint(ld<float>(row, v));
    if ((b & 0x7fffffffu) == 0) b = 0;  // -0 is +0: they compare equal, so the id orders them
    const unsigned o = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return (Key(o) << 32) | Key(0xffffffffu - unsigned(v));
  }
};
template <>
struct KeyOf<double> {
  using Key = unsigned __int128;
  static constexpr int kDigits = 12;
  __device__ static Key of(const double* row, int64_t v) {
    auto b = static_cast<unsigned long long>(__double_as_longlong(row[v]));
    if ((b << 1) == 0) b = 0;  // -0 is +0
    const unsigned long long o = (b >> 63) ? ~b : (b | (1ull << 63));
    return (Key(o) << 32) | Key(0xffffffffu - unsigned(v));
  }
};

template <class Key>
__device__ __forceinline__ int64_t id_of(Key k) {
  return int64_t(0xffffffffu - unsigned(k & Key(0xffffffffu)));
}

enum class Find { count_reaches, weight_reaches, weight_exceeds };

// The row's block-wide state, in shared memory.
struct RowState {
  unsigned long long hist[kBins];
  double m, lse;
  int64_t best, bad;
  unsigned long long found_above;
  unsigned long long found_digit;
};

// W_v: exp((x_v - m) / t) in units of 2^-scale.
__device__ __forceinline__ unsigned long long weight(double x, double m, double t, double unit) {
  return static_cast<unsigned long long>(rint(exp((x - m) / t) * unit));
}

// The key at which the running total over the candidates (keys >= lo) in decreasing key order
// first reaches (count_reaches, weight_reaches: >= target) or exceeds (weight_exceeds: > target)
// the target; *above gets the total of the candidates before it. The target must be met by the
// candidates' whole total. frac >= 0 (weight modes): the target is that fraction of the whole
// total, taken from the first digit's histogram (which holds every candidate) instead of a pass of
// its own: weight_reaches ceil(frac total) in [1, total], weight_exceeds floor(frac total) below
// total.
template <class T>
__device__ typename KeyOf<T>::Key find_key(RowState& st, const T* row, int64_t V, Find mode,
                                           unsigned long long target, typename KeyOf<T>::Key lo,
                                           double t, double unit, unsigned long long* above_out,
                                           double frac = -1) {
  using Key = typename KeyOf<T>::Key;
  constexpr int D = KeyOf<T>::kDigits;
  const int lane = int(threadIdx.x) % 32;
  Key prefix = 0;
  unsigned long long above = 0;
  for (int d = 0; d < D; ++d) {
    const int shift = 8 * (D - 1 - d);
    for (int b = int(threadIdx.x); b < kBins; b += kThreads) st.hist[b] = 0;
    __syncthreads();
    for (int64_t base = 0; base < V; base += kThreads) {
      const int64_t v = base + int64_t(threadIdx.x);
      bool ok = v < V;
      Key key = 0;
      if (ok) {
        key = KeyOf<T>::of(row, v);
        ok = key >= lo && (d == 0 || (key >> (shift + 8)) == (prefix >> (shift + 8)));
      }
      const int bin = ok ? int((key >> shift) & Key(0xff)) : 0;
      unsigned long long val = 0;
      if (ok) val = mode == Find::count_reaches ? 1ull : weight(ld<double>(row, v), st.m, t, unit);
      const unsigned act = __ballot_sync(kFull, ok);
      if (act == 0) continue;
      const int lead = __ffs(int(act)) - 1;
      const int lead_bin = __shfl_sync(kFull, bin, lead);
      if (__all_sync(kFull, !ok || bin == lead_bin)) {
        const unsigned long long s = warp_sum(val);
        if (lane == lead) atomicAdd(&st.hist[lead_bin], s);
      } else if (ok) {
        atomicAdd(&st.hist[bin], val);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      if (d == 0 && frac >= 0) {
        unsigned long long total = 0;
        for (int b = 0; b < kBins; ++b) total += st.hist[b];
        const double want = frac * static_cast<double>(total);
        if (mode == Find::weight_reaches) {
          target = static_cast<unsigned long long>(ceil(want));
          target = target < 1 ? 1 : (target > total ? total : target);
        } else {
          target = static_cast<unsigned long long>(want);
          target = target >= total ? total - 1 : target;
        }
      }
      int pick = -1;
      for (int b = kBins - 1; b >= 0; --b) {
        const unsigned long long h = st.hist[b];
        const bool met = mode == Find::weight_exceeds ? above + h > target : above + h >= target;
        if (h != 0 && met) {
          pick = b;
          break;
        }
        above += h;
      }
      // Unreachable when the target is met by the whole: then the last candidate.
      if (pick < 0)
        for (int b = 0; b < kBins && pick < 0; ++b)
          if (st.hist[b] != 0) {
            pick = b;
            above -= st.hist[b];
          }
      st.found_digit = static_cast<unsigned long long>(pick < 0 ? 0 : pick);
      st.found_above = above;
    }
    __syncthreads();
    prefix |= Key(st.found_digit) << shift;
    above = st.found_above;
  }
  *above_out = above;
  return prefix;
}

constexpr int64_t kSliceIds = 8 * kThreads;  // ids of a row per row_part_kernel block

// A slice's (m_s, S_s) and its pick, as doubles [R, slices, 2] and ids [R, slices, 2] (the best
// finite id or kNone, the first non-finite id or kNone).
template <class T>
__global__ void __launch_bounds__(kThreads)
    row_part_kernel(const T* __restrict__ x, int64_t V, double* __restrict__ pv,
                    int64_t* __restrict__ pi) {
  __shared__ double sv[kWarps], ss[kWarps];
  __shared__ int64_t si[kWarps], sb[kWarps];
  __shared__ double sm;
  const int64_t r = blockIdx.y, s = blockIdx.x, slices = gridDim.x;
  const int64_t v0 = s * kSliceIds, v1 = v0 + kSliceIds < V ? v0 + kSliceIds : V;
  const T* row = x + r * V;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  double best = -INFINITY;
  int64_t idx = kNone, first_bad = kNone;
  for (int64_t v = v0 + threadIdx.x; v < v1; v += kThreads) {
    const double e = ld<double>(row, v);
    if (!(fabs(e) < INFINITY)) {  // NaN or infinite
      if (first_bad == kNone) first_bad = v;
      continue;
    }
    if (e > best) {
      best = e;
      idx = v;
    }
  }
  warp_merge(best, idx, first_bad);
  if (lane == 0) {
    sv[warp] = best;
    si[warp] = idx;
    sb[warp] = first_bad;
  }
  __syncthreads();
  if (warp == 0) {
    best = lane < kWarps ? sv[lane] : -INFINITY;
    idx = lane < kWarps ? si[lane] : kNone;
    first_bad = lane < kWarps ? sb[lane] : kNone;
    warp_merge(best, idx, first_bad);
    if (lane == 0) {
      sm = best;
      pi[(r * slices + s) * 2] = idx;
      pi[(r * slices + s) * 2 + 1] = first_bad;
    }
  }
  __syncthreads();
  const double m = sm;
  double sum = 0;
  for (int64_t v = v0 + threadIdx.x; v < v1; v += kThreads) sum += exp(ld<double>(row, v) - m);
  sum = warp_sum(sum);
  if (lane == 0) ss[warp] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) sum += ss[w];
    pv[(r * slices + s) * 2] = m;
    pv[(r * slices + s) * 2 + 1] = sum;
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    pick_kernel(const T* __restrict__ x, int64_t V, const double* __restrict__ pv,
                const int64_t* __restrict__ pi, int64_t slices, const double* __restrict__ params,
                const int64_t* __restrict__ given, int scale, int64_t* __restrict__ token,
                double* __restrict__ logprob, int64_t* __restrict__ bad) {
  using Key = typename KeyOf<T>::Key;
  __shared__ RowState st;
  const int64_t r = blockIdx.x;
  const T* row = x + r * V;
  const double* prv = pv + r * slices * 2;
  const int64_t* pri = pi + r * slices * 2;
  const int lane = int(threadIdx.x) % 32;
  if (threadIdx.x < 32) {  // warp 0 merges the slices
    double best = -INFINITY;
    int64_t idx = kNone, first_bad = kNone;
    for (int64_t s = lane; s < slices; s += 32) {
      if (pri[2 * s] != kNone) better(best, idx, prv[2 * s], pri[2 * s]);
      first_bad = pri[2 * s + 1] < first_bad ? pri[2 * s + 1] : first_bad;
    }
    warp_merge(best, idx, first_bad);
    const double m = best;
    double sum = 0;
    for (int64_t s = lane; s < slices; s += 32)
      if (pri[2 * s] != kNone) sum += prv[2 * s + 1] * exp(prv[2 * s] - m);
    sum = warp_sum(sum);
    if (lane == 0) {
      st.m = m;
      st.lse = m + log(sum);
      st.best = idx == kNone ? 0 : idx;
      st.bad = first_bad == kNone ? -1 : first_bad;
      bad[r] = st.bad;
    }
  }
  __syncthreads();
  const double m = st.m;
  int64_t pick = given ? given[r] : st.best;
  const double temp = params ? params[4 * r] : 0.0;
  if (st.bad < 0 && temp > 0) {  // block-uniform
    const auto top_k = static_cast<int64_t>(params[4 * r + 1]);
    const double top_p = params[4 * r + 2], u = params[4 * r + 3];
    const double unit = ldexp(1.0, scale);
    unsigned long long above = 0;
    Key lo = 0;
    if (top_k > 0 && top_k < V)
      lo = find_key(st, row, V, Find::count_reaches, static_cast<unsigned long long>(top_k), lo,
                    temp, unit, &above);
    // The candidates' total weight comes from each search's first histogram (frac).
    if (top_p < 1) {
      lo = find_key(st, row, V, Find::weight_reaches, 0, lo, temp, unit, &above, top_p);
      const unsigned long long kept = above + weight(ld<double>(row, id_of(lo)), m, temp, unit);
      unsigned long long at = static_cast<unsigned long long>(u * static_cast<double>(kept));
      at = at >= kept ? kept - 1 : at;
      pick = id_of(find_key(st, row, V, Find::weight_exceeds, at, lo, temp, unit, &above));
    } else {
      pick = id_of(find_key(st, row, V, Find::weight_exceeds, 0, lo, temp, unit, &above, u));
    }
  }
  if (threadIdx.x == 0) {
    token[r] = pick;
    logprob[r] = st.bad >= 0 ? 0.0 : ld<double>(row, pick) - st.lse;
  }
}

// s with V 2^s < 2^63, at most 52 (a weight of 1 is then 2^s exactly).
int weight_scale(int64_t V) {
  int bits = 0;
  while ((int64_t(1) << bits) <= V) ++bits;  // V < 2^bits
  return bits + 52 < 63 ? 52 : 62 - bits;
}

void launch(const Tensor& logits, const double* params, const int64_t* given, TokenPick& out) {
  const int64_t R = logits.size(0), V = logits.size(1), slices = (V + kSliceIds - 1) / kSliceIds;
  HLM_CHECK(R <= 65535 && slices <= 65535,
            "token pick on CUDA: {} rows of {} ids, at most 65535 "
            "rows and {} ids",
            R, V, 65535 * kSliceIds);
  const Tensor pv = alloc({R, slices, 2}, DType::f64), pi = alloc({R, slices, 2}, DType::i64);
  dispatch_storage(logits.dtype(), [&](auto tx) {
    using T = decltype(tx);
    row_part_kernel<T><<<dim3(unsigned(slices), unsigned(R)), kThreads>>>(
        cptr<T>(logits), V, mptr<double>(pv), mptr<int64_t>(pi));
    pick_kernel<T><<<unsigned(R), kThreads>>>(cptr<T>(logits), V, cptr<double>(pv),
                                              cptr<int64_t>(pi), slices, params, given,
                                              weight_scale(V), mptr<int64_t>(out.token),
                                              mptr<double>(out.logprob), mptr<int64_t>(out.bad));
  });
}

}  // namespace

void greedy_pick(const Tensor& logits, TokenPick& out) {
  launch(logits, nullptr, nullptr, out);
  check_launch("greedy_pick");
}

void sample_pick(const Tensor& logits, const std::vector<SampleRow>& rows, TokenPick& out) {
  std::vector<double> p;
  p.reserve(4 * rows.size());
  const int64_t V = logits.size(1);
  for (const SampleRow& s : rows) {
    p.push_back(s.temperature);
    p.push_back(static_cast<double>(s.top_k < V ? s.top_k : V));  // exact: V < 2^53
    p.push_back(s.top_p);
    p.push_back(s.u);
  }
  const Tensor dp = to_device(p);
  launch(logits, cptr<double>(dp), nullptr, out);
  check_launch("sample_pick");
}

void score_tokens(const Tensor& logits, const std::vector<int64_t>& tokens, TokenPick& out) {
  const Tensor dt = to_device(tokens);
  launch(logits, nullptr, cptr<int64_t>(dt), out);
  check_launch("score_tokens");
}

}  // namespace hlm::ops::cuda
