// The CPU reference of the DSA indexer KL loss and its attention target (ops/dsa_indexer_loss.h).
// The front door (ops/dsa_indexer_loss.cpp) checks the arguments, builds the pattern of the
// target's layout (ops/dsa_common.h) and allocates the outputs; tensors are contiguous, f32 or
// f64, one dtype.
#pragma once

#include "core/tensor.h"
#include "ops/dsa_common.h"
#include "ops/dsa_indexer_loss.h"

namespace hlm::ops::cpu {

// out [T, p.W]: p* at the pattern's entries, 0 elsewhere.
void attention_target(const Tensor& q, const Tensor& kv, const dsa_detail::Pattern& p, double scale,
                      Tensor& out);
// Fills r.loss, r.rows and r.d_scores [T, W] (allocated). Throws hlm::Error when the target has
// mass where a score is -inf (found while it walks the rows).
void indexer_kl_loss(const Tensor& scores, const Tensor& target, double coeff,
                     KlReduction reduction, IndexerKl& r);

}  // namespace hlm::ops::cpu
