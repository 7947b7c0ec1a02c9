// Checkpoint layouts (model/checkpoint_layout.h): module tree <-> published names and shapes.
#include "model/checkpoint_layout.h"

#include <fmt/format.h>

#include <cctype>
#include <cstring>
#include <map>
#include <optional>

#include "core/error.h"

namespace hlm::checkpoint {

namespace {

bool ends_with(const std::string& s, const std::string& p) {
  return s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
}

// The renames, module tree -> published: a name containing `tree` (followed by one of `leaves`)
// has it replaced by `published`.
struct Rename {
  const char* tree;
  const char* published;
  std::vector<const char*> leaves;
};
const Rename kRenames[] = {
    {".attn_hc.", ".hc_attn_", {"fn", "base", "scale"}},
    {".ffn_hc.", ".hc_ffn_", {"fn", "base", "scale"}},
    {".self_attn.forget_gate.",
     ".self_attn.",
     {"f_a_proj.weight", "f_b_proj.weight", "f_proj.weight", "A_log", "dt_bias"}},
};

// The published name of a renamed module-tree name, or nullopt.
std::optional<std::string> renamed(const std::string& name) {
  for (const Rename& r : kRenames) {
    const size_t at = name.rfind(r.tree);
    if (at == std::string::npos) continue;
    const std::string leaf = name.substr(at + std::strlen(r.tree));
    for (const char* l : r.leaves)
      if (leaf == l) return name.substr(0, at) + r.published + leaf;
  }
  return std::nullopt;
}

// ".mlp.experts.<digits>." in the name.
bool has_expert_index(const std::string& name) {
  const std::string key = ".mlp.experts.";
  for (size_t at = name.find(key); at != std::string::npos; at = name.find(key, at + 1)) {
    size_t i = at + key.size(), j = i;
    while (j < name.size() && std::isdigit(static_cast<unsigned char>(name[j]))) ++j;
    if (j > i && j < name.size() && name[j] == '.') return true;
  }
  return false;
}

// Which layout a name belongs to, when only one has it.
std::optional<Layout> marker(const std::string& name) {
  for (const Rename& r : kRenames) {
    const size_t at = name.rfind(r.tree);
    if (at != std::string::npos) {
      const std::string leaf = name.substr(at + std::strlen(r.tree));
      for (const char* l : r.leaves)
        if (leaf == l) return Layout::module_tree;
    }
    const size_t p = name.rfind(r.published);
    if (p != std::string::npos) {
      const std::string leaf = name.substr(p + std::strlen(r.published));
      for (const char* l : r.leaves)
        if (leaf == l) return Layout::published;
    }
  }
  if (ends_with(name, ".mlp.experts.gate_up_proj") || ends_with(name, ".mlp.experts.down_proj") ||
      ends_with(name, ".self_attn.conv1d.weight"))
    return Layout::module_tree;
  if (has_expert_index(name) || ends_with(name, ".self_attn.q_conv1d.weight") ||
      ends_with(name, ".self_attn.k_conv1d.weight") ||
      ends_with(name, ".self_attn.v_conv1d.weight"))
    return Layout::published;
  return std::nullopt;
}

}  // namespace

const char* layout_name(Layout l) {
  return l == Layout::published ? "published" : "module_tree";
}

Layout parse_layout(const std::string& s, const std::string& what) {
  if (s == "module_tree") return Layout::module_tree;
  if (s == "published") return Layout::published;
  HLM_FAIL("{}: '{}' is not a checkpoint layout (expected published or module_tree)", what, s);
}

Layout detect_layout(const std::vector<std::string>& names, const std::string& where) {
  const std::string* first[2] = {nullptr, nullptr};
  for (const std::string& n : names)
    if (auto m = marker(n); m && !first[int(*m)]) first[int(*m)] = &n;
  HLM_CHECK(!(first[0] && first[1]),
            "{}: the tensor names mix two checkpoint layouts: '{}' is named as in transformers' "
            "module tree, '{}' as in the published checkpoints",
            where, *first[int(Layout::module_tree)], *first[int(Layout::published)]);
  return first[int(Layout::published)] ? Layout::published : Layout::module_tree;
}

std::vector<FileTensor> file_tensors(const std::vector<std::pair<std::string, Tensor>>& model,
                                     Layout layout) {
  std::vector<FileTensor> out;
  out.reserve(model.size());
  if (layout == Layout::module_tree) {
    for (const auto& [name, t] : model) out.push_back({name, t, name});
    return out;
  }
  std::map<std::string, const Tensor*> by_name;
  for (const auto& [name, t] : model) by_name.emplace(name, &t);
  auto rows_of = [&](const std::string& name, const std::string& what) {
    auto it = by_name.find(name);
    HLM_CHECK(it != by_name.end() && it->second->defined() && it->second->dim() >= 1,
              "published layout: {} is split by the rows of '{}', which the model lacks", what,
              name);
    return it->second->size(0);
  };
  for (const auto& [name, t] : model) {
    if (auto r = renamed(name)) {
      out.push_back({*r, t, name});
      continue;
    }
    const std::string experts = ".mlp.experts.";
    if (ends_with(name, experts + "gate_up_proj")) {
      const std::string pre = name.substr(0, name.size() - std::strlen("gate_up_proj"));
      HLM_CHECK(t.dim() == 3 && t.size(1) % 2 == 0,
                "published layout: '{}' must be [E, 2I, D], got {}", name, t.describe());
      const int64_t I = t.size(1) / 2;
      for (int64_t e = 0; e < t.size(0); ++e) {
        const Tensor ex = t.select(0, e);
        out.push_back({fmt::format("{}{}.gate_proj.weight", pre, e), ex.slice(0, 0, I), name});
        out.push_back({fmt::format("{}{}.up_proj.weight", pre, e), ex.slice(0, I, 2 * I), name});
      }
      continue;
    }
    if (ends_with(name, experts + "down_proj")) {
      const std::string pre = name.substr(0, name.size() - std::strlen("down_proj"));
      HLM_CHECK(t.dim() == 3, "published layout: '{}' must be [E, D, I], got {}", name,
                t.describe());
      for (int64_t e = 0; e < t.size(0); ++e)
        out.push_back({fmt::format("{}{}.down_proj.weight", pre, e), t.select(0, e), name});
      continue;
    }
    if (ends_with(name, ".self_attn.conv1d.weight")) {
      const std::string pre = name.substr(0, name.size() - std::strlen("conv1d.weight"));
      const int64_t cq = rows_of(pre + "q_proj.weight", "'" + name + "'");
      const int64_t ck = rows_of(pre + "k_proj.weight", "'" + name + "'");
      HLM_CHECK(t.dim() >= 1 && t.size(0) > cq + ck,
                "published layout: '{}' {} has no rows left for v_conv1d after q ({}) and k ({})",
                name, t.describe(), cq, ck);
      out.push_back({pre + "q_conv1d.weight", t.slice(0, 0, cq), name});
      out.push_back({pre + "k_conv1d.weight", t.slice(0, cq, cq + ck), name});
      out.push_back({pre + "v_conv1d.weight", t.slice(0, cq + ck, t.size(0)), name});
      continue;
    }
    out.push_back({name, t, name});
  }
  return out;
}

}  // namespace hlm::checkpoint
