// The front door of the embedding (ops/embedding.h): argument checks (every id: on the host for
// CPU ids, on the device for CUDA ids), output allocation, and the switch to the CPU reference
// (ops/cpu/embedding.cpp) or the CUDA kernels (ops/cuda/embedding.cu).
#include "ops/embedding.h"

#include "ops/cpu/embedding.h"
#include "ops/cuda/embedding.cuh"
#include "ops/cuda/index_check.cuh"
#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace hlm::ops {

namespace {
[[noreturn]] void bad_id(const char* op, int64_t pos, int64_t id, int64_t vocab) {
  HLM_FAIL("{}: ids[{}] (flat position) = {} is outside the vocabulary [0, {})", op, pos, id,
           vocab);
}

// CPU ids: every id checked, returned as int64. CUDA ids: checked on the device (the first bad
// flat position reported, as on the CPU); returns nothing.
std::vector<int64_t> check_ids(const char* op, const Tensor& ids, int64_t vocab) {
  detail::require_int(ids, op, "ids");
  if (ids.device() != Device::cpu) {
    HLM_CUDA_PATH(op, {
      const cuda::IndexScan s = cuda::scan_indices(ids.contiguous(), vocab, false, 0);
      if (s.first_bad >= 0) bad_id(op, s.first_bad, s.bad_value, vocab);
    });
    return {};
  }
  std::vector<int64_t> v = detail::index_values(ids);
  for (size_t t = 0; t < v.size(); ++t)
    if (v[t] < 0 || v[t] >= vocab) bad_id(op, int64_t(t), v[t], vocab);
  return v;
}

// [ids..., D]
Shape rows_shape(const Tensor& ids, int64_t d) {
  Shape shape = ids.shape();
  shape.push_back(d);
  return shape;
}

Tensor embedding_forward_impl(const Tensor& table_, const Tensor& ids,
                              const std::span<const int64_t>* host_ids) {
  constexpr const char* op = "embedding_forward";
  HLM_CHECK(table_.defined(), "{}: table is undefined", op);
  HLM_CHECK(table_.dim() == 2, "{}: table must be [V, D], got {}", op, table_.describe());
  detail::one_device(op, {table_, "table"}, {{ids, "ids"}});
  std::vector<int64_t> id;
  if (host_ids) {
    detail::require_int(ids, op, "ids");
    HLM_CHECK(int64_t(host_ids->size()) == ids.numel(), "{}: {} host ids for {} ids", op,
              host_ids->size(), ids.numel());
    const int64_t vocab = table_.size(0);
    for (size_t t = 0; t < host_ids->size(); ++t)
      if ((*host_ids)[t] < 0 || (*host_ids)[t] >= vocab)
        bad_id(op, int64_t(t), (*host_ids)[t], vocab);
    if (ids.is_cpu()) id.assign(host_ids->begin(), host_ids->end());
  } else {
    id = check_ids(op, ids, table_.size(0));
  }
  const Tensor table = table_.contiguous();
  Tensor out = detail::new_output(rows_shape(ids, table.size(1)), table.dtype(), table.device());
  if (table.device() == Device::cpu) {
    cpu::embedding_forward(table, id, out);
  } else {
    HLM_CUDA_PATH(op, cuda::embedding_forward(table, ids.contiguous(), out));
  }
  return out;
}

}  // namespace

Tensor embedding_forward(const Tensor& table, const Tensor& ids) {
  return embedding_forward_impl(table, ids, nullptr);
}

Tensor embedding_forward(const Tensor& table, const Tensor& ids,
                         std::span<const int64_t> host_ids) {
  return embedding_forward_impl(table, ids, &host_ids);
}

void embedding_backward(const Tensor& dy_, const Tensor& ids, Tensor& dtable) {
  constexpr const char* op = "embedding_backward";
  detail::require_real(dtable, op, "dtable");
  HLM_CHECK(dtable.dim() == 2, "{}: dtable must be [V, D], got {}", op, dtable.describe());
  detail::require_contiguous(dtable, op, "dtable");
  detail::one_device(op, {dtable, "dtable"}, {{ids, "ids"}});
  const std::vector<int64_t> id = check_ids(op, ids, dtable.size(0));
  detail::require_real_like(dy_, dtable, rows_shape(ids, dtable.size(1)), op, "dy", "dtable");
  const Tensor dy = dy_.contiguous();
  if (dtable.device() == Device::cpu) {
    cpu::embedding_backward(dy, id, dtable);
  } else {
    HLM_CUDA_PATH(op, cuda::embedding_backward(dy, ids.contiguous(), dtable));
  }
}

}  // namespace hlm::ops
