// The front door of the DSA indexer KL loss and its attention target (ops/dsa_indexer_loss.h):
// argument checks (the target's layout becomes a checked pattern, ops/dsa_common.h; on CUDA the
// explicit selection's pattern is built on the device, ops/cuda/dsa_common.cuh, and the dense
// causal target derives its sets on the device instead), output allocation, and the switch to the
// CPU reference (ops/cpu/dsa_indexer_loss.cpp) or, for the attention target, the CUDA kernels
// (ops/cuda/dsa_attention.cu; the KL loss: ops/cuda/dsa_select.cu).
#include "ops/dsa_indexer_loss.h"

#include <cmath>

#include "ops/cpu/dsa_indexer_loss.h"
#include "ops/cuda/dsa_attention.cuh"
#include "ops/cuda/dsa_common.cuh"
#include "ops/cuda/dsa_select.cuh"
#include "ops/dispatch.h"
#include "ops/dsa_common.h"
#include "ops/op_checks.h"

namespace hlm::ops {
namespace {

// q, kv: f32 / f64 (CUDA: also bf16, contiguous), one dtype; the target is in the computation
// dtype (f32 for bf16).
dsa_detail::QueryWindow check_target(const Tensor& q, const Tensor& kv, const Tensor& indices,
                                     const SeqLayout& seqs, double scale, const char* op,
                                     const std::optional<int64_t>& q0) {
  detail::require_float_dev(q, op, "q");
  HLM_CHECK(q.dim() == 3, "{}: q must be [T, H, D_qk], got {}", op, q.describe());
  detail::require_like(kv, q, {q0 ? seqs.total_tokens() : q.size(0), q.size(2)}, op,
                       "kv (the latent cache rows [T, D_qk])", "q");
  HLM_CHECK(std::isfinite(scale) && scale > 0, "{}: scale must be positive and finite, got {}", op,
            scale);
  detail::one_device(op, {q, "q"}, {{indices, "indices"}});
  return dsa_detail::window_of(seqs, q.size(0), q0, op);
}

// The CPU target over a host pattern.
Tensor run_target(const Tensor& q, const Tensor& kv, const dsa_detail::Pattern& p, double scale) {
  Tensor out = detail::new_output({p.T, p.W}, detail::compute_dtype(q.dtype()), q.device());
  cpu::attention_target(q.contiguous(), kv.contiguous(), p, scale, out);
  return out;
}

}  // namespace

Tensor attention_target(const Tensor& q, const Tensor& kv, const SeqLayout& seqs, double scale,
                        int64_t W, std::optional<int64_t> q0) {
  const char* op = "attention_target";
  const dsa_detail::QueryWindow win = check_target(q, kv, Tensor(), seqs, scale, op, q0);
  const std::vector<int64_t>& cu = win.cu;
  const int64_t need = dsa_detail::max_keys_per_doc(cu, 1);
  HLM_CHECK(W == 0 || W >= need, "{}: W must be 0 or >= {} (the longest document), got {}", op,
            need, W);
  if (q.is_cpu())
    return run_target(q, kv, dsa_detail::causal_pattern(win, 1, W == 0 ? need : W), scale);
  // CUDA: no host pattern (O(T^2) at long documents); the kernels read the per-token layout.
  Tensor out = detail::new_output({q.size(0), W == 0 ? need : W}, detail::compute_dtype(q.dtype()),
                                  q.device());
  HLM_CUDA_PATH(op, cuda::attention_target_dense(q, kv, win, scale, out));
  return out;
}

Tensor attention_target_at(const Tensor& q, const Tensor& kv, const SeqLayout& seqs,
                           const Tensor& indices, double scale, const Tensor& lse,
                           std::optional<int64_t> q0) {
  const char* op = "attention_target_at";
  const dsa_detail::QueryWindow win = check_target(q, kv, indices, seqs, scale, op, q0);
  if (lse.defined()) {
    detail::require_float_dev(lse, op, "lse");
    detail::require_same_device(lse, q, op, "lse", "q");
    detail::require_shape(lse, {q.size(0), q.size(1)}, op, "lse");
    HLM_CHECK(lse.dtype() == detail::compute_dtype(q.dtype()),
              "{}: lse must be in the computation dtype ({}), got {}", op,
              dtype_name(detail::compute_dtype(q.dtype())), lse.describe());
  }
  if (q.is_cpu())
    return run_target(q, kv, dsa_detail::rows_pattern(indices, win, 1, op, "indices", false),
                      scale);
  // CUDA: the selection's pattern built and checked on the device.
  Tensor out;
  HLM_CUDA_PATH(op, {
    const cuda::DsaPatternDev p = cuda::device_rows_pattern(indices, win, 1, op, "indices", false);
    out = detail::new_output({p.T, p.W}, detail::compute_dtype(q.dtype()), q.device());
    cuda::attention_target(q.contiguous(), kv.contiguous(), p, scale, out,
                           lse.defined() ? lse.contiguous() : Tensor());
  });
  return out;
}

IndexerKl indexer_kl_loss(const Tensor& scores_, const Tensor& target_, double coeff,
                          KlReduction reduction) {
  const char* op = "indexer_kl_loss";
  detail::require_real(scores_, op, "scores");
  HLM_CHECK(scores_.dim() == 2, "{}: scores must be [T, W], got {}", op, scores_.describe());
  detail::require_real_like(target_, scores_, scores_.shape(), op, "target", "scores");
  HLM_CHECK(std::isfinite(coeff), "{}: coeff must be finite, got {}", op, coeff);
  const Device dev = scores_.device();
  const Tensor scores = scores_.contiguous(), target = target_.contiguous();
  IndexerKl r;
  r.d_scores = detail::new_output(scores.shape(), scores.dtype(), dev);
  HLM_DISPATCH(op, dev, indexer_kl_loss, scores, target, coeff, reduction, r);
  return r;
}

}  // namespace hlm::ops
