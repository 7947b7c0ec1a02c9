// Causal depthwise conv1d on the CPU (ops/conv1d.h).
//
// Per sequence [bos, eos) of length L, extend the input to the left with the W-1 state values:
//   xe(p)[c] = x[bos + p][c]            for 0 <= p < L
//            = state[n, p + W - 1][c]   for -(W-1) <= p < 0   (0 without a state)
// Forward:   z_t = sum_j w[c, j] xe(t - W + 1 + j),  y_t = silu(z_t) or z_t
// Backward:  dz_t = dy_t * silu'(z_t) (or dy_t)
//            dxe(p) = sum_j w[c, j] dz_{p + W - 1 - j}   over 0 <= p + W - 1 - j < L
//            dx = dxe(p >= 0), d state[n, i] = dxe(i - (W - 1))
//            dw[c, j] += sum_t dz_t xe(t - W + 1 + j)
#include "ops/conv1d.h"

#include "ops/activations.h"
#include "ops/layer_ops_cuda.h"
#include "ops/op_checks.h"
#include "ops/seqlens.h"

namespace hlm::ops {

namespace {

template <class T>
struct ConvArgs {
  const T* x;      // [T, C]
  const T* w;      // [C, W]
  const T* state;  // [N, W-1, C] or nullptr
  int64_t c, width;
};

// xe(p)[ch] of sequence n starting at bos, for p < L.
template <class T>
inline T xe(const ConvArgs<T>& a, int64_t n, int64_t bos, int64_t p, int64_t ch) {
  if (p >= 0) return a.x[(bos + p) * a.c + ch];
  if (!a.state) return T(0);
  return a.state[(n * (a.width - 1) + p + a.width - 1) * a.c + ch];
}

// z = pre-activation at local position t of sequence n, channel ch (sum over j in order).
template <class T>
inline T conv_at(const ConvArgs<T>& a, int64_t n, int64_t bos, int64_t t, int64_t ch) {
  T z = 0;
  for (int64_t j = 0; j < a.width; ++j)
    z += a.w[ch * a.width + j] * xe(a, n, bos, t - a.width + 1 + j, ch);
  return z;
}

// Sequence id of every token.
std::vector<int64_t> token_seq(const std::vector<int64_t>& cu) {
  std::vector<int64_t> s(size_t(cu.back()));
  for (size_t n = 0; n + 1 < cu.size(); ++n)
    for (int64_t t = cu[n]; t < cu[n + 1]; ++t) s[size_t(t)] = int64_t(n);
  return s;
}

// x f32 / f64 (CUDA: also bf16); w of x's dtype (or f32 next to bf16 x) on x's device.
void check_conv(const char* op, const Tensor& x, const Tensor& w) {
  detail::require_float_dev(x, op, "x");
  HLM_CHECK(x.dim() == 2, "{}: x must be [T, C], got {}", op, x.describe());
  detail::require_float_dev(w, op, "w");
  detail::require_same_device(w, x, op, "w", "x");
  detail::require_param_dtype(w, x, op, "w");
  HLM_CHECK(w.dim() == 2 && w.size(0) == x.size(1) && w.size(1) >= 1,
            "{}: w must be [C, W] with C = {} and W >= 1, got {}", op, x.size(1), w.describe());
}

void check_state(const char* op, const Tensor& s, const Tensor& x, int64_t n, int64_t width,
                 const char* what) {
  detail::require_float_dev(s, op, what);
  detail::require_same_device(s, x, op, what, "x");
  detail::require_same_dtype(s, x, op, what, "x");
  detail::require_shape(s, {n, width - 1, x.size(1)}, op, what);
}

}  // namespace

Tensor causal_conv1d_forward(const Tensor& x_, const Tensor& w_, const Tensor& cu_seqlens,
                             const Tensor& initial_state, bool silu, Tensor* final_state) {
  constexpr const char* op = "causal_conv1d_forward";
  check_conv(op, x_, w_);
  const std::vector<int64_t> cu = check_cu_seqlens(cu_seqlens, x_.size(0));
  const int64_t nseq = int64_t(cu.size()) - 1, c = x_.size(1), width = w_.size(1);
  if (initial_state.defined()) check_state(op, initial_state, x_, nseq, width, "initial_state");
  if (x_.device() == Device::cuda) {
#ifdef HLM_HAVE_CUDA
    Tensor y = cuda::alloc(x_.shape(), x_.dtype());
    if (final_state) *final_state = cuda::alloc({nseq, width - 1, c}, x_.dtype());
    cuda::causal_conv1d_forward(x_, w_, cu, initial_state, silu, y, final_state);
    return y;
#else
    HLM_FAIL("{}: no CUDA support in this build", op);
#endif
  }
  const Tensor x = x_.contiguous(), w = w_.contiguous();
  const Tensor st = initial_state.defined() ? initial_state.contiguous() : Tensor();
  const std::vector<int64_t> seq = token_seq(cu);
  const int64_t nt = x.size(0);
  Tensor y = Tensor::empty({nt, c}, x.dtype());
  if (final_state) *final_state = Tensor::empty({nseq, width - 1, c}, x.dtype());
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const ConvArgs<T> a{x.data<T>(), w.data<T>(), st.defined() ? st.data<T>() : nullptr, c, width};
    T* py = y.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < nt; ++t) {
      const int64_t n = seq[size_t(t)], bos = cu[size_t(n)];
      for (int64_t ch = 0; ch < c; ++ch) {
        const T z = conv_at(a, n, bos, t - bos, ch);
        py[t * c + ch] = silu ? z * sigmoid_scalar(z) : z;
      }
    }
    if (final_state) {
      // final[n, i] = xe(L - (W-1) + i): the last W-1 inputs.
      T* pf = final_state->data<T>();
      for (int64_t n = 0; n < nseq; ++n) {
        const int64_t bos = cu[size_t(n)], len = cu[size_t(n) + 1] - bos;
        for (int64_t i = 0; i < width - 1; ++i)
          for (int64_t ch = 0; ch < c; ++ch)
            pf[(n * (width - 1) + i) * c + ch] = xe(a, n, bos, len - (width - 1) + i, ch);
      }
    }
  });
  return y;
}

CausalConv1dGrads causal_conv1d_backward(const Tensor& dy_, const Tensor& x_, const Tensor& w_,
                                         const Tensor& cu_seqlens, const Tensor& initial_state,
                                         bool silu, Tensor& dw) {
  constexpr const char* op = "causal_conv1d_backward";
  check_conv(op, x_, w_);
  detail::require_float_dev(dy_, op, "dy");
  detail::require_same_device(dy_, x_, op, "dy", "x");
  detail::require_same_dtype(dy_, x_, op, "dy", "x");
  detail::require_shape(dy_, x_.shape(), op, "dy");
  detail::require_float_dev(dw, op, "dw");
  detail::require_same_device(dw, x_, op, "dw", "x");
  detail::require_param_dtype(dw, x_, op, "dw");
  detail::require_shape(dw, w_.shape(), op, "dw");
  detail::require_contiguous(dw, op, "dw");
  const std::vector<int64_t> cu = check_cu_seqlens(cu_seqlens, x_.size(0));
  const int64_t nseq = int64_t(cu.size()) - 1, c = x_.size(1), width = w_.size(1);
  if (initial_state.defined()) check_state(op, initial_state, x_, nseq, width, "initial_state");
  if (x_.device() == Device::cuda) {
#ifdef HLM_HAVE_CUDA
    CausalConv1dGrads g;
    g.dx = cuda::alloc(x_.shape(), x_.dtype());
    if (initial_state.defined()) g.dinitial_state = cuda::alloc({nseq, width - 1, c}, x_.dtype());
    cuda::causal_conv1d_backward(dy_, x_, w_, cu, initial_state, silu, g.dx,
                                 initial_state.defined() ? &g.dinitial_state : nullptr, dw);
    return g;
#else
    HLM_FAIL("{}: no CUDA support in this build", op);
#endif
  }
  const Tensor x = x_.contiguous(), w = w_.contiguous(), dy = dy_.contiguous();
  const Tensor st = initial_state.defined() ? initial_state.contiguous() : Tensor();
  const std::vector<int64_t> seq = token_seq(cu);
  const int64_t nt = x.size(0);
  CausalConv1dGrads g;
  g.dx = Tensor::empty({nt, c}, x.dtype());
  if (st.defined()) g.dinitial_state = Tensor::empty({nseq, width - 1, c}, x.dtype());
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const ConvArgs<T> a{x.data<T>(), w.data<T>(), st.defined() ? st.data<T>() : nullptr, c, width};
    const T* pw = w.data<T>();
    const T* pdy = dy.data<T>();
    // dz = dy * act'(z)
    std::vector<T> dz(size_t(nt * c));
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < nt; ++t) {
      const int64_t n = seq[size_t(t)], bos = cu[size_t(n)];
      for (int64_t ch = 0; ch < c; ++ch) {
        T d = pdy[t * c + ch];
        if (silu) {
          const T z = conv_at(a, n, bos, t - bos, ch);
          const T s = sigmoid_scalar(z);
          d *= s * (T(1) + z * (T(1) - s));
        }
        dz[size_t(t * c + ch)] = d;
      }
    }
    // dxe(p) = sum_j w[c, j] dz_{p + W - 1 - j}, for local p in [-(W-1), L).
    auto dxe = [&](int64_t bos, int64_t len, int64_t p, int64_t ch) {
      T s = 0;
      for (int64_t j = 0; j < width; ++j) {
        const int64_t t = p + width - 1 - j;
        if (t >= 0 && t < len) s += pw[ch * width + j] * dz[size_t((bos + t) * c + ch)];
      }
      return s;
    };
    T* pdx = g.dx.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < nt; ++t) {
      const int64_t n = seq[size_t(t)], bos = cu[size_t(n)], len = cu[size_t(n) + 1] - bos;
      for (int64_t ch = 0; ch < c; ++ch) pdx[t * c + ch] = dxe(bos, len, t - bos, ch);
    }
    if (st.defined()) {
      T* pds = g.dinitial_state.data<T>();
      for (int64_t n = 0; n < nseq; ++n) {
        const int64_t bos = cu[size_t(n)], len = cu[size_t(n) + 1] - bos;
        for (int64_t i = 0; i < width - 1; ++i)
          for (int64_t ch = 0; ch < c; ++ch)
            pds[(n * (width - 1) + i) * c + ch] = dxe(bos, len, i - (width - 1), ch);
      }
    }
    // dw: per sequence, sum over its tokens in order, then dw += that sum.
    T* pdw = dw.data<T>();
    std::vector<T> acc(size_t(c * width));
    for (int64_t n = 0; n < nseq; ++n) {
      const int64_t bos = cu[size_t(n)], len = cu[size_t(n) + 1] - bos;
      if (len == 0) continue;
      std::fill(acc.begin(), acc.end(), T(0));
      for (int64_t t = 0; t < len; ++t)
        for (int64_t ch = 0; ch < c; ++ch) {
          const T d = dz[size_t((bos + t) * c + ch)];
          for (int64_t j = 0; j < width; ++j)
            acc[size_t(ch * width + j)] += d * xe(a, n, bos, t - width + 1 + j, ch);
        }
      for (int64_t i = 0; i < c * width; ++i) pdw[i] += acc[size_t(i)];
    }
  });
  return g;
}

Tensor causal_conv1d_update(const Tensor& x_, Tensor& state, const Tensor& w_, bool silu) {
  constexpr const char* op = "causal_conv1d_update";
  check_conv(op, x_, w_);
  const int64_t nseq = x_.size(0), c = x_.size(1), width = w_.size(1);
  check_state(op, state, x_, nseq, width, "state");
  detail::require_contiguous(state, op, "state");
  if (x_.device() == Device::cuda) {
#ifdef HLM_HAVE_CUDA
    Tensor y = cuda::alloc(x_.shape(), x_.dtype());
    cuda::causal_conv1d_update(x_, state, w_, silu, y);
    return y;
#else
    HLM_FAIL("{}: no CUDA support in this build", op);
#endif
  }
  const Tensor x = x_.contiguous(), w = w_.contiguous();
  Tensor y = Tensor::empty({nseq, c}, x.dtype());
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T *px = x.data<T>(), *pw = w.data<T>();
    T* ps = state.data<T>();
    T* py = y.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < nseq; ++n) {
      T* sn = ps + n * (width - 1) * c;
      for (int64_t ch = 0; ch < c; ++ch) {
        // Window: state[0..W-2] then x; the same terms in the same order as the full conv.
        T z = 0;
        for (int64_t j = 0; j < width; ++j) {
          const T v = j < width - 1 ? sn[j * c + ch] : px[n * c + ch];
          z += pw[ch * width + j] * v;
        }
        py[n * c + ch] = silu ? z * sigmoid_scalar(z) : z;
        for (int64_t i = 0; i + 1 < width - 1; ++i) sn[i * c + ch] = sn[(i + 1) * c + ch];
        if (width > 1) sn[(width - 2) * c + ch] = px[n * c + ch];
      }
    }
  });
  return y;
}

}  // namespace hlm::ops
