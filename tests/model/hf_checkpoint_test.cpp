// A checkpoint written by transformers' save_pretrained (tests/data/hf_glm5_next, made by
// tools/parity/make_hf_fixture.py with transformers 5.25): the published layout is detected and
// loaded with no config edit, the precision follows its dtype, forward and every gradient match
// transformers' float64 reference, save / load round trips are byte-identical in both layouts,
// and the layout rules (model/checkpoint_layout.h) hold name by name.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "core/json.h"
#include "core/safetensors.h"
#include "model/checkpoint.h"
#include "model/checkpoint_layout.h"
#include "model/config.h"
#include "model/hybrid_model.h"
#include "model/token_input.h"
#include "testing.h"

namespace hlm {
namespace {

namespace fs = std::filesystem;
using checkpoint::Layout;
using json = nlohmann::json;

const std::string kFixture = std::string(HLM_SOURCE_DIR) + "/tests/data/hf_glm5_next";

std::string temp_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / fmt::format("hlm_hf_{}_{}", ::getpid(), name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d.string();
}

HybridModelOptions options(DType dt) {
  HybridModelOptions o;
  o.dtype = dt;
  o.mtp = false;
  return o;
}

checkpoint::LoadOptions lm_head_optional() {
  checkpoint::LoadOptions lo;
  lo.allow_missing = true;  // a Glm5NextTextModel has no lm_head
  return lo;
}

// The dtype, shape and data bytes of every tensor of a checkpoint, by canonical name (lm_head,
// which a text model's checkpoint lacks, left out).
std::map<std::string, std::string> tensor_bytes(const std::string& path) {
  std::map<std::string, std::string> out;
  for (auto& [name, t] : checkpoint::read_checkpoint(path)) {
    if (name == "lm_head.weight") continue;
    const Tensor c = t.contiguous();
    out[name] = fmt::format("{}|{}|", dtype_name(c.dtype()), shape_str(c.shape())) +
                std::string(static_cast<const char*>(c.raw()), c.nbytes());
  }
  return out;
}

TEST(HfCheckpoint, TheConfigLoadsUneditedAndThePrecisionFollowsItsDtype) {
  const ModelConfig c = ModelConfig::load(kFixture);
  EXPECT_EQ(c.layer_pattern(), "KDK");  // layer_types: indexed_attention is a DSA layer
  EXPECT_EQ(c.precision.default_kind, GemmKind::native);
  EXPECT_EQ(c.precision_source, "the checkpoint's dtype float32");
  EXPECT_NE(c.precision_summary().find("GEMMs native (the checkpoint's dtype float32)"),
            std::string::npos);

  json j = read_json_file(kFixture + "/config.json");
  j["dtype"] = "bfloat16";
  EXPECT_EQ(ModelConfig::from_json(j, "c").precision.default_kind, GemmKind::bf16);
  j["gemm_precision"] = "native";  // named: it wins over the dtype
  const ModelConfig named = ModelConfig::from_json(j, "c");
  EXPECT_EQ(named.precision.default_kind, GemmKind::native);
  EXPECT_EQ(named.precision_source, "gemm_precision as given");
  j.erase("gemm_precision");
  j["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}};
  EXPECT_EQ(ModelConfig::from_json(j, "c").precision.default_kind, GemmKind::fp8_block);
  j.erase("quantization_config");
  j.erase("dtype");
  j["torch_dtype"] = "float64";
  EXPECT_EQ(ModelConfig::from_json(j, "c").precision.default_kind, GemmKind::native);
  j.erase("torch_dtype");
  const ModelConfig none = ModelConfig::from_json(j, "c");
  EXPECT_EQ(none.precision.default_kind, GemmKind::bf16);
  EXPECT_NE(none.precision_source.find("names neither"), std::string::npos);
  j["dtype"] = "int8";
  testing::expect_error([&] { ModelConfig::from_json(j, "c"); }, "'dtype' is 'int8'");
  // A saved config pins the precision it ran with.
  EXPECT_EQ(ModelConfig::from_json(ModelConfig::load(kFixture).to_json(), "c").precision_source,
            "gemm_precision as given");
}

// Forward with transformers' DSA selections replayed (exact score ties leave torch.topk's order
// unspecified), the probe loss backpropagated; every tensor against the float64 reference.
void check_against_transformers(DType dt, double tol) {
  const ModelConfig cfg = ModelConfig::load(kFixture);
  HybridModel model(cfg, options(dt));
  const checkpoint::LoadReport rep = checkpoint::load_module(kFixture, model, lm_head_optional());
  EXPECT_EQ(rep.layout, Layout::published);
  ASSERT_EQ(rep.missing, std::vector<std::string>{"lm_head.weight"});

  const TokenBatch tb =
      read_token_batch(safetensors::load(kFixture + "/tokens.safetensors"), cfg.vocab_size, "t");
  ModelInputs in;
  in.tokens = tb.tokens;
  in.cu_seqlens = tb.cu_seqlens;
  in.logits = false;
  in.aux_losses = false;
  in.dsa_indices =
      read_dsa_indices(safetensors::load(kFixture + "/indices.safetensors"), cfg, tb, "i");
  Context ctx;
  ctx.training = true;
  model.zero_grad();
  HybridModel::SavedPtr saved;
  const ModelOutput out = model.forward(ctx, in, &saved);
  const Tensor probe = safetensors::load(kFixture + "/probe.safetensors").tensors.at("probe");
  model.backward(ctx, *saved, probe.view({tb.num_tokens(), cfg.hidden_size}).to(dt));

  const safetensors::Contents ref = safetensors::load(kFixture + "/ref.safetensors");
  const Tensor h = out.hidden.to(DType::f32).view(probe.shape());
  EXPECT_TRUE(testing::close(h, ref.tensors.at("last_hidden_state"), {tol, 1e30}));
  size_t compared = 0;
  for (auto& [name, p] : model.named_parameters()) {
    if (name == "lm_head.weight") continue;
    // PyTorch names the text model's parameters without the "model." of the causal LM.
    auto r = ref.tensors.find("grad." + name.substr(std::strlen("model.")));
    if (r == ref.tensors.end()) {
      // transformers runs the indexer under no_grad (it is trained by its own KL loss only),
      // and the router's correction bias is a buffer (updated by counts, not by gradients).
      EXPECT_TRUE(name.find(".self_attn.indexer.") != std::string::npos ||
                  name.find(".mlp.gate.e_score_correction_bias") != std::string::npos)
          << name;
      continue;
    }
    EXPECT_TRUE(testing::close(p->grad.to(DType::f32), r->second, {tol, 1e30})) << name;
    ++compared;
  }
  EXPECT_EQ(compared + 1, ref.tensors.size());  // every reference gradient was compared
}

TEST(HfCheckpoint, ForwardAndEveryGradientMatchTransformersF32) {
  check_against_transformers(DType::f32, 1e-4);
}

TEST(HfCheckpoint, ForwardAndEveryGradientMatchTransformersF64) {
  // transformers computes the router, the mHC maps and the KDA core in float32 itself.
  check_against_transformers(DType::f64, 5e-5);
}

TEST(HfCheckpoint, SaveLoadRoundTripsAreByteIdenticalInBothLayouts) {
  const ModelConfig cfg = ModelConfig::load(kFixture);
  const auto original = tensor_bytes(kFixture + "/model.safetensors");
  HybridModel a(cfg, options(DType::f32));
  checkpoint::load_module(kFixture, a, lm_head_optional());

  const std::string pub = temp_dir("pub"), tree = temp_dir("tree"), pub2 = temp_dir("pub2");
  checkpoint::SaveOptions so;
  so.layout = Layout::published;
  checkpoint::save_module(pub, a, &cfg, so);
  EXPECT_EQ(tensor_bytes(pub), original);  // the same names, shapes, dtypes and bytes

  checkpoint::save_module(tree, a, &cfg);  // module tree: 4 fused experts tensors, one conv
  const auto tree_bytes = tensor_bytes(tree);
  EXPECT_TRUE(tree_bytes.count("model.layers.1.mlp.experts.gate_up_proj"));
  EXPECT_TRUE(tree_bytes.count("model.layers.0.self_attn.forget_gate.A_log"));
  EXPECT_LT(tree_bytes.size(), original.size());

  HybridModel b(cfg, options(DType::f32));
  const auto rep = checkpoint::load_module(tree, b, lm_head_optional());
  EXPECT_EQ(rep.layout, Layout::module_tree);
  checkpoint::save_module(pub2, b, &cfg, so);
  EXPECT_EQ(tensor_bytes(pub2), original);
  for (const auto& d : {pub, tree, pub2}) fs::remove_all(d);
}

TEST(HfCheckpointLayout, NamesMapBothWays) {
  const Tensor gu = Tensor::zeros({3, 4, 2}, DType::f32);  // E = 3, I = 2, D = 2
  const Tensor down = Tensor::zeros({3, 2, 2}, DType::f32);
  const Tensor conv = Tensor::zeros({7, 1, 4}, DType::f32);  // q 2 + k 2 + v 3 rows
  const std::vector<std::pair<std::string, Tensor>> model = {
      {"model.layers.0.attn_hc.fn", Tensor::zeros({2}, DType::f32)},
      {"model.layers.0.ffn_hc.scale", Tensor::zeros({3}, DType::f32)},
      {"model.layers.0.self_attn.forget_gate.A_log", Tensor::zeros({2}, DType::f32)},
      {"model.layers.0.self_attn.forget_gate.f_b_proj.weight", Tensor::zeros({2}, DType::f32)},
      {"model.layers.0.self_attn.q_proj.weight", Tensor::zeros({2, 5}, DType::f32)},
      {"model.layers.0.self_attn.k_proj.weight", Tensor::zeros({2, 5}, DType::f32)},
      {"model.layers.0.self_attn.conv1d.weight", conv},
      {"model.layers.1.mlp.experts.gate_up_proj", gu},
      {"model.layers.1.mlp.experts.down_proj", down},
      {"model.norm.weight", Tensor::zeros({5}, DType::f32)},
  };
  std::vector<std::string> names;
  for (const auto& f : checkpoint::file_tensors(model, Layout::published)) {
    names.push_back(f.name + shape_str(f.view.shape()));
    if (f.name == "model.layers.1.mlp.experts.2.up_proj.weight")  // rows I..2I-1 of expert 2
      EXPECT_EQ(static_cast<const float*>(f.view.raw()), gu.data<float>() + 2 * 8 + 4);
    if (f.name == "model.layers.0.self_attn.v_conv1d.weight")
      EXPECT_EQ(static_cast<const float*>(f.view.raw()), conv.data<float>() + 4 * 4);
  }
  const std::vector<std::string> want = {
      "model.layers.0.hc_attn_fn[2]",
      "model.layers.0.hc_ffn_scale[3]",
      "model.layers.0.self_attn.A_log[2]",
      "model.layers.0.self_attn.f_b_proj.weight[2]",
      "model.layers.0.self_attn.q_proj.weight[2, 5]",
      "model.layers.0.self_attn.k_proj.weight[2, 5]",
      "model.layers.0.self_attn.q_conv1d.weight[2, 1, 4]",
      "model.layers.0.self_attn.k_conv1d.weight[2, 1, 4]",
      "model.layers.0.self_attn.v_conv1d.weight[3, 1, 4]",
      "model.layers.1.mlp.experts.0.gate_proj.weight[2, 2]",
      "model.layers.1.mlp.experts.0.up_proj.weight[2, 2]",
      "model.layers.1.mlp.experts.1.gate_proj.weight[2, 2]",
      "model.layers.1.mlp.experts.1.up_proj.weight[2, 2]",
      "model.layers.1.mlp.experts.2.gate_proj.weight[2, 2]",
      "model.layers.1.mlp.experts.2.up_proj.weight[2, 2]",
      "model.layers.1.mlp.experts.0.down_proj.weight[2, 2]",
      "model.layers.1.mlp.experts.1.down_proj.weight[2, 2]",
      "model.layers.1.mlp.experts.2.down_proj.weight[2, 2]",
      "model.norm.weight[5]",
  };
  EXPECT_EQ(names, want);
  // The module tree is the identity.
  EXPECT_EQ(checkpoint::file_tensors(model, Layout::module_tree)[6].name,
            "model.layers.0.self_attn.conv1d.weight");
  // A conv without its layer's q_proj cannot be split.
  testing::expect_error(
      [&] {
        checkpoint::file_tensors({{"model.layers.0.self_attn.conv1d.weight", conv}},
                                 Layout::published);
      },
      "'model.layers.0.self_attn.q_proj.weight', which the model lacks");
}

TEST(HfCheckpointLayout, DetectionFromTheNamesPresent) {
  using checkpoint::detect_layout;
  EXPECT_EQ(detect_layout({"model.norm.weight", "model.layers.0.hc_attn_fn"}, "w"),
            Layout::published);
  EXPECT_EQ(detect_layout({"model.layers.3.mlp.experts.17.down_proj.weight"}, "w"),
            Layout::published);
  EXPECT_EQ(detect_layout({"model.layers.0.self_attn.v_conv1d.weight"}, "w"), Layout::published);
  EXPECT_EQ(detect_layout({"model.layers.0.self_attn.dt_bias"}, "w"), Layout::published);
  EXPECT_EQ(detect_layout({"model.layers.0.ffn_hc.base"}, "w"), Layout::module_tree);
  EXPECT_EQ(detect_layout({"model.layers.0.self_attn.forget_gate.A_log"}, "w"),
            Layout::module_tree);
  EXPECT_EQ(detect_layout({"model.layers.2.mlp.experts.gate_up_proj"}, "w"), Layout::module_tree);
  // Shared experts and dense MLPs are named alike in both; so is a layer without KDA or mHC.
  EXPECT_EQ(detect_layout({"model.layers.0.mlp.shared_experts.up_proj.weight",
                           "model.layers.0.mlp.gate_proj.weight", "model.norm.weight"},
                          "w"),
            Layout::module_tree);
  testing::expect_error(
      [&] {
        detect_layout({"model.layers.0.attn_hc.fn", "model.layers.1.hc_attn_fn"}, "ckpt.st");
      },
      "ckpt.st: the tensor names mix two checkpoint layouts: 'model.layers.0.attn_hc.fn' is named "
      "as in transformers' module tree, 'model.layers.1.hc_attn_fn' as in the published");
  testing::expect_error([&] { checkpoint::parse_layout("hf", "--layout"); },
                        "--layout: 'hf' is not a checkpoint layout");
}

// Malformed variants of the fixture: each load fails naming the tensor or file.
class HfCheckpointBad : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = temp_dir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::copy_file(kFixture + "/config.json", dir_ + "/config.json");
    contents_ = safetensors::load(kFixture + "/model.safetensors");
  }
  void TearDown() override { fs::remove_all(dir_); }
  void write() { safetensors::save(dir_ + "/model.safetensors", contents_.tensors); }
  void load_fails(const std::string& needle,
                  const checkpoint::LoadOptions& lo = lm_head_optional()) {
    const ModelConfig cfg = ModelConfig::load(dir_);
    HybridModel m(cfg, options(DType::f32));
    testing::expect_error([&] { checkpoint::load_module(dir_, m, lo); }, needle);
  }
  std::string dir_;
  safetensors::Contents contents_;
};

TEST_F(HfCheckpointBad, AMissingExpertIsNamed) {
  contents_.tensors.erase("layers.1.mlp.experts.2.up_proj.weight");
  write();
  load_fails(
      "2 tensors the model expects are missing: 'lm_head.weight', "
      "'model.layers.1.mlp.experts.2.up_proj.weight'",
      {});
}

TEST_F(HfCheckpointBad, AShapeOffByOneIsNamed) {
  Tensor& q = contents_.tensors.at("layers.0.self_attn.q_conv1d.weight");
  q = Tensor::zeros({q.size(0) + 1, q.size(1), q.size(2)}, q.dtype());
  write();
  load_fails(
      "'layers.0.self_attn.q_conv1d.weight' (as "
      "'model.layers.0.self_attn.q_conv1d.weight') has shape [33, 1, 4] in the "
      "checkpoint but the model expects [32, 1, 4]");
}

TEST_F(HfCheckpointBad, MixedLayoutsAreRefused) {
  contents_.tensors["layers.2.attn_hc.fn"] = contents_.tensors.at("layers.2.hc_attn_fn");
  contents_.tensors.erase("layers.2.hc_attn_fn");
  write();
  load_fails("mix two checkpoint layouts");
}

TEST_F(HfCheckpointBad, AnUnknownLayerTypeIsNamed) {
  json j = read_json_file(dir_ + "/config.json");
  j["layer_types"][1] = "sliding_attention";
  std::ofstream(dir_ + "/config.json") << j.dump();
  testing::expect_error([&] { ModelConfig::load(dir_); },
                        "'layer_types[1]' is 'sliding_attention', expected linear_attention");
}

TEST_F(HfCheckpointBad, AShardIndexNamingAMissingFileIsNamed) {
  json idx = {{"metadata", json::object()}, {"weight_map", json::object()}};
  for (auto& [name, t] : contents_.tensors)
    idx["weight_map"][name] = name.find("layers.2.") == 0 ? "model-00002-of-00002.safetensors"
                                                          : "model-00001-of-00002.safetensors";
  safetensors::save(dir_ + "/model-00001-of-00002.safetensors", contents_.tensors);
  std::ofstream(dir_ + "/" + checkpoint::kIndexFile) << idx.dump();
  load_fails("shard '" + dir_ + "/model-00002-of-00002.safetensors' does not exist");
}

TEST_F(HfCheckpointBad, ShardedPublishedCheckpointsLoad) {
  // The same tensors split over two shards by an index load like the single file.
  json idx = {{"metadata", json::object()}, {"weight_map", json::object()}};
  safetensors::TensorMap a, b;
  for (auto& [name, t] : contents_.tensors) {
    const bool second = name.find("layers.1.") == 0;
    (second ? b : a)[name] = t;
    idx["weight_map"][name] =
        second ? "model-00002-of-00002.safetensors" : "model-00001-of-00002.safetensors";
  }
  safetensors::save(dir_ + "/model-00001-of-00002.safetensors", a);
  safetensors::save(dir_ + "/model-00002-of-00002.safetensors", b);
  std::ofstream(dir_ + "/" + checkpoint::kIndexFile) << idx.dump();
  const ModelConfig cfg = ModelConfig::load(dir_);
  HybridModel m(cfg, options(DType::f32)), ref(cfg, options(DType::f32));
  EXPECT_EQ(checkpoint::load_module(dir_, m, lm_head_optional()).layout, Layout::published);
  checkpoint::load_module(kFixture, ref, lm_head_optional());
  auto pm = m.named_parameters(), pr = ref.named_parameters();
  ASSERT_EQ(pm.size(), pr.size());
  for (size_t i = 0; i < pm.size(); ++i)
    if (pm[i].first != "lm_head.weight")  // not in the checkpoint
      EXPECT_TRUE(testing::bit_equal(pm[i].second->value, pr[i].second->value)) << pm[i].first;
}

}  // namespace
}  // namespace hlm
