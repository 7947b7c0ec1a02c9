// What `generate` and `serve` share before they generate: the device and dtype flags checked
// against the config, the memory check of the weights, a prefill and the cache, the checkpoint's
// tokenizer, and the model built, loaded and moved to its device.
#pragma once

#include <memory>
#include <string>

#include "core/device.h"
#include "model/checkpoint.h"
#include "model/config_limits.h"
#include "model/hybrid_model.h"
#include "tokenizer/tokenizer.h"

namespace hlm::cli {

// --device (cpu | cuda) and --dtype (f32 | f64) of `command`: the device, after checking that it
// can run this config (CUDA present, f32, no FP8 block GEMMs).
Device inference_device(const std::string& device, const std::string& dtype, const ModelConfig& cfg,
                        const char* command);

// The weights, workload w and a cache of cache_bytes against the memory limit (what names them).
void check_inference_memory(const ModelConfig& cfg, const Workload& w, int64_t cache_bytes,
                            const std::string& what);

// The checkpoint in dir checked against cfg, then the model built, loaded, its bf16-GEMM weights
// kept in bf16 (Module::keep_gemm_weights_in_bf16) and moved to dev. With
// opt.mtp (`command --speculative`) an error in the checkpoint says that the MTP block's weights
// are needed.
std::unique_ptr<HybridModel> load_inference_model(const std::string& dir, const ModelConfig& cfg,
                                                  const HybridModelOptions& opt,
                                                  const checkpoint::LoadOptions& lo, Device dev,
                                                  const char* command);

// dir's tokenizer.json, or null when it has none.
std::unique_ptr<tokenizer::Tokenizer> tokenizer_if_any(const std::string& dir);

}  // namespace hlm::cli
