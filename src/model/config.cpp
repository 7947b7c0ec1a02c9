// ModelConfig (model/config.h): HF config.json parsing, validation, to_json, overrides.
// The field table with defaults and checks is docs/model_config.md.
#include "model/config.h"
#include "model/config_limits.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <set>

#include "core/enum_names.h"
#include "core/error.h"
#include "core/json.h"

namespace hlm {

using json = nlohmann::json;

namespace {

// Indexed by LayerKind.
constexpr auto kLayerKindNames = enum_names<LayerKind::mla>({"kda", "dsa", "mla"});
constexpr auto kLayerKindSymbols = enum_names<LayerKind::mla>({"K", "D", "M"});

}  // namespace

char layer_kind_symbol(LayerKind k) {
  return kLayerKindSymbols.name(k)[0];
}

const char* layer_kind_name(LayerKind k) {
  return kLayerKindNames.name(k);
}

double MlaHparams::softmax_scale() const {
  double s = 1.0 / std::sqrt(double(qk_head_dim()));
  if (applies_rope() && !rope_scaling.type.empty() && rope_scaling.mscale_all_dim != 0.0 &&
      rope_scaling.factor > 1.0) {
    const double m = 0.1 * rope_scaling.mscale_all_dim * std::log(rope_scaling.factor) + 1.0;
    s *= m * m;
  }
  return s;
}

LayerKind ModelConfig::layer_kind(int64_t layer) const {
  HLM_CHECK(layer >= 0 && layer < int64_t(layer_kinds.size()),
            "layer_kind: layer {} outside [0, {})", layer, layer_kinds.size());
  return layer_kinds[size_t(layer)];
}

MlpKind ModelConfig::mlp_kind(int64_t layer) const {
  HLM_CHECK(layer >= 0 && layer < int64_t(mlp_kinds.size()), "mlp_kind: layer {} outside [0, {})",
            layer, mlp_kinds.size());
  return mlp_kinds[size_t(layer)];
}

int64_t ModelConfig::count_layers(LayerKind k) const {
  return int64_t(std::count(layer_kinds.begin(), layer_kinds.end(), k));
}

std::string ModelConfig::layer_pattern() const {
  std::string s;
  for (LayerKind k : layer_kinds) s.push_back(layer_kind_symbol(k));
  return s;
}

int64_t ModelConfig::first_k_dense_replace() const {
  size_t k = 0;
  while (k < mlp_kinds.size() && mlp_kinds[k] == MlpKind::dense) ++k;
  for (size_t i = k; i < mlp_kinds.size(); ++i)
    if (mlp_kinds[i] != MlpKind::moe) return -1;
  return int64_t(k);
}

namespace {

enum class Family { glm5_next, kimi_linear };

// Top-level keys of a nested glm5_next config that describe the multimodal wrapper: ignored.
const std::set<std::string> kWrapperKeys = {"vision_config",
                                            "image_token_id",
                                            "video_token_id",
                                            "image_start_token_id",
                                            "image_end_token_id",
                                            "video_start_token_id",
                                            "video_end_token_id",
                                            "architectures",
                                            "auto_map",
                                            "torch_dtype",
                                            "dtype",
                                            "transformers_version",
                                            "_name_or_path",
                                            "model_type",
                                            "text_config"};

// Known HF fields that do not change the model hybridlm builds: accepted and ignored.
const std::set<std::string> kIgnoredKeys = {
    "architectures", "auto_map", "torch_dtype", "dtype", "transformers_version", "_name_or_path",
    "use_cache", "head_dim", "model_max_length", "vision_config", "image_token_id",
    "video_token_id", "image_start_token_id", "image_end_token_id", "video_start_token_id",
    "video_end_token_id", "use_grouped_topk", "output_attentions", "output_hidden_states",
    "return_dict", "tokenizer_class", "attn_implementation", "experts_implementation",
    "keys_to_ignore_at_inference",
    // written by transformers' save_pretrained
    "output_router_logits", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type"};

// Other spellings of our fields (Kimi-Linear / vLLM / HF aliases) -> the canonical name.
const std::pair<const char*, const char*> kAliases[] = {
    {"num_experts", "n_routed_experts"},
    {"num_experts_per_token", "num_experts_per_tok"},
    {"num_shared_experts", "n_shared_experts"},
    {"moe_renormalize", "norm_topk_prob"},
    {"num_expert_group", "n_group"},
    {"moe_router_activation_func", "scoring_func"},
    {"gate_lower_bound", "linear_lower_bound"},
};

void move_alias(json& text, const std::string& alias, const std::string& canonical,
                const std::string& what) {
  auto it = text.find(alias);
  if (it == text.end()) return;
  auto c = text.find(canonical);
  if (c != text.end()) {
    HLM_CHECK(*c == *it, "{}: '{}' ({}) and its alias '{}' ({}) disagree", what, canonical,
              c->dump(), alias, it->dump());
  } else {
    text[canonical] = *it;
  }
  text.erase(alias);
}

// Megatron-LM's option names (the GLM-5.3-Flash training configs) -> ours. Plain renames go
// through move_alias; the rest are translated or must hold the value hybridlm implements.
const std::pair<const char*, const char*> kMegatronAliases[] = {
    {"kda_lower_bound", "linear_lower_bound"},
    {"linear_num_key_heads", "linear_num_heads"},
    {"linear_key_head_dim", "linear_head_dim"},
    {"dsa_indexer_kpool", "index_kpool"},
    {"dsa_indexer_kpool_always_select_tail", "index_kpool_always_select_tail"},
    {"dsa_indexer_kpool_fp8", "dsa_indexer_kpool_use_quantization"},
    {"dsa_indexer_topk_freq", "index_topk_freq"},
    {"enable_mhc_connections", "mhc"},
    {"mhc_num_residual_streams", "hc_mult"},
    {"mhc_sinkhorn_iterations", "hc_sinkhorn_iters"},
    {"fp8", "fp8_format"},
};

// Sets text[key] = v, or checks that the value already there means the same.
void set_or_agree(json& text, const std::string& key, const json& v, const std::string& from,
                  const std::string& what) {
  auto it = text.find(key);
  if (it == text.end() || it->is_null()) {
    text[key] = v;
    return;
  }
  HLM_CHECK(*it == v, "{}: '{}' ({}) disagrees with '{}' (which means {})", what, key, it->dump(),
            from, v.dump());
}

// hybrid_layer_pattern: one symbol per Megatron layer, a decoder layer being an attention symbol
// (K = KDA, D = DSA) followed by an MLP symbol (- = dense, E = MoE); '|' marks pipeline stages
// (ignored); after '/', the MTP layers, each "DE". Becomes layer_pattern, mlp_layer_types,
// num_hidden_layers and num_nextn_predict_layers (each must agree with a value already given).
void expand_hybrid_layer_pattern(json& text, const std::string& what) {
  auto it = text.find("hybrid_layer_pattern");
  if (it == text.end()) return;
  JsonReader r(text, what);
  const std::string raw = r.to_string(*it, "hybrid_layer_pattern");
  text.erase("hybrid_layer_pattern");
  std::string main, mtp;
  bool after_slash = false;
  for (char ch : raw) {
    if (ch == '|') continue;
    if (ch == '/') {
      HLM_CHECK(!after_slash, "{}: 'hybrid_layer_pattern' '{}' has more than one '/'", what, raw);
      after_slash = true;
      continue;
    }
    (after_slash ? mtp : main).push_back(ch);
  }
  HLM_CHECK(!main.empty() && main.size() % 2 == 0,
            "{}: 'hybrid_layer_pattern' '{}': the main layers must be pairs of an attention symbol "
            "(K or D) and an MLP symbol (- or E), got {} symbols",
            what, raw, main.size());
  std::string kinds;
  json mlp = json::array();
  for (size_t i = 0; i < main.size(); i += 2) {
    const char a = main[i], m = main[i + 1];
    HLM_CHECK(a == 'K' || a == 'D',
              "{}: 'hybrid_layer_pattern' '{}': symbol '{}' at {} is not an attention symbol (K = "
              "KDA, D = DSA)",
              what, raw, a, i);
    HLM_CHECK(m == '-' || m == 'E',
              "{}: 'hybrid_layer_pattern' '{}': symbol '{}' at {} is not an MLP symbol (- = dense, "
              "E = MoE)",
              what, raw, m, i + 1);
    kinds.push_back(a);
    mlp.push_back(m == 'E' ? "sparse" : "dense");
  }
  HLM_CHECK(mtp.size() % 2 == 0, "{}: 'hybrid_layer_pattern' '{}': the MTP part '{}' is not pairs",
            what, raw, mtp);
  for (size_t i = 0; i < mtp.size(); i += 2)
    HLM_CHECK(mtp.compare(i, 2, "DE") == 0,
              "{}: 'hybrid_layer_pattern' '{}': MTP layer {} is '{}', expected DE (DSA + MoE)",
              what, raw, i / 2, mtp.substr(i, 2));
  const std::string from = "hybrid_layer_pattern";
  set_or_agree(text, "num_hidden_layers", json(int64_t(kinds.size())), from, what);
  set_or_agree(text, "layer_pattern", json(kinds), from, what);
  if (auto m = text.find("mlp_layer_types"); m != text.end() && m->is_array())
    for (auto& e : *m)
      if (e == "moe") e = "sparse";  // the same meaning, spelled as here
  set_or_agree(text, "mlp_layer_types", mlp, from, what);
  if (after_slash || !text.contains("num_nextn_predict_layers"))
    set_or_agree(text, "num_nextn_predict_layers", json(int64_t(mtp.size() / 2)), from, what);
}

void expand_megatron_options(json& text, const std::string& what) {
  for (auto& [alias, canonical] : kMegatronAliases) move_alias(text, alias, canonical, what);
  expand_hybrid_layer_pattern(text, what);
  JsonReader r(text, what);
  // Options whose only implemented value is the GLM-5.3-Flash one.
  const std::tuple<const char*, json, const char*> fixed[] = {
      {"mhc_learned_output_contract", false, "the output is the mean of the streams"},
      {"mhc_norm_eps_inside_sqrt", true, "the mapping RMSNorm has eps inside the sqrt"},
      {"mhc_keep_mappings_in_fp32", true, "the mappings are always FP32"},
      {"dsa_indexer_rotate_activation", true,
       "the indexer always rotates q and k (Hadamard) when index_head_dim is a power of two"},
      {"dsa_indexer_k_norm_epsilon", 1e-6, "the indexer's key LayerNorm uses eps 1e-6"},
      {"dsa_indexer_skip_topk_offset", 0, "give indexer_types for shared indexers"},
  };
  for (const auto& [key, want, why] : fixed) {
    auto it = text.find(key);
    if (it == text.end()) continue;
    HLM_CHECK(*it == want, "{}: '{}' is {}; only {} is implemented ({})", what, key, it->dump(),
              want.dump(), why);
    text.erase(key);
  }
  // kda_two_stage_gates: low-rank f_b(f_a(x)) / g_b(g_a(x)) gates (ours by default); false is
  // the full-rank f_proj / g_proj, rank 0 here.
  if (auto it = text.find("kda_two_stage_gates"); it != text.end()) {
    const bool two = r.to_bool(*it, "kda_two_stage_gates");
    text.erase("kda_two_stage_gates");
    for (const char* k : {"kda_f_lora_rank", "kda_gate_lora_rank"}) {
      auto f = text.find(k);
      const bool given = f != text.end() && !f->is_null();
      if (!two) {
        HLM_CHECK(!given || *f == 0, "{}: 'kda_two_stage_gates' is false but '{}' is {}", what, k,
                  f->dump());
        text[k] = 0;
      } else {
        HLM_CHECK(!given || *f != 0, "{}: 'kda_two_stage_gates' is true but '{}' is 0", what, k);
      }
    }
  }
  // kda_safe_gate: the lower-bound gate, bound kda_lower_bound (-5 when not given, FLA's default).
  if (auto it = text.find("kda_safe_gate"); it != text.end()) {
    const bool safe = r.to_bool(*it, "kda_safe_gate");
    text.erase("kda_safe_gate");
    auto b = text.find("linear_lower_bound");
    const bool bound = b != text.end() && !b->is_null();
    HLM_CHECK(safe || !bound,
              "{}: 'kda_safe_gate' is false but a lower bound is given ('linear_lower_bound' / "
              "'kda_lower_bound' {})",
              what, bound ? b->dump() : "");
    if (!bound) text["linear_lower_bound"] = safe ? json(-5.0) : json(nullptr);
  }
  // fp8_recipe: blockwise is the GEMM precision fp8_block.
  if (auto it = text.find("fp8_recipe"); it != text.end()) {
    const std::string recipe = r.to_string(*it, "fp8_recipe");
    HLM_CHECK(recipe == "blockwise",
              "{}: 'fp8_recipe' is '{}'; hybridlm implements the blockwise recipe only", what,
              recipe);
    text.erase("fp8_recipe");
    set_or_agree(text, "gemm_precision", "fp8_block", "fp8_recipe blockwise", what);
  }
}

// The layer lists of linear_attn_config, if given.
struct LinearAttnLists {
  bool present = false;
  json kda_layers, full_attn_layers;
};

// Expand linear_attn_config into the flat linear_* keys (conflicts are errors).
LinearAttnLists expand_linear_attn_config(json& text, const std::string& what) {
  LinearAttnLists lists;
  auto it = text.find("linear_attn_config");
  if (it == text.end()) return lists;
  if (it->is_null()) {
    text.erase("linear_attn_config");
    return lists;
  }
  const json lac = *it;
  text.erase("linear_attn_config");
  JsonReader r(lac, what, "linear_attn_config");
  if (const json* v = r.find("kda_layers")) lists.kda_layers = *v;
  if (const json* v = r.find("full_attn_layers")) lists.full_attn_layers = *v;
  if (r.get_bool("use_full_rank_gate", false)) {
    for (const char* k : {"kda_f_lora_rank", "kda_gate_lora_rank"}) {
      auto f = text.find(k);
      if (f != text.end() && !f->is_null() && *f != 0)
        r.error("use_full_rank_gate", fmt::format("is true but '{}' is {}", k, f->dump()));
      text[k] = 0;
    }
  }
  const std::pair<const char*, const char*> mapped[] = {
      {"num_heads", "linear_num_heads"},
      {"head_dim", "linear_head_dim"},
      {"short_conv_kernel_size", "linear_conv_kernel_dim"},
      {"gate_lower_bound", "linear_lower_bound"},
  };
  for (auto [k, flat] : mapped) {
    const json* v = r.find(k);
    if (!v) continue;
    auto f = text.find(flat);
    if (f != text.end() && *f != *v)
      r.error(k, fmt::format("({}) and '{}' ({}) disagree", v->dump(), flat, f->dump()));
    text[flat] = *v;
  }
  r.check_unknown_keys({},
                       "(expected kda_layers, full_attn_layers, num_heads, head_dim, "
                       "short_conv_kernel_size, gate_lower_bound, use_full_rank_gate)");
  lists.present = !lists.kda_layers.is_null() || !lists.full_attn_layers.is_null();
  if (lists.present) {
    HLM_CHECK(!lists.kda_layers.is_null() && !lists.full_attn_layers.is_null(),
              "{}: linear_attn_config needs both kda_layers and full_attn_layers", what);
  }
  return lists;
}

Family family_of(const std::string& model_type, const std::string& what) {
  if (model_type == "glm5_next" || model_type == "glm5_next_text") return Family::glm5_next;
  if (model_type == "kimi_linear") return Family::kimi_linear;
  HLM_FAIL(
      "{}: model_type '{}' is not supported (expected glm5_next, glm5_next_text or "
      "kimi_linear)",
      what, model_type);
}

std::string kinds_str(const std::vector<LayerKind>& v) {
  std::string s;
  for (LayerKind k : v) s.push_back(layer_kind_symbol(k));
  return s;
}

std::vector<LayerKind> layer_kinds_from_lists(const LinearAttnLists& l, int64_t n, Family fam,
                                              const std::string& what) {
  const int64_t base = fam == Family::kimi_linear ? 1 : 0;
  const LayerKind full = fam == Family::kimi_linear ? LayerKind::mla : LayerKind::dsa;
  std::vector<int> seen(size_t(n), 0);
  std::vector<LayerKind> kinds(size_t(n), LayerKind::kda);
  for (auto [name, list, kind] : {std::tuple{"kda_layers", &l.kda_layers, LayerKind::kda},
                                  std::tuple{"full_attn_layers", &l.full_attn_layers, full}}) {
    HLM_CHECK(list->is_array(), "{}: 'linear_attn_config.{}' must be a list of layer numbers", what,
              name);
    for (size_t i = 0; i < list->size(); ++i) {
      const json& v = (*list)[i];
      HLM_CHECK(v.is_number_integer() && v.get<int64_t>() >= base && v.get<int64_t>() < n + base,
                "{}: 'linear_attn_config.{}[{}]' is {}, expected a {}-based layer number in [{}, "
                "{}]",
                what, name, i, v.dump(), base, base, n - 1 + base);
      const int64_t layer = v.get<int64_t>() - base;
      HLM_CHECK(seen[size_t(layer)] == 0,
                "{}: layer {} appears twice in linear_attn_config.kda_layers / full_attn_layers",
                what, v.get<int64_t>());
      seen[size_t(layer)] = 1;
      kinds[size_t(layer)] = kind;
    }
  }
  for (int64_t i = 0; i < n; ++i)
    HLM_CHECK(seen[size_t(i)],
              "{}: layer {} is in neither linear_attn_config.kda_layers nor "
              "full_attn_layers ({}-based; num_hidden_layers {})",
              what, i + base, base, n);
  return kinds;
}

LayerKind layer_kind_from_string(const std::string& s, Family fam, const std::string& field,
                                 const std::string& what) {
  if (s == "linear_attention" || s == "kda") return LayerKind::kda;
  if (s == "deepseek_sparse_attention" || s == "dsa") return LayerKind::dsa;
  if (s == "mla") return LayerKind::mla;
  if (s == "indexed_attention") return LayerKind::dsa;  // transformers 5.25's name for DSA / MLA
  if (s == "full_attention") return fam == Family::kimi_linear ? LayerKind::mla : LayerKind::dsa;
  HLM_FAIL(
      "{}: '{}' is '{}', expected linear_attention (or kda), indexed_attention, "
      "deepseek_sparse_attention (or dsa), mla, or full_attention",
      what, field, s);
}

// rope_scaling / rope_parameters (YaRN): absent fields keep the RopeScaling defaults; a
// rope_theta inside goes to *theta.
RopeScaling parse_rope(JsonReader& o, std::optional<double>* theta) {
  RopeScaling rs;
  std::string type = o.get_string("type", "");
  const std::string rope_type = o.get_string("rope_type", "");
  if (type.empty()) {
    type = rope_type;
  } else if (!rope_type.empty() && rope_type != type) {
    o.error("type",
            fmt::format("({}) and '{}' ({}) disagree", type, o.path_of("rope_type"), rope_type));
  }
  rs.factor = o.get_double("factor", rs.factor);
  rs.original_max_position_embeddings =
      o.get_int("original_max_position_embeddings", rs.original_max_position_embeddings, {0});
  rs.beta_fast = o.get_double("beta_fast", rs.beta_fast);
  rs.beta_slow = o.get_double("beta_slow", rs.beta_slow);
  rs.mscale = o.get_double("mscale", rs.mscale);
  rs.mscale_all_dim = o.get_double("mscale_all_dim", rs.mscale_all_dim);
  if (const json* v = o.find("rope_theta")) *theta = o.to_double(*v, "rope_theta");
  if (const json* v = o.find("partial_rotary_factor");
      v && o.to_double(*v, "partial_rotary_factor") != 1.0)
    o.error("partial_rotary_factor", fmt::format("is {}, only 1.0 is supported", v->dump()));
  o.check_unknown_keys({},
                       "(expected type / rope_type, factor, original_max_position_embeddings, "
                       "beta_fast, beta_slow, mscale, mscale_all_dim, rope_theta)");
  if (type.empty() || type == "default" || type == "none") return RopeScaling{};
  if (type != "yarn" && type != "deepseek_yarn")
    o.error("type", fmt::format("is '{}', expected default, yarn or deepseek_yarn", type));
  rs.type = type;
  return rs;
}

ModelConfig parse_text(const json& text, Family fam, const LinearAttnLists& lists,
                       const std::string& what) {
  JsonReader r(text, what);
  r.mark("model_type");
  ModelConfig c;
  if (fam == Family::kimi_linear) {  // what Kimi-Linear does not have
    c.mhc.enabled = false;
    c.mtp.num_layers = 0;
    c.swiglu_limit = 0.0;
    c.kda.lower_bound = std::nullopt;
    c.mla.use_nope = false;
  }

  // ---- model ----
  c.vocab_size = r.get_int("vocab_size", c.vocab_size, {1});
  c.hidden_size = r.get_int("hidden_size", c.hidden_size, {1});
  c.num_hidden_layers = r.get_int("num_hidden_layers", c.num_hidden_layers, {1});
  c.rms_norm_eps = r.get_double("rms_norm_eps", c.rms_norm_eps);
  c.tie_word_embeddings = r.get_bool("tie_word_embeddings", c.tie_word_embeddings);
  c.initializer_range = r.get_double("initializer_range", c.initializer_range);
  c.max_position_embeddings = r.get_int("max_position_embeddings", c.max_position_embeddings, {1});
  c.intermediate_size = r.get_int("intermediate_size", c.intermediate_size, {0});
  if (const json* v = r.find("swiglu_limit"))
    c.swiglu_limit = v->is_null() ? 0.0 : r.to_double(*v, "swiglu_limit");
  r.expect_one_of("hidden_act", {"silu"});  // the only activation
  if (r.get_bool("attention_bias", false))
    HLM_FAIL("{}: 'attention_bias' is true; hybridlm's attention projections have no bias", what);
  if (const json* v = r.find_non_null("attention_dropout"))
    HLM_CHECK(r.to_double(*v, "attention_dropout") == 0.0,
              "{}: 'attention_dropout' is {}; hybridlm does not implement dropout (expected 0)",
              what, v->dump());

  // ---- KDA ----
  c.kda.num_heads = r.get_int("linear_num_heads", c.kda.num_heads, {1});
  c.kda.num_v_heads = r.get_int("linear_num_value_heads", c.kda.num_heads, {1});
  c.kda.head_dim = r.get_int("linear_head_dim", c.kda.head_dim, {1});
  c.kda.v_head_dim = r.get_int("linear_value_head_dim", c.kda.head_dim, {1});
  c.kda.conv_kernel = r.get_int("linear_conv_kernel_dim", c.kda.conv_kernel, {1});
  for (auto [key, dst] : {std::pair{"kda_f_lora_rank", &c.kda.f_lora_rank},
                          std::pair{"kda_gate_lora_rank", &c.kda.g_lora_rank}}) {
    const json* v = r.find(key);
    *dst = !v ? c.kda.head_dim : v->is_null() ? 0 : r.to_int(*v, key, {0});
  }
  if (const json* v = r.find("linear_lower_bound"))
    c.kda.lower_bound =
        v->is_null() ? std::nullopt : std::optional<double>(r.to_double(*v, "linear_lower_bound"));
  c.kda.use_a_log = r.get_bool("linear_use_a_log", c.kda.use_a_log);
  c.kda.output_gate_bias = r.get_bool("linear_output_gate_bias", c.kda.output_gate_bias);
  for (auto [key, lo, hi] :
       {std::tuple{"linear_A_init_range", &c.kda.a_init_min, &c.kda.a_init_max},
        std::tuple{"linear_dt_init_range", &c.kda.dt_init_min, &c.kda.dt_init_max}}) {
    const json* v = r.find(key);
    if (!v) continue;
    if (!v->is_array() || v->size() != 2) r.fail(key, "a list [min, max] of two numbers", *v);
    *lo = r.to_double((*v)[0], fmt::format("{}[0]", key));
    *hi = r.to_double((*v)[1], fmt::format("{}[1]", key));
  }
  c.kda.dt_init_floor = r.get_double("linear_dt_init_floor", c.kda.dt_init_floor);

  // ---- MLA ----
  c.mla.num_heads = r.get_int("num_attention_heads", c.mla.num_heads, {1});
  c.mla.num_kv_heads = r.get_int("num_key_value_heads", c.mla.num_heads, {1});
  if (const json* v = r.find("q_lora_rank"))
    c.mla.q_lora_rank = v->is_null() ? 0 : r.to_int(*v, "q_lora_rank", {0});
  c.mla.kv_lora_rank = r.get_int("kv_lora_rank", c.mla.kv_lora_rank, {1});
  c.mla.qk_nope_head_dim = r.get_int("qk_nope_head_dim", c.mla.qk_nope_head_dim, {1});
  c.mla.qk_rope_head_dim = r.get_int("qk_rope_head_dim", c.mla.qk_rope_head_dim, {0});
  c.mla.v_head_dim = r.get_int("v_head_dim", c.mla.v_head_dim, {1});
  if (auto qk = r.opt_int("qk_head_dim", {1}))
    HLM_CHECK(*qk == c.mla.qk_head_dim(),
              "{}: 'qk_head_dim' is {}, expected qk_nope_head_dim + qk_rope_head_dim = {}", what,
              *qk, c.mla.qk_head_dim());
  c.mla.use_nope = r.get_bool("mla_use_nope", c.mla.use_nope);
  if (const json* v = r.find_non_null("partial_rotary_factor"))
    HLM_CHECK(r.to_double(*v, "partial_rotary_factor") == 1.0,
              "{}: 'partial_rotary_factor' is {}, only 1.0 is supported (qk_rope_head_dim sets "
              "the rotated width)",
              what, v->dump());
  std::optional<double> theta_field, theta_params;
  if (const json* v = r.find_non_null("rope_theta")) theta_field = r.to_double(*v, "rope_theta");
  std::optional<RopeScaling> rs_scaling, rs_params;
  if (auto o = r.opt_child("rope_scaling")) rs_scaling = parse_rope(*o, &theta_field);
  if (auto o = r.opt_child("rope_parameters")) rs_params = parse_rope(*o, &theta_params);
  HLM_CHECK(!rs_scaling || !rs_params || *rs_scaling == *rs_params,
            "{}: 'rope_scaling' and 'rope_parameters' disagree", what);
  HLM_CHECK(!theta_field || !theta_params || *theta_field == *theta_params,
            "{}: 'rope_theta' ({}) and 'rope_parameters.rope_theta' ({}) disagree", what,
            theta_field.value_or(0), theta_params.value_or(0));
  c.mla.rope_theta = theta_field ? *theta_field : theta_params.value_or(c.mla.rope_theta);
  c.mla.rope_scaling = rs_scaling ? *rs_scaling : rs_params.value_or(RopeScaling{});

  // ---- indexer ----
  c.indexer.n_heads = r.get_int("index_n_heads", c.indexer.n_heads, {1});
  c.indexer.head_dim = r.get_int("index_head_dim", c.indexer.head_dim, {1});
  c.indexer.topk = r.get_int("index_topk", c.indexer.topk, {1});
  c.indexer.kpool = r.get_int("index_kpool", c.indexer.kpool, {1});
  c.indexer.kpool_compress = r.get_bool("index_kpool_compress", c.indexer.kpool_compress);
  c.indexer.kpool_always_select_tail =
      r.get_bool("index_kpool_always_select_tail", c.indexer.kpool_always_select_tail);
  c.indexer.rope_interleave = r.get_bool("indexer_rope_interleave", c.indexer.rope_interleave);
  c.indexer.share_for_mtp_iteration =
      r.get_bool("index_share_for_mtp_iteration", c.indexer.share_for_mtp_iteration);
  c.indexer.loss_coeff = r.get_double("dsa_indexer_loss_coeff", c.indexer.loss_coeff);
  c.indexer.use_sparse_loss = r.get_bool("dsa_indexer_use_sparse_loss", c.indexer.use_sparse_loss);
  if (!r.get_bool("index_dsa_use_layernorm", true))
    HLM_FAIL("{}: 'index_dsa_use_layernorm' is false; the indexer key LayerNorm is always on",
             what);
  if (auto f = r.opt_int("index_topk_freq", {1}))
    HLM_CHECK(*f == 1,
              "{}: 'index_topk_freq' is {}; derived index sharing is not supported (give "
              "indexer_types instead)",
              what, *f);
  for (const char* k : {"index_topk_pattern", "index_skip_topk_offset"})
    HLM_CHECK(r.find_non_null(k) == nullptr,
              "{}: '{}' is not supported (give indexer_types with full/shared per layer)", what, k);

  // ---- MoE ----
  if (const json* v = r.find("n_routed_experts"))  // null: no experts
    c.moe.n_routed_experts = v->is_null() ? 0 : r.to_int(*v, "n_routed_experts", {0});
  c.moe.num_experts_per_tok = r.get_int("num_experts_per_tok", c.moe.num_experts_per_tok, {1});
  c.moe.n_shared_experts = r.get_int("n_shared_experts", c.moe.n_shared_experts, {0});
  c.moe.moe_intermediate_size =
      r.get_int("moe_intermediate_size", c.moe.moe_intermediate_size, {1});
  c.moe.n_group = r.get_int("n_group", c.moe.n_group, {1});
  c.moe.topk_group = r.get_int("topk_group", c.moe.topk_group, {1});
  c.moe.routed_scaling_factor = r.get_double("routed_scaling_factor", c.moe.routed_scaling_factor);
  c.moe.norm_topk_prob = r.get_bool("norm_topk_prob", c.moe.norm_topk_prob);
  c.moe.router_aux_loss_coef = r.get_double("router_aux_loss_coef", c.moe.router_aux_loss_coef);
  c.moe.bias_update_rate = r.get_double("moe_router_bias_update_rate", c.moe.bias_update_rate);
  // The only router hybridlm implements.
  r.expect_one_of("scoring_func", {"sigmoid"});
  r.expect_one_of("topk_method", {"noaux_tc"});
  r.expect_one_of("moe_router_dtype", {"float32", "fp32"});

  // ---- mHC, MTP ----
  c.mhc.enabled = r.get_bool("mhc", c.mhc.enabled);
  c.mhc.hc_mult = r.get_int("hc_mult", c.mhc.hc_mult, {1});
  c.mhc.sinkhorn_iters = r.get_int("hc_sinkhorn_iters", c.mhc.sinkhorn_iters, {1});
  c.mhc.hc_eps = r.get_double("hc_eps", c.mhc.hc_eps);
  c.mtp.num_layers = r.get_int("num_nextn_predict_layers", c.mtp.num_layers, {0});
  c.mtp.loss_scaling_factor = r.get_double("mtp_loss_scaling_factor", c.mtp.loss_scaling_factor);

  // ---- precision ----
  c.precision = PrecisionPolicy::read(r);
  if (auto it = text.find("quantization_config"); it != text.end() && !it->is_null())
    c.quantization_config = *it;

  // ---- token ids ----
  c.bos_token_id = r.opt_int("bos_token_id", {0});
  c.pad_token_id = r.opt_int("pad_token_id", {0});
  if (const json* v = r.find_non_null("eos_token_id")) {
    if (v->is_array()) {
      for (size_t i = 0; i < v->size(); ++i)
        c.eos_token_ids.push_back(r.to_int((*v)[i], fmt::format("eos_token_id[{}]", i), {0}));
    } else {
      c.eos_token_ids.push_back(r.to_int(*v, "eos_token_id", {0}));
    }
  }

  // ---- per-layer structure ----
  const int64_t n = c.num_hidden_layers;
  struct Source {
    std::string name;
    std::vector<LayerKind> kinds;
  };
  std::vector<Source> sources;
  if (const json* v = r.find_non_null("layer_types")) {
    const auto names = r.to_string_list(*v, "layer_types");
    HLM_CHECK(int64_t(names.size()) == n,
              "{}: 'layer_types' has {} entries but num_hidden_layers is {}", what, names.size(),
              n);
    Source s{"layer_types", {}};
    for (size_t i = 0; i < names.size(); ++i)
      s.kinds.push_back(
          layer_kind_from_string(names[i], fam, fmt::format("layer_types[{}]", i), what));
    sources.push_back(std::move(s));
  }
  if (auto p = r.opt_string("layer_pattern")) {
    HLM_CHECK(int64_t(p->size()) == n,
              "{}: 'layer_pattern' '{}' has {} symbols but num_hidden_layers is {}", what, *p,
              p->size(), n);
    Source s{"layer_pattern", {}};
    for (size_t i = 0; i < p->size(); ++i) {
      const char ch = (*p)[i];
      HLM_CHECK(ch == 'K' || ch == 'D' || ch == 'M',
                "{}: 'layer_pattern' symbol '{}' at layer {} is not K (KDA), D (DSA) or M (MLA)",
                what, ch, i);
      s.kinds.push_back(ch == 'K' ? LayerKind::kda : ch == 'D' ? LayerKind::dsa : LayerKind::mla);
    }
    sources.push_back(std::move(s));
  }
  if (lists.present)
    sources.push_back({"linear_attn_config.kda_layers/full_attn_layers",
                       layer_kinds_from_lists(lists, n, fam, what)});
  for (size_t i = 1; i < sources.size(); ++i)
    HLM_CHECK(sources[i].kinds == sources[0].kinds, "{}: '{}' ({}) and '{}' ({}) disagree", what,
              sources[0].name, kinds_str(sources[0].kinds), sources[i].name,
              kinds_str(sources[i].kinds));
  if (!sources.empty()) {
    c.layer_kinds = sources[0].kinds;
  } else {
    HLM_CHECK(fam != Family::kimi_linear,
              "{}: a kimi_linear config needs linear_attn_config.kda_layers / full_attn_layers "
              "(or layer_types)",
              what);
    for (int64_t i = 0; i < n; ++i)
      c.layer_kinds.push_back(i % 4 == 3 ? LayerKind::dsa : LayerKind::kda);
  }

  // mlp_layer_types, or first_k_dense_replace / moe_layer_freq (DeepSeek rule: MoE iff
  // experts exist, i >= first_k_dense_replace and i % moe_layer_freq == 0).
  const std::optional<int64_t> first_k = r.opt_int("first_k_dense_replace", {0});
  const std::optional<int64_t> freq = r.opt_int("moe_layer_freq", {1});
  std::vector<MlpKind> derived;
  for (int64_t i = 0; i < n; ++i)
    derived.push_back(c.moe.n_routed_experts > 0 && i >= first_k.value_or(3) &&
                              i % freq.value_or(1) == 0
                          ? MlpKind::moe
                          : MlpKind::dense);
  if (const json* v = r.find_non_null("mlp_layer_types")) {
    const auto names = r.to_string_list(*v, "mlp_layer_types");
    HLM_CHECK(int64_t(names.size()) == n,
              "{}: 'mlp_layer_types' has {} entries but num_hidden_layers is {}", what,
              names.size(), n);
    for (size_t i = 0; i < names.size(); ++i) {
      const std::string& s = names[i];
      HLM_CHECK(s == "dense" || s == "sparse" || s == "moe",
                "{}: 'mlp_layer_types[{}]' is '{}', expected dense or sparse (or moe)", what, i, s);
      c.mlp_kinds.push_back(s == "dense" ? MlpKind::dense : MlpKind::moe);
    }
    if (first_k || freq) {
      auto str = [](const std::vector<MlpKind>& m) {
        std::string s;
        for (MlpKind k : m) s.push_back(k == MlpKind::moe ? 'E' : 'd');
        return s;
      };
      HLM_CHECK(c.mlp_kinds == derived,
                "{}: 'mlp_layer_types' ({}) disagrees with first_k_dense_replace {} / "
                "moe_layer_freq {} ({}; d = dense, E = sparse)",
                what, str(c.mlp_kinds), first_k.value_or(3), freq.value_or(1), str(derived));
    }
  } else {
    c.mlp_kinds = derived;
  }

  if (const json* v = r.find_non_null("indexer_types")) {
    const auto names = r.to_string_list(*v, "indexer_types");
    HLM_CHECK(int64_t(names.size()) == n,
              "{}: 'indexer_types' has {} entries but num_hidden_layers is {}", what, names.size(),
              n);
    for (size_t i = 0; i < names.size(); ++i) {
      HLM_CHECK(names[i] == "full" || names[i] == "shared",
                "{}: 'indexer_types[{}]' is '{}', expected full or shared", what, i, names[i]);
      c.indexer_kinds.push_back(names[i] == "full" ? IndexerKind::full : IndexerKind::shared);
    }
  } else {
    c.indexer_kinds.assign(size_t(n), IndexerKind::full);
  }

  r.check_unknown_keys(kIgnoredKeys,
                       "(not a glm5_next / kimi_linear field hybridlm knows; the accepted fields "
                       "are listed in docs/model_config.md)");
  c.validate(what);
  return c;
}

}  // namespace

void ModelConfig::validate(const std::string& what) const {
  auto positive = [&](double v, const char* field) {
    HLM_CHECK(std::isfinite(v) && v > 0, "{}: '{}' is {}, expected a positive number", what, field,
              v);
  };
  auto non_negative = [&](double v, const char* field) {
    HLM_CHECK(std::isfinite(v) && v >= 0, "{}: '{}' is {}, expected a number >= 0", what, field, v);
  };
  auto pos_int = [&](int64_t v, const char* field) {
    HLM_CHECK(v > 0, "{}: '{}' is {}, expected a positive integer", what, field, v);
  };
  pos_int(vocab_size, "vocab_size");
  pos_int(hidden_size, "hidden_size");
  pos_int(num_hidden_layers, "num_hidden_layers");
  pos_int(max_position_embeddings, "max_position_embeddings");
  positive(rms_norm_eps, "rms_norm_eps");
  positive(initializer_range, "initializer_range");
  non_negative(swiglu_limit, "swiglu_limit");
  const size_t n = size_t(num_hidden_layers);
  HLM_CHECK(layer_kinds.size() == n && mlp_kinds.size() == n && indexer_kinds.size() == n,
            "{}: the per-layer lists (layer_types {}, mlp_layer_types {}, indexer_types {}) must "
            "have num_hidden_layers = {} entries",
            what, layer_kinds.size(), mlp_kinds.size(), indexer_kinds.size(), n);
  for (auto [id, field] :
       {std::pair{bos_token_id, "bos_token_id"}, std::pair{pad_token_id, "pad_token_id"}})
    HLM_CHECK(!id || (*id >= 0 && *id < vocab_size), "{}: '{}' {} is outside [0, vocab_size {})",
              what, field, id.value_or(0), vocab_size);
  for (int64_t id : eos_token_ids)
    HLM_CHECK(id >= 0 && id < vocab_size, "{}: 'eos_token_id' {} is outside [0, vocab_size {})",
              what, id, vocab_size);

  const bool any_kda = count_layers(LayerKind::kda) > 0;
  const bool any_attn =
      count_layers(LayerKind::dsa) + count_layers(LayerKind::mla) > 0 || mtp.num_layers > 0;
  const bool any_dsa = count_layers(LayerKind::dsa) > 0 || mtp.num_layers > 0;

  // KDA
  if (any_kda) {
    pos_int(kda.num_heads, "linear_num_heads");
    pos_int(kda.num_v_heads, "linear_num_value_heads");
    pos_int(kda.head_dim, "linear_head_dim");
    pos_int(kda.v_head_dim, "linear_value_head_dim");
    pos_int(kda.conv_kernel, "linear_conv_kernel_dim");
    HLM_CHECK(kda.num_v_heads % kda.num_heads == 0,
              "{}: 'linear_num_value_heads' ({}) must be a multiple of 'linear_num_heads' ({})",
              what, kda.num_v_heads, kda.num_heads);
    HLM_CHECK(kda.f_lora_rank >= 0 && kda.g_lora_rank >= 0,
              "{}: 'kda_f_lora_rank' ({}) and 'kda_gate_lora_rank' ({}) must be >= 0 (0: full "
              "rank)",
              what, kda.f_lora_rank, kda.g_lora_rank);
    if (kda.lower_bound) {
      ops::check_kda_lower_bound(*kda.lower_bound, what.c_str(),
                                 "'linear_lower_bound' (null: the softplus gate)");
    }
    HLM_CHECK(kda.use_a_log || kda.lower_bound,
              "{}: 'linear_use_a_log' is false, which needs the lower-bound gate "
              "('linear_lower_bound' set)",
              what);
    positive(kda.a_init_min, "linear_A_init_range[0]");
    positive(kda.dt_init_min, "linear_dt_init_range[0]");
    positive(kda.dt_init_floor, "linear_dt_init_floor");
    HLM_CHECK(kda.a_init_min <= kda.a_init_max && std::isfinite(kda.a_init_max),
              "{}: 'linear_A_init_range' [{}, {}] must have min <= max", what, kda.a_init_min,
              kda.a_init_max);
    HLM_CHECK(kda.dt_init_min <= kda.dt_init_max && std::isfinite(kda.dt_init_max),
              "{}: 'linear_dt_init_range' [{}, {}] must have min <= max", what, kda.dt_init_min,
              kda.dt_init_max);
  }

  // MLA (DSA, dense MLA and MTP layers)
  if (any_attn) {
    pos_int(mla.num_heads, "num_attention_heads");
    pos_int(mla.num_kv_heads, "num_key_value_heads");
    HLM_CHECK(mla.num_heads % mla.num_kv_heads == 0,
              "{}: 'num_key_value_heads' ({}) must divide 'num_attention_heads' ({})", what,
              mla.num_kv_heads, mla.num_heads);
    HLM_CHECK(mla.q_lora_rank >= 0, "{}: 'q_lora_rank' is {}, expected >= 0 or null", what,
              mla.q_lora_rank);
    pos_int(mla.kv_lora_rank, "kv_lora_rank");
    pos_int(mla.qk_nope_head_dim, "qk_nope_head_dim");
    HLM_CHECK(mla.qk_rope_head_dim >= 0, "{}: 'qk_rope_head_dim' is {}, expected >= 0", what,
              mla.qk_rope_head_dim);
    HLM_CHECK(mla.qk_rope_head_dim % 2 == 0,
              "{}: 'qk_rope_head_dim' is {}, expected an even number (RoPE rotates pairs)", what,
              mla.qk_rope_head_dim);
    pos_int(mla.v_head_dim, "v_head_dim");
    positive(mla.rope_theta, "rope_theta");
    const RopeScaling& rs = mla.rope_scaling;
    HLM_CHECK(rs.type.empty() || rs.type == "yarn" || rs.type == "deepseek_yarn",
              "{}: 'rope_scaling.type' is '{}', expected yarn or deepseek_yarn", what, rs.type);
    if (!rs.type.empty()) {
      HLM_CHECK(std::isfinite(rs.factor) && rs.factor >= 1.0,
                "{}: 'rope_scaling.factor' is {}, expected >= 1", what, rs.factor);
      HLM_CHECK(std::isfinite(rs.beta_fast) && std::isfinite(rs.beta_slow) &&
                    std::isfinite(rs.mscale) && std::isfinite(rs.mscale_all_dim),
                "{}: 'rope_scaling' fields must be finite", what);
    }
  }

  // Indexer
  if (any_dsa) {
    pos_int(indexer.n_heads, "index_n_heads");
    pos_int(indexer.head_dim, "index_head_dim");
    pos_int(indexer.topk, "index_topk");
    pos_int(indexer.kpool, "index_kpool");
    HLM_CHECK(indexer.topk % indexer.kpool == 0,
              "{}: 'index_topk' ({}) must be a multiple of 'index_kpool' ({})", what, indexer.topk,
              indexer.kpool);
    HLM_CHECK(indexer.kpool == 1 || indexer.kpool_compress,
              "{}: 'index_kpool' is {} but 'index_kpool_compress' is false; pooled keys are "
              "always compressed (docs/dsa.md, \"KPool\")",
              what, indexer.kpool);
    non_negative(indexer.loss_coeff, "dsa_indexer_loss_coeff");
  }
  bool seen_full_dsa = false;
  for (size_t i = 0; i < n; ++i) {
    if (layer_kinds[i] != LayerKind::dsa) continue;
    if (indexer_kinds[i] == IndexerKind::full) {
      seen_full_dsa = true;
    } else {
      HLM_CHECK(seen_full_dsa,
                "{}: 'indexer_types[{}]' is shared but no earlier DSA layer has a full indexer",
                what, i);
    }
  }

  // FFN
  const bool any_moe = std::count(mlp_kinds.begin(), mlp_kinds.end(), MlpKind::moe) > 0 ||
                       (mtp.num_layers > 0 && moe.n_routed_experts > 0);
  const bool any_dense = std::count(mlp_kinds.begin(), mlp_kinds.end(), MlpKind::dense) > 0 ||
                         (mtp.num_layers > 0 && moe.n_routed_experts == 0);
  HLM_CHECK(moe.n_routed_experts >= 0, "{}: 'n_routed_experts' is {}, expected >= 0", what,
            moe.n_routed_experts);
  if (any_moe) {
    const int64_t e = moe.n_routed_experts;
    HLM_CHECK(e > 0, "{}: 'mlp_layer_types' has sparse layers but 'n_routed_experts' is 0", what);
    pos_int(moe.moe_intermediate_size, "moe_intermediate_size");
    HLM_CHECK(moe.num_experts_per_tok >= 1 && moe.num_experts_per_tok <= e,
              "{}: 'num_experts_per_tok' is {}, expected 1..n_routed_experts ({})", what,
              moe.num_experts_per_tok, e);
    HLM_CHECK(moe.n_shared_experts >= 0, "{}: 'n_shared_experts' is {}, expected >= 0", what,
              moe.n_shared_experts);
    HLM_CHECK(moe.n_group >= 1 && e % moe.n_group == 0,
              "{}: 'n_group' ({}) must divide 'n_routed_experts' ({})", what, moe.n_group, e);
    HLM_CHECK(moe.topk_group >= 1 && moe.topk_group <= moe.n_group,
              "{}: 'topk_group' is {}, expected 1..n_group ({})", what, moe.topk_group,
              moe.n_group);
    HLM_CHECK(moe.n_group == 1 || e / moe.n_group >= 2,
              "{}: 'n_group' {} leaves groups of one expert (the group score needs >= 2)", what,
              moe.n_group);
    HLM_CHECK(moe.num_experts_per_tok <= moe.topk_group * (e / moe.n_group),
              "{}: 'num_experts_per_tok' ({}) exceeds the experts of topk_group groups ({})", what,
              moe.num_experts_per_tok, moe.topk_group * (e / moe.n_group));
    positive(moe.routed_scaling_factor, "routed_scaling_factor");
    non_negative(moe.router_aux_loss_coef, "router_aux_loss_coef");
    non_negative(moe.bias_update_rate, "moe_router_bias_update_rate");
  }
  if (any_dense) pos_int(intermediate_size, "intermediate_size");

  // mHC, MTP
  pos_int(mhc.hc_mult, "hc_mult");
  pos_int(mhc.sinkhorn_iters, "hc_sinkhorn_iters");
  positive(mhc.hc_eps, "hc_eps");
  HLM_CHECK(mtp.num_layers >= 0, "{}: 'num_nextn_predict_layers' is {}, expected >= 0", what,
            mtp.num_layers);
  non_negative(mtp.loss_scaling_factor, "mtp_loss_scaling_factor");
  // Upper bounds of every count (model/config_limits.h).
  check_limits(*this, what);
}

// Without "gemm_precision" the GEMMs follow the checkpoint (ModelConfig::precision_source).
static void resolve_default_precision(ModelConfig& c, const json& text, const json& top,
                                      const std::string& what) {
  if (text.contains("gemm_precision")) {
    c.precision_source = "gemm_precision as given";
    return;
  }
  if (c.quantization_config.is_object()) {  // the parser accepts quant_method fp8 only
    c.precision.default_kind = GemmKind::fp8_block;
    c.precision_source = "the checkpoint's quantization_config: fp8";
    return;
  }
  for (const json* o : {&text, &top})
    for (const char* key : {"dtype", "torch_dtype"}) {
      auto it = o->find(key);
      if (it == o->end() || it->is_null()) continue;
      HLM_CHECK(it->is_string(), "{}: '{}' must be a string such as \"bfloat16\", got {}", what,
                key, it->dump());
      const std::string d = it->get<std::string>();
      if (d == "float32" || d == "float64" || d == "float16")
        c.precision.default_kind = GemmKind::native;
      else if (d == "bfloat16")
        c.precision.default_kind = GemmKind::bf16;
      else
        HLM_FAIL(
            "{}: '{}' is '{}', expected float32, bfloat16, float16 or float64 (or name the GEMM "
            "precision with gemm_precision)",
            what, key, d);
      c.precision_source = fmt::format("the checkpoint's {} {}", key, d);
      return;
    }
  c.precision_source = "the default: the config names neither gemm_precision nor dtype";
}

std::string ModelConfig::precision_summary() const {
  const PrecisionPolicy& p = precision;
  std::string s = fmt::format("GEMMs {} ({})", gemm_kind_name(p.default_kind), precision_source);
  if (p.default_kind == GemmKind::fp8_block) {
    s += fmt::format("; FP8 grads {}{}", p.grad_format == Fp8Format::e5m2 ? "e5m2" : "e4m3",
                     p.pow2_scales ? ", pow2 scales" : "");
    s += fmt::format(
        "; kda_disable_fp8 {}, mla_proj_disable_quantization {}, "
        "dsa_indexer_qk_proj_disable_quantization {}, dsa_indexer_kpool_use_quantization {}",
        p.kda_disable_fp8, p.mla_proj_disable_quantization,
        p.dsa_indexer_qk_proj_disable_quantization, p.dsa_indexer_kpool_use_quantization);
    if (!p.modules_to_not_convert.empty())
      s += fmt::format("; {} module pattern(s) not converted", p.modules_to_not_convert.size());
  }
  s += "; routers and mHC maps native";
  return s;
}

ModelConfig ModelConfig::from_json(const json& config, const std::string& what) {
  JsonReader top(config, what);
  const json* mt = top.find("model_type");
  if (!mt)
    top.error("model_type", "is missing (expected glm5_next, glm5_next_text or kimi_linear)");
  const std::string model_type = top.to_string(*mt, "model_type");
  const Family fam = family_of(model_type, what);

  json text;
  if (top.has("text_config") && !config.at("text_config").is_null()) {
    HLM_CHECK(model_type == "glm5_next",
              "{}: 'text_config' is only expected in a glm5_next config (model_type is {})", what,
              model_type);
    text = top.child("text_config").object();
    JsonReader(text, what, "text_config").expect_one_of("model_type", {"glm5_next_text"});
    // Text fields at the top level (e.g. quantization_config, a legacy layer_types copy) join
    // text_config; a value that contradicts text_config is an error.
    for (auto it = config.begin(); it != config.end(); ++it) {
      if (kWrapperKeys.count(it.key())) continue;
      auto t = text.find(it.key());
      if (t == text.end()) {
        text[it.key()] = it.value();
      } else {
        HLM_CHECK(*t == it.value(), "{}: top-level '{}' ({}) and 'text_config.{}' ({}) disagree",
                  what, it.key(), it.value().dump(), it.key(), t->dump());
      }
    }
  } else {
    text = config;
    text.erase("text_config");
  }
  for (auto& [alias, canonical] : kAliases) move_alias(text, alias, canonical, what);
  expand_megatron_options(text, what);
  const LinearAttnLists lists = expand_linear_attn_config(text, what);
  check_raw_limits(text, what);  // before the parser sizes lists by them (config_limits.h)
  ModelConfig c = parse_text(text, fam, lists, what);
  resolve_default_precision(c, text, config, what);
  return c;
}

ModelConfig ModelConfig::load(const std::string& path) {
  const std::string file = std::filesystem::is_directory(path)
                               ? (std::filesystem::path(path) / "config.json").string()
                               : path;
  return from_json(read_json_file(file), file);
}

json ModelConfig::to_json() const {
  json j = json::object();
  j["model_type"] = "glm5_next_text";
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["rms_norm_eps"] = rms_norm_eps;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["initializer_range"] = initializer_range;
  j["max_position_embeddings"] = max_position_embeddings;
  j["hidden_act"] = "silu";
  j["intermediate_size"] = intermediate_size;
  j["swiglu_limit"] = swiglu_limit > 0 ? json(swiglu_limit) : json(nullptr);

  json lt = json::array(), mt = json::array(), it = json::array();
  for (LayerKind k : layer_kinds)
    lt.push_back(k == LayerKind::kda   ? "linear_attention"
                 : k == LayerKind::dsa ? "deepseek_sparse_attention"
                                       : "mla");
  for (MlpKind k : mlp_kinds) mt.push_back(k == MlpKind::dense ? "dense" : "sparse");
  for (IndexerKind k : indexer_kinds) it.push_back(k == IndexerKind::full ? "full" : "shared");
  j["layer_types"] = lt;
  j["mlp_layer_types"] = mt;
  j["indexer_types"] = it;
  if (const int64_t k = first_k_dense_replace(); k >= 0 && moe.n_routed_experts > 0) {
    j["first_k_dense_replace"] = k;
    j["moe_layer_freq"] = 1;
  }

  j["linear_num_heads"] = kda.num_heads;
  j["linear_num_value_heads"] = kda.num_v_heads;
  j["linear_head_dim"] = kda.head_dim;
  j["linear_value_head_dim"] = kda.v_head_dim;
  j["linear_conv_kernel_dim"] = kda.conv_kernel;
  j["kda_f_lora_rank"] = kda.f_lora_rank;
  j["kda_gate_lora_rank"] = kda.g_lora_rank;
  j["linear_lower_bound"] = kda.lower_bound ? json(*kda.lower_bound) : json(nullptr);
  j["linear_use_a_log"] = kda.use_a_log;
  j["linear_output_gate_bias"] = kda.output_gate_bias;
  j["linear_A_init_range"] = {kda.a_init_min, kda.a_init_max};
  j["linear_dt_init_range"] = {kda.dt_init_min, kda.dt_init_max};
  j["linear_dt_init_floor"] = kda.dt_init_floor;

  j["num_attention_heads"] = mla.num_heads;
  j["num_key_value_heads"] = mla.num_kv_heads;
  j["q_lora_rank"] = mla.q_lora_rank > 0 ? json(mla.q_lora_rank) : json(nullptr);
  j["kv_lora_rank"] = mla.kv_lora_rank;
  j["qk_nope_head_dim"] = mla.qk_nope_head_dim;
  j["qk_rope_head_dim"] = mla.qk_rope_head_dim;
  j["qk_head_dim"] = mla.qk_head_dim();
  j["v_head_dim"] = mla.v_head_dim;
  j["mla_use_nope"] = mla.use_nope;
  j["rope_theta"] = mla.rope_theta;
  if (mla.rope_scaling.type.empty()) {
    j["rope_scaling"] = nullptr;
  } else {
    const RopeScaling& rs = mla.rope_scaling;
    j["rope_scaling"] = {{"type", rs.type},
                         {"factor", rs.factor},
                         {"original_max_position_embeddings", rs.original_max_position_embeddings},
                         {"beta_fast", rs.beta_fast},
                         {"beta_slow", rs.beta_slow},
                         {"mscale", rs.mscale},
                         {"mscale_all_dim", rs.mscale_all_dim}};
  }

  j["index_n_heads"] = indexer.n_heads;
  j["index_head_dim"] = indexer.head_dim;
  j["index_topk"] = indexer.topk;
  j["index_kpool"] = indexer.kpool;
  j["index_kpool_compress"] = indexer.kpool_compress;
  j["index_kpool_always_select_tail"] = indexer.kpool_always_select_tail;
  j["indexer_rope_interleave"] = indexer.rope_interleave;
  j["index_share_for_mtp_iteration"] = indexer.share_for_mtp_iteration;
  j["dsa_indexer_loss_coeff"] = indexer.loss_coeff;
  j["dsa_indexer_use_sparse_loss"] = indexer.use_sparse_loss;

  j["n_routed_experts"] = moe.n_routed_experts;
  j["num_experts_per_tok"] = moe.num_experts_per_tok;
  j["n_shared_experts"] = moe.n_shared_experts;
  j["moe_intermediate_size"] = moe.moe_intermediate_size;
  j["n_group"] = moe.n_group;
  j["topk_group"] = moe.topk_group;
  j["routed_scaling_factor"] = moe.routed_scaling_factor;
  j["norm_topk_prob"] = moe.norm_topk_prob;
  j["router_aux_loss_coef"] = moe.router_aux_loss_coef;
  j["moe_router_bias_update_rate"] = moe.bias_update_rate;
  j["scoring_func"] = "sigmoid";
  j["topk_method"] = "noaux_tc";
  j["moe_router_dtype"] = "float32";

  j["mhc"] = mhc.enabled;
  j["hc_mult"] = mhc.hc_mult;
  j["hc_sinkhorn_iters"] = mhc.sinkhorn_iters;
  j["hc_eps"] = mhc.hc_eps;
  j["num_nextn_predict_layers"] = mtp.num_layers;
  j["mtp_loss_scaling_factor"] = mtp.loss_scaling_factor;

  j["gemm_precision"] = gemm_kind_name(precision.default_kind);
  j["fp8_grad_format"] = precision.grad_format == Fp8Format::e5m2 ? "e5m2" : "e4m3";
  j["fp8_pow2_scales"] = precision.pow2_scales;
  j["kda_disable_fp8"] = precision.kda_disable_fp8;
  j["mla_proj_disable_quantization"] = precision.mla_proj_disable_quantization;
  j["dsa_indexer_qk_proj_disable_quantization"] =
      precision.dsa_indexer_qk_proj_disable_quantization;
  j["dsa_indexer_kpool_use_quantization"] = precision.dsa_indexer_kpool_use_quantization;
  if (!quantization_config.is_null()) {
    j["quantization_config"] = quantization_config;
  } else if (!precision.modules_to_not_convert.empty()) {
    j["quantization_config"] = {{"modules_to_not_convert", precision.modules_to_not_convert}};
  }

  j["bos_token_id"] = bos_token_id ? json(*bos_token_id) : json(nullptr);
  j["pad_token_id"] = pad_token_id ? json(*pad_token_id) : json(nullptr);
  j["eos_token_id"] = eos_token_ids.empty() ? json(nullptr) : json(eos_token_ids);
  return j;
}

bool ModelConfig::operator==(const ModelConfig& o) const {
  const PrecisionPolicy &a = precision, &b = o.precision;
  const bool same_precision =
      a.default_kind == b.default_kind && a.grad_format == b.grad_format &&
      a.pow2_scales == b.pow2_scales && a.kda_disable_fp8 == b.kda_disable_fp8 &&
      a.mla_proj_disable_quantization == b.mla_proj_disable_quantization &&
      a.dsa_indexer_qk_proj_disable_quantization == b.dsa_indexer_qk_proj_disable_quantization &&
      a.dsa_indexer_kpool_use_quantization == b.dsa_indexer_kpool_use_quantization &&
      a.modules_to_not_convert == b.modules_to_not_convert;
  return same_precision && vocab_size == o.vocab_size && hidden_size == o.hidden_size &&
         num_hidden_layers == o.num_hidden_layers && rms_norm_eps == o.rms_norm_eps &&
         tie_word_embeddings == o.tie_word_embeddings && initializer_range == o.initializer_range &&
         max_position_embeddings == o.max_position_embeddings &&
         intermediate_size == o.intermediate_size && swiglu_limit == o.swiglu_limit &&
         layer_kinds == o.layer_kinds && mlp_kinds == o.mlp_kinds &&
         indexer_kinds == o.indexer_kinds && kda == o.kda && mla == o.mla && indexer == o.indexer &&
         moe == o.moe && mhc == o.mhc && mtp == o.mtp &&
         quantization_config == o.quantization_config && bos_token_id == o.bos_token_id &&
         pad_token_id == o.pad_token_id && eos_token_ids == o.eos_token_ids;
}

// ---- overrides ------------------------------------------------------------------------------

namespace {

std::vector<std::string> split_path(const std::string& key) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (;;) {
    const size_t dot = key.find('.', start);
    parts.push_back(key.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  for (auto& p : parts)
    HLM_CHECK(!p.empty(), "override: key '{}' has an empty path component", key);
  return parts;
}

}  // namespace

void apply_override(json& config, const std::string& key, const std::string& value) {
  HLM_CHECK(config.is_object(), "override {}={}: the config must be a JSON object", key, value);
  HLM_CHECK(!key.empty(), "override: empty key (value '{}')", value);
  json v;
  try {
    v = json::parse(value);
  } catch (const json::exception&) {
    v = value;  // bare text is a string
  }
  std::vector<std::string> path = split_path(key);
  json* node = &config;
  auto tc = config.find("text_config");
  if (tc != config.end() && tc->is_object() && path[0] != "text_config") {
    const bool in_text = tc->contains(path[0]);
    if (in_text || !config.contains(path[0])) node = &*tc;
  }
  for (size_t i = 0; i + 1 < path.size(); ++i) {
    json& child = (*node)[path[i]];
    if (child.is_null()) child = json::object();
    HLM_CHECK(child.is_object(),
              "override {}={}: '{}' is a {} ({}), not an object, so it has no field '{}'", key,
              value, path[i], child.type_name(), child.dump(), path[i + 1]);
    node = &child;
  }
  (*node)[path.back()] = v;
}

void apply_overrides(json& config, const std::vector<std::string>& key_values) {
  for (const std::string& kv : key_values) {
    const size_t eq = kv.find('=');
    HLM_CHECK(eq != std::string::npos && eq > 0,
              "override '{}': expected key=value (e.g. hidden_size=128)", kv);
    apply_override(config, kv.substr(0, eq), kv.substr(eq + 1));
  }
}

}  // namespace hlm
