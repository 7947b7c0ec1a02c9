// RoPE on the CPU (ops/rope.h, the reference; entry point in ops/cpu/rope.h). Per token t, the
// rope_dim / 2 cos / sin pairs are formed once, then every row (head) of t is rotated; channels
// outside the rotated range are copied when y is not x. Tokens in parallel; every element is
// computed by the same expression whatever the thread split, so results do not depend on it.
#include "ops/cpu/rope.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "ops/op_checks.h"

namespace hlm::ops::cpu {

namespace {
// Loops with fewer elements than this run on one thread.
constexpr int64_t kParallelWork = 1 << 15;
}  // namespace

void rope(const Tensor& x, const Tensor& pos, const Tensor& inv_freq, const RopeOptions& opt,
          Tensor& y) {
  const int64_t T = x.size(0), n = x.dim() == 3 ? x.size(1) : 1, L = x.size(-1);
  const int64_t half = opt.rope_dim / 2, ia0 = opt.offset;
  const int64_t stride_b = opt.interleave ? 1 : half, step = opt.interleave ? 2 : 1;
  const int64_t* pp = pos.data<int64_t>();
  const double* pf = inv_freq.data<double>();
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using F = decltype(tag);
    const F* px = x.data<F>();
    F* py = y.data<F>();
    const F fac = F(opt.factor);
    if (px != py && x.numel() > 0) std::memcpy(py, px, size_t(x.numel()) * sizeof(F));
#pragma omp parallel for schedule(static) if (T * n * L > kParallelWork)
    for (int64_t t = 0; t < T; ++t) {
      std::vector<F> cs(static_cast<size_t>(half)), sn(static_cast<size_t>(half));
      for (int64_t i = 0; i < half; ++i) {
        double ang;
        if (opt.angle == RopeAngle::f64) {
          ang = double(pp[t]) * pf[i];
        } else {
          ang = double(F(pp[t]) * F(pf[i]));
        }
        cs[size_t(i)] = F(std::cos(ang)) * fac;
        sn[size_t(i)] = F(std::sin(ang)) * fac;
      }
      for (int64_t h = 0; h < n; ++h) {
        F* r = py + (t * n + h) * L + ia0;
        for (int64_t i = 0; i < half; ++i) {
          const int64_t ia = i * step, ib = ia + stride_b;
          const F a = r[ia], b = r[ib], c = cs[size_t(i)], s = sn[size_t(i)];
          if (!opt.inverse) {
            r[ia] = a * c - b * s;
            r[ib] = a * s + b * c;
          } else {
            r[ia] = a * c + b * s;
            r[ib] = -a * s + b * c;
          }
        }
      }
    }
  });
}

}  // namespace hlm::ops::cpu
