// Embedding on the CPU (ops/embedding.h, the reference; entry points in ops/cpu/embedding.h).
//   forward:  out[t] = table[id_t]
//   backward: dtable[id_t] += dy[t] for t = 0, 1, ... in order (a repeated id accumulates in
//             token order, so the result is the same run after run)
#include "ops/cpu/embedding.h"

#include <cstring>

#include "ops/op_checks.h"

namespace hlm::ops::cpu {

void embedding_forward(const Tensor& table, const std::vector<int64_t>& id, Tensor& out) {
  const size_t row_bytes = size_t(table.size(1)) * table.element_size();
  const char* src = static_cast<const char*>(table.raw());
  char* dst = static_cast<char*>(out.raw());
  const int64_t n = int64_t(id.size());
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n; ++t)
    std::memcpy(dst + size_t(t) * row_bytes, src + size_t(id[size_t(t)]) * row_bytes, row_bytes);
}

void embedding_backward(const Tensor& dy, const std::vector<int64_t>& id, Tensor& dtable) {
  const int64_t d = dtable.size(1), n = int64_t(id.size());
  detail::dispatch_float(dtable.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* g = dy.data<T>();
    T* dt = dtable.data<T>();
    for (int64_t t = 0; t < n; ++t) {
      T* row = dt + id[size_t(t)] * d;
      for (int64_t i = 0; i < d; ++i) row[i] += g[t * d + i];
    }
  });
}

}  // namespace hlm::ops::cpu
