// MLA: DeepSeek multi-head latent attention (docs/dsa.md, "MLA" and "The MLA module and
// the DSA layer"), explicit forward and backward, on CPU or CUDA tensors (Module::to moves the
// parameters; every input must be on their device). CUDA runs the absorbed form whatever `form`
// says (the same function; the expanded per-head attention is a CPU reference).
//
// Conventions (docs/architecture.md): forward(ctx, x, cu_seqlens, saved*) fills Saved with what
// backward needs (only the input under ctx.recompute; backward then re-runs the forward); backward
// writes dx (=) and accumulates every parameter gradient (+=). Packed THD input x [T, D] with
// cu_seqlens [N+1]; attention is causal within each sequence and RoPE positions restart at 0 in
// each one.
//
// Math (per token t, head h; d_n = qk_nope_head_dim, d_r = qk_rope_head_dim, d_v = v_head_dim,
// r_q = q_lora_rank, r_kv = kv_lora_rank, dqk = d_n + d_r):
//   c_q            = RMSNorm_q(W_DQ x_t)                        [r_q]  (r_q == 0: no c_q)
//   [qn_h ; qp_h]  = (W_UQ c_q)_h  or (W_Q x_t)_h               [d_n ; d_r]
//   [c_kv ; kp]    = W_DKV x_t, c_kv <- RMSNorm_kv(c_kv)        [r_kv ; d_r]
//   qp_h, kp       <- RoPE_pos(qp_h), RoPE_pos(kp)              (interleaved pairs; skipped when
//                                                                 rope is off: Kimi-Linear)
//   expanded:  k_h = [W_UK_h c_kv ; kp], v_h = W_UV_h c_kv,  o_h = sum_s softmax_s(scale q_h.k_h)
//   v_h absorbed:  q_abs_h = [W_UK_h^T qn_h ; qp_h]  [r_kv + d_r],  kv = [c_kv ; kp] (one KV head),
//              o_lat_h = sum_s softmax_s(scale q_abs_h.kv_s) c_kv(s),  o_h = W_UV_h o_lat_h
//   y_t = W_O concat_h o_h
// kv_b_proj.weight viewed as [H, d_n + d_v, r_kv]: rows [0, d_n) of head h are W_UK_h, rows
// [d_n, d_n + d_v) are W_UV_h. Both forms give the same result in exact arithmetic.
//
// Parameters (HF names relative to self_attn): q_a_proj.weight [r_q, D], q_a_layernorm.weight
// [r_q], q_b_proj.weight [H*dqk, r_q] (or q_proj.weight [H*dqk, D] when r_q == 0),
// kv_a_proj_with_mqa.weight [r_kv + d_r, D], kv_a_layernorm.weight [r_kv], kv_b_proj.weight
// [H*(d_n + d_v), r_kv], o_proj.weight [D, H*d_v]. No biases.
//
// Precision: parameters f64 (everything computed in f64: the FD tests), f32 or bf16 (computed in
// f32). The five projections take their GEMM precision from PrecisionPolicy::resolve(path +
// ".q_a_proj", ModuleRole::mla_proj) etc. (so mla_proj_disable_quantization keeps them out of
// FP8). Norms, RoPE and the softmax run in the compute dtype (f32 or f64). The per-head W_UK / W_UV
// products of the absorbed form follow kv_b_proj's precision: exact for native, bf16 operands
// with FP32 accumulation for bf16 and fp8_block (the serving engines run them on the dequantised
// bf16 weight).
// The absorbed attention follows the same switch (attention_operand): native computes it in the
// compute dtype; bf16 and fp8_block give it bf16 queries, latent rows, output and output gradient.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/seq_layout.h"
#include "layers/linear.h"
#include "layers/module.h"
#include "layers/precision.h"

namespace hlm {

enum class MlaForm : uint8_t {
  expanded,  // per-head keys/values from kv_b_proj (training / dense prefill)
  absorbed,  // W_UK folded into q, attention over the latent as one KV head, W_UV after
};

// YaRN rope scaling (HF rope_scaling type "yarn" / "deepseek_yarn"; docs/dsa.md, "MLA").
struct YarnConfig {
  double factor = 1.0;                             // "factor"
  double original_max_position_embeddings = 4096;  // "original_max_position_embeddings"
  double beta_fast = 32;                           // "beta_fast"
  double beta_slow = 1;                            // "beta_slow"
  double mscale = 1;                               // "mscale"
  double mscale_all_dim = 0;                       // "mscale_all_dim" (0: no softmax mscale)
  double attention_factor = 0;                     // "attention_factor" (0: derived, see below)
};

// m(factor, a) = 0.1 a ln(factor) + 1 for factor > 1, else 1 (HF / vLLM yarn_get_mscale).
double yarn_get_mscale(double factor, double mscale);

struct MlaConfig {
  int64_t hidden_size = 0;       // D
  int64_t num_heads = 0;         // H
  int64_t q_lora_rank = 0;       // r_q; 0: a plain q_proj (q_lora_rank null, Kimi-Linear)
  int64_t kv_lora_rank = 0;      // r_kv
  int64_t qk_nope_head_dim = 0;  // d_n
  int64_t qk_rope_head_dim = 0;  // d_r; 0: NoPE (GLM-5.3-Flash)
  int64_t v_head_dim = 0;        // d_v
  double rms_norm_eps = 1e-5;
  // false with d_r > 0: the "pe" channels exist but are not rotated (Kimi-Linear mla_use_nope).
  bool rope = true;
  double rope_theta = 10000;
  std::optional<YarnConfig> yarn;  // rope_scaling (requires rope and d_r > 0)
  double softmax_scale = 0;        // 0: derived (softmax_scale_value())
  MlaForm form = MlaForm::expanded;
  DType param_dtype = DType::f32;  // f64, f32 or bf16
  double init_std = 0.02;          // init_weights: N(0, init_std) for every projection

  // Throws hlm::Error naming the first bad field.
  void validate() const;
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  bool rotary() const { return rope && qk_rope_head_dim > 0; }
  // docs/dsa.md, "MLA": (d_n + d_r)^-1/2 (NoPE: d_n^-1/2), times m^2 with
  // m = yarn_get_mscale(factor, mscale_all_dim) when YaRN is on and mscale_all_dim != 0; or the
  // explicit softmax_scale.
  double softmax_scale_value() const;
  // RoPE inverse frequencies [d_r / 2] in f64: theta^(-2i/d_r), with YaRN the ramp of docs/dsa.md,
  // "MLA" (low = floor(corr(beta_fast)), high = ceil(corr(beta_slow)), clamped to [0, d_r - 1];
  // corr(b) = d_r ln(L_orig / (2 pi b)) / (2 ln theta); mix = clamp((i - low) / (high - low), 0,
  // 1); inv = (inv_base / factor) * mix + inv_base * (1 - mix)). Empty when !rotary().
  std::vector<double> rope_inv_freq() const;
  // The factor on cos and sin (HF _compute_yarn_parameters): attention_factor if given, else
  // m(factor, mscale) / m(factor, mscale_all_dim) when both are non-zero, else m(factor, 1);
  // 1 without YaRN.
  double rope_attention_factor() const;
};

class Mla : public Module {
 public:
  // The projected activations (compute dtype, contiguous).
  struct Projected {
    Tensor c_q;  // [T, r_q] after q_a_layernorm: the indexer's query input (undefined if r_q == 0)
    Tensor q;    // [T, H, d_n + d_r], RoPE applied to the last d_r channels
    Tensor kv;   // [T, r_kv + d_r] = [c_kv (normed) ; k_pe (RoPE applied)]: the latent cache row
  };
  struct ProjSaved {
    Linear::Saved q_a;               // q_a_proj (q_proj when r_q == 0)
    Linear::Saved q_b;               // q_b_proj
    Linear::Saved kv_a;              // kv_a_proj_with_mqa
    Tensor q_a_out;                  // [T, r_q] input of q_a_layernorm
    Tensor q_rstd;                   // [T]
    Tensor kv_lat_raw;               // [T, r_kv] input of kv_a_layernorm
    Tensor kv_rstd;                  // [T]
    std::vector<int64_t> positions;  // [T] position within the token's sequence
  };
  struct OutSaved {
    Tensor o_lat;  // [T, H, r_kv] absorbed attention output (input of W_UV)
    Linear::Saved o_proj;
  };
  struct Saved {
    Tensor x;           // the layer input as given (always kept)
    SeqLayout seqs;     // as given
    bool full = false;  // false under ctx.recompute: backward re-runs the forward
    MlaForm form = MlaForm::expanded;
    ProjSaved proj;
    Projected p;
    // expanded
    Linear::Saved kv_b;
    Tensor k, v;  // [T, H, dqk], [T, H, d_v]
    Tensor attn;  // [T, H, d_v] attention output (input of o_proj)
    Linear::Saved o_proj;
    // absorbed
    Tensor q_abs;  // [T, H, r_kv + d_r] as the attention took it (attention_operand)
    OutSaved out;
    Tensor lse;  // [T, H] natural-log softmax normaliser
  };

  // path: the module path for the precision policy ("model.layers.3.self_attn").
  Mla(const MlaConfig& cfg, const PrecisionPolicy& policy, const std::string& path = "self_attn");

  const MlaConfig& config() const { return cfg_; }
  const std::string& path() const { return path_; }
  void set_form(MlaForm f) { cfg_.form = f; }
  DType compute_dtype() const;  // f64 for f64 parameters, else f32
  // Where the parameters are (Module::to moves them): every input must be there too.
  Device device() const;

  // Deterministic initialisation of the MLA parameters (not of any child a derived layer adds):
  // parameter i in named_parameters() order of a plain Mla gets N(0, init_std) from Rng(seed, i);
  // the two layernorm weights are set to 1.
  void init_weights(uint64_t seed);

  // x [T, D] (f64, f32 or bf16) -> y [T, D] in x's dtype.
  Tensor forward(const Context& ctx, const Tensor& x, const SeqLayout& seqs, Saved* saved) const;
  // The same with a cu_seqlens tensor [N+1] (checked here; undefined: one sequence; an unusable
  // input is reported by the overload above).
  Tensor forward(const Context& ctx, const Tensor& x, const Tensor& cu_seqlens,
                 Saved* saved) const {
    return forward(ctx, x,
                   (x.defined() && x.dim() > 0
                        ? SeqLayout::from_tensor(cu_seqlens, x.size(0), "Mla::forward: cu_seqlens")
                        : SeqLayout()),
                   saved);
  }
  // dy [T, D] -> dx [T, D] in the dtype of the saved x.
  Tensor backward(const Context& ctx, const Tensor& dy, const Saved& saved);

  // ---- the stages, for the DSA layer (all tensors in the compute dtype) ----
  // starts (optional, [N]): the position of each sequence's first token (a decode step or a
  // continued prefill: the tokens already in the cache); absent: 0, the sequence start.
  Projected project(const Context& ctx, const Tensor& x, const SeqLayout& seqs, ProjSaved* saved,
                    const std::vector<int64_t>* starts = nullptr) const;
  // dq [T, H, dqk], dkv [T, r_kv + d_r] (gradients of Projected::q and ::kv) -> dx [T, D]. c_q
  // gets no gradient from outside (the indexer's input is detached).
  Tensor project_backward(const Context& ctx, const Tensor& dq, const Tensor& dkv,
                          const ProjSaved& saved);
  // q [T, H, dqk] -> q_abs [T, H, r_kv + d_r] = [W_UK_h^T qn_h ; qp_h].
  Tensor absorb_query(const Tensor& q) const;
  // dq_abs -> dq [T, H, dqk]; kv_b_proj.weight grad (W_UK rows) +=.
  Tensor absorb_query_backward(const Tensor& dq_abs, const Tensor& q);
  // o_lat [T, H, r_kv] -> y [T, D] = W_O concat_h (W_UV_h o_lat_h).
  Tensor output(const Context& ctx, const Tensor& o_lat, OutSaved* saved) const;
  // dy [T, D] -> do_lat [T, H, r_kv]; o_proj and kv_b_proj (W_UV rows) grads +=.
  Tensor output_backward(const Context& ctx, const Tensor& dy, const OutSaved& saved);

  // An operand of the absorbed attention (q_abs, the latent rows kv, its output o_lat, the
  // output's gradient, and the gradients dq_abs / dkv it returns) as the attention takes it. With
  // kv_b_proj's precision native: t itself. Otherwise (bf16, fp8_block) rounded to bf16, as the
  // serving engines hold the latent cache and the queries: on CUDA a bf16 tensor (the tensor-core
  // kernels: bf16 products, f32 softmax and sums), on the CPU a tensor of the compute dtype holding
  // the bf16 values (the CPU op computes in f32 / f64).
  Tensor attention_operand(const Tensor& t) const;
  // The dtype attention_operand gives on the layer's device: bf16 on CUDA unless kv_b_proj is
  // native, else the compute dtype (what an inference cache keeps the latents in).
  DType attention_dtype() const;
  // The rule of attention_dtype for a layer whose kv_b_proj resolves to `kv_b`, computing in
  // `compute` on `device` (ModelCache sizes its latent rows by it before any layer exists).
  static DType attention_dtype(GemmKind kv_b, DType compute, Device device);

  // Every causal token of its own sequence, ascending, then -1: i32 [T, max(1, longest)].
  static Tensor causal_indices(const std::vector<int64_t>& cu, int64_t T);

  Linear& q_a_proj() { return q_a_proj_; }
  Linear& q_b_proj() { return q_b_proj_; }
  Linear& q_proj() { return q_proj_; }
  Linear& kv_a_proj_with_mqa() { return kv_a_proj_; }
  Linear& kv_b_proj() { return kv_b_proj_; }
  Linear& o_proj() { return o_proj_; }

 private:
  // The whole forward; fills *s (all fields) when s != nullptr.
  Tensor forward_full(const Tensor& x, const std::vector<int64_t>& cu, const SeqLayout& seqs,
                      Saved* s, MlaForm form) const;
  Tensor backward_full(const Tensor& dy, const Saved& s);

  MlaConfig cfg_;
  std::string path_;
  std::vector<double> inv_freq_;
  double rope_factor_ = 1;
  Linear q_a_proj_, q_b_proj_, q_proj_, kv_a_proj_, kv_b_proj_, o_proj_;
  Param* q_norm_ = nullptr;
  Param* kv_norm_ = nullptr;
};

}  // namespace hlm
