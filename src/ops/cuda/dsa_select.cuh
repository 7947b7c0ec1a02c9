// The CUDA side of the DSA selection ops and the indexer loss (dsa_select.cu): top-k selection
// (ops/dsa_indexer.h), KPool's expansion of selected pools to token indices and its pool-level
// targets (ops/dsa_kpool.h), and the indexer KL loss (ops/dsa_indexer_loss.h). Host interface,
// includable from C++. The front doors check the arguments and allocate the outputs; scores and
// targets are f32 or f64 (the computation dtype of the DSA ops), index tensors i32 or i64.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/dsa_common.h"
#include "ops/dsa_indexer_loss.h"

namespace hlm::ops::cuda {

// out i32 [T, k]: the rule of ops::topk_select (higher score, then lower index; NaN last), rows
// in increasing index order, -1 padded.
void topk_select(const Tensor& scores, const dsa_detail::QueryWindow& w, int64_t k, int64_t pool,
                 Tensor& out);
// The selection of the forward over an inference cache (ops::cached_sparse_attention): per query
// t the best min(K / P, ncand[t]) of scores[t, 0 .. ncand[t]) (the topk_select rule), expanded to
// positions sel [T, W] (i32, -1 empty; W = K, or K + P - 1 with the tail columns) and to the
// pattern entries slot / key / query at row_ptr[t] .. (key: the storage row from the sequence's
// page table pages [N, max_pages], page tokens each). ncand, pos, seq_of, row_ptr: i64.
void cached_select(const Tensor& scores, const Tensor& ncand, const Tensor& pos,
                   const Tensor& seq_of, const Tensor& pages, int64_t page, int64_t K, int64_t P,
                   const Tensor& row_ptr, Tensor& sel, Tensor& slot, Tensor& key, Tensor& query);
// The candidates of the scoring over an inference cache (ops::indexer_scores_cached) as pattern
// entries: query t's candidates j = 0 .. ncand[t] - 1 at entries row_ptr[t] + j (slot j, query t,
// key the storage row of token j (P = 1) or of pool j: pages[seq_of[t]][j P / page] page / P +
// (j P % page) / P). ncand, seq_of, row_ptr: i64; pages [N, max_pages].
void cached_candidates(const Tensor& ncand, const Tensor& seq_of, const Tensor& pages, int64_t page,
                       int64_t P, const Tensor& row_ptr, Tensor& slot, Tensor& key, Tensor& query);
// indices i32 [T, K (+ P - 1)] from the selected pools i32 [T, K / P] (KPoolSelection).
void kpool_select_indices(const Tensor& pools, const dsa_detail::QueryWindow& w, int64_t K,
                          int64_t P, bool always_select_tail, Tensor& indices);
void kpool_pool_target_dense(const Tensor& token_target, const dsa_detail::QueryWindow& w,
                             int64_t P, Tensor& out);
// pools: i32 or i64 [T, G] on the device.
void kpool_pool_target_sparse(const Tensor& token_target, const Tensor& pools, int64_t P,
                              Tensor& out);
// r.d_scores allocated by the front door; r.loss and r.rows are filled here.
void indexer_kl_loss(const Tensor& scores, const Tensor& target, double coeff,
                     KlReduction reduction, IndexerKl& r);

}  // namespace hlm::ops::cuda
