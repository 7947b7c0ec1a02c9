// DsaLayer: DeepSeek Sparse Attention = MLA (absorbed form) + the lightning indexer + top-k sparse
// attention over exactly each query's selected tokens, with the indexer KL loss (docs/dsa.md,
// "The math, file by file" and "The MLA module and the DSA layer"). CPU, explicit forward and
// backward.
//
// Conventions (docs/architecture.md): forward(ctx, x, cu_seqlens, saved*) fills Saved (only the
// input under ctx.recompute; backward then re-runs the forward, which selects the same indices
// because every step is deterministic); backward writes dx (=) and accumulates parameter gradients
// (+=).
//
// Forward, x [T, D] packed with cu_seqlens:
//   (c_q, q, kv) = MLA projections (Mla::project);  q_abs = Mla::absorb_query(q)
//   selection S_t:
//     no indexer                      every causal token of t's sequence (dense attention)
//     stage dense_warmup              every causal token (the main attention stays dense; the
//                                     indexer runs for its loss only)
//     stage sparse                    DsaIndexer::forward(x, c_q).indices: top-k tokens, or KPool
//                                     pools + tail; a sequence prefix of at most K tokens selects
//                                     all its causal tokens, so short sequences are dense
//   o_lat = ops::sparse_attention(q_abs, kv, S, d_v = r_kv, scale);  y = Mla::output(o_lat)
//   (q_abs, kv, o_lat and its gradient in bf16 unless kv_b_proj's precision is native:
//   Mla::attention_operand. On CUDA the dense causal set runs ops::causal_attention, with no
//   index tensor.)
// Indexer loss (training forward with an indexer and indexer_loss on; docs/dsa.md, "DSA layer"):
//   target p* = ops::attention_target(q_abs, kv) over every causal token (dense warm-up) or
//   ops::attention_target_at(q_abs, kv, S) over the selection (sparse stage): the head-summed,
//   L1-normalised main-attention distribution, detached. The indexer compares its own scores with
//   it (DsaIndexer::loss_value / loss_backward; KPool: pool level, docs/dsa.md).
//   The indexer's inputs x and c_q are detached: its gradient flows only into its own
//   parameters, and the LM gradient never reaches the indexer.
// Backward: dy -> Mla::output_backward -> ops::sparse_attention_backward (same S) ->
//   Mla::absorb_query_backward -> Mla::project_backward -> dx; then, when the forward computed
//   the loss, DsaIndexer::loss_backward with grad_scale (Megatron's DSAIndexerLossAutoScaler:
//   the loss's gradient enters with the LM loss scale) into the indexer parameters only.
//
// Parameter names (HF, relative to self_attn): the MLA names (q_a_proj.weight, ...) and
// indexer.wq_b.weight, indexer.wk.weight, indexer.k_norm.{weight,bias},
// indexer.weights_proj.weight (+ indexer.index_kpool_compress_gate / _ape with KPool).
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "layers/dsa/dsa_cache.h"
#include "layers/dsa/indexer.h"
#include "layers/dsa/mla.h"

namespace hlm {

namespace dist {
class Comm;
class CpSlice;
}  // namespace dist

enum class DsaStage : uint8_t {
  dense_warmup,  // main attention over all causal tokens; indexer KL over all causal tokens
  sparse,        // main attention over the selection; indexer KL over the selection
};

struct DsaLayerConfig {
  MlaConfig mla;                         // form is ignored: the DSA layer runs absorbed
  std::optional<IndexerConfig> indexer;  // none: dense causal attention, no indexer
  DsaStage stage = DsaStage::sparse;
  bool indexer_loss = true;  // compute the KL in the training forward (needs an indexer)
  double indexer_loss_coeff = 1.0;
  ops::KlReduction indexer_loss_reduction = ops::KlReduction::mean;

  // mla.validate(), indexer->validate(), and the coupling: the indexer reads x and c_q, so
  // indexer.hidden_size == mla.hidden_size, indexer.q_lora_rank == mla.q_lora_rank (> 0: an
  // indexer needs the q latent); both in f64 or both not; coeff finite and >= 0.
  void validate() const;
};

class DsaLayer : public Mla {
 public:
  struct Output {
    Tensor y;        // [T, D], dtype of x
    Tensor indices;  // i32 [T, W]: the set each query attended (global token ids, -1 padded);
                     // undefined on CUDA for the dense causal set (no index tensor is built)
    bool has_indexer_loss = false;
    double indexer_loss = 0;  // coeff * reduced KL (training forward only)
    int64_t indexer_loss_rows = 0;
  };
  struct Saved {
    Tensor x;           // always kept
    SeqLayout seqs;     // always kept
    bool full = false;  // false under ctx.recompute
    DsaStage stage = DsaStage::sparse;
    Mla::ProjSaved proj;
    Mla::Projected p;
    Tensor q_abs;    // [T, H, r_kv + d_r] as the attention took it (Mla::attention_operand)
    Tensor indices;  // the attended set
    Tensor lse;      // [T, H]
    Mla::OutSaved out;
    bool has_loss = false;
    DsaIndexer::Saved indexer;
    Tensor target;  // detached token-level target of the indexer loss (its stage's layout)
    Tensor given;   // given_indices as passed (kept for recompute)
    const dist::CpSlice* cp = nullptr;  // context parallel: the slice (always kept)
    Tensor kv_all;                      // context parallel: the whole batch's latent rows
  };

  // path: "model.layers.3.self_attn"; the indexer is path + ".indexer".
  DsaLayer(const DsaLayerConfig& cfg, const PrecisionPolicy& policy,
           const std::string& path = "self_attn");

  const DsaLayerConfig& layer_config() const { return lcfg_; }
  void set_stage(DsaStage s) { lcfg_.stage = s; }
  bool has_indexer() const { return indexer_ != nullptr; }
  DsaIndexer& indexer();  // throws when there is none
  Mla& mla() { return *this; }

  // x [T, D] (f64, f32 or bf16), cu_seqlens [N+1]. given_indices (optional, i32/i64 [T, W]):
  // the set each query attends, replacing the indexer's selection in the sparse stage (index
  // sharing between layers, selection replay); global token ids within the query's own sequence
  // and causal, -1 padded, no duplicates. A layer without an indexer attends the given set when
  // one is given. The indexer still runs for its loss (over its own selection).
  //
  // Context parallel (cp; docs/parallel.md, "Context parallelism"): x holds rank cp->rank()'s
  // slice of the packed batch cp->global() and seqs is cp->local(); every rank of the group calls
  // together (and again in the backward). The latent rows (and the indexer's keys) are gathered
  // over the group; this rank's queries select and attend over the whole batch's, by the rules
  // above at their global positions, so y and Output::indices (global token ids) are those rows
  // of the one-process forward's. The backward sends each rank the gradients of its latent rows
  // and keys (summed over the ranks). The indexer loss is this slice's rows' mean (the caller
  // rescales it by this slice's share of the rows, as for data parallelism). A dense causal set
  // leaves Output::indices undefined.
  Output forward(const Context& ctx, const Tensor& x, const SeqLayout& seqs, Saved* saved,
                 const Tensor& given_indices = {}, const dist::CpSlice* cp = nullptr) const;
  // The same with a cu_seqlens tensor [N+1] (checked here; undefined: one sequence; an unusable
  // input is reported by the overload above).
  Output forward(const Context& ctx, const Tensor& x, const Tensor& cu_seqlens, Saved* saved,
                 const Tensor& given_indices = {}) const {
    return forward(
        ctx, x,
        (x.defined() && x.dim() > 0
             ? SeqLayout::from_tensor(cu_seqlens, x.size(0), "DsaLayer::forward: cu_seqlens")
             : SeqLayout()),
        saved, given_indices);
  }
  // Inference over a cache (CPU; docs/inference.md): x [T, D] holds the new tokens of each
  // sequence of `seqs`, which continue the tokens already cached (cache.start). Writes their
  // latent rows and indexer keys into the cache (KPool: a pool's key when it completes), selects
  // each query's set among all its sequence's tokens by the training forward's rules at positions
  // cache.start + r (the same sets, the same slot order) and attends it. given: i32 [T, W]
  // positions within each query's sequence (-1 padded), the set a "shared" layer attends, or
  // undefined. Output::indices: the attended sets as positions within each sequence, i32 [T, W]
  // (-1 padded).
  Output forward_cached(const Tensor& x, const SeqLayout& seqs, DsaCacheView& cache,
                        const Tensor& given = {}) const;

  // Tensor parallelism (layers/tensor_parallel.h): this layer holds its group's rank's share of the
  // heads, and the indexer loss's target, the head-summed attention distribution, is summed over
  // the group: every head's row sums to 1 over its set, so the whole layer's target is the mean
  // of the ranks' (one all-reduce of [T, W] per training forward with the loss). Every rank then
  // computes the same indexer loss and indexer gradients; y and dx are this rank's parts (the
  // caller sums them over the group). nullptr (the default) or a group of one: no sum. The group
  // must outlive the layer's use of it.
  void set_tensor_parallel(dist::Comm* group) { tp_ = group; }

  // dy [T, D] -> dx (dtype of the saved x). indexer_grad_scale multiplies the indexer loss's
  // gradient (the LM loss scale; 0 skips the indexer backward).
  Tensor backward(const Context& ctx, const Tensor& dy, const Saved& saved,
                  double indexer_grad_scale = 1.0);

 private:
  Output forward_full(const Tensor& x, const SeqLayout& seqs, bool training, Saved* s,
                      DsaStage stage, const Tensor& given, const dist::CpSlice* cp) const;
  Tensor backward_full(const Tensor& dy, const Saved& s, double indexer_grad_scale);

  DsaLayerConfig lcfg_;
  std::unique_ptr<DsaIndexer> indexer_;
  dist::Comm* tp_ = nullptr;
};

}  // namespace hlm
