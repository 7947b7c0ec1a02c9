// The sparse MLA attention on the CPU (ops/dsa_sparse_attention.h, the reference; entry points
// in ops/cpu/dsa_sparse_attention.h).
#include "ops/cpu/dsa_sparse_attention.h"

#include <cmath>
#include <limits>
#include <vector>

#include "ops/op_checks.h"

namespace hlm::ops::cpu {
namespace {

using dsa_detail::dot;
using dsa_detail::Pattern;

struct AttnArgs {
  Tensor q, kv;
  int64_t T = 0, H = 0, D = 0, dv = 0;
};

template <class F>
void attn_fwd(const AttnArgs& a, const Pattern& p, F scale, Tensor& out_t, Tensor& lse_t) {
  const F* q = a.q.data<F>();
  const F* kv = a.kv.data<F>();
  F* out = out_t.data<F>();
  F* lse = lse_t.data<F>();
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
        l[size_t(j)] = scale * dot(qr, kv + p.key[size_t(e0 + j)] * D, D);
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
void attn_bwd(const AttnArgs& a, const Pattern& p, F scale, const Tensor& out_t,
              const Tensor& lse_t, const Tensor& dout_t, Tensor& dq_t, Tensor& dkv_t) {
  const F* q = a.q.data<F>();
  const F* kv = a.kv.data<F>();
  const F* out = out_t.data<F>();
  const F* lse = lse_t.data<F>();
  const F* dout = dout_t.data<F>();
  const int64_t H = a.H, D = a.D, dv = a.dv;
  dq_t.zero_();
  dkv_t.zero_();
  F* dq = dq_t.data<F>();
  F* dkv = dkv_t.data<F>();
  // Per (entry, head): the probability p and the logit gradient ds (scale folded in later).
  std::vector<F> P(static_cast<size_t>(p.entries() * H)), dS(size_t(p.entries() * H));
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t t = 0; t < a.T; ++t) {
    const int64_t e0 = p.row_ptr[size_t(t)], e1 = p.row_ptr[size_t(t + 1)];
    for (int64_t h = 0; h < H; ++h) {
      const F* qr = q + (t * H + h) * D;
      const F* dor = dout + (t * H + h) * dv;
      const F Dt = dot(dor, out + (t * H + h) * dv, dv);
      const F L = lse[t * H + h];
      F* dqr = dq + (t * H + h) * D;
      for (int64_t e = e0; e < e1; ++e) {
        const F* k = kv + p.key[size_t(e)] * D;
        const F pj = std::exp(scale * dot(qr, k, D) - L);
        const F ds = pj * (dot(dor, k, dv) - Dt);
        P[size_t(e * H + h)] = pj;
        dS[size_t(e * H + h)] = ds;
        for (int64_t c = 0; c < D; ++c) dqr[c] += ds * k[c];
      }
      for (int64_t c = 0; c < D; ++c) dqr[c] *= scale;
    }
  }
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t s = 0; s < p.nkeys; ++s) {
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
}

AttnArgs args_of(const Tensor& q, const Tensor& kv, int64_t d_v) {
  AttnArgs a;
  a.q = q, a.kv = kv;
  a.T = q.size(0), a.H = q.size(1), a.D = q.size(2), a.dv = d_v;
  return a;
}

}  // namespace

void sparse_attention(const Tensor& q, const Tensor& kv, const Pattern& p, int64_t d_v,
                      double scale, Tensor& out, Tensor& lse) {
  const AttnArgs a = args_of(q, kv, d_v);
  if (q.dtype() == DType::f64)
    attn_fwd<double>(a, p, scale, out, lse);
  else
    attn_fwd<float>(a, p, float(scale), out, lse);
}

void sparse_attention_backward(const Tensor& q, const Tensor& kv, const Pattern& p, int64_t d_v,
                               double scale, const Tensor& out, const Tensor& lse,
                               const Tensor& d_out, Tensor& dq, Tensor& dkv) {
  const AttnArgs a = args_of(q, kv, d_v);
  if (q.dtype() == DType::f64)
    attn_bwd<double>(a, p, scale, out, lse, d_out, dq, dkv);
  else
    attn_bwd<float>(a, p, float(scale), out, lse, d_out, dq, dkv);
}

}  // namespace hlm::ops::cpu
