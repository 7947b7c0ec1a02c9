// The routed experts of the MoE layer on CUDA (ops/cuda/moe.cuh), the math of ops/cpu/moe.cpp's
// experts (docs/mhc_moe.md, "MoE on CUDA").
//
// Permutation by expert: the N = T K assignments a = t K + k are sorted by expert with a stable
// counting sort, with no atomics: a block per expert counts its assignments (integer block sum),
// one thread scans the counts into offsets off[E + 1], then a block per expert cuts the
// assignments into 256 contiguous slices, counts its hits per slice, scans the slice counts and
// writes each hit's place p = off[e] + (hits before it): perm[p] = a and pos[a] = p. Within an
// expert the assignments keep their ascending order (the CPU's gather order), so the permutation,
// hence every GEMM operand, is a function of topk_idx alone.
// GEMMs: the rows of expert e are the block [off[e], off[e + 1]) of the permuted operands, and all
// experts' products of one step go to cuBLAS as one grouped GEMM (ops/cuda/gemm.cuh,
// gemm_grouped: one cublasGemmGroupedBatchedEx call, experts without tokens left out). The weight
// gradients are accumulated by the GEMMs themselves (beta = 1) when the accumulator has the
// computation dtype, else computed into a zeroed buffer and added (ops::add_).
// Forward: xp = x[perm / K]; gup = xp W_gu[e]^T; hp = swiglu(gup); eop = hp W_dn[e]^T; the saved
// gu / h / eo are gathered back to assignment order (pos), and out = sum_k w_k eo[t, k] + shared
// in k order (moe_combine_rows). Backward: dw and dO = w dout (combine backward); dOp, xp, hp,
// gup gathered by perm; dhp = dOp W_dn[e]; dW_dn[e] += dOp^T hp; dgup = swiglu'(gup, dhp);
// dW_gu[e] += dgup^T xp; dxp = dgup W_gu[e]; dx = sum_k dxp[pos[t K + k]] + shared dx, k
// ascending. The shared expert runs through ops::gemm / ops::matmul. Every step is deterministic
// (no atomics, cuBLAS with atomics disallowed), so two runs give the same bits.
// Inference at decode sizes (moe_routed_experts): the same sort, then for each projection one
// weight-streaming kernel over every expert's rows (expert_gemv_kernel, 8 consecutive k per lane
// and step, vector loads), so no group size is read on the host; the down projection writes each
// row at its assignment.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "core/device.h"
#include "ops/cuda/gemm.cuh"
#include "ops/cuda/layer_ops_common.cuh"
#include "ops/cuda/moe.cuh"
#include "ops/gemm.h"
#include "ops/tensor_ops.h"

namespace hlm::ops::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ int64_t idx_at(const void* p, bool i32, int64_t i) {
  return i32 ? int64_t(static_cast<const int32_t*>(p)[i]) : static_cast<const int64_t*>(p)[i];
}

// count[e] = #{a < N : idx[a] == e}, one block per expert.
__global__ void __launch_bounds__(kThreads)
    expert_count_kernel(const void* __restrict__ idx, bool i32, int64_t N,
                        int64_t* __restrict__ count) {
  __shared__ int64_t red[kThreads];
  const int64_t e = blockIdx.x;
  int64_t c = 0;
  for (int64_t a = threadIdx.x; a < N; a += kThreads) c += idx_at(idx, i32, a) == e ? 1 : 0;
  red[threadIdx.x] = c;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w >>= 1) {
    if (int(threadIdx.x) < w) red[threadIdx.x] += red[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) count[e] = red[0];
}

// off[0] = 0, off[e + 1] = off[e] + count[e].
__global__ void expert_offsets_kernel(const int64_t* __restrict__ count, int64_t E,
                                      int64_t* __restrict__ off) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  int64_t s = 0;
  off[0] = 0;
  for (int64_t e = 0; e < E; ++e) off[e + 1] = (s += count[e]);
}

// The stable scatter of expert blockIdx.x's assignments: perm[p] = a, pos[a] = p.
__global__ void __launch_bounds__(kThreads)
    expert_scatter_kernel(const void* __restrict__ idx, bool i32, int64_t N,
                          const int64_t* __restrict__ off, int64_t* __restrict__ perm,
                          int64_t* __restrict__ pos) {
  __shared__ int64_t before[kThreads];
  const int64_t e = blockIdx.x;
  const int64_t L = (N + kThreads - 1) / kThreads;
  const int64_t a0 = std::min<int64_t>(N, int64_t(threadIdx.x) * L), a1 = std::min(N, a0 + L);
  int64_t c = 0;
  for (int64_t a = a0; a < a1; ++a) c += idx_at(idx, i32, a) == e ? 1 : 0;
  before[threadIdx.x] = c;
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t s = 0;
    for (int j = 0; j < kThreads; ++j) {
      const int64_t v = before[j];
      before[j] = s;
      s += v;
    }
  }
  __syncthreads();
  int64_t p = off[e] + before[threadIdx.x];
  for (int64_t a = a0; a < a1; ++a)
    if (idx_at(idx, i32, a) == e) {
      perm[p] = a;
      pos[a] = p;
      ++p;
    }
}

// dst[r, :] = src[map[r] / div, :] for r < rows (rows of C elements).
template <class T>
__global__ void __launch_bounds__(kThreads)
    gather_rows_kernel(const T* __restrict__ src, const int64_t* __restrict__ map, int64_t div,
                       T* __restrict__ dst, int64_t rows, int64_t C) {
  const int64_t n = rows * C;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * kThreads) {
    const int64_t r = i / C, c = i % C;
    dst[i] = src[(map[r] / div) * C + c];
  }
}

__global__ void __launch_bounds__(kThreads)
    index_to_i64_kernel(const void* __restrict__ idx, bool i32, int64_t n,
                        int64_t* __restrict__ out) {
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * kThreads)
    out[i] = idx_at(idx, i32, i);
}

unsigned grid_for(int64_t n) {
  return unsigned(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, int64_t(1) << 20));
}

// The permutation of the assignments of idx [N] by expert.
struct Perm {
  Tensor perm, pos;  // [N] i64 each
  Tensor off;        // [E + 1] i64: expert e's sorted positions are [off[e], off[e + 1])
};
Perm sort_by_expert(const Tensor& idx, int64_t E) {
  const int64_t N = idx.numel();
  const bool i32 = idx.dtype() == DType::i32;
  Tensor count = alloc({E}, DType::i64), off = alloc({E + 1}, DType::i64);
  Perm p{alloc({N}, DType::i64), alloc({N}, DType::i64), off};
  expert_count_kernel<<<unsigned(E), kThreads>>>(idx.raw(), i32, N, mptr<int64_t>(count));
  check_launch("moe experts: count");
  expert_offsets_kernel<<<1, 32>>>(cptr<int64_t>(count), E, mptr<int64_t>(off));
  check_launch("moe experts: offsets");
  expert_scatter_kernel<<<unsigned(E), kThreads>>>(idx.raw(), i32, N, cptr<int64_t>(off),
                                                   mptr<int64_t>(p.perm), mptr<int64_t>(p.pos));
  check_launch("moe experts: scatter");
  return p;
}

// ---- routed experts, weight-streaming (moe_routed_experts) ----
// Y[out(p), n] = sum_k r(X[in(p), k]) r(W[e, n, k]) for expert e = blockIdx.y, its sorted
// positions p in [off[e], off[e + 1]), and the output channels n of this block; in(p) =
// in_perm[p] / in_div (or p), out(p) = out_perm[p] (or p); r rounds to bf16 when kRound.
// Each warp owns kGemvCh output channels, so a block reads its kGemvWarps kGemvCh rows of W once
// per kGemvRows of the expert's rows: at decode sizes (a few rows per expert) the weights are
// streamed once. Lane l takes the spans of kGemvSpan consecutive k starting at kGemvSpan l +
// 32 kGemvSpan i, i = 0, 1, ..., summing them in ascending k with fused multiply-adds, then
// warp_sum's butterfly: one fixed order per output element, whatever the other rows (the CPU op
// follows it, ops/cpu/moe.cpp). When Kin is a multiple of the span and the operands are aligned
// (kVec), a lane reads each span of W and of x with vector loads (16 bytes of bf16 W): a warp
// covers 256 k per step, so the loop has 8 steps at Kin = 2048 instead of 64 scalar ones, each
// with its loads in flight together.
constexpr int kGemvWarps = 8, kGemvCh = 4, kGemvRows = 8, kGemvSpan = 8;

// v as the product takes an element of a T operand: rounded to bf16 under kRound when T is float
// (bf16 values are exact already).
template <bool kRound, class T, class A>
__device__ __forceinline__ A gemv_round(A v) {
  if constexpr (kRound && std::is_same_v<T, float>)
    return A(__bfloat162float(__float2bfloat16_rn(float(v))));
  else
    return v;
}

// The span of p from i: n = min(kGemvSpan, Kin - i) values (kVec: all, one aligned vector load),
// rounded to bf16 when kRound; the rest zero (never summed).
template <bool kVec, bool kRound, class A, class T>
__device__ __forceinline__ void gemv_span(const T* p, int64_t i, int n, A (&out)[kGemvSpan]) {
  if constexpr (kVec) {
    ldv<kGemvSpan>(p, i, out);
  } else {
#pragma unroll
    for (int j = 0; j < kGemvSpan; ++j) out[j] = j < n ? ld<A>(p, i + j) : A(0);
  }
#pragma unroll
  for (int j = 0; j < kGemvSpan; ++j) out[j] = gemv_round<kRound, T>(out[j]);
}

template <bool kVec, bool kRound, class TX, class TW, class A>
__global__ void __launch_bounds__(kGemvWarps * 32)
    expert_gemv_kernel(const TX* __restrict__ X, const int64_t* __restrict__ in_perm,
                       int64_t in_div, const TW* __restrict__ W, const int64_t* __restrict__ off,
                       const int64_t* __restrict__ out_perm, A* __restrict__ Y, int64_t Nout,
                       int64_t Kin) {
  const int64_t e = blockIdx.y, p0 = off[e], p1 = off[e + 1];
  const int lane = int(threadIdx.x) % 32;
  const int64_t n0 = (int64_t(blockIdx.x) * kGemvWarps + int(threadIdx.x) / 32) * kGemvCh;
  if (p0 == p1 || n0 >= Nout) return;
  const TW* We = W + e * Nout * Kin;
  int64_t wrow[kGemvCh];
#pragma unroll
  for (int c = 0; c < kGemvCh; ++c) wrow[c] = std::min(n0 + c, Nout - 1) * Kin;
  for (int64_t q0 = p0; q0 < p1; q0 += kGemvRows) {
    int64_t xrow[kGemvRows];
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r) {
      const int64_t p = std::min(q0 + r, p1 - 1);
      xrow[r] = (in_perm ? in_perm[p] / in_div : p) * Kin;
    }
    A acc[kGemvCh][kGemvRows];
#pragma unroll
    for (int c = 0; c < kGemvCh; ++c)
#pragma unroll
      for (int r = 0; r < kGemvRows; ++r) acc[c][r] = A(0);
    // The chunk's rows (uniform over the block): at batch 1 an expert has one, and the others'
    // loads and products are skipped.
    const int nr = int(std::min<int64_t>(kGemvRows, p1 - q0));
    for (int64_t k0 = int64_t(lane) * kGemvSpan; k0 < Kin; k0 += 32 * kGemvSpan) {
      const int nk = kVec ? kGemvSpan : int(std::min<int64_t>(kGemvSpan, Kin - k0));
      A w[kGemvCh][kGemvSpan];
#pragma unroll
      for (int c = 0; c < kGemvCh; ++c) gemv_span<kVec, kRound>(We, wrow[c] + k0, nk, w[c]);
#pragma unroll
      for (int r = 0; r < kGemvRows; ++r) {
        if (r >= nr) break;
        A xv[kGemvSpan];
        gemv_span<kVec, kRound>(X, xrow[r] + k0, nk, xv);
#pragma unroll
        for (int j = 0; j < kGemvSpan; ++j) {
          if (!kVec && j >= nk) break;
#pragma unroll
          for (int c = 0; c < kGemvCh; ++c) acc[c][r] = dfma(w[c][j], xv[j], acc[c][r]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r) {
      if (r >= nr) break;  // uniform: no butterflies for the chunk's absent rows
#pragma unroll
      for (int c = 0; c < kGemvCh; ++c) {
        const A v = warp_sum(acc[c][r]);
        const int64_t p = q0 + r;
        if (lane == 0 && p < p1 && n0 + c < Nout)
          Y[(out_perm ? out_perm[p] : p) * Nout + n0 + c] = v;
      }
    }
  }
}

template <bool kRound, class TX, class TW, class A>
void expert_gemv(const Tensor& X, const int64_t* in_perm, int64_t in_div, const Tensor& W,
                 const Tensor& off, const int64_t* out_perm, Tensor& Y) {
  const int64_t E = W.size(0), Nout = W.size(1), Kin = W.size(2);
  const int64_t per_block = int64_t(kGemvWarps) * kGemvCh;
  const dim3 grid(unsigned((Nout + per_block - 1) / per_block), unsigned(E));
  const TX* x = cptr<TX>(X);
  const TW* w = cptr<TW>(W);
  // Vector loads: every span starts on a multiple of kGemvSpan elements of an aligned base.
  const bool vec = Kin % kGemvSpan == 0 &&
                   reinterpret_cast<uintptr_t>(x) % (sizeof(TX) * kGemvSpan) == 0 &&
                   reinterpret_cast<uintptr_t>(w) % (sizeof(TW) * kGemvSpan) == 0;
  auto go = [&](auto kvec) {
    expert_gemv_kernel<decltype(kvec)::value, kRound, TX, TW, A><<<grid, kGemvWarps * 32>>>(
        x, in_perm, in_div, w, cptr<int64_t>(off), out_perm, mptr<A>(Y), Nout, Kin);
  };
  if (vec)
    go(std::true_type{});
  else
    go(std::false_type{});
  check_launch("moe_routed_experts");
}

// A new [rows, C] tensor of src's dtype: row r is src's row map[r] / div.
Tensor gather_rows(const Tensor& src, const Tensor& map, int64_t div, int64_t C) {
  const int64_t rows = map.numel();
  Tensor dst = alloc({rows, C}, src.dtype());
  if (rows * C == 0) return dst;
  auto go = [&](auto tag) {
    using T = decltype(tag);
    gather_rows_kernel<T><<<grid_for(rows * C), kThreads>>>(cptr<T>(src), cptr<int64_t>(map), div,
                                                            mptr<T>(dst), rows, C);
    check_launch("moe experts: gather");
  };
  if (src.dtype() == DType::f64)
    go(double{});
  else
    go(float{});
  return dst;
}

// The host offsets of the experts' row blocks, from the index values.
std::vector<int64_t> host_offsets(const std::vector<int64_t>& idx, int64_t E) {
  std::vector<int64_t> off(size_t(E) + 1, 0);
  for (int64_t e : idx) ++off[size_t(e) + 1];
  for (int64_t e = 0; e < E; ++e) off[size_t(e) + 1] += off[size_t(e)];
  return off;
}

// One group per expert with rows: fn(e, row0, rows) -> GemmGroup.
template <class Fn>
std::vector<GemmGroup> groups_of(const std::vector<int64_t>& off, Fn&& fn) {
  std::vector<GemmGroup> g;
  for (size_t e = 0; e + 1 < off.size(); ++e)
    if (off[e + 1] > off[e]) g.push_back(fn(int64_t(e), off[e], off[e + 1] - off[e]));
  return g;
}

Tensor in_dtype(const Tensor& t, DType dt) {
  return ops::contiguous(ops::as_dtype(t, dt));
}

// acc += the grouped product (acc: f32 / f64 contiguous): directly when acc has the computation
// dtype, else through a zeroed buffer of it.
void accumulate_grouped(Tensor& acc, DType dt, const Tensor& a, bool ta, const Tensor& b, bool tb,
                        const std::vector<GemmGroup>& groups) {
  if (acc.dtype() == dt) {
    cuda::gemm_grouped(a, ta, b, tb, acc, groups, 1.0, 1.0);
    return;
  }
  Tensor tmp = Tensor::zeros(acc.shape(), dt, Device::cuda);
  cuda::gemm_grouped(a, ta, b, tb, tmp, groups, 1.0, 0.0);
  ops::add_(acc, tmp);
}

// acc += op(a) op(b) for the shared expert's weight gradients.
void accumulate_gemm(Tensor& acc, const Tensor& a, bool ta, const Tensor& b, bool tb) {
  if (acc.dtype() == a.dtype()) {
    ops::gemm(a, ta, b, tb, acc, 1.0, 1.0);
    return;
  }
  ops::add_(acc, ops::matmul(a, ta, b, tb));
}

}  // namespace

void moe_expert_load(const Tensor& idx, Tensor& load) {
  const int64_t E = load.numel();
  if (E == 0) return;
  expert_count_kernel<<<unsigned(E), kThreads>>>(idx.raw(), idx.dtype() == DType::i32, idx.numel(),
                                                 mptr<int64_t>(load));
  check_launch("moe_expert_load");
}

void moe_experts_forward(const Tensor& x_in, const MoeWeights& w, const Tensor& topk_idx,
                         const std::vector<int64_t>& idx_host, const Tensor& topk_weight,
                         double limit, Tensor& out, MoeSaved& s) {
  const DType dt = out.dtype();
  const int64_t T = x_in.size(0), D = x_in.size(1), E = w.gate_up.size(0),
                I = w.gate_up.size(1) / 2, K = topk_idx.size(1), N = T * K;
  const bool shared = w.shared_gate_up.defined() || w.shared_down.defined();
  const Tensor x = in_dtype(x_in, dt), tw = in_dtype(topk_weight, dt);
  s.x = x;
  s.limit = limit;
  s.topk_weight = tw;
  s.topk_idx = alloc({T, K}, DType::i64);
  s.gu = alloc({T, K, 2 * I}, dt);
  s.h = alloc({T, K, I}, dt);
  s.eo = alloc({T, K, D}, dt);
  s.sgu = Tensor();
  s.sh = Tensor();
  if (N > 0) {
    index_to_i64_kernel<<<grid_for(N), kThreads>>>(topk_idx.raw(), topk_idx.dtype() == DType::i32,
                                                   N, mptr<int64_t>(s.topk_idx));
    check_launch("moe_experts_forward");
    const Tensor gu_w = in_dtype(w.gate_up, dt), dn_w = in_dtype(w.down, dt);
    const Perm p = sort_by_expert(s.topk_idx, E);
    const std::vector<int64_t> off = host_offsets(idx_host, E);
    const Tensor xp = gather_rows(x, p.perm, K, D);
    Tensor gup = alloc({N, 2 * I}, dt), eop = alloc({N, D}, dt);
    cuda::gemm_grouped(xp, false, gu_w, true, gup,
                       groups_of(off,
                                 [&](int64_t e, int64_t r0, int64_t n) {
                                   return GemmGroup{n, 2 * I, D, r0 * D, e * 2 * I * D, r0 * 2 * I};
                                 }),
                       1.0, 0.0);
    Tensor hp = alloc({N, I}, dt);
    swiglu_clamped_forward(gup, limit, hp);
    cuda::gemm_grouped(
        hp, false, dn_w, true, eop,
        groups_of(off, [&](int64_t e, int64_t r0,
                           int64_t n) { return GemmGroup{n, D, I, r0 * I, e * D * I, r0 * D}; }),
        1.0, 0.0);
    s.gu = gather_rows(gup, p.pos, 1, 2 * I).view({T, K, 2 * I});
    s.h = gather_rows(hp, p.pos, 1, I).view({T, K, I});
    s.eo = gather_rows(eop, p.pos, 1, D).view({T, K, D});
  }
  Tensor so;
  if (shared && T > 0) {
    s.sgu = ops::matmul(x, false, in_dtype(w.shared_gate_up, dt), true);
    s.sh = alloc({T, s.sgu.size(1) / 2}, dt);
    swiglu_clamped_forward(s.sgu, limit, s.sh);
    so = ops::matmul(s.sh, false, in_dtype(w.shared_down, dt), true);
  }
  moe_combine_rows(s.eo.view({N, D}), Tensor(), K, tw, so, out);
}

void moe_experts_backward(const MoeSaved& s, const MoeWeights& w,
                          const std::vector<int64_t>& idx_host, const Tensor& dout_in,
                          MoeWeightGrads& g, MoeGrads& r) {
  const DType dt = r.dx.dtype();
  const int64_t T = s.x.size(0), D = s.x.size(1), E = w.gate_up.size(0), I = w.gate_up.size(1) / 2,
                K = s.topk_idx.size(1), N = T * K;
  const bool shared = w.shared_gate_up.defined() || w.shared_down.defined();
  if (T == 0) return;
  const Tensor dout = in_dtype(dout_in, dt), x = in_dtype(s.x, dt);
  const Tensor tw = in_dtype(s.topk_weight, dt), eo = in_dtype(s.eo, dt);
  // dw[t, k] = <dout_t, eo[t, k]>, dO[a] = w_a dout_t.
  MoeCombineGrads cg{r.dtopk_weight, alloc({T, K, D}, dt)};
  moe_combine_backward(dout, eo, tw, cg);
  const Tensor idx = ops::contiguous(s.topk_idx);
  const Tensor gu_w = in_dtype(w.gate_up, dt), dn_w = in_dtype(w.down, dt);
  const Perm p = sort_by_expert(idx, E);
  const std::vector<int64_t> off = host_offsets(idx_host, E);
  const Tensor dOp = gather_rows(cg.deo.view({N, D}), p.perm, 1, D);
  const Tensor xp = gather_rows(x, p.perm, K, D);
  const Tensor hp = gather_rows(in_dtype(s.h, dt).view({N, I}), p.perm, 1, I);
  const Tensor gup = gather_rows(in_dtype(s.gu, dt).view({N, 2 * I}), p.perm, 1, 2 * I);
  // dhp = dOp W_dn[e]   ([n, D] [D, I])
  Tensor dhp = alloc({N, I}, dt);
  cuda::gemm_grouped(
      dOp, false, dn_w, false, dhp,
      groups_of(off, [&](int64_t e, int64_t r0,
                         int64_t n) { return GemmGroup{n, I, D, r0 * D, e * D * I, r0 * I}; }),
      1.0, 0.0);
  // dW_dn[e] += dOp^T hp   ([D, n] [n, I])
  accumulate_grouped(g.ddown, dt, dOp, true, hp, false,
                     groups_of(off, [&](int64_t e, int64_t r0, int64_t n) {
                       return GemmGroup{D, I, n, r0 * D, r0 * I, e * D * I};
                     }));
  Tensor dgup = alloc({N, 2 * I}, dt);
  swiglu_clamped_backward(gup, dhp, s.limit, dgup);
  // dW_gu[e] += dgup^T xp   ([2I, n] [n, D])
  accumulate_grouped(g.dgate_up, dt, dgup, true, xp, false,
                     groups_of(off, [&](int64_t e, int64_t r0, int64_t n) {
                       return GemmGroup{2 * I, D, n, r0 * 2 * I, r0 * D, e * 2 * I * D};
                     }));
  // dxp = dgup W_gu[e]   ([n, 2I] [2I, D])
  Tensor dxp = alloc({N, D}, dt);
  cuda::gemm_grouped(dgup, false, gu_w, false, dxp,
                     groups_of(off,
                               [&](int64_t e, int64_t r0, int64_t n) {
                                 return GemmGroup{n, D, 2 * I, r0 * 2 * I, e * 2 * I * D, r0 * D};
                               }),
                     1.0, 0.0);
  Tensor sdx;
  if (shared) {
    const Tensor sgu_w = in_dtype(w.shared_gate_up, dt), sdn_w = in_dtype(w.shared_down, dt);
    const Tensor sh = in_dtype(s.sh, dt), sgu = in_dtype(s.sgu, dt);
    const Tensor dsh = ops::matmul(dout, false, sdn_w, false);  // [T, Is]
    accumulate_gemm(g.dshared_down, dout, true, sh, false);
    Tensor dsgu = alloc(sgu.shape(), dt);
    swiglu_clamped_backward(sgu, dsh, s.limit, dsgu);
    accumulate_gemm(g.dshared_gate_up, dsgu, true, x, false);
    sdx = ops::matmul(dsgu, false, sgu_w, false);
  }
  moe_combine_rows(dxp, p.pos, K, Tensor(), sdx, r.dx);
}

void moe_routed_experts(const Tensor& x, const Tensor& gate_up, const Tensor& down,
                        const Tensor& topk_idx, double limit, bool round_bf16, Tensor& eo) {
  const int64_t T = x.size(0), E = gate_up.size(0), I = gate_up.size(1) / 2, K = topk_idx.size(1),
                N = T * K;
  // A row whose index lies outside [0, E) gets no place in the sort: it stays NaN.
  device_memset(Device::cuda, eo.raw(), 0xFF, eo.nbytes());
  const Perm p = sort_by_expert(topk_idx, E);
  Tensor gu = alloc({N, 2 * I}, x.dtype()), h = alloc({N, I}, x.dtype());
  // Weights of two dtypes (bf16 and f32) under round_bf16: both read as bf16.
  const bool mixed = round_bf16 && gate_up.dtype() != down.dtype();
  const Tensor gw = mixed ? in_dtype(gate_up, DType::bf16) : gate_up;
  const Tensor dw = mixed ? in_dtype(down, DType::bf16) : down;
  auto run = [&](auto rnd, auto tx, auto tw) {
    constexpr bool kRound = decltype(rnd)::value;
    using TX = decltype(tx);
    using TW = decltype(tw);
    using A = acc_t<TX>;
    expert_gemv<kRound, TX, TW, A>(x, cptr<int64_t>(p.perm), K, gw, p.off, nullptr, gu);
    swiglu_clamped_forward(gu, limit, h);
    expert_gemv<kRound, A, TW, A>(h, nullptr, 1, dw, p.off, cptr<int64_t>(p.perm), eo);
  };
  using RoundOn = std::true_type;
  using RoundOff = std::false_type;
  if (x.dtype() == DType::f64)
    run(RoundOff{}, double{}, double{});
  else if (!round_bf16)
    run(RoundOff{}, float{}, float{});
  else if (gw.dtype() == DType::bf16)
    run(RoundOn{}, float{}, nv_bf16{});
  else
    run(RoundOn{}, float{}, float{});
}

}  // namespace hlm::ops::cuda
