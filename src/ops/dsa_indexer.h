// DSA lightning-indexer ops (docs/dsa.md, "Indexer scoring", "Top-k selection"), CPU reference and
// CUDA kernels: scoring with its backward, and top-k selection. Packed THD layout: every op
// restarts at each sequence boundary.
//
// Scoring (weights already scaled, i.e. w = weights_proj(h) * H_I^-1/2):
//   I(t, s) = sum_h w[t, h] * ReLU(scale * q[t, h] . k[s]),   scale = d_I^-1/2 by default,
// for keys s visible to t within t's document. Keys are token keys ([T, d_I], pool = 1) or KPool
// pooled keys ([NP, d_I], pool = P, numbered per document as in dsa_kpool.h): pool p of a document
// is visible to t iff its last token is at or before t.
// Computed in the input dtype (f64 for f64; f32 with f32 accumulation for f32): per entry the dot
// product in channel order, then the head sum in head order. Deterministic (OpenMP over queries;
// key gradients are gathered per key in increasing (t, slot) order).
// Dtypes: on the CPU q, k, w (and d_scores) are all f32 or all f64. On CUDA q, k, w are one dtype
// of f32, f64 or bf16, contiguous; scores and d_scores are in the computation dtype (f32 for bf16,
// else the input dtype); dq, dk, dw in the input dtype; arithmetic in f32 (f64 for f64), each sum
// in a fixed order (ops/cuda/dsa_indexer.cu), so results repeat bit for bit but differ from the
// CPU's at rounding level.
//
// Row layouts of score tensors:
//   dense ("causal"): [T, W], W >= max keys per document; column j of query t is the document's
//     j-th key (the token doc_start + j, or the document's pool j); columns beyond the visible keys
//     hold -inf.
//   explicit rows ("at"): [T, W] key rows (i32/i64, -1 = empty); the score at an empty slot is
//   -inf.
// Index convention (all DSA ops): token indices are GLOBAL positions in the packed batch; pool ids
// are global pool ids (pool_offsets in dsa_kpool.h).
// Backward ignores d_scores at -inf (non-candidate) positions. Gradients are written (=), fresh
// tensors in the input dtype.
#pragma once

#include <optional>

#include "core/seq_layout.h"
#include "core/tensor.h"
#include "ops/dsa_sparse_attention.h"

namespace hlm::ops {

namespace dsa_detail {
struct Pattern;
}

struct IndexerScoreOptions {
  int64_t pool = 1;  // 1: token keys; P > 1: KPool pooled keys
  double scale = 0;  // inner scale on q.k; 0 means d_I^-1/2
  bool relu = true;  // Megatron dsa_indexer_scoring_relu
  // FP8 emulation of the scoring inputs (docs/dsa.md, "Indexer scoring"): q per (t, h) and k per
  // key row are quantised to E4M3 with one scale per 128 channels (a shorter last block when
  // d_I % 128 != 0):
  //   amax = max(max|x|, fp8_amax_floor) in f32; scale = amax / 448, or with fp8_pow2 the power of
  //   two 2^ceil(log2(amax / 448)) (ue8m0, DS V3.2 / GLM); x8 = e4m3_satfinite(x / scale);
  // and the scores are computed in the input dtype from the dequantised values x8 * scale (equal to
  // the DeepGEMM form sum_h w q_scale ReLU(q8 . k8) k_scale up to rounding). The scale rule is
  // fp8_scale_inv of ops/fp8_quant.h with the indexer's own amax floor (1e-4, DeepSeek-V3.2's;
  // the GEMM contract uses 1e-12). Backward is straight-through: the gradient is that of the
  // scores as a function of the dequantised values, passed to the unquantised q and k unchanged.
  // The dequantised values are the same f32 numbers on the CPU and on CUDA (bf16 inputs: of their
  // f32 values). A non-finite q or k is an error on both (found on the device on CUDA).
  bool fp8 = false;
  bool fp8_pow2 = true;
  double fp8_amax_floor = 1e-4;
};

// Query windows (context parallelism, docs/parallel.md): every op below that takes seqs also takes
// an optional q0. With it, q (w, the scores, their rows and gradients) holds the queries of global
// tokens [q0, q0 + T) of the packed batch seqs, and k its keys (all of them: [T_total or NP, d_I]);
// the result is those rows of the whole batch's (on CUDA the kernels take the window's per-query
// geometry, ops/cuda/dsa_common.cuh's DsaLayoutDev, and clip each key's readers to it).

// q [T, H_I, d_I], k [T or NP, d_I], w [T, H_I] (dtypes above) -> scores [T, W] dense layout.
// W = 0 picks the minimum width (max keys per document).
Tensor indexer_scores(const Tensor& q, const Tensor& k, const Tensor& w, const SeqLayout& seqs,
                      const IndexerScoreOptions& opt = {}, int64_t W = 0,
                      std::optional<int64_t> q0 = {});

// Scores at explicit key rows [T, W] (each a visible key of the query's document, no duplicates).
Tensor indexer_scores_at(const Tensor& q, const Tensor& k, const Tensor& w, const SeqLayout& seqs,
                         const Tensor& rows, const IndexerScoreOptions& opt = {},
                         std::optional<int64_t> q0 = {});

struct IndexerScoreGrads {
  Tensor dq;  // [T, H_I, d_I]
  Tensor dk;  // like k
  Tensor dw;  // [T, H_I]
};
// d_scores in the dense layout [T, W] of indexer_scores.
IndexerScoreGrads indexer_scores_backward(const Tensor& q, const Tensor& k, const Tensor& w,
                                          const SeqLayout& seqs, const Tensor& d_scores,
                                          const IndexerScoreOptions& opt = {},
                                          std::optional<int64_t> q0 = {});
IndexerScoreGrads indexer_scores_at_backward(const Tensor& q, const Tensor& k, const Tensor& w,
                                             const SeqLayout& seqs, const Tensor& rows,
                                             const Tensor& d_scores,
                                             const IndexerScoreOptions& opt = {},
                                             std::optional<int64_t> q0 = {});

// The forward over an inference cache (layers/dsa/dsa_cached.cpp) scores storage rows of the
// cache, not a packed batch's keys: p (built on the host) lists each query's key rows of k in slot
// order, p.W the score width. Each key row must be in [0, k.size(0)) (checked); no document or
// causality rule applies (the cache's page tables give the rows). q [p.T, H_I, d_I], w [p.T, H_I],
// k [R, d_I], dtypes as for indexer_scores; scores [p.T, p.W], -inf off the pattern. CUDA copies
// the pattern to the device.
Tensor indexer_scores_pattern(const Tensor& q, const Tensor& k, const Tensor& w,
                              const dsa_detail::Pattern& p, const IndexerScoreOptions& opt);
// The same over every candidate of each query of a forward over an inference cache, without a
// pattern from the host: query t scores candidates j = 0 .. s.ncand[t] - 1 of its sequence
// s.seq_of[t] (tokens with s.P = 1, complete pools of s.P tokens otherwise), key row the
// candidate's storage row from the sequence's page table (DsaCacheView::row / pool_row), in slot
// j. scores [T, max(1, max ncand)]. The candidates' count and pages are checked on the host (each
// ncand[t] = (pos[t] + 1) / P, covered by the page table, every page's rows inside k); CUDA builds
// the entries on the device from the page tables (O(T + pages) numbers copied, not one per
// candidate), the CPU the same pattern on the host, so the scores are indexer_scores_pattern's.
Tensor indexer_scores_cached(const Tensor& q, const Tensor& k, const Tensor& w,
                             const CachedSelection& s, const IndexerScoreOptions& opt);
// The values the FP8 scoring computes with (IndexerScoreOptions::fp8) for every row of x [...,
// d_I]: x quantised and dequantised per row and 128-channel block, in x's computation dtype (the
// same numbers on both devices). A non-finite entry throws, naming op and what.
Tensor indexer_fp8_emulate(const Tensor& x, const IndexerScoreOptions& opt, const char* op,
                           const char* what);
// The same where a non-finite entry of CUDA x does not throw (the check would wait for the
// device): it sets nonfinite (an i32 [1] on the device, zeroed by the caller; never reset here) to
// 1, for the caller to act on without reading it (ops::nan_if_flagged_). On the CPU it throws as
// above and nonfinite is not touched.
Tensor indexer_fp8_emulate(const Tensor& x, const IndexerScoreOptions& opt, const char* op,
                           const char* what, Tensor& nonfinite);

// Top-k selection over dense-layout scores [T, W] (pool = 1: tokens; pool = P: pools).
// Query t has n_t candidates (r + 1 tokens, or floor((r + 1) / P) pools, r = t - doc_start); the
// min(k, n_t) best are selected by (higher score first, then lower index; NaN ranks below every
// number), so when n_t <= k all candidates are selected whatever the scores. The row is written in
// increasing index order followed by -1 padding: i32 [T, k] of global token (or pool) ids.
Tensor topk_select(const Tensor& scores, const SeqLayout& seqs, int64_t k, int64_t pool = 1,
                   std::optional<int64_t> q0 = {});

}  // namespace hlm::ops
