// Precision policy (layers/precision.h): flags, modules_to_not_convert matching, config parsing
// and the keep-in-FP32 names.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "layers/precision.h"

namespace hlm {
namespace {

using nlohmann::json;

PrecisionPolicy fp8_policy() {
  PrecisionPolicy p;
  p.default_kind = GemmKind::fp8_block;
  return p;
}

const ModuleRole kFp8Roles[] = {ModuleRole::kda_proj,        ModuleRole::mla_proj,
                                ModuleRole::indexer_qk_proj, ModuleRole::moe_expert,
                                ModuleRole::dense_mlp,       ModuleRole::other};

TEST(PrecisionPolicy, DefaultKindsAndNeverFp8Roles) {
  PrecisionPolicy p = fp8_policy();
  for (ModuleRole r : kFp8Roles)
    EXPECT_EQ(p.resolve("model.layers.0.x", r).kind, GemmKind::fp8_block) << module_role_name(r);
  EXPECT_EQ(p.resolve("lm_head", ModuleRole::lm_head).kind, GemmKind::bf16);
  EXPECT_EQ(p.resolve("model.layers.0.self_attn.f_a_proj", ModuleRole::kda_gate).kind,
            GemmKind::bf16);
  EXPECT_EQ(p.resolve("x.indexer.weights_proj", ModuleRole::indexer_weights).kind, GemmKind::bf16);
  EXPECT_EQ(p.resolve("model.mtp.0.eh_proj", ModuleRole::mtp).kind, GemmKind::bf16);
  EXPECT_EQ(p.resolve("model.layers.3.mlp.gate", ModuleRole::router).kind, GemmKind::native);
  EXPECT_EQ(p.resolve("model.layers.3.hc_attn", ModuleRole::mhc).kind, GemmKind::native);
  // kpool gate: BF16 unless dsa_indexer_kpool_use_quantization
  EXPECT_EQ(p.resolve("i.index_kpool_compress_gate", ModuleRole::indexer_kpool).kind,
            GemmKind::bf16);

  p.default_kind = GemmKind::bf16;
  for (ModuleRole r : kFp8Roles) EXPECT_EQ(p.resolve("a", r).kind, GemmKind::bf16);
  EXPECT_EQ(p.resolve("a", ModuleRole::router).kind, GemmKind::native);
  p.default_kind = GemmKind::native;
  for (ModuleRole r : kFp8Roles) EXPECT_EQ(p.resolve("a", r).kind, GemmKind::native);
  EXPECT_EQ(p.resolve("lm_head", ModuleRole::lm_head).kind, GemmKind::native);
}

TEST(PrecisionPolicy, GradFormatAndPow2GoToFp8ModulesOnly) {
  PrecisionPolicy p = fp8_policy();
  p.grad_format = Fp8Format::e5m2;
  p.pow2_scales = true;
  const GemmPrecision g = p.resolve("m", ModuleRole::moe_expert);
  EXPECT_EQ(g.kind, GemmKind::fp8_block);
  EXPECT_EQ(g.grad_format, Fp8Format::e5m2);
  EXPECT_TRUE(g.pow2_scales);
  EXPECT_EQ(precision_str(g), "fp8_block(grad e5m2, pow2)");
  EXPECT_EQ(p.resolve("lm_head", ModuleRole::lm_head), GemmPrecision{GemmKind::bf16});
}

TEST(PrecisionPolicy, EachMegatronFlag) {
  struct Case {
    bool PrecisionPolicy::*flag;
    ModuleRole role;
    bool fp8_when_set;
  };
  const Case cases[] = {
      {&PrecisionPolicy::kda_disable_fp8, ModuleRole::kda_proj, false},
      {&PrecisionPolicy::mla_proj_disable_quantization, ModuleRole::mla_proj, false},
      {&PrecisionPolicy::dsa_indexer_qk_proj_disable_quantization, ModuleRole::indexer_qk_proj,
       false},
      {&PrecisionPolicy::dsa_indexer_kpool_use_quantization, ModuleRole::indexer_kpool, true},
  };
  for (const Case& c : cases) {
    PrecisionPolicy p = fp8_policy();
    const GemmKind unset = p.resolve("m", c.role).kind;
    p.*c.flag = true;
    const GemmKind set = p.resolve("m", c.role).kind;
    EXPECT_EQ(set, c.fp8_when_set ? GemmKind::fp8_block : GemmKind::bf16)
        << module_role_name(c.role);
    EXPECT_EQ(unset, c.fp8_when_set ? GemmKind::bf16 : GemmKind::fp8_block)
        << module_role_name(c.role);
    // a flag touches its own role only
    for (ModuleRole r : kFp8Roles)
      if (r != c.role) EXPECT_EQ(p.resolve("m", r).kind, GemmKind::fp8_block);
    // and never turns a BF16 run into FP8
    p.default_kind = GemmKind::bf16;
    EXPECT_EQ(p.resolve("m", c.role).kind, GemmKind::bf16);
  }
}

TEST(PrecisionPolicy, ModulesToNotConvertMatching) {
  struct M {
    const char* path;
    const char* pattern;
    bool match;
  };
  const M cases[] = {
      {"lm_head", "lm_head", true},
      {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.q_proj", true},  // exact
      {"model.layers.0.self_attn.q_proj", "model.layers.0", true},                   // ancestor
      {"model.layers.0.self_attn.q_proj", "model.layers.0.", true},
      {"model.layers.0.self_attn.q_proj", "model.layers.0.*", true},
      {"model.layers.3.self_attn.q_proj", "q_proj", true},              // leaf name
      {"model.layers.3.self_attn.q_proj", "self_attn.q_proj", true},    // suffix path
      {"model.layers.3.self_attn.q_proj", "self_attn", true},           // inner component
      {"model.layers.3.mlp.experts.7.down_proj", "mlp.experts", true},  // inner run
      {"model.layers.10.mlp.down_proj", "model.layers.1", false},       // not "layers.1*"
      {"model.layers.1.mlp.down_proj", "model.layers.1", true},
      {"model.layers.3.self_attn.q_proj", "attn", false},  // not a substring
      {"model.layers.3.self_attn.q_a_proj", "q_proj", false},
      {"model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.q_proj.weight", false},
      {"model.embed_tokens", "model.embed_tokens", true},
      {"model.layers.3.mlp.gate", "mlp.gate_proj", false},
      {"x", "", false},
  };
  for (const M& c : cases)
    EXPECT_EQ(module_matches_pattern(c.path, c.pattern), c.match)
        << "'" << c.pattern << "' vs '" << c.path << "'";

  PrecisionPolicy p = fp8_policy();
  p.modules_to_not_convert = {"model.layers.0.self_attn.q_proj", "lm_head", "mlp.shared_experts"};
  EXPECT_EQ(p.resolve("model.layers.0.self_attn.q_proj", ModuleRole::mla_proj).kind,
            GemmKind::bf16);
  EXPECT_EQ(p.resolve("model.layers.1.self_attn.q_proj", ModuleRole::mla_proj).kind,
            GemmKind::fp8_block);
  EXPECT_EQ(p.resolve("model.layers.5.mlp.shared_experts.up_proj", ModuleRole::moe_expert).kind,
            GemmKind::bf16);
  EXPECT_EQ(p.resolve("model.layers.5.mlp.experts.0.up_proj", ModuleRole::moe_expert).kind,
            GemmKind::fp8_block);
  EXPECT_TRUE(p.not_converted("lm_head"));
  EXPECT_FALSE(p.not_converted("model.layers.0.self_attn.q_b_proj"));
}

TEST(PrecisionPolicy, FromJson) {
  const json cfg = json::parse(R"({
    "hidden_size": 4096,
    "gemm_precision": "fp8_block",
    "fp8_format": "hybrid",
    "fp8_pow2_scales": true,
    "kda_disable_fp8": true,
    "mla_proj_disable_quantization": false,
    "dsa_indexer_qk_proj_disable_quantization": true,
    "dsa_indexer_kpool_use_quantization": true,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128],
                            "modules_to_not_convert": ["model.embed_tokens", "lm_head",
                                                       "model.layers.0.self_attn.q_proj"]}
  })");
  const PrecisionPolicy p = PrecisionPolicy::from_json(cfg);
  EXPECT_EQ(p.default_kind, GemmKind::fp8_block);
  EXPECT_EQ(p.grad_format, Fp8Format::e5m2);
  EXPECT_TRUE(p.pow2_scales);
  EXPECT_TRUE(p.kda_disable_fp8);
  EXPECT_FALSE(p.mla_proj_disable_quantization);
  EXPECT_TRUE(p.dsa_indexer_qk_proj_disable_quantization);
  EXPECT_TRUE(p.dsa_indexer_kpool_use_quantization);
  ASSERT_EQ(p.modules_to_not_convert.size(), 3u);
  EXPECT_EQ(p.resolve("model.layers.0.self_attn.q_proj", ModuleRole::mla_proj).kind,
            GemmKind::bf16);
  EXPECT_EQ(p.resolve("model.layers.2.self_attn.q_proj", ModuleRole::kda_proj).kind,
            GemmKind::bf16);
  EXPECT_EQ(p.resolve("model.layers.3.self_attn.indexer.index_kpool_compress_gate",
                      ModuleRole::indexer_kpool)
                .kind,
            GemmKind::fp8_block);

  // defaults: bf16, e4m3 grads, no flags, empty list; null quantization_config is fine
  const PrecisionPolicy d =
      PrecisionPolicy::from_json(json::parse(R"({"quantization_config": null})"));
  EXPECT_EQ(d.default_kind, GemmKind::bf16);
  EXPECT_EQ(d.grad_format, Fp8Format::e4m3);
  EXPECT_TRUE(d.modules_to_not_convert.empty());
  EXPECT_EQ(PrecisionPolicy::from_json(json::parse(R"({"fp8_grad_format": "e5m2"})")).grad_format,
            Fp8Format::e5m2);
  EXPECT_EQ(PrecisionPolicy::from_json(json::parse(R"({"gemm_precision": "fp8"})")).default_kind,
            GemmKind::fp8_block);
  EXPECT_EQ(PrecisionPolicy::from_json(json::parse(R"({"gemm_precision": "native"})")).default_kind,
            GemmKind::native);
}

TEST(PrecisionPolicy, FromJsonErrorsNameTheKey) {
  const std::pair<const char*, const char*> bad[] = {
      {R"({"gemm_precision": "fp16"})", "gemm_precision"},
      {R"({"gemm_precision": 8})", "gemm_precision"},
      {R"({"fp8_format": "e5m2"})", "fp8_format"},
      {R"({"fp8_grad_format": "e3m4"})", "fp8_grad_format"},
      {R"({"fp8_format": "e4m3", "fp8_grad_format": "e5m2"})", "fp8_grad_format"},
      {R"({"kda_disable_fp8": "yes"})", "kda_disable_fp8"},
      {R"({"mla_proj_disable_quantization": 1})", "mla_proj_disable_quantization"},
      {R"({"dsa_indexer_qk_proj_disable_quantization": null})",
       "dsa_indexer_qk_proj_disable_quantization"},
      {R"({"dsa_indexer_kpool_use_quantization": [true]})", "dsa_indexer_kpool_use_quantization"},
      {R"({"fp8_pow2_scales": "true"})", "fp8_pow2_scales"},
      {R"({"quantization_config": []})", "quantization_config"},
      {R"({"quantization_config": {"modules_to_not_convert": "lm_head"}})",
       "modules_to_not_convert"},
      {R"({"quantization_config": {"modules_to_not_convert": ["lm_head", 3]}})",
       "modules_to_not_convert[1]"},
      {R"({"quantization_config": {"modules_to_not_convert": [""]}})", "modules_to_not_convert[0]"},
      {R"({"quantization_config": {"weight_block_size": [1, 128]}})", "weight_block_size"},
      {R"({"quantization_config": {"fmt": "e5m2"}})", "fmt"},
      {R"({"quantization_config": {"quant_method": "awq"}})", "quant_method"},
      {R"([1, 2])", "JSON object"},
  };
  for (auto [text, key] : bad) {
    try {
      PrecisionPolicy::from_json(json::parse(text));
      ADD_FAILURE() << "accepted " << text;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << text << " -> " << e.what();
    }
  }
}

TEST(PrecisionKeepFp32, Names) {
  for (const char* n : {"A_log",
                        "model.layers.0.self_attn.A_log",
                        "model.layers.0.self_attn.dt_bias",
                        "model.layers.0.hc_attn_fn",
                        "model.layers.0.hc_attn_base",
                        "model.layers.0.hc_attn_scale",
                        "model.layers.44.hc_ffn_fn",
                        "hc_ffn_base",
                        "hc_ffn_scale",
                        "hc_head_fn",
                        "model.layers.3.self_attn.indexer.index_kpool_compress_ape",
                        "model.layers.5.mlp.gate.e_score_correction_bias",
                        "decoder.layers.0.mlp.router.expert_bias",
                        "decoder.layers.0.self_attention_hc.mapping_proj.weight",
                        "x.mapping_proj.bias",
                        "x.alpha_pre",
                        "x.alpha_post",
                        "x.alpha_res",
                        "model.layers.0.attn_hc.fn",
                        "model.layers.0.attn_hc.base",
                        "model.layers.7.ffn_hc.scale"})
    EXPECT_TRUE(is_keep_fp32_name(n)) << n;
  for (const char* n :
       {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.input_layernorm.weight",
        "model.layers.3.self_attn.indexer.index_kpool_compress_gate", "A_log_x", "hc_attn_fnx",
        "hc_attn", "model.layers.5.mlp.gate.weight", "dt_bias.weight.x", "lm_head.weight",
        "model.embed_tokens.weight", "mapping_proj.scale", "model.layers.0.attn_hc.weight",
        "model.layers.0.mlp.fn", "attn_hc_fn"})
    EXPECT_FALSE(is_keep_fp32_name(n)) << n;
}

}  // namespace
}  // namespace hlm
