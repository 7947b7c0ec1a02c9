// The front doors of the sparse and the dense causal MLA attention (ops/dsa_sparse_attention.h):
// argument checks (the selection becomes a checked pattern, ops/dsa_common.h, built on the host for
// the CPU and on the device for CUDA, ops/cuda/dsa_common.cuh; the causal set is implicit), output
// allocation, and the switch to the CPU reference (ops/cpu/dsa_sparse_attention.cpp; the causal set
// as dsa_detail::causal_pattern) or the CUDA kernels (ops/cuda/dsa_attention.cu; the causal set
// derived on the device).
#include "ops/dsa_sparse_attention.h"

#include <algorithm>
#include <cmath>

#include "ops/cpu/dsa_sparse_attention.h"
#include "ops/cuda/dsa_attention.cuh"
#include "ops/cuda/dsa_common.cuh"
#include "ops/cuda/dsa_select.cuh"
#include "ops/dispatch.h"
#include "ops/dsa_common.h"
#include "ops/op_checks.h"

namespace hlm::ops {
namespace {

struct AttnDims {
  dsa_detail::QueryWindow win;  // the queries' rows of the batch
  std::vector<int64_t> cu;      // the whole batch's offsets (win.cu)
  int64_t T = 0, H = 0, D = 0;
  Device dev = Device::cpu;
};

// The arguments both attentions share (indices: undefined for causal_attention).
AttnDims check_attn(const Tensor& q, const Tensor& kv, const Tensor& indices, const SeqLayout& seqs,
                    int64_t d_v, double scale, const char* op, const std::optional<int64_t>& q0) {
  detail::require_float_dev(q, op, "q");
  HLM_CHECK(q.dim() == 3, "{}: q must be [T, H, D_qk], got {}", op, q.describe());
  AttnDims a;
  a.T = q.size(0), a.H = q.size(1), a.D = q.size(2);
  const int64_t keys = q0 ? seqs.total_tokens() : a.T;
  detail::require_like(kv, q, {keys, a.D}, op, "kv (the latent cache rows [T, D_qk])", "q");
  HLM_CHECK(d_v >= 1 && d_v <= a.D, "{}: d_v must be in [1, D_qk = {}], got {}", op, a.D, d_v);
  HLM_CHECK(std::isfinite(scale) && scale > 0, "{}: scale must be positive and finite, got {}", op,
            scale);
  a.dev = detail::one_device(op, {q, "q"}, {{indices, "indices"}});
  a.win = dsa_detail::window_of(seqs, a.T, q0, op);
  a.cu = a.win.cu;
  return a;
}

// The backward's further arguments: out and d_out go with q, lse is in q's computation dtype.
void check_backward(const AttnDims& a, const Tensor& q, int64_t d_v, const Tensor& out,
                    const Tensor& lse, const Tensor& d_out, const char* op) {
  detail::require_like(out, q, {a.T, a.H, d_v}, op, "out", "q");
  detail::require_compute_like(lse, q, {a.T, a.H}, op, "lse", "q");
  detail::require_like(d_out, q, {a.T, a.H, d_v}, op, "d_out", "q");
}

SparseAttentionOut new_forward_outputs(const AttnDims& a, const Tensor& q, int64_t d_v) {
  return {detail::new_output({a.T, a.H, d_v}, q.dtype(), a.dev),
          detail::new_output({a.T, a.H}, detail::compute_dtype(q.dtype()), a.dev)};
}

SparseAttentionGrads new_grads(const AttnDims& a, const Tensor& q, const Tensor& kv) {
  return {detail::new_output(q.shape(), q.dtype(), a.dev),
          detail::new_output(kv.shape(), q.dtype(), a.dev)};
}

// The checked pattern of the selection, where the op runs: on the host for the CPU reference, on
// the device for the CUDA kernels (the indices are not copied to the host).
struct Selection {
  dsa_detail::Pattern host;
  cuda::DsaPatternDev dev;
};
Selection selection_of(const AttnDims& a, const Tensor& indices, const char* op,
                       bool with_inverse) {
  Selection s;
  if (a.dev == Device::cpu) {
    s.host = dsa_detail::rows_pattern(indices, a.win, 1, op, "indices", with_inverse);
  } else {
    HLM_CUDA_PATH(
        op, s.dev = cuda::device_rows_pattern(indices, a.win, 1, op, "indices", with_inverse));
  }
  return s;
}

// The CPU's dense causal set: every causal token of the query's document, ascending.
dsa_detail::Pattern causal_of(const AttnDims& a) {
  return dsa_detail::causal_pattern(a.win, 1, dsa_detail::max_keys_per_doc(a.cu, 1));
}

}  // namespace

SparseAttentionOut sparse_attention(const Tensor& q_, const Tensor& kv_, const Tensor& indices,
                                    const SeqLayout& seqs, int64_t d_v, double scale,
                                    std::optional<int64_t> q0) {
  const char* op = "sparse_attention";
  const AttnDims a = check_attn(q_, kv_, indices, seqs, d_v, scale, op, q0);
  const Selection p = selection_of(a, indices, op, false);
  const Tensor q = q_.contiguous(), kv = kv_.contiguous();
  SparseAttentionOut r = new_forward_outputs(a, q, d_v);
  if (a.dev == Device::cpu) {
    cpu::sparse_attention(q, kv, p.host, d_v, scale, r.out, r.lse);
  } else {
    HLM_CUDA_PATH(op, cuda::sparse_attention(q, kv, p.dev, d_v, scale, r.out, r.lse));
  }
  return r;
}

SparseAttentionOut sparse_attention_pattern(const Tensor& q_, const Tensor& kv_,
                                            const dsa_detail::Pattern& p_, int64_t d_v,
                                            double scale) {
  const char* op = "sparse_attention_pattern";
  detail::require_float_dev(q_, op, "q");
  HLM_CHECK(q_.dim() == 3 && q_.size(0) == p_.T, "{}: q must be [T = {}, H, D_qk], got {}", op,
            p_.T, q_.describe());
  HLM_CHECK(kv_.defined() && kv_.dim() == 2, "{}: kv must be [R, D_qk], got {}", op,
            kv_.defined() ? kv_.describe() : "undefined");
  AttnDims a;
  a.T = q_.size(0), a.H = q_.size(1), a.D = q_.size(2), a.dev = q_.device();
  detail::require_like(kv_, q_, {kv_.size(0), a.D}, op, "kv (latent rows [R, D_qk])", "q");
  HLM_CHECK(d_v >= 1 && d_v <= a.D, "{}: d_v must be in [1, D_qk = {}], got {}", op, a.D, d_v);
  HLM_CHECK(std::isfinite(scale) && scale > 0, "{}: scale must be positive and finite, got {}", op,
            scale);
  dsa_detail::Pattern p = p_;
  dsa_detail::check_pattern(p, kv_.size(0), op, "the latent rows");
  const Tensor q = q_.contiguous(), kv = kv_.contiguous();
  SparseAttentionOut r = new_forward_outputs(a, q, d_v);
  if (a.dev == Device::cpu) {
    cpu::sparse_attention(q, kv, p, d_v, scale, r.out, r.lse);
  } else {
    HLM_CUDA_PATH(op, cuda::sparse_attention(q, kv, cuda::upload_pattern(p, false), d_v, scale,
                                             r.out, r.lse));
  }
  return r;
}

CachedAttentionOut cached_sparse_attention(const Tensor& q, const Tensor& kv, const Tensor& scores_,
                                           const CachedSelection& s, int64_t d_v, double scale) {
  const char* op = "cached_sparse_attention";
  detail::require_float_dev(q, op, "q");
  const int64_t T = q.dim() == 3 ? q.size(0) : -1, W = s.width();
  HLM_CHECK(T >= 0 && kv.defined() && kv.dim() == 2, "{}: q [T, H, D_qk] and kv [R, D_qk], got {}",
            op, q.describe());
  detail::require_like(kv, q, {kv.size(0), q.size(2)}, op, "kv (latent rows [R, D_qk])", "q");
  HLM_CHECK(d_v >= 1 && d_v <= q.size(2) && std::isfinite(scale) && scale > 0,
            "{}: d_v must be in [1, {}] and scale positive, got {} and {}", op, q.size(2), d_v,
            scale);
  HLM_CHECK(T >= 0 && int64_t(s.pos.size()) == T && int64_t(s.ncand.size()) == T &&
                int64_t(s.seq_of.size()) == T && s.page > 0 && s.P >= 1 && s.K >= s.P &&
                s.K % s.P == 0,
            "{}: q [T, H, D_qk] with T positions, candidate counts and sequences, a page size and "
            "K a multiple of P; got q {}, {} positions, K {}, P {}",
            op, q.describe(), s.pos.size(), s.K, s.P);
  int64_t most = 0;
  for (int64_t t = 0; t < T; ++t) {
    const size_t n = size_t(s.seq_of[size_t(t)]);
    HLM_CHECK(n < s.pages.size() && s.pages[n] &&
                  s.ncand[size_t(t)] == (s.pos[size_t(t)] + 1) / s.P &&
                  int64_t(s.pages[n]->size()) * s.page > s.pos[size_t(t)],
              "{}: query {} (position {}, sequence {}) has no page for its position or a wrong "
              "candidate count",
              op, t, s.pos[size_t(t)], n);
    most = std::max(most, s.ncand[size_t(t)]);
  }
  HLM_CHECK(scores_.defined() && scores_.dim() == 2 && scores_.size(0) == T &&
                scores_.size(1) >= most && scores_.device() == q.device() &&
                scores_.dtype() == detail::compute_dtype(q.dtype()),
            "{}: scores must be a {} [{}, >= {}] tensor on q's device, got {}", op,
            dtype_name(detail::compute_dtype(q.dtype())), T, most,
            scores_.defined() ? scores_.describe() : "undefined");
  // Each query's entries: its selected pools' tokens, then its tail (counts known from pos).
  const int64_t G = s.K / s.P;
  std::vector<int64_t> row_ptr(size_t(T + 1), 0);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t n = s.ncand[size_t(t)], tail = s.tail ? s.pos[size_t(t)] + 1 - n * s.P : 0;
    row_ptr[size_t(t + 1)] = row_ptr[size_t(t)] + std::min(G, n) * s.P + tail;
  }
  auto row_of = [&](int64_t t, int64_t p) {
    const std::vector<int64_t>& pg = *s.pages[size_t(s.seq_of[size_t(t)])];
    return pg[size_t(p / s.page)] * s.page + p % s.page;
  };
  CachedAttentionOut r;
  dsa_detail::Pattern pat;
  pat.T = T, pat.W = W, pat.nkeys = kv.dim() == 2 ? kv.size(0) : 0;
  pat.row_ptr = row_ptr;
  if (q.is_cpu()) {
    const Tensor scores = scores_.contiguous();
    std::vector<int32_t> sel(size_t(T * W), -1), best;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t n = s.ncand[size_t(t)];
      if (scores.dtype() == DType::f64)
        dsa_detail::best_indices(scores.data<double>() + t * scores.size(1), n, G, best);
      else
        dsa_detail::best_indices(scores.data<float>() + t * scores.size(1), n, G, best);
      int32_t* row = sel.data() + t * W;
      for (size_t g = 0; g < best.size(); ++g)
        for (int64_t i = 0; i < s.P; ++i) row[int64_t(g) * s.P + i] = int32_t(best[g] * s.P + i);
      if (s.tail)
        for (int64_t i = 0; n * s.P + i <= s.pos[size_t(t)]; ++i)
          row[s.K + i] = int32_t(n * s.P + i);
      for (int64_t j = 0; j < W; ++j)
        if (row[j] >= 0) {
          pat.slot.push_back(int32_t(j));
          pat.key.push_back(row_of(t, row[j]));
          pat.query.push_back(t);
        }
    }
    const SparseAttentionOut a = sparse_attention_pattern(q, kv, pat, d_v, scale);
    r.out = a.out, r.lse = a.lse;
    r.sel = Tensor::from_vector<int32_t>({T, W}, sel);
    return r;
  }
  HLM_CUDA_PATH(op, {
    auto up = [](const std::vector<int64_t>& v, const Shape& shape) {
      return Tensor::from_vector<int64_t>(shape, v).to(Device::cuda);
    };
    cuda::DsaPatternDev d = cuda::pattern_for_entries(T, W, pat.nkeys, row_ptr);
    r.sel = detail::new_output({T, W}, DType::i32, Device::cuda);
    cuda::cached_select(scores_.contiguous(), up(s.ncand, {T}), up(s.pos, {T}), up(s.seq_of, {T}),
                        cuda::upload_page_table(s.pages), s.page, s.K, s.P, d.row_ptr, r.sel,
                        d.slot, d.key, d.query);
    r.out = detail::new_output({T, q.size(1), d_v}, q.dtype(), Device::cuda);
    r.lse = detail::new_output({T, q.size(1)}, detail::compute_dtype(q.dtype()), Device::cuda);
    cuda::sparse_attention(q.contiguous(), kv.contiguous(), d, d_v, scale, r.out, r.lse);
  });
  return r;
}

SparseAttentionGrads sparse_attention_backward(const Tensor& q_, const Tensor& kv_,
                                               const Tensor& indices, const SeqLayout& seqs,
                                               int64_t d_v, double scale, const Tensor& out_,
                                               const Tensor& lse_, const Tensor& d_out_,
                                               std::optional<int64_t> q0) {
  const char* op = "sparse_attention_backward";
  const AttnDims a = check_attn(q_, kv_, indices, seqs, d_v, scale, op, q0);
  const Selection p = selection_of(a, indices, op, true);
  check_backward(a, q_, d_v, out_, lse_, d_out_, op);
  const Tensor q = q_.contiguous(), kv = kv_.contiguous(), out = out_.contiguous(),
               lse = lse_.contiguous(), d_out = d_out_.contiguous();
  SparseAttentionGrads g = new_grads(a, q, kv);
  if (a.dev == Device::cpu) {
    cpu::sparse_attention_backward(q, kv, p.host, d_v, scale, out, lse, d_out, g.dq, g.dkv);
  } else {
    HLM_CUDA_PATH(op, cuda::sparse_attention_backward(q, kv, p.dev, d_v, scale, out, lse, d_out,
                                                      g.dq, g.dkv));
  }
  return g;
}

SparseAttentionOut causal_attention(const Tensor& q_, const Tensor& kv_, const SeqLayout& seqs,
                                    int64_t d_v, double scale, std::optional<int64_t> q0) {
  const char* op = "causal_attention";
  const AttnDims a = check_attn(q_, kv_, Tensor(), seqs, d_v, scale, op, q0);
  const Tensor q = q_.contiguous(), kv = kv_.contiguous();
  SparseAttentionOut r = new_forward_outputs(a, q, d_v);
  if (a.dev == Device::cpu) {
    cpu::sparse_attention(q, kv, causal_of(a), d_v, scale, r.out, r.lse);
  } else {
    HLM_CUDA_PATH(op, cuda::causal_attention(q, kv, a.win, d_v, scale, r.out, r.lse));
  }
  return r;
}

SparseAttentionGrads causal_attention_backward(const Tensor& q_, const Tensor& kv_,
                                               const SeqLayout& seqs, int64_t d_v, double scale,
                                               const Tensor& out_, const Tensor& lse_,
                                               const Tensor& d_out_, std::optional<int64_t> q0) {
  const char* op = "causal_attention_backward";
  const AttnDims a = check_attn(q_, kv_, Tensor(), seqs, d_v, scale, op, q0);
  check_backward(a, q_, d_v, out_, lse_, d_out_, op);
  const Tensor q = q_.contiguous(), kv = kv_.contiguous(), out = out_.contiguous(),
               lse = lse_.contiguous(), d_out = d_out_.contiguous();
  SparseAttentionGrads g = new_grads(a, q, kv);
  if (a.dev == Device::cpu) {
    cpu::sparse_attention_backward(q, kv, causal_of(a), d_v, scale, out, lse, d_out, g.dq, g.dkv);
  } else {
    HLM_CUDA_PATH(op, cuda::causal_attention_backward(q, kv, a.win, d_v, scale, out, lse, d_out,
                                                      g.dq, g.dkv));
  }
  return g;
}

}  // namespace hlm::ops
