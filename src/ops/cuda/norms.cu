// RMSNorm, gated RMSNorm (ops/rmsnorm.h), L2 norm (ops/l2norm.h) and LayerNorm (ops/layernorm.h)
// on CUDA (ops/cuda/norms.cuh), the math of ops/cpu/rmsnorm.cpp, l2norm.cpp and layernorm.cpp:
//   rmsnorm:  rstd = 1 / sqrt(sum x^2 / D + eps),  y = x rstd w (* sigmoid(g))
//             dn = dy (* s),  dg = dy x rstd w s (1 - s),
//             dx = rstd w dn - rstd^3 / D x sum_j(dn_j w_j x_j),  dw += sum_rows dn x rstd
//   l2norm:   rstd = 1 / sqrt(sum x^2 + eps),  y = x rstd,  dx = rstd (dy - y (y . dy))
//   layernorm: mean = sum x / D,  rstd = 1 / sqrt(sum (x - mean)^2 / D + eps) (two passes),
//             xhat = (x - mean) rstd,  y = xhat w + b;  g = dy w,
//             dx = rstd (g - sum g / D - xhat sum(g xhat) / D),  dw += sum_rows dy xhat,
//             db += sum_rows dy
// Row kernels: one warp per row for D <= 2048 (8 rows per 256-thread block), else one 256-thread
// block per row. Each thread walks its elements in a fixed order, V at a time as one 16-byte
// access when D and every pointer allow it (else V = 1); the row sum is a warp butterfly, then
// (block rows) the 8 warp sums added in warp order. A row's result depends only on that row, D
// and V, never on the launch, so it is bit-identical run to run.
// dw (db): rows are cut into parts of kRowsPerPart; one thread per (part, column) sums its rows in
// order into a workspace [parts, D], then one thread per column adds the parts in order to dw.
// LayerNorm uses the same row geometry with one more row sum (mean, then the centred variance;
// the backward's two dot products share one pass and are summed as a pair).
// Faster: keep the row in registers between the passes (D is read 2-3 times, L2-resident for
// warp rows), and fuse the dw / db partials into the dx kernel with a per-block row slice.
#include <initializer_list>

#include "ops/cuda/layer_ops_common.cuh"
#include "ops/cuda/norms.cuh"

namespace hlm::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kRowsPerPart = 64;
constexpr int64_t kWarpRowMaxD = 2048;

enum class Norm { rms, gated, l2 };

// Sum over the threads of one row (WPR warps); red: 8 slots of shared memory per block.
template <int WPR, class A>
__device__ __forceinline__ A row_sum(A v, A* red) {
  v = warp_sum(v);
  if constexpr (WPR == 1) {
    return v;
  } else {
    const int warp = threadIdx.x >> 5;
    __syncthreads();  // red may still be read from a previous sum
    if ((threadIdx.x & 31) == 0) red[warp] = v;
    __syncthreads();
    A s = red[0];
#pragma unroll
    for (int k = 1; k < WPR; ++k) s += red[k];
    return s;
  }
}

struct RowGeom {
  int64_t row;  // this thread's row (may be >= rows: the thread idles but joins block syncs)
  int tr;       // thread index within the row
};
template <int WPR>
__device__ __forceinline__ RowGeom row_geom() {
  constexpr int kRowsPerBlock = kThreads / (32 * WPR);
  return {int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / (32 * WPR),
          int(threadIdx.x % (32 * WPR))};
}

template <Norm NK, int WPR, int V, class T, class TW>
__global__ void __launch_bounds__(kThreads)
    norm_fwd_kernel(const T* __restrict__ x, const T* __restrict__ g, const TW* __restrict__ w,
                    T* __restrict__ y, acc_t<T>* __restrict__ rstd, int64_t rows, int64_t D,
                    acc_t<T> eps) {
  using A = acc_t<T>;
  constexpr int NT = 32 * WPR;
  __shared__ A red[8];
  const RowGeom rg = row_geom<WPR>();
  const bool live = rg.row < rows;
  const int64_t base = rg.row * D;
  A ss = 0;
  if (live)
    for (int64_t i = int64_t(rg.tr) * V; i < D; i += int64_t(NT) * V) {
      A v[V];
      ldv<V>(x, base + i, v);
#pragma unroll
      for (int k = 0; k < V; ++k) ss = dfma(v[k], v[k], ss);
    }
  ss = row_sum<WPR>(ss, red);
  if (!live) return;
  const A rs = NK == Norm::l2 ? A(1) / dsqrt(ss + eps) : A(1) / dsqrt(ss / A(D) + eps);
  if (rg.tr == 0) rstd[rg.row] = rs;
  for (int64_t i = int64_t(rg.tr) * V; i < D; i += int64_t(NT) * V) {
    A v[V], o[V];
    ldv<V>(x, base + i, v);
    if constexpr (NK == Norm::l2) {
#pragma unroll
      for (int k = 0; k < V; ++k) o[k] = v[k] * rs;
    } else {
      A wv[V];
      ldv<V>(w, i, wv);
#pragma unroll
      for (int k = 0; k < V; ++k) o[k] = v[k] * rs * wv[k];
      if constexpr (NK == Norm::gated) {
        A gv[V];
        ldv<V>(g, base + i, gv);
#pragma unroll
        for (int k = 0; k < V; ++k) o[k] *= dsigmoid(gv[k]);
      }
    }
    stv<V>(y, base + i, o);
  }
}

template <Norm NK, int WPR, int V, class T, class TW>
__global__ void __launch_bounds__(kThreads)
    norm_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ g,
                    const TW* __restrict__ w, const acc_t<T>* __restrict__ rstd, T* __restrict__ dx,
                    T* __restrict__ dg, int64_t rows, int64_t D) {
  using A = acc_t<T>;
  constexpr int NT = 32 * WPR;
  __shared__ A red[8];
  const RowGeom rg = row_geom<WPR>();
  const bool live = rg.row < rows;
  const int64_t base = rg.row * D;
  const A rs = live ? rstd[rg.row] : A(0);
  // dot = sum dn w x (rms) or sum x rstd dy (l2); dgate on the way.
  A dot = 0;
  if (live)
    for (int64_t i = int64_t(rg.tr) * V; i < D; i += int64_t(NT) * V) {
      A xv[V], dv[V];
      ldv<V>(x, base + i, xv);
      ldv<V>(dy, base + i, dv);
      if constexpr (NK == Norm::l2) {
#pragma unroll
        for (int k = 0; k < V; ++k) dot = dfma(xv[k] * rs, dv[k], dot);
      } else {
        A wv[V];
        ldv<V>(w, i, wv);
        if constexpr (NK == Norm::gated) {
          A gv[V], dgv[V];
          ldv<V>(g, base + i, gv);
#pragma unroll
          for (int k = 0; k < V; ++k) {
            const A s = dsigmoid(gv[k]);
            dgv[k] = dv[k] * xv[k] * rs * wv[k] * s * (A(1) - s);
            dv[k] *= s;
          }
          stv<V>(dg, base + i, dgv);
        }
#pragma unroll
        for (int k = 0; k < V; ++k) dot = dfma(dv[k] * wv[k], xv[k], dot);
      }
    }
  dot = row_sum<WPR>(dot, red);
  if (!live) return;
  const A c = NK == Norm::l2 ? rs * dot : rs * rs * rs / A(D) * dot;
  for (int64_t i = int64_t(rg.tr) * V; i < D; i += int64_t(NT) * V) {
    A xv[V], dv[V], o[V];
    ldv<V>(x, base + i, xv);
    ldv<V>(dy, base + i, dv);
    if constexpr (NK == Norm::l2) {
#pragma unroll
      for (int k = 0; k < V; ++k) o[k] = rs * (dv[k] - xv[k] * c);
    } else {
      A wv[V];
      ldv<V>(w, i, wv);
      if constexpr (NK == Norm::gated) {
        A gv[V];
        ldv<V>(g, base + i, gv);
#pragma unroll
        for (int k = 0; k < V; ++k) dv[k] *= dsigmoid(gv[k]);
      }
#pragma unroll
      for (int k = 0; k < V; ++k) o[k] = rs * wv[k] * dv[k] - c * xv[k];
    }
    stv<V>(dx, base + i, o);
  }
}

// part[p, i] = sum over rows r of part p (in order) of dn[r, i] x[r, i] rstd[r].
template <class T>
__global__ void norm_dw_partial_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                       const T* __restrict__ g, const acc_t<T>* __restrict__ rstd,
                                       acc_t<T>* __restrict__ part, int64_t rows, int64_t D) {
  using A = acc_t<T>;
  const int64_t i = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (i >= D) return;
  const int64_t p = blockIdx.x, r0 = p * kRowsPerPart;
  const int64_t r1 = r0 + kRowsPerPart < rows ? r0 + kRowsPerPart : rows;
  A acc = 0;
  for (int64_t r = r0; r < r1; ++r) {
    A dn = ld<A>(dy, r * D + i);
    if (g) dn *= dsigmoid(ld<A>(g, r * D + i));
    acc = dfma(dn * ld<A>(x, r * D + i), rstd[r], acc);
  }
  part[p * D + i] = acc;
}

// LayerNorm forward: mean, centred variance, y = xhat w + b.
template <int WPR, int V, class T, class TW>
__global__ void __launch_bounds__(kThreads)
    ln_fwd_kernel(const T* __restrict__ x, const TW* __restrict__ w, const TW* __restrict__ b,
                  T* __restrict__ y, acc_t<T>* __restrict__ mean, acc_t<T>* __restrict__ rstd,
                  int64_t rows, int64_t D, acc_t<T> eps) {
  using A = acc_t<T>;
  constexpr int NT = 32 * WPR;
  __shared__ A red[8];
  const RowGeom rg = row_geom<WPR>();
  const bool live = rg.row < rows;
  const int64_t base = rg.row * D;
  A s = 0;
  if (live)
    for (int64_t i = int64_t(rg.tr) * V; i < D; i += int64_t(NT) * V) {
      A v[V];
      ldv<V>(x, base + i, v);
#pragma unroll
      for (int k = 0; k < V; ++k) s += v[k];
    }
  s = row_sum<WPR>(s, red);
  const A m = D > 0 ? s / A(D) : A(0);
  A ss = 0;
  if (live)
    for (int64_t i = int64_t(rg.tr) * V; i < D; i += int64_t(NT) * V) {
      A v[V];
      ldv<V>(x, base + i, v);
#pragma unroll
      for (int k = 0; k < V; ++k) ss = dfma(v[k] - m, v[k] - m, ss);
    }
  ss = row_sum<WPR>(ss, red);
  if (!live) return;
  const A rs = A(1) / dsqrt((D > 0 ? ss / A(D) : A(0)) + eps);
  if (rg.tr == 0) {
    mean[rg.row] = m;
    rstd[rg.row] = rs;
  }
  for (int64_t i = int64_t(rg.tr) * V; i < D; i += int64_t(NT) * V) {
    A v[V], wv[V], bv[V], o[V];
    ldv<V>(x, base + i, v);
    ldv<V>(w, i, wv);
    ldv<V>(b, i, bv);
#pragma unroll
    for (int k = 0; k < V; ++k) o[k] = dfma((v[k] - m) * rs, wv[k], bv[k]);
    stv<V>(y, base + i, o);
  }
}

// LayerNorm backward, dx only: sum g and sum g xhat (g = dy w) in one pass, then dx.
template <int WPR, int V, class T, class TW>
__global__ void __launch_bounds__(kThreads)
    ln_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, const TW* __restrict__ w,
                  const acc_t<T>* __restrict__ mean, const acc_t<T>* __restrict__ rstd,
                  T* __restrict__ dx, int64_t rows, int64_t D) {
  using A = acc_t<T>;
  constexpr int NT = 32 * WPR;
  __shared__ A red[8];
  const RowGeom rg = row_geom<WPR>();
  const bool live = rg.row < rows;
  const int64_t base = rg.row * D;
  const A m = live ? mean[rg.row] : A(0), rs = live ? rstd[rg.row] : A(0);
  A sg = 0, sgx = 0;
  if (live)
    for (int64_t i = int64_t(rg.tr) * V; i < D; i += int64_t(NT) * V) {
      A xv[V], dv[V], wv[V];
      ldv<V>(x, base + i, xv);
      ldv<V>(dy, base + i, dv);
      ldv<V>(w, i, wv);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const A g = dv[k] * wv[k];
        sg += g;
        sgx = dfma(g, (xv[k] - m) * rs, sgx);
      }
    }
  sg = row_sum<WPR>(sg, red);
  sgx = row_sum<WPR>(sgx, red);
  if (!live) return;
  const A mg = sg / A(D), mgx = sgx / A(D);
  for (int64_t i = int64_t(rg.tr) * V; i < D; i += int64_t(NT) * V) {
    A xv[V], dv[V], wv[V], o[V];
    ldv<V>(x, base + i, xv);
    ldv<V>(dy, base + i, dv);
    ldv<V>(w, i, wv);
#pragma unroll
    for (int k = 0; k < V; ++k) o[k] = rs * (dv[k] * wv[k] - mg - (xv[k] - m) * rs * mgx);
    stv<V>(dx, base + i, o);
  }
}

// pw[p, i] = sum over rows r of part p (in order) of dy[r, i] xhat[r, i]; pb[p, i] of dy[r, i].
template <class T>
__global__ void ln_dwb_partial_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                      const acc_t<T>* __restrict__ mean,
                                      const acc_t<T>* __restrict__ rstd, acc_t<T>* __restrict__ pw,
                                      acc_t<T>* __restrict__ pb, int64_t rows, int64_t D) {
  using A = acc_t<T>;
  const int64_t i = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (i >= D) return;
  const int64_t p = blockIdx.x, r0 = p * kRowsPerPart;
  const int64_t r1 = r0 + kRowsPerPart < rows ? r0 + kRowsPerPart : rows;
  A aw = 0, ab = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const A g = ld<A>(dy, r * D + i);
    aw = dfma(g, (ld<A>(x, r * D + i) - mean[r]) * rstd[r], aw);
    ab += g;
  }
  pw[p * D + i] = aw;
  pb[p * D + i] = ab;
}

template <class A, class TDW>
__global__ void norm_dw_reduce_kernel(const A* __restrict__ part, TDW* __restrict__ dw,
                                      int64_t parts, int64_t D) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= D) return;
  A s = 0;
  for (int64_t p = 0; p < parts; ++p) s += part[p * D + i];
  st(dw, i, ld<A>(dw, i) + s);
}

bool aligned(const void* p, size_t bytes) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Calls f(wpr, v) with the row geometry and vector width for D and the pointers.
template <class T, class F>
void dispatch_geom(int64_t D, std::initializer_list<const void*> ptrs, F&& f) {
  constexpr int VV = int(16 / sizeof(T));
  bool vec = D % VV == 0;
  for (const void* p : ptrs) vec = vec && aligned(p, 16);
  auto go = [&](auto wpr) {
    if (vec) {
      f(wpr, std::integral_constant<int, VV>{});
    } else {
      f(wpr, std::integral_constant<int, 1>{});
    }
  };
  if (D <= kWarpRowMaxD) {
    go(std::integral_constant<int, 1>{});
  } else {
    go(std::integral_constant<int, 8>{});
  }
}

template <Norm NK>
void forward_impl(const Tensor& x, const Tensor* gate, const Tensor* w, double eps, Tensor& y,
                  Tensor& rstd) {
  const int64_t D = x.size(-1), rows = rstd.numel();
  if (rows == 0) return;
  dispatch_storage(x.dtype(), [&](auto tx) {
    using T = decltype(tx);
    using A = acc_t<T>;
    dispatch_param<T>(w ? w->dtype() : x.dtype(), [&](auto tw) {
      using TW = decltype(tw);
      const T* pg = gate ? cptr<T>(*gate) : nullptr;
      const TW* pw = w ? cptr<TW>(*w) : nullptr;
      dispatch_geom<T>(D, {x.raw(), pg, y.raw()}, [&](auto wpr, auto vc) {
        constexpr int WPR = decltype(wpr)::value;
        constexpr int V = decltype(vc)::value;
        constexpr int rpb = kThreads / (32 * WPR);
        // w (f32 next to bf16 x: 32 bytes per V) is read V at a time too.
        if (V > 1 && !aligned(pw, V * sizeof(TW))) {
          norm_fwd_kernel<NK, WPR, 1, T, TW><<<blocks_for(rows, rpb), kThreads>>>(
              cptr<T>(x), pg, pw, mptr<T>(y), mptr<A>(rstd), rows, D, A(eps));
        } else {
          norm_fwd_kernel<NK, WPR, V, T, TW><<<blocks_for(rows, rpb), kThreads>>>(
              cptr<T>(x), pg, pw, mptr<T>(y), mptr<A>(rstd), rows, D, A(eps));
        }
        check_launch("norm forward");
      });
    });
  });
}

template <Norm NK>
void backward_impl(const Tensor& dy, const Tensor& x, const Tensor* gate, const Tensor* w,
                   const Tensor& rstd, Tensor& dx, Tensor* dgate, Tensor* dw) {
  const int64_t D = x.size(-1), rows = rstd.numel();
  if (rows == 0 || D == 0) return;
  dispatch_storage(x.dtype(), [&](auto tx) {
    using T = decltype(tx);
    using A = acc_t<T>;
    dispatch_param<T>(w ? w->dtype() : x.dtype(), [&](auto tw) {
      using TW = decltype(tw);
      const T* pg = gate ? cptr<T>(*gate) : nullptr;
      T* pdg = dgate ? mptr<T>(*dgate) : nullptr;
      const TW* pw = w ? cptr<TW>(*w) : nullptr;
      dispatch_geom<T>(D, {x.raw(), dy.raw(), pg, pdg, dx.raw()}, [&](auto wpr, auto vc) {
        constexpr int WPR = decltype(wpr)::value;
        constexpr int V = decltype(vc)::value;
        constexpr int rpb = kThreads / (32 * WPR);
        if (V > 1 && !aligned(pw, V * sizeof(TW))) {
          norm_bwd_kernel<NK, WPR, 1, T, TW><<<blocks_for(rows, rpb), kThreads>>>(
              cptr<T>(dy), cptr<T>(x), pg, pw, cptr<A>(rstd), mptr<T>(dx), pdg, rows, D);
        } else {
          norm_bwd_kernel<NK, WPR, V, T, TW><<<blocks_for(rows, rpb), kThreads>>>(
              cptr<T>(dy), cptr<T>(x), pg, pw, cptr<A>(rstd), mptr<T>(dx), pdg, rows, D);
        }
        check_launch("norm backward");
      });
    });
    if (!dw) return;
    const int64_t parts = (rows + kRowsPerPart - 1) / kRowsPerPart;
    const Tensor part = alloc({parts, D}, std::is_same_v<A, double> ? DType::f64 : DType::f32);
    const dim3 grid(unsigned(parts), blocks_for(D, 128));
    norm_dw_partial_kernel<T><<<grid, 128>>>(cptr<T>(dy), cptr<T>(x),
                                             gate ? cptr<T>(*gate) : nullptr, cptr<A>(rstd),
                                             mptr<A>(part), rows, D);
    check_launch("norm dw partials");
    dispatch_param<T>(dw->dtype(), [&](auto tdw) {
      using TDW = decltype(tdw);
      norm_dw_reduce_kernel<A, TDW>
          <<<blocks_for(D, kThreads), kThreads>>>(cptr<A>(part), mptr<TDW>(*dw), parts, D);
      check_launch("norm dw");
    });
  });
}

}  // namespace

void rmsnorm_forward(const Tensor& x, const Tensor* gate, const Tensor& w, double eps, Tensor& y,
                     Tensor& rstd) {
  if (gate) {
    forward_impl<Norm::gated>(x, gate, &w, eps, y, rstd);
  } else {
    forward_impl<Norm::rms>(x, nullptr, &w, eps, y, rstd);
  }
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor* gate, const Tensor& w,
                      const Tensor& rstd, Tensor& dx, Tensor* dgate, Tensor& dw) {
  if (gate) {
    backward_impl<Norm::gated>(dy, x, gate, &w, rstd, dx, dgate, &dw);
  } else {
    backward_impl<Norm::rms>(dy, x, nullptr, &w, rstd, dx, nullptr, &dw);
  }
}

void l2norm_forward(const Tensor& x, double eps, Tensor& y, Tensor& rstd) {
  forward_impl<Norm::l2>(x, nullptr, nullptr, eps, y, rstd);
}

void l2norm_backward(const Tensor& dy, const Tensor& x, const Tensor& rstd, Tensor& dx) {
  backward_impl<Norm::l2>(dy, x, nullptr, nullptr, rstd, dx, nullptr, nullptr);
}

void layernorm_forward(const Tensor& x, const Tensor& w, const Tensor& b, double eps,
                       LayerNormResult& out) {
  const int64_t D = x.size(-1), rows = out.rstd.numel();
  if (rows == 0) return;
  dispatch_storage(x.dtype(), [&](auto tx) {
    using T = decltype(tx);
    using A = acc_t<T>;
    dispatch_param<T>(w.dtype(), [&](auto tw) {
      using TW = decltype(tw);
      const TW *pw = cptr<TW>(w), *pb = cptr<TW>(b);
      dispatch_geom<T>(D, {x.raw(), out.y.raw()}, [&](auto wpr, auto vc) {
        constexpr int WPR = decltype(wpr)::value;
        constexpr int V = decltype(vc)::value;
        constexpr int rpb = kThreads / (32 * WPR);
        const bool wvec = aligned(pw, V * sizeof(TW)) && aligned(pb, V * sizeof(TW));
        if (V > 1 && !wvec) {
          ln_fwd_kernel<WPR, 1, T, TW><<<blocks_for(rows, rpb), kThreads>>>(
              cptr<T>(x), pw, pb, mptr<T>(out.y), mptr<A>(out.mean), mptr<A>(out.rstd), rows, D,
              A(eps));
        } else {
          ln_fwd_kernel<WPR, V, T, TW><<<blocks_for(rows, rpb), kThreads>>>(
              cptr<T>(x), pw, pb, mptr<T>(out.y), mptr<A>(out.mean), mptr<A>(out.rstd), rows, D,
              A(eps));
        }
        check_launch("layernorm forward");
      });
    });
  });
}

void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& mean,
                        const Tensor& rstd, Tensor& dx, Tensor& dw, Tensor& db) {
  const int64_t D = x.size(-1), rows = rstd.numel();
  if (rows == 0 || D == 0) return;
  dispatch_storage(x.dtype(), [&](auto tx) {
    using T = decltype(tx);
    using A = acc_t<T>;
    dispatch_param<T>(w.dtype(), [&](auto tw) {
      using TW = decltype(tw);
      const TW* pw = cptr<TW>(w);
      dispatch_geom<T>(D, {x.raw(), dy.raw(), dx.raw()}, [&](auto wpr, auto vc) {
        constexpr int WPR = decltype(wpr)::value;
        constexpr int V = decltype(vc)::value;
        constexpr int rpb = kThreads / (32 * WPR);
        if (V > 1 && !aligned(pw, V * sizeof(TW))) {
          ln_bwd_kernel<WPR, 1, T, TW><<<blocks_for(rows, rpb), kThreads>>>(
              cptr<T>(dy), cptr<T>(x), pw, cptr<A>(mean), cptr<A>(rstd), mptr<T>(dx), rows, D);
        } else {
          ln_bwd_kernel<WPR, V, T, TW><<<blocks_for(rows, rpb), kThreads>>>(
              cptr<T>(dy), cptr<T>(x), pw, cptr<A>(mean), cptr<A>(rstd), mptr<T>(dx), rows, D);
        }
        check_launch("layernorm backward");
      });
    });
    const int64_t parts = (rows + kRowsPerPart - 1) / kRowsPerPart;
    const DType adt = std::is_same_v<A, double> ? DType::f64 : DType::f32;
    const Tensor pwk = alloc({parts, D}, adt), pbk = alloc({parts, D}, adt);
    const dim3 grid(unsigned(parts), blocks_for(D, 128));
    ln_dwb_partial_kernel<T><<<grid, 128>>>(cptr<T>(dy), cptr<T>(x), cptr<A>(mean), cptr<A>(rstd),
                                            mptr<A>(pwk), mptr<A>(pbk), rows, D);
    check_launch("layernorm dw/db partials");
    dispatch_param<T>(dw.dtype(), [&](auto tdw) {
      using TDW = decltype(tdw);
      norm_dw_reduce_kernel<A, TDW>
          <<<blocks_for(D, kThreads), kThreads>>>(cptr<A>(pwk), mptr<TDW>(dw), parts, D);
      check_launch("layernorm dw");
    });
    dispatch_param<T>(db.dtype(), [&](auto tdb) {
      using TDB = decltype(tdb);
      norm_dw_reduce_kernel<A, TDB>
          <<<blocks_for(D, kThreads), kThreads>>>(cptr<A>(pbk), mptr<TDB>(db), parts, D);
      check_launch("layernorm db");
    });
  });
}

}  // namespace hlm::ops::cuda
