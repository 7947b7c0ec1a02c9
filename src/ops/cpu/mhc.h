// The CPU reference of mHC (ops/mhc.h). The front door (ops/mhc.cpp) checks the arguments and
// allocates the outputs: in the computation dtype (f64 for f64 x, else f32), except u, X', the
// expanded and the contracted streams, which are in the dtype of their input. Inputs of any
// floating dtype and any strides are read in the computation dtype here. Parameter gradients
// accumulate (+=).
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "ops/mhc.h"

namespace hlm::ops::cpu {

void mhc_mappings_forward(const Tensor& x, const MhcParams& p, const MhcConfig& c, MhcMappings& m);
// dpre / dpost / dcomb may be undefined (zero). dx written, g accumulated.
void mhc_mappings_backward(const Tensor& x, const MhcParams& p, const MhcConfig& c,
                           const MhcMappings& m, const Tensor& dpre, const Tensor& dpost,
                           const Tensor& dcomb, MhcParamGrads& g, Tensor& dx);
void mhc_inv_rms(const Tensor& x, double eps, Tensor& inv_rms);
void mhc_inv_rms_backward(const Tensor& x, const Tensor& inv_rms, const Tensor& d_inv_rms,
                          Tensor& dx);
void mhc_sinkhorn(const Tensor& logits, double hc_eps, int64_t iters, Tensor& comb);
void mhc_sinkhorn_backward(const Tensor& logits, const Tensor& dcomb, double hc_eps, int64_t iters,
                           Tensor& dlogits);
void mhc_collapse(const Tensor& x, const Tensor& pre, Tensor& u);
void mhc_collapse_backward(const Tensor& x, const Tensor& pre, const Tensor& du,
                           MhcCollapseGrads& r);
void mhc_write_back(const Tensor& x, const Tensor& y, const Tensor& post, const Tensor& comb,
                    Tensor& out);
void mhc_write_back_backward(const Tensor& x, const Tensor& y, const Tensor& post,
                             const Tensor& comb, const Tensor& dx_out, MhcWriteBackGrads& r);
// out [T, n, D]: n copies of e [T, D].
void mhc_expand(const Tensor& e, Tensor& out);
// out [T, D] = (sum_j x_j) * (1 / divisor), in the computation dtype.
void mhc_stream_sum(const Tensor& x, int64_t divisor, Tensor& out);
// dx [T, n, D]: n copies of dh / n.
void mhc_mean_contract_backward(const Tensor& dh, Tensor& dx);
// dy [T, D] = sum_i post_i dX'_i (the order of mhc_write_back_backward's dy).
void mhc_post_sum(const Tensor& post, const Tensor& dx_out, Tensor& dy);
// dx = (dx + b) + c per element (one dtype, contiguous).
void mhc_add3_(Tensor& dx, const Tensor& b, const Tensor& c);

}  // namespace hlm::ops::cpu
