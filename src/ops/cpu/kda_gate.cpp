// The KDA decay gate on the CPU (ops/kda_gate.h, the reference; entry points in
// ops/cpu/kda_gate.h), in the computation dtype T (f64 for f64 z, else f32), x = z + dt_bias,
// eA = exp(A_log[h]) (1 without A_log):
//   standard:    g = -eA softplus(x)       dz = -eA sigmoid(x) dg    dA_log = sum dg g
//   lower_bound: g = lb sigmoid(eA x)      dz = dg lb s(1-s) eA      dA_log = sum dz x
// with 0 * anything = 0. Sums run over tokens in order (dA_log also over the channels).
#include "ops/cpu/kda_gate.h"

#include <cmath>

#include "ops/activations.h"
#include "ops/op_checks.h"

namespace hlm::ops::cpu {
namespace {

template <class T>
T softplus(T x) {
  return x > T(20) ? x : std::log1p(std::exp(x));
}
// a * b with 0 * anything = 0 (guards 0 * inf).
template <class T>
T mul0(T a, T b) {
  return (a == T(0) || b == T(0)) ? T(0) : a * b;
}

struct GateDims {
  int64_t T, HV, K;
  DType dt;
};

GateDims dims_of(const KdaGateArgs& a) {
  return {a.z.size(0), a.z.size(1), a.z.size(2), detail::compute_dtype(a.z.dtype())};
}

template <class T>
struct GateData {
  Tensor zc, Ac, bc;
  const T *z, *A = nullptr, *b = nullptr;
  GateData(const KdaGateArgs& a, DType dt) {
    zc = a.z.to(dt);
    z = zc.data<T>();
    if (a.A_log.defined()) Ac = a.A_log.to(dt), A = Ac.data<T>();
    if (a.dt_bias.defined()) bc = a.dt_bias.to(dt), b = bc.data<T>();
  }
};

// For every element i = (t, h, c), tokens in parallel: eA = exp(A_log[h]) (1 without A_log) and
// the gate input x = z[i] + dt_bias[h, c], handed to fn(i, eA, x).
template <class T, class Fn>
void for_each_gate_input(const GateData<T>& in, const GateDims& d, Fn&& fn) {
#pragma omp parallel for schedule(static) if (d.T * d.HV * d.K >= (1 << 16))
  for (int64_t t = 0; t < d.T; ++t)
    for (int64_t h = 0; h < d.HV; ++h) {
      const T eA = in.A ? std::exp(in.A[h]) : T(1);
      for (int64_t c = 0; c < d.K; ++c) {
        const int64_t i = (t * d.HV + h) * d.K + c;
        fn(i, eA, in.z[i] + (in.b ? in.b[h * d.K + c] : T(0)));
      }
    }
}

template <class T>
void gate_fwd(const KdaGateArgs& a, const GateDims& d, Tensor& g) {
  GateData<T> in(a, d.dt);
  T* out = g.data<T>();
  const bool std_gate = a.kind == KdaGateKind::standard;
  const T lb = T(a.lower_bound);
  for_each_gate_input(in, d, [&](int64_t i, T eA, T x) {
    out[i] = std_gate ? -mul0(eA, softplus(x)) : lb * sigmoid_scalar(mul0(eA, x));
  });
}

template <class T>
void gate_bwd(const KdaGateArgs& a, const GateDims& d, const Tensor& dg_in, KdaGateGrads& r) {
  GateData<T> in(a, d.dt);
  Tensor dgc = dg_in.to(d.dt);
  const T* dy = dgc.data<T>();
  T* dz = r.dz.data<T>();
  const bool std_gate = a.kind == KdaGateKind::standard;
  const T lb = T(a.lower_bound);
  // Per element: dz, and the dA_log summand (standard: dy * g; lower bound: dz * x).
  Tensor dAel = Tensor::empty({d.T, d.HV, d.K}, d.dt);
  T* dae = dAel.data<T>();
  for_each_gate_input(in, d, [&](int64_t i, T eA, T x) {
    if (std_gate) {
      const T g = -mul0(eA, softplus(x));
      dz[i] = -mul0(mul0(eA, sigmoid_scalar(x)), dy[i]);
      dae[i] = mul0(dy[i], g);
    } else {
      const T y = mul0(eA, x);
      const T ds = sigmoid_scalar(y) * sigmoid_scalar(-y);  // s (1 - s) without cancellation
      dz[i] = mul0(mul0(dy[i] * lb, ds), eA);
      dae[i] = mul0(dz[i], x);
    }
  });
  if (in.A) {
    T* dA = r.dA_log.data<T>();
#pragma omp parallel for schedule(static) if (d.T * d.HV * d.K >= (1 << 16))
    for (int64_t h = 0; h < d.HV; ++h) {
      T s = 0;
      for (int64_t t = 0; t < d.T; ++t)
        for (int64_t c = 0; c < d.K; ++c) s += dae[(t * d.HV + h) * d.K + c];
      dA[h] = s;
    }
  }
  if (in.b) {
    T* db = r.ddt_bias.data<T>();
#pragma omp parallel for schedule(static) if (d.T * d.HV * d.K >= (1 << 16))
    for (int64_t j = 0; j < d.HV * d.K; ++j) {
      T s = 0;
      for (int64_t t = 0; t < d.T; ++t) s += dz[t * d.HV * d.K + j];
      db[j] = s;
    }
  }
}

}  // namespace

void kda_gate_forward(const KdaGateArgs& a, Tensor& g) {
  const GateDims d = dims_of(a);
  detail::dispatch_float(d.dt, [&](auto tag) { gate_fwd<decltype(tag)>(a, d, g); });
}

void kda_gate_backward(const KdaGateArgs& a, const Tensor& dg, KdaGateGrads& r) {
  const GateDims d = dims_of(a);
  detail::dispatch_float(d.dt, [&](auto tag) { gate_bwd<decltype(tag)>(a, d, dg, r); });
}

}  // namespace hlm::ops::cpu
