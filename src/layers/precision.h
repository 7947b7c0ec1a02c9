// Precision policy: which GEMM precision each Linear runs, chosen once from the config
// (docs/architecture.md, "Precision is a policy, not a code path per layer"; docs/fp8.md,
// "The precision policy").
//
// GemmKind:
//   native    exact in the tensor dtype (f32 / f64 reference runs, the FP32 router, mHC mappings)
//   bf16      operands rounded to bf16, FP32 accumulation (a bf16 tensor-core GEMM)
//   fp8_block the blockwise FP8 recipe: E4M3 activations in 1x128 tiles, E4M3 weights in 128x128
//             blocks, output gradients in `grad_format` (1x128), FP32 accumulation per 128 K.
//
// PrecisionPolicy::resolve(path, role): the role says which Megatron flag applies; the path is
// checked against quantization_config.modules_to_not_convert. The rules, in order:
//   1. Roles that never run FP8: router and mhc -> native (FP32 weights);
//      lm_head, kda_gate, indexer_weights, mtp -> bf16 (native when the default is native).
//   2. default kind native or bf16: that kind for every other role.
//   3. default fp8_block: bf16 (never FP8) when
//        role kda_proj        and kda_disable_fp8
//        role mla_proj        and mla_proj_disable_quantization
//        role indexer_qk_proj and dsa_indexer_qk_proj_disable_quantization
//        role indexer_kpool   and not dsa_indexer_kpool_use_quantization (off by default)
//        the path matches an entry of modules_to_not_convert (rule: module_matches_pattern)
//      else fp8_block with the policy's grad format and pow2 flag.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "core/formats.h"

namespace hlm {

class JsonReader;  // core/json.h

enum class GemmKind : uint8_t { native, bf16, fp8_block };

struct GemmPrecision {
  GemmKind kind = GemmKind::native;
  Fp8Format grad_format = Fp8Format::e4m3;  // dY of the backward GEMMs (fp8_block only)
  bool pow2_scales = false;                 // power-of-two scale_inv in every quantizer
  bool operator==(const GemmPrecision&) const = default;
};

const char* gemm_kind_name(GemmKind k);             // "native", "bf16", "fp8_block"
std::string precision_str(const GemmPrecision& p);  // "fp8_block(grad e5m2, pow2)"

// What a Linear is, for the policy. Roles name the flag that governs them.
enum class ModuleRole : uint8_t {
  kda_proj,  // KDA q/k/v/o projections                        (kda_disable_fp8)
  kda_gate,  // KDA f_a/f_b/g_a/g_b/b_proj gate projections     (never FP8)
  mla_proj,  // MLA q_a/q_b/kv_a/kv_b/o projections             (mla_proj_disable_quantization)
  indexer_qk_proj,  // DSA indexer wq_b, wk                            (dsa_indexer_qk_proj_...)
  indexer_kpool,    // KPool compress gate W_g                         (dsa_indexer_kpool_use_...)
  indexer_weights,  // DSA indexer weights_proj (head weights)         (never FP8)
  moe_expert,       // routed and shared experts
  dense_mlp,        // dense-layer MLP
  lm_head,          // output head                                     (never FP8)
  router,           // MoE router, FP32                                (never FP8: native)
  mhc,              // mHC mapping projections, FP32                   (never FP8: native)
  mtp,              // MTP eh_proj and other MTP-only projections      (never FP8)
  other,            // anything else: the default kind
};
const char* module_role_name(ModuleRole r);

// HF modules_to_not_convert matching, on dot-separated path components (docs/fp8.md):
// the entry (with a trailing "." or ".*" removed) matches the module path when its components
// appear as a contiguous run of the path's components. So "lm_head" matches "lm_head",
// "model.layers.0" matches "model.layers.0.self_attn.q_proj" (an ancestor), "q_proj" matches
// "model.layers.3.self_attn.q_proj" (a leaf name) and "self_attn" matches every module under any
// self_attn; but "layers.1" does not match "layers.10.mlp" and "attn" does not match "self_attn".
bool module_matches_pattern(const std::string& module_path, const std::string& pattern);

class PrecisionPolicy {
 public:
  GemmKind default_kind = GemmKind::bf16;
  Fp8Format grad_format = Fp8Format::e4m3;  // "hybrid" recipe: e5m2
  bool pow2_scales = false;
  bool kda_disable_fp8 = false;
  bool mla_proj_disable_quantization = false;
  bool dsa_indexer_qk_proj_disable_quantization = false;
  bool dsa_indexer_kpool_use_quantization = false;
  std::vector<std::string> modules_to_not_convert;

  GemmPrecision resolve(const std::string& module_path, ModuleRole role) const;
  bool not_converted(const std::string& module_path) const;  // any modules_to_not_convert match

  // Reads these keys of a config object (all optional; other keys are ignored):
  //   "gemm_precision": "native" | "bf16" | "fp8_block"  (alias "fp8")       -> default_kind
  //   "fp8_format": "e4m3" | "hybrid"  (Megatron --fp8-format; hybrid = E5M2 grads)
  //   "fp8_grad_format": "e4m3" | "e5m2"  (explicit; must agree with fp8_format when both given)
  //   "fp8_pow2_scales": bool
  //   "kda_disable_fp8", "mla_proj_disable_quantization",
  //   "dsa_indexer_qk_proj_disable_quantization", "dsa_indexer_kpool_use_quantization": bool
  //   "quantization_config": {"modules_to_not_convert": [str...] | null,
  //                           "weight_block_size": [128, 128] (other sizes: error),
  //                           "fmt": "e4m3" (other: error), ...}
  // A known key with the wrong type or an unknown value throws hlm::Error naming the key.
  static PrecisionPolicy from_json(const nlohmann::json& config);
  // The same keys through a reader of the enclosing config (they count as read, and messages
  // name the reader's document): ModelConfig::from_json reads them so.
  static PrecisionPolicy read(JsonReader& config);
};

// Parameters that stay FP32 through BF16 casts, the optimizer and checkpoints (Param::keep_fp32),
// by checkpoint name (full or relative); the last dot-separated component decides:
//   KDA   A_log, dt_bias                                         (docs/kda.md, "The layer")
//   mHC   hc_{attn|ffn|head}_{fn|base|scale}                     (docs/mhc_moe.md, "Modules")
//         transformers: {attn|ffn}_hc.{fn|base|scale}
//         Megatron: alpha_pre, alpha_post, alpha_res, and mapping_proj.{weight|bias}
//   KPool index_kpool_compress_ape                               (docs/dsa.md, "KPool")
//   MoE   e_score_correction_bias (Megatron: expert_bias)        (docs/mhc_moe.md, "Modules")
bool is_keep_fp32_name(const std::string& param_name);

}  // namespace hlm
