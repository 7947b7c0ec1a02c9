// ops::greedy_pick on the CPU against infer::sample_token's greedy choice (the same token and the
// same log-probability bits) on random rows, rows with ties (the lower id), one-token rows, and
// rows with a NaN or an infinite logit (the first such id reported); ops::sample_pick against an
// FP64 reference written here (sort, top-k, top-p, the draw) on rows with many ties, and against
// sample_token with the same draw; bad arguments refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "infer/sampling.h"
#include "ops/token_pick.h"
#include "testing.h"

namespace hlm {
namespace {

// log softmax(x)[token] in FP64, written plainly (the reference of every log-probability here).
template <class T>
double ref_logprob(const T* x, int64_t V, int64_t token) {
  double mx = -INFINITY, sum = 0;
  for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double(x[v]));
  for (int64_t v = 0; v < V; ++v) sum += std::exp(double(x[v]) - mx);
  return double(x[token]) - mx - std::log(sum);
}

// greedy_pick and sample_token share the CPU row code: the first of each row's checks is the
// independent one (the first largest logit, log-softmax in FP64 written here).
TEST(TokenPick, EqualsTheSamplersGreedyChoice) {
  Rng rng(testing::test_seed());
  for (int64_t V : {1, 7, 1000, 4099}) {
    const int64_t R = 5;
    std::vector<float> x(size_t(R * V));
    for (auto& v : x) v = float(rng.normal() * 4.0);
    if (V > 3) {
      x[size_t(1 * V + 2)] = 50.f;  // row 1: a tie between ids 2 and V - 1
      x[size_t(1 * V + V - 1)] = 50.f;
    }
    const ops::TokenPick p = ops::greedy_pick(Tensor::from_vector({R, V}, x));
    for (int64_t r = 0; r < R; ++r) {
      const float* row = x.data() + r * V;
      const int64_t best = int64_t(std::max_element(row, row + V) - row);
      EXPECT_EQ(p.token.data<int64_t>()[r], best) << V << " " << r;
      EXPECT_NEAR(p.logprob.data<double>()[r], ref_logprob(row, V, best), 1e-12) << V << " " << r;
      const infer::Sampled s = infer::sample_token(row, V, {}, 0, 0);
      EXPECT_EQ(p.token.data<int64_t>()[r], s.token) << V << " " << r;
      EXPECT_EQ(p.logprob.data<double>()[r], s.logprob) << V << " " << r;
      EXPECT_EQ(p.bad.data<int64_t>()[r], -1);
    }
    if (V > 3) EXPECT_EQ(p.token.data<int64_t>()[1], 2);
  }
}

// The rule of ops/token_pick.h in FP64, written plainly: the sampled row's token.
int64_t ref_sample(const float* x, int64_t V, const ops::SampleRow& p) {
  std::vector<int64_t> ids(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), int64_t(0));
  std::stable_sort(ids.begin(), ids.end(), [&](int64_t a, int64_t b) { return x[a] > x[b]; });
  if (p.top_k > 0 && p.top_k < V) ids.resize(size_t(p.top_k));
  std::vector<double> w;
  for (int64_t i : ids) w.push_back(std::exp((double(x[i]) - double(x[ids[0]])) / p.temperature));
  const double total = std::accumulate(w.begin(), w.end(), 0.0);
  size_t keep = 0;
  for (double run = 0; keep < w.size();) {
    run += w[keep++];
    if (p.top_p < 1 && run >= p.top_p * total) break;
  }
  const double kept = std::accumulate(w.begin(), w.begin() + long(keep), 0.0);
  double run = 0;
  for (size_t i = 0; i < keep; ++i)
    if (p.u * kept < (run += w[i])) return ids[i];
  return ids[keep - 1];
}

// Rows of normal logits rounded to a grid (many ties) and one setting per row.
struct SampleCase {
  std::vector<float> x;
  std::vector<ops::SampleRow> rows;
};
SampleCase sample_case(int64_t V, Rng& rng) {
  const std::vector<ops::SampleRow> settings = {
      {0.0, 0, 1.0, 0.0},    {1.0, 0, 1.0, 0.0}, {0.7, 50, 1.0, 0.0},  {1.3, 0, 0.9, 0.0},
      {1.0, 7, 0.5, 0.0},    {2.0, 1, 1.0, 0.0}, {0.05, 0, 0.95, 0.0}, {5.0, 0, 0.999, 0.0},
      {1.0, 3000, 0.3, 0.0}, {0.9, 0, 1e-9, 0.0}};
  SampleCase c;
  for (size_t r = 0; r < settings.size(); ++r) {
    for (int64_t v = 0; v < V; ++v) c.x.push_back(float(std::round(rng.normal() * 16.0) / 8.0));
    c.rows.push_back(settings[r]);
    c.rows.back().u = rng.uniform();
  }
  return c;
}

TEST(TokenPick, SampledRowsFollowTheRule) {
  Rng rng(testing::test_seed());
  for (int64_t V : {1, 2, 7, 1000, 4099}) {
    const SampleCase c = sample_case(V, rng);
    const int64_t R = int64_t(c.rows.size());
    const ops::TokenPick p = ops::sample_pick(Tensor::from_vector({R, V}, c.x), c.rows);
    for (int64_t r = 0; r < R; ++r) {
      SCOPED_TRACE(::testing::Message() << "V " << V << " row " << r);
      const float* row = c.x.data() + r * V;
      const ops::SampleRow& s = c.rows[size_t(r)];
      const int64_t want = s.temperature == 0 ? int64_t(std::max_element(row, row + V) - row)
                                              : ref_sample(row, V, s);
      EXPECT_EQ(p.token.data<int64_t>()[r], want);
      EXPECT_NEAR(p.logprob.data<double>()[r], ref_logprob(row, V, want), 1e-12);
      // sample_token with the draw of (seed 5, stream r, step 3) picks as the op with that u.
      const infer::SamplingParams sp{s.temperature, s.top_k, s.top_p, 5};
      ops::SampleRow with = s;
      with.u = s.temperature > 0 ? infer::draw(5, uint64_t(r), 3) : 0.0;
      const ops::TokenPick q =
          ops::sample_pick(Tensor::from_vector({1, V}, std::vector<float>(row, row + V)), {with});
      const infer::Sampled t = infer::sample_token(row, V, sp, uint64_t(r), 3);
      EXPECT_EQ(q.token.data<int64_t>()[0], t.token);
      EXPECT_EQ(q.logprob.data<double>()[0], t.logprob);
    }
  }
  const Tensor x = Tensor::zeros({2, 3}, DType::f32);
  const auto bad = [&](ops::SampleRow r, const char* what) {
    testing::expect_error([&] { ops::sample_pick(x, {ops::SampleRow{}, r}); }, what);
  };
  bad({-1.0, 0, 1.0, 0.0}, "row 1: temperature must be 0 or finite and positive");
  bad({NAN, 0, 1.0, 0.0}, "row 1: temperature");
  bad({1.0, -2, 1.0, 0.0}, "row 1: top_k must be >= 0");
  bad({1.0, 0, 0.0, 0.0}, "row 1: top_p must be in (0, 1]");
  bad({1.0, 0, 1.5, 0.0}, "row 1: top_p");
  bad({1.0, 0, 1.0, 1.0}, "row 1: u must be in [0, 1)");
  bad({1.0, 0, 1.0, -0.5}, "row 1: u must be in [0, 1)");
  testing::expect_error([&] { ops::sample_pick(x, {ops::SampleRow{}}); },
                        "1 sampling rows for 2 rows of logits");
}

TEST(TokenPick, ScoresGivenTokens) {
  // Each row's log-probability of a given token against log softmax in FP64 written here; a row
  // with a non-finite logit reports it; a token outside the vocabulary is refused.
  Rng rng(testing::test_seed());
  const int64_t R = 6, V = 777;
  std::vector<double> x(size_t(R * V));
  for (auto& v : x) v = rng.normal() * 5.0;
  x[size_t(4 * V + 9)] = NAN;
  std::vector<int64_t> tok;
  for (int64_t r = 0; r < R; ++r) tok.push_back(int64_t(rng.below(uint64_t(V))));
  const ops::TokenPick p = ops::score_tokens(Tensor::from_vector<double>({R, V}, x), tok);
  for (int64_t r = 0; r < R; ++r) {
    EXPECT_EQ(p.token.data<int64_t>()[r], tok[size_t(r)]);
    EXPECT_EQ(p.bad.data<int64_t>()[r], r == 4 ? 9 : -1);
    if (r == 4) continue;
    EXPECT_NEAR(p.logprob.data<double>()[r], ref_logprob(x.data() + r * V, V, tok[size_t(r)]),
                1e-12);
  }
  const Tensor z = Tensor::zeros({2, 3}, DType::f32);
  testing::expect_error([&] { ops::score_tokens(z, {0, 3}); }, "row 1: token 3 is outside [0, 3)");
  testing::expect_error([&] { ops::score_tokens(z, {-1, 0}); }, "row 0: token -1 is outside");
  testing::expect_error([&] { ops::score_tokens(z, {0}); }, "1 tokens for 2 rows of logits");
}

TEST(TokenPick, ReportsTheFirstNonFiniteLogit) {
  std::vector<double> x = {1, 2, 3, 4, 5, 6, 7, 8, 9};  // [3, 3]
  x[4] = NAN;
  x[6] = -INFINITY;
  x[8] = INFINITY;
  const ops::TokenPick p = ops::greedy_pick(Tensor::from_vector<double>({3, 3}, x));
  EXPECT_EQ(p.bad.data<int64_t>()[0], -1);
  EXPECT_EQ(p.token.data<int64_t>()[0], 2);
  EXPECT_EQ(p.bad.data<int64_t>()[1], 1);
  EXPECT_EQ(p.bad.data<int64_t>()[2], 0);
  testing::expect_error([] { ops::greedy_pick(Tensor::zeros({4}, DType::f32)); },
                        "logits must be [R, V]");
  testing::expect_error(
      [] {
        ops::greedy_pick(Tensor::zeros({2, 0}, DType::f32));
      },
      "logits must be [R, V] with V >= 1");
  testing::expect_error(
      [] {
        ops::greedy_pick(Tensor::zeros({2, 3}, DType::i64));
      },
      "must be f32 or f64");
  EXPECT_EQ(ops::greedy_pick(Tensor::zeros({0, 3}, DType::f32)).token.numel(), 0);
}

}  // namespace
}  // namespace hlm
