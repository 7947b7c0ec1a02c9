// The front door of the copy and elementwise ops (ops/tensor_ops.h): argument checks, output
// allocation, and the switch to the CPU loops (ops/cpu/tensor_ops.cpp) or the CUDA kernels
// (ops/cuda/tensor_ops.cu). The conversions and copies with a host side use Tensor's own.
#include "ops/tensor_ops.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "ops/cpu/tensor_ops.h"
#include "ops/cuda/tensor_ops.cuh"
#include "ops/dispatch.h"

namespace hlm::ops {

namespace {

bool is_fdt(DType dt) {
  return dt == DType::f32 || dt == DType::f64 || dt == DType::bf16;
}

void require_fdt(const Tensor& t, const char* op, const char* what) {
  HLM_CHECK(t.defined(), "{}: {} is undefined", op, what);
  HLM_CHECK(is_fdt(t.dtype()), "{}: {} must be f32, f64 or bf16, got {}", op, what, t.describe());
}

// An f32 / f64 contiguous tensor that an op updates in place.
void require_accum(const Tensor& t, const char* op, const char* what) {
  HLM_CHECK(t.defined(), "{}: {} is undefined", op, what);
  HLM_CHECK(
      (t.dtype() == DType::f32 || t.dtype() == DType::f64) && (t.numel() == 0 || t.is_contiguous()),
      "{}: {} must be a contiguous f32 or f64 tensor, got {}", op, what, t.describe());
}

}  // namespace

Tensor as_dtype(const Tensor& x, DType dt) {
  HLM_CHECK(x.defined(), "as_dtype: x is undefined");
  if (x.dtype() == dt) return x;
  if (x.is_cpu()) return x.to(dt);
  require_fdt(x, "as_dtype", "x");
  HLM_CHECK(is_fdt(dt), "as_dtype: target dtype must be f32, f64 or bf16 on CUDA, got {}",
            dtype_name(dt));
  Tensor y = detail::new_output(x.shape(), dt, x.device());
  copy_into(y, x);
  return y;
}

Tensor contiguous(const Tensor& x) {
  HLM_CHECK(x.defined(), "contiguous: x is undefined");
  if (x.is_contiguous() || x.is_cpu()) return x.contiguous();
  Tensor y = detail::new_output(x.shape(), x.dtype(), x.device());
  copy_into(y, x);
  return y;
}

void copy_into(Tensor& dst, const Tensor& src) {
  HLM_CHECK(dst.defined() && src.defined(), "copy_into: undefined tensor");
  HLM_CHECK(dst.shape() == src.shape(), "copy_into: shape {} into {}", shape_str(src.shape()),
            shape_str(dst.shape()));
  if (dst.device() != Device::cuda || src.device() != Device::cuda) {
    // At least one side on the host: convert where the source lives, then Tensor::copy_ (which
    // writes a CUDA destination only when it is contiguous).
    const Tensor s = src.dtype() == dst.dtype() ? src : as_dtype(src, dst.dtype());
    if (dst.device() == Device::cuda && !dst.is_contiguous()) {
      copy_into(dst, s.to(Device::cuda));
      return;
    }
    dst.copy_(s);
    return;
  }
  require_fdt(dst, "copy_into", "dst");
  require_fdt(src, "copy_into", "src");
  HLM_CHECK(dst.dim() <= 8, "copy_into: at most 8 dimensions on CUDA, got {}", dst.describe());
  if (dst.numel() == 0) return;
  HLM_CUDA_PATH("copy_into", cuda::copy_into(dst, src));
}

void add_(Tensor& dst, const Tensor& src) {
  constexpr const char* op = "add_";
  require_accum(dst, op, "dst");
  require_fdt(src, op, "src");
  HLM_CHECK(src.shape() == dst.shape(), "{}: src {} must have the shape of dst {}", op,
            src.describe(), dst.describe());
  HLM_CHECK(src.device() == dst.device(), "{}: src {} must be on the device of dst {}", op,
            src.describe(), dst.describe());
  if (dst.numel() == 0) return;
  const Tensor s = contiguous(as_dtype(src, dst.dtype()));
  HLM_DISPATCH(op, dst.device(), add_, dst, s);
}

void add_bias_(Tensor& y, const Tensor& b) {
  constexpr const char* op = "add_bias_";
  require_accum(y, op, "y");
  require_fdt(b, op, "b");
  HLM_CHECK(y.dim() == 2 && b.dim() == 1 && b.size(0) == y.size(1),
            "{}: y must be [T, O] and b [O], got {} and {}", op, y.describe(), b.describe());
  HLM_CHECK(b.device() == y.device(), "{}: b {} must be on the device of y {}", op, b.describe(),
            y.describe());
  if (y.numel() == 0) return;
  const Tensor bb = contiguous(as_dtype(b, y.dtype()));
  HLM_DISPATCH(op, y.device(), add_bias_, y, bb);
}

Tensor sum_rows(const Tensor& x, DType dt) {
  constexpr const char* op = "sum_rows";
  require_fdt(x, op, "x");
  HLM_CHECK(x.dim() == 2, "{}: x must be [T, O], got {}", op, x.describe());
  HLM_CHECK(dt == DType::f32 || dt == DType::f64, "{}: dtype must be f32 or f64, got {}", op,
            dtype_name(dt));
  const Tensor d = contiguous(as_dtype(x, dt));
  const int64_t T = d.size(0), O = d.size(1);
  if (O == 0 || T == 0) return Tensor::zeros({O}, dt, x.device());
  Tensor out = detail::new_output({O}, dt, x.device());
  HLM_DISPATCH(op, x.device(), sum_rows, d, out);
  return out;
}

void scale_(Tensor& c, double beta) {
  constexpr const char* op = "scale_";
  require_fdt(c, op, "c");
  HLM_CHECK(c.dim() == 2, "{}: c must be 2-D, got {}", op, c.describe());
  if (c.numel() == 0) return;
  HLM_DISPATCH(op, c.device(), scale_, c, beta);
}

void nan_if_flagged_(Tensor& t, const Tensor& flag) {
  constexpr const char* op = "nan_if_flagged_";
  require_fdt(t, op, "t");
  HLM_CHECK(t.is_contiguous(), "{}: t must be contiguous, got {}", op, t.describe());
  HLM_CHECK(flag.defined() && flag.dtype() == DType::i32 && flag.numel() == 1 &&
                flag.device() == t.device(),
            "{}: flag must be an i32 [1] tensor on t's device ({}), got {}", op,
            device_name(t.device()), flag.defined() ? flag.describe() : "undefined");
  if (t.numel() == 0) return;
  if (t.is_cpu()) {
    if (flag.contiguous().data<int32_t>()[0] != 0)
      t.fill_(std::numeric_limits<double>::quiet_NaN());
    return;
  }
  HLM_CUDA_PATH(op, cuda::nan_if_flagged_(t, flag));
}

Tensor gather_rows(const Tensor& src, const std::vector<int64_t>& rows) {
  constexpr const char* op = "gather_rows";
  HLM_CHECK(src.defined() && src.dim() == 2 && src.is_contiguous(),
            "{}: src must be a contiguous 2-D tensor, got {}", op,
            src.defined() ? src.describe() : "undefined");
  const int64_t N = src.size(0), R = int64_t(rows.size());
  for (int64_t r = 0; r < R; ++r)
    HLM_CHECK(rows[size_t(r)] >= 0 && rows[size_t(r)] < N, "{}: rows[{}] = {} is outside [0, {})",
              op, r, rows[size_t(r)], N);
  Tensor out = detail::new_output({R, src.size(1)}, src.dtype(), src.device());
  if (out.numel() == 0) return out;
  if (src.is_cpu()) {
    const size_t rb = size_t(src.size(1)) * src.element_size();
    const auto* s = static_cast<const unsigned char*>(src.raw());
    auto* o = static_cast<unsigned char*>(out.raw());
    for (int64_t r = 0; r < R; ++r)
      std::memcpy(o + size_t(r) * rb, s + size_t(rows[size_t(r)]) * rb, rb);
    return out;
  }
  HLM_CUDA_PATH(op, cuda::gather_rows(src, rows, out));
  return out;
}

void scatter_rows(Tensor& dst, const std::vector<int64_t>& rows, const Tensor& src_) {
  constexpr const char* op = "scatter_rows";
  HLM_CHECK(dst.defined() && dst.dim() == 2 && dst.is_contiguous(),
            "{}: dst must be a contiguous 2-D tensor, got {}", op,
            dst.defined() ? dst.describe() : "undefined");
  const int64_t N = dst.size(0), R = int64_t(rows.size());
  HLM_CHECK(src_.defined() && src_.shape() == Shape({R, dst.size(1)}) &&
                src_.dtype() == dst.dtype() && src_.device() == dst.device(),
            "{}: src must be {} [{}, {}] on dst's device, got {}", op, dtype_name(dst.dtype()), R,
            dst.size(1), src_.defined() ? src_.describe() : "undefined");
  // O(R log R), not O(N): a decode step scatters a few rows into a cache of millions.
  for (int64_t r = 0; r < R; ++r)
    HLM_CHECK(rows[size_t(r)] >= 0 && rows[size_t(r)] < N, "{}: rows[{}] = {} is outside [0, {})",
              op, r, rows[size_t(r)], N);
  std::vector<int64_t> sorted = rows;
  std::sort(sorted.begin(), sorted.end());
  const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  HLM_CHECK(dup == sorted.end(), "{}: row {} appears twice", op, dup == sorted.end() ? 0 : *dup);
  if (R == 0 || dst.size(1) == 0) return;
  const Tensor src = contiguous(src_);
  if (dst.is_cpu()) {
    const size_t rb = size_t(dst.size(1)) * dst.element_size();
    const auto* s = static_cast<const unsigned char*>(src.raw());
    auto* d = static_cast<unsigned char*>(dst.raw());
    for (int64_t r = 0; r < R; ++r)
      std::memcpy(d + size_t(rows[size_t(r)]) * rb, s + size_t(r) * rb, rb);
    return;
  }
  HLM_CUDA_PATH(op, cuda::scatter_rows(dst, rows, src));
}

void causal_conv1d_final_state_backward(const Tensor& dfinal_, const std::vector<int64_t>& cu,
                                        int64_t width, Tensor& dx, Tensor* dinitial) {
  constexpr const char* op = "causal_conv1d_final_state_backward";
  HLM_CHECK(cu.size() >= 1 && width >= 1, "{}: need cu_seqlens and width >= 1", op);
  require_accum(dx, op, "dx");
  HLM_CHECK(dx.dim() == 2 && dx.size(0) == cu.back(), "{}: dx must be [T = {}, C], got {}", op,
            cu.back(), dx.describe());
  const int64_t N = int64_t(cu.size()) - 1, C = dx.size(1), wm = width - 1;
  require_fdt(dfinal_, op, "dfinal");
  HLM_CHECK(dfinal_.shape() == Shape({N, wm, C}) && dfinal_.device() == dx.device(),
            "{}: dfinal must be [N = {}, W-1 = {}, C = {}] on dx's device, got {}", op, N, wm, C,
            dfinal_.describe());
  if (dinitial) {
    require_accum(*dinitial, op, "dinitial");
    HLM_CHECK(dinitial->shape() == dfinal_.shape() && dinitial->dtype() == dx.dtype() &&
                  dinitial->device() == dx.device(),
              "{}: dinitial must be {} {} on dx's device, got {}", op, dtype_name(dx.dtype()),
              shape_str(dfinal_.shape()), dinitial->describe());
  }
  if (dfinal_.numel() == 0) return;
  const Tensor dfin = contiguous(as_dtype(dfinal_, dx.dtype()));
  HLM_DISPATCH(op, dx.device(), causal_conv1d_final_state_backward, dfin, cu, width, dx, dinitial);
}

}  // namespace hlm::ops
