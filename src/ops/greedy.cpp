// The front door of the greedy pick (ops/greedy.h): argument checks, output allocation, and the
// switch to the CPU reference (ops/cpu/greedy.cpp) or the CUDA kernel (ops/cuda/greedy.cu).
#include "ops/greedy.h"

#include "ops/cpu/greedy.h"
#include "ops/cuda/greedy.cuh"
#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace hlm::ops {

GreedyPick greedy_pick(const Tensor& logits_) {
  constexpr const char* op = "greedy_pick";
  detail::require_float_dev(logits_, op, "logits");
  HLM_CHECK(logits_.dim() == 2 && logits_.size(1) >= 1,
            "{}: logits must be [R, V] with V >= 1, got {}", op, logits_.describe());
  const Tensor logits = logits_.contiguous();
  const int64_t R = logits.size(0);
  const Device dev = logits.device();
  GreedyPick out;
  out.token = detail::new_output({R}, DType::i64, dev);
  out.logprob = detail::new_output({R}, DType::f64, dev);
  out.bad = detail::new_output({R}, DType::i64, dev);
  if (R == 0) return out;
  HLM_DISPATCH(op, dev, greedy_pick, logits, out);
  return out;
}

}  // namespace hlm::ops
