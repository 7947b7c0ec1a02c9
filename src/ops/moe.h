// The sigmoid-routed MoE of DeepSeek-V3 / GLM-5.3-Flash (docs/mhc_moe.md, "MoE"), CPU.
//
// Router ("noaux_tc"), per token, from the router logits l [E] (= x W_router^T, computed in FP32
// by the caller):
//   s      = sigmoid(l)
//   s_sel  = s + bias                  (e_score_correction_bias: selection only, no gradient)
//   groups (n_group > 1): view s_sel as [n_group, E / n_group]; group score = sum of its top-2
//          entries; keep the topk_group best groups, the others are excluded
//   idx    = top_k of s_sel over the kept experts; ties go to the lower index (groups likewise);
//            idx is ordered by descending s_sel (then ascending index)
//   w      = s[idx] (UNBIASED); norm_topk_prob: w = w / (sum w + 1e-20); w *= routed_scaling_factor
// Routing replay (R3): given replay indices, idx = replay (no selection); w is computed the same
// way from the scores, so the router still gets its gradient.
//
// Experts (SwiGLU with the GLM clamp, swiglu_limit > 0):
//   g = min(gate, limit), u = clamp(up, -limit, limit), h = silu(g) * u, out = W_down h
// gate_up [E, 2I, D] (rows 0..I-1 gate, I..2I-1 up; HF layout), down [E, D, I]. The shared expert
// is one such FFN ([2I_s, D], [D, I_s]), always on, ungated.
//   moe out_t = sum_{k = 0..K-1} w_{t,k} Expert_{idx_{t,k}}(x_t) + Shared(x_t)
// summed in that fixed order (k ascending, then the shared expert): deterministic, no atomics.
//
// Precision: computed in FP64 when the main input is f64, else FP32. Activation gradients are
// returned (=); parameter gradients accumulate (+=) into the caller's tensors (f32/f64).
//
// CUDA (ops/cuda/moe.cu, moe_experts.cu; docs/mhc_moe.md, "MoE on CUDA"): every op runs on CUDA
// tensors (all of an op's tensors on one device; any strides, made contiguous by the front door),
// with the CPU's dtypes and these additions, computed in FP32:
//   router, load, bias update, aux loss: as the CPU (the router is FP32 by design); the bias
//     update's load may live on the CPU or on the bias's device (i64 / i32 / f32 / f64 / bf16).
//   swiglu_clamped_*: gu / dh / outputs also bf16 (one dtype; dh is read in gu's dtype).
//   moe_combine*: eo / shared / dout / out / deo also bf16, w then bf16 or f32 (dw in w's dtype).
//   moe_experts_*: x, topk_weight, dout and the weights also bf16 (read into FP32; weights not in
//     the computation dtype are converted once per call); outputs and saved tensors in the
//     computation dtype; accumulators f32 / f64.
// The CUDA router picks the same experts as the CPU for the same scores (same order, same tie
// rule); every CUDA result is bit-identical run to run (no atomics).
#pragma once

#include <cstdint>

#include "core/seq_layout.h"
#include "core/tensor.h"

namespace hlm::ops {

// ---- router
// --------------------------------------------------------------------------------------
struct MoeRouterConfig {
  int64_t n_experts = 288;
  int64_t top_k = 8;
  int64_t n_group = 1;     // must divide n_experts; groups of >= 2 experts when n_group > 1
  int64_t topk_group = 1;  // 1 <= topk_group <= n_group; top_k <= topk_group * E / n_group
  bool norm_topk_prob = true;
  double routed_scaling_factor = 2.5;
  double norm_eps = 1e-20;  // in w / (sum w + norm_eps)
};

struct MoeRouterResult {
  Tensor scores;       // [T, E] sigmoid(logits), computation dtype
  Tensor topk_idx;     // [T, K] i64
  Tensor topk_weight;  // [T, K] computation dtype
};

// logits [T, E] f32/f64; bias [E] (undefined = 0); replay_idx [T, K] i64/i32 (undefined = select).
// Replay indices must be in [0, E) and distinct per token.
MoeRouterResult moe_router_forward(const Tensor& logits, const Tensor& bias,
                                   const MoeRouterConfig& cfg, const Tensor& replay_idx = {});
// dlogits [T, E] from d topk_weight [T, K] (non-selected experts get 0).
Tensor moe_router_backward(const Tensor& logits, const MoeRouterResult& r,
                           const MoeRouterConfig& cfg, const Tensor& dweight);

// Tokens routed to each expert: counts [E] (i64) from topk_idx [T, K].
Tensor moe_expert_load(const Tensor& topk_idx, int64_t n_experts);
// Aux-loss-free bias update (after the optimizer step), in place on bias [E] (f32/f64):
//   b_i += rate * sign(mean(load) - load_i)        (sign(0) = 0)
// `load` [E] holds the (globally all-reduced) token counts, any numeric dtype.
void moe_bias_update(Tensor& bias, const Tensor& load, double rate);

// Sequence-wise aux loss (DeepSeek-V3), averaged over the non-empty sequences of seqs:
//   per sequence of T_s tokens: f_i = E / (K T_s) * #{t : i in idx_t}, P_i = (1/T_s) sum_t
//   s'_{i,t}, s'_{i,t} = s_{i,t} / sum_j s_{j,t} (ALL experts), L_s = coeff * sum_i f_i P_i.
// f is a count (no gradient); the gradient flows to the logits through P.
// Under context parallelism a sequence of seqs may be a piece of a longer one (the rest on other
// ranks). `whole` then gives, for each sequence q of seqs, the whole sequence's length and its
// expert counts, which replace the piece's own in T_s and f_i; P_i sums the piece's tokens over
// the whole T_s. The result is the piece's share: the pieces' shares of a sequence sum to its
// L_s, and each token's gradient is the whole sequence's. (The mean is still over seqs' own
// non-empty sequences: the caller rescales.)
struct MoeAuxWhole {
  std::vector<int64_t> lengths;  // [N]: the whole sequence's tokens (>= the piece's)
  std::vector<int64_t> counts;   // [N E]: its tokens routed to each expert
};
double moe_seq_aux_loss(const Tensor& logits, const Tensor& topk_idx, const SeqLayout& seqs,
                        double coeff, const MoeAuxWhole* whole = nullptr);
// dlogits [T, E] of dloss * loss.
Tensor moe_seq_aux_loss_backward(const Tensor& logits, const Tensor& topk_idx,
                                 const SeqLayout& seqs, double coeff, double dloss = 1.0,
                                 const MoeAuxWhole* whole = nullptr);

// ---- clamped SwiGLU ---------------------------------------------------------------------------
// gu [..., 2I] (gate | up) -> h [..., I]; limit <= 0 or infinite: no clamp (DeepSeek-V3).
Tensor swiglu_clamped_forward(const Tensor& gu, double limit);
// The same h written in out_dtype: gu's dtype, or bf16 for an f32 gu (h computed in FP32, then
// rounded once: the operand a bf16 GEMM would round it to).
Tensor swiglu_clamped_forward(const Tensor& gu, double limit, DType out_dtype);
// d gu [..., 2I] from dh [..., I]. The clamp passes the gradient where the input lies inside the
// closed interval (gate <= limit; -limit <= up <= limit), zero outside.
Tensor swiglu_clamped_backward(const Tensor& gu, const Tensor& dh, double limit);

// ---- combine ------------------------------------------------------------------------------------
// Each token's K routed-expert outputs summed in a fixed order (k ascending, then the shared one):
//   out[t] = sum_{k = 0..K-1} w[t, k] eo[t, k]  (+ shared[t])
// eo [T, K, D] f32 / f64; w [T, K] of eo's dtype, or undefined for the plain sum (no
// multiplication); shared [T, D] of eo's dtype or undefined. Computed in eo's dtype.
Tensor moe_combine(const Tensor& eo, const Tensor& w, const Tensor& shared = {});
struct MoeCombineGrads {
  Tensor dw;   // [T, K]: <dout_t, eo[t, k]>, channels ascending
  Tensor deo;  // [T, K, D]: w[t, k] dout_t
};
// dout [T, D], eo [T, K, D], w [T, K]: one dtype (f32 / f64).
MoeCombineGrads moe_combine_backward(const Tensor& dout, const Tensor& eo, const Tensor& w);

// ---- experts ------------------------------------------------------------------------------------
struct MoeWeights {
  Tensor gate_up;         // [E, 2I, D]
  Tensor down;            // [E, D, I]
  Tensor shared_gate_up;  // [2I_s, D] (undefined: no shared expert)
  Tensor shared_down;     // [D, I_s]
};
struct MoeWeightGrads {  // accumulators (+=) of MoeWeights' shapes; shared ones only if used
  Tensor dgate_up, ddown, dshared_gate_up, dshared_down;
};

struct MoeSaved {
  Tensor x;            // [T, D]
  Tensor topk_idx;     // [T, K] i64
  Tensor topk_weight;  // [T, K]
  Tensor gu;           // [T, K, 2I] expert pre-activations
  Tensor h;            // [T, K, I]
  Tensor eo;           // [T, K, D] each routed expert's output (unweighted)
  Tensor sgu, sh;      // shared expert [T, 2I_s], [T, I_s]
  double limit = 10.0;
};

// out [T, D] = sum_k w_k Expert_{idx_k}(x) + Shared(x). x [T, D]; topk_idx [T, K] i64/i32 in
// [0, E); topk_weight [T, K].
Tensor moe_experts_forward(const Tensor& x, const MoeWeights& w, const Tensor& topk_idx,
                           const Tensor& topk_weight, double swiglu_limit, MoeSaved& saved);
struct MoeGrads {
  Tensor dx;            // [T, D]
  Tensor dtopk_weight;  // [T, K]: <dout_t, Expert_{idx_k}(x_t)>
};
MoeGrads moe_experts_backward(const MoeSaved& s, const MoeWeights& w, const Tensor& dout,
                              MoeWeightGrads& g);

// ---- routed experts with no host wait (inference)
// ------------------------------------------------ eo [T K, D]: row a = t K + k is
// Expert_{topk_idx[t, k]}(x_t), unweighted (what moe_combine takes), computed without the host
// reading the selection: on CUDA the assignments are sorted by expert on the device and each
// expert's rows go through one weight-streaming kernel, so a decode step does not wait for the
// device here (the grouped GEMM path sizes its groups on the host).
//   gu = r(x_t) r(W_gu[e])^T,  h = swiglu_clamped(gu),  eo = r(h) r(W_dn[e])^T
// round_bf16: r rounds to bf16 (x f32; weights f32 or bf16), FP32 accumulation: the operands of a
// bf16 GEMM. Else r is the identity, x and the weights of one dtype (f32 or f64), accumulated in
// it. gu, h and eo are in x's dtype.
// Each output element is one sum over its input channels in a fixed order that no other row
// changes (32 strided partial sums, k = j (mod 32) in increasing k, then a butterfly over the 32:
// the order of a warp's sum, which the CPU follows: the two sums agree bit for bit, and the
// outputs wherever the SwiGLU's exponentials do, as every one did on the emulation): a token's
// result does not depend on the batch it is in.
// topk_idx [T, K] i64 / i32. On the CPU its values are checked; on CUDA they are not read (that
// would wait): a row whose index is outside [0, E) is left NaN.
Tensor moe_routed_experts(const Tensor& x, const Tensor& gate_up, const Tensor& down,
                          const Tensor& topk_idx, double swiglu_limit, bool round_bf16);

}  // namespace hlm::ops
