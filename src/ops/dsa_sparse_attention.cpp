// The front door of the sparse MLA attention (ops/dsa_sparse_attention.h): argument checks (the
// selection becomes a checked pattern, ops/dsa_common.h), output allocation, and the switch to the
// CPU reference (ops/cpu/dsa_sparse_attention.cpp). No CUDA implementation yet.
#include "ops/dsa_sparse_attention.h"

#include <cmath>

#include "ops/cpu/dsa_sparse_attention.h"
#include "ops/dispatch.h"
#include "ops/dsa_common.h"
#include "ops/op_checks.h"

namespace hlm::ops {
namespace {

struct AttnDims {
  std::vector<int64_t> cu;
  int64_t T = 0, H = 0, D = 0;
  Device dev = Device::cpu;
};

AttnDims check_attn(const Tensor& q, const Tensor& kv, const Tensor& indices, const SeqLayout& seqs,
                    int64_t d_v, double scale, const char* op) {
  detail::require_real(q, op, "q");
  HLM_CHECK(q.dim() == 3, "{}: q must be [T, H, D_qk], got {}", op, q.describe());
  AttnDims a;
  a.T = q.size(0), a.H = q.size(1), a.D = q.size(2);
  detail::require_real_like(kv, q, {a.T, a.D}, op, "kv (the latent cache rows [T, D_qk])", "q");
  HLM_CHECK(d_v >= 1 && d_v <= a.D, "{}: d_v must be in [1, D_qk = {}], got {}", op, a.D, d_v);
  HLM_CHECK(std::isfinite(scale) && scale > 0, "{}: scale must be positive and finite, got {}", op,
            scale);
  a.dev = detail::one_device(op, {q, "q"}, {{indices, "indices"}});
  a.cu = dsa_detail::seq_offsets(seqs, a.T, op);
  return a;
}

}  // namespace

SparseAttentionOut sparse_attention(const Tensor& q_, const Tensor& kv_, const Tensor& indices,
                                    const SeqLayout& seqs, int64_t d_v, double scale) {
  const char* op = "sparse_attention";
  const AttnDims a = check_attn(q_, kv_, indices, seqs, d_v, scale, op);
  const dsa_detail::Pattern p = dsa_detail::rows_pattern(indices, a.cu, 1, op, "indices");
  const Tensor q = q_.contiguous(), kv = kv_.contiguous();
  SparseAttentionOut r{detail::new_output({a.T, a.H, d_v}, q.dtype(), a.dev),
                       detail::new_output({a.T, a.H}, q.dtype(), a.dev)};
  detail::cpu_only(op, q, "q");
  cpu::sparse_attention(q, kv, p, d_v, scale, r.out, r.lse);
  return r;
}

SparseAttentionGrads sparse_attention_backward(const Tensor& q_, const Tensor& kv_,
                                               const Tensor& indices, const SeqLayout& seqs,
                                               int64_t d_v, double scale, const Tensor& out_,
                                               const Tensor& lse_, const Tensor& d_out_) {
  const char* op = "sparse_attention_backward";
  const AttnDims a = check_attn(q_, kv_, indices, seqs, d_v, scale, op);
  const dsa_detail::Pattern p = dsa_detail::rows_pattern(indices, a.cu, 1, op, "indices");
  detail::require_real_like(out_, q_, {a.T, a.H, d_v}, op, "out", "q");
  detail::require_real_like(lse_, q_, {a.T, a.H}, op, "lse", "q");
  detail::require_real_like(d_out_, q_, {a.T, a.H, d_v}, op, "d_out", "q");
  const Tensor q = q_.contiguous(), kv = kv_.contiguous(), out = out_.contiguous(),
               lse = lse_.contiguous(), d_out = d_out_.contiguous();
  SparseAttentionGrads g{detail::new_output(q.shape(), q.dtype(), a.dev),
                         detail::new_output(kv.shape(), q.dtype(), a.dev)};
  detail::cpu_only(op, q, "q");
  cpu::sparse_attention_backward(q, kv, p, d_v, scale, out, lse, d_out, g.dq, g.dkv);
  return g;
}

}  // namespace hlm::ops
