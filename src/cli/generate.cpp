// `hybridlm generate`: generate from a checkpoint (docs/inference.md, "hybridlm generate").
//
//   hybridlm generate --model DIR (--prompt TEXT | --tokens FILE) [--max-new N]
//                     [--temperature T] [--top-k K] [--top-p P] [--seed S] [--stop ID ...]
//                     [--logprobs] [--prompt-logprobs] [--out FILE] [--max-batch N]
//                     [--dtype f32|f64] [--device cpu|cuda] [--speculative]
// --prompt is encoded with the checkpoint's tokenizer.json; --tokens reads input_ids as `forward`
// does ([B, T] rows, or [T] with an optional cu_seqlens: B prompts generated together, with
// continuous batching). Greedy unless --temperature is given. The generated text (or, without a
// tokenizer or with --tokens, the ids) streams to stdout as it comes; the speed goes to stderr.
// --out writes a safetensors file: tokens I64 [N] (the generated ids, every prompt's end to end)
// and cu_seqlens I64 [B + 1] (where each prompt's tokens lie), with --logprobs logprobs F32 [N]
// (each token's log-probability under the model's distribution before sampling), with
// --prompt-logprobs prompt_logprobs F32 [sum (len - 1)] and prompt_cu_seqlens (log p of each
// prompt token after the first, given the ones before it: what `forward --logits` gives).
// --device cuda runs the model and its cache on the GPU (f32; the GEMMs as the config's precision
// says, FP8 block GEMMs excepted); the stop tokens default to the config's eos_token_id.
// --speculative drafts with the checkpoint's MTP block (greedy only; the tokens are plain greedy
// decoding's) and reports how many drafts were accepted.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "cli/command.h"
#include "cli/infer_load.h"
#include "core/memory.h"
#include "core/safetensors.h"
#include "infer/generator.h"
#include "model/checkpoint.h"
#include "model/config_limits.h"
#include "model/hybrid_model.h"
#include "model/token_input.h"
#include "tokenizer/tokenizer.h"

namespace hlm::cli {
namespace {

namespace fs = std::filesystem;

struct GenerateArgs {
  std::string model, prompt, tokens, out, dtype = "f32", device = "cpu";
  int64_t max_new = 64, top_k = 0, max_batch = 16;
  double temperature = 0, top_p = 1;
  uint64_t seed = 0;
  std::vector<int64_t> stop;
  bool stop_given = false, logprobs = false, prompt_logprobs = false, speculative = false;
};

void run_generate(const GenerateArgs& a) {
  HLM_CHECK(a.prompt.empty() != a.tokens.empty(),
            "generate: give one of --prompt TEXT and --tokens FILE");
  HLM_CHECK((!a.logprobs && !a.prompt_logprobs) || !a.out.empty(),
            "generate: --logprobs and --prompt-logprobs are written to --out FILE; give one");
  if (!a.out.empty())
    HLM_CHECK(!fs::exists(a.out), "generate: --out {} exists; not overwriting it", a.out);
  const ModelConfig cfg = ModelConfig::load(a.model);
  const Device dev = inference_device(a.device, a.dtype, cfg, "generate");
  HybridModelOptions opt;
  opt.dtype = a.dtype == "f64" ? DType::f64 : DType::f32;
  opt.mtp = a.speculative;
  if (a.speculative) {
    HLM_CHECK(cfg.mtp.num_layers >= 1,
              "generate --speculative: the model has no MTP block to draft with "
              "(num_nextn_predict_layers = 0)");
    HLM_CHECK(a.temperature == 0, "generate --speculative: greedy only (no --temperature)");
  }
  infer::SamplingParams sp;
  sp.temperature = a.temperature;
  sp.top_k = a.top_k;
  sp.top_p = a.top_p;
  sp.seed = a.seed;
  sp.validate();

  // The prompts.
  std::vector<std::vector<int64_t>> prompts;
  const std::unique_ptr<tokenizer::Tokenizer> tok = tokenizer_if_any(a.model);
  if (!a.prompt.empty()) {
    HLM_CHECK(tok != nullptr,
              "generate --prompt: {} has no tokenizer.json to encode the text; give token ids "
              "with --tokens FILE",
              a.model);
    std::vector<int64_t> p;
    for (uint32_t id : tok->encode(a.prompt)) p.push_back(int64_t(id));
    HLM_CHECK(!p.empty(), "generate --prompt: the text encodes to no tokens");
    for (int64_t id : p)
      HLM_CHECK(id < cfg.vocab_size,
                "generate --prompt: the tokenizer gave id {}, outside the model's vocabulary "
                "[0, {})",
                id, cfg.vocab_size);
    prompts.push_back(std::move(p));
  } else {
    const TokenBatch tb = read_token_batch(safetensors::load(a.tokens), cfg.vocab_size, a.tokens);
    const Tensor t = tb.tokens.to(DType::i64).contiguous();
    const Tensor c = tb.cu_seqlens.to(DType::i64).contiguous();
    const std::vector<int64_t> ids(t.data<int64_t>(), t.data<int64_t>() + t.numel());
    const std::vector<int64_t> cu(c.data<int64_t>(), c.data<int64_t>() + c.numel());
    for (size_t n = 0; n + 1 < cu.size(); ++n) {
      HLM_CHECK(cu[n + 1] > cu[n], "generate --tokens {}: prompt {} is empty", a.tokens, n);
      prompts.emplace_back(ids.begin() + cu[n], ids.begin() + cu[n + 1]);
    }
  }
  const std::vector<int64_t> stop = a.stop_given ? a.stop : cfg.eos_token_ids;
  for (int64_t id : stop)
    HLM_CHECK(id >= 0 && id < cfg.vocab_size,
              "generate: stop token {} is outside the vocabulary [0, {})", id, cfg.vocab_size);

  // The cache: the prompts generated at most max_batch at a time, each with room for its prompt
  // and max_new tokens; checked against the memory limit with the weights before anything is
  // built.
  CacheOptions co;
  co.max_seqs = std::min<int64_t>(a.max_batch, int64_t(prompts.size()));
  int64_t longest = 0, first_batch = 0;
  std::vector<int64_t> lens;
  for (const auto& p : prompts) lens.push_back(int64_t(p.size()) + a.max_new);
  std::sort(lens.rbegin(), lens.rend());
  for (int64_t i = 0; i < co.max_seqs; ++i) first_batch += lens[size_t(i)];
  longest = lens[0];
  co.max_tokens = first_batch + co.max_seqs * co.page;  // a partial page per sequence
  co.speculative = a.speculative;
  co.device = dev;  // on CUDA the latents are bf16 unless the MLA projections are native
  const CacheBytes cb = ModelCache::plan(cfg, compute_dtype(opt.dtype), co);
  Workload w;
  w.tokens = first_batch;
  w.max_seq_len = longest;
  w.dtype = opt.dtype;
  w.mtp = a.speculative;
  w.bf16_gemm_weights = true;  // load_inference_model keeps them in bf16
  checkpoint::LoadOptions lo;
  if (!a.speculative) lo.ignore_layers_from = cfg.num_hidden_layers;
  lo.allow_missing = cfg.tie_word_embeddings;
  check_inference_memory(cfg, w, cb.total(), "generate");
  const std::unique_ptr<HybridModel> model =
      load_inference_model(a.model, cfg, opt, lo, dev, "generate");
  infer::Generator gen(*model, co);
  std::vector<infer::Request> reqs;
  for (const auto& p : prompts) {
    infer::Request r;
    r.prompt = p;
    r.max_new = a.max_new;
    r.sampling = sp;
    r.stop = stop;
    r.prompt_logprobs = a.prompt_logprobs;
    r.stream = uint64_t(reqs.size());  // prompt i samples from stream i
    gen.check(r);
    reqs.push_back(std::move(r));
  }
  std::fprintf(stderr,
               "generate: %zu prompt(s), %lld new tokens at most each, %s; cache %s (%lld "
               "sequences, %lld tokens)\n",
               prompts.size(), (long long)a.max_new,
               sp.greedy() ? "greedy"
                           : fmt::format("temperature {} top-k {} top-p {} seed {}", sp.temperature,
                                         sp.top_k, sp.top_p, sp.seed)
                                 .c_str(),
               format_bytes(double(cb.total())).c_str(), (long long)co.max_seqs,
               (long long)(cb.num_pages * cb.page_tokens));

  // Streaming: one prompt's text (or ids) as it comes; several prompts' ids tagged by prompt.
  const bool text = tok != nullptr && !a.prompt.empty();
  std::vector<std::vector<uint32_t>> so_far(prompts.size());
  std::vector<size_t> printed(prompts.size(), 0);
  int64_t generated = 0;
  const auto t0 = std::chrono::steady_clock::now();
  double first_token_s = -1;
  const std::vector<infer::Result> res = gen.run(reqs, [&](const infer::TokenEvent& e) {
    if (e.token < 0) return;  // a prompt scored, nothing generated
    if (first_token_s < 0)
      first_token_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++generated;
    if (text) {
      so_far[size_t(e.id)].push_back(uint32_t(e.token));
      const std::string s = tok->decode(so_far[size_t(e.id)]);
      // Print what the new token added (a token may complete a multi-byte character).
      if (s.size() > printed[size_t(e.id)]) {
        std::fwrite(s.data() + printed[size_t(e.id)], 1, s.size() - printed[size_t(e.id)], stdout);
        printed[size_t(e.id)] = s.size();
      }
    } else if (prompts.size() == 1) {
      std::printf("%lld ", (long long)e.token);
    } else {
      std::printf("[%lld] %lld\n", (long long)e.id, (long long)e.token);
    }
    std::fflush(stdout);
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("\n");
  std::fprintf(stderr,
               "generate: %lld tokens in %.2f s (%.1f tokens/s; first token after %.3f s) in %lld "
               "forwards; finished: ",
               (long long)generated, secs, double(generated) / std::max(secs, 1e-9),
               std::max(first_token_s, 0.0), (long long)gen.forwards());
  for (size_t i = 0; i < res.size(); ++i)
    std::fprintf(stderr, "%s%s", i ? ", " : "", res[i].finish.c_str());
  if (a.speculative)
    std::fprintf(stderr, "; MTP drafts accepted %lld of %lld", (long long)gen.accepted(),
                 (long long)gen.drafts());
  std::fprintf(stderr, "\n");

  if (a.out.empty()) return;
  std::vector<int64_t> ids, cu = {0}, pcu = {0};
  std::vector<float> lp, plp;
  for (const infer::Result& r : res) {
    ids.insert(ids.end(), r.tokens.begin(), r.tokens.end());
    for (double v : r.logprobs) lp.push_back(float(v));
    for (double v : r.prompt_logprobs) plp.push_back(float(v));
    cu.push_back(int64_t(ids.size()));
    pcu.push_back(int64_t(plp.size()));
  }
  safetensors::TensorMap out;
  out["tokens"] = Tensor::from_vector({int64_t(ids.size())}, ids);
  out["cu_seqlens"] = Tensor::from_vector({int64_t(cu.size())}, cu);
  if (a.logprobs) out["logprobs"] = Tensor::from_vector({int64_t(lp.size())}, lp);
  if (a.prompt_logprobs) {
    out["prompt_logprobs"] = Tensor::from_vector({int64_t(plp.size())}, plp);
    out["prompt_cu_seqlens"] = Tensor::from_vector({int64_t(pcu.size())}, pcu);
  }
  safetensors::save(a.out, out);
  std::fprintf(stderr, "generate: wrote %s\n", a.out.c_str());
}

std::function<void()> setup_generate(CLI::App& app) {
  auto a = std::make_shared<GenerateArgs>();
  app.add_option("--model", a->model, "checkpoint directory (config.json + safetensors)")
      ->required();
  app.add_option("--prompt", a->prompt, "the prompt text (needs the checkpoint's tokenizer.json)");
  app.add_option("--tokens", a->tokens, "safetensors with input_ids [B, T] or [T] + cu_seqlens")
      ->check(input_file());
  app.add_option("--max-new", a->max_new, "tokens to generate at most per prompt (default 64)")
      ->check(count_range(0, int64_t(1) << 30));
  app.add_option("--temperature", a->temperature, "sampling temperature (default: greedy)");
  app.add_option("--top-k", a->top_k, "keep the k most likely tokens (0: all)")
      ->check(count_range(0, int64_t(1) << 40));
  app.add_option("--top-p", a->top_p, "nucleus sampling mass in (0, 1] (1: off)");
  app.add_option("--seed", a->seed, "sampling seed")->check(count_range(0, INT64_MAX));
  app.add_option("--stop", a->stop, "stop token ids (default: the config's eos_token_id)")
      ->each([a](const std::string&) { a->stop_given = true; });
  app.add_flag("--logprobs", a->logprobs, "write each generated token's log-probability to --out");
  app.add_flag("--prompt-logprobs", a->prompt_logprobs,
               "write the prompt tokens' log-probabilities to --out");
  app.add_option("--out", a->out, "output safetensors (tokens, cu_seqlens, logprobs)");
  app.add_option("--max-batch", a->max_batch, "prompts generated together at most (default 16)")
      ->check(count_range(1, 4096));
  app.add_option("--dtype", a->dtype, "compute dtype")->check(CLI::IsMember({"f32", "f64"}));
  app.add_option("--device", a->device, "cpu or cuda: where the model and its cache run")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_flag("--speculative", a->speculative,
               "draft with the MTP block (greedy; the same tokens, fewer forwards when accepted)");
  return [a] { run_generate(*a); };
}

}  // namespace

HLM_REGISTER_COMMAND("generate", "generate text from a checkpoint (CPU or CUDA, with caches)",
                     setup_generate);

}  // namespace hlm::cli
