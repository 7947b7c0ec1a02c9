// CUDA embedding (ops::embedding_forward / embedding_backward) against the CPU op on the same
// inputs: forward rows bit-exact for f32, f64, bf16 and e4m3 tables (16-, 8-, 4-, 2- and 1-byte
// copy units), ids i64 / i32 of shapes [T] and [B, S], T = 1, 7, 130, 1100 (two chunks of the
// sort), V = 1 (no sort pass), 1000, 5003 and 70000 (three passes); backward f32 / f64 with
// repeated ids (one hot id, few ids, all ids distinct) bit-identical to the CPU reference and run
// to run; outputs NaN-poisoned; bad ids refused with the CPU's message.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/device.h"
#include "core/rng.h"
#include "ops/dispatch.h"
#include "ops/embedding.h"
#include "testing.h"

namespace hlm {
namespace {

using testing::bit_equal;
using testing::cpu;
using testing::gpu;

// T ids in [0, V): mode 0 uniform, 1 from 5 values, 2 half of them one hot id.
Tensor random_ids(const Shape& s, int64_t v, int mode, DType idt, Rng& rng) {
  std::vector<int64_t> ids(static_cast<size_t>(shape_numel(s)));
  const int64_t hot = int64_t(rng.below(uint64_t(v)));
  for (auto& i : ids) {
    if (mode == 1)
      i = int64_t(rng.below(5)) * 37 % v;
    else if (mode == 2 && rng.below(2) == 0)
      i = hot;
    else
      i = int64_t(rng.below(uint64_t(v)));
  }
  return Tensor::from_vector<int64_t>(s, ids).to(idt);
}

TEST(EmbeddingGpu, ForwardCopiesRowsBitExactly) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  testing::PoisonOutputs poison;
  Rng rng(testing::test_seed());
  struct Case {
    DType dt;
    int64_t v, d;
  };
  // Row bytes 256 (16-byte units), 40 (8), 20 (4), 6 (2), 5 (1).
  const std::vector<Case> cases = {{DType::f32, 1000, 64}, {DType::f64, 5003, 5},
                                   {DType::f32, 1000, 5},  {DType::bf16, 5003, 3},
                                   {DType::e4m3, 1000, 5}, {DType::bf16, 1, 16}};
  for (const Case& c : cases)
    for (int64_t t : {1, 7, 130})
      for (DType idt : {DType::i64, DType::i32}) {
        const Tensor table = randn({c.v, c.d}, DType::f32, rng).to(c.dt);
        const Tensor ids = random_ids({t}, c.v, int(t % 3), idt, rng);
        const Tensor ref = ops::embedding_forward(table, ids);
        const Tensor out = ops::embedding_forward(gpu(table), gpu(ids));
        ASSERT_EQ(out.shape(), ref.shape());
        EXPECT_EQ(out.dtype(), c.dt);
        EXPECT_TRUE(bit_equal(cpu(out), ref)) << dtype_name(c.dt) << " T=" << t;
      }
  // [B, S] ids; a table that is a view (rows 3.. of a larger one, columns 1..: copied contiguous
  // first).
  const Tensor big = randn({1003, 9}, DType::f32, rng);
  const Tensor view = big.slice(0, 3, 1003).slice(1, 1, 9);
  const Tensor ids = random_ids({4, 33}, 1000, 0, DType::i64, rng);
  const Tensor out = ops::embedding_forward(gpu(big).slice(0, 3, 1003).slice(1, 1, 9), gpu(ids));
  EXPECT_EQ(out.shape(), (Shape{4, 33, 8}));
  EXPECT_TRUE(bit_equal(cpu(out), ops::embedding_forward(view, ids)));
}

TEST(EmbeddingGpu, BackwardBitIdenticalToCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  testing::PoisonOutputs poison;
  Rng rng(testing::test_seed());
  struct Case {
    int64_t v, d, t;
  };
  const std::vector<Case> cases = {{1000, 64, 1},   {1000, 5, 7},    {5003, 130, 130}, {1, 16, 7},
                                   {5003, 3, 1100}, {70000, 7, 130}, {1000, 33, 130}};
  for (DType dt : {DType::f32, DType::f64})
    for (const Case& c : cases)
      for (int mode = 0; mode < 3; ++mode) {
        const DType idt = mode == 1 ? DType::i32 : DType::i64;
        const Tensor ids = random_ids({c.t}, c.v, mode, idt, rng);
        const Tensor dy = randn({c.t, c.d}, dt, rng), dtable0 = randn({c.v, c.d}, dt, rng);
        Tensor ref = dtable0.clone();
        ops::embedding_backward(dy, ids, ref);
        Tensor dtable = gpu(dtable0);
        const Tensor gdy = gpu(dy), gids = gpu(ids);
        ops::embedding_backward(gdy, gids, dtable);
        EXPECT_TRUE(bit_equal(cpu(dtable), ref))
            << dtype_name(dt) << " V=" << c.v << " D=" << c.d << " T=" << c.t << " mode " << mode;
        Tensor again = gpu(dtable0);
        ops::embedding_backward(gdy, gids, again);
        EXPECT_TRUE(bit_equal(cpu(again), cpu(dtable)));
      }
  // [B, S] ids accumulate twice into the same table: the second call adds to the first's result.
  const Tensor ids = random_ids({3, 20}, 50, 1, DType::i64, rng);
  const Tensor dy = randn({3, 20, 4}, DType::f32, rng);
  Tensor ref = Tensor::zeros({50, 4}, DType::f32), got = gpu(ref);
  for (int k = 0; k < 2; ++k) {
    ops::embedding_backward(dy, ids, ref);
    ops::embedding_backward(gpu(dy), gpu(ids), got);
  }
  EXPECT_TRUE(bit_equal(cpu(got), ref));
  // No tokens: nothing changes.
  Tensor none = gpu(ref);
  ops::embedding_backward(gpu(Tensor::zeros({0, 4}, DType::f32)),
                          gpu(Tensor::zeros({0}, DType::i64)), none);
  EXPECT_TRUE(bit_equal(cpu(none), ref));
}

TEST(EmbeddingGpu, BadIdsRefusedWithTheCpuMessage) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  const Tensor table = randn({5, 3}, DType::f32, rng), gtable = gpu(table);
  auto same = [&](const Tensor& ids) {
    const std::string c = testing::error_of([&] { ops::embedding_forward(table, ids); });
    const std::string g = testing::error_of([&] { ops::embedding_forward(gtable, gpu(ids)); });
    EXPECT_NE(c, "(no error)");
    EXPECT_EQ(g, c);
    EXPECT_EQ(g.find('\n'), std::string::npos) << g;
    Tensor dt = Tensor::zeros({5, 3}, DType::f32), gdt = gpu(dt);
    const Tensor dy = randn(Shape{ids.numel(), 3}, DType::f32, rng);
    const std::string cb = testing::error_of([&] { ops::embedding_backward(dy, ids, dt); });
    const std::string gb =
        testing::error_of([&] { ops::embedding_backward(gpu(dy), gpu(ids), gdt); });
    EXPECT_NE(cb, "(no error)");
    EXPECT_EQ(gb, cb);
    return g;
  };
  EXPECT_NE(
      same(Tensor::from_vector<int64_t>({4}, {0, 1, 5, 2})).find("ids[2] (flat position) = 5"),
      std::string::npos);
  EXPECT_NE(same(Tensor::from_vector<int32_t>({2}, {0, -1})).find("ids[1] (flat position) = -1"),
            std::string::npos);
  // The first bad position of several, far apart: 1777 and 2801 = 1777 + 1024 fall to the same
  // thread of the check, 2050 and 2999 to others.
  std::vector<int64_t> many(3000, 4);
  many[2999] = -7;
  many[2801] = -3;
  many[1777] = 1 << 20;
  many[2050] = 5;
  EXPECT_NE(same(Tensor::from_vector<int64_t>({3000}, many)).find("ids[1777]"), std::string::npos);
  // Wrong dtypes and shapes.
  EXPECT_THROW(ops::embedding_forward(gtable, gpu(Tensor::from_values({2}, {0, 1}, DType::f32))),
               Error);
  Tensor gdt = gpu(Tensor::zeros({5, 3}, DType::f32));
  EXPECT_THROW(ops::embedding_backward(gpu(randn({2, 4}, DType::f32, rng)),
                                       gpu(Tensor::from_vector<int64_t>({2}, {0, 1})), gdt),
               Error);
  EXPECT_THROW(ops::embedding_backward(gpu(randn({2, 3}, DType::f64, rng)),
                                       gpu(Tensor::from_vector<int64_t>({2}, {0, 1})), gdt),
               Error);
  Tensor bf = gpu(Tensor::zeros({5, 3}, DType::bf16));
  EXPECT_THROW(ops::embedding_backward(gpu(randn({2, 3}, DType::f32, rng).to(DType::bf16)),
                                       gpu(Tensor::from_vector<int64_t>({2}, {0, 1})), bf),
               Error);
}

// Device ids with their host values: the rows of the device check's path, and no copy back.
TEST(EmbeddingGpu, HostIdsSkipTheDeviceCheck) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  const Tensor table = gpu(randn({300, 16}, DType::f32, rng));
  const Tensor ids = random_ids({37}, 300, 0, DType::i64, rng);
  const std::vector<int64_t> v = ids.to_i64_vector();
  const Tensor dev_ids = gpu(ids);
  reset_transfer_stats();
  const Tensor out = ops::embedding_forward(table, dev_ids, v);
  EXPECT_EQ(transfer_stats().to_host, 0u);
  EXPECT_TRUE(bit_equal(cpu(out), cpu(ops::embedding_forward(table, dev_ids))));
  std::vector<int64_t> bad = v;
  bad[3] = -1;
  testing::expect_error([&] { ops::embedding_forward(table, dev_ids, bad); },
                        "ids[3] (flat position) = -1 is outside the vocabulary [0, 300)");
}

}  // namespace
}  // namespace hlm
