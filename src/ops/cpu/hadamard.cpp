// The Hadamard rotation on the CPU (ops/hadamard.h, the reference; entry point in
// ops/cpu/hadamard.h): per row, butterflies with stride 1, 2, 4, ... in place, then one
// multiplication by 1 / sqrt(d) rounded to the dtype. Rows in parallel.
#include "ops/cpu/hadamard.h"

#include <cmath>
#include <cstring>

#include "ops/op_checks.h"

namespace hlm::ops::cpu {

void hadamard(const Tensor& x, Tensor& y) {
  const int64_t d = x.size(-1), rows = d > 0 ? x.numel() / d : 0;
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    T* p = y.data<T>();
    if (px != p && x.numel() > 0) std::memcpy(p, px, size_t(x.numel()) * sizeof(T));
    const T norm = T(1.0 / std::sqrt(double(d)));
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      T* v = p + r * d;
      for (int64_t len = 1; len < d; len <<= 1)
        for (int64_t i = 0; i < d; i += 2 * len)
          for (int64_t j = i; j < i + len; ++j) {
            const T a = v[j], b = v[j + len];
            v[j] = a + b;
            v[j + len] = a - b;
          }
      for (int64_t j = 0; j < d; ++j) v[j] *= norm;
    }
  });
}

}  // namespace hlm::ops::cpu
