// The CUDA side of the DSA lightning-indexer scoring (ops/dsa_indexer.h): host interface of
// dsa_indexer.cu, includable from C++. The front door (ops/dsa_indexer.cpp) checks the arguments,
// resolves the scale and allocates the outputs. Tensors are contiguous CUDA tensors: q, k, w (and
// the gradients dq, dk, dw) in one dtype, f32, f64 or bf16; scores and d_scores in the
// computation dtype (f32 for bf16). Kernels run on the default stream.
//
// The dense ("causal") layout needs no pattern: its kernels derive every query's visible keys
// from the per-token geometry (ops/cuda/dsa_common.cuh), so nothing of size T x W is built on the
// host. The explicit-rows layout takes the pattern the front door built on the device from the rows
// (device_rows_pattern, which also validates them).
// `op` names the op in the one error raised here: a non-finite q or k under the FP8 emulation
// (found on the device, reported after the scoring kernels have been queued).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/cuda/dsa_common.cuh"
#include "ops/dsa_indexer.h"

namespace hlm::ops::cuda {

// scores [T, W] (W = scores.size(1) >= the most keys of a document); cu: checked cu_seqlens.
void indexer_scores_dense(const Tensor& q, const Tensor& k, const Tensor& w,
                          const dsa_detail::QueryWindow& win, const IndexerScoreOptions& opt,
                          double scale, Tensor& scores, const char* op);
// scores [T, p.W] at the pattern's entries, -inf elsewhere.
void indexer_scores_rows(const Tensor& q, const Tensor& k, const Tensor& w, const DsaPatternDev& p,
                         const IndexerScoreOptions& opt, double scale, Tensor& scores,
                         const char* op);
// The dequantised FP8 values of every row of x (ops::indexer_fp8_emulate), computation dtype. A
// non-finite entry throws, or with nonfinite sets nonfinite[0] to 1 (nothing read back).
Tensor indexer_fp8_emulate(const Tensor& x, const IndexerScoreOptions& opt, const char* op,
                           const char* what, Tensor* nonfinite);
// g.dq, g.dk, g.dw written; d_scores [T, W] in the dense layout.
void indexer_scores_dense_backward(const Tensor& q, const Tensor& k, const Tensor& w,
                                   const dsa_detail::QueryWindow& win,
                                   const IndexerScoreOptions& opt, double scale,
                                   const Tensor& d_scores, IndexerScoreGrads& g, const char* op);
// g.dq, g.dk, g.dw written; d_scores [T, p.W] in the explicit-rows layout.
void indexer_scores_rows_backward(const Tensor& q, const Tensor& k, const Tensor& w,
                                  const DsaPatternDev& p, const IndexerScoreOptions& opt,
                                  double scale, const Tensor& d_scores, IndexerScoreGrads& g,
                                  const char* op);

}  // namespace hlm::ops::cuda
