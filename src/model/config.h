// ModelConfig: the hybrid model's configuration, parsed from an HF config.json
// (docs/model_config.md lists every field, its default and the checks).
//
// Accepted inputs (field names are the HF / checkpoint names of the public configs;
// docs/model_config.md, "What `ModelConfig::from_json` accepts"):
//   - model_type "glm5_next" with a nested "text_config" (model_type "glm5_next_text"); text
//     fields found at the top level are merged into it (a conflicting value is an error);
//   - model_type "glm5_next" without text_config, or "glm5_next_text": flat;
//   - model_type "kimi_linear" (Kimi-Linear): its linear_attn_config (1-based kda_layers /
//     full_attn_layers), num_experts / num_experts_per_token / num_shared_experts /
//     moe_renormalize / num_expert_group spellings; full-attention layers are dense MLA.
// The per-layer structure comes from layer_types, our compact layer_pattern ("KKKD"),
// linear_attn_config's layer lists (0-based for glm5_next, 1-based for kimi_linear), or the
// GLM-5.3-Flash default (layer i is DSA iff i % 4 == 3); when several are given they must agree.
// Fields are read with JsonReader (core/json.h). An unknown field is an hlm::Error naming it (a
// list of known-but-ignored HF fields such as architectures or transformers_version is
// accepted); an inconsistent or mistyped field is an hlm::Error naming the file, the field and
// what was expected. Missing fields take the defaults of the struct members below (the
// GLM-5.3-Flash values), except where docs/model_config.md says otherwise for kimi_linear.
//
// The per-family structs (KdaHparams, MlaHparams, ...) hold the config.json fields; the layers
// have their own configs (KdaConfig, MlaConfig, ...), filled from these by the model.
//
// to_json() writes a flat "glm5_next_text" config.json (sorted keys, every field explicit) that
// from_json() parses back to an equal ModelConfig.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/json.h"  // read_json_file
#include "layers/precision.h"
#include "ops/kda_gate.h"

namespace hlm {

// Token mixer of a decoder layer. Symbols of layer_pattern: 'K', 'D', 'M'.
enum class LayerKind : uint8_t {
  kda,  // Kimi Delta Attention (linear attention)           layer_types "linear_attention"
  dsa,  // DSA: MLA + lightning/KPool indexer + sparse attn   "deepseek_sparse_attention"
  mla,  // dense MLA without an indexer (Kimi-Linear's full attention)  "mla"
};
// Feed-forward of a decoder layer. mlp_layer_types "dense" / "sparse".
enum class MlpKind : uint8_t { dense, moe };
// DSA indexer of a layer (GLM-5 indexer_types): "full" computes its own top-k, "shared" reuses
// the previous full DSA layer's selection.
enum class IndexerKind : uint8_t { full, shared };

char layer_kind_symbol(LayerKind k);       // 'K', 'D', 'M'
const char* layer_kind_name(LayerKind k);  // "kda", "dsa", "mla"

// rope_scaling (YaRN fields as in DeepSeek-V3 / HF). type "" means no scaling.
struct RopeScaling {
  std::string type;  // "", "yarn" or "deepseek_yarn" (same math)
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 0.0;
  bool operator==(const RopeScaling&) const = default;
};

// KDA layers (docs/kda.md, "The layer"). Weights per layer: q/k [H*K, D], v [HV*V, D],
// f_a [r_f, D], f_b [HV*K, r_f], g_a [r_g, D], g_b [HV*V, r_g], b [HV, D], o [D, HV*V], A_log [HV],
// dt_bias [HV*K], conv [2*H*K + HV*V, 1, W], o_norm [V].
struct KdaHparams {
  int64_t num_heads = 64;     // linear_num_heads          H (q/k heads)
  int64_t num_v_heads = 64;   // linear_num_value_heads    HV (GVA: HV % H == 0); default H
  int64_t head_dim = 128;     // linear_head_dim           K
  int64_t v_head_dim = 128;   // linear_value_head_dim     V; default K
  int64_t conv_kernel = 4;    // linear_conv_kernel_dim    W
  int64_t f_lora_rank = 128;  // kda_f_lora_rank     r_f; 0 = full-rank f_proj; default K
  int64_t g_lora_rank = 128;  // kda_gate_lora_rank  r_g; 0 = full-rank g_proj; default K
  // linear_lower_bound (alias gate_lower_bound): the safe lower-bound gate when set (must lie
  // in [-5, 0)); the softplus gate when null.
  std::optional<double> lower_bound = ops::kKdaLowerBound;
  bool use_a_log = true;          // linear_use_a_log: false only with a lower bound
  bool output_gate_bias = false;  // linear_output_gate_bias: g_b_proj has a bias
  // Initialisation (FLA / Mamba2 convention): A ~ U(a_init_min, a_init_max), A_log = ln A;
  // dt ~ exp(U(ln dt_init_min, ln dt_init_max)) floored at dt_init_floor, dt_bias =
  // softplus^-1(dt).
  double a_init_min = 1.0, a_init_max = 16.0;    // linear_A_init_range [min, max]
  double dt_init_min = 1e-3, dt_init_max = 0.1;  // linear_dt_init_range [min, max]
  double dt_init_floor = 1e-4;                   // linear_dt_init_floor
  bool operator==(const KdaHparams&) const = default;
};

// MLA attention (docs/dsa.md, "MLA"), used by DSA and dense MLA layers.
struct MlaHparams {
  int64_t num_heads = 64;          // num_attention_heads
  int64_t num_kv_heads = 64;       // num_key_value_heads (must divide num_heads)
  int64_t q_lora_rank = 1536;      // 0 (HF null): q = W_q h without compression
  int64_t kv_lora_rank = 512;      //
  int64_t qk_nope_head_dim = 256;  //
  int64_t qk_rope_head_dim = 0;    // 0: NoPE (no pe channels)
  int64_t v_head_dim = 256;        //
  bool use_nope = true;            // mla_use_nope: pe channels (if any) are not rotated
  double rope_theta = 10000.0;     //
  RopeScaling rope_scaling;        // rope_scaling (alias rope_parameters)
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  bool applies_rope() const { return qk_rope_head_dim > 0 && !use_nope; }
  // (d_n + d_r)^-1/2, times mscale^2 for YaRN with mscale_all_dim != 0 and factor > 1
  // (mscale = 0.1 mscale_all_dim ln(factor) + 1), only when RoPE is applied (docs/dsa.md, "MLA").
  double softmax_scale() const;
  bool operator==(const MlaHparams&) const = default;
};

// DSA indexer (docs/dsa.md, "The lightning indexer", "KPool"). kpool == 1 is the plain lightning
// indexer, kpool > 1 KPool.
struct IndexerHparams {
  int64_t n_heads = 32;                  // index_n_heads     H_I
  int64_t head_dim = 128;                // index_head_dim    d_I
  int64_t topk = 2048;                   // index_topk        K (tokens); K % P == 0
  int64_t kpool = 4;                     // index_kpool       P
  bool kpool_compress = true;            // index_kpool_compress (required when P > 1)
  bool kpool_always_select_tail = true;  // index_kpool_always_select_tail
  bool rope_interleave = true;           // indexer_rope_interleave
  bool share_for_mtp_iteration = true;   // index_share_for_mtp_iteration
  double loss_coeff = 0.0;               // dsa_indexer_loss_coeff (0: no indexer KL loss)
  bool use_sparse_loss = false;          // dsa_indexer_use_sparse_loss
  bool operator==(const IndexerHparams&) const = default;
};

// MoE (docs/mhc_moe.md, "MoE"). Sigmoid scoring and noaux_tc selection are the only supported
// scoring_func / topk_method.
struct MoeHparams {
  int64_t n_routed_experts = 288;        // alias num_experts; 0: no MoE layers
  int64_t num_experts_per_tok = 8;       // alias num_experts_per_token
  int64_t n_shared_experts = 1;          // alias num_shared_experts
  int64_t moe_intermediate_size = 2048;  // routed and (x n_shared_experts) shared experts
  int64_t n_group = 1;                   // alias num_expert_group
  int64_t topk_group = 1;
  double routed_scaling_factor = 2.5;
  bool norm_topk_prob = true;           // alias moe_renormalize
  double router_aux_loss_coef = 0.001;  // sequence-wise aux loss alpha (0: off)
  double bias_update_rate = 1e-3;       // moe_router_bias_update_rate (aux-free bias, gamma)
  bool operator==(const MoeHparams&) const = default;
};

// mHC (docs/mhc_moe.md, "mHC").
struct MhcHparams {
  bool enabled = true;          // mhc
  int64_t hc_mult = 4;          // n streams when enabled
  int64_t sinkhorn_iters = 20;  // hc_sinkhorn_iters
  double hc_eps = 1e-6;         // hc_eps
  int64_t streams() const { return enabled ? hc_mult : 1; }
  bool operator==(const MhcHparams&) const = default;
};

// MTP (docs/model.md, "MTP"): each depth is a DSA + MoE block (dense MLP without experts).
struct MtpHparams {
  int64_t num_layers = 1;            // num_nextn_predict_layers
  double loss_scaling_factor = 0.1;  // mtp_loss_scaling_factor (lambda)
  bool operator==(const MtpHparams&) const = default;
};

struct ModelConfig {
  int64_t vocab_size = 154880;
  int64_t hidden_size = 4096;
  int64_t num_hidden_layers = 45;
  double rms_norm_eps = 1e-5;
  bool tie_word_embeddings = false;
  double initializer_range = 0.02;
  int64_t max_position_embeddings = 1048576;
  int64_t intermediate_size = 12288;  // dense-layer MLP
  double swiglu_limit = 10.0;         // 0 (HF null): no clamp

  // One entry per decoder layer (size num_hidden_layers). indexer_kinds matters for DSA layers.
  std::vector<LayerKind> layer_kinds;
  std::vector<MlpKind> mlp_kinds;
  std::vector<IndexerKind> indexer_kinds;

  KdaHparams kda;
  MlaHparams mla;
  IndexerHparams indexer;
  MoeHparams moe;
  MhcHparams mhc;
  MtpHparams mtp;

  PrecisionPolicy precision;                     // PrecisionPolicy::from_json keys
  nlohmann::json quantization_config = nullptr;  // as given (written back verbatim)
  // Where precision.default_kind came from: "gemm_precision" when the config names it; else it
  // follows the checkpoint: quantization_config with quant_method fp8 -> fp8_block, "dtype" /
  // "torch_dtype" float32, float64 or float16 -> native, bfloat16 -> bf16; neither -> bf16. Not
  // part of the config's identity (to_json writes gemm_precision, so a saved config pins it).
  std::string precision_source = "default";
  // One line: "GEMMs bf16 (the checkpoint's dtype bfloat16); routers and mHC maps native".
  std::string precision_summary() const;

  std::optional<int64_t> bos_token_id;
  std::optional<int64_t> pad_token_id;
  std::vector<int64_t> eos_token_ids;  // eos_token_id: an int or a list

  // ---- derived ----
  int64_t num_layers() const { return num_hidden_layers; }
  LayerKind layer_kind(int64_t layer) const;
  MlpKind mlp_kind(int64_t layer) const;
  bool is_moe_layer(int64_t layer) const { return mlp_kind(layer) == MlpKind::moe; }
  int64_t count_layers(LayerKind k) const;
  std::string layer_pattern() const;  // "KKKD..."
  // Leading dense layers when mlp_kinds is dense^k moe^(n-k) (the HF first_k_dense_replace
  // form), else -1.
  int64_t first_k_dense_replace() const;
  MlpKind mtp_mlp_kind() const { return moe.n_routed_experts > 0 ? MlpKind::moe : MlpKind::dense; }

  // ---- I/O ----
  // `what` names the source in error messages (e.g. the file path).
  static ModelConfig from_json(const nlohmann::json& config, const std::string& what = "config");
  // A config.json file, or a directory holding one.
  static ModelConfig load(const std::string& path);
  nlohmann::json to_json() const;  // flat glm5_next_text

  // Checks the invariants (from_json calls it); throws hlm::Error naming the field.
  void validate(const std::string& what = "config") const;

  bool operator==(const ModelConfig& o) const;
};

// `--set key=value` overrides, applied to the JSON before ModelConfig::from_json.
//  value: JSON text when it parses as JSON (numbers, true/false, null, "quoted", [lists],
//         {objects}), else the raw text as a string (so kda_disable_fp8=true is a bool,
//         layer_pattern=KKKD a string).
//  key:   a dotted path; intermediate objects are created (a null one is replaced by an
//         object). In a nested glm5_next config, a path that starts with "text_config." goes
//         there; otherwise the path goes into text_config when its first component is present
//         there or absent from the top level, else to the top level.
void apply_override(nlohmann::json& config, const std::string& key, const std::string& value);
// "key=value" strings (split at the first '='), applied in order.
void apply_overrides(nlohmann::json& config, const std::vector<std::string>& key_values);

}  // namespace hlm
