// KDA: the fused pre-processing shared by the CPU references kda_recurrent and kda_chunk
// (ops/cpu/kda.h): q/k L2 norm, beta sigmoid and decay gate, forward and backward.
#include <cmath>

#include "ops/cpu/kda.h"

namespace hlm::ops::cpu {

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
    p.g = ops::kda_gate(ga);
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
    KdaGateGrads gg = ops::kda_gate_backward(ga, g.dg);
    g.dg.copy_(gg.dz);
    if (g.dA_log.defined()) g.dA_log.copy_(gg.dA_log);
    if (g.ddt_bias.defined()) g.ddt_bias.copy_(gg.ddt_bias);
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
}  // namespace hlm::ops::cpu
