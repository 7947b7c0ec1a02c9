// Precision policy (layers/precision.h): config parsing, per-module resolution, keep-in-FP32 names.
#include "layers/precision.h"

#include <fmt/format.h>

#include "core/enum_names.h"
#include "core/error.h"
#include "core/json.h"

namespace hlm {

namespace {

constexpr auto kGemmKindNames = enum_names<GemmKind::fp8_block>({"native", "bf16", "fp8_block"});
constexpr auto kModuleRoleNames = enum_names<ModuleRole::other>(
    {"kda_proj", "kda_gate", "mla_proj", "indexer_qk_proj", "indexer_kpool", "indexer_weights",
     "moe_expert", "dense_mlp", "lm_head", "router", "mhc", "mtp", "other"});

}  // namespace

const char* gemm_kind_name(GemmKind k) {
  return kGemmKindNames.name(k);
}

std::string precision_str(const GemmPrecision& p) {
  if (p.kind != GemmKind::fp8_block) return gemm_kind_name(p.kind);
  return fmt::format("fp8_block(grad {}{})", p.grad_format == Fp8Format::e4m3 ? "e4m3" : "e5m2",
                     p.pow2_scales ? ", pow2" : "");
}

const char* module_role_name(ModuleRole r) {
  return kModuleRoleNames.name(r);
}

namespace {

std::vector<std::string> split_dots(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    const size_t dot = s.find('.', start);
    out.push_back(s.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return out;
}

}  // namespace

bool module_matches_pattern(const std::string& module_path, const std::string& pattern) {
  std::string p = pattern;
  if (p.size() >= 2 && p.compare(p.size() - 2, 2, ".*") == 0) {
    p.resize(p.size() - 2);
  } else if (!p.empty() && p.back() == '.') {
    p.pop_back();
  }
  if (p.empty() || module_path.empty()) return false;
  const auto pc = split_dots(p), mc = split_dots(module_path);
  if (pc.size() > mc.size()) return false;
  for (size_t start = 0; start + pc.size() <= mc.size(); ++start) {
    bool all = true;
    for (size_t i = 0; i < pc.size() && all; ++i) all = mc[start + i] == pc[i];
    if (all) return true;
  }
  return false;
}

bool PrecisionPolicy::not_converted(const std::string& module_path) const {
  for (const auto& m : modules_to_not_convert)
    if (module_matches_pattern(module_path, m)) return true;
  return false;
}

GemmPrecision PrecisionPolicy::resolve(const std::string& module_path, ModuleRole role) const {
  GemmPrecision p;
  const GemmKind no_fp8 = default_kind == GemmKind::native ? GemmKind::native : GemmKind::bf16;
  switch (role) {
    case ModuleRole::router:
    case ModuleRole::mhc:
      p.kind = GemmKind::native;
      return p;
    case ModuleRole::lm_head:
    case ModuleRole::kda_gate:
    case ModuleRole::indexer_weights:
    case ModuleRole::mtp:
      p.kind = no_fp8;
      return p;
    default:
      break;
  }
  if (default_kind != GemmKind::fp8_block) {
    p.kind = default_kind;
    return p;
  }
  bool disabled = false;
  switch (role) {
    case ModuleRole::kda_proj:
      disabled = kda_disable_fp8;
      break;
    case ModuleRole::mla_proj:
      disabled = mla_proj_disable_quantization;
      break;
    case ModuleRole::indexer_qk_proj:
      disabled = dsa_indexer_qk_proj_disable_quantization;
      break;
    case ModuleRole::indexer_kpool:
      disabled = !dsa_indexer_kpool_use_quantization;
      break;
    default:
      break;
  }
  if (disabled || not_converted(module_path)) {
    p.kind = GemmKind::bf16;
    return p;
  }
  p.kind = GemmKind::fp8_block;
  p.grad_format = grad_format;
  p.pow2_scales = pow2_scales;
  return p;
}

PrecisionPolicy PrecisionPolicy::from_json(const nlohmann::json& j) {
  JsonReader r(j, "precision config");
  return read(r);
}

PrecisionPolicy PrecisionPolicy::read(JsonReader& r) {
  PrecisionPolicy p;
  p.default_kind = r.get_enum("gemm_precision", p.default_kind,
                              {{"native", GemmKind::native},
                               {"fp32", GemmKind::native},
                               {"bf16", GemmKind::bf16},
                               {"fp8_block", GemmKind::fp8_block},
                               {"fp8", GemmKind::fp8_block}});
  // fp8_format (Megatron --fp8-format): "hybrid" means E5M2 gradients.
  const auto format =
      r.opt_enum<Fp8Format>("fp8_format", {{"e4m3", Fp8Format::e4m3}, {"hybrid", Fp8Format::e5m2}});
  const auto grad = r.opt_enum<Fp8Format>("fp8_grad_format",
                                          {{"e4m3", Fp8Format::e4m3}, {"e5m2", Fp8Format::e5m2}});
  if (format && grad && *format != *grad)
    r.error("fp8_grad_format", fmt::format("({}) contradicts 'fp8_format' ({})",
                                           r.object().at("fp8_grad_format").dump(),
                                           r.object().at("fp8_format").dump()));
  p.grad_format = grad ? *grad : format.value_or(p.grad_format);
  p.pow2_scales = r.get_bool("fp8_pow2_scales", p.pow2_scales);
  p.kda_disable_fp8 = r.get_bool("kda_disable_fp8", p.kda_disable_fp8);
  p.mla_proj_disable_quantization =
      r.get_bool("mla_proj_disable_quantization", p.mla_proj_disable_quantization);
  p.dsa_indexer_qk_proj_disable_quantization = r.get_bool(
      "dsa_indexer_qk_proj_disable_quantization", p.dsa_indexer_qk_proj_disable_quantization);
  p.dsa_indexer_kpool_use_quantization =
      r.get_bool("dsa_indexer_kpool_use_quantization", p.dsa_indexer_kpool_use_quantization);

  // quantization_config: only the keys below are read; the others (activation_scheme, ...) are
  // the serving engines'.
  if (auto q = r.opt_child("quantization_config")) {
    q->expect_one_of("quant_method", {"fp8"});
    q->expect_one_of("fmt", {"e4m3"});
    if (const nlohmann::json* b = q->find_non_null("weight_block_size")) {
      const bool ok = b->is_array() && b->size() == 2 && (*b)[0].is_number_integer() &&
                      (*b)[1].is_number_integer() && (*b)[0].get<int64_t>() == 128 &&
                      (*b)[1].get<int64_t>() == 128;
      if (!ok) q->fail("weight_block_size", "[128, 128] (the only block size)", *b);
    }
    if (auto m = q->opt_string_list("modules_to_not_convert")) {
      for (size_t i = 0; i < m->size(); ++i)
        if ((*m)[i].empty())
          q->error(fmt::format("modules_to_not_convert[{}]", i), "must be a non-empty string");
      p.modules_to_not_convert = std::move(*m);
    }
  }
  return p;
}

bool is_keep_fp32_name(const std::string& param_name) {
  const auto parts = split_dots(param_name);
  const std::string& last = parts.back();
  if (last == "A_log" || last == "dt_bias" || last == "index_kpool_compress_ape" ||
      last == "e_score_correction_bias" || last == "expert_bias" || last == "alpha_pre" ||
      last == "alpha_post" || last == "alpha_res")
    return true;
  // hc_{attn|ffn|head}_{fn|base|scale}
  for (const char* site : {"hc_attn_", "hc_ffn_", "hc_head_"}) {
    const std::string s = site;
    if (last.compare(0, s.size(), s) == 0) {
      const std::string rest = last.substr(s.size());
      if (rest == "fn" || rest == "base" || rest == "scale") return true;
    }
  }
  // Megatron mHC: ...mapping_proj.weight / ...mapping_proj.bias
  if (parts.size() >= 2 && parts[parts.size() - 2] == "mapping_proj" &&
      (last == "weight" || last == "bias"))
    return true;
  // transformers' glm5_next mHC: ...{attn|ffn}_hc.{fn|base|scale}
  if (parts.size() >= 2 &&
      (parts[parts.size() - 2] == "attn_hc" || parts[parts.size() - 2] == "ffn_hc") &&
      (last == "fn" || last == "base" || last == "scale"))
    return true;
  return false;
}

}  // namespace hlm
