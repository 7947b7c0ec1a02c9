// The CPU references of the KDA core op (ops/kda.h): the FP64 step recurrence (kda_recurrent.cpp)
// and the chunked WY form (kda_chunk.cpp), with the fused pre-processing they share
// (kda_common.cpp). Arguments are checked by the front door (ops/kda.cpp, kda_check and
// kda_check_grads); the outputs are allocated by it, in the computation dtype (f64 for the
// recurrence; for the chunked form f64 for f64 inputs, else f32), and written here.
#pragma once

#include "core/tensor.h"
#include "ops/kda.h"

namespace hlm::ops::cpu {

// o [T, HV, V], final_state [N, HV, K, V].
void kda_recurrent_forward(const KdaArgs& a, const KdaDims& d, Tensor& o, Tensor& final_state);
void kda_chunk_forward(const KdaArgs& a, const KdaDims& d, Tensor& o, Tensor& final_state);
// Every tensor of g written: dq, dk, dv, dg, dbeta, dinitial_state, and dA_log / ddt_bias when
// defined (the fused gate with A_log / dt_bias given).
void kda_recurrent_backward(const KdaArgs& a, const KdaDims& d, const Tensor& d_o,
                            const Tensor& d_final_state, KdaGrads& g);
void kda_chunk_backward(const KdaArgs& a, const KdaDims& d, const Tensor& d_o,
                        const Tensor& d_final_state, KdaGrads& g);

// Shared by the two references (kda_common.cpp).
namespace kda_detail {
// The inputs after the fused pre-processing, contiguous, in the computation dtype.
struct Prepared {
  Tensor q, k;            // [T, H, K] normalised when use_qk_l2norm (q not yet scaled)
  Tensor q_rstd, k_rstd;  // [T, H] (use_qk_l2norm only)
  Tensor g;               // [T, HV, K] log decay
  Tensor beta;            // [T, HV] in (0, 1)
  Tensor h0;              // [N, HV, K, V]
};
Prepared prepare(const KdaArgs& a, const KdaDims& d, DType dt);
// In place: grads w.r.t. the prepared q, k, g, beta -> grads w.r.t. the arguments as passed (the
// fused gate's dz, dA_log, d dt_bias written into g.dg, g.dA_log, g.ddt_bias).
void finish_grads(const KdaArgs& a, const KdaDims& d, const Prepared& p, KdaGrads& g);
}  // namespace kda_detail

}  // namespace hlm::ops::cpu
