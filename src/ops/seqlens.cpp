// cu_seqlens validation (see ops/seqlens.h). Works on host values; a CUDA tensor is copied to
// the host first (a small synchronous copy of N+1 integers).
#include "ops/seqlens.h"

namespace hlm::ops {

void check_cu_seqlens(const std::vector<int64_t>& cu, int64_t total_tokens, const char* what) {
  HLM_CHECK(!cu.empty(), "{} must have N+1 >= 1 entries, got none", what);
  HLM_CHECK(cu.front() == 0, "{} must start at 0, got {}", what, cu.front());
  for (size_t i = 1; i < cu.size(); ++i)
    HLM_CHECK(cu[i] >= cu[i - 1], "{} must be non-decreasing, got {} at index {} after {}", what,
              cu[i], i, cu[i - 1]);
  HLM_CHECK(cu.back() == total_tokens, "{} must end at the token count T = {}, got {}", what,
            total_tokens, cu.back());
}

std::vector<int64_t> check_cu_seqlens(const Tensor& cu_seqlens, int64_t total_tokens,
                                      const char* what) {
  HLM_CHECK(cu_seqlens.defined(), "{} is undefined", what);
  HLM_CHECK(cu_seqlens.dtype() == DType::i64 || cu_seqlens.dtype() == DType::i32,
            "{} must be i64 or i32, got {}", what, cu_seqlens.describe());
  HLM_CHECK(cu_seqlens.dim() == 1, "{} must be 1-D [N+1], got {}", what, cu_seqlens.describe());
  const Tensor host = cu_seqlens.is_cpu() ? cu_seqlens : cu_seqlens.to(Device::cpu);
  std::vector<int64_t> cu(size_t(host.numel()));
  const auto vals = host.to(DType::i64);
  const int64_t* p = vals.data<int64_t>();
  for (size_t i = 0; i < cu.size(); ++i) cu[i] = p[i];
  check_cu_seqlens(cu, total_tokens, what);
  return cu;
}

Tensor cu_seqlens_from_lengths(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> cu(lengths.size() + 1, 0);
  for (size_t i = 0; i < lengths.size(); ++i) {
    HLM_CHECK(lengths[i] >= 0, "sequence length {} at index {} must be >= 0", lengths[i], i);
    cu[i + 1] = cu[i] + lengths[i];
  }
  return Tensor::from_vector<int64_t>({int64_t(cu.size())}, cu);
}

}  // namespace hlm::ops
