// CPU implementation of the KDA decay gate (ops/kda_gate.h).
#include <cmath>

#include "ops/kda_gate.h"
#include "ops/layer_ops_cuda.h"
#include "ops/op_checks.h"

namespace hlm::ops {
namespace {

template <class T>
T sigmoid(T x) {
  if (x >= 0) return T(1) / (T(1) + std::exp(-x));
  const T e = std::exp(x);
  return e / (T(1) + e);
}
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

// On CUDA (z f32 / f64 / bf16, contiguous), the parameters and dg must be contiguous tensors of
// the computation dtype on z's device (the CPU converts them).
void check_on_device(const Tensor& t, const Tensor& z, DType dt, const char* op, const char* what) {
  detail::require_same_device(t, z, op, what, "z");
  if (z.device() == Device::cpu) return;
  HLM_CHECK(t.dtype() == dt, "{}: {} must be {} on CUDA, got {}", op, what, dtype_name(dt),
            t.describe());
  HLM_CHECK(t.numel() == 0 || t.is_contiguous(), "{}: {} must be contiguous on CUDA, got {}", op,
            what, t.describe());
}

GateDims check_gate(const KdaGateArgs& a, const char* op) {
  HLM_CHECK(a.z.defined(), "{}: z is undefined", op);
  if (a.z.device() == Device::cuda) {
    detail::require_float_dev(a.z, op, "z");
  } else {
    HLM_CHECK(is_floating(a.z.dtype()), "{}: z must be floating, got {}", op, a.z.describe());
  }
  HLM_CHECK(a.z.dim() == 3, "{}: z must be [T, HV, K], got {}", op, a.z.describe());
  GateDims d{a.z.size(0), a.z.size(1), a.z.size(2),
             a.z.dtype() == DType::f64 ? DType::f64 : DType::f32};
  if (a.kind == KdaGateKind::standard)
    HLM_CHECK(a.A_log.defined(), "{}: A_log [{}] is required by the standard gate", op, d.HV);
  if (a.A_log.defined()) {
    check_on_device(a.A_log, a.z, d.dt, op, "A_log");
    detail::require_shape(a.A_log, {d.HV}, op, "A_log");
  }
  if (a.dt_bias.defined()) {
    check_on_device(a.dt_bias, a.z, d.dt, op, "dt_bias");
    detail::require_shape(a.dt_bias, {d.HV * d.K}, op, "dt_bias");
  }
  if (a.kind == KdaGateKind::lower_bound)
    HLM_CHECK(a.lower_bound >= -5.0 && a.lower_bound < 0.0,
              "{}: lower_bound must lie in [-5, 0), got {}", op, a.lower_bound);
  return d;
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

template <class T>
Tensor gate_fwd(const KdaGateArgs& a, const GateDims& d) {
  GateData<T> in(a, d.dt);
  Tensor g = Tensor::empty({d.T, d.HV, d.K}, d.dt);
  T* out = g.data<T>();
  const bool std_gate = a.kind == KdaGateKind::standard;
  const T lb = T(a.lower_bound);
#pragma omp parallel for schedule(static) if (d.T * d.HV * d.K >= (1 << 16))
  for (int64_t t = 0; t < d.T; ++t)
    for (int64_t h = 0; h < d.HV; ++h) {
      const T eA = in.A ? std::exp(in.A[h]) : T(1);
      for (int64_t c = 0; c < d.K; ++c) {
        const int64_t i = (t * d.HV + h) * d.K + c;
        const T x = in.z[i] + (in.b ? in.b[h * d.K + c] : T(0));
        out[i] = std_gate ? -mul0(eA, softplus(x)) : lb * sigmoid(mul0(eA, x));
      }
    }
  return g;
}

template <class T>
KdaGateGrads gate_bwd(const KdaGateArgs& a, const GateDims& d, const Tensor& dg_in) {
  GateData<T> in(a, d.dt);
  Tensor dgc = dg_in.to(d.dt);
  const T* dy = dgc.data<T>();
  KdaGateGrads r;
  r.dz = Tensor::empty({d.T, d.HV, d.K}, d.dt);
  T* dz = r.dz.data<T>();
  const bool std_gate = a.kind == KdaGateKind::standard;
  const T lb = T(a.lower_bound);
  // Per element: dz, and the dA_log summand (standard: dy * g; lower bound: dz * x).
  Tensor dAel = Tensor::empty({d.T, d.HV, d.K}, d.dt);
  T* dae = dAel.data<T>();
#pragma omp parallel for schedule(static) if (d.T * d.HV * d.K >= (1 << 16))
  for (int64_t t = 0; t < d.T; ++t)
    for (int64_t h = 0; h < d.HV; ++h) {
      const T eA = in.A ? std::exp(in.A[h]) : T(1);
      for (int64_t c = 0; c < d.K; ++c) {
        const int64_t i = (t * d.HV + h) * d.K + c;
        const T x = in.z[i] + (in.b ? in.b[h * d.K + c] : T(0));
        if (std_gate) {
          const T g = -mul0(eA, softplus(x));
          dz[i] = -mul0(mul0(eA, sigmoid(x)), dy[i]);
          dae[i] = mul0(dy[i], g);
        } else {
          const T y = mul0(eA, x);
          const T ds = sigmoid(y) * sigmoid(-y);  // s (1 - s) without cancellation
          dz[i] = mul0(mul0(dy[i] * lb, ds), eA);
          dae[i] = mul0(dz[i], x);
        }
      }
    }
  if (in.A && a.A_log.defined()) {
    r.dA_log = Tensor::empty({d.HV}, d.dt);
    T* dA = r.dA_log.data<T>();
#pragma omp parallel for schedule(static) if (d.T * d.HV * d.K >= (1 << 16))
    for (int64_t h = 0; h < d.HV; ++h) {
      T s = 0;
      for (int64_t t = 0; t < d.T; ++t)
        for (int64_t c = 0; c < d.K; ++c) s += dae[(t * d.HV + h) * d.K + c];
      dA[h] = s;
    }
  }
  if (a.dt_bias.defined()) {
    r.ddt_bias = Tensor::empty({d.HV * d.K}, d.dt);
    T* db = r.ddt_bias.data<T>();
#pragma omp parallel for schedule(static) if (d.T * d.HV * d.K >= (1 << 16))
    for (int64_t j = 0; j < d.HV * d.K; ++j) {
      T s = 0;
      for (int64_t t = 0; t < d.T; ++t) s += dz[t * d.HV * d.K + j];
      db[j] = s;
    }
  }
  return r;
}

}  // namespace

Tensor kda_gate(const KdaGateArgs& a) {
  const GateDims d = check_gate(a, "kda_gate");
  if (a.z.device() == Device::cuda) {
#ifdef HLM_HAVE_CUDA
    Tensor g = cuda::alloc({d.T, d.HV, d.K}, d.dt);
    cuda::kda_gate_forward(a, g);
    return g;
#else
    HLM_FAIL("kda_gate: no CUDA support in this build");
#endif
  }
  return d.dt == DType::f64 ? gate_fwd<double>(a, d) : gate_fwd<float>(a, d);
}

KdaGateGrads kda_gate_backward(const KdaGateArgs& a, const Tensor& dg) {
  const GateDims d = check_gate(a, "kda_gate_backward");
  HLM_CHECK(dg.defined(), "kda_gate_backward: dg is undefined");
  check_on_device(dg, a.z, d.dt, "kda_gate_backward", "dg");
  detail::require_shape(dg, a.z.shape(), "kda_gate_backward", "dg");
  if (a.z.device() == Device::cuda) {
#ifdef HLM_HAVE_CUDA
    KdaGateGrads r;
    r.dz = cuda::alloc({d.T, d.HV, d.K}, d.dt);
    if (a.A_log.defined()) r.dA_log = cuda::alloc({d.HV}, d.dt);
    if (a.dt_bias.defined()) r.ddt_bias = cuda::alloc({d.HV * d.K}, d.dt);
    cuda::kda_gate_backward(a, dg, r);
    return r;
#else
    HLM_FAIL("kda_gate_backward: no CUDA support in this build");
#endif
  }
  return d.dt == DType::f64 ? gate_bwd<double>(a, d, dg) : gate_bwd<float>(a, d, dg);
}

}  // namespace hlm::ops
