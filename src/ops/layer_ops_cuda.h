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
#include "ops/op_checks.h"

namespace hlm::ops {

namespace cuda {

// conv1d.h. cu: validated host cu_seqlens. state / final_state / dstate: undefined or nullptr
// when absent. y, dx, final_state, dstate are allocated by the caller (alloc); dw accumulates.
void causal_conv1d_forward(const Tensor& x, const Tensor& w, const std::vector<int64_t>& cu,
                           const Tensor& state, bool silu, Tensor& y, Tensor* final_state);
void causal_conv1d_backward(const Tensor& dy, const Tensor& x, const Tensor& w,
                            const std::vector<int64_t>& cu, const Tensor& state, bool silu,
                            Tensor& dx, Tensor* dstate, Tensor& dw);
void causal_conv1d_update(const Tensor& x, Tensor& state, const Tensor& w, bool silu, Tensor& y);

// kda_gate.h: g / the grads allocated by the caller in the computation dtype.
void kda_gate_forward(const KdaGateArgs& a, Tensor& g);
void kda_gate_backward(const KdaGateArgs& a, const Tensor& dg, KdaGateGrads& r);

// activations.h
enum class Act { sigmoid, silu, softplus };
void activation_forward(Act act, const Tensor& x, Tensor& y);
void activation_backward(Act act, const Tensor& x, const Tensor& dy, Tensor& dx);

}  // namespace cuda
}  // namespace hlm::ops
