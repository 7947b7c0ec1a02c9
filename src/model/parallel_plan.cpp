// The layout of a parallel training job (model/parallel_plan.h).
#include "model/parallel_plan.h"

#include <algorithm>
#include <sstream>

#include "core/error.h"
#include "model/config_limits.h"

namespace hlm {

ParallelLayout ParallelLayout::parse(const std::string& s) {
  ParallelLayout l;
  bool seen[4] = {false, false, false, false};
  HLM_CHECK(s.empty() || (s.back() != ',' && s.front() != ','),
            "--parallel: '{}' has an empty item (e.g. dp=8,ep=8,cp=2)", s);
  std::stringstream ss(s);
  std::string item;
  int items = 0;
  while (std::getline(ss, item, ',')) {
    ++items;
    const size_t eq = item.find('=');
    HLM_CHECK(eq != std::string::npos,
              "--parallel: '{}' is not key=value (keys dp, ep, cp, tp; e.g. dp=8,ep=8,cp=2)", item);
    const std::string key = item.substr(0, eq), val = item.substr(eq + 1);
    const char* keys[4] = {"dp", "ep", "cp", "tp"};
    int64_t* fields[4] = {&l.dp, &l.ep, &l.cp, &l.tp};
    const int k = int(std::find(keys, keys + 4, key) - keys);
    HLM_CHECK(k < 4, "--parallel: unknown key '{}' (keys dp, ep, cp, tp)", key);
    HLM_CHECK(!seen[k], "--parallel: {} is given twice", key);
    seen[k] = true;
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(val, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    HLM_CHECK(used == val.size() && !val.empty() && v >= 1 && v <= (1 << 20),
              "--parallel: {} must be a whole number in [1, 2^20], got '{}'", key, val);
    *fields[k] = v;
  }
  HLM_CHECK(items > 0, "--parallel: give at least one of dp, ep, cp, tp (e.g. dp=8,ep=8,cp=2)");
  HLM_CHECK(l.world() <= (1 << 20), "--parallel: {} GPUs is more than 2^20", l.world());
  return l;
}

namespace {

// Bytes a ring all-gather (or reduce-scatter) of `bytes` over n ranks sends per rank.
double ring(double bytes, int64_t n) {
  return n > 1 ? bytes * double(n - 1) / double(n) : 0.0;
}

uint64_t u64(double x) {
  return uint64_t(std::max(0.0, x) + 0.5);
}

}  // namespace

std::vector<int64_t> ParallelPlan::tp_group(int64_t r) const {
  std::vector<int64_t> g;
  for (int64_t t = 0; t < layout.tp; ++t) g.push_back(r / layout.tp * layout.tp + t);
  return g;
}

std::vector<int64_t> ParallelPlan::cp_group(int64_t r) const {
  const int64_t t = r % layout.tp, d = r / (layout.tp * layout.cp);
  std::vector<int64_t> g;
  for (int64_t c = 0; c < layout.cp; ++c) g.push_back((d * layout.cp + c) * layout.tp + t);
  return g;
}

std::vector<int64_t> ParallelPlan::dp_group(int64_t r) const {
  const int64_t t = r % layout.tp, c = r / layout.tp % layout.cp;
  std::vector<int64_t> g;
  for (int64_t d = 0; d < layout.dp; ++d) g.push_back((d * layout.cp + c) * layout.tp + t);
  return g;
}

std::vector<int64_t> ParallelPlan::ep_group(int64_t r) const {
  // The dp cp ranks of r's tp rank, in (d, c) order, in groups of ep consecutive ones.
  const int64_t t = r % layout.tp, i = r / layout.tp, first = i / layout.ep * layout.ep;
  std::vector<int64_t> g;
  for (int64_t j = first; j < first + layout.ep; ++j) g.push_back(j * layout.tp + t);
  return g;
}

ParallelPlan plan_parallel(const ModelConfig& c, const ParallelLayout& l, int64_t tokens,
                           int64_t seq_len, bool mtp) {
  check_limits(c);
  const int64_t E = c.moe.n_routed_experts;
  HLM_CHECK(tokens >= 1 && seq_len >= 1, "parallel plan: tokens and seq_len must be >= 1");
  HLM_CHECK((l.dp * l.cp) % l.ep == 0,
            "--parallel: ep = {} must divide dp x cp = {} (the experts are shared by ep of the "
            "data- and context-parallel ranks)",
            l.ep, l.dp * l.cp);
  HLM_CHECK(l.ep == 1 || (E > 0 && E % l.ep == 0),
            "--parallel: ep = {} must divide the {} routed experts", l.ep, E);
  for (const auto& [heads, what] :
       {std::pair{c.kda.num_heads, "KDA heads (linear_num_heads)"},
        std::pair{c.kda.num_v_heads, "KDA value heads"},
        std::pair{c.mla.num_heads, "attention heads (num_attention_heads)"},
        std::pair{c.indexer.n_heads, "indexer heads (index_n_heads)"}})
    HLM_CHECK(heads % l.tp == 0, "--parallel: tp = {} must divide the {} {}", l.tp, heads, what);
  HLM_CHECK(seq_len % l.cp == 0, "--parallel: cp = {} must divide the sequence length {}", l.cp,
            seq_len);
  HLM_CHECK(tokens % (l.dp * seq_len) == 0,
            "--parallel: the {} tokens of a step must be whole sequences of {} on each of the "
            "dp = {} ranks (a multiple of {})",
            tokens, seq_len, l.dp, l.dp * seq_len);

  ParallelPlan p;
  p.layout = l;
  p.tokens = tokens;
  p.seq_len = seq_len;
  const int64_t n_d = l.dp * l.cp, n_e = n_d / l.ep;
  p.tokens_per_gpu = tokens / n_d;
  p.experts_per_gpu = E / l.ep;
  const int64_t P = parameter_count(c, mtp), Pe = routed_expert_parameter_count(c, mtp);
  const int64_t S = tensor_parallel_split_count(c, mtp);
  p.held_dense = S / l.tp + (P - Pe - S);
  p.held_experts = Pe / l.ep;
  const double hd = double(p.held_dense), he = double(p.held_experts);
  p.weights = u64(2 * (hd + he));
  p.gradients = u64(4 * (hd + he));
  p.optimizer = u64(12 * (hd / double(n_d) + he / double(n_e)));
  Workload w;
  w.tokens = p.tokens_per_gpu;
  w.max_seq_len = seq_len / l.cp;
  w.training = true;
  w.optimizer = false;
  w.dtype = DType::bf16;
  w.mtp = mtp;
  p.activations = u64(double(estimate_memory(c, w).activations) / double(l.tp));

  const double t = double(p.tokens_per_gpu), D = double(c.hidden_size);
  p.dp_gradients = u64(4 * (ring(hd, n_d) + ring(he, n_e)));
  p.dp_parameters = u64(2 * (ring(hd, n_d) + ring(he, n_e)));
  int64_t moe_layers = 0;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) moe_layers += c.is_moe_layer(i) ? 1 : 0;
  if (mtp && c.mtp.num_layers > 0 && c.mtp_mlp_kind() == MlpKind::moe) ++moe_layers;
  p.ep_alltoall =
      u64(4 * t * double(c.moe.num_experts_per_tok) * D * 2 * ring(1.0, l.ep) * double(moe_layers));
  const int64_t kda_layers = c.count_layers(LayerKind::kda);
  const int64_t dsa_layers =
      c.count_layers(LayerKind::dsa) + (mtp && c.mtp.num_layers > 0 ? c.mtp.num_layers : 0);
  if (l.cp > 1) {
    const KdaHparams& k = c.kda;
    const double conv = double(2 * k.num_heads * k.head_dim + k.num_v_heads * k.v_head_dim);
    const double kda = 4.0 * double(l.cp - 1) *
                       (double(k.num_v_heads * k.head_dim) * double(2 * k.v_head_dim + k.head_dim) +
                        2.0 * double(k.conv_kernel - 1) * conv);
    const double g = c.indexer.kpool > 1 ? 2.0 : 1.0;
    const double dsa = double(l.cp - 1) * t *
                       (6.0 * double(c.mla.kv_lora_rank + c.mla.qk_rope_head_dim) +
                        8.0 * g * double(c.indexer.head_dim));
    p.cp_exchange = u64(kda * double(kda_layers) + dsa * double(dsa_layers));
  }
  // Tensor parallelism per layer: the attention's output and input gradient all-reduced; a dense
  // MLP's the same; a MoE layer's rows all-gathered (forward and backward); and a DSA layer's
  // indexer-loss target [t, index_topk] (FP32) all-reduced in the forward.
  const int64_t layers = c.num_hidden_layers + (mtp ? c.mtp.num_layers : 0);
  int64_t loss_layers = 0;
  if (c.indexer.loss_coeff > 0) {
    for (int64_t i = 0; i < c.num_hidden_layers; ++i)
      loss_layers += c.layer_kind(i) == LayerKind::dsa &&
                     (c.indexer_kinds.empty() || c.indexer_kinds[size_t(i)] == IndexerKind::full);
    if (mtp) loss_layers += c.mtp.num_layers;
  }
  const double act = t * D * 2;  // one BF16 [t, D]
  p.tp_allreduce =
      u64(ring(1.0, l.tp) *
          (2 * 2 * act * double(layers + layers - moe_layers) + 2 * act * double(moe_layers) +
           2 * t * double(c.indexer.topk) * 4 * double(loss_layers)));
  p.flops_per_gpu =
      6.0 * double(active_parameter_count(c, mtp)) * double(tokens) / double(l.world());
  return p;
}

}  // namespace hlm
