// The shared setup of `generate` and `serve` (cli/infer_load.h).
#include "cli/infer_load.h"

#include <filesystem>

#include "core/error.h"
#include "core/memory.h"

namespace hlm::cli {

Device inference_device(const std::string& device, const std::string& dtype, const ModelConfig& cfg,
                        const char* command) {
  HLM_CHECK(device == "cpu" || device == "cuda", "{}: --device is cpu or cuda, got '{}'", command,
            device);
  if (device == "cpu") return Device::cpu;
  HLM_CHECK(cuda_available(), "{} --device cuda: no CUDA device is present", command);
  HLM_CHECK(dtype == "f32", "{} --device cuda: computes in f32 (not --dtype {})", command, dtype);
  HLM_CHECK(cfg.precision.default_kind != GemmKind::fp8_block,
            "{} --device cuda: the FP8 block GEMMs (gemm_precision fp8_block) have no CUDA "
            "implementation yet",
            command);
  return Device::cuda;
}

void check_inference_memory(const ModelConfig& cfg, const Workload& w, int64_t cache_bytes,
                            const std::string& what) {
  check_memory_for(cfg, w, what);
  check_memory(estimate_memory(cfg, w).total() + uint64_t(cache_bytes),
               fmt::format("{}: the weights, a prefill of {} tokens and a cache of {}", what,
                           w.tokens, format_bytes(double(cache_bytes))));
}

std::unique_ptr<HybridModel> load_inference_model(const std::string& dir, const ModelConfig& cfg,
                                                  const HybridModelOptions& opt,
                                                  const checkpoint::LoadOptions& lo, Device dev,
                                                  const char* command) {
  std::unique_ptr<HybridModel> model;
  try {
    checkpoint::check_against_config(dir, cfg, opt.mtp, lo);
    model = std::make_unique<HybridModel>(cfg, opt);
    checkpoint::load_module(dir, *model, lo);
  } catch (const Error& e) {
    if (!opt.mtp) throw;
    throw Error(
        fmt::format("{} --speculative needs the MTP block's weights (model.layers.{}.*): {}",
                    command, cfg.num_hidden_layers, e.what()));
  }
  // Only GEMMs that round to bf16 read these weights: bf16 storage keeps every result's bits and
  // halves their bytes (before the move, so half of them travel).
  model->keep_gemm_weights_in_bf16();
  if (dev != Device::cpu) model->to(dev);
  return model;
}

std::unique_ptr<tokenizer::Tokenizer> tokenizer_if_any(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::exists(std::filesystem::path(dir) / "tokenizer.json", ec)) return nullptr;
  return std::make_unique<tokenizer::Tokenizer>(tokenizer::Tokenizer::load(dir));
}

}  // namespace hlm::cli
