// CUDA ops::greedy_pick against the CPU op on the same logits: f32, f64 and bf16 (the CPU on the
// bf16 values as f32), row lengths 1, 511, 513 and the GLM vocabulary 154880, ties (the lower id),
// non-finite logits (the first bad id); tokens and bad ids equal, log-probabilities within 1e-12
// relative (FP64 sums in another order), two runs bit-identical. CUDA ops::sample_pick likewise
// against the CPU op: rows with many ties, greedy and sampled rows mixed, top-k, top-p and both,
// at temperatures 0.05 to 5; and ops::score_tokens (given tokens' log-probabilities).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/device.h"
#include "ops/token_pick.h"
#include "testing.h"

namespace hlm {
namespace {

using testing::cpu;
using testing::gpu;

// Where tokens a and b fall in row x's sampling order under p (a failure's message): each one's
// rank in the order and the running share of all the row's weights before and after it (before
// any top-k or top-p cut: the draw's target is u times the kept share), so a boundary case shows
// as the target within rounding of a share.
std::string where_in_order(const std::vector<double>& x, int64_t V, const ops::SampleRow& p,
                           int64_t a, int64_t b) {
  std::vector<int64_t> ids(size_t(V), 0);
  for (int64_t v = 0; v < V; ++v) ids[size_t(v)] = v;
  std::sort(ids.begin(), ids.end(), [&](int64_t i, int64_t j) {
    return x[size_t(i)] > x[size_t(j)] || (x[size_t(i)] == x[size_t(j)] && i < j);
  });
  const double mx = x[size_t(ids[0])];
  double total = 0;
  std::vector<double> run(size_t(V) + 1, 0.0);
  for (int64_t i = 0; i < V; ++i) {
    total += std::exp((x[size_t(ids[size_t(i)])] - mx) / p.temperature);
    run[size_t(i) + 1] = total;
  }
  std::string s = fmt::format("T {} k {} p {} u {:.17g}:", p.temperature, p.top_k, p.top_p, p.u);
  for (int64_t t : {a, b}) {
    const int64_t rank = std::find(ids.begin(), ids.end(), t) - ids.begin();
    s += fmt::format(" token {} (logit {}) rank {} share {:.17g}..{:.17g};", t, x[size_t(t)], rank,
                     run[size_t(rank)] / total, run[size_t(rank) + 1] / total);
  }
  return s;
}

TEST(TokenPickGpu, MatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  testing::PoisonOutputs poison;
  Rng rng(testing::test_seed());
  for (DType dt : {DType::f32, DType::f64, DType::bf16})
    for (int64_t V : {int64_t(1), int64_t(511), int64_t(513), int64_t(154880)}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " V " << V);
      const int64_t R = V > 1000 ? 3 : 6;
      std::vector<double> x(size_t(R * V));
      for (auto& v : x) v = rng.normal() * 3.0;
      if (V > 3) {
        x[size_t(V + 1)] = 40;  // row 1: ties at 1 and V - 2, the lower wins
        x[size_t(V + V - 2)] = 40;
        x[size_t(2 * V + V / 2)] = NAN;  // row 2: a NaN, then an infinity
        x[size_t(2 * V + V - 1)] = -INFINITY;
      }
      Tensor h = Tensor::from_vector<double>({R, V}, x);
      if (dt != DType::f64) h = h.to(dt);
      const Tensor ref_in = dt == DType::bf16 ? h.to(DType::f32) : h;
      const ops::TokenPick want = ops::greedy_pick(ref_in);
      const Tensor d = gpu(h);
      const ops::TokenPick got = ops::greedy_pick(d);
      const ops::TokenPick again = ops::greedy_pick(d);
      const Tensor tok = cpu(got.token), lp = cpu(got.logprob), bad = cpu(got.bad);
      for (int64_t r = 0; r < R; ++r) {
        EXPECT_EQ(bad.data<int64_t>()[r], want.bad.data<int64_t>()[r]) << r;
        if (want.bad.data<int64_t>()[r] >= 0) continue;
        EXPECT_EQ(tok.data<int64_t>()[r], want.token.data<int64_t>()[r]) << r;
        const double a = lp.data<double>()[r], b = want.logprob.data<double>()[r];
        EXPECT_LE(std::fabs(a - b), 1e-12 * std::max(1.0, std::fabs(b))) << r;
      }
      if (V > 3) EXPECT_EQ(tok.data<int64_t>()[1], 1);
      // The host's view: one copy of the packed outputs, the same values.
      reset_transfer_stats();
      const std::vector<ops::RowPick> rows = got.to_host();
      EXPECT_EQ(transfer_stats().to_host, 1u);
      ASSERT_EQ(int64_t(rows.size()), R);
      for (int64_t r = 0; r < R; ++r) {
        EXPECT_EQ(rows[size_t(r)].token, tok.data<int64_t>()[r]);
        EXPECT_EQ(rows[size_t(r)].bad, bad.data<int64_t>()[r]);
        EXPECT_EQ(std::bit_cast<uint64_t>(rows[size_t(r)].logprob),
                  std::bit_cast<uint64_t>(lp.data<double>()[r]));
      }
      EXPECT_TRUE(testing::bit_equal(cpu(again.logprob), lp));
      EXPECT_TRUE(testing::bit_equal(cpu(again.token), tok));
    }
}

TEST(TokenPickGpu, SampleMatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  testing::PoisonOutputs poison;
  Rng rng(testing::test_seed());
  const std::vector<ops::SampleRow> settings = {
      {0.0, 0, 1.0, 0.0},    {1.0, 0, 1.0, 0.0}, {0.7, 50, 1.0, 0.0},  {1.3, 0, 0.9, 0.0},
      {1.0, 7, 0.5, 0.0},    {2.0, 1, 1.0, 0.0}, {0.05, 0, 0.95, 0.0}, {5.0, 0, 0.999, 0.0},
      {1.0, 3000, 0.3, 0.0}, {0.9, 0, 1e-9, 0.0}};
  std::vector<int64_t> lengths = {1, 2, 511, 513, 4099};
  if (!cuda_emulated()) lengths.push_back(154880);
  for (DType dt : {DType::f32, DType::f64, DType::bf16})
    for (int64_t V : lengths) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " V " << V);
      const int64_t R = 2 * int64_t(settings.size());
      std::vector<double> x(size_t(R * V));
      // A grid of 1/8 (many ties) in the first half of the rows, plain normal values after.
      for (int64_t i = 0; i < R * V; ++i)
        x[size_t(i)] = i < R * V / 2 ? std::round(rng.normal() * 16.0) / 8.0 : rng.normal() * 3.0;
      std::vector<ops::SampleRow> rows;
      for (int64_t r = 0; r < R; ++r) {
        rows.push_back(settings[size_t(r) % settings.size()]);
        rows.back().u = rng.uniform();
      }
      Tensor h = Tensor::from_vector<double>({R, V}, x);
      if (dt != DType::f64) h = h.to(dt);
      const ops::TokenPick want = ops::sample_pick(dt == DType::bf16 ? h.to(DType::f32) : h, rows);
      const Tensor d = gpu(h);
      const ops::TokenPick got = ops::sample_pick(d, rows);
      const ops::TokenPick again = ops::sample_pick(d, rows);
      const Tensor tok = cpu(got.token), lp = cpu(got.logprob), bad = cpu(got.bad);
      for (int64_t r = 0; r < R; ++r) {
        EXPECT_EQ(bad.data<int64_t>()[r], -1) << r;
        const int64_t g = tok.data<int64_t>()[r], w = want.token.data<int64_t>()[r];
        if (g != w) {
          ADD_FAILURE() << "row " << r << ": device " << g << ", cpu " << w << "; "
                        << where_in_order(h.slice(0, r, r + 1).to_f64_vector(), V, rows[size_t(r)],
                                          g, w);
        }
        const double a = lp.data<double>()[r], b = want.logprob.data<double>()[r];
        EXPECT_LE(std::fabs(a - b), 1e-12 * std::max(1.0, std::fabs(b))) << r;
      }
      EXPECT_TRUE(testing::bit_equal(cpu(again.logprob), lp));
      EXPECT_TRUE(testing::bit_equal(cpu(again.token), tok));
      // The given tokens' log-probabilities (a prompt's scores) likewise.
      std::vector<int64_t> given;
      for (int64_t r = 0; r < R; ++r) given.push_back(int64_t(rng.below(uint64_t(V))));
      const ops::TokenPick sw = ops::score_tokens(dt == DType::bf16 ? h.to(DType::f32) : h, given);
      const ops::TokenPick sg = ops::score_tokens(d, given);
      const Tensor slp = cpu(sg.logprob);
      for (int64_t r = 0; r < R; ++r) {
        EXPECT_EQ(cpu(sg.token).data<int64_t>()[r], given[size_t(r)]);
        EXPECT_EQ(cpu(sg.bad).data<int64_t>()[r], -1);
        const double a = slp.data<double>()[r], b = sw.logprob.data<double>()[r];
        EXPECT_LE(std::fabs(a - b), 1e-12 * std::max(1.0, std::fabs(b))) << r;
      }
    }
}

// -0 and +0 are equal logits: the id orders them, as on the CPU (a device key that ordered +0
// before -0 drew other tokens of the zero class on an H100). Rows of zeros of both signs, with
// and without larger logits among them, sampled, top-k and top-p.
TEST(TokenPickGpu, SignedZerosTieByIdAsOnTheCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  const int64_t V = 513, R = 8;
  std::vector<double> x(size_t(R * V));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < V; ++v)
      x[size_t(r * V + v)] = (r >= 4 && v % 7 == 3) ? 1.0 : ((v * 5 + r) % 3 == 0 ? -0.0 : 0.0);
  const std::vector<ops::SampleRow> rows = {
      {1.0, 0, 1.0, 0.3},  {1.0, 5, 1.0, 0.9},  {1.0, 0, 0.5, 0.99}, {2.0, 300, 0.8, 0.61},
      {1.0, 0, 1.0, 0.77}, {1.0, 90, 1.0, 0.9}, {0.5, 0, 0.9, 0.95}, {3.0, 0, 1.0, 0.5}};
  for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor h = Tensor::from_vector<double>({R, V}, x);
    if (dt != DType::f64) h = h.to(dt);
    const ops::TokenPick want = ops::sample_pick(dt == DType::bf16 ? h.to(DType::f32) : h, rows);
    const ops::TokenPick got = ops::sample_pick(gpu(h), rows);
    const Tensor tok = cpu(got.token);
    for (int64_t r = 0; r < R; ++r)
      EXPECT_EQ(tok.data<int64_t>()[r], want.token.data<int64_t>()[r]) << "row " << r;
  }
}

}  // namespace
}  // namespace hlm
