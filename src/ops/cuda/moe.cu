// The MoE router, load balancing, sequence-wise aux loss, clamped SwiGLU and combine on CUDA
// (ops/cuda/moe.cuh), the math of ops/cpu/moe.cpp (docs/mhc_moe.md, "MoE on CUDA").
//
// Router forward: one warp per token (4 per block). The lanes write s = sigmoid(l) and
// s_sel = s + bias of their experts (e = lane + 32 j) into shared memory; with n_group > 1 lane g
// of a group forms its top-2 sum as the CPU does and topk_group rounds of a warp arg-max keep the
// groups; then top_k rounds of a warp arg-max pick the experts. The arg-max order is the CPU's
// (score descending, then index ascending), a strict total order on non-NaN scores, so the pick
// does not depend on the reduction order and equals the CPU's for equal scores; lane 0's result is
// broadcast so the lanes agree even on NaN. Lane 0 then forms the weights as the CPU does (sum over
// k in order, w = s / (sum + eps) * scale). The f32 sigmoid takes e^x in FP64 rounded to FP32
// (a correctly rounded exponential but for ~2^-29 of the arguments) so that the scores, hence the
// selection, agree with the CPU's bits as far as glibc's expf is itself correctly rounded.
// Router backward: one warp per token zeroes the row, lane 0 adds the K entries in k order.
// Aux loss: a warp per token writes s'_{t,e} = s_e / sum_j s_j; a thread per (segment of <= 64
// tokens of one sequence, expert) sums s' and counts its hits over the segment's tokens in order;
// a block per sequence adds its segments in order into f and P and reduces sum_e f_e P_e (lane
// partials, warp butterflies, warps in order); the host adds the sequences in order.
// SwiGLU: one thread per output element. Combine: one thread per (token, channel), k ascending,
// then the shared expert; its backward one warp per (token, k): lanes over the channels, the dot
// product a warp butterfly. No atomics anywhere; every result is a fixed expression of its inputs,
// bit-identical run to run.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "ops/cuda/layer_ops_common.cuh"
#include "ops/cuda/moe.cuh"

namespace hlm::ops::cuda {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kWarps = 4;     // router warps (tokens) per block
constexpr int kEw = 256;      // threads of the elementwise kernels
constexpr int64_t kSeg = 64;  // tokens per aux-loss segment

__device__ __forceinline__ int64_t idx_at(const void* p, bool i32, int64_t i) {
  return i32 ? int64_t(static_cast<const int32_t*>(p)[i]) : static_cast<const int64_t*>(p)[i];
}

// e^x for the router's scores: FP64 for f32, rounded once.
__device__ __forceinline__ float router_exp(float x) {
  return float(exp(double(x)));
}
__device__ __forceinline__ double router_exp(double x) {
  return exp(x);
}
// ops::sigmoid_scalar's expression.
template <class A>
__device__ __forceinline__ A router_sigmoid(A x) {
  if (x >= A(0)) return A(1) / (A(1) + router_exp(-x));
  const A e = router_exp(x);
  return e / (A(1) + e);
}

// The CPU's selection order: score descending, then index ascending.
template <class A>
__device__ __forceinline__ bool better(A a, int ia, A b, int ib) {
  return a > b || (a == b && ia < ib);
}
// Arg-max over the warp of (v, i) (i < 0: no candidate), lane 0's result in every lane.
template <class A>
__device__ __forceinline__ void warp_best(A& v, int& i) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const A ov = __shfl_xor_sync(kFull, v, off);
    const int oi = __shfl_xor_sync(kFull, i, off);
    if (oi >= 0 && (i < 0 || better(ov, oi, v, i))) v = ov, i = oi;
  }
  v = __shfl_sync(kFull, v, 0);
  i = __shfl_sync(kFull, i, 0);
}

struct RouterDims {
  int64_t T, E, K, G, topk_group;
  bool norm;
};

// Shared memory per warp: s [E], s_sel [E], group scores [G] (A), then per warp flags [E + G].
template <class A>
size_t router_smem(int64_t E, int64_t G) {
  return size_t(kWarps) * (size_t(2 * E + G) * sizeof(A) + size_t(E + G));
}

template <class A>
__global__ void __launch_bounds__(kWarps * 32)
    router_fwd_kernel(const A* __restrict__ logits, const A* __restrict__ bias,
                      const void* __restrict__ replay, bool replay32, A* __restrict__ scores,
                      int64_t* __restrict__ idx, A* __restrict__ wout, RouterDims d, A eps,
                      A scale) {
  extern __shared__ float4 smem4[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t E = d.E, G = d.G, K = d.K;
  A* s = reinterpret_cast<A*>(smem4) + int64_t(warp) * (2 * E + G);
  A* sel = s + E;
  A* gsc = sel + E;
  unsigned char* out = reinterpret_cast<unsigned char*>(reinterpret_cast<A*>(smem4) +
                                                        int64_t(kWarps) * (2 * E + G)) +
                       int64_t(warp) * (E + G);  // 1: not a candidate (excluded or taken)
  unsigned char* gout = out + E;                 // 1: group not kept (yet)
  const int64_t t = int64_t(blockIdx.x) * kWarps + warp;
  if (t >= d.T) return;
  const A* l = logits + t * E;
  for (int64_t e = lane; e < E; e += 32) {
    const A v = router_sigmoid(l[e]);
    s[e] = v;
    scores[t * E + e] = v;
    sel[e] = v + (bias ? bias[e] : A(0));
    out[e] = 0;
  }
  __syncwarp();
  int64_t* it = idx + t * K;
  if (replay == nullptr) {
    if (G > 1) {
      const int64_t gs = E / G;
      for (int64_t g = lane; g < G; g += 32) {
        // top-2 of the group, as the CPU: the best, then the best of the others
        int64_t b1 = g * gs;
        for (int64_t e = g * gs + 1; e < (g + 1) * gs; ++e)
          if (better(sel[e], int(e), sel[b1], int(b1))) b1 = e;
        int64_t b2 = -1;
        for (int64_t e = g * gs; e < (g + 1) * gs; ++e)
          if (e != b1 && (b2 < 0 || better(sel[e], int(e), sel[b2], int(b2)))) b2 = e;
        gsc[g] = sel[b1] + sel[b2];
        gout[g] = 1;
      }
      for (int64_t q = 0; q < d.topk_group; ++q) {
        A bv = 0;
        int bi = -1;
        for (int64_t g = lane; g < G; g += 32)
          if (gout[g] && (bi < 0 || better(gsc[g], int(g), bv, bi))) bv = gsc[g], bi = int(g);
        warp_best(bv, bi);
        if ((bi & 31) == lane) gout[bi] = 0;  // group bi belongs to lane bi % 32
      }
      __syncwarp();
      for (int64_t e = lane; e < E; e += 32) out[e] = gout[e / gs];
    }
    for (int64_t k = 0; k < K; ++k) {
      A bv = 0;
      int bi = -1;
      for (int64_t e = lane; e < E; e += 32)
        if (!out[e] && (bi < 0 || better(sel[e], int(e), bv, bi))) bv = sel[e], bi = int(e);
      warp_best(bv, bi);
      if ((bi & 31) == lane) out[bi] = 1;
      if (lane == 0) it[k] = bi;
    }
  } else if (lane == 0) {
    for (int64_t k = 0; k < K; ++k) it[k] = idx_at(replay, replay32, t * K + k);
  }
  if (lane == 0) {
    A sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += s[it[k]];
    const A denom = d.norm ? sum + eps : A(1);
    for (int64_t k = 0; k < K; ++k) wout[t * K + k] = s[it[k]] / denom * scale;
  }
}

template <class A>
__global__ void __launch_bounds__(kWarps * 32)
    router_bwd_kernel(const A* __restrict__ logits, const void* __restrict__ idx, bool i32,
                      const A* __restrict__ dw, A* __restrict__ dl, int64_t T, int64_t E, int64_t K,
                      bool norm, A eps, A scale) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * kWarps + warp;
  if (t >= T) return;
  A* d = dl + t * E;
  const A* l = logits + t * E;
  for (int64_t e = lane; e < E; e += 32) d[e] = A(0);
  __syncwarp();
  if (lane != 0) return;
  A sum = 0, gs = 0;
  for (int64_t k = 0; k < K; ++k) {
    const A sk = router_sigmoid(l[idx_at(idx, i32, t * K + k)]);
    sum += sk;
    gs += scale * dw[t * K + k] * sk;
  }
  const A denom = sum + eps;
  for (int64_t k = 0; k < K; ++k) {
    const int64_t e = idx_at(idx, i32, t * K + k);
    const A x = l[e];
    const A g = scale * dw[t * K + k];
    const A ds = norm ? g / denom - gs / (denom * denom) : g;
    d[e] += ds * router_sigmoid(x) * router_sigmoid(-x);
  }
}

// b_i += rate * sign(mean(load) - load_i); the mean summed in FP64 in index order (as the CPU).
template <class TB, class TL>
__global__ void __launch_bounds__(kEw)
    bias_update_kernel(TB* __restrict__ bias, const TL* __restrict__ load, int64_t E, double rate) {
  __shared__ double mean;
  if (threadIdx.x == 0) {
    double m = 0;
    for (int64_t e = 0; e < E; ++e) m += double(load[e]);
    mean = m / double(E);
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < E; e += kEw) {
    const double diff = mean - double(load[e]);
    const double sg = diff > 0 ? 1.0 : (diff < 0 ? -1.0 : 0.0);
    bias[e] = TB(double(bias[e]) + rate * sg);
  }
}

// ---- sequence-wise aux loss ---------------------------------------------------------------------
template <class A>
__device__ __forceinline__ A tiny() {
  return std::numeric_limits<A>::min();
}

// q[t, e] = s_e / sum_j s_j for one token per warp; when the sum underflows, the scores rescaled
// as the CPU's aux_scores does (s_e = exp(u_e - max u), u = log sigmoid(l)).
template <class A>
__global__ void __launch_bounds__(kWarps * 32)
    aux_ratio_kernel(const A* __restrict__ logits, A* __restrict__ q, int64_t T, int64_t E) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * kWarps + warp;
  if (t >= T) return;
  const A* l = logits + t * E;
  A* qt = q + t * E;
  A part = 0;
  for (int64_t e = lane; e < E; e += 32) {
    const A v = dsigmoid(l[e]);
    qt[e] = v;
    part += v;
  }
  A S = warp_sum(part);
  if (!(S >= tiny<A>()) && S == S) {
    A m = -std::numeric_limits<A>::infinity();
    for (int64_t e = lane; e < E; e += 32) {
      const A x = l[e];
      const A u = (x < A(0) ? x : A(0)) - dlog1p(dexp(-fabs(x)));
      qt[e] = u;
      m = u > m ? u : m;
    }
    m = warp_max(m);
    const bool flat = m == -std::numeric_limits<A>::infinity();
    part = 0;
    for (int64_t e = lane; e < E; e += 32) {
      const A v = flat ? A(1) : dexp(qt[e] - m);
      qt[e] = v;
      part += v;
    }
    S = warp_sum(part);
  }
  for (int64_t e = lane; e < E; e += 32) qt[e] = qt[e] / S;
}

// One thread per (segment, expert): the sum of q and the hit count over the segment's tokens.
template <class A>
__global__ void __launch_bounds__(128)
    aux_partial_kernel(const A* __restrict__ q, const void* __restrict__ idx, bool i32,
                       const int64_t* __restrict__ seg, A* __restrict__ ppart,
                       int64_t* __restrict__ cpart, int64_t E, int64_t K) {
  const int64_t sg = blockIdx.x, e = int64_t(blockIdx.y) * 128 + threadIdx.x;
  if (e >= E) return;
  const int64_t t0 = seg[2 * sg], t1 = seg[2 * sg + 1];
  A p = 0;
  int64_t c = 0;
  for (int64_t t = t0; t < t1; ++t) {
    p += q[t * E + e];
    for (int64_t k = 0; k < K; ++k) c += idx_at(idx, i32, t * K + k) == e ? 1 : 0;
  }
  ppart[sg * E + e] = p;
  cpart[sg * E + e] = c;
}

// One block per sequence: f_e = E / (K T_s) count_e, P_e = sum s' / T_s (segments in order), and
// L_s = sum_e f_e P_e.
template <class A>
__global__ void __launch_bounds__(128)
    aux_seq_kernel(const A* __restrict__ ppart, const int64_t* __restrict__ cpart,
                   const int64_t* __restrict__ seq_seg, const int64_t* __restrict__ cu,
                   const int64_t* __restrict__ wlen, const int64_t* __restrict__ wcount,
                   A* __restrict__ f, A* __restrict__ lseq, int64_t E, int64_t K) {
  __shared__ A red[4];
  const int64_t s = blockIdx.x;
  if (cu[s + 1] == cu[s]) {
    if (threadIdx.x == 0) lseq[s] = A(0);
    return;
  }
  // T_s and the counts: the whole sequence's (wlen / wcount, context parallel), else this one's.
  const int64_t Ts = wlen ? wlen[s] : cu[s + 1] - cu[s];
  const A fscale = A(E) / (A(K) * A(Ts));
  A part = 0;
  for (int64_t e = threadIdx.x; e < E; e += 128) {
    A p = 0;
    int64_t c = 0;
    for (int64_t g = seq_seg[s]; g < seq_seg[s + 1]; ++g) {
      p += ppart[g * E + e];
      c += cpart[g * E + e];
    }
    if (wcount) c = wcount[s * E + e];
    const A fe = A(c) * fscale;
    f[s * E + e] = fe;
    part += fe * (p / A(Ts));
  }
  part = warp_sum(part);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = part;
  __syncthreads();
  if (threadIdx.x == 0) lseq[s] = ((red[0] + red[1]) + red[2]) + red[3];
}

// dl[t, e] = dloss coeff / (N T_s) (f_e - sum_j f_j s'_j) s'_e sigmoid(-l_e), one warp per token.
template <class A>
__global__ void __launch_bounds__(kWarps * 32)
    aux_bwd_kernel(const A* __restrict__ logits, const A* __restrict__ q, const A* __restrict__ f,
                   const int64_t* __restrict__ cu, const int64_t* __restrict__ wlen, int64_t nseq,
                   A* __restrict__ dl, int64_t T, int64_t E, A coeff_dloss, A n_seq) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * kWarps + warp;
  if (t >= T) return;
  const int64_t s = last_le(cu, nseq + 1, t);
  const A Ts = A(wlen ? wlen[s] : cu[s + 1] - cu[s]);
  const A base = coeff_dloss / (n_seq * Ts);
  const A* fs_ = f + s * E;
  const A* qt = q + t * E;
  A part = 0;
  for (int64_t e = lane; e < E; e += 32) part += fs_[e] * qt[e];
  const A fs = warp_sum(part);
  for (int64_t e = lane; e < E; e += 32)
    dl[t * E + e] = base * (fs_[e] - fs) * qt[e] * dsigmoid(-logits[t * E + e]);
}

// ---- clamped SwiGLU -----------------------------------------------------------------------------
template <class T, class TO>
__global__ void __launch_bounds__(kEw)
    swiglu_fwd_kernel(const T* __restrict__ gu, TO* __restrict__ h, int64_t rows, int64_t I,
                      bool clamp, acc_t<T> lim) {
  using A = acc_t<T>;
  const int64_t n = rows * I;
  for (int64_t i = int64_t(blockIdx.x) * kEw + threadIdx.x; i < n; i += int64_t(gridDim.x) * kEw) {
    const int64_t r = i / I, c = i % I;
    A g = ld<A>(gu, r * 2 * I + c), u = ld<A>(gu, r * 2 * I + I + c);
    if (clamp) {
      g = lim < g ? lim : g;                      // std::min(g, lim)
      u = u < -lim ? -lim : (lim < u ? lim : u);  // std::clamp(u, -lim, lim)
    }
    st(h, i, g * dsigmoid(g) * u);
  }
}

template <class T>
__global__ void __launch_bounds__(kEw)
    swiglu_bwd_kernel(const T* __restrict__ gu, const T* __restrict__ dh, T* __restrict__ dgu,
                      int64_t rows, int64_t I, bool clamp, acc_t<T> lim) {
  using A = acc_t<T>;
  const int64_t n = rows * I;
  for (int64_t i = int64_t(blockIdx.x) * kEw + threadIdx.x; i < n; i += int64_t(gridDim.x) * kEw) {
    const int64_t r = i / I, c = i % I;
    const A g0 = ld<A>(gu, r * 2 * I + c), u0 = ld<A>(gu, r * 2 * I + I + c);
    const bool gpass = !clamp || g0 <= lim, upass = !clamp || (u0 >= -lim && u0 <= lim);
    const A g = clamp ? (lim < g0 ? lim : g0) : g0;
    const A u = clamp ? (u0 < -lim ? -lim : (lim < u0 ? lim : u0)) : u0;
    const A s = dsigmoid(g);
    const A d = ld<A>(dh, i);
    st(dgu, r * 2 * I + c, gpass ? d * u * s * (A(1) + g * (A(1) - s)) : A(0));
    st(dgu, r * 2 * I + I + c, upass ? d * g * s : A(0));
  }
}

// ---- combine ------------------------------------------------------------------------------------
template <class T, class TW>
__global__ void __launch_bounds__(kEw)
    combine_kernel(const T* __restrict__ src, const int64_t* __restrict__ map,
                   const TW* __restrict__ w, const T* __restrict__ shared, T* __restrict__ out,
                   int64_t Tn, int64_t K, int64_t D) {
  using A = acc_t<T>;
  const int64_t n = Tn * D;
  for (int64_t i = int64_t(blockIdx.x) * kEw + threadIdx.x; i < n; i += int64_t(gridDim.x) * kEw) {
    const int64_t t = i / D, c = i % D;
    A acc = 0;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t a = t * K + k, row = map ? map[a] : a;
      const A v = ld<A>(src, row * D + c);
      acc += w ? ld<A>(w, a) * v : v;
    }
    if (shared) acc += ld<A>(shared, i);
    st(out, i, acc);
  }
}

template <class T, class TW>
__global__ void __launch_bounds__(kWarps * 32)
    combine_bwd_kernel(const T* __restrict__ dout, const T* __restrict__ eo,
                       const TW* __restrict__ w, TW* __restrict__ dw, T* __restrict__ deo,
                       int64_t Tn, int64_t K, int64_t D) {
  using A = acc_t<T>;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t a = int64_t(blockIdx.x) * kWarps + warp;
  if (a >= Tn * K) return;
  const int64_t t = a / K;
  const A wa = ld<A>(w, a);
  A acc = 0;
  for (int64_t c = lane; c < D; c += 32) {
    const A g = ld<A>(dout, t * D + c);
    acc += g * ld<A>(eo, a * D + c);
    st(deo, a * D + c, wa * g);
  }
  acc = warp_sum(acc);
  if (lane == 0) st(dw, a, acc);
}

unsigned ew_blocks(int64_t n) {
  return unsigned(std::min<int64_t>((n + kEw - 1) / kEw, int64_t(1) << 20));
}

template <class F>
void dispatch_real(DType dt, F&& f) {
  if (dt == DType::f64)
    f(double{});
  else
    f(float{});
}

}  // namespace

// ---- router -------------------------------------------------------------------------------------
void moe_router_forward(const Tensor& logits, const Tensor& bias, const MoeRouterConfig& cfg,
                        const Tensor& replay, MoeRouterResult& r) {
  const int64_t T = logits.size(0);
  if (T == 0) return;
  const RouterDims d{T, cfg.n_experts, cfg.top_k, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob};
  dispatch_real(logits.dtype(), [&](auto tag) {
    using A = decltype(tag);
    const size_t smem = router_smem<A>(d.E, d.G);
    HLM_CHECK(smem <= size_t(smem_optin()),
              "moe_router_forward: {} experts need {} bytes of shared memory per block on CUDA, "
              "more than the device's {}",
              d.E, smem, smem_optin());
    if (smem > 48 * 1024)
      set_smem(reinterpret_cast<const void*>(&router_fwd_kernel<A>), smem, "moe_router_forward");
    router_fwd_kernel<A><<<blocks_for(T, kWarps), kWarps * 32, smem>>>(
        cptr<A>(logits), cptr<A>(bias), replay.defined() ? replay.raw() : nullptr,
        replay.defined() && replay.dtype() == DType::i32, mptr<A>(r.scores),
        mptr<int64_t>(r.topk_idx), mptr<A>(r.topk_weight), d, A(cfg.norm_eps),
        A(cfg.routed_scaling_factor));
    check_launch("moe_router_forward");
  });
}

void moe_router_backward(const Tensor& logits, const Tensor& idx, const MoeRouterConfig& cfg,
                         const Tensor& dweight, Tensor& dlogits) {
  const int64_t T = logits.size(0);
  if (T == 0) return;
  dispatch_real(logits.dtype(), [&](auto tag) {
    using A = decltype(tag);
    router_bwd_kernel<A><<<blocks_for(T, kWarps), kWarps * 32>>>(
        cptr<A>(logits), idx.raw(), idx.dtype() == DType::i32, cptr<A>(dweight), mptr<A>(dlogits),
        T, cfg.n_experts, cfg.top_k, cfg.norm_topk_prob, A(cfg.norm_eps),
        A(cfg.routed_scaling_factor));
    check_launch("moe_router_backward");
  });
}

void moe_bias_update(Tensor& bias, const Tensor& load, double rate) {
  const int64_t E = bias.numel();
  if (E == 0) return;
  dispatch_real(bias.dtype(), [&](auto tb) {
    using TB = decltype(tb);
    const double r = std::is_same_v<TB, float> ? double(float(rate)) : rate;
    auto go = [&](auto tl) {
      using TL = decltype(tl);
      bias_update_kernel<TB, TL><<<1, kEw>>>(mptr<TB>(bias), cptr<TL>(load), E, r);
    };
    switch (load.dtype()) {
      case DType::i64:
        go(int64_t{});
        break;
      case DType::i32:
        go(int32_t{});
        break;
      case DType::f64:
        go(double{});
        break;
      case DType::f32:
        go(float{});
        break;
      default:
        HLM_FAIL("moe_bias_update: load dtype {} not supported on CUDA", dtype_name(load.dtype()));
    }
    check_launch("moe_bias_update");
  });
}

double moe_seq_aux_loss(const Tensor& logits, const Tensor& idx, const std::vector<int64_t>& cu,
                        double coeff, double dloss, Tensor* dlogits, const MoeAuxWhole* whole) {
  const int64_t T = logits.size(0), E = logits.size(1), K = idx.size(1);
  const int64_t N = int64_t(cu.size()) - 1;
  int64_t n_seq = 0;
  std::vector<int64_t> seg, seq_seg{0};
  for (int64_t s = 0; s < N; ++s) {
    n_seq += cu[size_t(s) + 1] > cu[size_t(s)] ? 1 : 0;
    for (int64_t t0 = cu[size_t(s)]; t0 < cu[size_t(s) + 1]; t0 += kSeg) {
      seg.push_back(t0);
      seg.push_back(std::min(t0 + kSeg, cu[size_t(s) + 1]));
    }
    seq_seg.push_back(int64_t(seg.size()) / 2);
  }
  if (n_seq == 0 || E == 0) {  // no token: nothing to sum, a zero gradient
    if (dlogits && dlogits->numel() > 0) dlogits->zero_();
    return 0.0;
  }
  const int64_t nseg = int64_t(seg.size()) / 2;
  double loss = 0;
  dispatch_real(logits.dtype(), [&](auto tag) {
    using A = decltype(tag);
    const DType dt = dtype_of<A>::value;
    const bool i32 = idx.dtype() == DType::i32;
    Tensor q = alloc({T, E}, dt), ppart = alloc({nseg, E}, dt),
           cpart = alloc({nseg, E}, DType::i64), f = alloc({N, E}, dt), lseq = alloc({N}, dt);
    const Tensor segd = to_device(seg), seq_segd = to_device(seq_seg), cud = to_device(cu);
    const Tensor wlen = whole ? to_device(whole->lengths) : Tensor(),
                 wcount = whole ? to_device(whole->counts) : Tensor();
    const int64_t* wl = whole ? cptr<int64_t>(wlen) : nullptr;
    const int64_t* wc = whole ? cptr<int64_t>(wcount) : nullptr;
    aux_ratio_kernel<A><<<blocks_for(T, kWarps), kWarps * 32>>>(cptr<A>(logits), mptr<A>(q), T, E);
    check_launch("moe_seq_aux_loss");
    aux_partial_kernel<A><<<dim3(unsigned(nseg), unsigned((E + 127) / 128)), 128>>>(
        cptr<A>(q), idx.raw(), i32, cptr<int64_t>(segd), mptr<A>(ppart), mptr<int64_t>(cpart), E,
        K);
    check_launch("moe_seq_aux_loss");
    aux_seq_kernel<A><<<unsigned(N), 128>>>(cptr<A>(ppart), cptr<int64_t>(cpart),
                                            cptr<int64_t>(seq_segd), cptr<int64_t>(cud), wl, wc,
                                            mptr<A>(f), mptr<A>(lseq), E, K);
    check_launch("moe_seq_aux_loss");
    if (dlogits) {
      aux_bwd_kernel<A><<<blocks_for(T, kWarps), kWarps * 32>>>(
          cptr<A>(logits), cptr<A>(q), cptr<A>(f), cptr<int64_t>(cud), wl, N, mptr<A>(*dlogits), T,
          E, A(dloss) * A(coeff), A(n_seq));
      check_launch("moe_seq_aux_loss_backward");
      return;
    }
    const Tensor lh = lseq.to(Device::cpu);
    const A* l = lh.data<A>();
    A total = 0;
    for (int64_t s = 0; s < N; ++s)
      if (cu[size_t(s) + 1] > cu[size_t(s)]) total += A(coeff) * l[s];
    loss = double(total) / double(n_seq);
  });
  return loss;
}

// ---- SwiGLU -------------------------------------------------------------------------------------
void swiglu_clamped_forward(const Tensor& gu, double limit, Tensor& h) {
  const int64_t I = gu.size(-1) / 2, rows = h.numel() / std::max<int64_t>(I, 1);
  if (h.numel() == 0) return;
  const bool clamp = limit > 0 && std::isfinite(limit);
  dispatch_storage(gu.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const acc_t<T> lim(clamp ? limit : 0.0);
    if constexpr (std::is_same_v<T, float>) {
      if (h.dtype() == DType::bf16) {  // an f32 gu into a bf16 h (ops/moe.h)
        swiglu_fwd_kernel<T, nv_bf16>
            <<<ew_blocks(rows * I), kEw>>>(cptr<T>(gu), mptr<nv_bf16>(h), rows, I, clamp, lim);
        check_launch("swiglu_clamped_forward");
        return;
      }
    }
    swiglu_fwd_kernel<T, T>
        <<<ew_blocks(rows * I), kEw>>>(cptr<T>(gu), mptr<T>(h), rows, I, clamp, lim);
    check_launch("swiglu_clamped_forward");
  });
}

void swiglu_clamped_backward(const Tensor& gu, const Tensor& dh, double limit, Tensor& dgu) {
  const int64_t I = gu.size(-1) / 2, rows = dh.numel() / std::max<int64_t>(I, 1);
  if (dh.numel() == 0) return;
  const bool clamp = limit > 0 && std::isfinite(limit);
  dispatch_storage(gu.dtype(), [&](auto tag) {
    using T = decltype(tag);
    swiglu_bwd_kernel<T><<<ew_blocks(rows * I), kEw>>>(cptr<T>(gu), cptr<T>(dh), mptr<T>(dgu), rows,
                                                       I, clamp, acc_t<T>(clamp ? limit : 0.0));
    check_launch("swiglu_clamped_backward");
  });
}

// ---- combine ------------------------------------------------------------------------------------
namespace {
template <class F>
void dispatch_combine(DType eo, const Tensor& w, F&& f) {
  dispatch_storage(eo, [&](auto te) {
    using T = decltype(te);
    if (w.defined())
      dispatch_param<T>(w.dtype(), [&](auto tw) { f(te, tw); });
    else
      f(te, te);
  });
}
}  // namespace

void moe_combine_rows(const Tensor& src, const Tensor& map, int64_t K, const Tensor& w,
                      const Tensor& shared, Tensor& out) {
  const int64_t Tn = out.size(0), D = out.size(1);
  if (Tn * D == 0) return;
  dispatch_combine(src.dtype(), w, [&](auto te, auto tw) {
    using T = decltype(te);
    using TW = decltype(tw);
    combine_kernel<T, TW><<<ew_blocks(Tn * D), kEw>>>(cptr<T>(src), cptr<int64_t>(map), cptr<TW>(w),
                                                      cptr<T>(shared), mptr<T>(out), Tn, K, D);
    check_launch("moe_combine");
  });
}

void moe_combine(const Tensor& eo, const Tensor& w, const Tensor& shared, Tensor& out) {
  moe_combine_rows(eo, Tensor(), eo.size(1), w, shared, out);
}

void moe_combine_backward(const Tensor& dout, const Tensor& eo, const Tensor& w,
                          MoeCombineGrads& r) {
  const int64_t Tn = eo.size(0), K = eo.size(1), D = eo.size(2);
  if (Tn * K == 0) return;
  dispatch_combine(eo.dtype(), w, [&](auto te, auto tw) {
    using T = decltype(te);
    using TW = decltype(tw);
    combine_bwd_kernel<T, TW><<<blocks_for(Tn * K, kWarps), kWarps * 32>>>(
        cptr<T>(dout), cptr<T>(eo), cptr<TW>(w), mptr<TW>(r.dw), mptr<T>(r.deo), Tn, K, D);
    check_launch("moe_combine_backward");
  });
}

}  // namespace hlm::ops::cuda
