// model/config_limits.h: every count of a model config bounded (a config of absurd sizes is
// refused at parsing, before anything is allocated), the exact parameter count from the shapes
// (checked against the model actually built), and the memory estimate.
#include <gtest/gtest.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"
#include "core/memory.h"
#include "model/config.h"
#include "model/config_limits.h"
#include "model/hybrid_model.h"

namespace hlm {
namespace {

using nlohmann::json;

json tiny_json() {
  return read_json_file(std::string(HLM_SOURCE_DIR) + "/configs/tiny.json");
}

std::string parse_error(const json& j) {
  try {
    ModelConfig::from_json(j, "test.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Items 2, 3 and 4 of the hardening list: each value used to crash, hang or allocate gigabytes.
TEST(ModelConfigLimits, AbsurdSizesAreRefusedAtParsingNamingFieldValueAndBound) {
  const struct {
    const char* field;
    json value;
    const char* bound;
  } cases[] = {
      {"hidden_size", json(int64_t(4611686018427387904)), "131072"},
      {"hidden_size", json(int64_t(1000000000)), "131072"},
      {"vocab_size", json(int64_t(1000000000000)), "16777216"},
      {"n_routed_experts", json(int64_t(1000000000)), "4096"},
      {"hc_mult", json(int64_t(1000000)), "64"},
      {"linear_conv_kernel_dim", json(int64_t(1000000)), "64"},
      {"hc_sinkhorn_iters", json(int64_t(1000000000)), "1000"},
      {"index_topk", json(int64_t(1) << 40), "16777216"},
      {"moe_intermediate_size", json(int64_t(1) << 40), "1048576"},
  };
  for (const auto& c : cases) {
    json j = tiny_json();
    j[c.field] = c.value;
    if (std::string(c.field) == "n_routed_experts") j["n_group"] = 1;
    const auto t0 = std::chrono::steady_clock::now();
    const std::string m = parse_error(j);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2)) << c.field;
    EXPECT_NE(m.find(std::string("'") + c.field + "' is " + c.value.dump()), std::string::npos)
        << m;
    EXPECT_NE(m.find(std::string("limit of ") + c.bound), std::string::npos) << m;
  }
  // num_hidden_layers sizes the parser's per-layer lists: refused before they are built (10^12
  // layers was a loop of 10^12 push_backs), in a nested glm5_next config too.
  {
    json j = tiny_json();
    j.erase("layer_pattern");
    j["num_hidden_layers"] = int64_t(1000000000000);
    const auto t0 = std::chrono::steady_clock::now();
    const std::string m = parse_error(j);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
    EXPECT_NE(m.find("'num_hidden_layers' is 1000000000000, more than the limit of 1024"),
              std::string::npos)
        << m;
    json nested = {{"model_type", "glm5_next"}, {"text_config", tiny_json()}};
    nested["text_config"]["num_hidden_layers"] = 1e15;
    nested["text_config"].erase("layer_pattern");
    EXPECT_NE(parse_error(nested).find("more than the limit of 1024"), std::string::npos);
  }
  // The bounds leave the family's real sizes alone.
  const ModelConfig flash =
      ModelConfig::load(std::string(HLM_SOURCE_DIR) + "/configs/glm5_3_flash.json");
  EXPECT_GT(parameter_count(flash), int64_t(1) << 30);
}

// The count from the shapes equals what HybridModel builds, over the config's variants.
TEST(ModelConfigLimits, ParameterCountIsExact) {
  std::vector<std::pair<std::string, json>> variants;
  variants.emplace_back("tiny", tiny_json());
  {
    json j = tiny_json();
    j["mhc"] = false;
    j["tie_word_embeddings"] = true;
    variants.emplace_back("no mHC, tied", j);
  }
  {
    json j = tiny_json();
    j["kda_f_lora_rank"] = 0;
    j["kda_gate_lora_rank"] = 0;
    j["linear_output_gate_bias"] = true;
    j["linear_num_value_heads"] = 4;
    j["linear_value_head_dim"] = 16;
    j["qk_rope_head_dim"] = 8;
    j["index_kpool"] = 1;
    j["n_shared_experts"] = 2;
    j["num_nextn_predict_layers"] = 0;
    j["layer_pattern"] = "KDKD";
    variants.emplace_back("full-rank gates, no MTP", j);
  }
  {
    json j = tiny_json();
    j["layer_pattern"] = "KDDK";
    j["indexer_types"] = {"full", "full", "shared", "full"};
    j["n_routed_experts"] = 0;
    j["first_k_dense_replace"] = 4;
    variants.emplace_back("shared indexer, dense MLPs", j);
  }
  {
    json j = tiny_json();
    j["layer_pattern"] = "KMKM";
    variants.emplace_back("dense MLA layers", j);
  }
  for (auto& [name, j] : variants) {
    SCOPED_TRACE(name);
    ModelConfig c;
    try {
      c = ModelConfig::from_json(j, name);
    } catch (const Error& e) {
      FAIL() << e.what();
    }
    for (bool mtp : {true, false}) {
      HybridModelOptions o;
      o.mtp = mtp;
      HybridModel m(c, o);
      EXPECT_EQ(parameter_count(c, mtp), m.parameter_count()) << "mtp " << mtp;
    }
  }
}

TEST(ModelConfigLimits, MemoryEstimateFromTheShapes) {
  const ModelConfig c = ModelConfig::from_json(tiny_json(), "tiny");
  const uint64_t P = uint64_t(parameter_count(c, true));
  Workload w;
  w.tokens = 1024;
  MemoryEstimate f = estimate_memory(c, w);
  EXPECT_EQ(f.parameters, 4 * P);
  EXPECT_EQ(f.training, 0u);
  w.training = true;
  w.optimizer = true;
  MemoryEstimate t = estimate_memory(c, w);
  EXPECT_EQ(t.training, 12 * P);  // f32 gradients, AdamW m and v
  w.dtype = DType::bf16;
  EXPECT_EQ(estimate_memory(c, w).training, 16 * P);  // + the FP32 masters
  EXPECT_EQ(estimate_memory(c, w).parameters, 2 * P);
  w.dtype = DType::f32;
  {
    // Inference with the bf16 GEMMs' weights in bf16: the routed experts at 2 bytes when their
    // GEMM is bf16 (every MoE layer and the MTP block's), nothing changed under native GEMMs.
    Workload inf;
    inf.tokens = 1024;
    inf.bf16_gemm_weights = true;
    EXPECT_EQ(estimate_memory(c, inf).parameters, 4 * P) << "native GEMMs";
    json jb = tiny_json();
    jb["gemm_precision"] = "bf16";
    const ModelConfig cb = ModelConfig::from_json(jb, "bf16");
    const uint64_t Pb = uint64_t(parameter_count(cb, true));
    const uint64_t experts = uint64_t(routed_expert_parameter_count(cb, true));
    ASSERT_GT(experts, 0u);
    EXPECT_EQ(estimate_memory(cb, inf).parameters, 4 * Pb - 2 * experts);
    inf.mtp = false;
    EXPECT_EQ(estimate_memory(cb, inf).parameters,
              4 * uint64_t(parameter_count(cb, false)) -
                  2 * uint64_t(routed_expert_parameter_count(cb, false)));
  }
  // Activations: the residual streams and logits grow with T; a dense MLA layer's index table
  // with T * L.
  Workload w2 = w;
  w2.tokens = 2048;
  EXPECT_GT(estimate_memory(c, w2).activations, 2 * t.activations - t.activations / 4);
  json jm = tiny_json();
  jm["layer_pattern"] = "KMKM";
  const ModelConfig cm = ModelConfig::from_json(jm, "mla");
  Workload big;
  big.tokens = 100000;
  // [T, T] i32 indices of one dense MLA layer alone: 4e10 bytes.
  EXPECT_GE(estimate_memory(cm, big).activations, uint64_t(4) * 100000 * 100000);
  big.max_seq_len = 1000;
  EXPECT_LT(estimate_memory(cm, big).activations, uint64_t(4) * 100000 * 100000 / 50);
  // Refused with both numbers named.
  Workload huge;
  huge.tokens = int64_t(1) << 40;
  try {
    check_memory_for(c, huge, "forward on x");
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("forward on x needs at least"), std::string::npos) << m;
    EXPECT_NE(m.find(fmt::format("memory limit of {} bytes", memory_limit())), std::string::npos)
        << m;
  }
}

}  // namespace
}  // namespace hlm
