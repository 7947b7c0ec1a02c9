// Small models for the inference tests: a GLM-5.3-Flash-shaped hybrid (KDA, DSA with KPool, mHC,
// MoE after a dense first layer) and variants of its layer stack.
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/rng.h"
#include "core/tensor.h"
#include "layers/module.h"
#include "model/config.h"
#include "model/hybrid_model.h"
#include "model/model_cache.h"
#include "testing.h"

namespace hlm::infer_test {

inline nlohmann::json base_json() {
  return nlohmann::json::parse(R"({
    "model_type": "glm5_next_text", "vocab_size": 40, "hidden_size": 16,
    "num_hidden_layers": 3, "layer_pattern": "KDK", "first_k_dense_replace": 1,
    "intermediate_size": 24, "swiglu_limit": 10.0, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": false, "initializer_range": 0.3,
    "linear_num_heads": 2, "linear_head_dim": 8, "linear_conv_kernel_dim": 4,
    "linear_lower_bound": -5.0,
    "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 8, "kv_lora_rank": 8,
    "qk_nope_head_dim": 4, "qk_rope_head_dim": 0, "v_head_dim": 4,
    "index_n_heads": 2, "index_head_dim": 8, "index_topk": 6, "index_kpool": 2,
    "index_kpool_always_select_tail": true,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "moe_intermediate_size": 8, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
    "norm_topk_prob": true,
    "mhc": true, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "num_nextn_predict_layers": 0, "gemm_precision": "native"
  })");
}

struct Stack {
  const char* name;
  nlohmann::json patch;
};

inline std::vector<Stack> stacks() {
  return {
      {"kda only", {{"layer_pattern", "KKK"}}},
      {"dsa only, KPool 2 with tail, RoPE",
       {{"layer_pattern", "DDD"}, {"qk_rope_head_dim", 4}, {"mla_use_nope", false}}},
      {"KPool 4 without tail",
       {{"layer_pattern", "DKD"},
        {"index_kpool", 4},
        {"index_topk", 8},
        {"index_kpool_always_select_tail", false}}},
      {"plain indexer, shared indexer, dense MLA",
       {{"layer_pattern", "KDDM"},
        {"num_hidden_layers", 4},
        {"index_kpool", 1},
        {"index_topk", 5},
        {"indexer_types", {"full", "full", "shared", "full"}}}},
      {"no mHC", {{"layer_pattern", "KD"}, {"num_hidden_layers", 2}, {"mhc", false}}},
      {"FP8 pooled scoring, bf16 latents",
       {{"layer_pattern", "DKD"},
        {"dsa_indexer_kpool_use_quantization", true},
        {"gemm_precision", "bf16"}}},
  };
}

inline ModelConfig config_of(const Stack& s) {
  nlohmann::json j = base_json();
  j.merge_patch(s.patch);
  return ModelConfig::from_json(j, s.name);
}

inline std::vector<int64_t> random_tokens(int64_t n, int64_t vocab, Rng& rng) {
  std::vector<int64_t> t(static_cast<size_t>(n));
  for (auto& v : t) v = int64_t(rng.next_u32() % uint32_t(vocab));
  return t;
}

inline Context eval_ctx() {
  Context c;
  c.training = false;
  return c;
}

// Max over rows of ||a_r - b_r|| / ||b_r|| (both [R, V]).
inline double max_row_rel(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_f64_vector(), y = b.to_f64_vector();
  const int64_t R = a.size(0), V = a.size(1);
  double worst = 0;
  for (int64_t r = 0; r < R; ++r) {
    double d = 0, n = 0;
    for (int64_t v = 0; v < V; ++v) {
      const double e = x[size_t(r * V + v)] - y[size_t(r * V + v)];
      d += e * e;
      n += y[size_t(r * V + v)] * y[size_t(r * V + v)];
    }
    worst = std::max(worst, std::sqrt(d / std::max(n, 1e-300)));
  }
  return worst;
}

// Whether every row of a and b (i32 [R, *] positions, -1 = empty) lists the same entries in the
// same order (the dense sets' width is the batch's longest sequence in the full forward).
inline ::testing::AssertionResult same_sets(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_f64_vector(), y = b.to_f64_vector();
  if (a.size(0) != b.size(0)) return ::testing::AssertionFailure() << "row counts differ";
  for (int64_t r = 0; r < a.size(0); ++r) {
    std::vector<double> u, v;
    for (int64_t j = 0; j < a.size(1); ++j)
      if (x[size_t(r * a.size(1) + j)] >= 0) u.push_back(x[size_t(r * a.size(1) + j)]);
    for (int64_t j = 0; j < b.size(1); ++j)
      if (y[size_t(r * b.size(1) + j)] >= 0) v.push_back(y[size_t(r * b.size(1) + j)]);
    if (u != v) return ::testing::AssertionFailure() << "row " << r << " differs";
  }
  return ::testing::AssertionSuccess();
}

// Forward of `tokens` over slot `slot` of the cache: logits of every new token.
inline ModelOutput cached_forward(const HybridModel& m, ModelCache& cache,
                                  const std::vector<std::vector<int64_t>>& seqs,
                                  const std::vector<int64_t>& slots) {
  std::vector<int64_t> flat, lengths;
  for (const auto& s : seqs) {
    flat.insert(flat.end(), s.begin(), s.end());
    lengths.push_back(int64_t(s.size()));
  }
  ModelInputs in;
  in.tokens = Tensor::from_vector({int64_t(flat.size())}, flat);
  in.cu_seqlens = testing::cu_of(lengths);
  in.cache = &cache;
  in.cache_slots = slots;
  return m.forward(eval_ctx(), in);
}

}  // namespace hlm::infer_test
