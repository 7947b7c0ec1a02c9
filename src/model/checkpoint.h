// Checkpoint I/O in the HF layout: model.safetensors, or shards with model.safetensors.index.json
// ("weight_map": tensor name -> shard file), plus config.json. docs/model_config.md describes the
// naming rule, the load checks and the save protocol.
//
// Names. Our module tree uses the HF GLM text-model names: "model.embed_tokens.weight",
// "model.layers.<i>.<...>", "model.norm.weight", "lm_head.weight" (MTP depth k is
// "model.layers.<num_hidden_layers + k>."). canonical_name() maps the checkpoint spellings:
//   model.language_model.X -> model.X        (multimodal glm5_next wrapper)
//   language_model.model.X -> model.X, language_model.lm_head.X -> lm_head.X
//   model.X, lm_head.X     -> unchanged
//   any other X            -> model.X        (a bare text model saved without its "model.")
// Two checkpoint tensors with the same canonical name are an error.
//
// Loading copies into existing tensors (their storage, device and dtype stay): dtype conversion
// bf16/f16/f32/f64/e4m3/e5m2 -> the target's dtype (floating types only; integer tensors must
// match exactly), block-FP8 weights with a "<name>_scale_inv" companion are dequantised first
// (w * scale_inv per weight_block_size block, as in the HF FP8 release), shapes must match
// (error naming the tensor and both shapes), NaN/Inf in a loaded tensor (before or after the
// conversion) is an error naming it, missing and unexpected tensors are reported by name.
//
// Saving is atomic per file: every file is written to a temporary name in the same directory,
// flushed and fsynced; only when all are written are they renamed into place (shards first,
// then config.json, then the index as the commit point) and the directory fsynced. A failure
// before the renames deletes the temporaries and leaves the previous checkpoint untouched.
// Every file carries the same "hlm_save_id" (safetensors __metadata__ / index metadata); a load
// that finds shards of different saves (an interrupted overwrite) is an error.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/safetensors.h"
#include "core/tensor.h"
#include "model/checkpoint_layout.h"
#include "model/config.h"

namespace hlm {
class Module;
}

namespace hlm::checkpoint {

using TensorMap = safetensors::TensorMap;
using Metadata = safetensors::Metadata;
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;  // in save order
using Targets = std::vector<std::pair<std::string, Tensor*>>;      // name -> tensor to fill

inline constexpr const char* kSingleFile = "model.safetensors";
inline constexpr const char* kIndexFile = "model.safetensors.index.json";
inline constexpr const char* kConfigFile = "config.json";

std::string canonical_name(const std::string& checkpoint_name);

// ---- load ----------------------------------------------------------------------------------
struct LoadOptions {
  bool allow_missing = false;     // report missing targets instead of throwing
  bool allow_unexpected = false;  // report checkpoint tensors without a target instead of throwing
  // Unexpected tensors whose canonical name starts with one of these are skipped silently
  // (e.g. "model.visual." of the multimodal release).
  std::vector<std::string> ignore_prefixes;
  // Unexpected "model.layers.<i>." tensors with i >= this are skipped (e.g. MTP weights when
  // MTP is off: num_hidden_layers + num_nextn_predict_layers). -1: off.
  int64_t ignore_layers_from = -1;
  bool check_finite = true;
  int64_t fp8_block_rows = 128, fp8_block_cols = 128;  // quantization_config weight_block_size
  // The names the checkpoint's tensors are expected in (model/checkpoint_layout.h); unset: detected
  // from the names present. Targets are always named as in the module tree.
  std::optional<Layout> layout;
};

struct LoadReport {
  Layout layout = Layout::module_tree;            // the checkpoint's layout, as given or detected
  std::vector<std::string> files;                 // safetensors files read
  std::vector<std::string> loaded;                // target names filled (canonical, in the layout)
  std::map<std::string, std::string> file_names;  // canonical -> as the file spells it
  std::vector<std::string> dequantized;  // targets filled from block-FP8 weight + scale_inv
  std::vector<std::string> missing;      // with allow_missing
  std::vector<std::string> unexpected;   // with allow_unexpected
  std::vector<std::string> ignored;      // matched ignore_prefixes / ignore_layers_from
};

// `path`: a checkpoint directory, a .safetensors file or a model.safetensors.index.json.
LoadReport load_into(const std::string& path, const Targets& targets, const LoadOptions& opts = {});
// Targets = module.named_parameters() values.
LoadReport load_module(const std::string& path, Module& module, const LoadOptions& opts = {});
// Every tensor of a checkpoint under its canonical name, in the file's dtype; block-FP8 weights
// with a scale_inv companion come back dequantised to f32 (the companion is consumed). Checks
// finiteness when opts.check_finite. Reads everything into memory: for small checkpoints, tools
// and tests.
TensorMap read_checkpoint(const std::string& path, const LoadOptions& opts = {});

// The tensors of a checkpoint as its headers describe them, read without the data (canonical
// names -> shapes): names `opts` would skip (ignore_prefixes, ignore_layers_from) and the
// scale_inv companions of block-FP8 weights are left out.
std::map<std::string, Shape> read_shapes(const std::string& path, const LoadOptions& opts = {});
// The same with each tensor's stored dtype (and offsets within its file).
std::map<std::string, safetensors::TensorInfo> read_infos(const std::string& path,
                                                          const LoadOptions& opts = {});
// Before a model is built for `config`: the checkpoint at `path` must be able to fill it. Its
// embed_tokens (and lm_head, when present) must be [vocab_size, hidden_size], and the model of the
// config (parameter_count(config, mtp), less lm_head's when it is missing and opts.allow_missing)
// may hold at most twice the checkpoint's values. hlm::Error naming both numbers otherwise: a
// config that claims a huge model next to a small checkpoint is refused before anything is
// allocated. Smaller differences are left to the load, which names the missing or unexpected
// tensors.
void check_against_config(const std::string& path, const ModelConfig& config, bool mtp,
                          const LoadOptions& opts = {});

// ---- save ----------------------------------------------------------------------------------
struct SaveOptions {
  // 0: one model.safetensors. Otherwise shards model-0000i-of-0000n.safetensors of at most this
  // many data bytes each (a larger single tensor gets a shard of its own) plus the index.
  uint64_t max_shard_bytes = 0;
  // Cast floating tensors to this dtype on save, except keep-in-FP32 names (is_keep_fp32_name).
  std::optional<DType> cast_floating_to;
  Metadata metadata;  // added to every file's __metadata__ (format = "pt" is always set)
  // save_module only: the names it writes (model/checkpoint_layout.h; save_checkpoint writes the
  // names it is given), the module tree's parameters it leaves out, and the dtype a tensor is
  // written in, by the name it is written under (cast_floating_to then applies on top).
  Layout layout = Layout::module_tree;
  std::set<std::string> skip;
  std::map<std::string, DType> dtype_of;
  // Test hook: called with each temporary file's path after it is written and fsynced, before
  // anything is renamed. An exception from it aborts the save like a failed write.
  std::function<void(const std::string& tmp_path)> after_temp_written;
};

// Writes `dir` (created if needed): the tensors, and config.json when `config` is given. Stale
// files of a previous save in another layout (model.safetensors vs shards, shards beyond the
// new count) are removed after the commit.
void save_checkpoint(const std::string& dir, const NamedTensors& tensors, const ModelConfig* config,
                     const SaveOptions& opts = {});
// The module's parameters in opts.layout.
void save_module(const std::string& dir, Module& module, const ModelConfig* config,
                 const SaveOptions& opts = {});
// The same from a module's tensors under its tree names (module_tensors, some of them replaced,
// e.g. by the whole tensors of expert-parallel shares).
void save_module_tensors(const std::string& dir, const NamedTensors& tree,
                         const ModelConfig* config, const SaveOptions& opts = {});
NamedTensors module_tensors(Module& module);  // (name, value) in named_parameters() order
// config.json alone, atomically.
void save_config(const std::string& path, const ModelConfig& config);

// ---- arbitrary named tensor maps (optimizer state, RNG state, ...) ----------------------------
// One safetensors file, written atomically like a checkpoint file (the parent directory is
// created if needed). Names are stored as given.
void save_tensor_map(const std::string& path, const TensorMap& tensors,
                     const Metadata& metadata = {}, const SaveOptions& opts = {});
// Floating tensors are checked for NaN/Inf when check_finite.
safetensors::Contents load_tensor_map(const std::string& path, bool check_finite = true);

// ---- utilities -----------------------------------------------------------------------------
// Write `bytes` to `path` atomically (temporary in the same directory, fsync, rename, fsync of
// the directory). `after_temp_written` as in SaveOptions.
void write_file_atomic(const std::string& path, const std::vector<uint8_t>& bytes,
                       const std::function<void(const std::string&)>& after_temp_written = {});
// Flat index (row-major order of the view) of the first NaN/Inf element, -1 when none or when
// the dtype is an integer type.
int64_t first_non_finite(const Tensor& t);
// Block-FP8 dequantisation: w [..., R, C] (e4m3/e5m2), scale_inv [..., ceil(R/br), ceil(C/bc)]
// (any floating dtype) -> f32 w * scale_inv[r / br, c / bc].
Tensor dequantize_fp8_blockwise(const Tensor& w, const Tensor& scale_inv, int64_t block_rows,
                                int64_t block_cols, const std::string& what);

}  // namespace hlm::checkpoint
