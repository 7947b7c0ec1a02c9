// The CUDA side of mHC (ops/mhc.h): host interface of ops/cuda/mhc.cu, includable from C++, with
// the signatures of the CPU reference (ops/cpu/mhc.h) so the front door (ops/mhc.cpp) switches with
// HLM_DISPATCH. The front door checks the arguments (every tensor f32, f64 or bf16 on CUDA; n <= 8
// streams; accumulators contiguous) and allocates the outputs, contiguous, in the dtypes the CPU
// reference writes: the computation dtype (f64 for f64 x, else f32), except u, X', the expanded and
// the contracted streams, which take the dtype of their input. Inputs may have any strides (they
// are made contiguous first) and, independently of each other, any of the three dtypes; each is
// read into the computation dtype. Parameter gradients accumulate (+=). Default stream.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "ops/mhc.h"

namespace hlm::ops::cuda {

// The most streams the CUDA kernels take (per-thread n x n matrices live in registers).
constexpr int64_t kMhcMaxStreams = 8;

void mhc_mappings_forward(const Tensor& x, const MhcParams& p, const MhcConfig& c, MhcMappings& m);
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
void mhc_collapse_norm(const Tensor& x, const MhcParams& p, const MhcConfig& c,
                       const Tensor& norm_w, double norm_eps, MhcCollapseNormed& r);
void mhc_collapse_backward(const Tensor& x, const Tensor& pre, const Tensor& du,
                           MhcCollapseGrads& r);
void mhc_write_back(const Tensor& x, const Tensor& y, const Tensor& post, const Tensor& comb,
                    Tensor& out);
void mhc_write_back_backward(const Tensor& x, const Tensor& y, const Tensor& post,
                             const Tensor& comb, const Tensor& dx_out, MhcWriteBackGrads& r);
void mhc_expand(const Tensor& e, Tensor& out);
void mhc_stream_sum(const Tensor& x, int64_t divisor, Tensor& out);
void mhc_mean_contract_backward(const Tensor& dh, Tensor& dx);
void mhc_post_sum(const Tensor& post, const Tensor& dx_out, Tensor& dy);
void mhc_add3_(Tensor& dx, const Tensor& b, const Tensor& c);

}  // namespace hlm::ops::cuda
