// The limits of a model config and the memory a command needs, estimated from the shapes
// before anything is allocated (docs/robustness.md, "Limits").
//
// check_limits() bounds every count of a ModelConfig by a named constant below, far above any
// model of the family (GLM-5.3-Flash: hidden 4096, vocab 154880, 288 experts, hc_mult 4, 20
// Sinkhorn iterations), so that a typo or a hostile file is refused with a message naming the
// field, its value and the bound, instead of an allocation of terabytes, an overflow or a loop
// that never ends. ModelConfig::validate() checks everything else (signs, divisibility, ...).
//
// parameter_count() is the exact number of parameter elements HybridModel builds for a config
// (computed from the shapes, no allocation); estimate_memory() turns it and a workload (tokens,
// longest sequence, training or forward only) into a lower bound of the bytes the command needs
// (parameters, gradients and AdamW state, the residual streams, one layer's working set, logits,
// and the index and score tables of the attention layers). check_memory_for() refuses a workload
// whose estimate exceeds the memory limit (core/memory.h) with a message naming both numbers.
#pragma once

#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "model/config.h"

namespace hlm {

namespace limits {
inline constexpr int64_t kMaxVocabSize = int64_t(1) << 24;           // 16,777,216 token ids
inline constexpr int64_t kMaxHiddenSize = int64_t(1) << 17;          // 131,072
inline constexpr int64_t kMaxLayers = 1024;                          // num_hidden_layers
inline constexpr int64_t kMaxHeads = 4096;                           // every head count
inline constexpr int64_t kMaxHeadDim = 4096;                         // every head dimension
inline constexpr int64_t kMaxRank = int64_t(1) << 17;                // LoRA / latent ranks
inline constexpr int64_t kMaxIntermediateSize = int64_t(1) << 20;    // MLP and expert widths
inline constexpr int64_t kMaxConvKernel = 64;                        // linear_conv_kernel_dim
inline constexpr int64_t kMaxExperts = 4096;                         // n_routed_experts
inline constexpr int64_t kMaxSharedExperts = 64;                     // n_shared_experts
inline constexpr int64_t kMaxHcMult = 64;                            // hc_mult
inline constexpr int64_t kMaxSinkhornIters = 1000;                   // hc_sinkhorn_iters
inline constexpr int64_t kMaxIndexTopk = int64_t(1) << 24;           // index_topk
inline constexpr int64_t kMaxKpool = 4096;                           // index_kpool
inline constexpr int64_t kMaxMtpLayers = 16;                         // num_nextn_predict_layers
inline constexpr int64_t kMaxPositionEmbeddings = int64_t(1) << 40;  // max_position_embeddings
inline constexpr int64_t kMaxParameters = int64_t(1) << 44;          // ~17.6 T parameters
}  // namespace limits

// Throws hlm::Error "<what>: '<field>' is <value>, more than the limit of <bound>" for the first
// count above its bound (and for a parameter count above kMaxParameters).
void check_limits(const ModelConfig& c, const std::string& what = "config");

// The same bounds on the raw JSON of a (flat, aliases resolved) text config, before it is parsed:
// the parser sizes its per-layer lists by num_hidden_layers, so a huge value must be refused
// before that (a loop of 10^12 iterations otherwise). Non-numeric values are left to the parser.
void check_raw_limits(const nlohmann::json& text, const std::string& what);

// The parameter elements of HybridModel(c, {.mtp = mtp}) (the MTP block only when mtp and the
// config has one). Needs check_limits(c) to have passed (no overflow is possible then).
int64_t parameter_count(const ModelConfig& c, bool mtp = true);

struct Workload {
  int64_t tokens = 0;            // T of one batch
  int64_t max_seq_len = 0;       // the longest sequence of the batch (0: tokens)
  bool training = false;         // forward + backward with gradients (else a forward pass alone)
  bool optimizer = false;        // AdamW state (moments, FP32 masters) on top of training
  DType dtype = DType::f32;      // parameter dtype
  bool mtp = true;               // the MTP block is built
  bool dense_attention = false;  // DSA layers attend every earlier token (the warm-up stage)
  // Inference that keeps the weights of bf16 GEMMs in bf16 (Module::keep_gemm_weights_in_bf16):
  // the routed experts whose GEMM resolves to bf16 are counted at 2 bytes (the bulk of a MoE
  // model); the other weights at dtype (an over-estimate by their bf16 share).
  bool bf16_gemm_weights = false;
};

struct MemoryEstimate {
  uint64_t parameters = 0;       // the weights
  uint64_t training = 0;         // gradients, AdamW moments and master weights
  uint64_t activations = 0;      // residual streams, logits, attention index / score tables
  uint64_t total() const;        // the sum, saturating at 2^64 - 1
  std::string describe() const;  // "12.0 GiB (weights 4.0 GiB, ...)"
};
MemoryEstimate estimate_memory(const ModelConfig& c, const Workload& w);

// The routed experts' parameters (3 D moe_intermediate_size per expert of every MoE layer, the
// MTP block's when mtp): what expert parallelism shards.
int64_t routed_expert_parameter_count(const ModelConfig& c, bool mtp = true);

// The parameters tensor parallelism splits over its group (layers/tensor_parallel.h): each
// attention layer's per-head projections (KDA: q, k, v, the conv, f_b, g_b, b_proj, A_log,
// dt_bias, o_proj; MLA: q_b_proj or q_proj, kv_b_proj, o_proj) and every dense MLP. The rest is
// whole on every rank of the group: the embedding and head, norms, mHC, the low-rank f_a / g_a,
// o_norm, MLA's latent projections and norms, the indexers and the MoE layers.
int64_t tensor_parallel_split_count(const ModelConfig& c, bool mtp = true);

// Parameters one token runs through: parameter_count less the routed experts a token does not
// use ((n_routed_experts - num_experts_per_tok) experts of every MoE layer) and the embedding rows
// but its own (the vocab_size - 1 other rows of embed_tokens).
int64_t active_parameter_count(const ModelConfig& c, bool mtp = true);

// The decode cache of one sequence (docs/model_config.md, "Inspect"), `eb` bytes per cached
// element (2 for bf16): per KDA layer a fixed part, the recurrent state f32 [HV, K, V] and the
// conv state [W - 1, 2 H K + HV V]; per DSA layer the MLA latent of every token (kv_lora_rank +
// qk_rope_head_dim) and, for a layer with its own indexer, one index_head_dim key per complete
// pool of index_kpool tokens plus, for the incomplete pool, the raw keys and (KPool compress) the
// hidden states its gate reads.
struct CacheEstimate {
  uint64_t eb = 2;
  uint64_t kda_fixed = 0;                        // all KDA layers, bytes per sequence
  uint64_t latent_per_token = 0;                 // all DSA layers' latents, bytes per token
  uint64_t index_layers = 0;                     // DSA layers with their own indexer
  uint64_t pool = 1, key_dim = 0, tail_dim = 0;  // index_kpool, index_head_dim, key + gate input
  uint64_t at(uint64_t seq_len) const;           // the whole cache of a sequence of seq_len tokens
};
CacheEstimate estimate_decode_cache(const ModelConfig& c, uint64_t eb = 2);

// check_limits, then the estimate against the memory limit: hlm::Error "<what> needs at least N
// bytes (...): weights ..., more than the memory limit of M bytes ...".
void check_memory_for(const ModelConfig& c, const Workload& w, const std::string& what);

}  // namespace hlm
