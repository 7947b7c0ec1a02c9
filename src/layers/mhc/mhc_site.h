// MhcSite: one mHC site of a decoder layer ("attn" or "ffn"), the parameter-owning module over
// ops/mhc.h (the GLM-5.3-Flash contract: docs/mhc_moe.md, "mHC"; decisions in "Modules").
//
// Per token, with the n residual streams X [T, n, D] and flat = vec(X) (stream-major):
//   inv_rms = 1 / sqrt(mean(flat^2) + norm_eps)
//   mix     = (fn @ flat) * inv_rms                            fn [(2+n) n, n D]
//   pre_j   = sigmoid(mix[j] scale[0] + base[j]) + hc_eps
//   post_j  = 2 sigmoid(mix[n+j] scale[1] + base[n+j])
//   comb    = sinkhorn(mix[2n..] scale[2] + base[2n..])         (n x n, row-major)
//   u       = sum_j pre_j X_j                                   collapse: returned to the caller
//   y       = sublayer(RMSNorm_w(u))                            the caller's (norm + attn / FFN)
//   X'_i    = post_i y + sum_j comb[j][i] X_j                   write-back (comb TRANSPOSED)
//
// Use (the decoder layer; one Saved per site per step):
//   MhcSite::Saved s;
//   Tensor u  = site.collapse(ctx, X, s);          // [T, D]
//   Tensor y  = sublayer(norm(u));                 // [T, D]
//   Tensor X2 = site.write_back(ctx, y, s);        // [T, n, D]
// backward, the two halves in reverse:
//   MhcSite::Partial p = site.backward_write_back(ctx, dX2, s);   // p.dy for the sublayer
//   Tensor du = norm.backward(sublayer.backward(p.dy));
//   Tensor dX = site.backward_collapse(ctx, du, s, p);             // param grads += here
// Model level (no parameters, already ops): X0 = ops::mhc_expand(embed, n) and the exit
// h = ops::mhc_mean_contract(XL) (the mean output contract, no hc_head), with their backwards.
//
// Conventions (docs/architecture.md): explicit forward and backward, no autograd. Activation
// gradients are written (=): dy in y's dtype, dX in X's dtype. Parameter gradients accumulate (+=)
// into Param::grad, all in backward_collapse (the mapping backward needs d pre, d post and d comb
// together). dX = write-back path + collapse path + mapping path, added in that fixed order, the
// same arithmetic as ops::mhc_site_backward (bit for bit). Saved is needed in inference too: it
// carries the mappings from collapse to write_back (with ctx.training = false, write_back empties
// it). Under ctx.recompute the mappings are dropped after write_back and backward_write_back
// recomputes them from X (deterministic: bit for bit).
//
// Parameters (HF names, relative to the DECODER LAYER path, e.g. "model.layers.3"; all keep_fp32,
// no weight decay; f64 in f64 mode):
//   hc_{attn|ffn}_fn    [(2+n) n, n D]   rows 0..n-1 pre, n..2n-1 post, 2n.. comb (i, j) at 2n+ni+j
//   hc_{attn|ffn}_base  [(2+n) n]
//   hc_{attn|ffn}_scale [3]               (scale_pre, scale_post, scale_comb)
//
// Init (deterministic from cfg.seed, one Philox stream per parameter from its full name):
//   MhcInit::hf (default, the HF reference; docs/mhc_moe.md, "Decisions"): fn ~ N(0, init_std),
//     base = 0, scale = 1.
//     At fn = 0 this gives pre = 1/2 + hc_eps (u = (1/2) sum_j X_j), post = 1 and comb = J/n
//     (every stream receives the mean of the streams).
//   MhcInit::residual (pre-norm-residual start, paper/HC-style): fn ~ N(0, init_std), scale =
//     (gating, gating, gating) with gating = cfg.init_gating (paper 0.01), base_pre =
//     logit(1/n - hc_eps) (pre = 1/n: u = mean of the streams), base_post = 0 (post = 1),
//     base_comb = diag(ln((n-1)(1-d)/d)) with d = 1e-3 (softmax rows put 1 - d on the diagonal,
//     so comb = I up to ~1e-3 and X'_i = X_i + y at fn = 0).
//
// Precision: the mappings in FP32 (FP64 when X is f64), u and X' stored in X's dtype (bf16
// streams: FP32 arithmetic, bf16 store). Every step is per token: a packed batch gives its
// sequences' results bit for bit; parameter gradients reduce over tokens in token order.
#pragma once

#include <cstdint>
#include <string>

#include "layers/module.h"
#include "layers/precision.h"
#include "ops/mhc.h"

namespace hlm {

enum class MhcSiteKind : uint8_t { attn, ffn };
const char* mhc_site_kind_name(MhcSiteKind k);  // "attn" / "ffn"

enum class MhcInit : uint8_t { hf, residual };

// Checkpoint names of a site's parameters, relative to the decoder layer.
enum class MhcNaming : uint8_t {
  hc_prefixed,   // hc_attn_fn, hc_attn_base, hc_attn_scale (GLM-5.3-Flash; DeepSeek-V4 style)
  transformers,  // attn_hc.fn, attn_hc.base, attn_hc.scale (transformers' modeling_glm5_next)
};

struct MhcSiteConfig {
  int64_t hidden_size = 0;      // D (one stream)
  int64_t hc_mult = 4;          // n
  double hc_eps = 1e-6;         // pre offset, softmax and Sinkhorn epsilon
  double norm_eps = 1e-5;       // rms_norm_eps of the flat RMS (inside the sqrt)
  int64_t sinkhorn_iters = 20;  // hc_sinkhorn_iters (>= 1)
  MhcInit init = MhcInit::hf;   // see the top of this file
  MhcNaming naming = MhcNaming::hc_prefixed;
  double init_std = 0.02;     // fn ~ N(0, init_std) (HF initializer_range)
  double init_gating = 0.01;  // MhcInit::residual: the three scales (paper alpha = 0.01)
  DType dtype = DType::f32;   // f64 (FD tests) or f32; bf16 is accepted and stored as f32
  uint64_t seed = 0;

  // Throws hlm::Error naming the field: hidden_size < 1, hc_mult < 1 (or 1 with MhcInit::residual),
  // eps < 0 / not finite, sinkhorn_iters < 1, init_std < 0, dtype not f64/f32/bf16.
  void validate() const;
  ops::MhcConfig op_config() const;
};

class MhcSite : public Module {
 public:
  struct Saved {
    Tensor x;                // [T, n, D] site input, as given
    Tensor y;                // [T, D] sublayer output, as given to write_back
    ops::MhcMappings maps;   // from collapse; dropped after write_back under ctx.recompute
    bool training = false;   // the forward ran with ctx.training
    bool collapsed = false;  // collapse ran (write_back may follow)
  };
  // The write-back half of the backward, consumed by backward_collapse.
  struct Partial {
    Tensor dy;              // [T, D] in y's dtype: the sublayer's output gradient
    Tensor dx;              // [T, n, D] write-back path of dX, compute dtype
    Tensor dpost, dcomb;    // [T, n], [T, n, n]
    ops::MhcMappings maps;  // recomputed mappings (ctx.recompute), else empty
  };

  // `layer_path` is the decoder layer's full name ("model.layers.3"); the parameters are
  // layer_path + ".hc_attn_fn" etc. The policy is accepted for uniformity: the mHC role always
  // resolves to native FP32 (docs/fp8.md, "The precision policy"; the mapping GEMM is part of
  // ops/mhc).
  MhcSite(const MhcSiteConfig& cfg, MhcSiteKind kind, const PrecisionPolicy& policy,
          const std::string& layer_path);

  // X [T, n, D] (f64/f32/bf16) -> u [T, D] in X's dtype. Fills s (always: write_back needs it).
  Tensor collapse(const Context& ctx, const Tensor& x, Saved& s) const;
  // Inference: collapse followed by the sublayer's RMSNorm (weight norm_w [D], eps), in one pass
  // (ops::mhc_collapse_norm: on CUDA two kernels instead of four and a GEMM): returns the normed
  // sublayer input; write_back follows as after collapse.
  Tensor collapse_norm(const Tensor& x, const Tensor& norm_w, double eps, Saved& s) const;
  // y [T, D] (any floating dtype) -> X' [T, n, D] in X's dtype. Needs the Saved of collapse.
  Tensor write_back(const Context& ctx, const Tensor& y, Saved& s) const;

  // dX' [T, n, D] -> dy (and the pending write-back terms). No parameter gradient here.
  Partial backward_write_back(const Context& ctx, const Tensor& dx_out, const Saved& s) const;
  // du [T, D] (the gradient of collapse's output) -> dX [T, n, D] in X's dtype; fn/base/scale
  // grads +=.
  Tensor backward_collapse(const Context& ctx, const Tensor& du, const Saved& s, const Partial& p);

  const MhcSiteConfig& config() const { return cfg_; }
  MhcSiteKind kind() const { return kind_; }
  const std::string& layer_path() const { return path_; }
  Param& fn() { return *fn_; }
  Param& base() { return *base_; }
  Param& scale() { return *scale_; }
  ops::MhcParams params() const { return {fn_->value, base_->value, scale_->value}; }

 private:
  // hlm::Error unless x is a floating [T, hc_mult, hidden_size] tensor on the parameters' device.
  void check_streams(const Tensor& x, const char* what) const;
  MhcSiteConfig cfg_;
  MhcSiteKind kind_;
  std::string path_;
  Param* fn_ = nullptr;
  Param* base_ = nullptr;
  Param* scale_ = nullptr;
};

}  // namespace hlm
