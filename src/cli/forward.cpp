// `hybridlm forward`: run a checkpoint on a batch of token ids and write its hidden states (and
// logits, and with --grad-probe the gradient of every parameter), the parity tool of
// docs/parity.md.
//
//   hybridlm forward --model DIR --tokens IN.safetensors --out OUT.safetensors [--logits]
//                    [--grad-probe P.safetensors] [--grad-layout published|module_tree]
//                    [--dtype f32|f64] [--dsa-indices S.safetensors]
// The checkpoint may be in either layout (model/checkpoint_layout.h; detected from its names).
// IN: input_ids I64 / I32 / U8 [B, T] (each row a sequence) or [T] with an optional cu_seqlens
// (I64/I32 [N+1]); nothing else (model/token_input.h has every check).
// OUT: last_hidden_state F32 ([B, T, D] or [T, D]); with --logits, logits F32 ([B, T, vocab] or
// [T, vocab]; the checkpoint must have lm_head or tie it); dsa_indices.layers.<i> I32 [B, T, W]
// (row-local positions; [T, W] global ids for [T] input): the token sets the DSA layers attended;
// with --grad-probe (tensor `probe`, shaped like last_hidden_state) the loss sum(last_hidden_state
// * probe) is backpropagated and OUT also holds grad.NAME (F32) for every parameter, NAME as the
// checkpoint's layout names it (or as
// --grad-layout asks: module_tree gives PyTorch's named_parameters() names). MTP weights in the
// checkpoint are ignored (the tool runs the main stack); the MoE aux and indexer losses are not
// part of the probe loss.
// --dsa-indices: the token set each query of DSA layer i attends, tensor "layers.<i>" I32/I64
// [B, T, W] with positions local to the row (or [T, W] global ids for [T] input), -1 padded: the
// reference's selection replayed (top-k ties may be broken differently by another
// implementation; replaying the selection compares everything else exactly).
#include <cstdio>
#include <filesystem>

#include "cli/command.h"
#include "core/safetensors.h"
#include "model/checkpoint.h"
#include "model/config_limits.h"
#include "model/hybrid_model.h"
#include "model/token_input.h"

namespace hlm::cli {
namespace {

struct ForwardArgs {
  std::string model, tokens, out, probe, dtype = "f32", dsa_indices, grad_layout;
  bool logits = false;
};

void run_forward(const ForwardArgs& a) {
  const ModelConfig cfg = ModelConfig::load(a.model);
  HybridModelOptions opt;
  opt.dtype = a.dtype == "f64" ? DType::f64 : DType::f32;
  opt.mtp = false;
  // lm_head is optional in the checkpoint (a base-model save has none).
  checkpoint::LoadOptions lo;
  lo.allow_missing = true;
  lo.ignore_layers_from = cfg.num_hidden_layers;

  // Everything is checked before the model is built: the token file, the checkpoint's shapes
  // against its config, the memory the pass needs.
  const TokenBatch tb = read_token_batch(safetensors::load(a.tokens), cfg.vocab_size, a.tokens);
  checkpoint::check_against_config(a.model, cfg, opt.mtp, lo);
  const bool grads = !a.probe.empty();
  Workload w;
  w.tokens = tb.num_tokens();
  w.max_seq_len = tb.max_seq_len;
  w.training = grads;
  w.dtype = opt.dtype;
  w.mtp = false;
  check_memory_for(cfg, w, fmt::format("forward on {}", a.tokens));

  HybridModel model(cfg, opt);
  const checkpoint::LoadReport rep = checkpoint::load_module(a.model, model, lo);
  bool have_head = cfg.tie_word_embeddings;
  for (const std::string& m : rep.missing)
    HLM_CHECK(m == "lm_head.weight", "forward: the checkpoint {} has no tensor {}", a.model, m);
  if (rep.missing.empty()) have_head = true;
  HLM_CHECK(!a.logits || have_head,
            "forward --logits: the checkpoint {} has no lm_head.weight and does not tie it to the "
            "embedding (tie_word_embeddings)",
            a.model);
  const checkpoint::Layout grad_layout =
      a.grad_layout.empty() ? rep.layout : checkpoint::parse_layout(a.grad_layout, "--grad-layout");
  std::printf("forward: checkpoint %s in the %s layout; computing in %s; %s\n", a.model.c_str(),
              checkpoint::layout_name(rep.layout), a.dtype.c_str(),
              cfg.precision_summary().c_str());

  const int64_t B = tb.batch, T = tb.length;
  ModelInputs mi;
  mi.tokens = tb.tokens;
  mi.cu_seqlens = tb.cu_seqlens;
  mi.logits = a.logits;
  mi.aux_losses = false;
  if (!a.dsa_indices.empty())
    mi.dsa_indices = read_dsa_indices(safetensors::load(a.dsa_indices), cfg, tb, a.dsa_indices);
  const int64_t D = cfg.hidden_size;

  Context ctx;
  ctx.training = grads;
  if (grads) model.zero_grad();
  HybridModel::SavedPtr saved;
  ModelOutput out = model.forward(ctx, mi, grads ? &saved : nullptr);

  const Shape hshape = tb.rows ? Shape{B, T, D} : Shape{T, D};
  safetensors::TensorMap res;
  res["last_hidden_state"] = out.hidden.to(DType::f32).view(hshape);
  if (a.logits) {
    const int64_t V = cfg.vocab_size;
    res["logits"] = out.logits.to(DType::f32).view(tb.rows ? Shape{B, T, V} : Shape{T, V});
  }
  // The token sets the DSA layers attended, in the layout of --dsa-indices.
  {
    size_t d = 0;
    for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
      if (cfg.layer_kind(l) != LayerKind::dsa || d >= out.dsa_indices.size()) continue;
      Tensor t = out.dsa_indices[d++].to(DType::i64).contiguous();
      if (tb.rows) {
        const int64_t W = t.size(1);
        int64_t* p = t.data<int64_t>();
        for (int64_t b = 0; b < B; ++b)
          for (int64_t i = 0; i < T * W; ++i)
            if (p[b * T * W + i] >= 0) p[b * T * W + i] -= b * T;
        t = t.view({B, T, W});
      }
      res["dsa_indices.layers." + std::to_string(l)] = t.to(DType::i32);
    }
  }
  if (grads) {
    const safetensors::Contents pc = safetensors::load(a.probe);
    auto p = pc.tensors.find("probe");
    HLM_CHECK(p != pc.tensors.end(), "forward: {} has no tensor probe", a.probe);
    HLM_CHECK(is_floating(p->second.dtype()), "forward: {}: probe must be floating, got {}",
              a.probe, p->second.describe());
    HLM_CHECK(p->second.shape() == hshape, "forward: probe must have shape {}, got {}",
              shape_str(hshape), p->second.describe());
    model.backward(ctx, *saved, p->second.contiguous().view({B * T, D}));
    std::vector<std::pair<std::string, Tensor>> grads;
    for (auto& [name, param] : model.named_parameters()) {
      if (!have_head && name == "lm_head.weight") continue;
      grads.emplace_back(name, param->grad);
    }
    for (const checkpoint::FileTensor& g : checkpoint::file_tensors(grads, grad_layout)) {
      // In the checkpoint's own layout, the name as the file spells it (prefixes included).
      auto f = rep.file_names.find(g.name);
      const bool as_file = grad_layout == rep.layout && f != rep.file_names.end();
      res["grad." + (as_file ? f->second : g.name)] = g.view.to(DType::f32);
    }
  }
  safetensors::save(a.out, res);
  std::printf("forward: %s, %lld token(s) in %lld sequence(s), dtype %s%s -> %s\n", a.model.c_str(),
              (long long)tb.num_tokens(), (long long)tb.sequences, a.dtype.c_str(),
              grads ? ", with parameter gradients" : "", a.out.c_str());
}

std::function<void()> setup_forward(CLI::App& app) {
  auto a = std::make_shared<ForwardArgs>();
  app.add_option("--model", a->model, "checkpoint directory (config.json + safetensors)")
      ->required();
  app.add_option("--tokens", a->tokens, "safetensors with input_ids [B, T] or [T] + cu_seqlens")
      ->required()
      ->check(input_file());
  app.add_option("--out", a->out, "output safetensors")->required();
  app.add_option("--grad-probe", a->probe,
                 "safetensors with probe [like last_hidden_state]: also write grad.NAME")
      ->check(input_file());
  app.add_option("--dtype", a->dtype, "compute dtype")->check(CLI::IsMember({"f32", "f64"}));
  app.add_flag("--logits", a->logits, "also write logits F32 [.., vocab]");
  app.add_option("--grad-layout", a->grad_layout,
                 "names of grad.NAME: published or module_tree (default: the checkpoint's)")
      ->check(CLI::IsMember({"published", "module_tree"}));
  app.add_option("--dsa-indices", a->dsa_indices,
                 "safetensors with layers.<i> [B, T, W]: replay these DSA selections")
      ->check(input_file());
  return [a] { run_forward(*a); };
}

}  // namespace

HLM_REGISTER_COMMAND("forward",
                     "run a checkpoint on token ids: hidden states, logits, parameter gradients",
                     setup_forward);

}  // namespace hlm::cli
