// Embedding on the CPU (ops/embedding.h).
//   forward:  out[t] = table[id_t]
//   backward: dtable[id_t] += dy[t] for t = 0, 1, ... in order (a repeated id accumulates in
//             token order, so the result is the same run after run)
#include "ops/embedding.h"

#include <cstring>

#include "ops/op_checks.h"

namespace hlm::ops {

namespace {
std::vector<int64_t> check_ids(const char* op, const Tensor& ids, int64_t vocab) {
  detail::require_index(ids, op, "ids");
  std::vector<int64_t> v = detail::index_values(ids);
  for (size_t t = 0; t < v.size(); ++t)
    HLM_CHECK(v[t] >= 0 && v[t] < vocab,
              "{}: ids[{}] (flat position) = {} is outside the vocabulary [0, {})", op, t, v[t],
              vocab);
  return v;
}
}  // namespace

Tensor embedding_forward(const Tensor& table_, const Tensor& ids) {
  constexpr const char* op = "embedding_forward";
  HLM_CHECK(table_.defined(), "{}: table is undefined", op);
  detail::require_cpu(table_, op, "table");
  HLM_CHECK(table_.dim() == 2, "{}: table must be [V, D], got {}", op, table_.describe());
  const std::vector<int64_t> id = check_ids(op, ids, table_.size(0));
  const Tensor table = table_.contiguous();
  const int64_t d = table.size(1);
  Shape shape = ids.shape();
  shape.push_back(d);
  Tensor out = Tensor::empty(shape, table.dtype());
  const size_t row_bytes = size_t(d) * table.element_size();
  const char* src = static_cast<const char*>(table.raw());
  char* dst = static_cast<char*>(out.raw());
  const int64_t n = int64_t(id.size());
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n; ++t)
    std::memcpy(dst + size_t(t) * row_bytes, src + size_t(id[size_t(t)]) * row_bytes, row_bytes);
  return out;
}

void embedding_backward(const Tensor& dy_, const Tensor& ids, Tensor& dtable) {
  constexpr const char* op = "embedding_backward";
  detail::require_float(dtable, op, "dtable");
  HLM_CHECK(dtable.dim() == 2, "{}: dtable must be [V, D], got {}", op, dtable.describe());
  detail::require_contiguous(dtable, op, "dtable");
  const std::vector<int64_t> id = check_ids(op, ids, dtable.size(0));
  detail::require_float(dy_, op, "dy");
  detail::require_same_dtype(dy_, dtable, op, "dy", "dtable");
  Shape shape = ids.shape();
  shape.push_back(dtable.size(1));
  detail::require_shape(dy_, shape, op, "dy");
  const Tensor dy = dy_.contiguous();
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

}  // namespace hlm::ops
