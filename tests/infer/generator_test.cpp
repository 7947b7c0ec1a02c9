// Generator (infer/generator.h): greedy generation equals the arg max of one full forward over
// the same tokens at every step, and its log-probabilities are that forward's log-softmax (the
// trainer's numbers); a batch of requests of different lengths, admitted as the cache allows,
// generates what each generates alone, sampled ones included; stop tokens and max_new end a
// request; prompt scoring; bad requests are refused with nothing queued.
#include <algorithm>
#include <cmath>

#include "infer/generator.h"
#include "infer_models.h"
#include "testing.h"

namespace hlm::infer {
namespace {

using namespace infer_test;
using testing::test_seed;

// log softmax(logits)[token] in FP64 (logits[0 .. V)), the reference of the log-probabilities.
double token_logprob(const float* logits, int64_t V, int64_t token) {
  double m = -INFINITY;
  for (int64_t v = 0; v < V; ++v) m = std::max(m, double(logits[v]));
  double sum = 0;
  for (int64_t v = 0; v < V; ++v) sum += std::exp(double(logits[v]) - m);
  return double(logits[token]) - m - std::log(sum);
}

// The full forward's logits over tokens, f32 [T, V].
Tensor full_logits(const HybridModel& m, const std::vector<int64_t>& tokens) {
  ModelInputs in;
  in.tokens = Tensor::from_vector({int64_t(tokens.size())}, tokens);
  return m.forward(eval_ctx(), in).logits.to(DType::f32).contiguous();
}

int64_t argmax(const float* row, int64_t V) {
  return int64_t(std::max_element(row, row + V) - row);
}

TEST(Generator, GreedyIsTheFullForwardsArgMaxWithItsLogProbabilities) {
  for (const Stack& st : stacks()) {
    SCOPED_TRACE(st.name);
    const ModelConfig cfg = config_of(st);
    const HybridModel m(cfg, {.dtype = DType::f32, .seed = 11, .mtp = false});
    Rng rng(test_seed());
    Request r;
    r.prompt = random_tokens(5, cfg.vocab_size, rng);
    r.max_new = 14;
    r.prompt_logprobs = true;
    Generator g(m, {.max_seqs = 1, .max_tokens = 32, .page = 4});
    const Result res = g.run({r})[0];
    ASSERT_EQ(res.tokens.size(), 14u);
    EXPECT_EQ(res.finish, "length");
    // One forward over prompt + generated: every generated token is the arg max of the row
    // before it, with that row's log-softmax.
    std::vector<int64_t> all = r.prompt;
    all.insert(all.end(), res.tokens.begin(), res.tokens.end());
    const Tensor L = full_logits(m, all);
    const int64_t V = L.size(1), P = int64_t(r.prompt.size());
    double worst = 0;
    for (size_t i = 0; i < res.tokens.size(); ++i) {
      const float* row = L.data<float>() + (P - 1 + int64_t(i)) * V;
      EXPECT_EQ(res.tokens[i], argmax(row, V)) << "step " << i;
      worst = std::max(worst, std::fabs(res.logprobs[i] - token_logprob(row, V, res.tokens[i])));
    }
    ASSERT_EQ(res.prompt_logprobs.size(), size_t(P - 1));
    for (int64_t i = 0; i + 1 < P; ++i)
      worst = std::max(
          worst, std::fabs(res.prompt_logprobs[size_t(i)] -
                           token_logprob(L.data<float>() + i * V, V, r.prompt[size_t(i + 1)])));
    EXPECT_LT(worst, 2e-5);
    EXPECT_EQ(g.forwards(), 14);  // one prefill, 13 decode steps (the last token is not fed)
  }
}

TEST(Generator, ABatchGeneratesWhatEachGeneratesAlone) {
  const ModelConfig cfg = config_of(stacks()[3]);
  const HybridModel m(cfg, {.dtype = DType::f32, .seed = 2, .mtp = false});
  Rng rng(test_seed());
  std::vector<Request> reqs;
  for (int i = 0; i < 5; ++i) {
    Request r;
    r.prompt = random_tokens(2 + 3 * i, cfg.vocab_size, rng);
    r.max_new = 4 + i;
    if (i % 2 == 1) r.sampling = {.temperature = 0.8, .top_k = 10, .top_p = 0.9, .seed = 7};
    r.stream = uint64_t(i);
    reqs.push_back(r);
  }
  // Alone: a generator per request.
  std::vector<Result> alone;
  for (size_t i = 0; i < reqs.size(); ++i) {
    Generator g(m, {.max_seqs = 1, .max_tokens = 64, .page = 4});
    alone.push_back(g.run({reqs[i]})[0]);
  }
  // Together in a cache of 3 slots and 40 tokens: requests wait for room and join as others
  // finish.
  Generator g(m, {.max_seqs = 3, .max_tokens = 40, .page = 4});
  int64_t events = 0;
  const std::vector<Result> together = g.run(reqs, [&](const TokenEvent&) { ++events; });
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(together[i].tokens, alone[i].tokens) << "request " << i;
    ASSERT_EQ(together[i].logprobs.size(), alone[i].logprobs.size());
    for (size_t j = 0; j < alone[i].logprobs.size(); ++j)
      EXPECT_NEAR(together[i].logprobs[j], alone[i].logprobs[j], 2e-5);
  }
  EXPECT_EQ(events, 4 + 5 + 6 + 7 + 8);
  EXPECT_LT(g.forwards(), 4 + 5 + 6 + 7 + 8);  // batched
  EXPECT_EQ(g.cache().free_slots(), 3);
  EXPECT_EQ(g.cache().free_pages(), g.cache().bytes().num_pages);
}

TEST(Generator, StopTokensAndScoring) {
  const ModelConfig cfg = config_of(stacks()[0]);
  const HybridModel m(cfg, {.dtype = DType::f32, .seed = 4, .mtp = false});
  Rng rng(test_seed());
  Request r;
  r.prompt = random_tokens(6, cfg.vocab_size, rng);
  r.max_new = 10;
  Generator g(m, {.max_seqs = 2, .max_tokens = 64});
  const Result free_run = g.run({r})[0];
  // Stop at the third token generated: it is returned and ends the request.
  r.stop = {free_run.tokens[2]};
  const Result stopped = g.run({r})[0];
  const size_t first = size_t(std::find(free_run.tokens.begin(), free_run.tokens.end(), r.stop[0]) -
                              free_run.tokens.begin());
  ASSERT_EQ(stopped.tokens.size(), first + 1);
  EXPECT_EQ(stopped.finish, "stop");
  // Scoring only.
  Request s;
  s.prompt = r.prompt;
  s.max_new = 0;
  s.prompt_logprobs = true;
  const Result scored = g.run({s})[0];
  EXPECT_TRUE(scored.tokens.empty());
  ASSERT_EQ(scored.prompt_logprobs.size(), r.prompt.size() - 1);
  const Tensor L = full_logits(m, r.prompt);
  for (size_t i = 0; i + 1 < r.prompt.size(); ++i)
    EXPECT_NEAR(scored.prompt_logprobs[i],
                token_logprob(L.data<float>() + int64_t(i) * L.size(1), L.size(1), r.prompt[i + 1]),
                2e-5);
}

TEST(Generator, BadRequestsAreRefusedWithNothingQueued) {
  const ModelConfig cfg = config_of(stacks()[1]);
  const HybridModel m(cfg, {.dtype = DType::f32, .seed = 4, .mtp = false});
  Generator g(m, {.max_seqs = 2, .max_tokens = 16, .page = 4});
  Request ok;
  ok.prompt = {1, 2, 3};
  ok.max_new = 2;
  auto refused = [&](Request r, const std::string& needle) {
    testing::expect_error([&] { g.run({ok, r}); }, needle);
    EXPECT_FALSE(g.busy());
  };
  Request r = ok;
  r.prompt = {};
  refused(r, "the prompt is empty");
  r = ok;
  r.prompt = {1, 40};
  refused(r, "prompt token 1 is 40, outside the vocabulary [0, 40)");
  r = ok;
  r.prompt.assign(15, 1);
  r.max_new = 3;
  refused(r, "need 17 tokens of cache, the cache holds 16");
  r = ok;
  r.max_new = -1;
  refused(r, "max_new must be in [0, 2^30]");
  r = ok;
  r.sampling.temperature = -1;
  refused(r, "temperature");
  r = ok;
  r.stop = {-3};
  refused(r, "stop token -3");
  EXPECT_EQ(g.run({ok})[0].tokens.size(), 2u);
}

}  // namespace
}  // namespace hlm::infer
