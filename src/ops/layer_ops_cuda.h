// CUDA paths of the KDA layer's non-GEMM ops (internal to src/ops/): causal conv1d (conv1d.h),
// RMSNorm and gated RMSNorm (rmsnorm.h), L2 norm (l2norm.h), the KDA gate (kda_gate.h) and the
// elementwise activations (activations.h). The public entry points validate their arguments
// (the checks below plus each op's own), then call these launchers when the tensors are on CUDA.
//
// Dtype rules on CUDA (the CPU accepts f32 / f64 only, except kda_gate's z):
//   activations (x, dy, y): f32, f64 or bf16, computed in f32 (f64 for f64).
//   x-like tensors (x, dy, gate, conv state, outputs): f32, f64 or bf16, one dtype.
//   parameters w and their gradients dw: x's dtype, or f32 when x is bf16.
//   rstd: the computation dtype (x's dtype; f32 when x is bf16).
//   kda_gate: z f32 / f64 / bf16; A_log, dt_bias, dg and all outputs in the computation dtype.
// CUDA tensors must be contiguous. Kernels run on the default stream (no synchronisation of their
// own: a host read of an output waits for them); every reduction has a fixed order and no
// atomics, so results are bit-identical run to run.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/kda_gate.h"

namespace hlm::ops {

namespace detail {

// A floating tensor on the CPU (f32 / f64) or on CUDA (f32 / f64 / bf16, contiguous).
inline void require_float_dev(const Tensor& t, const char* op, const char* what) {
  HLM_CHECK(t.defined(), "{}: {} is undefined", op, what);
  if (t.device() == Device::cpu) {
    HLM_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::f64,
              "{}: {} must be f32 or f64, got {}", op, what, t.describe());
    return;
  }
#ifndef HLM_HAVE_CUDA
  HLM_FAIL("{}: {} is a CUDA tensor ({}) but this build has no CUDA support", op, what,
           t.describe());
#endif
  HLM_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::f64 || t.dtype() == DType::bf16,
            "{}: {} must be f32, f64 or bf16 on CUDA, got {}", op, what, t.describe());
  HLM_CHECK(t.numel() == 0 || t.is_contiguous(),
            "{}: {} must be contiguous on CUDA, got strides {} for {}", op, what,
            shape_str(t.strides()), t.describe());
}

inline void require_same_device(const Tensor& t, const Tensor& ref, const char* op,
                                const char* what, const char* ref_name) {
  HLM_CHECK(t.device() == ref.device(), "{}: {} must be on the device of {} ({}), got {}", op, what,
            ref_name, ref.describe(), t.describe());
}

// A parameter (w) or its gradient (dw) of an op on x: x's dtype, or f32 when x is bf16.
inline void require_param_dtype(const Tensor& t, const Tensor& x, const char* op,
                                const char* what) {
  HLM_CHECK(t.dtype() == x.dtype() || (x.dtype() == DType::bf16 && t.dtype() == DType::f32),
            "{}: {} must have the dtype of x ({}){}, got {}", op, what, dtype_name(x.dtype()),
            x.dtype() == DType::bf16 ? " or f32" : "", t.describe());
}

// The dtype an op on `dt` computes in (and stores rstd in): f32 for bf16.
inline DType compute_dtype(DType dt) {
  return dt == DType::bf16 ? DType::f32 : dt;
}

}  // namespace detail

namespace cuda {

// Test hook: while on, every output and workspace these launchers allocate is filled with NaN
// bytes (0xFF) before the kernels write it, so an element a kernel forgets shows up as NaN.
void set_poison_outputs(bool on);
// A new contiguous CUDA tensor (poisoned while the hook is on).
Tensor alloc(const Shape& shape, DType dt);

// conv1d.h. cu: validated host cu_seqlens. state / final_state / dstate: undefined or nullptr
// when absent. y, dx, final_state, dstate are allocated by the caller (alloc); dw accumulates.
void causal_conv1d_forward(const Tensor& x, const Tensor& w, const std::vector<int64_t>& cu,
                           const Tensor& state, bool silu, Tensor& y, Tensor* final_state);
void causal_conv1d_backward(const Tensor& dy, const Tensor& x, const Tensor& w,
                            const std::vector<int64_t>& cu, const Tensor& state, bool silu,
                            Tensor& dx, Tensor* dstate, Tensor& dw);
void causal_conv1d_update(const Tensor& x, Tensor& state, const Tensor& w, bool silu, Tensor& y);

// rmsnorm.h (gate == nullptr: plain RMSNorm) and l2norm.h.
void rmsnorm_forward(const Tensor& x, const Tensor* gate, const Tensor& w, double eps, Tensor& y,
                     Tensor& rstd);
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor* gate, const Tensor& w,
                      const Tensor& rstd, Tensor& dx, Tensor* dgate, Tensor& dw);
void l2norm_forward(const Tensor& x, double eps, Tensor& y, Tensor& rstd);
void l2norm_backward(const Tensor& dy, const Tensor& x, const Tensor& rstd, Tensor& dx);

// kda_gate.h: g / the grads allocated by the caller in the computation dtype.
void kda_gate_forward(const KdaGateArgs& a, Tensor& g);
void kda_gate_backward(const KdaGateArgs& a, const Tensor& dg, KdaGateGrads& r);

// activations.h
enum class Act { sigmoid, silu, softplus };
void activation_forward(Act act, const Tensor& x, Tensor& y);
void activation_backward(Act act, const Tensor& x, const Tensor& dy, Tensor& dx);

}  // namespace cuda
}  // namespace hlm::ops
