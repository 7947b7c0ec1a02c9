// The pattern of an explicit selection built on the device (ops/cuda/dsa_common.cuh,
// device_rows_pattern) against the host's dsa_detail::rows_pattern on the same rows: every array
// equal (row_ptr, slot, key, query and, with the inverse, key_ptr and key_entry), with and without
// the inverse, for i32 and i64 rows with -1 holes, rows ascending, descending and shuffled, single
// documents of 1, 63 and 65 tokens, packed documents (empty ones too), pools of 1 and 4 tokens,
// W below and above the causal width, all-empty rows, T = 0, and larger shapes (a two-pass sort,
// multi-tile scans); outputs NaN-poisoned, two runs equal. Every refusal (a value beyond the causal
// bound, a key of another document, below -1, a repeat, a bad shape or dtype) gives the host's
// message, also when several rows are bad, on hand-made and on random selections; the front doors
// of the ops give the CPU's messages on CUDA. Off the emulation, one large selection (T = 8192,
// W = 2048, shuffled) is timed and checked.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/rng.h"
#include "core/seq_layout.h"
#include "ops/cuda/dsa_common.cuh"
#include "ops/dsa_common.h"
#include "ops/dsa_indexer.h"
#include "ops/dsa_indexer_loss.h"
#include "ops/dsa_sparse_attention.h"
#include "testing.h"

namespace hlm {
namespace {

using ops::cuda::DsaPatternDev;
using ops::dsa_detail::Pattern;
using testing::cpu;
using testing::gpu;
using Poison = testing::PoisonOutputs;

template <class V>
std::vector<V> host_of(const Tensor& t) {
  EXPECT_TRUE(t.defined());
  if (!t.defined()) return {};
  const Tensor c = cpu(t);
  return std::vector<V>(c.data<V>(), c.data<V>() + c.numel());
}

// The device pattern downloaded.
struct Arrays {
  int64_t T = 0, W = 0, nkeys = 0, entries = 0;
  std::vector<int64_t> row_ptr, key, query, key_ptr, key_entry;
  std::vector<int32_t> slot;
  bool operator==(const Arrays&) const = default;
};
Arrays download(const DsaPatternDev& d, bool with_inverse) {
  Arrays a;
  a.T = d.T, a.W = d.W, a.nkeys = d.nkeys, a.entries = d.entries;
  a.row_ptr = host_of<int64_t>(d.row_ptr);
  a.slot = host_of<int32_t>(d.slot);
  a.key = host_of<int64_t>(d.key);
  a.query = host_of<int64_t>(d.query);
  if (with_inverse) {
    a.key_ptr = host_of<int64_t>(d.key_ptr);
    a.key_entry = host_of<int64_t>(d.key_entry);
  } else {
    EXPECT_FALSE(d.key_ptr.defined() || d.key_entry.defined()) << "an inverse map not asked for";
  }
  return a;
}

void expect_equal(const Arrays& d, const Pattern& h, const std::string& what) {
  EXPECT_EQ(d.T, h.T) << what;
  EXPECT_EQ(d.W, h.W) << what;
  EXPECT_EQ(d.nkeys, h.nkeys) << what;
  EXPECT_EQ(d.entries, h.entries()) << what;
  EXPECT_EQ(d.row_ptr, h.row_ptr) << what << ": row_ptr";
  EXPECT_EQ(d.slot, h.slot) << what << ": slot";
  EXPECT_EQ(d.key, h.key) << what << ": key";
  EXPECT_EQ(d.query, h.query) << what << ": query";
  EXPECT_EQ(d.key_ptr, h.key_ptr) << what << ": key_ptr";
  EXPECT_EQ(d.key_entry, h.key_entry) << what << ": key_entry";
}

std::vector<int64_t> offsets_of(const std::vector<int64_t>& lens) {
  std::vector<int64_t> cu{0};
  for (int64_t L : lens) cu.push_back(cu.back() + L);
  return cu;
}

enum class Order { ascending, descending, shuffled };
const char* name_of(Order o) {
  return o == Order::ascending ? "ascending" : o == Order::descending ? "descending" : "shuffled";
}

// A random selection [T, W] of the packed batch `cu` (keys: tokens for pool 1, the document's
// complete pools for pool > 1): each query keeps a random subset of its visible keys (all of them
// on every 5th row, none on every 7th), at most W, in `order`, at random slots left to right with
// -1 between them. Values as int64, row-major.
std::vector<int64_t> random_rows(const std::vector<int64_t>& cu, int64_t pool, int64_t W,
                                 Order order, Rng& rng) {
  const int64_t T = cu.back();
  const std::vector<int64_t> cp = ops::dsa_detail::pool_offsets(cu, pool);
  std::vector<int64_t> v(size_t(T * W), -1);
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int64_t t = cu[d]; t < cu[d + 1]; ++t) {
      const int64_t lo = cp[d], hi = cp[d] + (t - cu[d] + 1) / pool;
      std::vector<int64_t> keys;
      for (int64_t s = lo; s < hi; ++s)
        if ((t % 5 == 2 || rng.below(3) != 0) && t % 7 != 3) keys.push_back(s);
      for (int64_t j = int64_t(keys.size()) - 1; j > 0; --j)
        std::swap(keys[size_t(j)], keys[rng.below(uint64_t(j + 1))]);
      if (int64_t(keys.size()) > W) keys.resize(size_t(W));
      if (order == Order::ascending) std::sort(keys.begin(), keys.end());
      if (order == Order::descending) std::sort(keys.rbegin(), keys.rend());
      std::vector<int64_t> slots(static_cast<size_t>(W));
      for (int64_t j = 0; j < W; ++j) slots[size_t(j)] = j;
      for (int64_t j = W - 1; j > 0; --j)
        std::swap(slots[size_t(j)], slots[rng.below(uint64_t(j + 1))]);
      slots.resize(keys.size());
      std::sort(slots.begin(), slots.end());
      for (size_t i = 0; i < keys.size(); ++i) v[size_t(t * W + slots[i])] = keys[i];
    }
  return v;
}

Tensor rows_tensor(const std::vector<int64_t>& v, int64_t T, int64_t W, DType dt) {
  if (dt == DType::i64) return Tensor::from_vector<int64_t>({T, W}, v);
  std::vector<int32_t> v32(v.begin(), v.end());
  return Tensor::from_vector<int32_t>({T, W}, v32);
}

// The message without its "file:line: " prefix.
std::string message(const std::string& what) {
  const size_t colon = what.find(": ");
  return colon == std::string::npos ? what : what.substr(colon + 2);
}

// Host and device refuse rows (a CUDA tensor) with the same message; returns it.
std::string expect_same_refusal(const Tensor& rows, const std::vector<int64_t>& cu, int64_t pool,
                                bool with_inverse) {
  const std::string h = message(testing::error_of(
      [&] { ops::dsa_detail::rows_pattern(rows, cu, pool, "op", "rows", with_inverse); }));
  const std::string d = message(testing::error_of(
      [&] { ops::cuda::device_rows_pattern(rows, cu, pool, "op", "rows", with_inverse); }));
  EXPECT_NE(h, "(no error)");
  EXPECT_EQ(d, h) << (with_inverse ? "with" : "without") << " the inverse";
  return h;
}

// One selection both ways, with and without the inverse; the device twice.
void pattern_case(const std::vector<int64_t>& cu, int64_t pool, const Tensor& rows,
                  const std::string& what) {
  const Tensor dev_rows = gpu(rows);
  for (bool inv : {false, true}) {
    const Pattern h = ops::dsa_detail::rows_pattern(rows, cu, pool, "op", "rows", inv);
    const Arrays a =
        download(ops::cuda::device_rows_pattern(dev_rows, cu, pool, "op", "rows", inv), inv);
    const Arrays b =
        download(ops::cuda::device_rows_pattern(dev_rows, cu, pool, "op", "rows", inv), inv);
    const std::string w = what + (inv ? " with inverse" : "");
    expect_equal(a, h, w);
    EXPECT_TRUE(a == b) << w << ": the second run differs";
  }
}

TEST(DsaPatternGpu, RandomSelectionsEqualTheHostPattern) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  const Poison poison;
  Rng rng(testing::test_seed());
  const std::vector<std::vector<int64_t>> batches{
      {1}, {63}, {65}, {1, 63, 65, 2}, {3, 0, 9, 2, 0, 5, 1, 7, 12, 4}};
  int n = 0, entries = 0;
  for (const std::vector<int64_t>& lens : batches)
    for (int64_t pool : {1, 4})
      for (int64_t W : pool == 1 ? std::vector<int64_t>{8, 70} : std::vector<int64_t>{3, 20})
        for (Order order : {Order::ascending, Order::descending, Order::shuffled}) {
          const std::vector<int64_t> cu = offsets_of(lens);
          const int64_t T = cu.back();
          const DType dt = (n++ % 2) ? DType::i64 : DType::i32;
          const Tensor rows = rows_tensor(random_rows(cu, pool, W, order, rng), T, W, dt);
          const std::string what = "T=" + std::to_string(T) +
                                   " docs=" + std::to_string(lens.size()) +
                                   " pool=" + std::to_string(pool) + " W=" + std::to_string(W) +
                                   " " + name_of(order) + " " + dtype_name(dt);
          pattern_case(cu, pool, rows, what);
          entries +=
              int(ops::dsa_detail::rows_pattern(rows, cu, pool, "op", "rows", false).entries());
        }
  std::printf("%d random selections, %d entries in all: device arrays equal the host's\n", n,
              entries);
}

// Larger shapes: more than 256 keys (600 keys: 10 bits, a radix sort of two passes of 5), more
// than 2048 rows or digit counts (scans of several tiles), some 10^4 entries (10 sort chunks).
TEST(DsaPatternGpu, LargerSelectionsEqualTheHostPattern) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  const Poison poison;
  Rng rng(testing::test_seed());
  struct Case {
    std::vector<int64_t> lens;
    int64_t pool, W;
    Order order;
  };
  for (const Case& c :
       {Case{{300, 1, 299}, 1, 5, Order::descending}, Case{{300, 1, 299}, 1, 5, Order::shuffled},
        Case{{256}, 1, 64, Order::shuffled}, Case{{1500, 1200}, 4, 2, Order::ascending}}) {
    const std::vector<int64_t> cu = offsets_of(c.lens);
    const Tensor rows =
        rows_tensor(random_rows(cu, c.pool, c.W, c.order, rng), cu.back(), c.W, DType::i32);
    const int64_t E = ops::dsa_detail::rows_pattern(rows, cu, c.pool, "op", "rows").entries();
    std::printf("T=%lld pool=%lld W=%lld %s: %lld entries\n", (long long)cu.back(),
                (long long)c.pool, (long long)c.W, name_of(c.order), (long long)E);
    pattern_case(cu, c.pool, rows,
                 std::string("T=") + std::to_string(cu.back()) + " " + name_of(c.order));
  }
}

TEST(DsaPatternGpu, EmptySelectionsAndNoTokens) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  const Poison poison;
  for (int64_t pool : {1, 4}) {
    const std::vector<int64_t> cu{0, 5, 70};
    pattern_case(cu, pool, rows_tensor(std::vector<int64_t>(70 * 9, -1), 70, 9, DType::i32),
                 "all -1");
    pattern_case(cu, pool, rows_tensor({}, 70, 0, DType::i64), "W = 0");
  }
  pattern_case({0}, 1, rows_tensor({}, 0, 4, DType::i32), "T = 0");
  pattern_case({0, 0}, 4, rows_tensor({}, 0, 3, DType::i64), "T = 0, an empty document");
}

TEST(DsaPatternGpu, RefusalsGiveTheHostMessages) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  const Poison poison;
  // Two documents: tokens 0..2 and 3..8. Row t of the second document sees tokens [3, t + 1).
  const std::vector<int64_t> cu{0, 3, 9};
  const int64_t T = 9, W = 4;
  const std::vector<int64_t> good{0,  -1, -1, -1,  // t = 0
                                  0,  1,  -1, -1,  // t = 1
                                  -1, 0,  1,  2,   // t = 2
                                  3,  -1, -1, -1,  // t = 3
                                  3,  4,  -1, -1,  // t = 4
                                  5,  3,  4,  -1,  // t = 5 (not ascending)
                                  6,  5,  4,  3,   // t = 6 (descending)
                                  3,  5,  7,  -1,  // t = 7
                                  -1, -1, 8,  4};  // t = 8
  struct Case {
    const char* what;
    std::vector<std::pair<int64_t, int64_t>> set;  // (flat index, value)
    const char* expect;                            // a part of the message
  };
  const std::vector<Case> cases{
      {"beyond the causal bound", {{4 * W + 2, 5}}, "rows[4, 2] = 5 is not a causal token"},
      {"a key of another document", {{5 * W + 3, 1}}, "rows[5, 3] = 1"},
      {"below -1", {{2 * W + 0, -2}}, "rows[2, 0] = -2"},
      {"far below -1", {{7 * W + 3, -1000}}, "rows[7, 3] = -1000"},
      {"a repeat", {{7 * W + 3, 3}}, "rows row 7 holds index 3 more than once"},
      {"two repeated values: the smallest", {{6 * W + 0, 5}, {6 * W + 2, 3}}, "holds index 3"},
      {"a repeat in a descending row", {{6 * W + 1, 6}}, "row 6 holds index 6"},
      {"a repeat, then a bad row", {{4 * W + 2, 3}, {6 * W + 0, 9}}, "row 4 holds index 3"},
      {"a bad row, then a repeat", {{4 * W + 2, 5}, {6 * W + 0, 5}}, "rows[4, 2] = 5"},
      {"an unsorted row, then a bad row", {{8 * W + 0, 0}}, "rows[8, 0] = 0"},
      {"a repeat and a bad column in one row", {{5 * W + 3, 5}, {5 * W + 2, 8}}, "rows[5, 2] = 8"},
      {"a bad column after a repeat in one row",
       {{5 * W + 2, 5}, {5 * W + 3, 9}},
       "rows[5, 3] = 9"},
      {"two bad columns: the first", {{8 * W + 0, 9}, {8 * W + 1, -3}}, "rows[8, 0] = 9"},
      {"the first of many bad rows", {{0, 1}, {4 * W, 0}, {8 * W, -2}}, "rows[0, 0] = 1"},
      {"repeats in many rows: the first",
       {{8 * W + 1, 8}, {2 * W, 2}, {6 * W, 3}},
       "row 2 holds index 2"},
  };
  for (const Case& c : cases) {
    std::vector<int64_t> v = good;
    for (const auto& [i, x] : c.set) v[size_t(i)] = x;
    for (DType dt : {DType::i32, DType::i64})
      for (bool inv : {false, true}) {
        const std::string m = expect_same_refusal(gpu(rows_tensor(v, T, W, dt)), cu, 1, inv);
        EXPECT_NE(m.find(c.expect), std::string::npos) << c.what << ": " << m;
        if (dt == DType::i32 && inv) std::printf("  %-40s %s\n", c.what, m.c_str());
      }
  }
  // Pools of 2 tokens: token t of a document sees pools [first, first + (r + 1) / 2).
  std::vector<int64_t> pv(size_t(T * 2), -1);
  pv[size_t(8 * 2)] = 3;  // t = 8 (r = 5): pools [1, 4) of the second document
  pv[size_t(8 * 2 + 1)] = 4;
  std::printf("  %-40s %s\n", "a pool beyond the bound",
              expect_same_refusal(gpu(rows_tensor(pv, T, 2, DType::i64)), cu, 2, true).c_str());
  pv[size_t(8 * 2 + 1)] = 3;
  std::printf("  %-40s %s\n", "a repeated pool",
              expect_same_refusal(gpu(rows_tensor(pv, T, 2, DType::i32)), cu, 2, false).c_str());
  // Shapes and dtypes.
  const Tensor ok = gpu(rows_tensor(good, T, W, DType::i32));
  for (const Tensor& bad :
       {gpu(Tensor::from_vector<int32_t>({T}, std::vector<int32_t>(T, -1))),
        gpu(rows_tensor(std::vector<int64_t>((T - 1) * W, -1), T - 1, W, DType::i64)),
        gpu(Tensor::full({T, W}, -1.0, DType::f32)), Tensor()})
    std::printf("  %-40s %s\n", "bad rows", expect_same_refusal(bad, cu, 1, true).c_str());
  // A strided CUDA index tensor (a transposed view) gives the pattern of its contiguous copy.
  const Tensor okt = gpu(cpu(ok).transpose(0, 1).contiguous()).transpose(0, 1);
  ASSERT_FALSE(okt.is_contiguous());
  const auto a = ops::cuda::device_rows_pattern(okt, cu, 1, "op", "rows", true);
  const auto b = ops::cuda::device_rows_pattern(ok, cu, 1, "op", "rows", true);
  for (const auto& [x, y] : {std::pair{a.row_ptr, b.row_ptr}, std::pair{a.key, b.key},
                             std::pair{a.slot, b.slot}, std::pair{a.key_entry, b.key_entry}})
    EXPECT_TRUE(testing::bit_equal(cpu(x), cpu(y))) << "strided rows";
}

// Random valid selections with 1 to 3 random faults (a value beyond the bound or below -1, a key
// of another document, a repeat of a value of the row) in random rows: the same message both ways.
TEST(DsaPatternGpu, RandomFaultsGiveTheHostMessages) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  const std::vector<int64_t> cu{0, 20, 21, 60};
  const int64_t T = cu.back();
  int repeats = 0, ranges = 0;
  for (int trial = 0; trial < 24; ++trial) {
    const int64_t pool = trial % 3 == 2 ? 4 : 1, W = trial % 2 ? 6 : 24;
    const Order order = Order(trial % 3);
    std::vector<int64_t> v = random_rows(cu, pool, W, order, rng);
    const int faults = 1 + int(rng.below(3));
    for (int f = 0; f < faults; ++f) {
      const int64_t t = int64_t(rng.below(uint64_t(T))), j = int64_t(rng.below(uint64_t(W)));
      int64_t* row = v.data() + t * W;
      switch (rng.below(4)) {
        case 0:  // beyond the causal bound
          row[j] = (t + 1) / pool + 50;
          break;
        case 1:  // below -1
          row[j] = -2 - int64_t(rng.below(5));
          break;
        case 2:  // a key of another document (the first document's first key)
          row[j] = t >= cu[1] ? 0 : T / pool - 1;
          break;
        default: {  // a value of the row repeated (-2 when the row has no other value)
          const int64_t s0 = int64_t(rng.below(uint64_t(W)));
          row[j] = -2;
          for (int64_t k = 0; k < W; ++k) {
            const int64_t s = (s0 + k) % W;
            if (s != j && row[s] >= 0) {
              row[j] = row[s];
              break;
            }
          }
          break;
        }
      }
    }
    const std::string m = expect_same_refusal(
        gpu(rows_tensor(v, T, W, trial % 2 ? DType::i64 : DType::i32)), cu, pool, trial % 4 < 2);
    repeats += m.find("more than once") != std::string::npos;
    ranges += m.find("is not a causal") != std::string::npos;
  }
  std::printf("24 faulty selections: %d repeats and %d out-of-range values reported as the host\n",
              repeats, ranges);
  EXPECT_GT(repeats, 0);
  EXPECT_GT(ranges, 0);
}

// The front doors on CUDA build the device pattern: a bad selection gives the CPU's message.
TEST(DsaPatternGpu, FrontDoorsRefuseAsTheCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  const SeqLayout seqs = SeqLayout::from_lengths({3, 5});
  const int64_t T = 8, H = 2, D = 8;
  const Tensor q = randn({T, H, D}, DType::f32, rng), kv = randn({T, D}, DType::f32, rng);
  const Tensor w = randn({T, H}, DType::f32, rng), out = randn({T, H, 4}, DType::f32, rng);
  const Tensor lse = randn({T, H}, DType::f32, rng), ds = randn({T, 2}, DType::f32, rng);
  for (const std::vector<int32_t>& iv :
       {std::vector<int32_t>{0, -1, 0, 1, 2, 1, 3, -1, 4, 3, 5, 3, 6, 5, 7, 7},
        std::vector<int32_t>{0, -1, 0, 1, 2, 1, 3, -1, 4, 3, 5, 3, 6, 2, 7, 3}}) {
    const Tensor idx = Tensor::from_vector<int32_t>({T, 2}, iv);
    const auto both = [&](const char* op, const std::function<void(bool)>& f) {
      const std::string c = message(testing::error_of([&] { f(false); }));
      const std::string g = message(testing::error_of([&] { f(true); }));
      EXPECT_NE(c, "(no error)") << op;
      EXPECT_EQ(g, c) << op;
      std::printf("  %-28s %s\n", op, g.c_str());
    };
    const auto on = [](bool dev, const Tensor& t) { return dev ? gpu(t) : t; };
    both("sparse_attention",
         [&](bool g) { ops::sparse_attention(on(g, q), on(g, kv), on(g, idx), seqs, 4, 0.5); });
    both("sparse_attention_backward", [&](bool g) {
      ops::sparse_attention_backward(on(g, q), on(g, kv), on(g, idx), seqs, 4, 0.5, on(g, out),
                                     on(g, lse), on(g, out));
    });
    both("attention_target_at",
         [&](bool g) { ops::attention_target_at(on(g, q), on(g, kv), seqs, on(g, idx), 0.5); });
    both("indexer_scores_at",
         [&](bool g) { ops::indexer_scores_at(on(g, q), on(g, kv), on(g, w), seqs, on(g, idx)); });
    both("indexer_scores_at_backward", [&](bool g) {
      ops::indexer_scores_at_backward(on(g, q), on(g, kv), on(g, w), seqs, on(g, idx), on(g, ds));
    });
  }
}

TEST(DsaPatternGpu, LargeShuffledSelectionTimed) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  if (cuda_emulated())
    GTEST_SKIP() << "emulated device: T = 8192 is too slow and timings mean nothing";
  Rng rng(testing::test_seed());
  const int64_t T = 8192, W = 2048;
  const std::vector<int64_t> cu{0, T};
  std::vector<int32_t> v(size_t(T * W), -1), cand;
  for (int64_t t = 0; t < T; ++t) {
    cand.resize(size_t(t + 1));
    for (int64_t s = 0; s <= t; ++s) cand[size_t(s)] = int32_t(s);
    const int64_t n = std::min<int64_t>(W, t + 1);
    for (int64_t j = 0; j < n; ++j) {
      std::swap(cand[size_t(j)], cand[size_t(j) + rng.below(uint64_t(t + 1 - j))]);
      v[size_t(t * W + j)] = cand[size_t(j)];
    }
  }
  const Tensor rows = Tensor::from_vector<int32_t>({T, W}, v), dev_rows = gpu(rows);
  for (bool inv : {false, true}) {
    const auto h0 = std::chrono::steady_clock::now();
    const Pattern h = ops::dsa_detail::rows_pattern(dev_rows, cu, 1, "timing", "rows", inv);
    const DsaPatternDev up = ops::cuda::upload_pattern(h, inv);
    device_synchronize();
    const double host_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - h0).count();
    DsaPatternDev d = ops::cuda::device_rows_pattern(dev_rows, cu, 1, "timing", "rows", inv);
    std::vector<double> ms;
    for (int i = 0; i < 5; ++i) {
      device_synchronize();
      const auto t0 = std::chrono::steady_clock::now();
      d = ops::cuda::device_rows_pattern(dev_rows, cu, 1, "timing", "rows", inv);
      device_synchronize();
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    std::printf(
        "T=%lld W=%lld shuffled, %lld entries, %s inverse: device pattern %.2f ms (median of 5), "
        "host pattern + upload %.1f ms\n",
        (long long)T, (long long)W, (long long)h.entries(), inv ? "with" : "without", ms[2],
        host_ms);
    expect_equal(download(d, inv), h, inv ? "large, with inverse" : "large");
  }
}

}  // namespace
}  // namespace hlm
