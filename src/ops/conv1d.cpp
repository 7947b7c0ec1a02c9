// The front door of the causal depthwise conv1d (ops/conv1d.h): argument checks, output
// allocation, and the switch to the CPU reference (ops/cpu/conv1d.cpp) or the CUDA kernels
// (ops/cuda/conv1d.cu).
#include "ops/conv1d.h"

#include "ops/cpu/conv1d.h"
#include "ops/cuda/conv1d.cuh"
#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace hlm::ops {

namespace {

// x f32 / f64 (CUDA: also bf16); w of x's dtype (or f32 next to bf16 x) on x's device.
void check_conv(const char* op, const Tensor& x, const Tensor& w) {
  detail::require_float_dev(x, op, "x");
  HLM_CHECK(x.dim() == 2, "{}: x must be [T, C], got {}", op, x.describe());
  detail::require_float_dev(w, op, "w");
  detail::require_same_device(w, x, op, "w", "x");
  detail::require_param_dtype(w, x, op, "w");
  HLM_CHECK(w.dim() == 2 && w.size(0) == x.size(1) && w.size(1) >= 1,
            "{}: w must be [C, W] with C = {} and W >= 1, got {}", op, x.size(1), w.describe());
}

void check_state(const char* op, const Tensor& s, const Tensor& x, int64_t n, int64_t width,
                 const char* what) {
  detail::require_like_x(s, x, {n, width - 1, x.size(1)}, op, what);
}

Tensor contiguous_or_none(const Tensor& t) {
  return t.defined() ? t.contiguous() : Tensor();
}

}  // namespace

Tensor causal_conv1d_forward(const Tensor& x_, const Tensor& w_, const SeqLayout& seqs,
                             const Tensor& initial_state, bool silu, Tensor* final_state) {
  constexpr const char* op = "causal_conv1d_forward";
  check_conv(op, x_, w_);
  seqs.check_tokens(x_.size(0), op, "x");
  const std::vector<int64_t>& cu = seqs.offsets();
  const int64_t nseq = int64_t(cu.size()) - 1, c = x_.size(1), width = w_.size(1);
  if (initial_state.defined()) check_state(op, initial_state, x_, nseq, width, "initial_state");
  const Tensor x = x_.contiguous(), w = w_.contiguous(), st = contiguous_or_none(initial_state);
  const Device dev = x.device();
  Tensor y = detail::new_output(x.shape(), x.dtype(), dev);
  if (final_state) *final_state = detail::new_output({nseq, width - 1, c}, x.dtype(), dev);
  HLM_DISPATCH(op, dev, causal_conv1d_forward, x, w, cu, st, silu, y, final_state);
  return y;
}

CausalConv1dGrads causal_conv1d_backward(const Tensor& dy_, const Tensor& x_, const Tensor& w_,
                                         const SeqLayout& seqs, const Tensor& initial_state,
                                         bool silu, Tensor& dw) {
  constexpr const char* op = "causal_conv1d_backward";
  check_conv(op, x_, w_);
  detail::require_like_x(dy_, x_, x_.shape(), op, "dy");
  detail::require_param_grad(dw, x_, w_.shape(), op, "dw");
  seqs.check_tokens(x_.size(0), op, "x");
  const std::vector<int64_t>& cu = seqs.offsets();
  const int64_t nseq = int64_t(cu.size()) - 1, c = x_.size(1), width = w_.size(1);
  if (initial_state.defined()) check_state(op, initial_state, x_, nseq, width, "initial_state");
  const Tensor x = x_.contiguous(), w = w_.contiguous(), dy = dy_.contiguous(),
               st = contiguous_or_none(initial_state);
  const Device dev = x.device();
  CausalConv1dGrads g;
  g.dx = detail::new_output(x.shape(), x.dtype(), dev);
  if (st.defined()) g.dinitial_state = detail::new_output({nseq, width - 1, c}, x.dtype(), dev);
  Tensor* dstate = st.defined() ? &g.dinitial_state : nullptr;
  HLM_DISPATCH(op, dev, causal_conv1d_backward, dy, x, w, cu, st, silu, g.dx, dstate, dw);
  return g;
}

Tensor causal_conv1d_update(const Tensor& x_, Tensor& state, const Tensor& w_, bool silu) {
  constexpr const char* op = "causal_conv1d_update";
  check_conv(op, x_, w_);
  const int64_t nseq = x_.size(0), width = w_.size(1);
  check_state(op, state, x_, nseq, width, "state");
  detail::require_contiguous(state, op, "state");
  const Tensor x = x_.contiguous(), w = w_.contiguous();
  Tensor y = detail::new_output(x.shape(), x.dtype(), x.device());
  HLM_DISPATCH(op, x.device(), causal_conv1d_update, x, state, w, silu, y);
  return y;
}

Tensor causal_conv1d_update_slots(const Tensor& x_, Tensor& pool, const std::vector<int64_t>& slots,
                                  const Tensor& w_, bool silu) {
  constexpr const char* op = "causal_conv1d_update_slots";
  check_conv(op, x_, w_);
  const int64_t nseq = x_.size(0), width = w_.size(1), c = x_.size(1);
  HLM_CHECK(pool.defined() && pool.dim() == 3 && pool.size(1) == width - 1 && pool.size(2) == c,
            "{}: pool must be [S, W - 1 = {}, C = {}], got {}", op, width - 1, c,
            pool.defined() ? pool.describe() : "undefined");
  detail::require_like_x(pool, x_, pool.shape(), op, "pool");
  detail::require_contiguous(pool, op, "pool");
  HLM_CHECK(int64_t(slots.size()) == nseq, "{}: {} slots for {} sequences", op, slots.size(), nseq);
  std::vector<char> used(size_t(pool.size(0)), 0);
  for (int64_t s : slots) {
    HLM_CHECK(s >= 0 && s < pool.size(0), "{}: slot {} is outside the pool [0, {})", op, s,
              pool.size(0));
    HLM_CHECK(!used[size_t(s)], "{}: slot {} is given twice", op, s);
    used[size_t(s)] = 1;
  }
  const Tensor x = x_.contiguous(), w = w_.contiguous();
  Tensor y = detail::new_output(x.shape(), x.dtype(), x.device());
  HLM_DISPATCH(op, x.device(), causal_conv1d_update, x, pool, w, silu, y, slots);
  return y;
}

}  // namespace hlm::ops
