// The CPU reference of the DSA indexer ops (ops/dsa_indexer.h). The front door
// (ops/dsa_indexer.cpp) checks the arguments, builds the pattern of the score layout
// (ops/dsa_common.h), resolves the scale and allocates the outputs; tensors are contiguous, f32 or
// f64, one dtype. `op` names the op in the one error raised here: a non-finite q or k under the
// fp8 emulation (found while quantising).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/dsa_common.h"
#include "ops/dsa_indexer.h"

namespace hlm::ops::cpu {

// Quantise-dequantise each 128-channel block of every row of x (IndexerScoreOptions::fp8): the
// values the FP8 scoring computes with, in x's dtype. A non-finite entry throws, naming op and
// what.
Tensor indexer_fp8_emulate(const Tensor& x, const IndexerScoreOptions& opt, const char* op,
                           const char* what);
// scores [T, p.W]: the pattern's entries, -inf elsewhere.
void indexer_scores(const Tensor& q, const Tensor& k, const Tensor& w, const dsa_detail::Pattern& p,
                    const IndexerScoreOptions& opt, double scale, Tensor& scores, const char* op);
// g.dq, g.dk, g.dw written.
void indexer_scores_backward(const Tensor& q, const Tensor& k, const Tensor& w,
                             const dsa_detail::Pattern& p, const IndexerScoreOptions& opt,
                             double scale, const Tensor& d_scores, IndexerScoreGrads& g,
                             const char* op);
// out i32 [w.T, k] for the window's queries (ops/dsa_common.h).
void topk_select(const Tensor& scores, const dsa_detail::QueryWindow& w, int64_t k, int64_t pool,
                 Tensor& out);

}  // namespace hlm::ops::cpu
