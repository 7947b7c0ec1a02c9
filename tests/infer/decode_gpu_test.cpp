// Inference on CUDA against the CPU: the cache on the device (ModelCache with device = cuda), the
// KDA layers continuing from its slots' states, the DSA layers over its pages
// (DsaLayer::forward_cached through ops::indexer_scores_pattern and ops::sparse_attention_pattern).
// Two small GLM-5.3-Flash-shaped stacks (KDA head dims of 32, the smallest the CUDA kernels take):
// a mixed one in f32 with native GEMMs (KPool 2 with its tail, mHC, MoE, an MTP block), and a
// DSA-heavy one with FP8 pooled scoring and bf16 GEMMs (KPool 4 without the tail, so the bf16
// latents and the emulated pooled keys go through the device cache). Checked: a sequence prefilled
// at two splits and decoded token by token on CUDA gives the CPU full forward's logits (f32: row
// relative error below 5e-5; bf16 GEMMs: below 1e-3) and, for f32, its DSA selections exactly;
// the Generator on CUDA yields the CPU's greedy and sampled tokens and their log-probabilities
// (1e-4) with sequences joining and leaving, and speculative decoding with the MTP block yields the
// same tokens; a decode step's forward copies nothing to the host (the Generator's step one block
// of picks); the weights kept in bf16 change no bit.
#include <gtest/gtest.h>

#include <cstdio>

#include "core/device.h"
#ifdef HLM_CUDA_EMU
#include "cuda_emu.h"
#endif
#include "infer/generator.h"
#include "infer_models.h"

namespace hlm {
namespace {

using namespace infer_test;
using testing::cpu;

ModelConfig gpu_config(bool bf16) {
  nlohmann::json j = nlohmann::json::parse(R"({
    "model_type": "glm5_next_text", "vocab_size": 40, "hidden_size": 32,
    "num_hidden_layers": 3, "layer_pattern": "KDK", "first_k_dense_replace": 1,
    "intermediate_size": 48, "swiglu_limit": 10.0, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": false, "initializer_range": 0.2,
    "linear_num_heads": 2, "linear_head_dim": 32, "linear_conv_kernel_dim": 4,
    "linear_lower_bound": -5.0,
    "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 0, "v_head_dim": 8,
    "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4, "index_kpool": 2,
    "index_kpool_always_select_tail": true,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "moe_intermediate_size": 16, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
    "norm_topk_prob": true,
    "mhc": true, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "num_nextn_predict_layers": 1, "gemm_precision": "native"
  })");
  if (bf16)
    j.merge_patch({{"layer_pattern", "DKD"},
                   {"index_kpool", 4},
                   {"index_topk", 8},
                   {"index_kpool_always_select_tail", false},
                   {"dsa_indexer_kpool_use_quantization", true},
                   {"gemm_precision", "bf16"},
                   {"num_nextn_predict_layers", 0}});
  return ModelConfig::from_json(j, bf16 ? "GPU decode, bf16" : "GPU decode, f32");
}

TEST(DecodeGpu, TokenByTokenOnCudaGivesTheCpuFullForward) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  constexpr int64_t L = 13;
  for (const bool bf16 : {false, true}) {
    const ModelConfig cfg = gpu_config(bf16);
    SCOPED_TRACE(bf16 ? "bf16 GEMMs, FP8 pooled scoring" : "f32");
    const HybridModel ref(cfg, {.dtype = DType::f32, .seed = 5, .mtp = false});
    HybridModel dev(cfg, {.dtype = DType::f32, .seed = 5, .mtp = false});
    dev.to(Device::cuda);
    Rng rng(testing::test_seed());
    const std::vector<int64_t> tok = random_tokens(L, cfg.vocab_size, rng);
    ModelInputs full_in;
    full_in.tokens = Tensor::from_vector({L}, tok);
    const ModelOutput full = ref.forward(eval_ctx(), full_in);
    // The training path on the device (its attention on the operands the cache keeps).
    ModelInputs dev_in;
    dev_in.tokens = full_in.tokens.to(Device::cuda);
    const Tensor dev_full = cpu(dev.forward(eval_ctx(), dev_in).logits);
    double worst = 0, worst_dev = 0;
    for (const int64_t split : {int64_t(1), int64_t(7)}) {
      ModelCache cache(cfg, DType::f32,
                       {.max_seqs = 2, .max_tokens = L, .page = 4, .device = Device::cuda});
      const int64_t slot = cache.open();
      // The latents as the device's attention takes them: bf16 under bf16 GEMMs.
      EXPECT_EQ(cache.dsa_view(bf16 ? 0 : 1, {slot}).kv.dtype(), bf16 ? DType::bf16 : DType::f32);
      auto check = [&](const ModelOutput& o, int64_t t0, int64_t t1) {
        worst = std::max(worst, max_row_rel(cpu(o.logits), full.logits.slice(0, t0, t1)));
        worst_dev = std::max(worst_dev, max_row_rel(cpu(o.logits), dev_full.slice(0, t0, t1)));
        if (bf16) return;  // near ties may select differently at bf16
        for (size_t d = 0; d < o.dsa_indices.size(); ++d)
          EXPECT_TRUE(same_sets(cpu(o.dsa_indices[d]), full.dsa_indices[d].slice(0, t0, t1)))
              << "dsa layer " << d << " tokens " << t0 << ".." << t1 << " split " << split;
      };
      check(cached_forward(dev, cache, {{tok.begin(), tok.begin() + split}}, {slot}), 0, split);
      for (int64_t t = split; t < L; ++t)
        check(cached_forward(dev, cache, {{tok[size_t(t)]}}, {slot}), t, t + 1);
      EXPECT_EQ(cache.length(slot), L);
    }
    EXPECT_LT(worst, bf16 ? 1e-3 : 5e-5);
    EXPECT_LT(worst_dev, bf16 ? 1e-3 : 5e-5);
    std::printf(
        "[ decode on CUDA ] %-32s worst row relative error %.2e (CPU full forward), %.2e (CUDA "
        "full forward)\n",
        bf16 ? "bf16 GEMMs, FP8 pooled scoring" : "f32", worst, worst_dev);
  }
}

TEST(DecodeGpu, ThePlanIsWhatTheCudaCacheAllocates) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  // f32 GEMMs keep f32 latents; bf16 GEMMs keep them in bf16 on the device (2 bytes a value),
  // the indexer keys in f32: per token 2 (DSA layers) x 16 latent values x 2 bytes, and the two
  // layers' pooled keys, 16 values x 4 bytes per 4 tokens.
  for (const bool bf16 : {false, true}) {
    const ModelConfig cfg = gpu_config(bf16);
    for (const bool spec : {false, true}) {
      if (spec && cfg.mtp.num_layers == 0) continue;
      const CacheOptions o{
          .max_seqs = 3, .max_tokens = 50, .page = 4, .speculative = spec, .device = Device::cuda};
      const CacheBytes plan = ModelCache::plan(cfg, DType::f32, o);
      const CacheBytes got = ModelCache(cfg, DType::f32, o).allocated();
      EXPECT_EQ(plan.slots, got.slots) << bf16 << spec;
      EXPECT_EQ(plan.pages, got.pages) << bf16 << spec;
      if (bf16) EXPECT_EQ(plan.per_token, 2 * 16 * 2 + 2 * 16 * 4 / 4);
      if (bf16) {
        CacheOptions on_cpu = o;
        on_cpu.device = Device::cpu;
        EXPECT_EQ(ModelCache::plan(cfg, DType::f32, on_cpu).per_token, 2 * 16 * 4 + 2 * 16 * 4 / 4);
      }
    }
  }
}

TEST(DecodeGpu, TheGeneratorOnCudaYieldsTheCpuTokens) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  const ModelConfig cfg = gpu_config(false);
  const HybridModel ref(cfg, {.dtype = DType::f32, .seed = 9});
  HybridModel dev(cfg, {.dtype = DType::f32, .seed = 9});
  dev.to(Device::cuda);
  Rng rng(testing::test_seed());
  std::vector<infer::Request> reqs;
  for (const int64_t len : {5, 2, 9}) {
    infer::Request r;
    r.prompt = random_tokens(len, cfg.vocab_size, rng);
    r.max_new = 6;
    r.prompt_logprobs = true;
    reqs.push_back(r);
  }
  // Sampled requests, picked on the device (ops::sample_pick): the CPU's tokens too.
  std::vector<infer::Request> sampled;
  for (const infer::SamplingParams& sp :
       {infer::SamplingParams{0.8, 0, 0.9, 11}, infer::SamplingParams{1.5, 5, 1.0, 12},
        infer::SamplingParams{1.0, 0, 1.0, 13}}) {
    infer::Request r;
    r.prompt = random_tokens(4, cfg.vocab_size, rng);
    r.max_new = 8;
    r.sampling = sp;
    sampled.push_back(r);
  }
  // Two slots for three requests: the third joins when the first leaves.
  const CacheOptions opt{.max_seqs = 2, .max_tokens = 48, .page = 4};
  const std::vector<infer::Result> want = infer::Generator(ref, opt).run(reqs);
  const std::vector<infer::Result> got = infer::Generator(dev, opt).run(reqs);
  const std::vector<infer::Result> want_s = infer::Generator(ref, opt).run(sampled);
  const std::vector<infer::Result> got_s = infer::Generator(dev, opt).run(sampled);
  CacheOptions spec = opt;
  spec.speculative = true;
  infer::Generator sg(dev, spec);
  const std::vector<infer::Result> drafted = sg.run(reqs);
  double worst = 0;
  for (size_t i = 0; i < sampled.size(); ++i) {
    EXPECT_EQ(got_s[i].tokens, want_s[i].tokens) << "sampled request " << i;
    ASSERT_EQ(got_s[i].logprobs.size(), want_s[i].logprobs.size());
    for (size_t j = 0; j < want_s[i].logprobs.size(); ++j)
      worst = std::max(worst, std::fabs(got_s[i].logprobs[j] - want_s[i].logprobs[j]));
  }
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(got[i].tokens, want[i].tokens) << "request " << i;
    EXPECT_EQ(drafted[i].tokens, want[i].tokens) << "request " << i << ", speculative";
    ASSERT_EQ(got[i].logprobs.size(), want[i].logprobs.size());
    ASSERT_EQ(got[i].prompt_logprobs.size(), want[i].prompt_logprobs.size());
    for (size_t j = 0; j < want[i].logprobs.size(); ++j)
      worst = std::max(worst, std::fabs(got[i].logprobs[j] - want[i].logprobs[j]));
    for (size_t j = 0; j < want[i].prompt_logprobs.size(); ++j)
      worst = std::max(worst, std::fabs(got[i].prompt_logprobs[j] - want[i].prompt_logprobs[j]));
  }
  EXPECT_LT(worst, 1e-4);
  EXPECT_GT(sg.drafts(), 0);
  std::printf(
      "[ generate on CUDA ] worst log-probability difference %.2e; %lld of %lld drafts "
      "accepted\n",
      worst, static_cast<long long>(sg.accepted()), static_cast<long long>(sg.drafts()));
}

// The decode step waits for the device only to read its picks: the model's forward over the cache
// (KDA decode, DSA over the cache with KPool, FP8 pooled scoring, MoE, mHC) copies nothing to the
// host and never synchronizes; the Generator's step copies one [3, B] block of picks (and one
// more in a step that scores a prompt). On the emulation the step's launches are held to a
// budget (the counts docs/inference.md gives, "What a decode step spends").
TEST(DecodeGpu, AStepWaitsForTheDeviceOnlyForItsPicks) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16 GEMMs, FP8 pooled scoring" : "f32");
    const ModelConfig cfg = gpu_config(bf16);
    HybridModel dev(cfg, {.dtype = DType::f32, .seed = 5, .mtp = false});
    dev.to(Device::cuda);
    dev.keep_gemm_weights_in_bf16();  // as generate and serve load it (a no-op for f32 GEMMs)
    Rng rng(testing::test_seed());
    ModelCache cache(cfg, DType::f32,
                     {.max_seqs = 2, .max_tokens = 24, .page = 4, .device = Device::cuda});
    const int64_t a = cache.open(), b = cache.open();
    cached_forward(dev, cache,
                   {random_tokens(5, cfg.vocab_size, rng), random_tokens(3, cfg.vocab_size, rng)},
                   {a, b});
    // Steps across a KPool pool's completion (positions 5..9 and 3..7).
    for (int step = 0; step < 5; ++step) {
      reset_transfer_stats();
#ifdef HLM_CUDA_EMU
      const uint64_t k0 = emu::kernel_launches(), g0 = emu::blas_calls();
#endif
      cached_forward(dev, cache, {{1 + step}, {2 + step}}, {a, b});
      const TransferStats t = transfer_stats();
      EXPECT_EQ(t.to_host, 0u) << "step " << step;
      EXPECT_EQ(t.synchronizes, 0u) << "step " << step;
#ifdef HLM_CUDA_EMU
      const uint64_t kernels = emu::kernel_launches() - k0, blas = emu::blas_calls() - g0;
      EXPECT_LE(kernels, bf16 ? 116u : 77u) << "step " << step;
      EXPECT_LE(blas, bf16 ? 28u : 32u) << "step " << step;
      if (step == 4)
        std::printf("[ decode step ] %s: %llu kernels and %llu cuBLAS calls for %lld layers\n",
                    bf16 ? "bf16 GEMMs" : "f32", (unsigned long long)kernels,
                    (unsigned long long)blas, (long long)cfg.num_hidden_layers);
#endif
    }
    infer::Generator g(dev, {.max_seqs = 2, .max_tokens = 24, .page = 4});
    for (const bool scored : {true, false}) {
      infer::Request r;
      r.prompt = random_tokens(4, cfg.vocab_size, rng);
      r.max_new = 6;
      r.prompt_logprobs = scored;
      if (!scored) r.sampling = infer::SamplingParams{0.9, 0, 0.95, 3};
      g.submit(r);
    }
    for (int step = 0; g.busy(); ++step) {
      reset_transfer_stats();
      g.step();
      // Step 0 prefills both prompts, one of them scored.
      EXPECT_EQ(transfer_stats().to_host, step == 0 ? 2u : 1u) << "step " << step;
      EXPECT_EQ(transfer_stats().synchronizes, 0u) << "step " << step;
    }
  }
}

// keep_gemm_weights_in_bf16 on CUDA (after the move): the same tokens, log-probabilities and
// logits, bit for bit, as with the f32 weights, the MoE experts' too.
TEST(DecodeGpu, GemmWeightsKeptInBf16ChangeNoBit) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  const ModelConfig cfg = gpu_config(true);
  HybridModel ref(cfg, {.dtype = DType::f32, .seed = 9, .mtp = false});
  HybridModel dev(cfg, {.dtype = DType::f32, .seed = 9, .mtp = false});
  ref.to(Device::cuda);
  dev.to(Device::cuda);
  dev.keep_gemm_weights_in_bf16();
  bool experts_bf16 = false;
  for (auto& [n, p] : dev.named_parameters()) {
    EXPECT_EQ(p->value.device(), Device::cuda) << n;
    if (n.find("experts.down_proj") != std::string::npos)
      experts_bf16 = p->value.dtype() == DType::bf16;
  }
  EXPECT_TRUE(experts_bf16);
  Rng rng(testing::test_seed());
  std::vector<infer::Request> reqs;
  for (const int64_t len : {5, 9}) {
    infer::Request r;
    r.prompt = random_tokens(len, cfg.vocab_size, rng);
    r.max_new = 6;
    r.prompt_logprobs = true;
    r.sampling = infer::SamplingParams{0.9, 0, 0.95, uint64_t(len)};
    reqs.push_back(r);
  }
  const CacheOptions opt{.max_seqs = 2, .max_tokens = 48, .page = 4};
  const std::vector<infer::Result> want = infer::Generator(ref, opt).run(reqs);
  const std::vector<infer::Result> got = infer::Generator(dev, opt).run(reqs);
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(got[i].tokens, want[i].tokens) << i;
    EXPECT_EQ(got[i].logprobs, want[i].logprobs) << i;
    EXPECT_EQ(got[i].prompt_logprobs, want[i].prompt_logprobs) << i;
  }
}

}  // namespace
}  // namespace hlm
