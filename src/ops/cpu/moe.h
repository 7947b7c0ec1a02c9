// The CPU reference of the MoE ops (ops/moe.h). The front door (ops/moe.cpp) checks the arguments
// (index tensors are handed over as their checked values) and allocates the outputs in the
// computation dtype (f64 for f64 inputs, else f32). Parameter gradients accumulate (+=).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/moe.h"

namespace hlm::ops::cpu {

// replay: the [T, K] replay indices, or nullptr (select). Fills r's three allocated tensors.
void moe_router_forward(const Tensor& logits, const Tensor& bias, const MoeRouterConfig& cfg,
                        const std::vector<int64_t>* replay, MoeRouterResult& r);
// dlogits [T, E] from the selected experts idx [T, K] and dweight [T, K].
void moe_router_backward(const Tensor& logits, const std::vector<int64_t>& idx,
                         const MoeRouterConfig& cfg, const Tensor& dweight, Tensor& dlogits);
// load [E] i64: the count of each expert in idx.
void moe_expert_load(const std::vector<int64_t>& idx, Tensor& load);
void moe_bias_update(Tensor& bias, const Tensor& load, double rate);
// Returns the loss; with dlogits (allocated [T, E]) also writes dloss * its gradient.
double moe_seq_aux_loss(const Tensor& logits, const std::vector<int64_t>& idx, int64_t K,
                        const std::vector<int64_t>& cu, double coeff, double dloss, Tensor* dlogits,
                        const MoeAuxWhole* whole = nullptr);
void swiglu_clamped_forward(const Tensor& gu, double limit, Tensor& h);
void swiglu_clamped_backward(const Tensor& gu, const Tensor& dh, double limit, Tensor& dgu);
// out [T, D] from eo [T, K, D], w [T, K] (undefined: plain sum), shared [T, D] (or undefined).
void moe_combine(const Tensor& eo, const Tensor& w, const Tensor& shared, Tensor& out);
// r.dw [T, K] and r.deo [T, K, D] written.
void moe_combine_backward(const Tensor& dout, const Tensor& eo, const Tensor& w,
                          MoeCombineGrads& r);
// out [T, D]; saved: what the backward needs (its tensors made here).
void moe_experts_forward(const Tensor& x, const MoeWeights& w, const std::vector<int64_t>& idx,
                         int64_t K, const Tensor& topk_weight, double swiglu_limit, Tensor& out,
                         MoeSaved& saved);
// r.dx, r.dtopk_weight written; g accumulated.
void moe_experts_backward(const MoeSaved& s, const MoeWeights& w, const Tensor& dout,
                          MoeWeightGrads& g, MoeGrads& r);
// eo [T K, D] written (x's dtype); idx checked.
void moe_routed_experts(const Tensor& x, const Tensor& gate_up, const Tensor& down,
                        const std::vector<int64_t>& idx, double swiglu_limit, bool round_bf16,
                        Tensor& eo);

}  // namespace hlm::ops::cpu
