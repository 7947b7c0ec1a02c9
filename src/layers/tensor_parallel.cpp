// Tensor parallelism (layers/tensor_parallel.h): the parameter layouts, the slicing of a whole
// layer's parameters into a rank's part and back, and the sums over the group.
#include "layers/tensor_parallel.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "core/error.h"
#include "ops/tensor_ops.h"

namespace hlm {

namespace {

bool sliced(const TpParam& p) {
  return p.split == TpSplit::rows || p.split == TpSplit::cols;
}

int split_dim(const TpParam& p) {
  return p.split == TpSplit::cols ? 1 : 0;
}

// The geometry of a split: the product of the dimensions before the split one (outer), after it
// (inner, in elements), and the segments' sum (the split dimension's size). Checks that the
// segments fit `shape` and divide by n.
struct SplitGeometry {
  int64_t outer = 1, inner = 1, total = 0;
};
SplitGeometry geometry(const Shape& shape, const TpParam& p, int n) {
  const int d = split_dim(p);
  HLM_CHECK(int64_t(shape.size()) > d,
            "tensor parallel: parameter '{}' has {} dimensions, too few to split dimension {}",
            p.name, shape.size(), d);
  HLM_CHECK(!p.segments.empty(), "tensor parallel: parameter '{}' lists no segments", p.name);
  SplitGeometry g;
  for (int i = 0; i < d; ++i) g.outer *= shape[size_t(i)];
  for (size_t i = size_t(d) + 1; i < shape.size(); ++i) g.inner *= shape[i];
  for (int64_t s : p.segments) {
    HLM_CHECK(s >= 0 && s % n == 0,
              "tensor parallel: parameter '{}': a segment of {} does not split over {} ranks",
              p.name, s, n);
    g.total += s;
  }
  return g;
}

// Copies between the whole tensor `whole` and rank r's part `part` (contiguous CPU tensors of one
// dtype): to_part copies whole -> part, else part -> whole.
void copy_part(Tensor& whole, Tensor& part, const TpParam& p, const SplitGeometry& g, int r, int n,
               bool to_part) {
  const size_t es = whole.element_size();
  auto* wb = static_cast<unsigned char*>(whole.raw());
  auto* pb = static_cast<unsigned char*>(part.raw());
  const int64_t part_total = g.total / n;
  for (int64_t o = 0; o < g.outer; ++o) {
    int64_t whole_row = 0, part_row = 0;
    for (int64_t s : p.segments) {
      const int64_t rows = s / n;
      const size_t bytes = size_t(rows * g.inner) * es;
      unsigned char* w = wb + size_t((o * g.total + whole_row + r * rows) * g.inner) * es;
      unsigned char* q = pb + size_t((o * part_total + part_row) * g.inner) * es;
      if (bytes > 0) {
        if (to_part)
          std::memcpy(q, w, bytes);
        else
          std::memcpy(w, q, bytes);
      }
      whole_row += s;
      part_row += rows;
    }
  }
}

// A new contiguous CPU copy of t.
Tensor host_copy(const Tensor& t) {
  return t.is_cpu() ? t.clone() : ops::contiguous(t).to(Device::cpu);
}

}  // namespace

Tensor tp_shard(const Tensor& full, const TpParam& p, int r, int n) {
  HLM_CHECK(n >= 1 && r >= 0 && r < n,
            "tensor parallel: rank {} is not in a group of {} (parameter '{}')", r, n, p.name);
  HLM_CHECK(full.defined(), "tensor parallel: parameter '{}' is undefined", p.name);
  Tensor whole = host_copy(full);
  if (!sliced(p)) return whole;
  const int d = split_dim(p);
  const SplitGeometry g = geometry(whole.shape(), p, n);
  HLM_CHECK(whole.size(d) == g.total,
            "tensor parallel: parameter '{}' has {} along dimension {}, its segments sum to {}",
            p.name, whole.size(d), d, g.total);
  Shape shape = whole.shape();
  shape[size_t(d)] = g.total / n;
  Tensor part = Tensor::empty(shape, whole.dtype());
  copy_part(whole, part, p, g, r, n, true);
  return part;
}

Tensor tp_unshard(const std::vector<Tensor>& parts, const TpParam& p) {
  const int n = int(parts.size());
  HLM_CHECK(n >= 1, "tensor parallel: no parts of parameter '{}'", p.name);
  std::vector<Tensor> host;
  for (const Tensor& t : parts) {
    HLM_CHECK(t.defined() && t.shape() == parts[0].shape() && t.dtype() == parts[0].dtype(),
              "tensor parallel: the parts of parameter '{}' differ in shape or dtype ({} and {})",
              p.name, parts[0].describe(), t.defined() ? t.describe() : "undefined");
    host.push_back(host_copy(t));
  }
  if (!sliced(p)) return host[0];
  const int d = split_dim(p);
  const SplitGeometry g = geometry(host[0].shape(), p, n);
  HLM_CHECK(host[0].size(d) * n == g.total,
            "tensor parallel: parameter '{}': a part has {} along dimension {}, the segments "
            "give {} per rank",
            p.name, host[0].size(d), d, g.total / n);
  Shape shape = host[0].shape();
  shape[size_t(d)] = g.total;
  Tensor whole = Tensor::empty(shape, host[0].dtype());
  for (int r = 0; r < n; ++r) copy_part(whole, host[size_t(r)], p, g, r, n, false);
  return whole;
}

Tensor tp_gather(dist::Comm& group, const Tensor& part, const TpParam& p) {
  const Tensor h = host_copy(part);
  if (!sliced(p)) return h;
  const int n = group.size();
  const Tensor rows = h.view({int64_t(1), h.numel()});
  const Tensor all = dist::allgather_from(group, rows);  // [n, numel], rank r's part in row r
  std::vector<Tensor> parts;
  for (int r = 0; r < n; ++r) parts.push_back(all.slice(0, r, r + 1).contiguous().view(h.shape()));
  return tp_unshard(parts, p);
}

void tp_load_shard(Module& whole, Module& shard, const std::vector<TpParam>& layouts, int r,
                   int n) {
  std::map<std::string, const TpParam*> by_name;
  for (const TpParam& p : layouts) by_name[p.name] = &p;
  const auto shard_params = shard.named_parameters();
  // Everything checked before anything is set.
  std::vector<std::pair<Param*, Tensor>> parts;
  for (const auto& [name, sp] : shard_params) {
    const auto it = by_name.find(name);
    HLM_CHECK(it != by_name.end(),
              "tensor parallel: parameter '{}' of the rank's layer has no tensor-parallel layout",
              name);
    Param* wp = whole.find_parameter(name);
    HLM_CHECK(wp != nullptr, "tensor parallel: the whole layer has no parameter '{}'", name);
    Tensor part = tp_shard(wp->value, *it->second, r, n);
    HLM_CHECK(part.shape() == sp->value.shape(),
              "tensor parallel: rank {}'s part of '{}' is {}, the rank's layer holds {}", r, name,
              part.describe(), sp->value.describe());
    parts.emplace_back(sp, std::move(part));
  }
  for (auto& [sp, part] : parts) sp->value.copy_(part.to(sp->value.dtype()));
}

void tp_reduce_grads(dist::Comm& group, Module& shard, const std::vector<TpParam>& layouts) {
  std::map<std::string, const TpParam*> by_name;
  for (const TpParam& p : layouts) by_name[p.name] = &p;
  for (const auto& [name, p] : shard.named_parameters()) {
    const auto it = by_name.find(name);
    HLM_CHECK(it != by_name.end(),
              "tensor parallel: parameter '{}' of the rank's layer has no tensor-parallel layout",
              name);
    if (it->second->split != TpSplit::replicated || !p->grad.defined()) continue;
    p->grad = dist::allreduce_from(group, p->grad);
  }
}

KdaConfig kda_tp_config(const KdaConfig& whole, int n) {
  HLM_CHECK(n >= 1 && whole.num_heads % n == 0,
            "tensor parallel: a KDA layer's {} heads do not split over {} ranks", whole.num_heads,
            n);
  KdaConfig c = whole;
  c.num_heads = whole.num_heads / n;
  c.num_v_heads = whole.num_v_heads / n;
  return c;
}

std::vector<TpParam> kda_tp_params(const KdaConfig& c) {
  const int64_t HK = c.qk_dim(), HVV = c.v_dim(), HV = c.num_v_heads, K = c.head_k_dim;
  const std::string gate = c.naming == KdaNaming::glm5_next_transformers ? "forget_gate." : "";
  auto rows = [](std::string name, std::vector<int64_t> seg) {
    return TpParam{std::move(name), TpSplit::rows, std::move(seg)};
  };
  std::vector<TpParam> v = {
      rows("q_proj.weight", {HK}),
      rows("k_proj.weight", {HK}),
      rows("v_proj.weight", {HVV}),
      rows("b_proj.weight", {HV}),
      {"o_proj.weight", TpSplit::cols, {HVV}},
      rows(gate + "A_log", {HV}),
      rows(gate + "dt_bias", {HV * K}),
      {"o_norm.weight", TpSplit::replicated, {}},
  };
  if (c.decay_rank > 0) {
    v.push_back({gate + "f_a_proj.weight", TpSplit::replicated, {}});
    v.push_back(rows(gate + "f_b_proj.weight", {HV * K}));
  } else {
    v.push_back(rows(gate + "f_proj.weight", {HV * K}));
  }
  const std::string g = c.output_gate_rank > 0 ? "g_b_proj" : "g_proj";
  if (c.output_gate_rank > 0) v.push_back({"g_a_proj.weight", TpSplit::replicated, {}});
  v.push_back(rows(g + ".weight", {HVV}));
  if (c.output_gate_bias) v.push_back(rows(g + ".bias", {HVV}));
  if (c.naming == KdaNaming::kimi_linear) {
    v.push_back(rows("q_conv1d.weight", {HK}));
    v.push_back(rows("k_conv1d.weight", {HK}));
    v.push_back(rows("v_conv1d.weight", {HVV}));
  } else {
    v.push_back(rows("conv1d.weight", {HK, HK, HVV}));
  }
  return v;
}

DenseMlpConfig mlp_tp_config(const DenseMlpConfig& whole, int n) {
  HLM_CHECK(n >= 1 && whole.intermediate_size % n == 0,
            "tensor parallel: an MLP's {} intermediate channels do not split over {} ranks",
            whole.intermediate_size, n);
  DenseMlpConfig c = whole;
  c.intermediate_size = whole.intermediate_size / n;
  return c;
}

std::vector<TpParam> mlp_tp_params(const DenseMlpConfig& c) {
  const int64_t I = c.intermediate_size;
  return {{"gate_proj.weight", TpSplit::rows, {I}},
          {"up_proj.weight", TpSplit::rows, {I}},
          {"down_proj.weight", TpSplit::cols, {I}}};
}

MlaConfig mla_tp_config(const MlaConfig& whole, int n) {
  HLM_CHECK(n >= 1 && whole.num_heads % n == 0,
            "tensor parallel: an MLA layer's {} heads do not split over {} ranks", whole.num_heads,
            n);
  MlaConfig c = whole;
  c.num_heads = whole.num_heads / n;
  return c;
}

std::vector<TpParam> mla_tp_params(const MlaConfig& c) {
  const int64_t H = c.num_heads;
  std::vector<TpParam> v;
  if (c.q_lora_rank > 0) {
    v.push_back({"q_a_proj.weight", TpSplit::replicated, {}});
    v.push_back({"q_a_layernorm.weight", TpSplit::replicated, {}});
    v.push_back({"q_b_proj.weight", TpSplit::rows, {H * c.qk_head_dim()}});
  } else {
    v.push_back({"q_proj.weight", TpSplit::rows, {H * c.qk_head_dim()}});
  }
  v.push_back({"kv_a_proj_with_mqa.weight", TpSplit::replicated, {}});
  v.push_back({"kv_a_layernorm.weight", TpSplit::replicated, {}});
  v.push_back({"kv_b_proj.weight", TpSplit::rows, {H * (c.qk_nope_head_dim + c.v_head_dim)}});
  v.push_back({"o_proj.weight", TpSplit::cols, {H * c.v_head_dim}});
  return v;
}

DsaLayerConfig dsa_tp_config(const DsaLayerConfig& whole, int n) {
  DsaLayerConfig c = whole;
  c.mla = mla_tp_config(whole.mla, n);
  return c;
}

std::vector<TpParam> dsa_tp_params(DsaLayer& layer) {
  std::vector<TpParam> v = mla_tp_params(layer.config());
  if (layer.has_indexer())
    for (const auto& [name, p] : layer.indexer().named_parameters("indexer."))
      v.push_back({name, TpSplit::identical, {}});
  return v;
}

}  // namespace hlm
