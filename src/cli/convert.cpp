// `hybridlm convert`: a checkpoint rewritten in another tensor layout, dtype or sharding.
//
//   hybridlm convert --model DIR --out DIR2 [--layout published|module_tree]
//                    [--dtype bf16|f32] [--shard-size BYTES]
//
// The weights are loaded into the model of DIR's config (any layout, detected; block-FP8 weights
// dequantised), then saved atomically to DIR2 with its config.json (model/checkpoint.h): in the
// layout DIR was in unless --layout asks for the other (model/checkpoint_layout.h), floating
// tensors cast to --dtype except the keep-in-FP32 ones, in shards of at most --shard-size bytes
// (0: one file). With neither option the tensors come back byte-identical.
#include <cstdio>
#include <filesystem>
#include <map>

#include "cli/command.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/config_limits.h"
#include "model/hybrid_model.h"

namespace hlm::cli {
namespace {

struct ConvertArgs {
  std::string model, out, layout, dtype;
  uint64_t shard_size = 0;
};

void run_convert(const ConvertArgs& a) {
  const ModelConfig cfg = ModelConfig::load(a.model);
  std::error_code ec;
  HLM_CHECK(std::filesystem::weakly_canonical(a.model, ec) !=
                std::filesystem::weakly_canonical(a.out, ec),
            "convert: --out '{}' is the checkpoint being read; write to another directory", a.out);
  checkpoint::LoadOptions lo;
  lo.allow_missing = true;  // lm_head: a text model's checkpoint has none
  // Nothing is skipped: a tensor the model of the config has no place for (a layer beyond it, a
  // vision tower) is an error naming it, rather than left out of the copy.
  // The MTP block is built when the checkpoint holds it. Parameters keep the checkpoint's values
  // exactly: f32 holds every bf16 / f16 / FP8 value; an f64 checkpoint is loaded in f64.
  const auto infos = checkpoint::read_infos(a.model, lo);
  const std::string mtp_prefix = "model.layers." + std::to_string(cfg.num_hidden_layers) + ".";
  HybridModelOptions opt;
  opt.dtype = DType::f32;
  opt.mtp = false;
  for (const auto& [n, info] : infos) {
    opt.mtp = opt.mtp || n.rfind(mtp_prefix, 0) == 0;
    if (info.dtype == DType::f64) opt.dtype = DType::f64;
  }
  opt.mtp = opt.mtp && cfg.mtp.num_layers > 0;
  checkpoint::check_against_config(a.model, cfg, opt.mtp, lo);
  Workload w;
  w.dtype = opt.dtype;
  w.mtp = opt.mtp;
  check_memory_for(cfg, w, fmt::format("convert {}", a.model));
  HybridModel model(cfg, opt);
  const checkpoint::LoadReport rep = checkpoint::load_module(a.model, model, lo);
  for (const std::string& m : rep.missing)
    HLM_CHECK(m == "lm_head.weight", "convert: the checkpoint {} has no tensor {}", a.model, m);

  checkpoint::SaveOptions so;
  so.layout = a.layout.empty() ? rep.layout : checkpoint::parse_layout(a.layout, "--layout");
  so.max_shard_bytes = a.shard_size;
  for (const std::string& m : rep.missing) so.skip.insert(m);  // not read: not written either
  // Unless --dtype asks for one, every parameter goes back in the dtype the checkpoint stored it
  // in (a block-FP8 weight, dequantised on load, in f32).
  if (!a.dtype.empty()) {
    so.cast_floating_to = a.dtype == "bf16" ? DType::bf16 : DType::f32;
  } else {
    checkpoint::NamedTensors tree;
    for (auto& [name, t] : checkpoint::module_tensors(model))
      if (!so.skip.count(name)) tree.emplace_back(name, t);
    std::map<std::string, DType> stored;  // model tensor -> the dtype of its parts in --model
    for (const auto& f : checkpoint::file_tensors(tree, rep.layout)) {
      auto it = infos.find(f.name);
      if (it != infos.end() && it->second.dtype != DType::e4m3 && it->second.dtype != DType::e5m2)
        stored.emplace(f.source, it->second.dtype);
    }
    for (const auto& f : checkpoint::file_tensors(tree, so.layout))
      if (auto s = stored.find(f.source); s != stored.end()) so.dtype_of[f.name] = s->second;
  }
  checkpoint::save_module(a.out, model, &cfg, so);
  std::printf("convert: %s (%s layout) -> %s (%s layout)%s\n", a.model.c_str(),
              checkpoint::layout_name(rep.layout), a.out.c_str(),
              checkpoint::layout_name(so.layout),
              a.dtype.empty() ? "" : (", floating tensors " + a.dtype).c_str());
}

std::function<void()> setup_convert(CLI::App& app) {
  auto a = std::make_shared<ConvertArgs>();
  app.add_option("--model", a->model, "checkpoint directory (config.json + safetensors)")
      ->required();
  app.add_option("--out", a->out, "output directory")->required();
  app.add_option("--layout", a->layout, "published or module_tree (default: as --model)")
      ->check(CLI::IsMember({"published", "module_tree"}));
  app.add_option("--dtype", a->dtype, "cast floating tensors (keep-in-FP32 ones excepted)")
      ->check(CLI::IsMember({"bf16", "f32"}));
  app.add_option("--shard-size", a->shard_size, "bytes per shard (0: one model.safetensors)")
      ->check(CLI::Range(uint64_t(0), uint64_t(1) << 50));
  return [a] { run_convert(*a); };
}

}  // namespace

HLM_REGISTER_COMMAND("convert", "rewrite a checkpoint in another layout, dtype or sharding",
                     setup_convert);

}  // namespace hlm::cli
