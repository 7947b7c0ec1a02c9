// KPool pooled-key indexer ops (docs/dsa.md, "KPool"): CPU reference and CUDA kernels.
//
// Pools: each document [cu[i], cu[i+1]) holds floor(L_i / P) complete pools of P consecutive
// tokens starting at the document start; the partial last pool is never compressed. Pools are
// numbered globally, document by document: doc i owns pool ids pool_offsets(cu, P)[i] .. [i+1]-1.
//
// Compression (4.2), per pool p of a document starting at s0, slot j = 0..P-1, channel c:
//   z[p,j,c] = gate[s0 + pP + j, c] + ape[j, c]
//   a[p,j,c] = softmax_j z[p,.,c]
//   K[p,c]   = sum_j a[p,j,c] * k[s0 + pP + j, c]
// computed in the input dtype (f32: f32 softmax and f32 accumulation, rounded once; f64: f64).
// Dtypes: on the CPU k, gate, ape (and d_pooled) are all f32 or all f64. On CUDA k, gate, d_pooled
// and the outputs pooled, dk, dgate are one dtype of f32, f64 or bf16 (contiguous); ape is a
// parameter, in k's dtype or f32 when k is bf16, and dape is in ape's dtype; arithmetic in f32
// (f64 for f64). dape sums the pools in fixed chunks of pool ids, then the chunks in order
// (ops/cuda/dsa_kpool.cu): deterministic, rounding-level different from the CPU's single pass.
// The bf16 rounding / Hadamard / FP8 steps of the serving path belong to the layer's precision
// policy, not to this op.
// Backward (4.5): dk[j,c] = a[j,c] dK[c];  dz[j,c] = a[j,c] (k[j,c] - K[c]) dK[c];  dgate = dz;
//   dape[j,c] = sum over all pools (in pool id order) of dz[p,j,c]. Tokens outside complete pools
//   get zero gradient. Gradients are written (=) into fresh tensors.
//
// Pooled scoring is indexer_scores(..., IndexerScoreOptions{.pool = P}) (dsa_indexer.h): pool p is
// a candidate of query t (document-relative position r) iff p < floor((r + 1) / P).
#pragma once

#include <optional>
#include <vector>

#include "core/seq_layout.h"
#include "core/tensor.h"

namespace hlm::ops {

// pool_offsets as an i64 tensor [N+1] (checks that seqs covers T).
Tensor kpool_pool_offsets(const SeqLayout& seqs, int64_t T, int64_t P);

// k [T, d], gate [T, d], ape [P, d] (dtypes above; P = ape.size(0) >= 1) -> pooled [NP, d].
Tensor kpool_compress(const Tensor& k, const Tensor& gate, const Tensor& ape,
                      const SeqLayout& seqs);

struct KPoolCompressGrads {
  Tensor dk;     // [T, d]
  Tensor dgate;  // [T, d]
  Tensor dape;   // [P, d]
};
KPoolCompressGrads kpool_compress_backward(const Tensor& k, const Tensor& gate, const Tensor& ape,
                                           const SeqLayout& seqs, const Tensor& d_pooled);

struct KPoolSelection {
  // i32 [T, K + P - 1] (always_select_tail) or [T, K]: global token indices. Columns [0, K) hold
  // the selected pools, pool ids ascending, each as its P tokens ascending; unused pool groups are
  // P x -1. Columns [K, K + P - 1) hold the tail: the query's incomplete trailing pool as raw
  // tokens doc_start + [floor((r + 1) / P) * P, r], ascending, then -1.
  Tensor indices;
  // i32 [T, K / P]: the selected global pool ids, ascending, -1 padded (group g of `indices`).
  Tensor pools;
};
// pool_scores [T, W] in the dense pool layout of indexer_scores(pool = P). Selects
// min(K / P, candidate pools) per query by (higher score, then lower pool id; NaN last).
// K % P != 0, P < 1 or K < 1 throw. With the tail, when the document prefix r + 1 <= K every causal
// token is selected (dense attention).
// q0: the rows [q0, q0 + T) of a query window (dsa_indexer.h).
KPoolSelection kpool_select(const Tensor& pool_scores, const SeqLayout& seqs, int64_t K, int64_t P,
                            bool always_select_tail = true, std::optional<int64_t> q0 = {});

// Pool-level indexer-loss targets (our own design, no public source trains KPool; docs/dsa.md,
// "Pool-level KL for KPool: our design"). Input: the token-level
// target p*(t, s) (head-summed, L1-normalised main attention, dsa_indexer_loss.h), computed over
// the set the main attention actually attends. Output: P*(t, p) = sum of p* over pool p's tokens,
// renormalised over the candidate pools of the row (the tail tokens are dropped); rows without any
// pool are all zero.
// Dense warm-up: token_target [T, Wt] in the dense token layout -> [T, Wp] dense pool layout
// (Wp = 0: max pools per document).
Tensor kpool_pool_target_dense(const Tensor& token_target, const SeqLayout& seqs, int64_t P,
                               int64_t Wp = 0, std::optional<int64_t> q0 = {});
// Sparse stage: token_target [T, K + P - 1 or K] in the layout of KPoolSelection::indices
// -> [T, K / P] aligned with KPoolSelection::pools (0 where the pool id is -1).
Tensor kpool_pool_target_sparse(const Tensor& token_target, const Tensor& pools, int64_t P);

}  // namespace hlm::ops
