// MoeLayer: the sigmoid-routed MoE block of DeepSeek-V3 / GLM-5.3-Flash (docs/mhc_moe.md,
// "MoE" and "Modules"; HF Glm5NextTextMoE), the parameter-owning module over ops/moe.h. CPU
// reference.
//
// Forward, per token x [D] (the sublayer input after post_attention_layernorm):
//   logits = x W_router^T                       FP32 (FP64 in f64 mode), native GEMM, [E]
//   route  = ops::moe_router_forward(logits, e_score_correction_bias, cfg)
//            s = sigmoid(logits); selection on s + bias (group-limited when n_group > 1); top-k;
//            w = s[idx] (unbiased), renormalised (norm_topk_prob), * routed_scaling_factor
//            replay (R3): the given indices replace the selection; w is computed the same way
//   routed = sum_{k=0..K-1} w_k E_{idx_k}(x)    E_e(x) = down_e(swiglu_clamped(gate_up_e x, L))
//   y      = routed + Shared(x)                 shared expert: DenseMlp, always on, ungated
//   (combined in that fixed order, k ascending then the shared expert: deterministic)
// Also returned: the per-expert token counts [E] (for the aux-loss-free bias update, after the
// caller all-reduces them) and, when aux_loss_coeff > 0, the sequence-wise aux loss
// (ops::moe_seq_aux_loss over cu_seqlens; DeepSeek-V3 L_bal = alpha sum_i f_i P_i, per sequence,
// averaged over the non-empty sequences).
//
// Backward (explicit, no autograd): dx = routed path (k ascending) + shared expert + router, added
// in that order per element. d w_k = <dy, E_{idx_k}(x)>; the router gets d logits through the
// renormalisation and sigmoid (ops::moe_router_backward) plus, with aux_loss_coeff > 0, d_aux times
// the aux loss gradient; x gets the router path too (it is not detached). Activation gradients are
// written (=, in x's dtype); parameter gradients accumulate (+=) into Param::grad. The router bias
// has no gradient (its grad stays zero): it moves only through update_bias().
// Under ctx.recompute only x, the selection (topk_idx) and cu_seqlens are kept (and the shared
// expert's input); backward recomputes the router (replaying the saved selection) and the experts
// bit for bit.
//
// Parameters (HF glm5_next names relative to the module path, e.g. "model.layers.3.mlp"):
//   gate.weight                     [E, D]     router; keep_fp32 (FP32 through bf16 casts)
//   gate.e_score_correction_bias    [E]        keep_fp32, no weight decay, no gradient, init 0
//   experts.gate_up_proj            [E, 2I, D] fused per expert: rows 0..I-1 gate, I..2I-1 up
//   experts.down_proj               [E, D, I]
//   shared_experts.{gate,up,down}_proj.weight  [I_s, D], [I_s, D], [D, I_s]; I_s = I * n_shared
// Init: N(0, init_std) for every weight from cfg.seed (one Philox stream per parameter from its
// full name); the bias 0.
//
// Precision: the router is a native FP32 Linear (role router, never FP8). The routed expert GEMMs
// run the precision the policy resolves for path + ".experts" with role moe_expert, with exactly
// the numerics of a Linear of that precision applied per expert to the expert's tokens (ascending
// token order): a Linear worker whose weight (and gradient) alias the expert's slice of the fused
// parameters. So native, bf16 (operands rounded to bf16, FP32 accumulation) and fp8_block (per
// expert: E4M3 1x128 activation tiles, 128x128 weight blocks of the fused [2I, D] / [D, I]
// matrix, gradients in the policy's format; wgrad tiles along that expert's tokens) are all
// emulated on the CPU. The shared expert resolves path + ".shared_experts.*_proj" (role
// moe_expert). Compute dtype f64 when x is f64, else f32 (bf16 x is converted once); y and dx
// are rounded once to x's dtype.
//
// Packing: everything but the aux loss is per token, so a packed batch gives its sequences' rows
// of y, dx, topk_idx and topk_weight (and counts that sum to the packed counts). The aux loss is
// per sequence: the packed value is the mean of the sequences' values (its gradient 1/N of theirs).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "layers/linear.h"
#include "layers/mlp.h"
#include "layers/module.h"
#include "layers/precision.h"
#include "ops/moe.h"

namespace hlm {

namespace dist {
class Comm;
class CpSlice;
}  // namespace dist

struct MoeConfig {
  int64_t hidden_size = 0;     // D
  int64_t n_experts = 0;       // E = n_routed_experts
  int64_t top_k = 0;           // K = num_experts_per_tok
  int64_t n_group = 1;         // group-limited routing (GLM: 1 = off; DeepSeek-V3: 8)
  int64_t topk_group = 1;      // groups kept (DeepSeek-V3: 4)
  bool norm_topk_prob = true;  // renormalise the top-k weights
  double routed_scaling_factor = 2.5;
  int64_t moe_intermediate_size = 0;  // I of a routed expert
  int64_t n_shared_experts = 1;       // shared expert width I * n_shared_experts; 0: none
  double swiglu_limit = 10.0;         // GLM clamp (routed and shared); <= 0 or inf: none
  double aux_loss_coeff = 0.0;        // sequence-wise aux loss alpha; 0: off (GLM bridge: 1e-3)
  DType dtype = DType::f32;           // expert / shared parameter dtype: f64, f32 or bf16
  uint64_t seed = 0;
  double init_std = 0.02;
  // Expert parallel (docs/parallel.md, "Expert parallelism"): the routed experts are split over
  // ep_size ranks, this one holding experts [ep_rank E / ep_size, (ep_rank + 1) E / ep_size)
  // (ep_size must divide E). 1: every expert here.
  int64_t ep_size = 1;
  int64_t ep_rank = 0;

  // Throws hlm::Error naming the first bad field (the router constraints of ops/moe.h included:
  // top_k in [1, E], n_group divides E with >= 2 experts per group when > 1, topk_group in
  // [1, n_group], top_k <= topk_group * E / n_group, routed_scaling_factor finite > 0).
  void validate() const;
  ops::MoeRouterConfig router_config() const;
  int64_t local_experts() const { return n_experts / ep_size; }       // E / ep_size
  int64_t first_expert() const { return ep_rank * local_experts(); }  // of this rank's
  DenseMlpConfig shared_config() const;  // the shared expert's DenseMlp config
};

// The router Linear ("gate"): weight [E, D] plus the selection bias e_score_correction_bias [E].
class MoeRouterGate : public Linear {
 public:
  MoeRouterGate() = default;
  void init_gate(int64_t hidden, int64_t n_experts, DType dt);  // native FP32 GEMM
  Param& correction_bias() { return *corr_bias_; }
  const Tensor& correction_bias_value() const { return corr_bias_->value; }

 private:
  Param* corr_bias_ = nullptr;
};

class MoeLayer : public Module {
 public:
  struct Output {
    Tensor y;             // [T, D] in x's dtype
    Tensor topk_idx;      // [T, K] i64 (descending biased score; replay: as given)
    Tensor topk_weight;   // [T, K] compute dtype (renormalised, scaled)
    Tensor counts;        // [E] i64 tokens per expert (this batch; all-reduce before update_bias)
    double aux_loss = 0;  // coeff * seq aux loss (0 when aux_loss_coeff == 0)
  };

  struct ExpertSaved {
    std::vector<int64_t> rows;    // assignments a = t*K + k routed to this expert, ascending
    Linear::Saved gate_up, down;  // the expert's two GEMMs
    Tensor gu;                    // [n_e, 2I] pre-activations, compute dtype
  };

  struct EpDispatch;  // expert parallel: where the assignments went (moe_layer.cpp)

  struct Saved {
    // Always kept (also under ctx.recompute):
    dist::Comm* ep = nullptr;  // the expert-parallel group (ep_size > 1)
    Tensor x;                  // [T, D] compute dtype
    DType x_dtype = DType::f32;
    SeqLayout seqs;           // the batch's sequences (one when none was given)
    Tensor topk_idx;          // [T, K] i64, the selection
    DenseMlp::Saved shared;   // the shared expert (its own recompute rule)
    bool recomputed = false;  // true: the fields below are empty, backward recomputes them
    Linear::Saved router;
    Tensor logits;  // [T, E] compute dtype
    ops::MoeRouterResult route;
    Tensor eo;                         // [T * K, D] unweighted routed expert outputs
    std::vector<ExpertSaved> experts;  // [E] (the per-expert path)
    // The grouped path (CUDA; see run_experts): the assignments sorted by expert, stably.
    bool grouped = false;
    std::vector<int64_t> counts;  // [E] assignments per expert
    std::vector<int64_t> order;   // [T * K] the assignment a = t*K + k at sorted row p
    std::vector<int64_t> pos;     // [T * K] its inverse: the sorted row of assignment a
    Tensor xp;                    // [N, D] x's rows in sorted order (bf16 under a bf16 GEMM)
    Tensor gu;                    // [N, 2I] pre-activations, compute dtype
    Tensor h;                     // [N, I] activations (bf16 under a bf16 GEMM)
    // Expert parallel: the dispatch, and the experts' own Saved over the rows this rank received.
    std::shared_ptr<const EpDispatch> ep_dispatch;
    // Context parallel: the whole sequences' lengths and expert counts of the aux loss (kept also
    // under ctx.recompute: the backward needs no exchange).
    std::shared_ptr<const ops::MoeAuxWhole> aux_whole;
  };

  // Validates cfg; `path` is the module's full name (e.g. "model.layers.3.mlp"). Precisions are
  // resolved from policy once here (see the top of this file).
  MoeLayer(const MoeConfig& cfg, const PrecisionPolicy& policy, const std::string& path);

  // x [T, D] f64/f32/bf16; seqs: the layout of the T tokens (used by the aux loss only);
  // replay_idx [T, K] i64/i32 (undefined: select). Fills *saved when saved && ctx.training.
  // Expert parallel (config ep_size > 1): ep is the group (ep_size ranks, this one ep_rank; every
  // rank calls with its own tokens). Each assignment's row goes to the rank of its expert and its
  // output comes back (two all-to-alls, and two more in the backward); the router and the shared
  // expert run here on this rank's tokens. Parameter gradients are this rank's share: the
  // router's and the shared expert's sum over the group is the whole batch's, and each routed
  // expert's is whole on the rank that holds it.
  // stats false: neither the aux loss (Output::aux_loss 0) nor the expert load (counts undefined),
  // as over the inference cache: both check or read the selection on the host, which waits for
  // the device.
  // On CUDA, outside training (no Saved kept) and at decode sizes (T K <= kRoutedRowsPerExpert
  // E), the routed experts run through ops::moe_routed_experts: the selection stays on the device.
  // Context parallel (cp: this rank's slice of a packed batch, seqs = cp->local()): the aux loss
  // of a sequence cut by a slice boundary takes the whole sequence's length and expert counts
  // (one all-gather over the group of every slice's counts per sequence), so it is this slice's
  // share (ops::moe_seq_aux_loss); everything else is per token.
  Output forward(const Context& ctx, const Tensor& x, const SeqLayout& seqs, Saved* saved,
                 const Tensor& replay_idx = Tensor(), dist::Comm* ep = nullptr, bool stats = true,
                 const dist::CpSlice* cp = nullptr) const;
  // The device path's limit on the mean rows per expert (above it the grouped GEMMs' tensor cores
  // pay for the host-sized groups).
  static constexpr int64_t kRoutedRowsPerExpert = 16;
  // The same with the layout read from cu_seqlens [N+1] i32/i64 (undefined: one sequence).
  Output forward(const Context& ctx, const Tensor& x, const Tensor& cu_seqlens, Saved* saved,
                 const Tensor& replay_idx = Tensor()) const;
  // dy [T, D] (any floating dtype) -> dx [T, D] in x's dtype; parameter grads +=. d_aux is the
  // gradient of the objective w.r.t. Output::aux_loss (1 when the trainer adds it to the loss,
  // as Megatron's aux-loss scaler does; ignored when aux_loss_coeff == 0).
  Tensor backward(const Context& ctx, const Tensor& dy, const Saved& saved, double d_aux = 1.0);

  // Aux-loss-free balancing (docs/mhc_moe.md, "MoE"), after the optimizer step:
  // bias_i += rate * sign(mean(counts) - counts_i) (sign(0) = 0), rounded once to the bias dtype.
  // counts [E], all-reduced over the global batch by the caller. Over-loaded experts go down,
  // under-loaded ones up.
  // Module: the experts' weights too (the grouped GEMMs, the routed kernel and the per-expert
  // Linears all round them to bf16 under a bf16 expert GEMM).
  void keep_gemm_weights_in_bf16() override;
  void update_bias(const Tensor& counts, double rate);

  const MoeConfig& config() const { return cfg_; }
  const std::string& path() const { return path_; }
  const GemmPrecision& expert_precision() const { return gate_up_w_.precision(); }
  MoeRouterGate& router() { return gate_; }
  Param& correction_bias() { return gate_.correction_bias(); }
  Param& experts_gate_up() { return *gate_up_; }
  Param& experts_down() { return *down_; }
  DenseMlp* shared_experts() { return shared_.get(); }

 private:
  void check_input(const Tensor& x) const;  // x [T, D] f64/f32/bf16 on the CPU
  DType compute_dtype(DType x_dt) const;
  // The router (logits, route, topk_idx; the router Linear's Saved when ctx.training) and the
  // routed experts (eo; per-expert Saved when ctx.training), into s.
  void run_router(const Context& ctx, const Tensor& xc, const Tensor& replay, Saved& s) const;
  // The routed experts held here over rows xc [R, D], whose assignment a = r K + k goes to local
  // expert idx[a] (s.eo [R K, D]; the per-expert or grouped Saved when ctx.training).
  void run_experts(const Context& ctx, const Tensor& xc, const std::vector<int64_t>& idx, int64_t K,
                   Saved& s) const;
  // Expert parallel: the assignments of s.topk_idx dispatched to their experts' ranks, run there,
  // and their outputs brought back into s.eo.
  void run_experts_ep(const Context& ctx, const Tensor& xc, dist::Comm& ep, Saved& s) const;
  // d(eo) [N, D] of the assignments run_experts ran -> d(their rows) [N, D]; weight gradients +=.
  Tensor backward_experts(const Context& ctx, const Tensor& deo, const Saved& R) const;
  // The routed experts as two grouped GEMMs (ops::gemm_grouped, one call each for all experts)
  // around one SwiGLU over every routed row: on CUDA, for a bf16 expert GEMM with f32
  // activations or a native one whose weights have the activations' dtype. The same numerics as
  // the per-expert Linear path (bf16 operands, FP32 accumulation), another summation order.
  bool use_grouped(const Tensor& xc) const;
  // ops::moe_routed_experts instead of the grouped GEMMs (see forward).
  bool use_routed(const Context& ctx, const Tensor& xc) const;
  void run_experts_grouped(const Tensor& xc, const std::vector<int64_t>& idx, int64_t K, Saved& s,
                           bool keep) const;
  // d(eo) [T * K, D] -> d(routed rows of x) [T * K, D]; the experts' weight gradients +=.
  Tensor backward_experts_grouped(const Tensor& deo, const Saved& s) const;
  // Point the workers at expert e (and its gradient slices); e < 0 releases them.
  void alias_workers(int64_t e, bool with_grads) const;

  MoeConfig cfg_;
  std::string path_;
  MoeRouterGate gate_;
  std::unique_ptr<DenseMlp> shared_;
  Param* gate_up_ = nullptr;  // experts.gate_up_proj
  Param* down_ = nullptr;     // experts.down_proj
  // Per-expert GEMM workers (not children: their weight / grad alias the fused parameters' slice
  // of the expert being run, set before every use).
  mutable Linear gate_up_w_, down_w_;
};

}  // namespace hlm
