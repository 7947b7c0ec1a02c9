// ModelConfig (model/config.h): the shipped configs, nested glm5_next and kimi_linear inputs,
// every error class naming its field, the layer configs the model builds from the HF fields,
// to_json round trips and --set overrides.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "core/error.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/hybrid_model.h"

namespace hlm {
namespace {

using nlohmann::json;

std::string src_path(const std::string& rel) {
  return std::string(HLM_SOURCE_DIR) + "/" + rel;
}

// The message of the hlm::Error that parsing `j` throws ("" when it does not throw).
std::string parse_error(const json& j) {
  try {
    ModelConfig::from_json(j, "test.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Parsing `j` throws an hlm::Error whose message contains every one of `needles`.
::testing::AssertionResult fails_naming(const json& j, std::initializer_list<const char*> needles) {
  const std::string msg = parse_error(j);
  if (msg.empty()) return ::testing::AssertionFailure() << "no error for " << j.dump();
  for (const char* n : needles)
    if (msg.find(n) == std::string::npos)
      return ::testing::AssertionFailure() << "message does not name '" << n << "': " << msg;
  return ::testing::AssertionSuccess();
}

json tiny_json() {
  return read_json_file(src_path("configs/tiny.json"));
}

// A nested glm5_next config as the multimodal release lays it out (vision tower and media
// tokens at the top level, the text model under text_config).
json nested_glm5_next() {
  json text = {{"model_type", "glm5_next_text"},
               {"vocab_size", 512},
               {"hidden_size", 128},
               {"num_hidden_layers", 8},
               {"intermediate_size", 256},
               {"moe_intermediate_size", 64},
               {"num_attention_heads", 4},
               {"num_key_value_heads", 4},
               {"q_lora_rank", 64},
               {"kv_lora_rank", 32},
               {"qk_nope_head_dim", 32},
               {"qk_rope_head_dim", 0},
               {"v_head_dim", 32},
               {"n_routed_experts", 16},
               {"num_experts_per_tok", 4},
               {"n_shared_experts", 1},
               {"first_k_dense_replace", 2},
               {"index_n_heads", 4},
               {"index_head_dim", 32},
               {"index_topk", 64},
               {"index_kpool", 4},
               {"linear_attn_config",
                {{"num_heads", 4},
                 {"head_dim", 32},
                 {"short_conv_kernel_size", 4},
                 {"gate_lower_bound", -4.0},
                 {"kda_layers", {0, 1, 2, 4, 5, 6}},
                 {"full_attn_layers", {3, 7}}}},
               {"hc_mult", 4},
               {"hc_sinkhorn_iters", 10},
               {"num_nextn_predict_layers", 1},
               {"eos_token_id", {2, 5}},
               {"pad_token_id", 0}};
  return {{"model_type", "glm5_next"},
          {"architectures", {"Glm5NextForConditionalGeneration"}},
          {"transformers_version", "5.16.1"},
          {"dtype", "bfloat16"},
          {"image_token_id", 154854},
          {"video_token_id", 154855},
          {"vision_config", {{"depth", 24}, {"hidden_size", 1024}}},
          {"quantization_config",
           {{"quant_method", "fp8"},
            {"fmt", "e4m3"},
            {"activation_scheme", "dynamic"},
            {"weight_block_size", {128, 128}},
            {"modules_to_not_convert", {"lm_head", "model.layers.0.self_attn.q_proj"}}}},
          // a legacy top-level copy of a text field, equal to the nested one
          {"num_hidden_layers", 8},
          {"text_config", text}};
}

// Kimi-Linear-48B-A3B as its published config.json has it (1-based layer lists, Kimi spellings;
// docs/model_config.md, "What `ModelConfig::from_json` accepts").
json kimi_linear() {
  return {
      {"model_type", "kimi_linear"},
      {"architectures", {"KimiLinearForCausalLM"}},
      {"auto_map", {{"AutoConfig", "configuration_kimi.KimiLinearConfig"}}},
      {"torch_dtype", "bfloat16"},
      {"transformers_version", "4.56.0"},
      {"vocab_size", 163840},
      {"hidden_size", 2304},
      {"num_hidden_layers", 27},
      {"rms_norm_eps", 1e-5},
      {"hidden_act", "silu"},
      {"tie_word_embeddings", false},
      {"use_cache", true},
      {"bos_token_id", 163584},
      {"eos_token_id", 163585},
      {"pad_token_id", 163839},
      {"linear_attn_config",
       {{"num_heads", 32},
        {"head_dim", 128},
        {"short_conv_kernel_size", 4},
        {"kda_layers", {1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26}},
        {"full_attn_layers", {4, 8, 12, 16, 20, 24, 27}}}},
      {"num_attention_heads", 32},
      {"num_key_value_heads", 32},
      {"q_lora_rank", nullptr},
      {"kv_lora_rank", 512},
      {"qk_nope_head_dim", 128},
      {"qk_rope_head_dim", 64},
      {"v_head_dim", 128},
      {"mla_use_nope", true},
      {"num_experts", 256},
      {"num_experts_per_token", 8},
      {"num_shared_experts", 1},
      {"moe_intermediate_size", 1024},
      {"intermediate_size", 9216},
      {"first_k_dense_replace", 1},
      {"moe_layer_freq", 1},
      {"moe_router_activation_func", "sigmoid"},
      {"moe_renormalize", true},
      {"routed_scaling_factor", 2.446},
      {"use_grouped_topk", true},
      {"num_expert_group", 1},
      {"topk_group", 1}};
}

TEST(ModelConfig, ParsesTinyConfig) {
  const ModelConfig c = ModelConfig::load(src_path("configs/tiny.json"));
  EXPECT_EQ(c.vocab_size, 128);
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.layer_pattern(), "KKKD");
  EXPECT_EQ(c.count_layers(LayerKind::kda), 3);
  EXPECT_EQ(c.mlp_kinds,
            (std::vector<MlpKind>{MlpKind::dense, MlpKind::moe, MlpKind::moe, MlpKind::moe}));
  EXPECT_EQ(c.first_k_dense_replace(), 1);
  EXPECT_EQ(c.kda.num_heads, 2);
  EXPECT_EQ(c.kda.num_v_heads, 2);
  EXPECT_EQ(c.kda.head_dim, 32);
  EXPECT_EQ(c.kda.v_head_dim, 32);
  EXPECT_EQ(c.kda.f_lora_rank, 32);  // default: the head dim
  EXPECT_EQ(c.kda.g_lora_rank, 32);
  EXPECT_EQ(c.kda.lower_bound, std::optional<double>(-5.0));
  EXPECT_EQ(c.mla.num_heads, 2);
  EXPECT_EQ(c.mla.q_lora_rank, 32);
  EXPECT_EQ(c.mla.kv_lora_rank, 32);
  EXPECT_EQ(c.mla.qk_head_dim(), 16);
  EXPECT_FALSE(c.mla.applies_rope());
  EXPECT_DOUBLE_EQ(c.mla.softmax_scale(), 0.25);
  EXPECT_EQ(c.indexer.n_heads, 2);
  EXPECT_EQ(c.indexer.head_dim, 16);
  EXPECT_EQ(c.indexer.topk, 16);
  EXPECT_EQ(c.indexer.kpool, 4);
  EXPECT_TRUE(c.indexer.kpool_always_select_tail);
  EXPECT_EQ(c.moe.n_routed_experts, 8);
  EXPECT_EQ(c.moe.num_experts_per_tok, 2);
  EXPECT_EQ(c.moe.n_shared_experts, 1);
  EXPECT_EQ(c.mhc.streams(), 4);
  EXPECT_EQ(c.mtp.num_layers, 1);
  EXPECT_EQ(c.precision.default_kind, GemmKind::native);
  EXPECT_FALSE(c.bos_token_id.has_value());
  EXPECT_TRUE(c.eos_token_ids.empty());
}

TEST(ModelConfig, ParsesGlm53FlashConfig) {
  const ModelConfig c = ModelConfig::load(src_path("configs/glm5_3_flash.json"));
  EXPECT_EQ(c.vocab_size, 154880);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.num_layers(), 45);
  EXPECT_EQ(c.count_layers(LayerKind::kda), 34);
  EXPECT_EQ(c.count_layers(LayerKind::dsa), 11);
  for (int64_t i = 0; i < 45; ++i)
    EXPECT_EQ(c.layer_kind(i), i % 4 == 3 ? LayerKind::dsa : LayerKind::kda) << i;
  EXPECT_EQ(c.first_k_dense_replace(), 3);
  EXPECT_EQ(c.kda.num_heads, 64);
  EXPECT_EQ(c.kda.head_dim, 128);
  EXPECT_EQ(c.kda.conv_kernel, 4);
  EXPECT_EQ(c.kda.f_lora_rank, 128);
  EXPECT_EQ(c.kda.lower_bound, std::optional<double>(-5.0));
  EXPECT_EQ(c.mla.num_heads, 64);
  EXPECT_EQ(c.mla.q_lora_rank, 1536);
  EXPECT_EQ(c.mla.kv_lora_rank, 512);
  EXPECT_EQ(c.mla.qk_nope_head_dim, 256);
  EXPECT_EQ(c.mla.qk_rope_head_dim, 0);
  EXPECT_EQ(c.mla.v_head_dim, 256);
  EXPECT_DOUBLE_EQ(c.mla.softmax_scale(), 1.0 / 16);  // NoPE: d_n^-1/2 (docs/dsa.md, "MLA")
  EXPECT_EQ(c.indexer.n_heads, 32);
  EXPECT_EQ(c.indexer.head_dim, 128);
  EXPECT_EQ(c.indexer.topk, 2048);
  EXPECT_EQ(c.indexer.kpool, 4);
  EXPECT_TRUE(c.indexer.share_for_mtp_iteration);
  EXPECT_EQ(c.moe.n_routed_experts, 288);
  EXPECT_EQ(c.moe.num_experts_per_tok, 8);
  EXPECT_EQ(c.moe.n_shared_experts, 1);
  EXPECT_EQ(c.moe.moe_intermediate_size, 2048);
  EXPECT_EQ(c.intermediate_size, 12288);
  EXPECT_DOUBLE_EQ(c.moe.routed_scaling_factor, 2.5);
  EXPECT_DOUBLE_EQ(c.swiglu_limit, 10.0);
  EXPECT_EQ(c.mhc.hc_mult, 4);
  EXPECT_EQ(c.mhc.sinkhorn_iters, 20);
  EXPECT_DOUBLE_EQ(c.mhc.hc_eps, 1e-6);
  EXPECT_EQ(c.mtp.num_layers, 1);
  EXPECT_DOUBLE_EQ(c.mtp.loss_scaling_factor, 0.1);
  EXPECT_EQ(c.pad_token_id, std::optional<int64_t>(154820));
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{154820, 154827, 154829}));

  // The documented defaults are the GLM-5.3-Flash values: a config that only names the model
  // type (plus the token ids, which have no default) is the same model.
  json minimal = {{"model_type", "glm5_next_text"},
                  {"pad_token_id", 154820},
                  {"eos_token_id", {154820, 154827, 154829}}};
  EXPECT_EQ(ModelConfig::from_json(minimal), c);
}

TEST(ModelConfig, ParsesNestedGlm5Next) {
  const ModelConfig c = ModelConfig::from_json(nested_glm5_next(), "nested");
  EXPECT_EQ(c.layer_pattern(), "KKKDKKKD");
  EXPECT_EQ(c.mlp_kinds[0], MlpKind::dense);
  EXPECT_EQ(c.mlp_kinds[1], MlpKind::dense);
  EXPECT_EQ(c.mlp_kinds[2], MlpKind::moe);
  EXPECT_EQ(c.kda.num_heads, 4);
  EXPECT_EQ(c.kda.head_dim, 32);
  EXPECT_EQ(c.kda.lower_bound, std::optional<double>(-4.0));
  EXPECT_EQ(c.mhc.sinkhorn_iters, 10);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{2, 5}));
  // The top-level quantization_config reaches the precision policy.
  EXPECT_EQ(c.precision.modules_to_not_convert,
            (std::vector<std::string>{"lm_head", "model.layers.0.self_attn.q_proj"}));
  EXPECT_TRUE(c.precision.not_converted("model.layers.0.self_attn.q_proj"));
  EXPECT_EQ(c.quantization_config.at("activation_scheme"), "dynamic");

  // A flat glm5_next (no text_config) with the same text fields is the same model.
  json flat = nested_glm5_next()["text_config"];
  flat["model_type"] = "glm5_next";
  flat["quantization_config"] = nested_glm5_next()["quantization_config"];
  EXPECT_EQ(ModelConfig::from_json(flat), c);

  // A top-level text field that contradicts text_config is an error naming it.
  json bad = nested_glm5_next();
  bad["num_hidden_layers"] = 9;
  EXPECT_TRUE(fails_naming(bad, {"num_hidden_layers", "text_config"}));
  json bad_type = nested_glm5_next();
  bad_type["text_config"]["model_type"] = "glm5_next_vision";
  EXPECT_TRUE(fails_naming(bad_type, {"text_config.model_type"}));
}

TEST(ModelConfig, ParsesKimiLinear) {
  const ModelConfig c = ModelConfig::from_json(kimi_linear(), "kimi");
  EXPECT_EQ(c.num_layers(), 27);
  // 1-based lists: layer i (0-based) is full attention iff i + 1 is in full_attn_layers; Kimi's
  // full attention is dense MLA (no indexer).
  EXPECT_EQ(c.layer_pattern(), "KKKMKKKMKKKMKKKMKKKMKKKMKKM");
  EXPECT_EQ(c.count_layers(LayerKind::dsa), 0);
  EXPECT_EQ(c.kda.num_heads, 32);
  EXPECT_EQ(c.kda.head_dim, 128);
  EXPECT_FALSE(c.kda.lower_bound.has_value());  // no gate_lower_bound: softplus gate
  EXPECT_EQ(c.mla.q_lora_rank, 0);              // null: no q compression
  EXPECT_EQ(c.mla.qk_rope_head_dim, 64);
  EXPECT_TRUE(c.mla.use_nope);
  EXPECT_FALSE(c.mla.applies_rope());  // pe channels present, not rotated
  EXPECT_DOUBLE_EQ(c.mla.softmax_scale(), 1.0 / std::sqrt(192.0));
  EXPECT_EQ(c.moe.n_routed_experts, 256);   // num_experts
  EXPECT_EQ(c.moe.num_experts_per_tok, 8);  // num_experts_per_token
  EXPECT_EQ(c.moe.n_shared_experts, 1);     // num_shared_experts
  EXPECT_TRUE(c.moe.norm_topk_prob);        // moe_renormalize
  EXPECT_DOUBLE_EQ(c.moe.routed_scaling_factor, 2.446);
  EXPECT_EQ(c.first_k_dense_replace(), 1);
  EXPECT_EQ(c.intermediate_size, 9216);
  EXPECT_FALSE(c.mhc.enabled);
  EXPECT_EQ(c.mhc.streams(), 1);
  EXPECT_EQ(c.mtp.num_layers, 0);
  EXPECT_EQ(c.swiglu_limit, 0.0);
  EXPECT_EQ(c.bos_token_id, std::optional<int64_t>(163584));
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{163585}));

  // 0-based numbers in a Kimi list are rejected (layer 0 does not exist 1-based).
  json zero = kimi_linear();
  zero["linear_attn_config"]["kda_layers"][0] = 0;
  EXPECT_TRUE(fails_naming(zero, {"linear_attn_config.kda_layers[0]", "1-based"}));
  json gap = kimi_linear();
  gap["linear_attn_config"]["full_attn_layers"].erase(6);  // layer 27 in neither list
  EXPECT_TRUE(fails_naming(gap, {"layer 27", "full_attn_layers"}));
  json twice = kimi_linear();
  twice["linear_attn_config"]["full_attn_layers"].push_back(1);
  EXPECT_TRUE(fails_naming(twice, {"layer 1", "twice"}));
  json no_lists = kimi_linear();
  no_lists["linear_attn_config"].erase("kda_layers");
  no_lists["linear_attn_config"].erase("full_attn_layers");
  EXPECT_TRUE(fails_naming(no_lists, {"kda_layers"}));
  // An alias and its canonical spelling must agree.
  json alias = kimi_linear();
  alias["n_routed_experts"] = 128;
  EXPECT_TRUE(fails_naming(alias, {"n_routed_experts", "num_experts"}));
}

TEST(ModelConfig, LayerSourcesMustAgree) {
  json j = tiny_json();
  j["layer_types"] = {"linear_attention", "linear_attention", "linear_attention",
                      "deepseek_sparse_attention"};
  EXPECT_EQ(ModelConfig::from_json(j).layer_pattern(), "KKKD");  // consistent: fine
  j["layer_types"][1] = "dsa";
  EXPECT_TRUE(fails_naming(j, {"layer_types", "layer_pattern", "KDKD", "KKKD"}));
  // full_attention is the family's full-attention layer: DSA for glm5_next.
  json f = tiny_json();
  f.erase("layer_pattern");
  f["layer_types"] = {"kda", "kda", "kda", "full_attention"};
  EXPECT_EQ(ModelConfig::from_json(f).layer_pattern(), "KKKD");
  // Dense MLA layers are expressible ('M' / "mla").
  json m = tiny_json();
  m["layer_pattern"] = "KMKD";
  EXPECT_EQ(ModelConfig::from_json(m).layer_kind(1), LayerKind::mla);
  // Without any layer source, glm5_next layers are DSA iff i % 4 == 3.
  json d = tiny_json();
  d.erase("layer_pattern");
  d["num_hidden_layers"] = 8;
  EXPECT_EQ(ModelConfig::from_json(d).layer_pattern(), "KKKDKKKD");
}

// Megatron-LM's option names carry over: the same model as our own names.
TEST(ModelConfig, MegatronOptionNamesAreAliases) {
  json ours = tiny_json();
  json m = tiny_json();
  for (const char* k :
       {"layer_pattern", "first_k_dense_replace", "num_hidden_layers", "num_nextn_predict_layers",
        "linear_num_heads", "linear_head_dim", "linear_lower_bound", "index_kpool",
        "index_kpool_always_select_tail", "mhc", "hc_mult", "hc_sinkhorn_iters", "gemm_precision"})
    m.erase(k);
  m["hybrid_layer_pattern"] = "K-KE|KEDE/DE";
  m["linear_num_key_heads"] = 2;
  m["linear_key_head_dim"] = 32;
  m["kda_two_stage_gates"] = true;
  m["kda_safe_gate"] = true;  // bound -5 by default
  m["dsa_indexer_kpool"] = 4;
  m["dsa_indexer_kpool_always_select_tail"] = true;
  m["dsa_indexer_rotate_activation"] = true;
  m["dsa_indexer_k_norm_epsilon"] = 1e-6;
  m["dsa_indexer_skip_topk_offset"] = 0;
  m["enable_mhc_connections"] = true;
  m["mhc_num_residual_streams"] = 4;
  m["mhc_sinkhorn_iterations"] = 20;
  m["mhc_learned_output_contract"] = false;
  m["mhc_norm_eps_inside_sqrt"] = true;
  m["mhc_keep_mappings_in_fp32"] = true;
  m["fp8_recipe"] = "blockwise";
  m["fp8"] = "hybrid";
  m["kda_disable_fp8"] = true;
  ours["gemm_precision"] = "fp8_block";
  ours["fp8_format"] = "hybrid";
  ours["kda_disable_fp8"] = true;
  const ModelConfig a = ModelConfig::from_json(ours, "ours"), b = ModelConfig::from_json(m, "m");
  EXPECT_TRUE(a == b) << a.to_json().dump() << "\n" << b.to_json().dump();
  EXPECT_EQ(b.layer_pattern(), "KKKD");
  EXPECT_EQ(b.mtp.num_layers, 1);
  EXPECT_EQ(b.precision.default_kind, GemmKind::fp8_block);
  EXPECT_EQ(b.precision.grad_format, Fp8Format::e5m2);

  // Full-rank gates and the standard gate.
  json full = m;
  full["kda_two_stage_gates"] = false;
  full["kda_safe_gate"] = false;
  const ModelConfig f = ModelConfig::from_json(full, "m");
  EXPECT_EQ(f.kda.f_lora_rank, 0);
  EXPECT_EQ(f.kda.g_lora_rank, 0);
  EXPECT_FALSE(f.kda.lower_bound.has_value());

  auto with = [&](const char* key, json v) {
    json j = m;
    j[key] = v;
    return j;
  };
  EXPECT_TRUE(fails_naming(with("hybrid_layer_pattern", "K-KEKED"), {"pairs", "7 symbols"}));
  EXPECT_TRUE(fails_naming(with("hybrid_layer_pattern", "K-MEKEDE"),
                           {"symbol 'M' at 2 is not an attention symbol"}));
  EXPECT_TRUE(fails_naming(with("hybrid_layer_pattern", "K*KEKEDE"),
                           {"symbol '*' at 1 is not an MLP symbol"}));
  EXPECT_TRUE(fails_naming(with("hybrid_layer_pattern", "K-KEKEDE/KE"),
                           {"MTP layer 0 is 'KE', expected DE"}));
  EXPECT_TRUE(fails_naming(with("num_hidden_layers", 8),
                           {"'num_hidden_layers' (8) disagrees with 'hybrid_layer_pattern'"}));
  EXPECT_TRUE(
      fails_naming(with("layer_types", json::array({"linear_attention", "linear_attention",
                                                    "linear_attention", "linear_attention"})),
                   {"disagree"}));
  EXPECT_TRUE(fails_naming(with("mhc_learned_output_contract", true),
                           {"'mhc_learned_output_contract' is true; only false is implemented"}));
  EXPECT_TRUE(fails_naming(with("fp8_recipe", "tensorwise"), {"'fp8_recipe' is 'tensorwise'"}));
  json two_bounds = with("kda_lower_bound", -3.0);
  two_bounds["linear_lower_bound"] = -5.0;
  EXPECT_TRUE(fails_naming(two_bounds, {"'linear_lower_bound' (-5.0) and its alias "
                                        "'kda_lower_bound' (-3.0) disagree"}));
  json unsafe = with("kda_safe_gate", false);
  unsafe["kda_lower_bound"] = -5.0;
  EXPECT_TRUE(fails_naming(unsafe, {"'kda_safe_gate' is false but a lower bound is given"}));
  json streams = with("mhc_num_residual_streams", 2);
  streams["hc_mult"] = 4;
  EXPECT_TRUE(
      fails_naming(streams, {"'hc_mult' (4) and its alias 'mhc_num_residual_streams' (2)"}));
}

TEST(ModelConfig, ErrorsNameTheField) {
  auto with = [](const char* key, json v) {
    json j = tiny_json();
    j[key] = v;
    return j;
  };
  // unknown fields: every one is named
  EXPECT_TRUE(fails_naming(with("hiden_size", 64), {"unknown key", "hiden_size"}));
  json two = with("foo", 1);
  two["bar"] = 2;
  EXPECT_TRUE(fails_naming(two, {"'foo'", "'bar'"}));
  json lac = tiny_json();
  lac["linear_attn_config"] = {{"num_heads", 2}, {"conv_size", 4}};
  EXPECT_TRUE(fails_naming(lac, {"linear_attn_config.conv_size"}));
  json rope = with("rope_scaling", {{"type", "yarn"}, {"factr", 4}});
  EXPECT_TRUE(fails_naming(rope, {"rope_scaling.factr"}));
  // known-but-ignored HF fields are accepted
  json ok = tiny_json();
  for (const char* k : {"architectures", "torch_dtype", "dtype", "transformers_version", "auto_map",
                        "use_cache", "head_dim"})
    ok[k] = "x";
  ok["attention_bias"] = false;
  ok["attention_dropout"] = 0.0;
  ok["bos_token_id"] = 0;
  EXPECT_NO_THROW(ModelConfig::from_json(ok));

  // inconsistent list lengths and symbols
  json lt = tiny_json();
  lt.erase("layer_pattern");
  lt["layer_types"] = {"kda", "kda", "dsa"};
  EXPECT_TRUE(fails_naming(lt, {"layer_types", "3 entries", "num_hidden_layers is 4"}));
  EXPECT_TRUE(fails_naming(with("layer_pattern", "KKK"), {"layer_pattern", "3 symbols"}));
  EXPECT_TRUE(fails_naming(with("layer_pattern", "KKXD"), {"layer_pattern", "'X'", "layer 2"}));
  json badtype = tiny_json();
  badtype.erase("layer_pattern");
  badtype["layer_types"] = {"kda", "kda", "kda", "sliding_attention"};
  EXPECT_TRUE(fails_naming(badtype, {"layer_types[3]", "sliding_attention"}));
  EXPECT_TRUE(fails_naming(with("mlp_layer_types", {"dense", "sparse"}), {"mlp_layer_types"}));
  EXPECT_TRUE(fails_naming(with("mlp_layer_types", {"dense", "sparse", "dense", "sparse"}),
                           {"mlp_layer_types", "first_k_dense_replace"}));
  EXPECT_TRUE(fails_naming(with("mlp_layer_types", {"dense", "moe", "moe", "mixed"}),
                           {"mlp_layer_types[3]", "mixed"}));
  EXPECT_TRUE(fails_naming(with("indexer_types", {"full"}), {"indexer_types", "1 entries"}));
  json shared = with("indexer_types", {"full", "full", "full", "shared"});
  EXPECT_TRUE(fails_naming(shared, {"indexer_types[3]", "shared"}));
  json sparse_no_experts = with("n_routed_experts", 0);
  sparse_no_experts.erase("first_k_dense_replace");
  sparse_no_experts["mlp_layer_types"] = {"dense", "sparse", "sparse", "sparse"};
  EXPECT_TRUE(fails_naming(sparse_no_experts, {"mlp_layer_types", "n_routed_experts"}));

  // inconsistent values
  EXPECT_TRUE(
      fails_naming(with("num_key_value_heads", 3), {"num_key_value_heads", "num_attention_heads"}));
  EXPECT_TRUE(fails_naming(with("index_topk", 18), {"index_topk", "index_kpool"}));
  EXPECT_TRUE(fails_naming(with("linear_num_value_heads", 3),
                           {"linear_num_value_heads", "linear_num_heads"}));
  EXPECT_TRUE(fails_naming(with("linear_lower_bound", -6.0), {"linear_lower_bound"}));
  EXPECT_TRUE(fails_naming(with("linear_lower_bound", 0.0), {"linear_lower_bound"}));
  EXPECT_TRUE(fails_naming(with("num_experts_per_tok", 9), {"num_experts_per_tok"}));
  EXPECT_TRUE(fails_naming(with("n_group", 3), {"n_group"}));
  EXPECT_TRUE(fails_naming(with("qk_head_dim", 20), {"qk_head_dim"}));
  EXPECT_TRUE(fails_naming(with("eos_token_id", 128), {"eos_token_id", "vocab_size"}));
  EXPECT_TRUE(fails_naming(with("hidden_act", "gelu"), {"hidden_act", "gelu"}));
  EXPECT_TRUE(fails_naming(with("scoring_func", "softmax"), {"scoring_func"}));
  EXPECT_TRUE(fails_naming(with("attention_bias", true), {"attention_bias"}));
  EXPECT_TRUE(fails_naming(with("index_kpool_compress", false), {"index_kpool_compress"}));
  EXPECT_TRUE(fails_naming(with("partial_rotary_factor", 0.5), {"partial_rotary_factor"}));
  EXPECT_TRUE(fails_naming(with("rope_scaling", {{"type", "linear"}}), {"rope_scaling.type"}));
  EXPECT_TRUE(fails_naming(with("index_topk_pattern", "FSFS"), {"index_topk_pattern"}));
  json rp = with("rope_parameters", {{"rope_type", "yarn"}, {"factor", 2.0}, {"rope_theta", 5e4}});
  rp["rope_theta"] = 6e4;
  EXPECT_TRUE(fails_naming(rp, {"rope_theta", "rope_parameters.rope_theta"}));
  rp.erase("rope_theta");
  const ModelConfig rpc = ModelConfig::from_json(rp);  // rope_parameters: the newer HF spelling
  EXPECT_EQ(rpc.mla.rope_theta, 5e4);
  EXPECT_EQ(rpc.mla.rope_scaling.type, "yarn");
  EXPECT_EQ(rpc.mla.rope_scaling.factor, 2.0);
  EXPECT_NO_THROW(ModelConfig::from_json(with("linear_use_a_log", false)));  // has the bound
  json no_alog = with("linear_use_a_log", false);
  no_alog["linear_lower_bound"] = nullptr;
  EXPECT_TRUE(fails_naming(no_alog, {"linear_use_a_log"}));

  // bad types
  EXPECT_TRUE(fails_naming(with("hidden_size", "64"), {"hidden_size", "integer"}));
  EXPECT_TRUE(fails_naming(with("hidden_size", 64.5), {"hidden_size", "integer"}));
  EXPECT_TRUE(fails_naming(with("hidden_size", 0), {"hidden_size"}));
  EXPECT_TRUE(fails_naming(with("tie_word_embeddings", "yes"), {"tie_word_embeddings"}));
  EXPECT_TRUE(fails_naming(with("rms_norm_eps", "1e-5"), {"rms_norm_eps", "number"}));
  EXPECT_TRUE(fails_naming(with("layer_types", "KKKD"), {"layer_types", "list"}));
  EXPECT_TRUE(fails_naming(with("kda_disable_fp8", 1), {"kda_disable_fp8"}));  // precision keys
  EXPECT_TRUE(fails_naming(with("gemm_precision", "fp4"), {"gemm_precision"}));

  // model_type
  json no_type = tiny_json();
  no_type.erase("model_type");
  EXPECT_TRUE(fails_naming(no_type, {"model_type"}));
  EXPECT_TRUE(fails_naming(with("model_type", "llama"), {"model_type", "llama"}));
  EXPECT_THROW(ModelConfig::from_json(json::array()), Error);
  EXPECT_THROW(read_json_file(src_path("configs/does_not_exist.json")), Error);
}

// The HF fields reach the layer configs the model builds (model/hybrid_model.h): each layer
// family's fields, defaults and type errors, read once by ModelConfig::from_json.
TEST(ModelConfig, FillsTheLayerConfigs) {
  auto with = [](json j, const char* key, json v) {
    j[key] = v;
    return j;
  };
  // MLA, GLM-5.3-Flash (NoPE): no rotation, scale d_n^-1/2 = 1/16.
  const ModelConfig glm = ModelConfig::load(src_path("configs/glm5_3_flash.json"));
  const MlaConfig g = dsa_layer_config(glm, DType::f32, 0).mla;
  EXPECT_EQ(g.hidden_size, 4096);
  EXPECT_EQ(g.num_heads, 64);
  EXPECT_EQ(g.q_lora_rank, 1536);
  EXPECT_EQ(g.kv_lora_rank, 512);
  EXPECT_EQ(g.qk_nope_head_dim, 256);
  EXPECT_EQ(g.qk_rope_head_dim, 0);
  EXPECT_EQ(g.v_head_dim, 256);
  EXPECT_EQ(g.rms_norm_eps, 1e-5);
  EXPECT_FALSE(g.rotary());
  EXPECT_FALSE(g.yarn.has_value());
  EXPECT_DOUBLE_EQ(g.softmax_scale_value(), 1.0 / 16);
  // Kimi-Linear: q_lora_rank null -> 0; pe channels present but not rotated.
  const MlaConfig k = dsa_layer_config(ModelConfig::from_json(kimi_linear()), DType::f32, 0).mla;
  EXPECT_EQ(k.q_lora_rank, 0);
  EXPECT_EQ(k.qk_rope_head_dim, 64);
  EXPECT_FALSE(k.rope);
  EXPECT_DOUBLE_EQ(k.softmax_scale_value(), 1.0 / std::sqrt(192.0));
  // DeepSeek-V3-style YaRN on rotated pe channels.
  json ds = tiny_json();
  ds["mla_use_nope"] = false;
  ds["qk_nope_head_dim"] = 128;
  ds["qk_rope_head_dim"] = 64;
  ds["rope_theta"] = 50000.0;
  ds["rope_scaling"] = {{"type", "yarn"},
                        {"factor", 40},
                        {"beta_fast", 32},
                        {"beta_slow", 1},
                        {"mscale", 1.0},
                        {"mscale_all_dim", 1.0},
                        {"original_max_position_embeddings", 4096}};
  const DsaLayerConfig dd = dsa_layer_config(ModelConfig::from_json(ds), DType::f32, 0);
  const MlaConfig& d = dd.mla;
  EXPECT_TRUE(d.rotary());
  EXPECT_EQ(d.rope_theta, 50000.0);
  ASSERT_TRUE(d.yarn.has_value());
  EXPECT_EQ(d.yarn->factor, 40);
  EXPECT_EQ(d.yarn->original_max_position_embeddings, 4096);
  EXPECT_EQ(d.yarn->beta_fast, 32);
  EXPECT_EQ(d.yarn->beta_slow, 1);
  // m = 0.1 ln(40) + 1 squared, times (d_n + d_r)^-1/2.
  EXPECT_NEAR(d.softmax_scale_value() * std::sqrt(192.0), 1.8738, 1e-4);
  EXPECT_EQ(dd.indexer->rope_dim, 64);  // the indexer rotates as the attention does
  EXPECT_EQ(dd.indexer->rope_theta, 50000.0);
  EXPECT_TRUE(
      fails_naming(with(tiny_json(), "mla_use_nope", 1), {"'mla_use_nope'", "true or false"}));
  json bad = ds;
  bad["rope_scaling"]["factor"] = "x";
  EXPECT_TRUE(fails_naming(bad, {"'rope_scaling.factor'", "number", "\"x\""}));
  bad["rope_scaling"]["factor"] = 0.5;
  EXPECT_TRUE(fails_naming(bad, {"rope_scaling.factor", ">= 1"}));

  // Indexer (KPool): P = 4 of top-k 16 tokens, the tail pool always selected: 16 + 3 indices.
  const ModelConfig tiny = ModelConfig::from_json(tiny_json());
  const DsaLayerConfig t = dsa_layer_config(tiny, DType::f32, 0);
  ASSERT_TRUE(t.indexer.has_value());
  EXPECT_EQ(t.indexer->hidden_size, 64);
  EXPECT_EQ(t.indexer->q_lora_rank, 32);
  EXPECT_EQ(t.indexer->n_heads, 2);
  EXPECT_EQ(t.indexer->head_dim, 16);
  EXPECT_EQ(t.indexer->topk, 16);
  EXPECT_EQ(t.indexer->kpool, 4);
  EXPECT_EQ(t.indexer->rope_dim, 0);
  EXPECT_TRUE(t.indexer->rope_interleave);
  EXPECT_TRUE(t.indexer->kpool_always_select_tail);
  EXPECT_EQ(t.indexer->index_width(), 19);
  EXPECT_EQ(
      dsa_layer_config(ModelConfig::from_json(with(tiny_json(), "index_kpool", 1)), DType::f32, 0)
          .indexer->index_width(),
      16);  // the plain lightning indexer
  EXPECT_TRUE(fails_naming(with(tiny_json(), "index_kpool", "4"), {"'index_kpool'", "integer"}));
  EXPECT_TRUE(fails_naming(with(tiny_json(), "index_head_dim", 0), {"'index_head_dim'"}));

  // mHC site: streams, Sinkhorn iterations and eps; its RMSNorm eps is rms_norm_eps.
  const MhcSiteConfig h = mhc_site_config(
      ModelConfig::from_json(with(tiny_json(), "rms_norm_eps", 3e-6)), DType::f32, 0);
  EXPECT_EQ(h.hidden_size, 64);
  EXPECT_EQ(h.hc_mult, 4);
  EXPECT_EQ(h.sinkhorn_iters, 20);
  EXPECT_EQ(h.hc_eps, 1e-6);
  EXPECT_EQ(h.norm_eps, 3e-6);
  EXPECT_EQ(h.init_std, 0.02);
  EXPECT_TRUE(
      fails_naming(with(tiny_json(), "hc_mult", 2.5), {"'hc_mult'", "integer >= 1", "2.5"}));

  // Dense MLP: sizes and the SwiGLU clamp (null: no clamp; Kimi-Linear has none).
  const DenseMlpConfig m = dense_mlp_config(tiny, DType::f32, 0);
  EXPECT_EQ(m.hidden_size, 64);
  EXPECT_EQ(m.intermediate_size, 128);
  EXPECT_EQ(m.swiglu_limit, 10.0);
  EXPECT_EQ(dense_mlp_config(ModelConfig::from_json(with(tiny_json(), "swiglu_limit", nullptr)),
                             DType::f32, 0)
                .swiglu_limit,
            0.0);
  EXPECT_EQ(dense_mlp_config(ModelConfig::from_json(kimi_linear()), DType::f32, 0).swiglu_limit,
            0.0);
  EXPECT_TRUE(fails_naming(with(tiny_json(), "hidden_size", "x"), {"'hidden_size'", "integer"}));

  // MoE: experts, top-k, groups, scaling, aux loss; n_shared_experts defaults to 1.
  json mj = tiny_json();
  mj["n_routed_experts"] = 16;
  mj["num_experts_per_tok"] = 4;
  mj["n_group"] = 4;
  mj["topk_group"] = 2;
  mj.erase("n_shared_experts");
  const MoeConfig e = moe_layer_config(ModelConfig::from_json(mj), DType::f32, 0);
  EXPECT_EQ(e.hidden_size, 64);
  EXPECT_EQ(e.n_experts, 16);
  EXPECT_EQ(e.top_k, 4);
  EXPECT_EQ(e.n_group, 4);
  EXPECT_EQ(e.topk_group, 2);
  EXPECT_EQ(e.moe_intermediate_size, 32);
  EXPECT_EQ(e.n_shared_experts, 1);
  EXPECT_TRUE(e.norm_topk_prob);
  EXPECT_EQ(e.routed_scaling_factor, 2.5);
  EXPECT_EQ(e.swiglu_limit, 10.0);
  EXPECT_EQ(e.aux_loss_coeff, 0.001);
  EXPECT_TRUE(fails_naming(with(mj, "norm_topk_prob", 1), {"'norm_topk_prob'", "true or false"}));
  EXPECT_TRUE(fails_naming(with(mj, "topk_group", 5), {"topk_group", "n_group"}));
}

TEST(ModelConfig, ToJsonRoundTrip) {
  std::vector<ModelConfig> configs = {ModelConfig::load(src_path("configs/tiny.json")),
                                      ModelConfig::load(src_path("configs/glm5_3_flash.json")),
                                      ModelConfig::from_json(nested_glm5_next()),
                                      ModelConfig::from_json(kimi_linear())};
  // A config that sets every non-default option.
  json x = tiny_json();
  x["layer_pattern"] = "KMDD";
  x["indexer_types"] = {"full", "full", "full", "shared"};
  x["first_k_dense_replace"] = 0;
  x["moe_layer_freq"] = 2;
  x["linear_num_heads"] = 2;
  x["linear_num_value_heads"] = 4;
  x["linear_value_head_dim"] = 24;
  x["linear_attn_config"] = {{"use_full_rank_gate", true}};
  x["linear_lower_bound"] = nullptr;
  x["linear_output_gate_bias"] = true;
  x["linear_A_init_range"] = {2.0, 8.0};
  x["q_lora_rank"] = nullptr;
  x["qk_rope_head_dim"] = 8;
  x["mla_use_nope"] = false;
  x["rope_theta"] = 50000.0;
  x["rope_scaling"] = {{"type", "yarn"},
                       {"factor", 40.0},
                       {"original_max_position_embeddings", 4096},
                       {"mscale", 1.0},
                       {"mscale_all_dim", 1.0}};
  x["index_kpool"] = 1;
  x["dsa_indexer_loss_coeff"] = 0.01;
  x["swiglu_limit"] = nullptr;
  x["mhc"] = false;
  x["gemm_precision"] = "fp8_block";
  x["fp8_format"] = "hybrid";
  x["fp8_pow2_scales"] = true;
  x["kda_disable_fp8"] = true;
  x["quantization_config"] = {{"modules_to_not_convert", {"lm_head"}}};
  x["bos_token_id"] = 1;
  x["eos_token_id"] = 2;
  configs.push_back(ModelConfig::from_json(x));
  const ModelConfig& xc = configs.back();
  EXPECT_EQ(xc.kda.f_lora_rank, 0);
  EXPECT_EQ(xc.mlp_kinds,
            (std::vector<MlpKind>{MlpKind::moe, MlpKind::dense, MlpKind::moe, MlpKind::dense}));
  EXPECT_EQ(xc.first_k_dense_replace(), -1);
  EXPECT_TRUE(xc.mla.applies_rope());
  const double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_DOUBLE_EQ(xc.mla.softmax_scale(), m * m / std::sqrt(24.0));
  EXPECT_EQ(xc.precision.grad_format, Fp8Format::e5m2);

  for (const ModelConfig& c : configs) {
    const json j = c.to_json();
    EXPECT_EQ(j.at("model_type"), "glm5_next_text");
    EXPECT_EQ(ModelConfig::from_json(j), c) << j.dump();
    // through text, as config.json is written and read
    EXPECT_EQ(ModelConfig::from_json(json::parse(j.dump(2))), c);
  }
  // operator== sees every part: changing one field makes configs differ.
  const ModelConfig base = configs[0];
  auto differs = [&](auto&& mutate) {
    ModelConfig c = base;
    mutate(c);
    return !(c == base);
  };
  EXPECT_TRUE(differs([](ModelConfig& c) { c.kda.dt_init_floor = 1e-3; }));
  EXPECT_TRUE(differs([](ModelConfig& c) { c.mla.rope_scaling.beta_fast = 8; }));
  EXPECT_TRUE(differs([](ModelConfig& c) { c.indexer.use_sparse_loss = true; }));
  EXPECT_TRUE(differs([](ModelConfig& c) { c.moe.bias_update_rate = 0; }));
  EXPECT_TRUE(differs([](ModelConfig& c) { c.mhc.hc_eps = 1e-5; }));
  EXPECT_TRUE(differs([](ModelConfig& c) { c.mtp.loss_scaling_factor = 0.3; }));
  EXPECT_TRUE(differs([](ModelConfig& c) { c.precision.pow2_scales = true; }));
  EXPECT_TRUE(differs([](ModelConfig& c) { c.indexer_kinds[3] = IndexerKind::shared; }));
  EXPECT_TRUE(differs([](ModelConfig& c) { c.pad_token_id = 3; }));
}

// config.json as checkpoints write it (save_config: to_json().dump(2) and a newline) for
// configs/tiny.json, byte for byte: the text written before the training config held the typed
// ModelConfig. A checkpoint's config.json must not change when the code that reads configs does.
TEST(ModelConfig, CheckpointConfigJsonTextIsStable) {
  const std::string expected = R"json({
  "bos_token_id": null,
  "dsa_indexer_kpool_use_quantization": false,
  "dsa_indexer_loss_coeff": 0.0,
  "dsa_indexer_qk_proj_disable_quantization": false,
  "dsa_indexer_use_sparse_loss": false,
  "eos_token_id": null,
  "first_k_dense_replace": 1,
  "fp8_grad_format": "e4m3",
  "fp8_pow2_scales": false,
  "gemm_precision": "native",
  "hc_eps": 1e-06,
  "hc_mult": 4,
  "hc_sinkhorn_iters": 20,
  "hidden_act": "silu",
  "hidden_size": 64,
  "index_head_dim": 16,
  "index_kpool": 4,
  "index_kpool_always_select_tail": true,
  "index_kpool_compress": true,
  "index_n_heads": 2,
  "index_share_for_mtp_iteration": true,
  "index_topk": 16,
  "indexer_rope_interleave": true,
  "indexer_types": [
    "full",
    "full",
    "full",
    "full"
  ],
  "initializer_range": 0.02,
  "intermediate_size": 128,
  "kda_disable_fp8": false,
  "kda_f_lora_rank": 32,
  "kda_gate_lora_rank": 32,
  "kv_lora_rank": 32,
  "layer_types": [
    "linear_attention",
    "linear_attention",
    "linear_attention",
    "deepseek_sparse_attention"
  ],
  "linear_A_init_range": [
    1.0,
    16.0
  ],
  "linear_conv_kernel_dim": 4,
  "linear_dt_init_floor": 0.0001,
  "linear_dt_init_range": [
    0.001,
    0.1
  ],
  "linear_head_dim": 32,
  "linear_lower_bound": -5.0,
  "linear_num_heads": 2,
  "linear_num_value_heads": 2,
  "linear_output_gate_bias": false,
  "linear_use_a_log": true,
  "linear_value_head_dim": 32,
  "max_position_embeddings": 4096,
  "mhc": true,
  "mla_proj_disable_quantization": false,
  "mla_use_nope": true,
  "mlp_layer_types": [
    "dense",
    "sparse",
    "sparse",
    "sparse"
  ],
  "model_type": "glm5_next_text",
  "moe_intermediate_size": 32,
  "moe_layer_freq": 1,
  "moe_router_bias_update_rate": 0.001,
  "moe_router_dtype": "float32",
  "mtp_loss_scaling_factor": 0.1,
  "n_group": 1,
  "n_routed_experts": 8,
  "n_shared_experts": 1,
  "norm_topk_prob": true,
  "num_attention_heads": 2,
  "num_experts_per_tok": 2,
  "num_hidden_layers": 4,
  "num_key_value_heads": 2,
  "num_nextn_predict_layers": 1,
  "pad_token_id": null,
  "q_lora_rank": 32,
  "qk_head_dim": 16,
  "qk_nope_head_dim": 16,
  "qk_rope_head_dim": 0,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "rope_theta": 10000.0,
  "routed_scaling_factor": 2.5,
  "router_aux_loss_coef": 0.001,
  "scoring_func": "sigmoid",
  "swiglu_limit": 10.0,
  "tie_word_embeddings": false,
  "topk_group": 1,
  "topk_method": "noaux_tc",
  "v_head_dim": 16,
  "vocab_size": 128
}
)json";
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("hlm_config_test_" + std::to_string(::getpid()) + ".json"))
                               .string();
  const ModelConfig c = ModelConfig::load(src_path("configs/tiny.json"));
  checkpoint::save_config(path, c);
  std::stringstream ss;
  ss << std::ifstream(path).rdbuf();
  std::filesystem::remove(path);
  EXPECT_EQ(ss.str(), expected);
  EXPECT_EQ(ModelConfig::from_json(json::parse(expected)), c);  // parse -> write -> parse
}

TEST(ModelConfig, Overrides) {
  json j = tiny_json();
  apply_overrides(j, {"hidden_size=128", "kda_disable_fp8=true", "layer_pattern=KDKD",
                      "rms_norm_eps=1e-6", "q_lora_rank=null", "rope_scaling.type=yarn",
                      "rope_scaling.factor=4", "eos_token_id=[1,2]"});
  EXPECT_EQ(j["hidden_size"], 128);
  EXPECT_EQ(j["kda_disable_fp8"], true);
  EXPECT_EQ(j["layer_pattern"], "KDKD");
  EXPECT_TRUE(j["q_lora_rank"].is_null());
  EXPECT_EQ(j["rope_scaling"]["factor"], 4);
  const ModelConfig c = ModelConfig::from_json(j);
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_TRUE(c.precision.kda_disable_fp8);
  EXPECT_EQ(c.layer_pattern(), "KDKD");
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.mla.q_lora_rank, 0);
  EXPECT_EQ(c.mla.rope_scaling.type, "yarn");
  EXPECT_DOUBLE_EQ(c.mla.rope_scaling.factor, 4.0);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{1, 2}));
  // A quoted value stays a string (and is then a type error for a number field).
  json q = tiny_json();
  apply_override(q, "hidden_size", "\"128\"");
  EXPECT_TRUE(fails_naming(q, {"hidden_size"}));

  // Nested configs: text fields go into text_config, wrapper fields stay on top.
  json n = nested_glm5_next();
  apply_override(n, "hidden_size", "256");
  apply_override(n, "text_config.hc_mult", "2");
  apply_override(n, "quantization_config.modules_to_not_convert", "[\"lm_head\"]");
  apply_override(n, "linear_attn_config.num_heads", "8");
  apply_override(n, "index_topk", "128");
  apply_override(n, "dsa_indexer_loss_coeff", "0.5");  // absent everywhere: into text_config
  EXPECT_EQ(n["text_config"]["hidden_size"], 256);
  EXPECT_FALSE(n.contains("hidden_size"));
  EXPECT_EQ(n["text_config"]["hc_mult"], 2);
  EXPECT_EQ(n["text_config"]["linear_attn_config"]["num_heads"], 8);
  const ModelConfig nc = ModelConfig::from_json(n);
  EXPECT_EQ(nc.hidden_size, 256);
  EXPECT_EQ(nc.mhc.hc_mult, 2);
  EXPECT_EQ(nc.kda.num_heads, 8);
  EXPECT_EQ(nc.indexer.topk, 128);
  EXPECT_EQ(n["text_config"]["dsa_indexer_loss_coeff"], 0.5);
  EXPECT_DOUBLE_EQ(nc.indexer.loss_coeff, 0.5);
  EXPECT_EQ(nc.precision.modules_to_not_convert, (std::vector<std::string>{"lm_head"}));

  // Errors name the key.
  auto override_error = [](json cfg, const std::string& kv) -> std::string {
    try {
      apply_overrides(cfg, {kv});
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(override_error(tiny_json(), "hidden_size.x=1").find("hidden_size"), std::string::npos);
  EXPECT_NE(override_error(tiny_json(), "hidden_size").find("key=value"), std::string::npos);
  EXPECT_NE(override_error(tiny_json(), "=3").find("key=value"), std::string::npos);
  EXPECT_NE(override_error(tiny_json(), "a..b=3").find("a..b"), std::string::npos);
}

}  // namespace
}  // namespace hlm
