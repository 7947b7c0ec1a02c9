// Argument checks shared by the ops (internal to src/ops/): every op's front door
// (ops/<op>.cpp) validates its inputs with these before it switches on the device, so a bad call
// throws hlm::Error naming the op, the argument and what was expected.
#pragma once

#include <initializer_list>
#include <vector>

#include "core/tensor.h"

namespace hlm::ops::detail {

// ---- dtypes, shapes, devices (on any device) -------------------------------------------------

// Defined, f32 or f64.
inline void require_real(const Tensor& t, const char* op, const char* what) {
  HLM_CHECK(t.defined(), "{}: {} is undefined", op, what);
  HLM_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::f64, "{}: {} must be f32 or f64, got {}",
            op, what, t.describe());
}

// Defined, any floating dtype (f32, f64, bf16, f16, fp8).
inline void require_floating(const Tensor& t, const char* op, const char* what) {
  HLM_CHECK(t.defined(), "{}: {} is undefined", op, what);
  HLM_CHECK(is_floating(t.dtype()), "{}: {} must be floating, got {}", op, what, t.describe());
}

// Defined, integer: i64 or i32.
inline void require_int(const Tensor& t, const char* op, const char* what) {
  HLM_CHECK(t.defined(), "{}: {} is undefined", op, what);
  HLM_CHECK(t.dtype() == DType::i64 || t.dtype() == DType::i32, "{}: {} must be i64 or i32, got {}",
            op, what, t.describe());
}

inline void require_same_dtype(const Tensor& t, const Tensor& ref, const char* op, const char* what,
                               const char* ref_name) {
  HLM_CHECK(t.dtype() == ref.dtype(), "{}: {} must have the dtype of {} ({}), got {}", op, what,
            ref_name, dtype_name(ref.dtype()), t.describe());
}

inline void require_shape(const Tensor& t, const Shape& s, const char* op, const char* what) {
  HLM_CHECK(t.shape() == s, "{}: {} must have shape {}, got {}", op, what, shape_str(s),
            t.describe());
}

inline void require_same_device(const Tensor& t, const Tensor& ref, const char* op,
                                const char* what, const char* ref_name) {
  HLM_CHECK(t.device() == ref.device(), "{}: {} must be on the device of {} ({}), got {}", op, what,
            ref_name, ref.describe(), t.describe());
}

// A named tensor argument.
struct Arg {
  const Tensor& t;
  const char* name;
};

// The one device of an op's tensors: that of `first`, after checking that every defined tensor
// of `rest` is on it.
inline Device one_device(const char* op, Arg first, std::initializer_list<Arg> rest) {
  for (const Arg& a : rest)
    if (a.t.defined()) require_same_device(a.t, first.t, op, a.name, first.name);
  return first.t.device();
}

// An f32 / f64 tensor of ref's dtype and device and of shape s: the gradients and saved tensors
// that go with an op's main input.
inline void require_real_like(const Tensor& t, const Tensor& ref, const Shape& s, const char* op,
                              const char* what, const char* ref_name) {
  require_real(t, op, what);
  require_same_dtype(t, ref, op, what, ref_name);
  require_same_device(t, ref, op, what, ref_name);
  require_shape(t, s, op, what);
}

// A parameter-gradient accumulator (+=) of shape s: defined, f32 or f64, on the device of x.
inline void require_accumulator(const Tensor& acc, const Shape& s, const Tensor& x, const char* op,
                                const char* what) {
  HLM_CHECK(acc.defined(), "{}: gradient accumulator {} is undefined (expected {})", op, what,
            shape_str(s));
  require_real(acc, op, what);
  require_same_device(acc, x, op, what, "x");
  require_shape(acc, s, op, what);
}

// ---- the ops that have no CUDA implementation yet ----------------------------------------------
// Their front doors check with the helpers above (any device), find the device of their tensors
// (one_device) and switch on it; the CUDA case is no_cuda_yet.
[[noreturn]] inline void no_cuda_yet(const char* op, const Tensor& t, const char* what) {
  HLM_FAIL("{}: no CUDA implementation yet ({} is {})", op, what, t.describe());
}

// The device switch of an op that has only its CPU reference so far: a CUDA tensor gets
// "<op>: no CUDA implementation yet (<what> is ...)"; on the CPU the front door goes on to the
// reference.
inline void cpu_only(const char* op, const Tensor& t, const char* what) {
  if (t.device() != Device::cpu) no_cuda_yet(op, t, what);
}

// The same rule as a check on one argument, for the ops that still check on the CPU only (the
// KDA chunk family): a CUDA tensor gets a clear error.
inline void require_cpu(const Tensor& t, const char* op, const char* what) {
  HLM_CHECK(t.device() == Device::cpu, "{}: no CUDA implementation of {} yet ({} is {})", op, op,
            what, t.describe());
}

// Defined, on the CPU, f32 or f64.
inline void require_float(const Tensor& t, const char* op, const char* what) {
  HLM_CHECK(t.defined(), "{}: {} is undefined", op, what);
  require_cpu(t, op, what);
  require_real(t, op, what);
}

// Defined, on the CPU, integer (i64 or i32).
inline void require_index(const Tensor& t, const char* op, const char* what) {
  HLM_CHECK(t.defined(), "{}: {} is undefined", op, what);
  require_cpu(t, op, what);
  require_int(t, op, what);
}

// ---- values and shapes -----------------------------------------------------------------------

// Index values of an i64 / i32 tensor (any strides, any device: a CUDA tensor is copied to the
// host first) as int64.
inline std::vector<int64_t> index_values(const Tensor& t) {
  const Tensor c = t.is_cpu() ? t.contiguous() : t.to(Device::cpu).contiguous();
  std::vector<int64_t> v(size_t(c.numel()));
  if (c.dtype() == DType::i64) {
    const int64_t* p = c.data<int64_t>();
    for (size_t i = 0; i < v.size(); ++i) v[i] = p[i];
  } else {
    const int32_t* p = c.data<int32_t>();
    for (size_t i = 0; i < v.size(); ++i) v[i] = p[i];
  }
  return v;
}

// The shape without its last dimension.
inline Shape leading_shape(const Tensor& t) {
  Shape s = t.shape();
  if (!s.empty()) s.pop_back();
  return s;
}

// Rows of a [..., D] tensor: the product of all dimensions but the last.
inline int64_t leading_rows(const Tensor& t) {
  return shape_numel(leading_shape(t));
}

// Calls f(T{}) with T = double for f64, else float (f32: checked by the front door).
template <class F>
decltype(auto) dispatch_float(DType dt, F&& f) {
  if (dt == DType::f64) return f(double{});
  return f(float{});
}

// A tensor an op writes in place (accumulated gradients, rolling states) must be contiguous; an
// empty tensor always qualifies.
inline void require_contiguous(const Tensor& t, const char* op, const char* what) {
  HLM_CHECK(t.numel() == 0 || t.is_contiguous(), "{}: {} must be contiguous, got strides {} for {}",
            op, what, shape_str(t.strides()), t.describe());
}

// ---- the layer ops that also run on CUDA (conv1d, rmsnorm, l2norm, kda_gate, activations) ----
// Dtype rules on CUDA (the CPU accepts f32 / f64 only, except kda_gate's z):
//   activations (x, dy, y): f32, f64 or bf16, computed in f32 (f64 for f64).
//   x-like tensors (x, dy, gate, conv state, outputs): f32, f64 or bf16, one dtype.
//   parameters w and their gradients dw: x's dtype, or f32 when x is bf16.
//   rstd: the computation dtype (x's dtype; f32 when x is bf16).
//   kda_gate: z f32 / f64 / bf16; A_log, dt_bias, dg and all outputs in the computation dtype.
// CUDA tensors must be contiguous.

// A floating tensor on the CPU (f32 / f64) or on CUDA (f32 / f64 / bf16, contiguous).
inline void require_float_dev(const Tensor& t, const char* op, const char* what) {
  HLM_CHECK(t.defined(), "{}: {} is undefined", op, what);
  if (t.device() == Device::cpu) {
    HLM_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::f64,
              "{}: {} must be f32 or f64, got {}", op, what, t.describe());
    return;
  }
  HLM_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::f64 || t.dtype() == DType::bf16,
            "{}: {} must be f32, f64 or bf16 on CUDA, got {}", op, what, t.describe());
  HLM_CHECK(t.numel() == 0 || t.is_contiguous(),
            "{}: {} must be contiguous on CUDA, got strides {} for {}", op, what,
            shape_str(t.strides()), t.describe());
}

// A parameter (w) or its gradient (dw) of an op on x: x's dtype, or f32 when x is bf16.
inline void require_param_dtype(const Tensor& t, const Tensor& x, const char* op,
                                const char* what) {
  HLM_CHECK(t.dtype() == x.dtype() || (x.dtype() == DType::bf16 && t.dtype() == DType::f32),
            "{}: {} must have the dtype of x ({}){}, got {}", op, what, dtype_name(x.dtype()),
            x.dtype() == DType::bf16 ? " or f32" : "", t.describe());
}

// A tensor that goes with an op's main input `ref` (dy, gate, conv state; the DSA ops' k, kv, w,
// out, d_out): floating as above, on ref's device, of ref's dtype and of shape s.
inline void require_like(const Tensor& t, const Tensor& ref, const Shape& s, const char* op,
                         const char* what, const char* ref_name) {
  require_float_dev(t, op, what);
  require_same_device(t, ref, op, what, ref_name);
  require_same_dtype(t, ref, op, what, ref_name);
  require_shape(t, s, op, what);
}
inline void require_like_x(const Tensor& t, const Tensor& x, const Shape& s, const char* op,
                           const char* what) {
  require_like(t, x, s, op, what, "x");
}

// A tensor in the computation dtype of `ref` (compute_dtype below: the DSA ops' scores, d_scores,
// lse), on ref's device, of shape s.
inline void require_compute_like(const Tensor& t, const Tensor& ref, const Shape& s, const char* op,
                                 const char* what, const char* ref_name) {
  require_float_dev(t, op, what);
  const DType cdt = hlm::compute_dtype(ref.dtype());
  HLM_CHECK(t.dtype() == cdt, "{}: {} must be {} (the computation dtype of {}, {}), got {}", op,
            what, dtype_name(cdt), ref_name, dtype_name(ref.dtype()), t.describe());
  require_same_device(t, ref, op, what, ref_name);
  require_shape(t, s, op, what);
}

// A parameter gradient accumulated in place (dw): floating as above, on x's device, of the
// parameter dtype (require_param_dtype), of shape s and contiguous.
inline void require_param_grad(const Tensor& dw, const Tensor& x, const Shape& s, const char* op,
                               const char* what) {
  require_float_dev(dw, op, what);
  require_same_device(dw, x, op, what, "x");
  require_param_dtype(dw, x, op, what);
  require_shape(dw, s, op, what);
  require_contiguous(dw, op, what);
}

// The dtype an op on `dt` computes in (and stores its statistics, e.g. rstd, in):
// hlm::compute_dtype (core/dtype.h): f64 stays f64, every other dtype computes in f32.
using hlm::compute_dtype;

// The rstd [x's leading shape] that a norm's forward saved: in the computation dtype of x.
inline void require_rstd(const Tensor& rstd, const Tensor& x, const char* op) {
  require_float_dev(rstd, op, "rstd");
  require_same_device(rstd, x, op, "rstd", "x");
  HLM_CHECK(rstd.dtype() == compute_dtype(x.dtype()), "{}: rstd must be {}, got {}", op,
            dtype_name(compute_dtype(x.dtype())), rstd.describe());
  require_shape(rstd, leading_shape(x), op, "rstd");
}

}  // namespace hlm::ops::detail
