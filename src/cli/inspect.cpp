// `hybridlm inspect PATH`: what a checkpoint (or a config.json alone) holds, read from the config
// and the safetensors headers only (no weights are loaded):
//
//   hybridlm inspect DIR|config.json [--seq-len L] [--tokens T] [--parallel dp=8,ep=8,cp=2,tp=1]
//
// architecture and layer pattern, parameters (total, active per token), the precision policy, the
// checkpoint's layout, files, tensors and dtypes, and the memory a training step of T tokens in
// sequences of L tokens needs and the decode cache of one sequence of L tokens
// (docs/model_config.md, "Inspect"). --parallel lays the training step out over GPUs: the groups,
// memory per GPU and the bytes each parallelism sends per step (model/parallel_plan.h,
// docs/parallel.md); T then defaults to one sequence per data-parallel rank.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>

#include "cli/command.h"
#include "core/memory.h"
#include "core/safetensors.h"
#include "model/checkpoint.h"
#include "model/checkpoint_layout.h"
#include "model/config.h"
#include "model/config_limits.h"
#include "model/model_cache.h"
#include "model/parallel_plan.h"

namespace hlm::cli {
namespace {

namespace fs = std::filesystem;

struct InspectArgs {
  std::string path, parallel;
  int64_t seq_len = 4096, tokens = 0;
};

std::string billions(int64_t n) {
  return n >= 1000000000 ? fmt::format("{:.2f} B", double(n) / 1e9)
                         : fmt::format("{:.2f} M", double(n) / 1e6);
}

std::string members(const std::vector<int64_t>& g) {
  std::string s = "{";
  for (size_t i = 0; i < g.size(); ++i) {
    if (i == 8 && g.size() > 10) {
      s += fmt::format(", ... {}", g.back());
      break;
    }
    s += fmt::format("{}{}", i ? ", " : "", g[i]);
  }
  return s + "}";
}

void print_plan(const ParallelPlan& p) {
  const ParallelLayout& l = p.layout;
  auto b = [](uint64_t x) { return format_bytes(double(x)); };
  std::printf(
      "parallel     dp %lld x cp %lld x tp %lld = %lld GPUs; routed experts over ep %lld (%lld "
      "per GPU)\n",
      (long long)l.dp, (long long)l.cp, (long long)l.tp, (long long)l.world(), (long long)l.ep,
      (long long)p.experts_per_gpu);
  std::printf("groups       of rank 0: tp %s, cp %s, dp %s, ep %s\n",
              members(p.tp_group(0)).c_str(), members(p.cp_group(0)).c_str(),
              members(p.dp_group(0)).c_str(), members(p.ep_group(0)).c_str());
  std::printf(
      "per GPU      %lld tokens of a step of %lld (sequences of %lld, %lld per GPU slice); %s "
      "(%s): weights %s, gradients %s, optimizer %s, activations %s\n",
      (long long)p.tokens_per_gpu, (long long)p.tokens, (long long)p.seq_len,
      (long long)(p.seq_len / l.cp), b(p.memory()).c_str(),
      fmt::format("{} + {} parameters", p.held_dense, p.held_experts).c_str(), b(p.weights).c_str(),
      b(p.gradients).c_str(), b(p.optimizer).c_str(), b(p.activations).c_str());
  std::printf(
      "traffic      per GPU per step %s: dp gradients %s, dp parameters %s, ep all-to-all %s, "
      "cp %s, tp %s\n",
      b(p.traffic()).c_str(), b(p.dp_gradients).c_str(), b(p.dp_parameters).c_str(),
      b(p.ep_alltoall).c_str(), b(p.cp_exchange).c_str(), b(p.tp_allreduce).c_str());
  std::printf("compute      %.1f TFLOP per GPU per step (6 x active parameters x tokens / GPUs)\n",
              p.flops_per_gpu / 1e12);
}

void run_inspect(const InspectArgs& a) {
  std::error_code ec;
  const bool dir = fs::is_directory(a.path, ec);
  const ModelConfig c = ModelConfig::load(a.path);
  const ParallelLayout pl =
      a.parallel.empty() ? ParallelLayout{} : ParallelLayout::parse(a.parallel);
  const int64_t T = a.tokens > 0 ? a.tokens : a.seq_len * pl.dp;
  const bool mtp_on = c.mtp.num_layers > 0;
  // Checked before anything is printed: a layout that does not fit is an error alone.
  const ParallelPlan plan = plan_parallel(c, pl, T, a.seq_len, mtp_on);

  std::string mlp;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) mlp.push_back(c.is_moe_layer(l) ? 'E' : 'd');
  std::printf(
      "model        %s: %lld layers (%lld KDA, %lld DSA, %lld MLA), hidden %lld, vocab %lld\n",
      c.count_layers(LayerKind::kda) > 0 ? "hybrid KDA / attention" : "attention",
      (long long)c.num_hidden_layers, (long long)c.count_layers(LayerKind::kda),
      (long long)c.count_layers(LayerKind::dsa), (long long)c.count_layers(LayerKind::mla),
      (long long)c.hidden_size, (long long)c.vocab_size);
  std::printf("pattern      %s (K = KDA, D = DSA, M = MLA)\n", c.layer_pattern().c_str());
  std::printf("mlp          %s (d = dense, E = MoE: %lld experts, top %lld, %lld shared)\n",
              mlp.c_str(), (long long)c.moe.n_routed_experts, (long long)c.moe.num_experts_per_tok,
              (long long)c.moe.n_shared_experts);
  const bool mtp = mtp_on;
  const int64_t total = parameter_count(c, mtp), active = active_parameter_count(c, mtp);
  std::printf(
      "parameters   %lld total (%s), %lld active per token (%s)%s\n", (long long)total,
      billions(total).c_str(), (long long)active, billions(active).c_str(),
      mtp ? fmt::format("; the MTP block {}", billions(total - parameter_count(c, false))).c_str()
          : "");
  std::printf("precision    %s\n", c.precision_summary().c_str());

  if (dir && (fs::exists(fs::path(a.path) / checkpoint::kSingleFile) ||
              fs::exists(fs::path(a.path) / checkpoint::kIndexFile))) {
    checkpoint::LoadOptions lo;
    const std::map<std::string, Shape> shapes = checkpoint::read_shapes(a.path, lo);
    std::vector<std::string> names;
    for (const auto& [n, s] : shapes) names.push_back(n);
    const checkpoint::Layout layout = checkpoint::detect_layout(names, a.path);
    int64_t held = 0;
    for (const auto& [n, s] : shapes) held += shape_numel(s);
    // What the tensors cover: the whole model, or it without lm_head (a text model's checkpoint)
    // and / or the MTP block.
    const int64_t head = c.tie_word_embeddings ? 0 : c.vocab_size * c.hidden_size;
    const int64_t base = parameter_count(c, false);
    std::string cover = "the config's model";
    if (held == total - head && head > 0) cover += " without lm_head";
    if (mtp && held == base) cover += " without the MTP block";
    if (mtp && held == base - head && head > 0) cover += " without lm_head and the MTP block";
    const bool match = held == total || (held == total - head && head > 0) ||
                       (mtp && (held == base || held == base - head));
    std::printf("checkpoint   %s layout, %zu tensors, %lld values (%s %s)\n",
                checkpoint::layout_name(layout), shapes.size(), (long long)held,
                match          ? "="
                : held < total ? "fewer than"
                               : "more than",
                cover.c_str());
  } else {
    std::printf("checkpoint   none (a config alone)\n");
  }

  Workload w;
  w.tokens = T;
  w.max_seq_len = a.seq_len;
  w.training = true;
  w.optimizer = true;
  w.dtype = DType::bf16;
  w.mtp = mtp;
  const MemoryEstimate m = estimate_memory(c, w);
  std::printf(
      "training     a step of %lld tokens in sequences of %lld, bf16 weights + AdamW: %s (%s)\n",
      (long long)T, (long long)a.seq_len, format_bytes(double(m.total())).c_str(),
      m.describe().c_str());
  const CacheEstimate ce = estimate_decode_cache(c, 2);
  std::printf(
      "decode cache one sequence of %lld tokens, bf16: %s (KDA states %s fixed; DSA %s per "
      "token)\n",
      (long long)a.seq_len, format_bytes(double(ce.at(uint64_t(a.seq_len)))).c_str(),
      format_bytes(double(ce.kda_fixed)).c_str(),
      format_bytes(double(ce.at(uint64_t(a.seq_len)) - ce.kda_fixed) / double(a.seq_len)).c_str());
  // What this engine's cache (model/model_cache.h, f32; on CUDA the latents as the attention
  // takes them) allocates for one such sequence.
  CacheOptions co;
  co.max_seqs = 1;
  co.max_tokens = a.seq_len;
  for (const Device dev : {Device::cpu, Device::cuda}) {
    co.device = dev;
    const CacheBytes cb = ModelCache::plan(c, DType::f32, co);
    std::printf(
        "hybridlm cache one sequence of %lld tokens, f32, %s (generate / serve): %s (a slot of "
        "%s; %s per token in pages of %lld; latents %s)\n",
        (long long)a.seq_len, device_name(dev), format_bytes(double(cb.total())).c_str(),
        format_bytes(double(cb.per_sequence)).c_str(), format_bytes(double(cb.per_token)).c_str(),
        (long long)cb.page_tokens, dtype_name(ModelCache::latent_dtype(c, DType::f32, dev, 0)));
  }
  if (!a.parallel.empty()) print_plan(plan);
}

std::function<void()> setup_inspect(CLI::App& app) {
  auto a = std::make_shared<InspectArgs>();
  app.add_option("path", a->path, "checkpoint directory (config.json + safetensors) or config.json")
      ->required();
  app.add_option("--seq-len", a->seq_len, "sequence length of the estimates")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 40));
  app.add_option("--tokens", a->tokens,
                 "tokens per training step (default: --seq-len, times dp with --parallel)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 40));
  app.add_option("--parallel", a->parallel,
                 "lay the step out over GPUs: dp=N,ep=N,cp=N,tp=N (any of them; the rest 1)");
  return [a] { run_inspect(*a); };
}

}  // namespace

HLM_REGISTER_COMMAND("inspect",
                     "what a checkpoint holds: architecture, parameters, precision, layout, memory",
                     setup_inspect);

}  // namespace hlm::cli
