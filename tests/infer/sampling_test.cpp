// infer/sampling.h against an FP64 reference written here: greedy is the arg max (ties to the lower
// id) and top-k 1 equals it at any temperature; the log-probability is log softmax of the raw
// logits whatever the settings; top-p keeps the shortest prefix reaching p (worked examples); 20000
// draws with temperature, top-k and top-p follow the renormalised kept distribution within 4.5
// standard deviations and never leave the kept set; the same (seed, sequence, step) gives the same
// token, another sequence another stream; bad settings and non-finite logits are refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <tuple>
#include <vector>

#include "core/rng.h"
#include "infer/sampling.h"
#include "testing.h"

namespace hlm {
namespace {

using infer::sample_token;
using infer::SamplingParams;

double ref_logprob(const std::vector<float>& l, int64_t t) {
  double mx = -INFINITY, s = 0;
  for (float x : l) mx = std::max(mx, double(x));
  for (float x : l) s += std::exp(double(x) - mx);
  return double(l[size_t(t)]) - mx - std::log(s);
}

// The kept tokens and their probabilities (renormalised over the kept set), FP64.
std::vector<std::pair<int64_t, double>> ref_kept(const std::vector<float>& l, double temp,
                                                 int64_t top_k, double top_p) {
  const int64_t V = int64_t(l.size());
  std::vector<int64_t> ids(size_t(V), 0);
  std::iota(ids.begin(), ids.end(), int64_t(0));
  std::stable_sort(ids.begin(), ids.end(), [&](int64_t a, int64_t b) { return l[a] > l[b]; });
  if (top_k > 0 && top_k < V) ids.resize(size_t(top_k));
  double mx = l[size_t(ids[0])], total = 0;
  std::vector<double> w;
  for (int64_t i : ids)
    w.push_back(std::exp((double(l[size_t(i)]) - mx) / temp)), total += w.back();
  size_t keep = ids.size();
  double run = 0;
  for (size_t i = 0; i < ids.size() && top_p < 1; ++i) {
    run += w[i];
    if (run >= top_p * total) {
      keep = i + 1;
      break;
    }
  }
  double kept = 0;
  for (size_t i = 0; i < keep; ++i) kept += w[i];
  std::vector<std::pair<int64_t, double>> out;
  for (size_t i = 0; i < keep; ++i) out.push_back({ids[i], w[i] / kept});
  return out;
}

TEST(Sampling, GreedyIsTheArgMaxAndLogprobIsTheModels) {
  const std::vector<float> l = {0.5f, 2.0f, -1.0f, 2.0f, 1.5f};  // a tie at 2.0: id 1 wins
  SamplingParams g;
  const infer::Sampled s = sample_token(l.data(), 5, g, 0, 0);
  EXPECT_EQ(s.token, 1);
  EXPECT_NEAR(s.logprob, ref_logprob(l, 1), 1e-14);
  SamplingParams k1;
  k1.temperature = 0.7;
  k1.top_k = 1;
  for (uint64_t step = 0; step < 50; ++step) {
    const infer::Sampled t = sample_token(l.data(), 5, k1, 3, step);
    EXPECT_EQ(t.token, 1);
    EXPECT_NEAR(t.logprob, ref_logprob(l, 1), 1e-14);
  }
}

TEST(Sampling, TopPKeepsTheShortestPrefixReachingP) {
  const std::vector<float> l = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  SamplingParams p;
  p.temperature = 1.0;
  for (auto [top_p, allowed] : std::vector<std::pair<double, int>>{{0.5, 1}, {0.7, 2}, {0.81, 3}}) {
    p.top_p = top_p;
    std::vector<int> seen(3, 0);
    for (uint64_t step = 0; step < 400; ++step)
      ++seen[size_t(sample_token(l.data(), 3, p, 1, step).token)];
    for (int t = 0; t < 3; ++t) {
      if (t < allowed)
        EXPECT_GT(seen[size_t(t)], 0) << "top_p " << top_p << " token " << t;
      else
        EXPECT_EQ(seen[size_t(t)], 0) << "top_p " << top_p << " token " << t;
    }
  }
}

TEST(Sampling, DrawsFollowTheKeptDistribution) {
  Rng rng(testing::test_seed(), 5);
  std::vector<float> l(12);
  for (float& x : l) x = float(rng.normal() * 1.5);
  for (auto [temp, top_k, top_p] : std::vector<std::tuple<double, int64_t, double>>{
           {1.0, 0, 1.0}, {0.7, 6, 1.0}, {1.3, 0, 0.8}, {0.9, 8, 0.75}}) {
    SamplingParams p;
    p.temperature = temp;
    p.top_k = top_k;
    p.top_p = top_p;
    p.seed = 11;
    const auto kept = ref_kept(l, temp, top_k, top_p);
    const int N = 20000;
    std::vector<int> count(l.size(), 0);
    for (int i = 0; i < N; ++i) {
      const infer::Sampled s = sample_token(l.data(), int64_t(l.size()), p, 7, uint64_t(i));
      ++count[size_t(s.token)];
      ASSERT_NEAR(s.logprob, ref_logprob(l, s.token), 1e-13);
    }
    std::vector<double> q(l.size(), 0.0);
    for (auto [id, pr] : kept) q[size_t(id)] = pr;
    for (size_t v = 0; v < l.size(); ++v) {
      const double f = double(count[v]) / N, sd = std::sqrt(q[v] * (1 - q[v]) / N);
      if (q[v] == 0)
        EXPECT_EQ(count[v], 0) << "token " << v << " is outside the kept set";
      else
        EXPECT_NEAR(f, q[v], 4.5 * sd + 1e-4)
            << "temperature " << temp << " top_k " << top_k << " top_p " << top_p << " token " << v;
    }
  }
}

TEST(Sampling, ReproducibleAndIndependentPerSequence) {
  Rng rng(testing::test_seed(), 6);
  std::vector<float> l(50);
  for (float& x : l) x = float(rng.normal());
  SamplingParams p;
  p.temperature = 1.0;
  p.seed = 99;
  std::vector<int64_t> a, b, c;
  for (uint64_t step = 0; step < 64; ++step) {
    a.push_back(sample_token(l.data(), 50, p, 4, step).token);
    b.push_back(sample_token(l.data(), 50, p, 4, step).token);
    c.push_back(sample_token(l.data(), 50, p, 5, step).token);
  }
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  p.seed = 100;
  std::vector<int64_t> d;
  for (uint64_t step = 0; step < 64; ++step)
    d.push_back(sample_token(l.data(), 50, p, 4, step).token);
  EXPECT_NE(a, d);
}

TEST(Sampling, BadSettingsAndLogitsAreRefused) {
  const std::vector<float> l = {0.f, 1.f};
  auto with = [&](auto set) {
    SamplingParams p;
    p.temperature = 1.0;
    set(p);
    return p;
  };
  testing::expect_error(
      [&] { sample_token(l.data(), 2, with([](auto& p) { p.temperature = -1; }), 0, 0); },
      "temperature must be 0 (greedy) or a finite positive number, got -1");
  testing::expect_error(
      [&] { sample_token(l.data(), 2, with([](auto& p) { p.temperature = NAN; }), 0, 0); },
      "temperature must be");
  testing::expect_error(
      [&] { sample_token(l.data(), 2, with([](auto& p) { p.top_k = -2; }), 0, 0); },
      "top_k must be 0 (off) or >= 1, got -2");
  testing::expect_error(
      [&] { sample_token(l.data(), 2, with([](auto& p) { p.top_p = 0; }), 0, 0); },
      "top_p must be in (0, 1], got 0");
  testing::expect_error(
      [&] { sample_token(l.data(), 2, with([](auto& p) { p.top_p = 1.5; }), 0, 0); },
      "top_p must be in (0, 1]");
  testing::expect_error([&] { sample_token(l.data(), 0, SamplingParams{}, 0, 0); },
                        "the vocabulary is empty");
  const std::vector<float> bad = {0.f, NAN, 1.f};
  testing::expect_error([&] { sample_token(bad.data(), 3, SamplingParams{}, 0, 0); },
                        "logit nan of token 1 is not finite");
}

}  // namespace
}  // namespace hlm
