// `hybridlm inspect PATH`: what a checkpoint (or a config.json alone) holds, read from the config
// and the safetensors headers only (no weights are loaded):
//
//   hybridlm inspect DIR|config.json [--seq-len L] [--tokens T]
//
// architecture and layer pattern, parameters (total, active per token), the precision policy, the
// checkpoint's layout, files, tensors and dtypes, and the memory a training step of T tokens in
// sequences of L tokens needs and the decode cache of one sequence of L tokens
// (docs/model_config.md, "Inspect").
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

namespace hlm::cli {
namespace {

namespace fs = std::filesystem;

struct InspectArgs {
  std::string path;
  int64_t seq_len = 4096, tokens = 0;
};

std::string billions(int64_t n) {
  return n >= 1000000000 ? fmt::format("{:.2f} B", double(n) / 1e9)
                         : fmt::format("{:.2f} M", double(n) / 1e6);
}

void run_inspect(const InspectArgs& a) {
  std::error_code ec;
  const bool dir = fs::is_directory(a.path, ec);
  const ModelConfig c = ModelConfig::load(a.path);
  const int64_t T = a.tokens > 0 ? a.tokens : a.seq_len;

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
  const bool mtp = c.mtp.num_layers > 0;
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
  // What this engine's cache (model/model_cache.h, f32) allocates for one such sequence.
  CacheOptions co;
  co.max_seqs = 1;
  co.max_tokens = a.seq_len;
  const CacheBytes cb = ModelCache::plan(c, DType::f32, co);
  std::printf(
      "hybridlm cache one sequence of %lld tokens, f32 (generate / serve): %s (a slot of %s; "
      "%s per token in pages of %lld)\n",
      (long long)a.seq_len, format_bytes(double(cb.total())).c_str(),
      format_bytes(double(cb.per_sequence)).c_str(), format_bytes(double(cb.per_token)).c_str(),
      (long long)cb.page_tokens);
}

std::function<void()> setup_inspect(CLI::App& app) {
  auto a = std::make_shared<InspectArgs>();
  app.add_option("path", a->path, "checkpoint directory (config.json + safetensors) or config.json")
      ->required();
  app.add_option("--seq-len", a->seq_len, "sequence length of the estimates")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 40));
  app.add_option("--tokens", a->tokens, "tokens per training step (default: --seq-len)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 40));
  return [a] { run_inspect(*a); };
}

}  // namespace

HLM_REGISTER_COMMAND("inspect",
                     "what a checkpoint holds: architecture, parameters, precision, layout, memory",
                     setup_inspect);

}  // namespace hlm::cli
