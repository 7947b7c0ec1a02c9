// The CUDA side of the MoE ops (ops/moe.h): host interface of moe.cu (router, load balancing,
// aux loss, clamped SwiGLU, combine) and moe_experts.cu (the token permutation by expert and the
// experts' grouped GEMMs), includable from C++. The front door (ops/moe.cpp) checks the
// arguments, makes the tensors contiguous and allocates the outputs; every tensor here is a
// contiguous CUDA tensor. Index tensors (topk_idx, replay) are i64 or i32 and already checked to
// lie in [0, E). Default stream.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/moe.h"

namespace hlm::ops::cuda {

// ---- router and load balancing (moe.cu) ---------------------------------------------------------
// logits [T, E] f32 / f64 (the computation dtype); bias [E] of the logits' dtype or undefined;
// replay [T, K] or undefined (select). Fills r's three allocated tensors.
void moe_router_forward(const Tensor& logits, const Tensor& bias, const MoeRouterConfig& cfg,
                        const Tensor& replay, MoeRouterResult& r);
// dlogits [T, E] from idx [T, K] and dweight [T, K] of the logits' dtype.
void moe_router_backward(const Tensor& logits, const Tensor& idx, const MoeRouterConfig& cfg,
                         const Tensor& dweight, Tensor& dlogits);
// load [E] i64: the count of each expert in idx [T, K].
void moe_expert_load(const Tensor& idx, Tensor& load);
// bias [E] f32 / f64 in place; load [E] i64 / i32 / f32 / f64 on the device.
void moe_bias_update(Tensor& bias, const Tensor& load, double rate);
// logits [T, E] f32 / f64; idx [T, K]; cu the checked host offsets of the sequences. Returns the
// loss; with dlogits (allocated [T, E], logits' dtype) also writes dloss * its gradient.
// whole: ops::moe_seq_aux_loss's (or nullptr).
double moe_seq_aux_loss(const Tensor& logits, const Tensor& idx, const std::vector<int64_t>& cu,
                        double coeff, double dloss, Tensor* dlogits,
                        const MoeAuxWhole* whole = nullptr);

// ---- clamped SwiGLU and combine (moe.cu) --------------------------------------------------------
// gu [..., 2I], h [..., I], dh, dgu: one dtype, f32 / f64 / bf16 (computed in f32, f64 for f64).
void swiglu_clamped_forward(const Tensor& gu, double limit, Tensor& h);
void swiglu_clamped_backward(const Tensor& gu, const Tensor& dh, double limit, Tensor& dgu);
// eo [T, K, D] and shared / out [T, D] of one dtype (f32 / f64 / bf16); w [T, K] of eo's dtype
// (or f32 when eo is bf16) or undefined (plain sum); shared may be undefined.
void moe_combine(const Tensor& eo, const Tensor& w, const Tensor& shared, Tensor& out);
// dout [T, D] and r.deo [T, K, D] of eo's dtype; w and r.dw [T, K] of w's dtype.
void moe_combine_backward(const Tensor& dout, const Tensor& eo, const Tensor& w,
                          MoeCombineGrads& r);
// The combine over rows gathered through a map (the experts' permuted outputs):
//   out[t] = sum_{k < K} (w[t, k]) src[map[t K + k]] (+ shared[t]),
// src [N, D], map [T K] i64 (undefined: map[a] = a), w [T, K] or undefined, shared [T, D] or
// undefined, out [T, D]; src, w, shared and out of one dtype (f32 / f64).
void moe_combine_rows(const Tensor& src, const Tensor& map, int64_t K, const Tensor& w,
                      const Tensor& shared, Tensor& out);

// ---- experts (moe_experts.cu) -------------------------------------------------------------------
// x [T, D] f32 / f64 / bf16, computed in compute_dtype(x); weights f32 / f64 / bf16 (read in
// the computation dtype, converted once per call when they differ); topk_idx [T, K] on the
// device with idx_host its values; topk_weight [T, K] (any floating dtype); out [T, D] in the
// computation dtype. saved: what the backward needs (its tensors made here, on the device).
void moe_experts_forward(const Tensor& x, const MoeWeights& w, const Tensor& topk_idx,
                         const std::vector<int64_t>& idx_host, const Tensor& topk_weight,
                         double swiglu_limit, Tensor& out, MoeSaved& saved);
// idx_host: the values of s.topk_idx. r.dx, r.dtopk_weight written; g accumulated (+=).
void moe_experts_backward(const MoeSaved& s, const MoeWeights& w,
                          const std::vector<int64_t>& idx_host, const Tensor& dout,
                          MoeWeightGrads& g, MoeGrads& r);
// x [T, D] f32 / f64; weights f32 / f64 / bf16 as ops::moe_routed_experts allows; topk_idx
// [T, K] i64 / i32 (not checked); eo [T K, D] of x's dtype.
void moe_routed_experts(const Tensor& x, const Tensor& gate_up, const Tensor& down,
                        const Tensor& topk_idx, double swiglu_limit, bool round_bf16, Tensor& eo);

}  // namespace hlm::ops::cuda
