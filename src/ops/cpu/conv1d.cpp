// Causal depthwise conv1d on the CPU (ops/conv1d.h, the reference; entry points in
// ops/cpu/conv1d.h).
//
// Per sequence [bos, eos) of length L, extend the input to the left with the W-1 state values:
//   xe(p)[c] = x[bos + p][c]            for 0 <= p < L
//            = state[n, p + W - 1][c]   for -(W-1) <= p < 0   (0 without a state)
// Forward:   z_t = sum_j w[c, j] xe(t - W + 1 + j),  y_t = silu(z_t) or z_t
// Backward:  dz_t = dy_t * silu'(z_t) (or dy_t)
//            dxe(p) = sum_j w[c, j] dz_{p + W - 1 - j}   over 0 <= p + W - 1 - j < L
//            dx = dxe(p >= 0), d state[n, i] = dxe(i - (W - 1))
//            dw[c, j] += sum_t dz_t xe(t - W + 1 + j)
#include "ops/cpu/conv1d.h"

#include <algorithm>

#include "ops/activations.h"
#include "ops/op_checks.h"

namespace hlm::ops::cpu {

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

// Calls f(n, bos, len, i, ch) for every entry [n, i, ch] of a state [N, W-1, C], in memory order
// (sequence n = [bos, bos + len)).
template <class F>
void for_state(const std::vector<int64_t>& cu, int64_t width, int64_t c, F&& f) {
  for (size_t n = 0; n + 1 < cu.size(); ++n) {
    const int64_t bos = cu[n], len = cu[n + 1] - bos;
    for (int64_t i = 0; i < width - 1; ++i)
      for (int64_t ch = 0; ch < c; ++ch) f(int64_t(n), bos, len, i, ch);
  }
}

// Sequence id of every token.
std::vector<int64_t> token_seq(const std::vector<int64_t>& cu) {
  std::vector<int64_t> s(size_t(cu.back()));
  for (size_t n = 0; n + 1 < cu.size(); ++n)
    for (int64_t t = cu[n]; t < cu[n + 1]; ++t) s[size_t(t)] = int64_t(n);
  return s;
}

}  // namespace

void causal_conv1d_forward(const Tensor& x, const Tensor& w, const std::vector<int64_t>& cu,
                           const Tensor& st, bool silu, Tensor& y, Tensor* final_state) {
  const int64_t c = x.size(1), width = w.size(1);
  const std::vector<int64_t> seq = token_seq(cu);
  const int64_t nt = x.size(0);
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
      for_state(cu, width, c, [&](int64_t n, int64_t bos, int64_t len, int64_t i, int64_t ch) {
        pf[(n * (width - 1) + i) * c + ch] = xe(a, n, bos, len - (width - 1) + i, ch);
      });
    }
  });
}

void causal_conv1d_backward(const Tensor& dy, const Tensor& x, const Tensor& w,
                            const std::vector<int64_t>& cu, const Tensor& st, bool silu, Tensor& dx,
                            Tensor* dstate, Tensor& dw) {
  const int64_t nseq = int64_t(cu.size()) - 1, c = x.size(1), width = w.size(1);
  const std::vector<int64_t> seq = token_seq(cu);
  const int64_t nt = x.size(0);
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
    T* pdx = dx.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < nt; ++t) {
      const int64_t n = seq[size_t(t)], bos = cu[size_t(n)], len = cu[size_t(n) + 1] - bos;
      for (int64_t ch = 0; ch < c; ++ch) pdx[t * c + ch] = dxe(bos, len, t - bos, ch);
    }
    if (dstate) {
      T* pds = dstate->data<T>();
      for_state(cu, width, c, [&](int64_t n, int64_t bos, int64_t len, int64_t i, int64_t ch) {
        pds[(n * (width - 1) + i) * c + ch] = dxe(bos, len, i - (width - 1), ch);
      });
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
}

void causal_conv1d_update(const Tensor& x, Tensor& state, const Tensor& w, bool silu, Tensor& y,
                          const std::vector<int64_t>& slots) {
  const int64_t nseq = x.size(0), c = x.size(1), width = w.size(1);
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T *px = x.data<T>(), *pw = w.data<T>();
    T* ps = state.data<T>();
    T* py = y.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < nseq; ++n) {
      T* sn = ps + (slots.empty() ? n : slots[size_t(n)]) * (width - 1) * c;
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
}

}  // namespace hlm::ops::cpu
