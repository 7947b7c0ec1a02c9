// SeqLayout (core/seq_layout.h): the checks, the accessors, and the chunk table against a
// token-by-token walk of the same batch.
#include "core/seq_layout.h"

#include <gtest/gtest.h>

#include <thread>

#include "core/error.h"
#include "core/rng.h"
#include "testing.h"

namespace hlm {
namespace {

using testing::expect_error;

TEST(SeqLayout, Accessors) {
  const SeqLayout s = SeqLayout::from_lengths({3, 0, 5, 1});
  EXPECT_EQ(s.total_tokens(), 9);
  EXPECT_EQ(s.num_seqs(), 4);
  EXPECT_EQ(s.offsets(), (std::vector<int64_t>{0, 3, 3, 8, 9}));
  EXPECT_EQ(s.begin(2), 3);
  EXPECT_EQ(s.end(2), 8);
  EXPECT_EQ(s.length(1), 0);
  EXPECT_EQ(s.max_length(), 5);
  const Tensor& cu = s.cu_seqlens();
  ASSERT_EQ(cu.dtype(), DType::i64);
  ASSERT_EQ(cu.shape(), Shape({5}));
  for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(cu.data<int64_t>()[i], s.offsets()[size_t(i)]);
  EXPECT_EQ(&s.cu_seqlens(), &cu) << "made once, then shared";
  const SeqLayout copy = s;  // copies share the caches
  EXPECT_EQ(&copy.cu_seqlens(), &cu);

  const SeqLayout one = SeqLayout::single(7);
  EXPECT_EQ(one.num_seqs(), 1);
  EXPECT_EQ(one.total_tokens(), 7);
  const SeqLayout none = SeqLayout::from_tensor(Tensor(), 7);
  EXPECT_EQ(none.offsets(), one.offsets());
  EXPECT_EQ(SeqLayout().total_tokens(), 0);
}

TEST(SeqLayout, FromTensorChecks) {
  const Tensor i32 = Tensor::from_vector<int32_t>({3}, {0, 2, 6});
  EXPECT_EQ(SeqLayout::from_tensor(i32, 6).offsets(), (std::vector<int64_t>{0, 2, 6}));
  expect_error([&] { SeqLayout::from_tensor(i32, 5); }, "must end at the token count T = 5");
  expect_error(
      [&] {
        SeqLayout::from_tensor(Tensor::from_vector<int64_t>({3}, {1, 2, 6}), 6);
      },
      "must start at 0");
  expect_error(
      [&] {
        SeqLayout::from_tensor(Tensor::from_vector<int64_t>({3}, {0, 4, 2}), 2);
      },
      "must be non-decreasing, got 2 at index 2 after 4");
  expect_error(
      [&] {
        SeqLayout::from_tensor(Tensor::from_vector<float>({2}, {0, 2}), 2);
      },
      "must be i64 or i32");
  expect_error(
      [&] {
        SeqLayout::from_tensor(Tensor::from_vector<int64_t>({1, 2}, {0, 2}), 2);
      },
      "must be 1-D");
  expect_error([&] { SeqLayout::from_tensor(Tensor::from_vector<int64_t>({0}, {}), 0); },
               "N+1 >= 1 entries");
  expect_error([&] { SeqLayout::from_lengths({2, -1}); }, "must be >= 0");
  expect_error([&] { SeqLayout::from_lengths({INT64_MAX, 1}); }, "overflow");
  expect_error([&] { SeqLayout::single(-1); }, "must be >= 0");
  const SeqLayout s = SeqLayout::from_lengths({2, 2});
  expect_error([&] { s.check_tokens(5, "conv1d", "x"); },
               "conv1d: the sequence layout covers 4 tokens, x has 5");
  s.check_tokens(4, "conv1d");
}

// Layouts read from cu_seqlens tensors: i32 with empty sequences, N = 0 sequences, a strided view,
// lengths with empty sequences; errors name the argument they were given.
TEST(SeqLayout, FromTensorLayouts) {
  const SeqLayout i32 = SeqLayout::from_tensor(Tensor::from_vector<int32_t>({3}, {0, 0, 5}), 5);
  EXPECT_EQ(i32.offsets(), (std::vector<int64_t>{0, 0, 5}));
  EXPECT_EQ(i32.num_seqs(), 2);
  EXPECT_EQ(i32.length(0), 0);
  const SeqLayout none = SeqLayout::from_tensor(Tensor::from_vector<int64_t>({1}, {0}), 0);
  EXPECT_EQ(none.num_seqs(), 0);
  EXPECT_EQ(none.total_tokens(), 0);
  EXPECT_EQ(none.chunks(64).num_chunks, 0);
  const Tensor big = Tensor::from_vector<int64_t>({6}, {0, 99, 2, 99, 5, 99});
  const Tensor strided = big.view({3, 2}).select(1, 0);  // [0, 2, 5]
  EXPECT_EQ(SeqLayout::from_tensor(strided, 5).offsets(), (std::vector<int64_t>{0, 2, 5}));
  EXPECT_EQ(SeqLayout::from_lengths({3, 0, 2}).offsets(), (std::vector<int64_t>{0, 3, 3, 5}));
  EXPECT_EQ(SeqLayout::from_offsets({0, 4, 4, 7}, 7).num_seqs(), 3);
  expect_error(
      [] {
        SeqLayout::from_tensor(Tensor::from_vector<int64_t>({3}, {3, 4, 5}), 5);
      },
      "must start at 0, got 3");
  expect_error([] { SeqLayout::from_offsets({0, 2, 4}, 5, "cu_pools"); }, "cu_pools");
  expect_error([] { SeqLayout::from_offsets({}, 0); }, "N+1 >= 1 entries");
}

// The chunk table of random layouts against a walk over the tokens: a chunk starts at every
// sequence start and every C tokens into a sequence.
TEST(SeqLayout, ChunkTableMatchesTokenWalk) {
  Rng rng(testing::test_seed());
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<int64_t> lengths(1 + rng.next_u32() % 6);
    for (auto& l : lengths) l = int64_t(rng.next_u32() % 150);  // 0 allowed
    const int64_t C = 1 + int64_t(rng.next_u32() % 70);
    const SeqLayout s = SeqLayout::from_lengths(lengths);
    const auto& t = s.chunks(C);
    std::vector<int32_t> bos, len, first{0};
    for (size_t n = 0; n < lengths.size(); ++n) {
      for (int64_t tok = s.begin(int64_t(n)); tok < s.end(int64_t(n)); ++tok) {
        if ((tok - s.begin(int64_t(n))) % C == 0) {
          bos.push_back(int32_t(tok));
          len.push_back(0);
        }
        ++len.back();
      }
      first.push_back(int32_t(bos.size()));
    }
    ASSERT_EQ(t.chunk, C);
    ASSERT_EQ(t.num_chunks, int64_t(bos.size()));
    ASSERT_EQ(t.meta.size(), bos.size() * 2 + first.size());
    for (size_t c = 0; c < bos.size(); ++c) {
      EXPECT_EQ(t.bos()[c], bos[c]) << "chunk " << c;
      EXPECT_EQ(t.len()[c], len[c]) << "chunk " << c;
    }
    for (size_t n = 0; n < first.size(); ++n) EXPECT_EQ(t.first_chunk()[n], first[n]);
    EXPECT_EQ(&s.chunks(C), &t);
    const Tensor& meta = s.chunk_meta(C, Device::cpu);
    ASSERT_EQ(meta.dtype(), DType::i32);
    ASSERT_EQ(meta.numel(), int64_t(t.meta.size()));
    for (size_t i = 0; i < t.meta.size(); ++i) EXPECT_EQ(meta.data<int32_t>()[i], t.meta[i]);
  }
  expect_error([] { SeqLayout::single(4).chunks(0); }, "chunk size must be >= 1");
  expect_error([] { SeqLayout::single(int64_t(1) << 31).chunks(64); }, "exceed the int32");
}

// Threads asking for the same derived tables get one copy.
TEST(SeqLayout, CachesAreThreadSafe) {
  const SeqLayout s = SeqLayout::from_lengths({100, 37, 64});
  std::vector<const SeqLayout::ChunkTable*> seen(8);
  std::vector<const Tensor*> cus(8);
  std::vector<std::thread> th;
  for (int i = 0; i < 8; ++i)
    th.emplace_back([&, i] {
      seen[size_t(i)] = &s.chunks(64);
      cus[size_t(i)] = &s.cu_seqlens();
    });
  for (auto& t : th) t.join();
  for (int i = 1; i < 8; ++i) {
    EXPECT_EQ(seen[size_t(i)], seen[0]);
    EXPECT_EQ(cus[size_t(i)], cus[0]);
  }
  EXPECT_EQ(seen[0]->num_chunks, 2 + 1 + 1);
}

}  // namespace
}  // namespace hlm
