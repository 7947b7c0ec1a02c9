// DsaIndexer: the DSA lightning indexer module, with the optional KPool pooled-key indexer
// (docs/dsa.md, "The lightning indexer" and "KPool"; decisions in "The indexer module"), on CPU
// or CUDA tensors (the parameters' device, Module::to; the ops dispatch to their CUDA kernels).
//
// Conventions (docs/architecture.md): explicit forward and backward, no autograd. forward() fills a
// named Saved struct (or, under ctx.recompute, only the inputs and the discrete selection; the rest
// is recomputed by the backward). loss_backward() accumulates (+=) into every indexer parameter's
// Param::grad and writes (=) the optional input gradients. Packed THD layout: every step that looks
// along the sequence (RoPE positions, causal candidates, KPool pools, top-k) restarts at each
// cu_seqlens boundary, so a packed batch gives the documents' results bit for bit.
//
// Parameters (HF checkpoint names, relative to the module, e.g.
// "model.layers.3.self_attn.indexer"):
//   wq_b.weight               [H_I * d_I, q_lora_rank]  GEMM role indexer_qk_proj
//   wk.weight                 [d_I, hidden]             GEMM role indexer_qk_proj
//   k_norm.weight, .bias      [d_I]                     LayerNorm, computed in FP32 (f64 in f64
//   mode) weights_proj.weight       [H_I, hidden]             GEMM role indexer_weights (never FP8)
//   KPool only (index_kpool P > 1):
//   index_kpool_compress_gate [d_I, hidden]             GEMM role indexer_kpool (no ".weight"
//   suffix,
//                                                       as in the checkpoint)
//   index_kpool_compress_ape  [P, d_I]                  keep_fp32, no weight decay, init zeros
//
// Forward, for h [T, hidden] (layer input after the attention norm), c_q [T, q_lora_rank] (MLA's
// q latent after q_a_layernorm) and cu_seqlens [N+1]:
//   q   = wq_b(c_q) viewed [T, H_I, d_I]
//   k   = LayerNorm(wk(h)) [T, d_I]                                      (eps = k_norm_eps)
//   RoPE on channels [0, d_r) of q and k (indexer layout [pe, nope]), position = t - doc_start;
//        interleaved pairs (2i, 2i+1) or NeoX halves (i, i + d_r/2); freq_i = theta^(-2i/d_r)
//   token-level (P = 1):  q <- Hd q, k <- Hd k   (Hd = normalised Sylvester Walsh-Hadamard matrix,
//        H_d / sqrt(d_I), symmetric and orthogonal; skipped when hadamard = false)
//   KPool (P > 1): gate = index_kpool_compress_gate(h) [T, d_I];
//        pooled = ops::kpool_compress(k, gate, ape) [NP, d_I] (per-channel softmax pooling, pools
//        restart per document, partial last pool never compressed); q <- Hd q, pooled <- Hd pooled
//        (the rotation follows the pooling, as in the serving path: the pooling weights are per
//        channel in the unrotated basis)
//   w   = weights_proj(h) * H_I^-1/2 [T, H_I], in FP32 (f64 in f64 mode)
//   scores I(t, s) = sum_h w[t, h] ReLU(d_I^-1/2 q[t, h] . key_s) over the causal candidates
//        (ops::indexer_scores, dense layout [T, W]; pool-level with P > 1)
//   selection: P = 1: ops::topk_select(K) -> indices [T, K];
//              P > 1: ops::kpool_select(K, P, always_select_tail) -> indices [T, K + P - 1]
//              (or [T, K] without the tail) and pools [T, K / P].
//   Indices are i32 GLOBAL token positions in the packed batch (the ops' convention, FlashMLA's
//   int32), each row ascending then -1 padded (KPool: pool groups, then the tail; -1 anywhere);
//   min(K, candidates) are selected with ties to the lower index, so a document prefix of at most
//   K tokens selects all its causal tokens.
//
// Precision: compute dtype f64 when the parameters are f64 (FD tests), else f32 (f32 or bf16
// parameters; bf16 parameters are read as bf16 values and computed in f32). Inputs h and c_q of
// any floating dtype are converted to the compute dtype first. The GEMM precision of each Linear
// is resolved from the PrecisionPolicy with its full path at construction (layers/precision.h):
// fp8_block default: wq_b/wk FP8 unless dsa_indexer_qk_proj_disable_quantization; weights_proj
// never FP8 (bf16, or native FP32 with IndexerConfig::weights_proj_fp32); the KPool gate FP8 only
// with dsa_indexer_kpool_use_quantization. Scoring precision: exact in the compute dtype, or the
// FP8 emulation of ops::IndexerScoreOptions::fp8 (E4M3, one power-of-two scale per 128-vector of q
// per head and of each key) when IndexerConfig::fp8_scoring is set; the pooled (KPool) scoring
// also takes the FP8 path when the policy's dsa_indexer_kpool_use_quantization is set.
//
// Loss (docs/dsa.md, "Indexer KL loss"; ops/dsa_indexer_loss.h): the caller computes the detached
// target from the main attention (ops::attention_target for the dense warm-up, over all causal
// tokens; ops::attention_target_at(..., out.indices, ...) for the sparse stage) and passes it in
// TOKEN level; with KPool the module aggregates it to pools (ops::kpool_pool_target_dense/_sparse:
// pool sums of p*, tail tokens dropped, renormalised over the candidate/selected pools; our own
// design, docs/dsa.md, "Pool-level KL for KPool: our design").
// L = coeff * mean over non-empty rows of KL(target || softmax(scores)) over the row's set.
// The gradient flows analytically into wq_b, wk, k_norm, weights_proj and (KPool) the gate and
// ape; h and c_q are detached in the model, but their gradients fall out of the Linear backwards
// at no extra cost and are returned (dh, dc_q) for callers that want them.
#pragma once

#include <cstdint>
#include <string>

#include "layers/linear.h"
#include "layers/module.h"
#include "layers/precision.h"
#include "ops/dsa_indexer.h"
#include "ops/dsa_indexer_loss.h"

namespace hlm {

namespace dist {
class CpSlice;
}

struct IndexerConfig {
  int64_t hidden_size = 0;  // D: width of h
  int64_t q_lora_rank = 0;  // r_q: width of c_q
  int64_t n_heads = 0;      // H_I = index_n_heads
  int64_t head_dim = 0;     // d_I = index_head_dim
  int64_t topk = 0;         // K = index_topk (tokens; with KPool K / P pools are selected)
  int64_t rope_dim = 0;     // d_r of the indexer (= qk_rope_head_dim); 0 = no RoPE; even, <= d_I
  double rope_theta = 10000.0;
  bool rope_interleave = true;  // indexer_rope_interleave: pairs (2i, 2i+1); false: NeoX halves
  int64_t kpool = 1;            // P = index_kpool; 1 = plain token-level indexer
  bool kpool_always_select_tail = true;  // index_kpool_always_select_tail
  bool hadamard = true;                  // dsa_indexer_rotate_activation; needs d_I a power of 2
  double k_norm_eps = 1e-6;
  bool scoring_relu = true;        // dsa_indexer_scoring_relu
  bool fp8_scoring = false;        // FP8-emulated scoring inputs (E4M3, 1 scale per 128-vector)
  bool fp8_pow2_scales = true;     // ue8m0 power-of-two scales in the FP8 scoring path
  bool weights_proj_fp32 = false;  // run weights_proj as a native FP32 GEMM (vLLM GLM-5.3)
  DType dtype = DType::f32;        // parameter dtype: f64, f32 or bf16 (ape stays >= f32)
  uint64_t seed = 0;               // deterministic init (core/rng.h)
  double init_std = 0.02;          // N(0, init_std) for the projection weights

  // Throws hlm::Error naming the first bad field: sizes < 1, kpool < 1, topk % kpool != 0,
  // head_dim not a power of two with hadamard, rope_dim odd / negative / > head_dim, rope_theta
  // <= 0 with RoPE, k_norm_eps <= 0, dtype not f64/f32/bf16, init_std < 0 or not finite.
  void validate() const;
  // Width of the selection rows: K, or K + P - 1 with KPool and the tail.
  int64_t index_width() const;
};

enum class IndexerLossStage : uint8_t {
  dense,   // warm-up: KL over all causal tokens (KPool: all candidate pools)
  sparse,  // sparse stage: KL over the selected set (KPool: the selected pools)
};

struct IndexerLossOptions {
  IndexerLossStage stage = IndexerLossStage::dense;
  double coeff = 1.0;                                   // the indexer loss coefficient
  ops::KlReduction reduction = ops::KlReduction::mean;  // sum = per-token-loss mode
  // Multiplies the gradient only, not the returned loss (Megatron's DSAIndexerLossAutoScaler:
  // main_loss_backward_scale).
  double grad_scale = 1.0;
};

struct IndexerLossResult {
  double loss = 0;   // coeff * reduced KL (not multiplied by grad_scale)
  int64_t rows = 0;  // rows with at least one entry (the mean's denominator)
  // Gradients of grad_scale * loss w.r.t. the inputs (the model detaches them; here for free):
  Tensor dh;    // [T, hidden], compute dtype (empty from loss_value)
  Tensor dc_q;  // [T, q_lora_rank], compute dtype (empty from loss_value)
};

class DsaIndexer : public Module {
 public:
  struct Output {
    Tensor indices;  // i32 [T, index_width()]: global token indices, -1 padded (see top)
    Tensor pools;    // KPool only: i32 [T, K / P] selected global pool ids, ascending, -1 padded
    Tensor scores;   // dense-layout scores [T, W] (P = 1: tokens; P > 1: pools), compute dtype
    Tensor weights;  // [T, H_I] head weights w (already * H_I^-1/2), compute dtype
  };

  struct Saved {
    // Always kept (also under ctx.recompute):
    Tensor h, c_q;                      // inputs converted to the compute dtype
    SeqLayout seqs;                     // as given
    const dist::CpSlice* cp = nullptr;  // context parallel: the slice (seqs is its local layout)
    Tensor indices;           // the selection (discrete; the sparse-stage loss runs over it)
    Tensor pools;             // KPool selection (pool ids)
    bool recomputed = false;  // true: the fields below are empty and the backward recomputes
    // Intermediates (empty under ctx.recompute):
    Linear::Saved wq_b, wk, weights_proj, gate;
    Tensor k_lin;            // wk(h) [T, d_I] (LayerNorm input)
    Tensor k_mean, k_rstd;   // LayerNorm statistics [T]
    Tensor q;                // scoring queries [T, H_I, d_I] (after RoPE and Hadamard)
    Tensor k;                // P = 1: scoring keys [T, d_I] (after RoPE and Hadamard);
                             // P > 1: LayerNorm(+RoPE) keys before pooling
    Tensor gate_out;         // KPool: gate [T, d_I]
    Tensor k_all, gate_all;  // context parallel: k and gate_out of the whole batch (gathered)
    Tensor pooled;           // KPool: scoring keys [NP, d_I] (pooled, after Hadamard)
    Tensor w;                // [T, H_I]
    Tensor scores;           // dense-layout scores (as Output::scores)
  };

  // Validates cfg; resolves the GEMM precisions from `policy` with the full module path `path`
  // (e.g. "model.layers.3.self_attn.indexer"; the Linears are path + ".wq_b" etc.); initialises
  // the parameters deterministically from cfg.seed (projection weights N(0, init_std), one Philox
  // stream per parameter; k_norm weight 1 and bias 0; ape 0) in cfg.dtype.
  DsaIndexer(const IndexerConfig& cfg, const PrecisionPolicy& policy, const std::string& path);

  // h [T, hidden], c_q [T, q_lora_rank] (f64/f32/bf16), cu_seqlens [N+1] (i32/i64, validated).
  // Fills *saved when saved != nullptr and ctx.training.
  // Context parallel (cp; docs/parallel.md): h and c_q hold rank cp->rank()'s slice of the packed
  // batch cp->global() and seqs is cp->local(); every rank of the group calls together. The keys
  // (and KPool's gates) are gathered over the group, the pools made from the whole batch's, and
  // this rank's queries scored and selected over them (global token and pool ids): the rows of
  // the whole batch's output. The loss's backward sends each rank its keys' gradients back
  // (summed over the ranks).
  Output forward(const Context& ctx, const Tensor& h, const Tensor& c_q, const SeqLayout& seqs,
                 Saved* saved, const dist::CpSlice* cp = nullptr) const;
  // The same with a cu_seqlens tensor [N+1] (checked here; undefined: one sequence; an unusable
  // input is reported by the overload above).
  Output forward(const Context& ctx, const Tensor& h, const Tensor& c_q, const Tensor& cu_seqlens,
                 Saved* saved) const {
    return forward(
        ctx, h, c_q,
        (h.defined() && h.dim() > 0
             ? SeqLayout::from_tensor(cu_seqlens, h.size(0), "DsaIndexer::forward: cu_seqlens")
             : SeqLayout()),
        saved);
  }

  // The indexer loss and its backward. `target` is the detached TOKEN-level main-attention target
  // in the layout of the stage:
  //   dense:  [T, Wt] dense causal token layout (ops::attention_target, W = 0: longest document)
  //   sparse: [T, index_width()] aligned with saved.indices (ops::attention_target_at over them)
  // (same floating dtype family; converted to the compute dtype). With KPool it is aggregated to
  // pools here. Accumulates the gradient of grad_scale * loss into every parameter's grad (+=).
  IndexerLossResult loss_backward(const Context& ctx, const Tensor& target,
                                  const IndexerLossOptions& opt, const Saved& saved);
  // The same loss value without touching any gradient (dh, dc_q empty).
  IndexerLossResult loss_value(const Context& ctx, const Tensor& target,
                               const IndexerLossOptions& opt, const Saved& saved) const;

  // The per-token part of the forward, for tokens at explicit positions (RoPE; a decode step or a
  // continued prefill, whose keys go into a cache and whose scoring runs over it). h [T, hidden],
  // c_q [T, q_lora_rank] on the parameters' device, pos [T]:
  struct TokenProjection {
    Tensor q;     // [T, H_I, d_I] after RoPE and Hadamard: the scoring queries
    Tensor k;     // [T, d_I] LayerNorm + RoPE; P = 1 also Hadamard (the scoring keys); P > 1 the
                  // keys before pooling
    Tensor gate;  // KPool: [T, d_I] the compress gate
    Tensor w;     // [T, H_I] head weights (* H_I^-1/2)
  };
  TokenProjection project_tokens(const Tensor& h, const Tensor& c_q,
                                 const std::vector<int64_t>& pos) const;
  // KPool: the scoring keys [M, d_I] of M complete pools from their keys and gates [M P, d_I], pool
  // after pool (as TokenProjection gives them): ops::kpool_compress, then the Hadamard rotation.
  Tensor pool_keys(const Tensor& k, const Tensor& gate) const;
  // The scoring options of forward (pool size, ReLU, the FP8 emulation).
  ops::IndexerScoreOptions score_options() const;

  const IndexerConfig& config() const { return cfg_; }
  const std::string& path() const { return path_; }
  int64_t index_width() const { return cfg_.index_width(); }
  // Whether the token-level / pooled scoring runs the FP8 emulation.
  bool fp8_scoring() const { return fp8_scoring_; }

  Linear& wq_b() { return wq_b_; }
  Linear& wk() { return wk_; }
  Linear& weights_proj() { return weights_proj_; }
  Param& k_norm_weight() { return *k_norm_w_; }
  Param& k_norm_bias() { return *k_norm_b_; }
  Param* kpool_gate() { return gate_; }  // nullptr without KPool
  Param* kpool_ape() { return ape_; }    // nullptr without KPool
  // The GEMM precision of the KPool gate projection (native when there is no KPool).
  const GemmPrecision& kpool_gate_precision() const { return gate_lin_.precision(); }

 private:
  struct LossEval {
    Tensor scores;  // scores over the stage's set (token or pool level)
    Tensor target;  // the target in the same layout (pool level with KPool)
    ops::IndexerKl kl;
    // The loss and its row count (no gradients yet).
    IndexerLossResult result() const {
      IndexerLossResult r;
      r.loss = kl.loss;
      r.rows = kl.rows;
      return r;
    }
  };
  DType compute_dtype() const;
  // The checks and the per-token intermediates of Saved (h, c_q, q, k_lin, k_mean, k_rstd, k,
  // gate_out, w and their Linear saves) for tokens at positions pos. infer: only q, k, gate_out
  // and w are wanted (no Linear saves): h is rounded once for the bf16 GEMMs that read it.
  void project_into(const Tensor& h, const Tensor& c_q, const std::vector<int64_t>& pos, Saved& s,
                    bool infer = false) const;
  // Validates the inputs and computes every intermediate of Saved (and the selection if select).
  void run_internals(const Tensor& h, const Tensor& c_q, const SeqLayout& seqs, bool select,
                     Saved& s, const dist::CpSlice* cp) const;
  // saved itself, or (recompute) `local` filled from saved's inputs plus saved's selection.
  const Saved& full_saved(const Saved& saved, Saved& local) const;
  LossEval eval_loss(const Saved& s, const Tensor& target, const IndexerLossOptions& opt) const;

  IndexerConfig cfg_;
  std::string path_;
  bool fp8_scoring_ = false;
  Linear wq_b_, wk_, weights_proj_;
  Param* k_norm_w_ = nullptr;
  Param* k_norm_b_ = nullptr;
  Param* gate_ = nullptr;  // index_kpool_compress_gate [d_I, hidden]
  Param* ape_ = nullptr;   // index_kpool_compress_ape [P, d_I]
  // Runs the gate GEMM with the Linear's precision; not a child (the checkpoint name has no
  // ".weight" suffix): its weight/grad alias *gate_ before every use.
  mutable Linear gate_lin_;
};

}  // namespace hlm
