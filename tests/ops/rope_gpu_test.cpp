// CUDA RoPE (ops::rope / rope_inplace) against the CPU op on the same inputs: f32, f64, bf16;
// documents of lengths 1, 63, 65 and packed documents (document-relative positions); interleaved
// and split pairs, both angle modes, forward and inverse, offset and factor; [T, n, L] and
// [T, L]; outputs NaN-poisoned, in place == out of place, two runs bit-identical, bad arguments.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "gpu_compare.h"
#include "ops/dispatch.h"
#include "ops/rope.h"

namespace hlm {
namespace {

using gpu_compare::check;
using gpu_compare::make;
using gpu_compare::Pair;
using testing::cpu;
using testing::gpu;

Tensor positions(const std::vector<int64_t>& lens) {
  std::vector<int64_t> pos;
  for (int64_t l : lens)
    for (int64_t t = 0; t < l; ++t) pos.push_back(t);
  return Tensor::from_vector<int64_t>({int64_t(pos.size())}, pos);
}

TEST(RopeGpu, MatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  testing::PoisonOutputs poison;
  Rng rng(testing::test_seed());
  const std::vector<std::vector<int64_t>> docs = {{1}, {63}, {65}, {5, 0, 40, 1, 17}};
  struct Geo {
    int64_t n, L, off, dr;
  };
  // Indexer-like (rope on the first channels), MLA-like (after the nope channels), [T, L] rows.
  const std::vector<Geo> geos = {{4, 32, 0, 16}, {2, 48, 16, 32}, {0, 40, 8, 24}};
  for (DType dt : {DType::f32, DType::f64, DType::bf16})
    for (const auto& lens : docs)
      for (const Geo& g : geos)
        for (int variant = 0; variant < 4; ++variant) {
          const Tensor pos = positions(lens);
          const int64_t T = pos.numel();
          ops::RopeOptions o;
          o.offset = g.off;
          o.rope_dim = g.dr;
          o.interleave = variant % 2 == 0;
          o.angle = variant < 2 ? ops::RopeAngle::f64 : ops::RopeAngle::compute;
          o.factor = variant == 3 ? 1.3 : 1.0;
          std::vector<double> inv(size_t(g.dr / 2));
          for (size_t i = 0; i < inv.size(); ++i)
            inv[i] = std::pow(10000.0, -2.0 * double(i) / double(g.dr)) / (i % 3 == 0 ? 4.0 : 1.0);
          const Tensor invt = Tensor::from_vector<double>({int64_t(inv.size())}, inv);
          const Shape s = g.n > 0 ? Shape{T, g.n, g.L} : Shape{T, g.L};
          const Pair x = make(s, dt, rng);
          const Tensor pd = gpu(pos), id = gpu(invt);
          for (bool inverse : {false, true}) {
            o.inverse = inverse;
            const Tensor ref = ops::rope(x.ref, pos, invt, o);
            const Tensor y = ops::rope(x.dev, pd, id, o);
            check(inverse ? "rope inverse" : "rope forward", y, ref, dt);
            EXPECT_TRUE(testing::bit_equal(cpu(ops::rope(x.dev, pd, id, o)), cpu(y)));
            Tensor xi = x.dev.clone();
            ops::rope_inplace(xi, pd, id, o);
            EXPECT_TRUE(testing::bit_equal(cpu(xi), cpu(y)));
          }
        }
}

TEST(RopeGpu, BadArguments) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  const Tensor x = gpu(randn({4, 2, 8}, DType::f32, rng));
  const Tensor pos = Tensor::from_vector<int64_t>({4}, {0, 1, 2, 0});
  const Tensor inv = Tensor::from_vector<double>({2}, {1.0, 0.1});
  ops::RopeOptions o;
  o.rope_dim = 4;
  EXPECT_NO_THROW(ops::rope(x, gpu(pos), gpu(inv), o));
  EXPECT_THROW(ops::rope(x, pos, gpu(inv), o), Error);                      // pos on the host
  EXPECT_THROW(ops::rope(x, gpu(pos.to(DType::i32)), gpu(inv), o), Error);  // pos i32
  EXPECT_THROW(ops::rope(x, gpu(pos.slice(0, 0, 3)), gpu(inv), o), Error);  // pos shape
  EXPECT_THROW(ops::rope(x, gpu(pos), gpu(inv.to(DType::f32)), o), Error);  // inv_freq f32
  EXPECT_THROW(ops::rope(gpu(Tensor::zeros({4, 8}, DType::i64)), gpu(pos), gpu(inv), o), Error);
  o.offset = 5;
  EXPECT_THROW(ops::rope(x, gpu(pos), gpu(inv), o), Error);  // range past the row
}

}  // namespace
}  // namespace hlm
