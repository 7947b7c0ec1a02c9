// ops::embedding_*: forward copies rows exactly (any dtype), backward accumulates in token order
// (repeated ids) and matches an FP64 reference and finite differences, bad ids name the position.
#include "ops/embedding.h"
#include "testing.h"

namespace hlm {
namespace {

using testing::bit_equal;
using testing::close;
using testing::dot;
using testing::grad_check;
using testing::test_seed;
using testing::tolerance_for;

TEST(OpsEmbedding, ForwardCopiesRows) {
  Rng rng(test_seed());
  for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
    Tensor table = randn({11, 5}, DType::f32, rng).to(dt);
    std::vector<int64_t> ids = {3, 0, 10, 3, 7};
    for (DType idt : {DType::i64, DType::i32}) {
      Tensor out = ops::embedding_forward(table, Tensor::from_vector<int64_t>({5}, ids).to(idt));
      ASSERT_EQ(out.shape(), (Shape{5, 5}));
      for (int64_t t = 0; t < 5; ++t)
        EXPECT_TRUE(bit_equal(out.select(0, t), table.select(0, ids[size_t(t)])));
    }
  }
  // 2-D ids [B, S] give [B, S, D].
  Tensor table = randn({4, 3}, DType::f32, rng);
  Tensor out = ops::embedding_forward(table, Tensor::from_vector<int64_t>({2, 2}, {0, 1, 2, 3}));
  EXPECT_EQ(out.shape(), (Shape{2, 2, 3}));
}

TEST(OpsEmbedding, BackwardAccumulatesAndMatchesReference) {
  Rng rng(test_seed());
  const int64_t nv = 9, d = 6, nt = 20;
  std::vector<int64_t> ids(static_cast<size_t>(nt));
  for (auto& i : ids) i = int64_t(rng.below(4));  // many repeats
  Tensor idt = Tensor::from_vector<int64_t>({nt}, ids);
  for (DType dt : {DType::f32, DType::f64}) {
    Tensor dy = randn({nt, d}, dt, rng), dtable0 = randn({nv, d}, dt, rng);
    Tensor dtable = dtable0.clone();
    ops::embedding_backward(dy, idt, dtable);
    auto ref = dtable0.to_f64_vector();
    const auto vdy = dy.to_f64_vector();
    for (int64_t t = 0; t < nt; ++t)
      for (int64_t i = 0; i < d; ++i) ref[size_t(ids[size_t(t)] * d + i)] += vdy[size_t(t * d + i)];
    EXPECT_TRUE(close(dtable, Tensor::from_values({nv, d}, ref, DType::f64), tolerance_for(dt)));
    Tensor again = dtable0.clone();
    ops::embedding_backward(dy, idt, again);
    EXPECT_TRUE(bit_equal(again, dtable));  // deterministic
  }
  // Finite differences through the forward.
  Tensor table = randn({nv, d}, DType::f64, rng), probe = randn({nt, d}, DType::f64, rng);
  auto loss = [&] { return dot(ops::embedding_forward(table, idt), probe); };
  Tensor g = Tensor::zeros({nv, d}, DType::f64);
  ops::embedding_backward(probe, idt, g);
  EXPECT_TRUE(grad_check(loss, table, g));
}

TEST(OpsEmbedding, BadIds) {
  Rng rng(test_seed());
  Tensor table = randn({5, 3}, DType::f32, rng);
  std::string msg;
  try {
    ops::embedding_forward(table, Tensor::from_vector<int64_t>({4}, {0, 1, 5, 2}));
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("ids[2]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("= 5"), std::string::npos) << msg;
  EXPECT_THROW(ops::embedding_forward(table, Tensor::from_vector<int32_t>({2}, {-1, 0})), Error);
  EXPECT_THROW(ops::embedding_forward(table, Tensor::from_values({2}, {0, 1}, DType::f32)), Error);
  EXPECT_THROW(
      ops::embedding_forward(randn({5}, DType::f32, rng), Tensor::from_vector<int64_t>({1}, {0})),
      Error);
  Tensor dtable = Tensor::zeros({5, 3}, DType::f32);
  EXPECT_THROW(ops::embedding_backward(randn({2, 4}, DType::f32, rng),
                                       Tensor::from_vector<int64_t>({2}, {0, 1}), dtable),
               Error);
  EXPECT_THROW(ops::embedding_backward(randn({2, 3}, DType::f32, rng),
                                       Tensor::from_vector<int64_t>({2}, {0, 9}), dtable),
               Error);
}

// The ids' values given from the host: the same rows, checked there with the same message.
TEST(OpsEmbedding, HostIds) {
  Rng rng(test_seed());
  const Tensor table = randn({5, 3}, DType::f32, rng);
  const std::vector<int64_t> v = {4, 0, 2, 2};
  const Tensor ids = Tensor::from_vector<int64_t>({4}, v);
  EXPECT_TRUE(testing::bit_equal(ops::embedding_forward(table, ids, v),
                                 ops::embedding_forward(table, ids)));
  const std::vector<int64_t> bad = {4, 0, 5, 2};
  testing::expect_error(
      [&] { ops::embedding_forward(table, Tensor::from_vector<int64_t>({4}, bad), bad); },
      "ids[2] (flat position) = 5 is outside the vocabulary [0, 5)");
  testing::expect_error(
      [&] {
        ops::embedding_forward(table, ids, std::vector<int64_t>{1, 2});
      },
      "2 host ids for 4 ids");
}

}  // namespace
}  // namespace hlm
