// libFuzzer target: the config readers. The input is JSON text read as an HF model config.json
// and as a training config (with the model inline). Each must parse or raise hlm::Error; a model
// config that parses must round-trip through to_json() to an equal config, and its parameter
// count and memory estimate must be computable. Anything else is a bug. scripts/fuzz.sh runs it.
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"
#include "model/config.h"
#include "model/config_limits.h"
#include "train/train_limits.h"
#include "train/trainer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(std::string(reinterpret_cast<const char*>(data), size));
  } catch (const nlohmann::json::exception&) {
    return 0;  // not JSON: the readers report it through their own parse error
  }
  try {
    const hlm::ModelConfig c = hlm::ModelConfig::from_json(j, "fuzz");
    const hlm::ModelConfig back = hlm::ModelConfig::from_json(c.to_json(), "round trip");
    if (!(back == c)) std::abort();
    if (hlm::parameter_count(c) <= 0) std::abort();
    hlm::Workload w;
    w.tokens = 4096;
    w.training = true;
    w.optimizer = true;
    hlm::estimate_memory(c, w);
  } catch (const hlm::Error&) {
  }
  // A training config. A "model" given as a path would read an arbitrary file: only inline
  // models (or none: the default path, relative to a directory that has no configs/).
  if (j.is_object() && j.contains("model") && !j["model"].is_object()) return 0;
  if (j.is_object() && j.contains("data")) return 0;  // a path, likewise
  try {
    const hlm::train::TrainConfig t =
        hlm::train::make_train_config(j, {}, "fuzz", "/nonexistent-base");
    const hlm::train::TrainConfig back =
        hlm::train::TrainConfig::from_json(t.to_json(), "round trip", "/nonexistent-base");
    if (back.to_json() != t.to_json()) std::abort();
    hlm::train::check_train_limits(t, t.model, "fuzz");
  } catch (const hlm::Error&) {
  }
  return 0;
}
