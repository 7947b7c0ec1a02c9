// Speculative decoding with the MTP block as the drafter (infer/generator.h, ModelCache with
// speculative): the MTP block over the cache gives the training forward's MTP logits; a forward
// of [token, draft] per sequence, with the draft accepted or dropped, continues exactly as plain
// decoding (KDA states kept before and after the draft, DSA rows rolled back); the speculative
// Generator yields plain greedy decoding's tokens, with drafts both accepted and rejected.
#include "infer/generator.h"
#include "infer_models.h"
#include "testing.h"

namespace hlm::infer {
namespace {

using namespace infer_test;
using testing::test_seed;

ModelConfig mtp_config(const Stack& st, int64_t vocab = 40) {
  nlohmann::json j = base_json();
  j.merge_patch(st.patch);
  j["num_nextn_predict_layers"] = 1;
  j["mtp_loss_scaling_factor"] = 0.3;
  j["vocab_size"] = vocab;
  return ModelConfig::from_json(j, st.name);
}

ModelOutput cached(const HybridModel& m, ModelCache& c, const std::vector<int64_t>& tok,
                   int64_t slot, bool draft_last = false) {
  ModelInputs in;
  in.tokens = Tensor::from_vector({int64_t(tok.size())}, tok);
  in.cache = &c;
  in.cache_slots = {slot};
  in.draft_last = draft_last;
  return m.forward(eval_ctx(), in);
}

TEST(Speculative, MtpOverTheCacheGivesTheTrainingForwardsMtpLogits) {
  constexpr int64_t L = 15;
  for (const Stack& st : stacks()) {
    SCOPED_TRACE(st.name);
    const ModelConfig cfg = mtp_config(st);
    const HybridModel m(cfg, {.dtype = DType::f32, .seed = 3});
    Rng rng(test_seed());
    const std::vector<int64_t> tok = random_tokens(L, cfg.vocab_size, rng);
    std::vector<int64_t> tgt(tok.begin() + 1, tok.end());
    tgt.push_back(-100);
    ModelInputs in;
    in.tokens = Tensor::from_vector({L}, tok);
    in.targets = Tensor::from_vector({L}, tgt);
    const ModelOutput full = m.forward(eval_ctx(), in);
    ASSERT_TRUE(full.mtp_logits.defined());
    ModelCache c(cfg, DType::f32,
                 {.max_seqs = 1, .max_tokens = 32, .page = 4, .speculative = true});
    const int64_t slot = c.open();
    const ModelOutput o = cached(m, c, tok, slot);
    // MTP rows 0..5 at once, then one at a time (row i reads token i + 1 and h_i).
    double worst = 0;
    for (int64_t r0 = 0; r0 < L - 1;) {
      const int64_t r1 = r0 == 0 ? 6 : r0 + 1;
      const std::vector<int64_t> next(tok.begin() + r0 + 1, tok.begin() + r1 + 1);
      const Tensor lg = m.mtp_forward_cached(Tensor::from_vector({r1 - r0}, next),
                                             o.pre_norm.slice(0, r0, r1).contiguous(),
                                             SeqLayout::single(r1 - r0), c, {slot});
      worst = std::max(worst, max_row_rel(lg, full.mtp_logits.slice(0, r0, r1)));
      r0 = r1;
    }
    EXPECT_EQ(c.mtp_length(slot), L - 1);
    EXPECT_LT(worst, 1e-5);
  }
}

TEST(Speculative, AcceptedAndRejectedDraftsContinueAsPlainDecoding) {
  constexpr int64_t L = 16, kPrompt = 3;
  for (const Stack& st : stacks()) {
    SCOPED_TRACE(st.name);
    const ModelConfig cfg = mtp_config(st);
    const HybridModel m(cfg, {.dtype = DType::f32, .seed = 8});
    Rng rng(test_seed());
    const std::vector<int64_t> tok = random_tokens(L, cfg.vocab_size, rng);
    ModelInputs in;
    in.tokens = Tensor::from_vector({L}, tok);
    const Tensor full = m.forward(eval_ctx(), in).logits;
    ModelCache c(cfg, DType::f32,
                 {.max_seqs = 2, .max_tokens = 40, .page = 4, .speculative = true});
    const int64_t slot = c.open();
    cached(m, c, std::vector<int64_t>(tok.begin(), tok.begin() + kPrompt), slot);
    // Feed [tok[q], draft]: the right token (accepted) on even steps, a wrong one on odd steps.
    double worst = 0;
    int64_t q = kPrompt, step = 0, accepted = 0;
    while (q + 1 < L) {
      const bool right = step++ % 2 == 0;
      const int64_t d = right ? tok[size_t(q + 1)] : (tok[size_t(q + 1)] + 1) % cfg.vocab_size;
      const ModelOutput o = cached(m, c, {tok[size_t(q)], d}, slot, true);
      EXPECT_EQ(c.length(slot), q + 1);
      worst = std::max(worst, max_row_rel(o.logits.slice(0, 0, 1), full.slice(0, q, q + 1)));
      if (right)
        worst = std::max(worst, max_row_rel(o.logits.slice(0, 1, 2), full.slice(0, q + 1, q + 2)));
      c.accept_drafts({slot}, {right});
      accepted += right;
      q += right ? 2 : 1;
      EXPECT_EQ(c.length(slot), q);
    }
    EXPECT_GE(accepted, 3);
    EXPECT_LT(worst, 1e-5);
  }
}

TEST(Speculative, TheGeneratorYieldsPlainGreedyTokens) {
  for (const Stack& st : stacks()) {
    SCOPED_TRACE(st.name);
    // A small vocabulary, so that the untrained MTP block's drafts are sometimes right.
    const ModelConfig cfg = mtp_config(st, 5);
    const HybridModel m(cfg, {.dtype = DType::f32, .seed = 21});
    Rng rng(test_seed());
    std::vector<Request> reqs;
    for (int i = 0; i < 4; ++i) {
      Request r;
      r.prompt = random_tokens(1 + 3 * i, cfg.vocab_size, rng);
      r.max_new = 10 + i;
      r.prompt_logprobs = i == 2;
      reqs.push_back(r);
    }
    reqs[3].stop = {2};
    Generator plain(m, {.max_seqs = 4, .max_tokens = 128, .page = 4});
    const std::vector<Result> want = plain.run(reqs);
    // Three slots for four requests: the last waits and is prefilled beside running ones.
    Generator spec(m, {.max_seqs = 3, .max_tokens = 128, .page = 4, .speculative = true});
    const std::vector<Result> got = spec.run(reqs);
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(got[i].tokens, want[i].tokens) << "request " << i;
      EXPECT_EQ(got[i].finish, want[i].finish) << "request " << i;
      ASSERT_EQ(got[i].logprobs.size(), want[i].logprobs.size());
      for (size_t j = 0; j < want[i].logprobs.size(); ++j)
        EXPECT_NEAR(got[i].logprobs[j], want[i].logprobs[j], 2e-5);
      ASSERT_EQ(got[i].prompt_logprobs.size(), want[i].prompt_logprobs.size());
    }
    EXPECT_GT(spec.accepted(), 0);
    EXPECT_LT(spec.accepted(), spec.drafts());
    std::printf("[ spec ] %-45s drafts %lld, accepted %lld; forwards %lld (plain %lld)\n", st.name,
                (long long)spec.drafts(), (long long)spec.accepted(), (long long)spec.forwards(),
                (long long)plain.forwards());
    EXPECT_EQ(spec.cache().free_slots(), 3);
  }
}

TEST(Speculative, ACacheSizedForTheRequestIsEnough) {
  // A request takes prompt + max_new - 1 rows, and a speculative step one more for the draft:
  // the admission counts it, so a cache of exactly that many rows never runs out mid-request.
  const ModelConfig cfg = mtp_config(stacks()[1], 5);
  const HybridModel m(cfg, {.dtype = DType::f32, .seed = 21});
  Request r;
  r.prompt = {1, 2, 3};
  r.max_new = 6;
  Generator plain(m, {.max_seqs = 1, .max_tokens = 8, .page = 2});
  const Result want = plain.run({r})[0];
  Generator spec(m, {.max_seqs = 1, .max_tokens = 9, .page = 2, .speculative = true});
  EXPECT_EQ(spec.run({r})[0].tokens, want.tokens);
  Generator small(m, {.max_seqs = 1, .max_tokens = 8, .page = 2, .speculative = true});
  testing::expect_error([&] { small.submit(r); }, "need 9 tokens of cache, the cache holds 8");
}

TEST(Speculative, RefusesWhatItCannotDo) {
  const ModelConfig no_mtp = config_of(stacks()[0]);
  const HybridModel m0(no_mtp, {.dtype = DType::f32, .seed = 1, .mtp = false});
  testing::expect_error([&] { ModelCache(no_mtp, DType::f32, {.speculative = true}); },
                        "num_nextn_predict_layers = 0");
  const ModelConfig cfg = mtp_config(stacks()[0]);
  const HybridModel plain_model(cfg, {.dtype = DType::f32, .seed = 1, .mtp = false});
  testing::expect_error(
      [&] { Generator(plain_model, {.max_seqs = 1, .max_tokens = 16, .speculative = true}); },
      "built without one");
  const HybridModel m(cfg, {.dtype = DType::f32, .seed = 1});
  Generator g(m, {.max_seqs = 1, .max_tokens = 16, .speculative = true});
  Request r;
  r.prompt = {1, 2};
  r.sampling.temperature = 0.5;
  testing::expect_error([&] { g.submit(r); }, "greedy only");
  ModelCache c(cfg, DType::f32, {.max_seqs = 1, .max_tokens = 16, .speculative = true});
  const int64_t s = c.open();
  testing::expect_error([&] { cached(m, c, {1, 2, 3}, s, true); }, "[token, draft]");
  ModelCache plain_cache(cfg, DType::f32, {.max_seqs = 1, .max_tokens = 16});
  const int64_t s2 = plain_cache.open();
  testing::expect_error(
      [&] {
        cached(m, plain_cache, {1, 2}, s2, true);
      },
      "needs a cache made with speculative");
}

}  // namespace
}  // namespace hlm::infer
