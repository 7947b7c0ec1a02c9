// Checkpoint layouts: how a checkpoint's tensor names and shapes relate to the model's parameters.
//
// The model's parameters carry one set of names, transformers' in-memory module tree of
// modeling_glm5_next (docs/model_config.md, "Checkpoints"). A checkpoint file may use it, or the
// published GLM-5.3-Flash layout, which transformers (5.25 and later) writes with
// save_pretrained and the released checkpoints use. Per decoder layer (and the MTP block under
// model.layers.<L>) the published layout differs in five ways:
//
//   module tree                                published
//   attn_hc.{fn,base,scale}                    hc_attn_{fn,base,scale}          (renamed)
//   ffn_hc.{fn,base,scale}                     hc_ffn_{fn,base,scale}           (renamed)
//   self_attn.forget_gate.{f_a_proj,f_b_proj,  self_attn.{f_a_proj,f_b_proj,    (renamed)
//     f_proj,A_log,dt_bias}                      f_proj,A_log,dt_bias}
//   self_attn.conv1d.weight [Cq+Ck+Cv, 1, W]   self_attn.{q,k,v}_conv1d.weight  (split in rows:
//                                                [Cq|Ck|Cv, 1, W]                 C* = the rows of
//                                                                                 {q,k,v}_proj)
//   mlp.experts.gate_up_proj [E, 2I, D]        mlp.experts.<e>.gate_proj.weight (rows 0..I-1 of
//                                                [I, D], .up_proj.weight [I, D]   expert e, then
//                                                                                 rows I..2I-1)
//   mlp.experts.down_proj [E, D, I]            mlp.experts.<e>.down_proj.weight [D, I]
//
// Every other name is the same in both. A published tensor is a contiguous block of one model
// parameter, so loading copies each file tensor into a view of its parameter and saving writes
// the views: a load / save round trip gives byte-identical tensors in either layout.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace hlm::checkpoint {

enum class Layout : uint8_t {
  module_tree,  // transformers' in-memory names (what hybridlm's modules are called)
  published,    // the released checkpoints' names (transformers' save_pretrained from 5.25)
};
const char* layout_name(Layout l);  // "module_tree", "published"
// "module_tree" | "published"; anything else: hlm::Error naming `what` and the value.
Layout parse_layout(const std::string& s, const std::string& what);

// The layout a checkpoint's tensor names (canonical, see canonical_name) are in: published when a
// name only the published layout has is present, module_tree when one only the module tree has
// is, module_tree when neither (a model without KDA, mHC and MoE layers: the two agree). Names of
// both kinds: hlm::Error naming one of each and `where`.
Layout detect_layout(const std::vector<std::string>& names, const std::string& where);

// A model tensor as the checkpoint holds it: the file name and a view of the model tensor (the
// same storage: copying into the view fills the parameter).
struct FileTensor {
  std::string name;
  Tensor view;
  std::string source;  // the model tensor it is (a part of)
};

// The file tensors of named model tensors (the module tree's names, as named_parameters() gives
// them) in `layout`, in the order given (a split or stacked tensor in its parts' order). The
// conv split needs the layer's q_proj.weight and k_proj.weight among `model`: hlm::Error naming
// the conv otherwise, or when the shapes do not add up.
std::vector<FileTensor> file_tensors(const std::vector<std::pair<std::string, Tensor>>& model,
                                     Layout layout);

}  // namespace hlm::checkpoint
