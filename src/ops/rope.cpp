// The front door of RoPE (ops/rope.h): argument checks, output allocation, and the switch to the
// CPU reference (ops/cpu/rope.cpp) or the CUDA kernel (ops/cuda/rope.cu).
#include "ops/rope.h"

#include <cmath>

#include "ops/cpu/rope.h"
#include "ops/cuda/rope.cuh"
#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace hlm::ops {

namespace {

void check(const char* op, const Tensor& x, const Tensor& pos, const Tensor& inv_freq,
           const RopeOptions& opt) {
  detail::require_float_dev(x, op, "x");
  HLM_CHECK(x.dim() == 2 || x.dim() == 3, "{}: x must be [T, L] or [T, n, L], got {}", op,
            x.describe());
  const int64_t L = x.size(-1);
  HLM_CHECK(opt.rope_dim >= 0 && opt.rope_dim % 2 == 0,
            "{}: rope_dim must be even and >= 0, got {}", op, opt.rope_dim);
  HLM_CHECK(opt.offset >= 0 && opt.offset + opt.rope_dim <= L,
            "{}: channels [{}, {}) do not fit rows of {} channels", op, opt.offset,
            opt.offset + opt.rope_dim, L);
  HLM_CHECK(std::isfinite(opt.factor), "{}: factor must be finite, got {}", op, opt.factor);
  HLM_CHECK(pos.defined() && pos.dtype() == DType::i64, "{}: pos must be i64, got {}", op,
            pos.defined() ? pos.describe() : std::string("undefined"));
  detail::require_same_device(pos, x, op, "pos", "x");
  detail::require_shape(pos, {x.size(0)}, op, "pos");
  HLM_CHECK(inv_freq.defined() && inv_freq.dtype() == DType::f64,
            "{}: inv_freq must be f64, got {}", op,
            inv_freq.defined() ? inv_freq.describe() : std::string("undefined"));
  detail::require_same_device(inv_freq, x, op, "inv_freq", "x");
  detail::require_shape(inv_freq, {opt.rope_dim / 2}, op, "inv_freq");
}

}  // namespace

Tensor rope(const Tensor& x_, const Tensor& pos_, const Tensor& inv_freq_, const RopeOptions& opt) {
  constexpr const char* op = "rope";
  check(op, x_, pos_, inv_freq_, opt);
  const Tensor x = x_.contiguous(), pos = pos_.contiguous(), inv_freq = inv_freq_.contiguous();
  Tensor y = detail::new_output(x.shape(), x.dtype(), x.device());
  HLM_DISPATCH(op, x.device(), rope, x, pos, inv_freq, opt, y);
  return y;
}

void rope_inplace(Tensor& x, const Tensor& pos_, const Tensor& inv_freq_, const RopeOptions& opt) {
  constexpr const char* op = "rope_inplace";
  check(op, x, pos_, inv_freq_, opt);
  detail::require_contiguous(x, op, "x");
  const Tensor pos = pos_.contiguous(), inv_freq = inv_freq_.contiguous();
  HLM_DISPATCH(op, x.device(), rope, x, pos, inv_freq, opt, x);
}

}  // namespace hlm::ops
