// The front door of the KDA decay gate (ops/kda_gate.h): argument checks, output allocation, and
// the switch to the CPU reference (ops/cpu/kda_gate.cpp) or the CUDA kernels
// (ops/cuda/kda_gate.cu).
#include "ops/kda_gate.h"

#include <cmath>

#include "ops/cpu/kda_gate.h"
#include "ops/cuda/kda_gate.cuh"
#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace hlm::ops {
namespace {

struct GateDims {
  int64_t T, HV, K;
  DType dt;  // the computation dtype
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
  GateDims d{a.z.size(0), a.z.size(1), a.z.size(2), detail::compute_dtype(a.z.dtype())};
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
  if (a.kind == KdaGateKind::lower_bound) check_kda_lower_bound(a.lower_bound, op);
  return d;
}

}  // namespace

Tensor kda_gate(const KdaGateArgs& a) {
  constexpr const char* op = "kda_gate";
  const GateDims d = check_gate(a, op);
  const Device dev = a.z.device();
  Tensor g = detail::new_output({d.T, d.HV, d.K}, d.dt, dev);
  HLM_DISPATCH(op, dev, kda_gate_forward, a, g);
  return g;
}

KdaGateGrads kda_gate_backward(const KdaGateArgs& a, const Tensor& dg) {
  constexpr const char* op = "kda_gate_backward";
  const GateDims d = check_gate(a, op);
  HLM_CHECK(dg.defined(), "{}: dg is undefined", op);
  check_on_device(dg, a.z, d.dt, op, "dg");
  detail::require_shape(dg, a.z.shape(), op, "dg");
  const Device dev = a.z.device();
  KdaGateGrads r;
  r.dz = detail::new_output({d.T, d.HV, d.K}, d.dt, dev);
  if (a.A_log.defined()) r.dA_log = detail::new_output({d.HV}, d.dt, dev);
  if (a.dt_bias.defined()) r.ddt_bias = detail::new_output({d.HV * d.K}, d.dt, dev);
  HLM_DISPATCH(op, dev, kda_gate_backward, a, dg, r);
  return r;
}

void check_kda_lower_bound(double lb, const char* where, const char* what) {
  HLM_CHECK(std::isfinite(lb) && lb >= kKdaLowerBoundMin && lb < 0.0,
            "{}: {} must lie in [{}, 0), got {}", where, what, kKdaLowerBoundMin, lb);
}

}  // namespace hlm::ops
