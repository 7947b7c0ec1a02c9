// Inference over a cache (model/model_cache.h, HybridModel::forward with ModelInputs::cache):
// a prompt prefilled and the rest decoded token by token gives the logits (and the DSA
// selections) of one full forward over the same tokens, for KDA-only, DSA-only (KPool with its
// tail, RoPE) and mixed stacks (plain indexer, a shared indexer, dense MLA), at every prompt /
// decode split of a sequence long enough for sparse selection; a batch of sequences of different
// lengths decodes as each alone; the budget refuses what does not fit and changes nothing.
#include <nlohmann/json.hpp>

#include "core/rng.h"
#include "core/seq_layout.h"
#include "infer_models.h"
#include "model/hybrid_model.h"
#include "model/model_cache.h"
#include "testing.h"

namespace hlm {
namespace {

using testing::test_seed;
using namespace infer_test;

TEST(Decode, PrefillThenDecodeEqualsTheFullForwardAtEverySplit) {
  constexpr int64_t L = 17;
  for (const Stack& st : stacks()) {
    SCOPED_TRACE(st.name);
    const ModelConfig cfg = config_of(st);
    const HybridModel m(cfg, {.dtype = DType::f32, .seed = 5, .mtp = false});
    Rng rng(test_seed());
    const std::vector<int64_t> tok = random_tokens(L, cfg.vocab_size, rng);
    ModelInputs full_in;
    full_in.tokens = Tensor::from_vector({L}, tok);
    const ModelOutput full = m.forward(eval_ctx(), full_in);
    double worst = 0;
    for (int64_t split = 1; split < L; ++split) {
      ModelCache cache(cfg, DType::f32, {.max_seqs = 2, .max_tokens = L, .page = 4});
      const int64_t slot = cache.open();
      const std::vector<int64_t> prompt(tok.begin(), tok.begin() + split);
      ModelOutput o = cached_forward(m, cache, {prompt}, {slot});
      worst = std::max(worst, max_row_rel(o.logits, full.logits.slice(0, 0, split)));
      // The DSA selections of the prompt's queries are the full forward's (a single sequence:
      // positions are token ids).
      for (size_t d = 0; d < o.dsa_indices.size(); ++d) {
        EXPECT_TRUE(same_sets(o.dsa_indices[d], full.dsa_indices[d].slice(0, 0, split)))
            << "dsa layer " << d << " split " << split;
      }
      for (int64_t t = split; t < L; ++t) {
        o = cached_forward(m, cache, {{tok[size_t(t)]}}, {slot});
        worst = std::max(worst, max_row_rel(o.logits, full.logits.slice(0, t, t + 1)));
        for (size_t d = 0; d < o.dsa_indices.size(); ++d)
          EXPECT_TRUE(same_sets(o.dsa_indices[d], full.dsa_indices[d].slice(0, t, t + 1)))
              << "dsa layer " << d << " token " << t << " split " << split;
      }
      EXPECT_EQ(cache.length(slot), L);
    }
    EXPECT_LT(worst, 1e-5) << st.name;
    std::printf("[ decode ] %-45s worst row relative error %.2e\n", st.name, worst);
  }
}

TEST(Decode, Fp8ScoringSelectsAsTheFullForward) {
  // Many candidate pools per query (a 64-token sequence, 3 of up to 32 pools selected), so that
  // the FP8 emulation of the scoring inputs decides selections: the cached path quantizes each
  // pooled key once, when its pool completes, and must select as the full forward does.
  constexpr int64_t L = 64;
  nlohmann::json j = base_json();
  j.merge_patch({{"layer_pattern", "DKD"}, {"dsa_indexer_kpool_use_quantization", true}});
  const ModelConfig cfg = ModelConfig::from_json(j, "fp8 scoring");
  const HybridModel m(cfg, {.dtype = DType::f32, .seed = 12, .mtp = false});
  Rng rng(test_seed());
  const std::vector<int64_t> tok = random_tokens(L, cfg.vocab_size, rng);
  ModelInputs in;
  in.tokens = Tensor::from_vector({L}, tok);
  const ModelOutput full = m.forward(eval_ctx(), in);
  ModelCache cache(cfg, DType::f32, {.max_seqs = 1, .max_tokens = L, .page = 8});
  const int64_t slot = cache.open();
  ModelOutput o = cached_forward(m, cache, {{tok.begin(), tok.begin() + 9}}, {slot});
  double worst = max_row_rel(o.logits, full.logits.slice(0, 0, 9));
  for (int64_t t = 9; t < L; ++t) {
    o = cached_forward(m, cache, {{tok[size_t(t)]}}, {slot});
    worst = std::max(worst, max_row_rel(o.logits, full.logits.slice(0, t, t + 1)));
    for (size_t d = 0; d < o.dsa_indices.size(); ++d)
      EXPECT_TRUE(same_sets(o.dsa_indices[d], full.dsa_indices[d].slice(0, t, t + 1)))
          << "dsa layer " << d << " token " << t;
  }
  EXPECT_LT(worst, 1e-5);
}

TEST(Decode, ABatchOfDifferentLengthsDecodesAsEachAlone) {
  const ModelConfig cfg = config_of(stacks()[3]);
  const HybridModel m(cfg, {.dtype = DType::f32, .seed = 7, .mtp = false});
  Rng rng(test_seed());
  const std::vector<int64_t> prompt_len = {3, 11, 6};
  constexpr int64_t kSteps = 9;
  std::vector<std::vector<int64_t>> seqs;
  for (int64_t l : prompt_len) seqs.push_back(random_tokens(l + kSteps, cfg.vocab_size, rng));
  // Each alone: one forward over the whole sequence.
  std::vector<Tensor> alone;
  for (const auto& s : seqs) {
    ModelInputs in;
    in.tokens = Tensor::from_vector({int64_t(s.size())}, s);
    alone.push_back(m.forward(eval_ctx(), in).logits);
  }
  // Together: the prompts prefilled as one packed batch, then one token of each per step; the
  // second sequence joins late (its prompt is prefilled at step 4, beside decode steps of the
  // others) and the first leaves after step 6.
  ModelCache cache(cfg, DType::f32, {.max_seqs = 3, .max_tokens = 64, .page = 4});
  std::vector<int64_t> slot = {cache.open(), -1, cache.open()};
  std::vector<int64_t> next = {0, 0, 0};  // tokens of each sequence already in
  double worst = 0;
  for (int step = 0; step < 20; ++step) {
    std::vector<std::vector<int64_t>> batch;
    std::vector<int64_t> slots, who;
    if (step == 4) slot[1] = cache.open();
    for (int i = 0; i < 3; ++i) {
      if (slot[size_t(i)] < 0) continue;
      const int64_t take = next[size_t(i)] == 0 ? prompt_len[size_t(i)] : 1;
      if (next[size_t(i)] + take > int64_t(seqs[size_t(i)].size())) continue;
      batch.emplace_back(seqs[size_t(i)].begin() + next[size_t(i)],
                         seqs[size_t(i)].begin() + next[size_t(i)] + take);
      slots.push_back(slot[size_t(i)]);
      who.push_back(i);
    }
    if (batch.empty()) break;
    const ModelOutput o = cached_forward(m, cache, batch, slots);
    int64_t row = 0;
    for (size_t b = 0; b < batch.size(); ++b) {
      const int i = int(who[b]);
      const int64_t n = int64_t(batch[b].size());
      worst = std::max(
          worst, max_row_rel(o.logits.slice(0, row, row + n),
                             alone[size_t(i)].slice(0, next[size_t(i)], next[size_t(i)] + n)));
      next[size_t(i)] += n;
      row += n;
    }
    if (step == 6) {
      cache.close(slot[0]);
      slot[0] = -1;
    }
  }
  EXPECT_EQ(next[1], int64_t(seqs[1].size()));
  EXPECT_EQ(next[2], int64_t(seqs[2].size()));
  EXPECT_LT(worst, 1e-5);
}

TEST(Decode, TheBudgetRefusesWhatDoesNotFitAndChangesNothing) {
  const ModelConfig cfg = config_of(stacks()[1]);
  const HybridModel m(cfg, {.dtype = DType::f32, .seed = 3, .mtp = false});
  ModelCache cache(cfg, DType::f32, {.max_seqs = 2, .max_tokens = 8, .page = 4});
  EXPECT_EQ(cache.bytes().num_pages, 2);
  const int64_t a = cache.open();
  Rng rng(test_seed());
  cached_forward(m, cache, {random_tokens(5, cfg.vocab_size, rng)}, {a});
  EXPECT_EQ(cache.length(a), 5);
  EXPECT_EQ(cache.free_pages(), 0);
  testing::expect_error([&] { cached_forward(m, cache, {random_tokens(4, 40, rng)}, {a}); },
                        "4 more tokens need 1 pages of 4 tokens, 0 of 2 are free");
  EXPECT_EQ(cache.length(a), 5);
  // Three more fit in the last page.
  cached_forward(m, cache, {random_tokens(3, cfg.vocab_size, rng)}, {a});
  EXPECT_EQ(cache.length(a), 8);
  const int64_t b = cache.open();
  testing::expect_error([&] { cache.open(); }, "all 2 sequence slots are in use");
  testing::expect_error([&] { cached_forward(m, cache, {{1}, {2}}, {a, a}); }, "appears twice");
  testing::expect_error([&] { cached_forward(m, cache, {{1}}, {7}); }, "slot 7 is not an open");
  // A bad token id or logits row is refused before the cache is touched.
  const int64_t pages = cache.free_pages();
  testing::expect_error([&] { cached_forward(m, cache, {{1, 99}}, {b}); }, "99");
  {
    ModelInputs in;
    in.tokens = Tensor::from_vector<int64_t>({2}, {1, 2});
    in.cache = &cache;
    in.cache_slots = {b};
    in.logit_rows = {0, 2};
    testing::expect_error([&] { m.forward(eval_ctx(), in); }, "logit row 2 is outside [0, 2)");
  }
  EXPECT_EQ(cache.length(b), 0);
  EXPECT_EQ(cache.free_pages(), pages);
  cache.close(a);
  EXPECT_EQ(cache.free_pages(), 2);
  cached_forward(m, cache, {random_tokens(8, cfg.vocab_size, rng)}, {b});
  EXPECT_EQ(cache.length(b), 8);
  // Inference only.
  ModelInputs in;
  in.tokens = Tensor::from_vector<int64_t>({1}, {1});
  in.targets = Tensor::from_vector<int64_t>({1}, {1});
  in.cache = &cache;
  in.cache_slots = {b};
  testing::expect_error([&] { m.forward(eval_ctx(), in); }, "inference only");
}

TEST(Decode, CacheBytesFollowTheShapes) {
  // The GLM-5.3-Flash shapes: per token the 512-wide latent of each DSA layer plus its pooled
  // key share d_I / P; per sequence every KDA layer's conv and recurrent state and each KPool
  // layer's tail.
  const ModelConfig cfg =
      ModelConfig::load(std::string(HLM_SOURCE_DIR) + "/configs/glm5_3_flash.json");
  const CacheBytes b = ModelCache::plan(cfg, DType::f32, {.max_seqs = 4, .max_tokens = 1 << 16});
  const int64_t n_dsa = cfg.count_layers(LayerKind::dsa) + cfg.count_layers(LayerKind::mla);
  const int64_t n_kda = cfg.count_layers(LayerKind::kda);
  const auto& k = cfg.kda;
  const int64_t P = cfg.indexer.kpool, d = cfg.indexer.head_dim;
  int64_t n_ix = 0;
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l)
    n_ix += cfg.layer_kind(l) == LayerKind::dsa &&
            (cfg.indexer_kinds.empty() || cfg.indexer_kinds[size_t(l)] == IndexerKind::full);
  EXPECT_EQ(b.per_token,
            4 * (n_dsa * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)) + 4 * n_ix * d / P);
  EXPECT_EQ(b.per_sequence, 4 * n_kda *
                                    ((k.conv_kernel - 1) * (2 * k.num_heads * k.head_dim +
                                                            k.num_v_heads * k.v_head_dim) +
                                     k.num_v_heads * k.head_dim * k.v_head_dim) +
                                4 * n_ix * 2 * P * d);
}

TEST(Decode, ThePlanIsWhatTheCacheAllocates) {
  // ModelCache::plan (what inspect and the memory checks use) against the tensors a cache of the
  // same options allocates, for every test stack, with and without speculative decoding.
  for (const Stack& st : stacks()) {
    SCOPED_TRACE(st.name);
    nlohmann::json j = base_json();
    j.merge_patch(st.patch);
    j["num_nextn_predict_layers"] = 1;
    const ModelConfig cfg = ModelConfig::from_json(j, st.name);
    for (const bool spec : {false, true}) {
      const CacheOptions o{.max_seqs = 3, .max_tokens = 50, .page = 4, .speculative = spec};
      const CacheBytes plan = ModelCache::plan(cfg, DType::f32, o);
      const CacheBytes got = ModelCache(cfg, DType::f32, o).allocated();
      EXPECT_EQ(plan.slots, got.slots) << "speculative " << spec;
      EXPECT_EQ(plan.pages, got.pages) << "speculative " << spec;
      EXPECT_EQ(plan.slots, plan.per_sequence * 3);
      EXPECT_GE(plan.num_pages * plan.page_tokens, 50);
    }
  }
}

// HybridModel::keep_gemm_weights_in_bf16 (inference): the weights that only bf16 GEMMs read go
// to bf16 and every number stays the same: a full forward's logits and a cached decode's, bit for
// bit, for each stack under bf16 GEMMs (MoE experts and MLA's kv_b_proj, whose bf16 weight the
// absorbed per-head products read as it is, included).
TEST(Decode, GemmWeightsKeptInBf16ChangeNoBit) {
  constexpr int64_t L = 9;
  for (const Stack& st : stacks()) {
    SCOPED_TRACE(st.name);
    nlohmann::json j = base_json();
    j.merge_patch(st.patch);
    j["gemm_precision"] = "bf16";
    const ModelConfig cfg = ModelConfig::from_json(j, st.name);
    const HybridModel ref(cfg, {.dtype = DType::f32, .seed = 5, .mtp = false});
    HybridModel m(cfg, {.dtype = DType::f32, .seed = 5, .mtp = false});
    const int64_t bytes_before = [&] {
      int64_t b = 0;
      for (auto& [n, p] : m.named_parameters()) b += int64_t(p->value.nbytes());
      return b;
    }();
    m.keep_gemm_weights_in_bf16();
    int64_t bytes = 0, in_bf16 = 0;
    for (auto& [n, p] : m.named_parameters()) {
      bytes += int64_t(p->value.nbytes());
      in_bf16 += p->value.dtype() == DType::bf16;
      if (n.find("norm") != std::string::npos) EXPECT_EQ(p->value.dtype(), DType::f32) << n;
      if (n.find("kv_b_proj") != std::string::npos) EXPECT_EQ(p->value.dtype(), DType::bf16) << n;
      if (n.find("experts.gate_up_proj") != std::string::npos)
        EXPECT_EQ(p->value.dtype(), DType::bf16) << n;
    }
    EXPECT_GT(in_bf16, 0);
    EXPECT_LT(bytes, bytes_before);
    Rng rng(test_seed());
    const std::vector<int64_t> tok = random_tokens(L, cfg.vocab_size, rng);
    ModelInputs in;
    in.tokens = Tensor::from_vector({L}, tok);
    EXPECT_TRUE(
        testing::bit_equal(m.forward(eval_ctx(), in).logits, ref.forward(eval_ctx(), in).logits));
    ModelCache ca(cfg, DType::f32, {.max_seqs = 1, .max_tokens = L, .page = 4});
    ModelCache cb(cfg, DType::f32, {.max_seqs = 1, .max_tokens = L, .page = 4});
    const int64_t sa = ca.open(), sb = cb.open();
    const std::vector<int64_t> prompt(tok.begin(), tok.begin() + 5);
    EXPECT_TRUE(testing::bit_equal(cached_forward(m, ca, {prompt}, {sa}).logits,
                                   cached_forward(ref, cb, {prompt}, {sb}).logits));
    for (int64_t t = 5; t < L; ++t)
      EXPECT_TRUE(testing::bit_equal(cached_forward(m, ca, {{tok[size_t(t)]}}, {sa}).logits,
                                     cached_forward(ref, cb, {{tok[size_t(t)]}}, {sb}).logits))
          << "token " << t;
    std::printf("[ bf16 weights ] %-45s %lld parameters in bf16, %.1f%% of the bytes\n", st.name,
                static_cast<long long>(in_bf16), 100.0 * double(bytes) / double(bytes_before));
  }
}

}  // namespace
}  // namespace hlm
