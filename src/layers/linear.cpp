// Linear: y = x W^T (+ b), W [out, in], x [T, in], y [T, out] (layers/linear.h).
//
// Forward:  y  = x W^T + b
// Backward: dx = dy W            (written, =)
//           dW += dy^T x         (accumulated)
//           db += sum_t dy[t, :] (accumulated)
//
// Precision (layers/precision.h), the same for all three GEMMs:
//   native    exact in the compute dtype (f64 when x is f64, else f32)
//   bf16      operands rounded to bf16, FP32 accumulation (ops::GemmOptions::round_bf16)
//   fp8_block the blockwise recipe, emulated bit-exactly (docs/fp8.md):
//     fprop  y[T, out]  = Q1x128_e4m3(x)  . Q128x128_e4m3(W)^T        K = in
//     dgrad  dx[T, in]  = Q1x128_g(dy)    . (Q128x128_e4m3(W))^T^T    K = out (same W codes)
//     wgrad  dW[out,in] = Q1x128_g(dy^T)  . Q1x128_e4m3(x^T)^T        K = T
//   g = the grad format (E4M3, or E5M2 for the "hybrid" recipe); every 1x128 tile runs along the
//   GEMM's reduction dimension. Reduction dimensions that are not multiples of 128 (in, out, T)
//   are zero-padded to the next multiple: padding changes no amax and adds exact zeros, so it is
//   the same as a partial last tile. The bias is added in FP32 after the FP32 accumulation; y and
//   dx are rounded once to x's dtype; dW is accumulated in FP32 (grad += dW_fp8).
#include "layers/linear.h"

#include <algorithm>

#include "ops/gemm.h"
#include "ops/tensor_ops.h"

namespace hlm {

Linear::Linear(int64_t in_features, int64_t out_features, bool bias, GemmPrecision precision,
               DType dt) {
  init(in_features, out_features, bias, precision, dt);
}

void Linear::init(int64_t in_features, int64_t out_features, bool bias, GemmPrecision precision,
                  DType dt) {
  HLM_CHECK(weight_ == nullptr, "Linear::init: already initialised ([{}, {}])", out_, in_);
  HLM_CHECK(in_features > 0 && out_features > 0,
            "Linear: in_features and out_features must be positive, got {} and {}", in_features,
            out_features);
  HLM_CHECK(dt == DType::f64 || dt == DType::f32 || dt == DType::bf16,
            "Linear: parameter dtype must be f64, f32 or bf16, got {}", dtype_name(dt));
  in_ = in_features;
  out_ = out_features;
  precision_ = precision;
  weight_ = &add_param("weight", Tensor::zeros({out_, in_}, dt));
  if (bias) bias_ = &add_param("bias", Tensor::zeros({out_}, dt), false, true);
}

namespace {

constexpr int64_t kB = ops::kFp8TileSize;

int64_t pad128(int64_t n) {
  return (n + kB - 1) / kB * kB;
}

DType compute_dtype(const GemmPrecision& p, DType x_dt) {
  return (p.kind == GemmKind::native && x_dt == DType::f64) ? DType::f64 : DType::f32;
}

// (ops::as_dtype: the CPU's Tensor::to, or the CUDA conversion kernel.)
Tensor as_dtype(const Tensor& t, DType dt) {
  return t.dtype() == dt ? t : t.is_cpu() ? t.to(dt) : ops::as_dtype(t, dt);
}

// [R, C] f32 copy of a 2-D tensor, zero-padded to [R, Cp] (Cp >= C).
Tensor padded_f32(const Tensor& t, int64_t cp) {
  const Tensor f = as_dtype(t, DType::f32);
  if (f.size(1) == cp) return f.contiguous();
  Tensor out = Tensor::zeros({f.size(0), cp}, DType::f32);
  out.slice(1, 0, f.size(1)).copy_(f);
  return out;
}

ops::Fp8Tensor quantize(const Tensor& x2d, int64_t cols_padded, Fp8Format fmt, ops::TileShape tile,
                        bool pow2) {
  return ops::fp8_quantize(padded_f32(x2d, cols_padded), ops::QuantRecipe{fmt, tile, pow2});
}

ops::Fp8Tensor quantize_weight(const Tensor& w, const GemmPrecision& p) {
  return quantize(w, pad128(w.size(1)), Fp8Format::e4m3, ops::TileShape::t128x128, p.pow2_scales);
}

// out[r, c] (+)= src[r, c] for the first out.size(1) columns of src (both f32/f64 CPU).
void add_into(Tensor& out, const Tensor& src) {
  Tensor s = src.slice(1, 0, out.size(1));
  Tensor sum = out.to(DType::f64);
  const auto v = s.to_f64_vector();
  double* p = sum.data<double>();
  // out and src are both FP32 (or FP64) values; one rounding to out's dtype per element makes
  // this the FP32 (or FP64) addition out + src.
  for (size_t i = 0; i < v.size(); ++i) p[i] += v[i];
  out.copy_(sum);
}

// y[t, o] += b[o] in y's dtype (f32 / f64), one addition per element.
void add_bias(Tensor& y, const Tensor& b) {
  if (!y.is_cpu()) {
    ops::add_bias_(y, b);
    return;
  }
  const Tensor bb = as_dtype(b, y.dtype()).contiguous();
  const int64_t T = y.size(0), N = y.size(1);
  if (y.dtype() == DType::f32) {
    float* yp = y.data<float>();
    const float* bp = bb.data<float>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t o = 0; o < N; ++o) yp[t * N + o] += bp[o];
  } else {
    double* yp = y.data<double>();
    const double* bp = bb.data<double>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t o = 0; o < N; ++o) yp[t * N + o] += bp[o];
  }
}

}  // namespace

void Linear::keep_gemm_weights_in_bf16() {
  if (!weight_ || precision_.kind != GemmKind::bf16) return;
  Param& w = *weight_;
  if (!w.value.defined() || w.value.dtype() == DType::bf16 || w.value.dtype() == DType::f64) return;
  w.value = as_dtype(w.value, DType::bf16);
  w.grad = Tensor();
}

Tensor Linear::forward(const Context& ctx, const Tensor& x, Saved* saved) const {
  HLM_CHECK(weight_ != nullptr, "Linear::forward: the layer is not initialised");
  HLM_CHECK(x.defined() && x.device() == weight_->value.device(),
            "Linear::forward: x must be a defined tensor on the weight's device ({}), got {}",
            device_name(weight_->value.device()), x.defined() ? x.describe() : "undefined");
  HLM_CHECK(x.dtype() == DType::f64 || x.dtype() == DType::f32 || x.dtype() == DType::bf16,
            "Linear::forward: x must be f64, f32 or bf16, got {}", x.describe());
  HLM_CHECK(x.dim() == 2 && x.size(1) == in_, "Linear::forward: x must be [T, {}], got {}", in_,
            x.describe());
  const int64_t T = x.size(0);
  const Tensor& w = weight_->value;
  const DType cdt = compute_dtype(precision_, x.dtype());
  Tensor y;
  ops::Fp8Tensor wq;
  switch (precision_.kind) {
    case GemmKind::native:
      y = ops::matmul(as_dtype(x, cdt), false, as_dtype(w, cdt), true);
      break;
    case GemmKind::bf16:
      y = Tensor::empty({T, out_}, DType::f32, x.device());
      ops::gemm(x, false, w, true, y, 1.0, 0.0, ops::GemmOptions{true});
      break;
    case GemmKind::fp8_block: {
      HLM_CHECK(x.is_cpu(),
                "Linear::forward: the fp8_block GEMM has no CUDA implementation yet "
                "(x is {}); use the bf16 or native precision on CUDA",
                x.describe());
      const int64_t kp = pad128(in_);
      wq = quantize_weight(w, precision_);
      const auto xq =
          quantize(x, kp, Fp8Format::e4m3, ops::TileShape::t1x128, precision_.pow2_scales);
      y = ops::fp8_gemm_tn(xq, wq);
      break;
    }
  }
  if (bias_) add_bias(y, bias_->value);
  if (saved && ctx.training) {
    saved->x = x;
    saved->w_q = ctx.recompute ? ops::Fp8Tensor{} : wq;
  }
  return as_dtype(y, x.dtype());
}

bool Linear::writes_directly(DType xdt, DType odt) const {
  if (bias_ || !weight_) return false;
  if (precision_.kind == GemmKind::native)  // exact in one dtype: x, out and the weight
    return (xdt == DType::f32 || xdt == DType::f64) && odt == xdt && weight_->value.dtype() == xdt;
  return precision_.kind == GemmKind::bf16 && (xdt == DType::f32 || xdt == DType::bf16) &&
         (odt == DType::f32 || odt == DType::bf16);
}

void Linear::forward_into(const Tensor& x, Tensor& out) const {
  HLM_CHECK(weight_ != nullptr, "Linear::forward_into: the layer is not initialised");
  HLM_CHECK(x.defined() && x.dim() == 2 && x.size(1) == in_,
            "Linear::forward_into: x must be [T, {}], got {}", in_,
            x.defined() ? x.describe() : "undefined");
  HLM_CHECK(out.defined() && out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == out_ &&
                out.device() == x.device() && out.stride(1) == 1,
            "Linear::forward_into: out must be [{}, {}] with contiguous rows on x's device, got {}",
            x.size(0), out_, out.defined() ? out.describe() : "undefined");
  if (writes_directly(x.dtype(), out.dtype())) {
    HLM_CHECK(x.device() == weight_->value.device(),
              "Linear::forward_into: x must be on the weight's device ({}), got {}",
              device_name(weight_->value.device()), x.describe());
    ops::gemm(x, false, weight_->value, true, out, 1.0, 0.0,
              ops::GemmOptions{precision_.kind == GemmKind::bf16});
    return;
  }
  // forward's output has x's dtype: a bf16 x goes in as f32 (exact), so out is not rounded twice.
  const Tensor xin = x.dtype() == DType::bf16 ? ops::as_dtype(x, DType::f32) : x;
  ops::copy_into(out, forward(Context{false, false}, xin, nullptr));
}

void Linear::forward_into_many(const Tensor& x, const std::vector<const Linear*>& layers,
                               std::vector<Tensor>& outs) {
  HLM_CHECK(!layers.empty() && layers.size() == outs.size(),
            "Linear::forward_into_many: {} layers for {} outputs", layers.size(), outs.size());
  bool grouped = layers.size() > 1;
  for (size_t i = 0; i < layers.size(); ++i) {
    const Linear& l = *layers[i];
    HLM_CHECK(l.weight_ != nullptr && x.defined() && x.dim() == 2 && x.size(1) == l.in_ &&
                  outs[i].defined() && outs[i].dim() == 2 && outs[i].size(0) == x.size(0) &&
                  outs[i].size(1) == l.out_ && outs[i].stride(1) == 1,
              "Linear::forward_into_many: layer {} takes x [T, {}] into [T, {}], got {} into {}", i,
              l.in_, l.out_, x.defined() ? x.describe() : "undefined",
              outs[i].defined() ? outs[i].describe() : "undefined");
    grouped = grouped && l.writes_directly(x.dtype(), outs[i].dtype()) &&
              outs[i].dtype() == outs[0].dtype() && l.weight_->value.device() == x.device();
  }
  if (!grouped) {
    for (size_t i = 0; i < layers.size(); ++i) layers[i]->forward_into(x, outs[i]);
    return;
  }
  std::vector<Tensor> w;
  bool bf16 = true, native = true;
  for (const Linear* l : layers) {
    w.push_back(l->weight_->value);
    bf16 = bf16 && l->precision_.kind == GemmKind::bf16;
    native = native && l->precision_.kind == GemmKind::native;
  }
  if (!bf16 && !native) {  // mixed precisions: one product each
    for (size_t i = 0; i < layers.size(); ++i) layers[i]->forward_into(x, outs[i]);
    return;
  }
  ops::gemm_multi(x, false, w, true, outs, ops::GemmOptions{bf16});
}

Tensor Linear::backward(const Context& ctx, const Tensor& dy, const Saved& saved) {
  HLM_CHECK(weight_ != nullptr, "Linear::backward: the layer is not initialised");
  const Tensor& x = saved.x;
  HLM_CHECK(x.defined(), "Linear::backward: Saved has no input (was forward run with training?)");
  HLM_CHECK(
      dy.defined() && dy.device() == x.device() &&
          (dy.dtype() == DType::f64 || dy.dtype() == DType::f32 || dy.dtype() == DType::bf16),
      "Linear::backward: dy must be an f64, f32 or bf16 tensor on the device of x ({}), got {}",
      device_name(x.device()), dy.defined() ? dy.describe() : "undefined");
  HLM_CHECK(dy.dim() == 2 && dy.size(0) == x.size(0) && dy.size(1) == out_,
            "Linear::backward: dy must be [{}, {}], got {}", x.size(0), out_, dy.describe());
  const int64_t T = x.size(0);
  const Tensor& w = weight_->value;
  Tensor& gw = ensure_grad(*weight_, "Linear");
  const DType cdt = compute_dtype(precision_, x.dtype());
  Tensor dx;
  switch (precision_.kind) {
    case GemmKind::native: {
      dx = ops::matmul(as_dtype(dy, cdt), false, as_dtype(w, cdt), false);
      const DType gd = gw.dtype();
      ops::gemm(as_dtype(dy, gd), true, as_dtype(x, gd), false, gw, 1.0, 1.0);
      break;
    }
    case GemmKind::bf16:
      dx = Tensor::empty({T, in_}, DType::f32, x.device());
      ops::gemm(dy, false, w, false, dx, 1.0, 0.0, ops::GemmOptions{true});
      ops::gemm(dy, true, x, false, gw, 1.0, 1.0, ops::GemmOptions{true});
      break;
    case GemmKind::fp8_block: {
      HLM_CHECK(x.is_cpu(),
                "Linear::backward: the fp8_block GEMM has no CUDA implementation yet "
                "(x is {})",
                x.describe());
      const Fp8Format g = precision_.grad_format;
      const bool pow2 = precision_.pow2_scales;
      // dgrad: K = out. dy 1x128 along out; W^T from the same 128x128 codes as the forward.
      const ops::Fp8Tensor wq = saved.w_q.q.defined() ? saved.w_q : quantize_weight(w, precision_);
      const auto dyq = quantize(dy, pad128(out_), g, ops::TileShape::t1x128, pow2);
      const Tensor dxp = ops::fp8_gemm_tn(dyq, ops::fp8_transpose_blocks(wq));  // [T, pad(in)]
      dx = dxp.slice(1, 0, in_).contiguous();
      // wgrad: K = T. dy^T and x^T quantized 1x128 along T, from high precision (docs/fp8.md,
      // "The blockwise FP8 GEMM").
      const int64_t tp = pad128(T);
      const auto dytq = quantize(dy.transpose(0, 1), tp, g, ops::TileShape::t1x128, pow2);
      const auto xtq =
          quantize(x.transpose(0, 1), tp, Fp8Format::e4m3, ops::TileShape::t1x128, pow2);
      const Tensor dw = ops::fp8_gemm_tn(dytq, xtq);  // [out, in] f32
      add_into(gw, dw);
      break;
    }
  }
  if (bias_ && !x.is_cpu()) {
    // CUDA: the same column sums over t in ascending order in the grad dtype, then gb += sum.
    Tensor& gb = ensure_grad(*bias_, "Linear");
    ops::add_(gb, ops::sum_rows(dy, gb.dtype()));
  } else if (bias_) {
    Tensor& gb = ensure_grad(*bias_, "Linear");
    const DType gd = gb.dtype();
    const Tensor d = as_dtype(dy, gd).contiguous();
    Tensor sum = Tensor::zeros({out_}, gd);
    // Column sums over t in ascending order, in the grad dtype; then gb += sum.
    if (gd == DType::f32) {
      const float* p = d.data<float>();
      float* s = sum.data<float>();
      for (int64_t t = 0; t < T; ++t)
        for (int64_t o = 0; o < out_; ++o) s[o] += p[t * out_ + o];
    } else {
      const double* p = d.data<double>();
      double* s = sum.data<double>();
      for (int64_t t = 0; t < T; ++t)
        for (int64_t o = 0; o < out_; ++o) s[o] += p[t * out_ + o];
    }
    Tensor gb2 = gb.view({1, out_});
    add_into(gb2, sum.view({1, out_}));
  }
  (void)ctx;
  return as_dtype(dx, x.dtype());
}

}  // namespace hlm
