// The DSA ops' host patterns (ops/dsa_common.h): rows_pattern against a plain sequential
// construction, on selections large enough for the parallel inverse map (many chunks), with and
// without the inverse, ascending and shuffled rows, and its errors.
#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <vector>

#include "core/rng.h"
#include "ops/dsa_common.h"
#include "testing.h"

namespace hlm::ops {
namespace {

using testing::expect_error;
using testing::test_seed;

// Random causal selections [T, W] of a packed batch: each query keeps a random subset of its
// document's tokens at or before it, ascending or shuffled, -1 elsewhere.
Tensor random_selection(const std::vector<int64_t>& cu, int64_t W, bool shuffled, Rng& rng) {
  const int64_t T = cu.back();
  std::vector<int32_t> v(size_t(T * W), -1);
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int64_t t = cu[d]; t < cu[d + 1]; ++t) {
      std::vector<int32_t> keys;
      for (int64_t s = cu[d]; s <= t; ++s)
        if (rng.below(3) != 0) keys.push_back(int32_t(s));
      if (int64_t(keys.size()) > W) keys.resize(size_t(W));
      std::vector<int64_t> slots(static_cast<size_t>(W));
      for (int64_t j = 0; j < W; ++j) slots[size_t(j)] = j;
      if (shuffled) {
        for (int64_t j = W - 1; j > 0; --j)
          std::swap(slots[size_t(j)], slots[rng.below(uint64_t(j + 1))]);
      } else {
        std::sort(slots.begin(), slots.begin() + int64_t(keys.size()));
      }
      for (size_t i = 0; i < keys.size(); ++i) v[size_t(t * W + slots[i])] = keys[i];
    }
  return Tensor::from_vector<int32_t>({T, W}, v);
}

TEST(DsaPattern, RowsPatternEqualsASequentialConstruction) {
  Rng rng(test_seed());
  const std::vector<int64_t> cu{0, 1, 400, 700};  // T = 700: ~10^5 entries, the parallel path
  const int64_t W = 300;
  for (bool shuffled : {false, true}) {
    const Tensor sel = random_selection(cu, W, shuffled, rng);
    std::vector<int64_t> v;
    for (double x : sel.to_f64_vector()) v.push_back(int64_t(x));
    // The reference: entries row by row in slot order, each key's readers in that order.
    std::vector<int64_t> row_ptr{0}, key, query, key_ptr(701, 0);
    std::vector<int32_t> slot;
    for (int64_t t = 0; t < 700; ++t) {
      for (int64_t j = 0; j < W; ++j)
        if (v[size_t(t * W + j)] >= 0) {
          slot.push_back(int32_t(j));
          key.push_back(v[size_t(t * W + j)]);
          query.push_back(t);
        }
      row_ptr.push_back(int64_t(key.size()));
    }
    std::vector<std::vector<int64_t>> readers(700);
    for (size_t e = 0; e < key.size(); ++e) readers[size_t(key[e])].push_back(int64_t(e));
    std::vector<int64_t> key_entry;
    for (int64_t s = 0; s < 700; ++s) {
      key_ptr[size_t(s + 1)] = key_ptr[size_t(s)] + int64_t(readers[size_t(s)].size());
      key_entry.insert(key_entry.end(), readers[size_t(s)].begin(), readers[size_t(s)].end());
    }
    ASSERT_GE(key.size(), size_t(1) << 16) << "too few entries for the parallel inverse";
    for (int threads : {1, 3, omp_get_max_threads()}) {
      omp_set_num_threads(threads);
      const dsa_detail::Pattern p = dsa_detail::rows_pattern(sel, cu, 1, "test", "sel");
      EXPECT_EQ(p.row_ptr, row_ptr);
      EXPECT_EQ(p.slot, slot);
      EXPECT_EQ(p.key, key);
      EXPECT_EQ(p.query, query);
      EXPECT_EQ(p.key_ptr, key_ptr) << threads << " threads";
      EXPECT_EQ(p.key_entry, key_entry) << threads << " threads";
      const dsa_detail::Pattern f = dsa_detail::rows_pattern(sel, cu, 1, "test", "sel", false);
      EXPECT_EQ(f.key, key);
      EXPECT_TRUE(f.key_ptr.empty() && f.key_entry.empty());
    }
    omp_set_num_threads(omp_get_num_procs());
  }
}

TEST(DsaPattern, TheFirstBadRowIsReported) {
  const std::vector<int64_t> cu{0, 3, 6};
  // Row 4 repeats a key (unsorted), row 5 has a key of the other document: row 4 is reported.
  std::vector<int32_t> v{0, -1, -1, 0, 1, -1, 0, 1, 2, 3, -1, -1, 4, 3, 4, 2, -1, -1};
  const Tensor sel = Tensor::from_vector<int32_t>({6, 3}, v);
  expect_error([&] { dsa_detail::rows_pattern(sel, cu, 1, "op", "sel"); },
               "op: sel row 4 holds index 4 more than once");
  v[size_t(4 * 3 + 2)] = -1;
  expect_error(
      [&] {
        dsa_detail::rows_pattern(Tensor::from_vector<int32_t>({6, 3}, v), cu, 1, "op", "sel");
      },
      "op: sel[5, 0] = 2 is not a causal token of query 5's document");
}

}  // namespace
}  // namespace hlm::ops
