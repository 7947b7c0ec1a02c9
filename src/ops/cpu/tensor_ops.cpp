// The copy and elementwise ops on the CPU (ops/tensor_ops.h; entry points in
// ops/cpu/tensor_ops.h): one addition per element, sums over rows in ascending order, so the GPU
// kernels give the same bits.
#include "ops/cpu/tensor_ops.h"

#include "ops/op_checks.h"

namespace hlm::ops::cpu {

void add_(Tensor& dst, const Tensor& src) {
  detail::dispatch_float(dst.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* d = dst.data<T>();
    const T* p = src.data<T>();
    for (int64_t i = 0; i < dst.numel(); ++i) d[i] += p[i];
  });
}

void add_bias_(Tensor& y, const Tensor& b) {
  const int64_t T = y.size(0), N = y.size(1);
  detail::dispatch_float(y.dtype(), [&](auto tag) {
    using D = decltype(tag);
    D* yp = y.data<D>();
    const D* bp = b.data<D>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t o = 0; o < N; ++o) yp[t * N + o] += bp[o];
  });
}

void sum_rows(const Tensor& x, Tensor& out) {
  const int64_t T = x.size(0), O = x.size(1);
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using D = decltype(tag);
    const D* p = x.data<D>();
    D* s = out.data<D>();
    for (int64_t o = 0; o < O; ++o) s[o] = D(0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t o = 0; o < O; ++o) s[o] += p[t * O + o];
  });
}

void scale_(Tensor& c, double beta) {
  if (beta == 0.0) {
    c.zero_();
    return;
  }
  Tensor cc = c.to(DType::f64);
  double* p = cc.data<double>();
  for (int64_t i = 0; i < cc.numel(); ++i) p[i] *= beta;
  c.copy_(cc);
}

void causal_conv1d_final_state_backward(const Tensor& dfinal, const std::vector<int64_t>& cu,
                                        int64_t width, Tensor& dx, Tensor* dinitial) {
  const int64_t N = int64_t(cu.size()) - 1, C = dx.size(1), wm = width - 1;
  detail::dispatch_float(dx.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* pf = dfinal.data<T>();
    T* px = dx.data<T>();
    T* ps = dinitial ? dinitial->data<T>() : nullptr;
    for (int64_t n = 0; n < N; ++n) {
      const int64_t bos = cu[size_t(n)], len = cu[size_t(n) + 1] - bos;
      for (int64_t i = 0; i < wm; ++i) {
        const int64_t p = len - wm + i;  // local position the entry was copied from
        const T* src = pf + (n * wm + i) * C;
        if (p >= 0) {
          T* dst = px + (bos + p) * C;
          for (int64_t ch = 0; ch < C; ++ch) dst[ch] += src[ch];
        } else if (ps) {
          T* dst = ps + (n * wm + p + wm) * C;
          for (int64_t ch = 0; ch < C; ++ch) dst[ch] += src[ch];
        }
      }
    }
  });
}

}  // namespace hlm::ops::cpu
