// CPU reference of the sparse MLA attention (see ops/dsa_sparse_attention.h).
#include <cmath>
#include <limits>

#include "ops/dsa_common.h"
#include "ops/dsa_sparse_attention.h"
#include "ops/op_checks.h"

namespace hlm::ops {
namespace {

using dsa_detail::Pattern;

struct AttnArgs {
  Tensor q, kv;
  std::vector<int64_t> cu;
  int64_t T = 0, H = 0, D = 0, dv = 0;
};

AttnArgs check_attn(const Tensor& q, const Tensor& kv, const Tensor& cu_seqlens, int64_t d_v,
                    double scale, const char* op) {
  detail::require_float(q, op, "q");
  detail::require_float(kv, op, "kv");
  detail::require_same_dtype(kv, q, op, "kv", "q");
  HLM_CHECK(q.dim() == 3, "{}: q must be [T, H, D_qk], got {}", op, q.describe());
  AttnArgs a;
  a.T = q.size(0), a.H = q.size(1), a.D = q.size(2), a.dv = d_v;
  detail::require_shape(kv, {a.T, a.D}, op, "kv (the latent cache rows [T, D_qk])");
  HLM_CHECK(d_v >= 1 && d_v <= a.D, "{}: d_v must be in [1, D_qk = {}], got {}", op, a.D, d_v);
  HLM_CHECK(std::isfinite(scale) && scale > 0, "{}: scale must be positive and finite, got {}", op,
            scale);
  a.cu = dsa_detail::read_cu_seqlens(cu_seqlens, a.T, op);
  a.q = q.contiguous(), a.kv = kv.contiguous();
  return a;
}

template <class F>
inline F dotp(const F* a, const F* b, int64_t n) {
  F s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

template <class F>
void attn_fwd(const AttnArgs& a, const Pattern& p, F scale, SparseAttentionOut& r) {
  const F* q = a.q.data<F>();
  const F* kv = a.kv.data<F>();
  F* out = r.out.data<F>();
  F* lse = r.lse.data<F>();
  const int64_t H = a.H, D = a.D, dv = a.dv;
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t t = 0; t < a.T; ++t) {
    const int64_t e0 = p.row_ptr[size_t(t)], n = p.row_ptr[size_t(t + 1)] - e0;
    std::vector<F> l(static_cast<size_t>(n));
    for (int64_t h = 0; h < H; ++h) {
      const F* qr = q + (t * H + h) * D;
      F* o = out + (t * H + h) * dv;
      for (int64_t c = 0; c < dv; ++c) o[c] = 0;
      if (n == 0) {
        lse[t * H + h] = -std::numeric_limits<F>::infinity();
        continue;
      }
      F m = -std::numeric_limits<F>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        l[size_t(j)] = scale * dotp(qr, kv + p.key[size_t(e0 + j)] * D, D);
        m = std::max(m, l[size_t(j)]);
      }
      F sum = 0;
      for (int64_t j = 0; j < n; ++j) {
        l[size_t(j)] = std::exp(l[size_t(j)] - m);
        sum += l[size_t(j)];
      }
      for (int64_t j = 0; j < n; ++j) {
        const F pj = l[size_t(j)] / sum;
        const F* v = kv + p.key[size_t(e0 + j)] * D;
        for (int64_t c = 0; c < dv; ++c) o[c] += pj * v[c];
      }
      lse[t * H + h] = m + std::log(sum);
    }
  }
}

template <class F>
SparseAttentionGrads attn_bwd(const AttnArgs& a, const Pattern& p, F scale, const Tensor& out_in,
                              const Tensor& lse_in, const Tensor& dout_in) {
  const Tensor out_c = out_in.contiguous(), lse_c = lse_in.contiguous(),
               dout_c = dout_in.contiguous();
  const F* q = a.q.data<F>();
  const F* kv = a.kv.data<F>();
  const F* out = out_c.data<F>();
  const F* lse = lse_c.data<F>();
  const F* dout = dout_c.data<F>();
  const int64_t H = a.H, D = a.D, dv = a.dv;
  SparseAttentionGrads g;
  g.dq = Tensor::zeros({a.T, H, D}, a.q.dtype());
  g.dkv = Tensor::zeros({a.T, D}, a.q.dtype());
  F* dq = g.dq.data<F>();
  F* dkv = g.dkv.data<F>();
  // Per (entry, head): the probability p and the logit gradient ds (scale folded in later).
  std::vector<F> P(static_cast<size_t>(p.entries() * H)), dS(size_t(p.entries() * H));
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t t = 0; t < a.T; ++t) {
    const int64_t e0 = p.row_ptr[size_t(t)], e1 = p.row_ptr[size_t(t + 1)];
    for (int64_t h = 0; h < H; ++h) {
      const F* qr = q + (t * H + h) * D;
      const F* dor = dout + (t * H + h) * dv;
      const F Dt = dotp(dor, out + (t * H + h) * dv, dv);
      const F L = lse[t * H + h];
      F* dqr = dq + (t * H + h) * D;
      for (int64_t e = e0; e < e1; ++e) {
        const F* k = kv + p.key[size_t(e)] * D;
        const F pj = std::exp(scale * dotp(qr, k, D) - L);
        const F ds = pj * (dotp(dor, k, dv) - Dt);
        P[size_t(e * H + h)] = pj;
        dS[size_t(e * H + h)] = ds;
        for (int64_t c = 0; c < D; ++c) dqr[c] += ds * k[c];
      }
      for (int64_t c = 0; c < D; ++c) dqr[c] *= scale;
    }
  }
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t s = 0; s < a.T; ++s) {
    F* dk = dkv + s * D;
    std::vector<F> acc_k(size_t(D), F(0));
    for (int64_t i = p.key_ptr[size_t(s)]; i < p.key_ptr[size_t(s + 1)]; ++i) {
      const int64_t e = p.key_entry[size_t(i)], t = p.query[size_t(e)];
      for (int64_t h = 0; h < H; ++h) {
        const F ds = dS[size_t(e * H + h)], pj = P[size_t(e * H + h)];
        const F* qr = q + (t * H + h) * D;
        const F* dor = dout + (t * H + h) * dv;
        for (int64_t c = 0; c < D; ++c) acc_k[size_t(c)] += ds * qr[c];
        for (int64_t c = 0; c < dv; ++c) dk[c] += pj * dor[c];
      }
    }
    for (int64_t c = 0; c < D; ++c) dk[c] += scale * acc_k[size_t(c)];
  }
  return g;
}

}  // namespace

SparseAttentionOut sparse_attention(const Tensor& q, const Tensor& kv, const Tensor& indices,
                                    const Tensor& cu_seqlens, int64_t d_v, double scale) {
  const char* op = "sparse_attention";
  const AttnArgs a = check_attn(q, kv, cu_seqlens, d_v, scale, op);
  const Pattern p = dsa_detail::rows_pattern(indices, a.cu, 1, op, "indices");
  SparseAttentionOut r;
  r.out = Tensor::empty({a.T, a.H, d_v}, q.dtype());
  r.lse = Tensor::empty({a.T, a.H}, q.dtype());
  if (q.dtype() == DType::f64)
    attn_fwd<double>(a, p, scale, r);
  else
    attn_fwd<float>(a, p, float(scale), r);
  return r;
}

SparseAttentionGrads sparse_attention_backward(const Tensor& q, const Tensor& kv,
                                               const Tensor& indices, const Tensor& cu_seqlens,
                                               int64_t d_v, double scale, const Tensor& out,
                                               const Tensor& lse, const Tensor& d_out) {
  const char* op = "sparse_attention_backward";
  const AttnArgs a = check_attn(q, kv, cu_seqlens, d_v, scale, op);
  const Pattern p = dsa_detail::rows_pattern(indices, a.cu, 1, op, "indices");
  for (const auto& [t, name] :
       {std::pair{&out, "out"}, std::pair{&lse, "lse"}, std::pair{&d_out, "d_out"}}) {
    detail::require_float(*t, op, name);
    detail::require_same_dtype(*t, q, op, name, "q");
  }
  detail::require_shape(out, {a.T, a.H, d_v}, op, "out");
  detail::require_shape(d_out, {a.T, a.H, d_v}, op, "d_out");
  detail::require_shape(lse, {a.T, a.H}, op, "lse");
  return q.dtype() == DType::f64 ? attn_bwd<double>(a, p, scale, out, lse, d_out)
                                 : attn_bwd<float>(a, p, float(scale), out, lse, d_out);
}

}  // namespace hlm::ops
