// libFuzzer target: the safetensors reader and the token readers of `hybridlm forward`.
// Any input must parse or raise hlm::Error; a file that parses must survive a serialize / parse
// round trip with the same tensors, and its token reading (input_ids / cu_seqlens, DSA
// selections) must succeed or raise hlm::Error. Anything else (a crash, a sanitizer report,
// another exception, a hang) is a bug. scripts/fuzz.sh runs it.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/error.h"
#include "core/safetensors.h"
#include "model/config.h"
#include "model/token_input.h"

namespace {

const hlm::ModelConfig& model() {
  // Two layers, the second DSA: read_dsa_indices has a layer to fill.
  static const hlm::ModelConfig c = hlm::ModelConfig::from_json(nlohmann::json::parse(R"({
    "model_type": "glm5_next_text", "vocab_size": 24, "hidden_size": 16,
    "num_hidden_layers": 2, "layer_pattern": "KD", "first_k_dense_replace": 1,
    "intermediate_size": 24, "linear_num_heads": 2, "linear_head_dim": 8,
    "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 8, "kv_lora_rank": 8,
    "qk_nope_head_dim": 4, "qk_rope_head_dim": 0, "v_head_dim": 4,
    "index_n_heads": 2, "index_head_dim": 8, "index_topk": 4, "index_kpool": 2,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "hc_mult": 2
  })"));
  return c;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<uint8_t> bytes(data, data + size);
  hlm::safetensors::Contents c;
  try {
    c = hlm::safetensors::parse(bytes, "fuzz");
  } catch (const hlm::Error&) {
    return 0;
  }
  // What parses, serializes and parses back to the same bytes per tensor.
  const hlm::safetensors::Contents again =
      hlm::safetensors::parse(hlm::safetensors::serialize(c.tensors, c.metadata), "round trip");
  if (again.tensors.size() != c.tensors.size()) std::abort();
  for (const auto& [name, t] : c.tensors) {
    const hlm::Tensor& u = again.tensors.at(name);
    if (u.dtype() != t.dtype() || u.shape() != t.shape()) std::abort();
    if (t.nbytes() && std::memcmp(u.raw(), t.raw(), t.nbytes()) != 0) std::abort();
  }
  try {
    const hlm::TokenBatch b = hlm::read_token_batch(c, model().vocab_size, "fuzz");
    if (b.tokens.numel() != b.batch * b.length) std::abort();
    hlm::read_dsa_indices(c, model(), b, "fuzz");
  } catch (const hlm::Error&) {
  }
  // The same contents as a --dsa-indices file for a [T] batch of 5 tokens.
  try {
    hlm::safetensors::Contents ids;
    ids.tensors["input_ids"] = hlm::Tensor::from_vector<int64_t>({5}, {1, 2, 3, 4, 5});
    hlm::read_dsa_indices(c, model(), hlm::read_token_batch(ids, 24, "ids"), "fuzz");
  } catch (const hlm::Error&) {
  }
  return 0;
}
