// Linear: y = x W^T (+ b), W [out, in] (HF layout), x [T, in], y [T, out].
// The GEMM precision comes from a policy (layers/precision.h): bf16 (operands rounded to bf16,
// FP32 accumulation), fp32 / f64 (exact in the tensor dtype), or fp8_block (activations quantized
// in 1x128 tiles, weights in 128x128 blocks, E4M3 forward; the backward GEMMs quantize the output
// gradient in E4M3 or E5M2), emulated exactly on the CPU (quantize, dequantize, FP32 accumulation
// per 128 K-elements).
// Forward saves the input (and, for fp8, what the backward GEMMs need); backward writes dx and
// accumulates dW (+= ) and db (+=). Output and dx have the dtype of x; the fp8_block contract
// (quantization, padding of in/out/T to multiples of 128, FP32 accumulation order) is in
// docs/fp8.md and linear.cpp.
#pragma once

#include <string>
#include <vector>

#include "layers/module.h"
#include "layers/precision.h"
#include "ops/fp8_quant.h"

namespace hlm {

class Linear : public Module {
 public:
  struct Saved {
    Tensor x;  // the layer input [T, in] as given
    // fp8_block only (empty under ctx.recompute, when backward re-quantizes W): the 128x128 E4M3
    // quantization of W, zero-padded to [out, ceil(in/128)*128], that the forward GEMM used; the
    // dgrad GEMM uses the same codes and scales (2-D blocks transpose exactly; docs/fp8.md, "The
    // blockwise FP8 GEMM").
    ops::Fp8Tensor w_q;
  };

  Linear() = default;
  // Parameters "weight" [out, in] (and "bias" [out]), initialised to zeros (fill weight().value
  // to initialise). dt: parameter dtype (f64, f32 or bf16); x and dy: f64, f32 or bf16.
  Linear(int64_t in_features, int64_t out_features, bool bias, GemmPrecision precision,
         DType dt = DType::f32);
  void init(int64_t in_features, int64_t out_features, bool bias, GemmPrecision precision,
            DType dt = DType::f32);

  Tensor forward(const Context& ctx, const Tensor& x, Saved* saved) const;
  // Inference (nothing saved): forward's y written into out, a [T, out] tensor or view with
  // contiguous rows on x's device, converted to out's dtype (f64, f32 or bf16). With no bias the
  // GEMM writes out directly: under a bf16 GEMM (x may then be given already in bf16, the
  // rounding forward applies, done once for several layers) and under a native one with x, out
  // and the weight of one dtype; otherwise through forward and a copy.
  void forward_into(const Tensor& x, Tensor& out) const;
  // Whether forward_into writes out without a copy for x of dtype xdt and out of dtype odt.
  bool writes_directly(DType xdt, DType odt) const;
  // forward_into for several layers that read the same x (a layer's projections): one grouped
  // GEMM (ops::gemm_multi) where every layer writes directly and the outputs share a dtype, else
  // one forward_into each. The same values either way.
  static void forward_into_many(const Tensor& x, const std::vector<const Linear*>& layers,
                                std::vector<Tensor>& outs);
  Tensor backward(const Context& ctx, const Tensor& dy, const Saved& saved);

  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  const GemmPrecision& precision() const { return precision_; }
  void set_precision(const GemmPrecision& p) { precision_ = p; }
  // Module: the weight in bf16 under a bf16 GEMM.
  void keep_gemm_weights_in_bf16() override;
  Param& weight() { return *weight_; }
  Param* bias() { return bias_; }
  const Tensor& weight_value() const { return weight_->value; }

 private:
  int64_t in_ = 0, out_ = 0;
  GemmPrecision precision_;
  Param* weight_ = nullptr;
  Param* bias_ = nullptr;
};

}  // namespace hlm
