// Checkpoint I/O (model/checkpoint.h): bit-exact save/load in every dtype, single and sharded,
// checkpoint name prefixes, dtype conversion and block-FP8 dequantisation on load, the error for
// each kind of bad checkpoint, atomic saves under simulated failures, tensor maps.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <stdexcept>

#include "core/error.h"
#include "core/rng.h"
#include "core/safetensors.h"
#include "layers/module.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "testing.h"

namespace hlm {
namespace {

namespace fs = std::filesystem;
using checkpoint::LoadOptions;
using checkpoint::NamedTensors;
using checkpoint::SaveOptions;
using checkpoint::Targets;

// Directories made by fresh_dir, removed when the test program ends.
class TempDirCleanup : public ::testing::Environment {
 public:
  static std::vector<std::string>& dirs() {
    static std::vector<std::string> d;
    return d;
  }
  void TearDown() override {
    std::error_code ec;
    for (auto& d : dirs()) fs::remove_all(d, ec);
  }
};
[[maybe_unused]] ::testing::Environment* const g_cleanup =
    ::testing::AddGlobalTestEnvironment(new TempDirCleanup);

std::string fresh_dir(const std::string& tag) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const fs::path d =
      fs::path(::testing::TempDir()) /
      ("hlm_ckpt_" + std::string(info->name()) + "_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  TempDirCleanup::dirs().push_back(d.string());
  return d.string();
}

std::vector<std::string> temp_files(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.find(".tmp.") != std::string::npos) out.push_back(n);
  }
  return out;
}

::testing::AssertionResult mentions(const std::string& msg,
                                    std::initializer_list<std::string> needles) {
  if (msg.empty()) return ::testing::AssertionFailure() << "no hlm::Error was thrown";
  for (const auto& n : needles)
    if (msg.find(n) == std::string::npos)
      return ::testing::AssertionFailure() << "message does not mention '" << n << "': " << msg;
  return ::testing::AssertionSuccess();
}

ModelConfig tiny_config() {
  return ModelConfig::load(std::string(HLM_SOURCE_DIR) + "/configs/tiny.json");
}

// Random tensors of every dtype under model-tree names.
NamedTensors every_dtype(Rng& rng) {
  NamedTensors t;
  const DType floats[] = {DType::f64, DType::f32,  DType::bf16,
                          DType::f16, DType::e4m3, DType::e5m2};
  int i = 0;
  for (DType dt : floats) {
    t.emplace_back(fmt::format("model.layers.{}.self_attn.w_{}.weight", i, dtype_name(dt)),
                   randn({7, 6 + i}, dt, rng));
    ++i;
  }
  t.emplace_back("model.layers.0.ids64", Tensor::from_values({3}, {0, -1, 1e12}, DType::i64));
  t.emplace_back("model.layers.0.ids32", Tensor::from_values({2, 2}, {1, 2, 3, -4}, DType::i32));
  t.emplace_back("model.layers.0.bytes", Tensor::from_values({3}, {0, 7, 255}, DType::u8));
  t.emplace_back("model.norm.weight", randn({16}, DType::f32, rng));
  t.emplace_back("lm_head.weight", randn({16, 9}, DType::bf16, rng));
  return t;
}

// Targets of the same shapes and dtypes, poisoned.
struct Holder {
  std::vector<std::pair<std::string, Tensor>> tensors;
  Targets targets() {
    Targets t;
    for (auto& [n, v] : tensors) t.emplace_back(n, &v);
    return t;
  }
};
Holder holder_like(const NamedTensors& src) {
  Holder h;
  for (auto& [n, t] : src) {
    Tensor x = Tensor::empty(t.shape(), t.dtype());
    if (x.nbytes()) std::memset(x.raw(), 0x5a, x.nbytes());
    h.tensors.emplace_back(n, x);
  }
  return h;
}

void expect_same(const NamedTensors& a, const Holder& b) {
  ASSERT_EQ(a.size(), b.tensors.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(b.tensors[i].second.dtype(), a[i].second.dtype()) << a[i].first;
    EXPECT_TRUE(testing::bit_equal(b.tensors[i].second, a[i].second)) << a[i].first;
  }
}

TEST(CheckpointIo, SaveLoadBitIdenticalEveryDtype) {
  Rng rng(testing::test_seed());
  const NamedTensors src = every_dtype(rng);
  const ModelConfig cfg = tiny_config();

  // single file
  const std::string d1 = fresh_dir("single");
  checkpoint::save_checkpoint(d1, src, &cfg);
  EXPECT_TRUE(fs::exists(fs::path(d1) / "model.safetensors"));
  EXPECT_FALSE(fs::exists(fs::path(d1) / "model.safetensors.index.json"));
  EXPECT_EQ(ModelConfig::load(d1), cfg);  // config.json written next to the weights
  Holder h1 = holder_like(src);
  const auto rep1 = checkpoint::load_into(d1, h1.targets());
  EXPECT_EQ(rep1.loaded.size(), src.size());
  EXPECT_EQ(rep1.files.size(), 1u);
  expect_same(src, h1);
  EXPECT_TRUE(temp_files(d1).empty());

  // sharded: a small limit forces several shards
  const std::string d2 = fresh_dir("sharded");
  SaveOptions so;
  so.max_shard_bytes = 200;
  so.metadata["note"] = "test";
  checkpoint::save_checkpoint(d2, src, &cfg, so);
  EXPECT_FALSE(fs::exists(fs::path(d2) / "model.safetensors"));
  const nlohmann::json index = read_json_file((fs::path(d2) / "model.safetensors.index.json"));
  std::set<std::string> shard_files;
  uint64_t total = 0;
  for (auto& [n, t] : src) {
    ASSERT_TRUE(index["weight_map"].contains(n)) << n;
    shard_files.insert(index["weight_map"][n].get<std::string>());
    total += t.nbytes();
  }
  EXPECT_EQ(index["weight_map"].size(), src.size());
  EXPECT_GE(shard_files.size(), 3u);
  EXPECT_EQ(index["metadata"]["total_size"], total);
  for (auto& f : shard_files) {
    EXPECT_TRUE(f.find("-of-") != std::string::npos) << f;
    const auto c = safetensors::load((fs::path(d2) / f).string());
    EXPECT_EQ(c.metadata.at("note"), "test");
    EXPECT_EQ(c.metadata.at("format"), "pt");
    uint64_t bytes = 0;
    for (auto& [n, t] : c.tensors) bytes += t.nbytes();
    EXPECT_TRUE(bytes <= 200 || c.tensors.size() == 1) << f;  // a big tensor gets its own shard
  }
  Holder h2 = holder_like(src);
  const auto rep2 = checkpoint::load_into(d2, h2.targets());
  EXPECT_EQ(rep2.files.size(), shard_files.size());
  expect_same(src, h2);
  // Also through the index path and read_checkpoint.
  Holder h3 = holder_like(src);
  checkpoint::load_into((fs::path(d2) / "model.safetensors.index.json").string(), h3.targets());
  expect_same(src, h3);
  const auto all = checkpoint::read_checkpoint(d2);
  ASSERT_EQ(all.size(), src.size());
  for (auto& [n, t] : src) EXPECT_TRUE(testing::bit_equal(all.at(n), t)) << n;
  EXPECT_TRUE(temp_files(d2).empty());
}

TEST(CheckpointIo, PrefixesAccepted) {
  EXPECT_EQ(checkpoint::canonical_name("model.layers.0.self_attn.q_proj.weight"),
            "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(checkpoint::canonical_name("model.language_model.layers.3.mlp.gate.weight"),
            "model.layers.3.mlp.gate.weight");
  EXPECT_EQ(checkpoint::canonical_name("language_model.model.norm.weight"), "model.norm.weight");
  EXPECT_EQ(checkpoint::canonical_name("language_model.lm_head.weight"), "lm_head.weight");
  EXPECT_EQ(checkpoint::canonical_name("lm_head.weight"), "lm_head.weight");
  EXPECT_EQ(checkpoint::canonical_name("embed_tokens.weight"), "model.embed_tokens.weight");

  Rng rng(testing::test_seed());
  const std::string d = fresh_dir("p");
  safetensors::TensorMap m;
  m["model.language_model.layers.0.w"] = randn({3, 4}, DType::bf16, rng);
  m["language_model.lm_head.weight"] = randn({5, 4}, DType::f32, rng);
  m["layers.1.w"] = randn({2}, DType::f32, rng);
  m["model.norm.weight"] = randn({4}, DType::f32, rng);
  m["model.visual.blocks.0.w"] = randn({2}, DType::f32, rng);
  safetensors::save((fs::path(d) / "model.safetensors").string(), m);
  const NamedTensors want = {{"model.layers.0.w", m["model.language_model.layers.0.w"]},
                             {"lm_head.weight", m["language_model.lm_head.weight"]},
                             {"model.layers.1.w", m["layers.1.w"]},
                             {"model.norm.weight", m["model.norm.weight"]}};
  Holder h = holder_like(want);
  LoadOptions o;
  o.ignore_prefixes = {"model.visual."};
  const auto rep = checkpoint::load_into(d, h.targets(), o);
  expect_same(want, h);
  EXPECT_EQ(rep.ignored, (std::vector<std::string>{"model.visual.blocks.0.w"}));

  // Two spellings of one tensor collide.
  m["model.language_model.norm.weight"] = randn({4}, DType::f32, rng);
  safetensors::save((fs::path(d) / "model.safetensors").string(), m);
  EXPECT_TRUE(mentions(testing::error_of([&] { checkpoint::load_into(d, h.targets(), o); }),
                       {"model.language_model.norm.weight", "'model.norm.weight'", "both map"}));
}

TEST(CheckpointIo, DtypeConversionOnLoad) {
  Rng rng(testing::test_seed());
  const std::string d = fresh_dir("c");
  const Tensor w32 = randn({6, 10}, DType::f32, rng);
  const Tensor w16 = randn({4, 3}, DType::bf16, rng);
  checkpoint::save_checkpoint(d, {{"a", w32}, {"b", w16}}, nullptr);
  for (DType dt : {DType::f64, DType::bf16, DType::f16, DType::e4m3, DType::e5m2}) {
    Tensor a = Tensor::zeros({6, 10}, dt), b = Tensor::zeros({4, 3}, DType::f32);
    checkpoint::load_into(d, {{"model.a", &a}, {"model.b", &b}});  // bare names map to model.
    EXPECT_TRUE(testing::bit_equal(a, w32.to(dt))) << dtype_name(dt);
    EXPECT_TRUE(testing::bit_equal(b, w16.to(DType::f32)));  // exact widening
  }
  // Integer and floating tensors do not convert into each other.
  Tensor ia = Tensor::zeros({6, 10}, DType::i32), b = Tensor::zeros({4, 3}, DType::f32);
  EXPECT_TRUE(mentions(testing::error_of([&] {
                         checkpoint::load_into(d, {{"model.a", &ia}, {"model.b", &b}});
                       }),
                       {"'model.a'", "f32", "i32"}));
  // A value that overflows the target dtype is caught after the conversion.
  const std::string d2 = fresh_dir("ovf");
  checkpoint::save_checkpoint(d2, {{"model.x", Tensor::from_values({2}, {1.0, 1e6}, DType::f32)}},
                              nullptr);
  Tensor x16 = Tensor::zeros({2}, DType::f16);
  EXPECT_TRUE(mentions(testing::error_of([&] {
                         checkpoint::load_into(d2, {{"model.x", &x16}});
                       }),
                       {"'model.x'", "after conversion", "flat index 1"}));
}

TEST(CheckpointIo, BlockFp8WeightsAreDequantised) {
  Rng rng(testing::test_seed());
  // [3, 200] with 128 x 128 blocks: scale_inv [1, 2]
  const Tensor w8 = randn({3, 200}, DType::e4m3, rng, 50.0);
  const Tensor s = Tensor::from_values({1, 2}, {0.5, 0.03125}, DType::f32);
  std::vector<double> expect = w8.to_f64_vector();
  for (int64_t r = 0; r < 3; ++r)
    for (int64_t c = 0; c < 200; ++c) expect[size_t(r * 200 + c)] *= c < 128 ? 0.5 : 0.03125;
  const Tensor ref = Tensor::from_values({3, 200}, expect, DType::f32);
  const Tensor other = randn({4}, DType::f32, rng);
  for (uint64_t limit : {uint64_t(0), uint64_t(16)}) {  // single file; scale in another shard
    const std::string d = fresh_dir(std::to_string(limit));
    SaveOptions so;
    so.max_shard_bytes = limit;
    checkpoint::save_checkpoint(d,
                                {{"model.layers.0.mlp.down_proj.weight", w8},
                                 {"model.layers.0.other", other},
                                 {"model.layers.0.mlp.down_proj.weight_scale_inv", s}},
                                nullptr, so);
    Tensor w = Tensor::zeros({3, 200}, DType::f32), o = Tensor::zeros({4}, DType::f32);
    const auto rep = checkpoint::load_into(
        d, {{"model.layers.0.mlp.down_proj.weight", &w}, {"model.layers.0.other", &o}});
    EXPECT_TRUE(testing::bit_equal(w, ref));
    EXPECT_EQ(rep.dequantized, (std::vector<std::string>{"model.layers.0.mlp.down_proj.weight"}));
    const auto all = checkpoint::read_checkpoint(d);
    EXPECT_EQ(all.size(), 2u);  // the scale is consumed
    EXPECT_TRUE(testing::bit_equal(all.at("model.layers.0.mlp.down_proj.weight"), ref));
    // A model that stores the FP8 weight and its scale itself gets them as they are.
    Tensor w8t = Tensor::zeros({3, 200}, DType::e4m3), st = Tensor::zeros({1, 2}, DType::f32);
    checkpoint::load_into(d, {{"model.layers.0.mlp.down_proj.weight", &w8t},
                              {"model.layers.0.mlp.down_proj.weight_scale_inv", &st},
                              {"model.layers.0.other", &o}});
    EXPECT_TRUE(testing::bit_equal(w8t, w8));
    EXPECT_TRUE(testing::bit_equal(st, s));
  }
  // Stacked experts [E, R, C] and a scale of the wrong shape.
  const Tensor e8 = randn({2, 130, 3}, DType::e5m2, rng);
  const Tensor es = Tensor::from_values({2, 2, 1}, {1, 2, 4, 8}, DType::f32);
  const Tensor deq = checkpoint::dequantize_fp8_blockwise(e8, es, 128, 128, "e");
  EXPECT_EQ(deq.at({1, 129, 2}), e8.at({1, 129, 2}) * 8);
  EXPECT_EQ(deq.at({0, 127, 0}), e8.at({0, 127, 0}) * 1);
  EXPECT_EQ(deq.at({0, 128, 1}), e8.at({0, 128, 1}) * 2);
  EXPECT_TRUE(mentions(testing::error_of([&] {
                         checkpoint::dequantize_fp8_blockwise(
                             e8, Tensor::zeros({2, 1, 1}, DType::f32), 128, 128, "experts");
                       }),
                       {"experts", "scale_inv", "[2, 1, 1]", "[2, 2, 1]"}));
}

TEST(CheckpointIo, ErrorsNameTheTensorOrFile) {
  Rng rng(testing::test_seed());
  const std::string d = fresh_dir("e");
  const NamedTensors src = {{"model.layers.0.a", randn({2, 3}, DType::f32, rng)},
                            {"model.layers.0.b", randn({4}, DType::bf16, rng)},
                            {"model.layers.45.eh_proj.weight", randn({2, 4}, DType::bf16, rng)},
                            {"lm_head.weight", randn({3, 2}, DType::f32, rng)}};
  checkpoint::save_checkpoint(d, src, nullptr);
  Tensor a = Tensor::zeros({2, 3}, DType::f32), b = Tensor::zeros({4}, DType::bf16);
  Tensor head = Tensor::zeros({3, 2}, DType::f32), extra = Tensor::zeros({5}, DType::f32);
  const Targets base = {
      {"model.layers.0.a", &a}, {"model.layers.0.b", &b}, {"lm_head.weight", &head}};

  // unexpected (the MTP layer when MTP is off) ...
  EXPECT_TRUE(mentions(testing::error_of([&] { checkpoint::load_into(d, base); }),
                       {"unexpected", "'model.layers.45.eh_proj.weight'"}));
  LoadOptions allow;
  allow.allow_unexpected = true;
  EXPECT_EQ(checkpoint::load_into(d, base, allow).unexpected,
            (std::vector<std::string>{"model.layers.45.eh_proj.weight"}));
  LoadOptions from;
  from.ignore_layers_from = 45;  // num_hidden_layers + 0 MTP layers
  EXPECT_EQ(checkpoint::load_into(d, base, from).ignored,
            (std::vector<std::string>{"model.layers.45.eh_proj.weight"}));
  from.ignore_layers_from = 46;
  EXPECT_THROW(checkpoint::load_into(d, base, from), Error);
  // ... missing ...
  Targets more = base;
  more.emplace_back("model.layers.1.missing", &extra);
  EXPECT_TRUE(mentions(testing::error_of([&] { checkpoint::load_into(d, more, allow); }),
                       {"missing", "'model.layers.1.missing'"}));
  LoadOptions lax = allow;
  lax.allow_missing = true;
  EXPECT_EQ(checkpoint::load_into(d, more, lax).missing,
            (std::vector<std::string>{"model.layers.1.missing"}));
  // ... wrong shape ...
  Tensor a_bad = Tensor::zeros({3, 2}, DType::f32);
  Targets shape = base;
  shape[0].second = &a_bad;
  EXPECT_TRUE(mentions(testing::error_of([&] { checkpoint::load_into(d, shape, allow); }),
                       {"'model.layers.0.a'", "[2, 3]", "[3, 2]"}));
  // ... duplicate targets
  Targets dup = base;
  dup.push_back(base[0]);
  EXPECT_TRUE(mentions(testing::error_of([&] { checkpoint::load_into(d, dup, allow); }),
                       {"model.layers.0.a", "twice"}));

  // NaN / Inf in a loaded tensor.
  const std::string dn = fresh_dir("nan");
  Tensor nan = randn({2, 3}, DType::f32, rng);
  nan.data<float>()[4] = std::numeric_limits<float>::quiet_NaN();
  Tensor inf =
      Tensor::from_values({4}, {1, 2, 3, std::numeric_limits<double>::infinity()}, DType::bf16);
  checkpoint::save_checkpoint(dn, {{"model.layers.0.a", nan}}, nullptr);
  EXPECT_TRUE(mentions(testing::error_of([&] {
                         checkpoint::load_into(dn, {{"model.layers.0.a", &a}});
                       }),
                       {"'model.layers.0.a'", "non-finite", "index 4"}));
  LoadOptions unchecked;
  unchecked.check_finite = false;
  EXPECT_NO_THROW(checkpoint::load_into(dn, {{"model.layers.0.a", &a}}, unchecked));
  checkpoint::save_checkpoint(dn, {{"model.layers.0.b", inf}}, nullptr);
  EXPECT_TRUE(mentions(testing::error_of([&] {
                         checkpoint::load_into(dn, {{"model.layers.0.b", &b}});
                       }),
                       {"'model.layers.0.b'", "inf", "index 3"}));

  // Truncated files: the single file and one shard.
  const std::string dt = fresh_dir("trunc");
  checkpoint::save_checkpoint(dt, src, nullptr);
  const fs::path single = fs::path(dt) / "model.safetensors";
  fs::resize_file(single, fs::file_size(single) - 5);
  EXPECT_TRUE(mentions(testing::error_of([&] { checkpoint::load_into(dt, base, allow); }),
                       {single.string()}));
  const std::string ds = fresh_dir("trunc_shard");
  SaveOptions so;
  so.max_shard_bytes = 16;
  checkpoint::save_checkpoint(ds, src, nullptr, so);
  const fs::path shard = fs::path(ds) / "model-00002-of-00004.safetensors";
  ASSERT_TRUE(fs::exists(shard));
  fs::resize_file(shard, 12);
  EXPECT_TRUE(mentions(testing::error_of([&] { checkpoint::load_into(ds, base, allow); }),
                       {shard.string()}));
  // A shard the index names but that is gone; an index entry its shard does not hold.
  fs::remove(shard);
  EXPECT_TRUE(mentions(testing::error_of([&] { checkpoint::load_into(ds, base, allow); }),
                       {"model-00002-of-00004.safetensors", "does not exist"}));
  checkpoint::save_checkpoint(ds, src, nullptr, so);
  auto index = read_json_file((fs::path(ds) / "model.safetensors.index.json").string());
  index["weight_map"]["model.layers.0.a"] = "model-00004-of-00004.safetensors";
  std::ofstream((fs::path(ds) / "model.safetensors.index.json").string()) << index.dump();
  EXPECT_TRUE(mentions(testing::error_of([&] { checkpoint::load_into(ds, base, allow); }),
                       {"model.layers.0.a"}));
  // Both layouts present; nothing present.
  checkpoint::save_checkpoint(ds, src, nullptr, so);
  fs::copy_file(single.string() + "", (fs::path(ds) / "model.safetensors").string());
  EXPECT_TRUE(mentions(testing::error_of([&] { checkpoint::load_into(ds, base, allow); }),
                       {"both", "model.safetensors.index.json"}));
  EXPECT_TRUE(mentions(testing::error_of([&] { checkpoint::load_into(fresh_dir("empty"), base); }),
                       {"neither"}));
  EXPECT_TRUE(mentions(testing::error_of([&] { checkpoint::load_into(d + "/nope", base); }),
                       {"does not exist"}));
}

class TestLeaf : public Module {
 public:
  explicit TestLeaf(Rng& rng) {
    add_param("q_proj.weight", randn({4, 6}, DType::f32, rng));
    add_param("A_log", randn({4}, DType::f32, rng), /*keep_fp32=*/true);
  }
};
class TestModel : public Module {
 public:
  explicit TestModel(Rng& rng) : l0(rng), l1(rng) {
    add_param("model.embed_tokens.weight", randn({10, 6}, DType::f32, rng));
    add_child("model.layers.0.self_attn", &l0);
    add_child("model.layers.1.self_attn", &l1);
    add_param("lm_head.weight", randn({10, 6}, DType::f32, rng));
  }
  TestLeaf l0, l1;
};

TEST(CheckpointIo, ModuleSaveLoad) {
  Rng rng(testing::test_seed());
  TestModel a(rng), b(rng);
  const std::string d = fresh_dir("m");
  const ModelConfig cfg = tiny_config();
  SaveOptions so;
  so.cast_floating_to = DType::bf16;  // an export: bf16 except keep-in-FP32 parameters
  checkpoint::save_module(d, a, &cfg, so);
  const auto stored = checkpoint::read_checkpoint(d);
  EXPECT_EQ(stored.at("model.layers.1.self_attn.q_proj.weight").dtype(), DType::bf16);
  EXPECT_EQ(stored.at("model.layers.1.self_attn.A_log").dtype(), DType::f32);
  const auto rep = checkpoint::load_module(d, b);
  EXPECT_EQ(rep.loaded.size(), a.named_parameters().size());
  auto pa = a.named_parameters(), pb = b.named_parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    ASSERT_EQ(pa[i].first, pb[i].first);
    const bool keep = pa[i].second->keep_fp32;
    EXPECT_EQ(pb[i].second->value.dtype(), DType::f32);  // the parameter's dtype stays
    EXPECT_TRUE(testing::bit_equal(
        pb[i].second->value,
        keep ? pa[i].second->value : pa[i].second->value.to(DType::bf16).to(DType::f32)))
        << pa[i].first;
  }
  // Without the cast the round trip is exact.
  TestModel c(rng);
  checkpoint::save_module(d, a, &cfg);
  checkpoint::load_module(d, c);
  for (auto& [n, p] : a.named_parameters())
    EXPECT_TRUE(testing::bit_equal(c.find_parameter(n)->value, p->value)) << n;
}

TEST(CheckpointIo, AtomicSaveKeepsPreviousCheckpoint) {
  Rng rng(testing::test_seed());
  auto make = [&](int n) {
    NamedTensors t;
    for (int i = 0; i < n; ++i)
      t.emplace_back(fmt::format("model.layers.{}.w", i), randn({4, 4}, DType::f32, rng));
    return t;
  };
  auto expect_loads = [&](const std::string& dir, const NamedTensors& want) {
    Holder h = holder_like(want);
    checkpoint::load_into(dir, h.targets());
    expect_same(want, h);
  };
  const ModelConfig cfg = tiny_config();
  for (uint64_t limit : {uint64_t(0), uint64_t(64)}) {
    const std::string d = fresh_dir(std::to_string(limit));
    SaveOptions so;
    so.max_shard_bytes = limit;
    const NamedTensors A = make(4);
    checkpoint::save_checkpoint(d, A, &cfg, so);
    // B has the same names: a crash while writing it must not touch A.
    NamedTensors B = A;
    for (auto& [n, t] : B) t = randn({4, 4}, DType::f32, rng);
    ModelConfig cfg_b = cfg;
    cfg_b.hidden_size = 96;
    const int files = limit ? 6 : 2;  // 4 shards + config + index, or weights + config
    for (int fail_at : {1, 2, files}) {
      SaveOptions crash = so;
      int seen = 0;
      crash.after_temp_written = [&](const std::string& tmp) {
        EXPECT_TRUE(fs::exists(tmp));
        if (++seen == fail_at) throw std::runtime_error("simulated crash");
      };
      EXPECT_THROW(checkpoint::save_checkpoint(d, B, &cfg_b, crash), std::runtime_error);
      expect_loads(d, A);
      EXPECT_EQ(ModelConfig::load(d), cfg);
      EXPECT_TRUE(temp_files(d).empty()) << temp_files(d)[0];
    }
    // A directory that cannot be created: an error, and A is untouched.
    const std::string blocker = (fs::path(d) / "model.safetensors.blocker").string();
    std::ofstream(blocker) << "x";
    EXPECT_TRUE(mentions(
        testing::error_of([&] { checkpoint::save_checkpoint(blocker + "/sub", B, &cfg_b); }),
        {"sub"}));
    expect_loads(d, A);
    fs::remove(blocker);
    // A successful save replaces A; stale files of other layouts / shard counts go away.
    const NamedTensors C = make(2);
    checkpoint::save_checkpoint(d, C, &cfg_b, so);
    expect_loads(d, C);
    EXPECT_EQ(ModelConfig::load(d), cfg_b);
    SaveOptions other = so;
    other.max_shard_bytes = limit ? 0 : 64;  // switch layout
    checkpoint::save_checkpoint(d, A, &cfg, other);
    expect_loads(d, A);
    size_t shards = 0;
    for (const auto& e : fs::directory_iterator(d))
      shards += e.path().filename().string().rfind("model-", 0) == 0;
    EXPECT_EQ(shards, other.max_shard_bytes ? 4u : 0u);
    EXPECT_EQ(fs::exists(fs::path(d) / "model.safetensors"), other.max_shard_bytes == 0);
    EXPECT_EQ(fs::exists(fs::path(d) / "model.safetensors.index.json"), other.max_shard_bytes != 0);
    EXPECT_TRUE(temp_files(d).empty());
  }
}

TEST(CheckpointIo, InterruptedOverwriteIsDetected) {
  Rng rng(testing::test_seed());
  NamedTensors a, b;
  for (int i = 0; i < 3; ++i) {
    a.emplace_back(fmt::format("model.layers.{}.w", i), randn({4, 4}, DType::f32, rng));
    b.emplace_back(fmt::format("model.layers.{}.w", i), randn({4, 4}, DType::f32, rng));
  }
  SaveOptions so;
  so.max_shard_bytes = 64;
  const std::string da = fresh_dir("a"), db = fresh_dir("b");
  checkpoint::save_checkpoint(da, a, nullptr, so);
  checkpoint::save_checkpoint(db, b, nullptr, so);
  // What a crash between the shard renames of an overwrite leaves: one new shard, old index.
  const std::string shard = "model-00002-of-00003.safetensors";
  fs::copy_file(fs::path(db) / shard, fs::path(da) / shard, fs::copy_options::overwrite_existing);
  Holder h = holder_like(a);
  EXPECT_TRUE(mentions(testing::error_of([&] { checkpoint::load_into(da, h.targets()); }),
                       {shard, "another save"}));
}

TEST(CheckpointTensorMap, SaveLoadAtomic) {
  Rng rng(testing::test_seed());
  const std::string d = fresh_dir("t");
  const std::string path = (fs::path(d) / "optim" / "state.safetensors").string();
  checkpoint::TensorMap m;
  m["exp_avg.model.layers.0.w"] = randn({3, 5}, DType::f32, rng);
  m["exp_avg_sq.model.layers.0.w"] = randn({3, 5}, DType::f32, rng);
  m["step"] = Tensor::from_values({1}, {1234}, DType::i64);
  checkpoint::save_tensor_map(path, m, {{"kind", "adamw"}});
  auto c = checkpoint::load_tensor_map(path);
  EXPECT_EQ(c.metadata.at("kind"), "adamw");
  ASSERT_EQ(c.tensors.size(), m.size());
  for (auto& [n, t] : m) EXPECT_TRUE(testing::bit_equal(c.tensors.at(n), t)) << n;

  checkpoint::TensorMap m2 = m;
  m2["step"] = Tensor::from_values({1}, {1235}, DType::i64);
  SaveOptions crash;
  crash.after_temp_written = [](const std::string&) { throw std::runtime_error("crash"); };
  EXPECT_THROW(checkpoint::save_tensor_map(path, m2, {}, crash), std::runtime_error);
  EXPECT_EQ(checkpoint::load_tensor_map(path).tensors.at("step").item(), 1234);
  EXPECT_TRUE(temp_files(fs::path(path).parent_path().string()).empty());

  m2["exp_avg.model.layers.0.w"].data<float>()[7] = std::numeric_limits<float>::infinity();
  checkpoint::save_tensor_map(path, m2);
  EXPECT_TRUE(mentions(testing::error_of([&] { checkpoint::load_tensor_map(path); }),
                       {"'exp_avg.model.layers.0.w'", "index 7"}));
  EXPECT_EQ(checkpoint::load_tensor_map(path, false).tensors.at("step").item(), 1235);
}

TEST(CheckpointIo, FirstNonFinite) {
  EXPECT_EQ(checkpoint::first_non_finite(Tensor::from_values({3}, {1, 2, 3}, DType::f64)), -1);
  for (DType dt : {DType::f64, DType::f32, DType::bf16, DType::f16}) {
    Tensor t = Tensor::from_values({4}, {0, 1, std::numeric_limits<double>::infinity(), 2}, dt);
    EXPECT_EQ(checkpoint::first_non_finite(t), 2) << dtype_name(dt);
    t = Tensor::from_values({2}, {std::nan(""), 1}, dt);
    EXPECT_EQ(checkpoint::first_non_finite(t), 0) << dtype_name(dt);
  }
  Tensor e5 = Tensor::zeros({3}, DType::e5m2);
  static_cast<uint8_t*>(e5.raw())[2] = 0xfc;  // E5M2 -inf
  EXPECT_EQ(checkpoint::first_non_finite(e5), 2);
  static_cast<uint8_t*>(e5.raw())[2] = 0x7b;  // 57344: finite
  EXPECT_EQ(checkpoint::first_non_finite(e5), -1);
  Tensor e = Tensor::zeros({3}, DType::e4m3);
  static_cast<uint8_t*>(e.raw())[1] = 0xff;  // E4M3 NaN
  EXPECT_EQ(checkpoint::first_non_finite(e), 1);
  static_cast<uint8_t*>(e.raw())[1] = 0x7e;  // 448: finite
  EXPECT_EQ(checkpoint::first_non_finite(e), -1);
  EXPECT_EQ(checkpoint::first_non_finite(Tensor::from_values({2}, {1, 2}, DType::i32)), -1);
  // A strided view is checked in view order.
  Tensor m = Tensor::zeros({2, 3}, DType::f32);
  m.data<float>()[1] = std::numeric_limits<float>::quiet_NaN();   // (0, 1)
  EXPECT_EQ(checkpoint::first_non_finite(m.transpose(0, 1)), 2);  // (1, 0) of the transpose
}

}  // namespace
}  // namespace hlm
