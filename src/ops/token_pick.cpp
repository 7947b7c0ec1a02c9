// The front door of the token picks (ops/token_pick.h): argument checks, output allocation, and
// the switch to the CPU reference (ops/cpu/token_pick.cpp) or the CUDA kernel
// (ops/cuda/token_pick.cu).
#include "ops/token_pick.h"

#include <cmath>
#include <cstring>

#include "ops/cpu/token_pick.h"
#include "ops/cuda/token_pick.cuh"
#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace hlm::ops {
namespace {

TokenPick pick(const char* op, const Tensor& logits_, const std::vector<SampleRow>* rows,
               const std::vector<int64_t>* given) {
  detail::require_float_dev(logits_, op, "logits");
  HLM_CHECK(logits_.dim() == 2 && logits_.size(1) >= 1,
            "{}: logits must be [R, V] with V >= 1, got {}", op, logits_.describe());
  const Tensor logits = logits_.contiguous();
  const int64_t R = logits.size(0);
  if (rows) {
    HLM_CHECK(int64_t(rows->size()) == R, "{}: {} sampling rows for {} rows of logits", op,
              rows->size(), R);
    for (int64_t r = 0; r < R; ++r) {
      const SampleRow& s = (*rows)[size_t(r)];
      HLM_CHECK(std::isfinite(s.temperature) && s.temperature >= 0,
                "{}: row {}: temperature must be 0 or finite and positive, got {}", op, r,
                s.temperature);
      HLM_CHECK(s.top_k >= 0, "{}: row {}: top_k must be >= 0, got {}", op, r, s.top_k);
      HLM_CHECK(std::isfinite(s.top_p) && s.top_p > 0 && s.top_p <= 1,
                "{}: row {}: top_p must be in (0, 1], got {}", op, r, s.top_p);
      HLM_CHECK(s.u >= 0 && s.u < 1, "{}: row {}: u must be in [0, 1), got {}", op, r, s.u);
    }
  }
  if (given) {
    HLM_CHECK(int64_t(given->size()) == R, "{}: {} tokens for {} rows of logits", op, given->size(),
              R);
    for (int64_t r = 0; r < R; ++r)
      HLM_CHECK((*given)[size_t(r)] >= 0 && (*given)[size_t(r)] < logits.size(1),
                "{}: row {}: token {} is outside [0, {})", op, r, (*given)[size_t(r)],
                logits.size(1));
  }
  const Device dev = logits.device();
  TokenPick out;
  out.packed = detail::new_output({3, R}, DType::i64, dev);
  out.token = out.packed.select(0, 0);
  out.logprob = out.packed.select(0, 1).bitcast(DType::f64);
  out.bad = out.packed.select(0, 2);
  if (R == 0) return out;
  if (given)
    HLM_DISPATCH(op, dev, score_tokens, logits, *given, out);
  else if (rows)
    HLM_DISPATCH(op, dev, sample_pick, logits, *rows, out);
  else
    HLM_DISPATCH(op, dev, greedy_pick, logits, out);
  return out;
}

}  // namespace

std::vector<RowPick> TokenPick::to_host() const {
  HLM_CHECK(packed.defined() && packed.dim() == 2 && packed.size(0) == 3,
            "TokenPick::to_host: no packed [3, R] outputs");
  const Tensor h = packed.to(Device::cpu);
  const int64_t R = h.size(1);
  const int64_t* p = h.data<int64_t>();
  std::vector<RowPick> rows(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    RowPick& q = rows[size_t(r)];
    q.token = p[r];
    std::memcpy(&q.logprob, &p[R + r], sizeof(double));
    q.bad = p[2 * R + r];
  }
  return rows;
}

TokenPick greedy_pick(const Tensor& logits) {
  return pick("greedy_pick", logits, nullptr, nullptr);
}

TokenPick sample_pick(const Tensor& logits, const std::vector<SampleRow>& rows) {
  return pick("sample_pick", logits, &rows, nullptr);
}

TokenPick score_tokens(const Tensor& logits, const std::vector<int64_t>& tokens) {
  return pick("score_tokens", logits, nullptr, &tokens);
}

RowPick pick_host_row(const float* x, int64_t V, const SampleRow& p) {
  return cpu::pick_row(x, V, p);
}

}  // namespace hlm::ops
