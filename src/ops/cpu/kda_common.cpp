// KDA: argument checks and the fused pre-processing shared by kda_recurrent and kda_chunk.
#include <cmath>

#include "ops/kda.h"
#include "ops/op_checks.h"

namespace hlm::ops {

KdaDims kda_check(const KdaArgs& a, const char* op) {
  auto req = [&](const Tensor& t, const char* what, int64_t nd, const char* shape) {
    HLM_CHECK(t.defined(), "{}: {} is undefined", op, what);
    detail::require_cpu(t, op, what);
    HLM_CHECK(is_floating(t.dtype()), "{}: {} must be floating point, got {}", op, what,
              t.describe());
    HLM_CHECK(t.dim() == nd, "{}: {} must be {}, got {}", op, what, shape, t.describe());
  };
  req(a.q, "q", 3, "[T, H, K]");
  req(a.k, "k", 3, "[T, H, K]");
  req(a.v, "v", 3, "[T, HV, V]");
  req(a.g, "g", 3, "[T, HV, K]");
  req(a.beta, "beta", 2, "[T, HV]");
  KdaDims d;
  d.T = a.q.size(0), d.H = a.q.size(1), d.K = a.q.size(2);
  d.HV = a.v.size(1), d.V = a.v.size(2);
  HLM_CHECK(d.H > 0 && d.K > 0 && d.HV > 0 && d.V > 0, "{}: empty head dims: q {}, v {}", op,
            a.q.describe(), a.v.describe());
  detail::require_shape(a.k, a.q.shape(), op, "k");
  HLM_CHECK(a.v.size(0) == d.T, "{}: v must be [T={}, HV, V], got {}", op, d.T, a.v.describe());
  HLM_CHECK(d.HV % d.H == 0, "{}: value heads HV={} (v) must be a multiple of qk heads H={} (q)",
            op, d.HV, d.H);
  detail::require_shape(a.g, {d.T, d.HV, d.K}, op, "g");
  detail::require_shape(a.beta, {d.T, d.HV}, op, "beta");
  for (auto* p : {&a.k, &a.v, &a.g, &a.beta})
    detail::require_same_dtype(*p, a.q, op,
                               p == &a.k   ? "k"
                               : p == &a.v ? "v"
                               : p == &a.g ? "g"
                                           : "beta",
                               "q");
  if (a.cu_seqlens.defined()) {
    detail::require_index(a.cu_seqlens, op, "cu_seqlens");
    HLM_CHECK(a.cu_seqlens.dim() == 1 && a.cu_seqlens.size(0) >= 2,
              "{}: cu_seqlens must be [N+1] with N >= 1, got {}", op, a.cu_seqlens.describe());
    d.cu = detail::index_values(a.cu_seqlens);
    HLM_CHECK(d.cu[0] == 0, "{}: cu_seqlens must start at 0, got {}", op, d.cu[0]);
    for (size_t i = 1; i < d.cu.size(); ++i)
      HLM_CHECK(d.cu[i] >= d.cu[i - 1],
                "{}: cu_seqlens must be non-decreasing, got {} then {} at {}", op, d.cu[i - 1],
                d.cu[i], i);
    HLM_CHECK(d.cu.back() == d.T, "{}: cu_seqlens must end at T={}, got {}", op, d.T, d.cu.back());
  } else {
    d.cu = {0, d.T};
  }
  d.N = int64_t(d.cu.size()) - 1;
  if (a.initial_state.defined()) {
    detail::require_float(a.initial_state, op, "initial_state");
    detail::require_shape(a.initial_state, {d.N, d.HV, d.K, d.V}, op, "initial_state");
  }
  if (a.gate) {
    HLM_CHECK(a.A_log.defined() || *a.gate == KdaGateKind::lower_bound,
              "{}: A_log [HV] is required with the standard gate", op);
    if (a.A_log.defined()) detail::require_shape(a.A_log, {d.HV}, op, "A_log");
    if (a.dt_bias.defined()) detail::require_shape(a.dt_bias, {d.HV * d.K}, op, "dt_bias");
    if (*a.gate == KdaGateKind::lower_bound)
      HLM_CHECK(a.lower_bound >= -5.0 && a.lower_bound < 0.0,
                "{}: lower_bound must lie in [-5, 0), got {}", op, a.lower_bound);
  }
  HLM_CHECK(std::isfinite(a.scale), "{}: scale must be finite, got {}", op, a.scale);
  d.scale = a.scale > 0 ? a.scale : 1.0 / std::sqrt(double(d.K));
  return d;
}

namespace kda_detail {
namespace {

template <class T>
T sigm(T x) {
  if (x >= 0) return T(1) / (T(1) + std::exp(-x));
  const T e = std::exp(x);
  return e / (T(1) + e);
}

template <class T>
void l2norm_fwd(Tensor& x, Tensor& rstd, int64_t rows, int64_t K) {
  T* p = x.data<T>();
  T* r = rstd.data<T>();
#pragma omp parallel for schedule(static) if (rows * K >= (1 << 16))
  for (int64_t i = 0; i < rows; ++i) {
    T s = 0;
    for (int64_t c = 0; c < K; ++c) s += p[i * K + c] * p[i * K + c];
    const T rs = T(1) / std::sqrt(s + T(kKdaL2Eps));
    r[i] = rs;
    for (int64_t c = 0; c < K; ++c) p[i * K + c] *= rs;
  }
}

// dx = rstd (dxh - xh (xh . dxh)), in place on dx.
template <class T>
void l2norm_bwd(Tensor& dx, const Tensor& xh, const Tensor& rstd, int64_t rows, int64_t K) {
  T* d = dx.data<T>();
  const T* x = xh.data<T>();
  const T* r = rstd.data<T>();
#pragma omp parallel for schedule(static) if (rows * K >= (1 << 16))
  for (int64_t i = 0; i < rows; ++i) {
    T s = 0;
    for (int64_t c = 0; c < K; ++c) s += x[i * K + c] * d[i * K + c];
    for (int64_t c = 0; c < K; ++c) d[i * K + c] = r[i] * (d[i * K + c] - x[i * K + c] * s);
  }
}

KdaGateArgs gate_args(const KdaArgs& a) {
  KdaGateArgs ga;
  ga.z = a.g;
  ga.A_log = a.A_log;
  ga.dt_bias = a.dt_bias;
  ga.kind = *a.gate;
  ga.lower_bound = a.lower_bound;
  return ga;
}

template <class T>
Prepared prepare_t(const KdaArgs& a, const KdaDims& d, DType dt) {
  Prepared p;
  p.q = a.q.to(dt);
  p.k = a.k.to(dt);
  if (a.use_qk_l2norm) {
    p.q_rstd = Tensor::empty({d.T, d.H}, dt);
    p.k_rstd = Tensor::empty({d.T, d.H}, dt);
    l2norm_fwd<T>(p.q, p.q_rstd, d.T * d.H, d.K);
    l2norm_fwd<T>(p.k, p.k_rstd, d.T * d.H, d.K);
  }
  if (a.gate) {
    KdaGateArgs ga = gate_args(a);
    ga.z = a.g.to(dt);
    p.g = kda_gate(ga);
  } else {
    p.g = a.g.to(dt);
  }
  p.beta = a.beta.to(dt);
  if (a.beta_logits) {
    T* b = p.beta.data<T>();
    for (int64_t i = 0; i < d.T * d.HV; ++i) b[i] = sigm(b[i]);
  }
  p.h0 =
      a.initial_state.defined() ? a.initial_state.to(dt) : Tensor::zeros({d.N, d.HV, d.K, d.V}, dt);
  return p;
}

template <class T>
void finish_t(const KdaArgs& a, const KdaDims& d, const Prepared& p, KdaGrads& g) {
  if (a.use_qk_l2norm) {
    l2norm_bwd<T>(g.dq, p.q, p.q_rstd, d.T * d.H, d.K);
    l2norm_bwd<T>(g.dk, p.k, p.k_rstd, d.T * d.H, d.K);
  }
  if (a.beta_logits) {
    T* db = g.dbeta.data<T>();
    const T* b = p.beta.data<T>();
    for (int64_t i = 0; i < d.T * d.HV; ++i) db[i] *= b[i] * (T(1) - b[i]);
  }
  if (a.gate) {
    KdaGateArgs ga = gate_args(a);
    ga.z = a.g.to(p.g.dtype());
    KdaGateGrads gg = kda_gate_backward(ga, g.dg);
    g.dg = gg.dz;
    g.dA_log = gg.dA_log;
    g.ddt_bias = gg.ddt_bias;
  }
}

}  // namespace

Prepared prepare(const KdaArgs& a, const KdaDims& d, DType dt) {
  return dt == DType::f64 ? prepare_t<double>(a, d, dt) : prepare_t<float>(a, d, dt);
}

void finish_grads(const KdaArgs& a, const KdaDims& d, const Prepared& p, KdaGrads& g) {
  if (p.q.dtype() == DType::f64)
    finish_t<double>(a, d, p, g);
  else
    finish_t<float>(a, d, p, g);
}

}  // namespace kda_detail
}  // namespace hlm::ops
