// DSA indexer KL loss (docs/dsa.md, "Indexer KL loss"; the pool level, our own design: "Pool-level
// KL for KPool: our design"): the CPU reference and the CUDA kernels (ops/cuda/dsa_attention.cu
// for the targets, ops/cuda/dsa_select.cu for the loss).
//
// Target (detached; computed from the main attention's q and latent kv, absorbed form):
//   p[t,s,h] = softmax_s(scale * q[t,h] . kv[s])  over the row's set
//   p*[t,s]  = sum_h p[t,s,h] / sum_{s'} sum_h p[t,s',h]
// Indexer distribution: pi[t,s] = softmax_s I(t,s) over the same set.
// Loss:  L = coeff * reduce_t sum_s p* (log(p* + 1e-10) - log(pi + 1e-10))
//   reduce = mean over the rows that have at least one entry (Megatron's mean over b, t), or sum
//   (per-token-loss mode).
// d_scores is the exact gradient of that L, eps included:
//   dI_s = g * (pi_s * sum_s' p*_s' pi_s' / (pi_s' + eps) - p*_s pi_s / (pi_s + eps)),
// g = coeff / rows (mean) or coeff (sum); with eps -> 0 this is Megatron's g * (pi - p*). Feed it
// to indexer_scores[_at]_backward (dsa_indexer.h), then for KPool to kpool_compress_backward.
//
// Sets: dense warm-up uses the dense causal layout ([T, W], column j = document token j, W = 0
// picks the longest document), the sparse stage the explicit layout of a selection [T, W]
// (global token indices, -1 empty). The KL op itself sees only [T, W] tensors: an entry belongs to
// the row's set iff its score is not -inf (the scoring ops write -inf exactly outside the set);
// the target must be 0 there. Computed in the input dtype (f32: f32 softmax); the row losses are
// summed in f64 in row order (deterministic).
#pragma once

#include <optional>

#include "core/seq_layout.h"
#include "core/tensor.h"

namespace hlm::ops {

constexpr double kIndexerKlEps = 1e-10;

// q [T, H, D_qk], kv [T, D_qk] (one dtype: f32 or f64; on CUDA also bf16, contiguous) -> p* [T, W]
// in the computation dtype (f32 for bf16) in the dense causal layout (0 outside the causal set).
// q0: a query window (context parallelism): q holds the queries of global tokens
// [q0, q0 + T) of seqs, kv all its tokens; likewise for attention_target_at.
Tensor attention_target(const Tensor& q, const Tensor& kv, const SeqLayout& seqs, double scale,
                        int64_t W = 0, std::optional<int64_t> q0 = {});
// p* over explicit selections: indices [T, W] (global tokens, -1 empty) -> [T, W] (0 at -1).
// lse (optional): [T, H] in the computation dtype, the log-sum-exp of each query and head over the
// same set, as sparse_attention returns it for the same q, kv, indices and scale. CUDA then skips
// its own pass over the keys for it (half the work); the CPU computes it either way (the two agree
// to rounding).
Tensor attention_target_at(const Tensor& q, const Tensor& kv, const SeqLayout& seqs,
                           const Tensor& indices, double scale, const Tensor& lse = {},
                           std::optional<int64_t> q0 = {});

enum class KlReduction { mean, sum };

struct IndexerKl {
  double loss = 0;
  Tensor d_scores;   // [T, W], dtype of scores; 0 outside the set
  int64_t rows = 0;  // rows with at least one entry
};
// scores [T, W] (indexer_scores[_at] or pooled), target [T, W] (same dtype).
IndexerKl indexer_kl_loss(const Tensor& scores, const Tensor& target, double coeff = 1.0,
                          KlReduction reduction = KlReduction::mean);

}  // namespace hlm::ops
