// HybridModel: the GLM-5.3-Flash family model (transformers' Glm5NextTextModel plus lm_head and
// MTP), CPU, explicit forward and backward over packed THD batches.
//
//   e      = embed_tokens(tokens)                                      [T, D]
//   X^0    = (e, e, ..., e)                        n mHC streams       [T, n, D]
//   per decoder layer l (attention site, then FFN site; docs/model.md, "The forward"):
//     u = attn_hc.collapse(X);  y = self_attn(input_layernorm(u));  X = attn_hc.write_back(y)
//     u = ffn_hc.collapse(X);   y = mlp(post_attention_layernorm(u)); X = ffn_hc.write_back(y)
//     self_attn: KDA ("linear_attention") or DSA ("deepseek_sparse_attention", MLA + indexer +
//     sparse attention); mlp: dense SwiGLU or the sigmoid-routed MoE.
//   h      = (1/n) sum_j X^L_j                     the mean output contract
//   hidden = norm(h)                               last_hidden_state
//   logits = lm_head(hidden)                       (tied to embed_tokens when configured)
// Without mHC (mhc = false) every site is a plain pre-norm residual: X' = X + y.
//
// MTP (one depth, docs/model.md "MTP"; checkpoint layer index L = num_hidden_layers): for
// position i of a sequence, e' = embed(tokens[i+1]) (zeros at the last position),
//   m = eh_proj([enorm(e'); hnorm(h_i)]),  m += self_attn(input_layernorm(m)),
//   m += mlp(post_attention_layernorm(m)),  logits' = lm_head(shared_head.norm(m)),
// predicting tokens[i+2] (the target of position i+1); a single-stream pre-norm block, DSA + MoE.
//
// Objective (training forward with targets):
//   loss = CE(logits, targets) + mtp_loss_scaling_factor * CE(logits', targets shifted)
//        + sum of the MoE sequence aux losses + sum of the DSA indexer KL losses
// CE is the mean over non-ignored targets (-100). The indexer losses train only the indexers (their
// inputs are detached); the aux losses reach only the routers. Each part is reported separately.
//
// Conventions (docs/architecture.md): forward fills Saved; backward accumulates every parameter
// gradient (+=).
// Recompute: none keeps every activation; selective passes ctx.recompute to the sublayers (each
// keeps its input only); full keeps only each decoder layer's input streams and re-runs the layer
// in backward. All three give bit-identical gradients.
// Parameter names are the HF checkpoint names: model.embed_tokens.weight,
// model.layers.{i}.{attn_hc,ffn_hc}.{fn,base,scale}, model.layers.{i}.input_layernorm.weight,
// model.layers.{i}.self_attn.* (KDA: transformers' names, forget_gate.*; DSA: MLA + indexer.*),
// model.layers.{i}.mlp.* (gate_proj/up_proj/down_proj, or gate.weight,
// gate.e_score_correction_bias, experts.gate_up_proj, experts.down_proj, shared_experts.*),
// model.norm.weight, lm_head.weight, and the MTP block under model.layers.{L}.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "layers/dsa/dsa_layer.h"
#include "layers/kda/kda_layer.h"
#include "layers/linear.h"
#include "layers/mhc/mhc_site.h"
#include "layers/mlp.h"
#include "layers/module.h"
#include "layers/moe/moe_layer.h"
#include "layers/norm.h"
#include "layers/tensor_parallel.h"
#include "model/config.h"

namespace hlm {

enum class Recompute : uint8_t { none, selective, full };
const char* recompute_name(Recompute r);  // "none", "selective", "full"
Recompute parse_recompute(const std::string& s);

struct HybridModelOptions {
  DType dtype = DType::f32;  // parameter dtype: f64 (reference runs), f32 or bf16
  uint64_t seed = 0;         // deterministic initialisation
  Recompute recompute = Recompute::none;
  bool mtp = true;  // build the MTP block when the config has one
  // Rows per chunk of the chunked head + loss (ModelInputs::logits); 0: as many as 512 MiB of
  // f32 logits hold.
  int64_t loss_chunk_rows = 0;
  // Expert parallelism (docs/parallel.md, "Expert parallelism"): the processes that share every
  // MoE layer's routed experts, this one holding experts [r E / n, (r + 1) E / n) for its rank r
  // of n (MoeConfig::ep_size / ep_rank); every process of the group runs each forward and
  // backward together, each on its own tokens. nullptr or a group of one: every expert here.
  dist::Comm* expert_comm = nullptr;
  // Tensor parallelism (docs/parallel.md, "Tensor parallelism"): the processes that split every
  // attention layer's heads and every dense MLP's channels (layers/tensor_parallel.h), each rank
  // holding its part of them; each rank runs the same batch, and the parts' outputs and input
  // gradients are summed over the group after each such layer. A MoE layer runs on the rank's
  // share of the batch's tokens (an even split of the rows), its outputs gathered back. Every
  // other parameter (embedding, mHC, norms, head) is whole on every rank and computed the same
  // there. Every rank of the group calls each forward and backward together. With expert
  // parallelism, a MoE layer's share of the rows goes to the expert group (which must be made of
  // ranks of other tensor-parallel groups, as the trainer makes it). With context parallelism
  // (ModelInputs::cp: a slice over a group of the ranks of one tensor-parallel rank) the group's
  // ranks run the same slice, and tensor_context_comm must be given. Not over a cache yet
  // (refused). nullptr or a group of one: none.
  dist::Comm* tensor_comm = nullptr;
  // Tensor and context parallelism together: the ranks that hold one part of the batch (every
  // tensor-parallel group of one context-parallel group), ordered by (context rank, tensor rank).
  // A MoE layer's rows are the slice's rows split over the tensor group, and its sequence aux loss
  // takes the whole sequences' counts over this group.
  dist::Comm* tensor_context_comm = nullptr;
};

// The caller's own output projection and loss (Megatron's output_processor): given the final
// hidden states [T, D] (after model.norm), return the loss and write d loss / d hidden into
// *d_hidden ([T, D], f32 or f64). Used instead of lm_head + cross-entropy for the main loss.
using OutputProcessor = std::function<double(const Tensor& hidden, Tensor* d_hidden)>;

class ModelCache;  // model/model_cache.h

struct ModelInputs {
  Tensor tokens;      // [T] i64 / i32 token ids in [0, vocab)
  Tensor cu_seqlens;  // [N+1] (undefined: one sequence of T tokens)
  Tensor targets;     // [T] next-token targets, -100 ignored (undefined: no loss)
  // Compute logits (on the CPU always when targets are given). false in a training forward with
  // targets on CUDA: the output head and the cross-entropy run in chunks of rows and no [T, V]
  // logits are held (ModelOutput::logits / mtp_logits undefined; lm_head's gradient and d hidden
  // are computed in the forward, the backward uses them).
  bool logits = true;
  bool aux_losses = true;            // add the MoE aux and indexer losses to the objective
  OutputProcessor output_processor;  // optional: replaces lm_head + CE for the main loss
  // Routing replay: per MoE layer (main layers in order, then MTP), [T, K] indices or undefined.
  std::vector<Tensor> replay;
  // Selection replay: per DSA layer of the main stack (in order), the token set each query
  // attends ([T, W] global ids, -1 padded; DsaLayer::forward given_indices) or undefined (the
  // layer's own indexer). A layer whose indexer_types entry is "shared" attends the previous DSA
  // layer's set.
  std::vector<Tensor> dsa_indices;
  // Inference over a cache (model/model_cache.h, docs/inference.md; CPU): sequence n of
  // cu_seqlens continues the cached sequence in slot cache_slots[n] (distinct open slots). Its
  // KDA states and DSA rows are read and extended: the forward takes the pages its tokens need
  // (or throws, changing nothing, when they do not fit) and advances the lengths. Inference only:
  // no training, targets, output processor, replay or given selections; no MTP.
  // ModelOutput::dsa_indices then holds positions within each sequence.
  ModelCache* cache = nullptr;
  std::vector<int64_t> cache_slots;
  // With a speculative cache: every sequence is 2 tokens, the last a draft. The KDA layers keep
  // the states before and after it; the lengths advance by 1 and ModelCache::accept_drafts
  // settles each draft.
  bool draft_last = false;
  // The token rows whose logits are computed (ModelOutput::logits [R, V] in this order); empty:
  // every row. Inference only (no targets).
  std::vector<int64_t> logit_rows;
  // Data parallelism (train/data_parallel.h): this call is one part of a global batch split by
  // whole sequences, and these are the global batch's denominators of the mean losses: the targets
  // of the main and the MTP cross-entropy and the non-empty sequences the MoE sequence-wise aux
  // loss averages over. 0: this call's own. The losses returned (and their gradients) are then
  // this part's shares: summed over the parts they are the global batch's losses.
  int64_t lm_normalizer = 0;
  int64_t mtp_normalizer = 0;
  int64_t aux_sequences = 0;
  // Context parallelism (docs/parallel.md, "Context parallelism"): this call is rank
  // cp->rank()'s slice of the packed batch cp->global(), every rank of cp's group calling
  // together. tokens, targets and replay hold the slice's rows; cu_seqlens is undefined or the
  // slice's own layout (cp->local()). The KDA layers pass what crosses a slice boundary on
  // (cp_mode), the MoE aux loss takes the whole sequences' counts; every loss and gradient is
  // this slice's share (with the global batch's normalizers above, they sum over the ranks to the
  // whole batch's). The DSA layers gather the latent rows and indexer keys over the group and
  // attend from this slice's queries; their indexer losses are this slice's
  // rows' means (ModelOutput::indexer_rows: the caller rescales each by the slice's share of the
  // rows, as the trainer does under data parallelism). Not over a cache; the MTP block does not
  // run context parallel yet (refused).
  const dist::CpSlice* cp = nullptr;
  KdaCpMode cp_mode = KdaCpMode::chunkwise;
};

struct ModelOutput {
  Tensor hidden;      // [T, D] last_hidden_state, compute dtype
  Tensor pre_norm;    // [T, D] the mean-contracted hidden before model.norm (the MTP's input)
  Tensor logits;      // [T, V] compute dtype (when computed)
  Tensor mtp_logits;  // [T, V] (training forward with MTP)
  double loss = 0;    // the whole objective
  double lm_loss = 0, mtp_loss = 0, aux_loss = 0, indexer_loss = 0;
  int64_t lm_count = 0, mtp_count = 0;  // targets counted by the two CE terms
  // Per MoE layer (main layers in order, then MTP): tokens per expert [E] i64 and the selection.
  // A forward over a cache computes neither the counts (undefined) nor the aux loss (0).
  std::vector<Tensor> expert_counts;
  std::vector<Tensor> expert_topk;
  std::vector<Tensor> dsa_indices;  // per DSA layer of the main stack: the attended sets
  // Per DSA layer (main stack in order, then the MTP block's) in a training forward: its indexer
  // KL loss (coefficient applied) and the query rows that loss averages over (0: no loss). A
  // data-parallel step turns the per-part means into the global mean with backward's
  // indexer_scales.
  std::vector<double> indexer_losses;
  std::vector<int64_t> indexer_rows;
};

class DecoderLayer;
class MtpBlock;

class HybridModel : public Module {
 public:
  struct Saved;  // defined in hybrid_model.cpp
  struct SavedDeleter {
    void operator()(Saved* s) const;
  };
  using SavedPtr = std::unique_ptr<Saved, SavedDeleter>;

  HybridModel(const ModelConfig& config, const HybridModelOptions& options = {});
  ~HybridModel() override;

  const ModelConfig& config() const { return cfg_; }
  const HybridModelOptions& options() const { return opt_; }
  DType compute_dtype() const;         // f64 for f64 parameters, else f32
  Device device() const;               // where the parameters live (Module::to)
  void set_dsa_stage(DsaStage stage);  // every DSA layer (warm-up / sparse indexer training)

  // Forward. With saved != nullptr and ctx.training, *saved receives what backward needs.
  ModelOutput forward(const Context& ctx, const ModelInputs& in, SavedPtr* saved = nullptr) const;
  // Backward of the objective of the forward (when it had targets or an output processor), plus
  // sum(hidden * d_hidden_extra) when d_hidden_extra is given ([T, D]): the grad-probe of the
  // parity tool. Parameter gradients accumulate (+=).
  // indexer_scales: per DSA layer (ModelOutput::indexer_rows' order), the factor of its indexer
  // loss's gradient (empty: 1 each; data parallelism passes local rows / global rows).
  void backward(const Context& ctx, const Saved& saved, const Tensor& d_hidden_extra = {},
                const std::vector<double>& indexer_scales = {});

  // After the optimizer step: the aux-loss-free bias update of every MoE layer from the counts of
  // the last forward (ModelOutput::expert_counts), rate = moe.bias_update_rate.
  void update_moe_bias(const std::vector<Tensor>& counts);

  int64_t num_moe_layers() const;
  // Every MoE layer's routed-expert weights (experts.gate_up_proj and experts.down_proj, main
  // layers in order, then MTP's): under expert parallelism they hold this process's experts only.
  std::vector<Param*> expert_params();
  bool has_mtp() const { return mtp_ != nullptr; }
  // Under tensor parallelism: every parameter's layout over the group (full names, in
  // named_parameters order). The attention layers' and dense MLPs' as kda_tp_params /
  // dsa_tp_params / mlp_tp_params give them; a MoE layer's parameters replicated (each rank's
  // gradient is its tokens' share); every other parameter identical. Without it: every parameter
  // identical. tp_reduce_grads(group, model, layouts) then sums the shares, and
  // tp_gather the whole parameters (for a checkpoint).
  std::vector<TpParam> tensor_parallel_params();

  // The MTP block over a speculative cache (CPU; docs/inference.md, "Speculative decoding"):
  // sequence n's rows are MTP positions mtp_length(slot) + r, row r reading next_tokens[r] (the
  // token after that position) and h [R, D] (the main stack's pre-norm hidden at that position,
  // ModelOutput::pre_norm). Returns the MTP logits [R, V] (each predicting the token two after its
  // position) and advances the slots' MTP lengths.
  Tensor mtp_forward_cached(const Tensor& next_tokens, const Tensor& h, const SeqLayout& seqs,
                            ModelCache& cache, const std::vector<int64_t>& slots) const;

 private:
  ModelConfig cfg_;
  HybridModelOptions opt_;
  Param* embed_ = nullptr;
  std::vector<std::unique_ptr<DecoderLayer>> layers_;
  std::unique_ptr<RmsNorm> norm_;
  std::unique_ptr<Linear> lm_head_;  // null when tied
  std::unique_ptr<MtpBlock> mtp_;
};

// The layer configs the model builds from a ModelConfig (exposed for tests and tools).
KdaConfig kda_layer_config(const ModelConfig& c);
DsaLayerConfig dsa_layer_config(const ModelConfig& c, DType dt, uint64_t seed);
MoeConfig moe_layer_config(const ModelConfig& c, DType dt, uint64_t seed);
DenseMlpConfig dense_mlp_config(const ModelConfig& c, DType dt, uint64_t seed);
MhcSiteConfig mhc_site_config(const ModelConfig& c, DType dt, uint64_t seed);

}  // namespace hlm
