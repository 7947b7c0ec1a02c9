// CUDA cross-entropy (ops::cross_entropy_forward / backward) against the CPU op on the same
// inputs: logits f32, f64 and bf16 (the CPU in f32 on the bf16-rounded logits), V = 1, 1000 and
// 5003, T = 1, 7 and 130, targets i64 / i32 with ignored rows and a non-default ignore_index;
// row_loss, lse, the mean loss, the count and dlogits; outputs NaN-poisoned, two runs
// bit-identical; all rows ignored (loss 0, zero gradient), no rows, large logits, a NaN logit,
// strided logits; bad targets refused with the CPU's message.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "gpu_compare.h"
#include "ops/cross_entropy.h"
#include "ops/dispatch.h"

namespace hlm {
namespace {

using gpu_compare::check;
using gpu_compare::make;
using gpu_compare::Pair;
using testing::bit_equal;
using testing::cpu;
using testing::gpu;

// Targets in [0, V), every fifth (and the first when T > 1) ignored.
std::vector<int64_t> random_targets(int64_t nt, int64_t v, int64_t ignore, Rng& rng) {
  std::vector<int64_t> tg(static_cast<size_t>(nt));
  for (int64_t t = 0; t < nt; ++t)
    tg[size_t(t)] = (t % 5 == 4 || (t == 0 && nt > 1)) ? ignore : int64_t(rng.below(uint64_t(v)));
  return tg;
}

void expect_same_bits(const ops::CrossEntropyResult& a, const ops::CrossEntropyResult& b) {
  EXPECT_TRUE(bit_equal(cpu(a.row_loss), cpu(b.row_loss)));
  EXPECT_TRUE(bit_equal(cpu(a.lse), cpu(b.lse)));
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(a.count, b.count);
}

// |got - ref| / max(|ref|, 1) within the dtype's bound (bf16 logits compute in f32).
void check_loss(double got, double ref, DType dt) {
  const double err = std::fabs(got - ref) / std::max(std::fabs(ref), 1.0);
  std::printf("  %-28s %-5s rel err %.3e\n", "loss", dtype_name(dt), err);
  EXPECT_LE(err, dt == DType::f64 ? 1e-12 : 2e-6) << got << " vs " << ref;
}

TEST(CrossEntropyGpu, MatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  testing::PoisonOutputs poison;
  Rng rng(testing::test_seed());
  for (DType dt : {DType::f32, DType::f64, DType::bf16})
    for (int64_t v : {1, 1000, 5003})
      for (int64_t nt : {1, 7, 130}) {
        const int64_t ignore = nt == 7 ? 3 : -100;
        const DType idt = nt == 130 ? DType::i32 : DType::i64;
        const std::vector<int64_t> tgv = random_targets(nt, v, ignore, rng);
        const Tensor tg = Tensor::from_vector<int64_t>({nt}, tgv).to(idt), gtg = gpu(tg);
        const Pair x = make({nt, v}, dt, rng, 3.0);
        std::printf(" %s V=%lld T=%lld\n", dtype_name(dt), (long long)v, (long long)nt);
        const ops::CrossEntropyResult ref = ops::cross_entropy_forward(x.ref, tg, ignore);
        const ops::CrossEntropyResult got = ops::cross_entropy_forward(x.dev, gtg, ignore);
        EXPECT_EQ(got.row_loss.dtype(), compute_dtype(dt));
        EXPECT_EQ(got.lse.dtype(), compute_dtype(dt));
        EXPECT_EQ(got.count, ref.count);
        EXPECT_EQ(got.ignore_index, ignore);
        check("row_loss", got.row_loss, ref.row_loss, dt);
        check("lse", got.lse, ref.lse, dt);
        check_loss(got.loss, ref.loss, dt);
        expect_same_bits(ops::cross_entropy_forward(x.dev, gtg, ignore), got);

        const Tensor dref = ops::cross_entropy_backward(x.ref, tg, ref, 1.7);
        const Tensor dgot = ops::cross_entropy_backward(x.dev, gtg, got, 1.7);
        EXPECT_EQ(dgot.dtype(), dt);
        check("dlogits", dgot, dref, dt);
        EXPECT_TRUE(bit_equal(cpu(ops::cross_entropy_backward(x.dev, gtg, got, 1.7)), cpu(dgot)));
        // Ignored rows are exactly zero.
        const Tensor dh = cpu(dgot).to(DType::f64);
        for (int64_t t = 0; t < nt; ++t)
          if (tgv[size_t(t)] == ignore)
            for (double e : dh.select(0, t).to_f64_vector()) ASSERT_EQ(e, 0.0) << "row " << t;
      }
}

TEST(CrossEntropyGpu, EdgeCases) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  testing::PoisonOutputs poison;
  Rng rng(testing::test_seed());
  // All rows ignored: loss 0, count 0, zero row losses and a zero gradient.
  const Tensor x = gpu(randn({4, 1000}, DType::f32, rng));
  const Tensor all = gpu(Tensor::from_vector<int32_t>({4}, {-100, -100, -100, -100}));
  const ops::CrossEntropyResult o = ops::cross_entropy_forward(x, all);
  EXPECT_EQ(o.count, 0);
  EXPECT_EQ(o.loss, 0.0);
  for (double e : cpu(o.row_loss).to_f64_vector()) EXPECT_EQ(e, 0.0);
  for (double e : cpu(ops::cross_entropy_backward(x, all, o, 2.0)).to_f64_vector())
    EXPECT_EQ(e, 0.0);
  // No rows.
  const Tensor x0 = gpu(Tensor::zeros({0, 1000}, DType::f32));
  const Tensor t0 = gpu(Tensor::zeros({0}, DType::i64));
  const ops::CrossEntropyResult o0 = ops::cross_entropy_forward(x0, t0);
  EXPECT_EQ(o0.count, 0);
  EXPECT_EQ(o0.loss, 0.0);
  EXPECT_EQ(ops::cross_entropy_backward(x0, t0, o0).shape(), (Shape{0, 1000}));
  // Large logits stay finite.
  const Tensor big = Tensor::from_values({2, 3}, {1e4, -1e4, 0.0, -3e4, 2e4, 1.0}, DType::f32);
  const Tensor tb = Tensor::from_vector<int64_t>({2}, {1, 0});
  const ops::CrossEntropyResult ob = ops::cross_entropy_forward(gpu(big), gpu(tb));
  const ops::CrossEntropyResult rb = ops::cross_entropy_forward(big, tb);
  EXPECT_NEAR(ob.loss, rb.loss, 1e-2);
  EXPECT_NEAR(ob.loss, 3.5e4, 1e-2);
  check("large dlogits", ops::cross_entropy_backward(gpu(big), gpu(tb), ob),
        ops::cross_entropy_backward(big, tb, rb), DType::f32);
  // A NaN logit makes its row's loss NaN (as on the CPU), the other rows stay finite.
  Tensor xn = randn({3, 1000}, DType::f32, rng);
  xn.data<float>()[1000 + 517] = std::nanf("");
  const Tensor tn = Tensor::from_vector<int64_t>({3}, {1, 2, 3});
  const Tensor rl = cpu(ops::cross_entropy_forward(gpu(xn), gpu(tn)).row_loss);
  EXPECT_TRUE(std::isfinite(rl.at({0})) && std::isnan(rl.at({1})) && std::isfinite(rl.at({2})));
  EXPECT_TRUE(std::isnan(ops::cross_entropy_forward(xn, tn).row_loss.at({1})));
  // Strided logits (a transposed view) are copied contiguous first.
  const Tensor xt = randn({1000, 7}, DType::f32, rng);
  const Tensor t7 = Tensor::from_vector<int64_t>({7}, {0, 999, 5, -100, 17, 400, 3});
  const ops::CrossEntropyResult rt = ops::cross_entropy_forward(xt.transpose(0, 1), t7);
  const ops::CrossEntropyResult gt = ops::cross_entropy_forward(gpu(xt).transpose(0, 1), gpu(t7));
  check("strided row_loss", gt.row_loss, rt.row_loss, DType::f32);
  check("strided dlogits", ops::cross_entropy_backward(gpu(xt).transpose(0, 1), gpu(t7), gt),
        ops::cross_entropy_backward(xt.transpose(0, 1), t7, rt), DType::f32);
}

TEST(CrossEntropyGpu, BadTargetsRefusedWithTheCpuMessage) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  const Tensor x = randn({3, 5}, DType::f32, rng), gx = gpu(x);
  auto same = [&](const Tensor& tg, int64_t ignore) {
    const std::string c = testing::error_of([&] { ops::cross_entropy_forward(x, tg, ignore); });
    const std::string g =
        testing::error_of([&] { ops::cross_entropy_forward(gx, gpu(tg), ignore); });
    EXPECT_NE(c, "(no error)");
    EXPECT_EQ(g, c);
    EXPECT_EQ(g.find('\n'), std::string::npos) << g;
    ops::CrossEntropyResult saved;
    saved.lse = gpu(Tensor::zeros({3}, DType::f32));
    saved.ignore_index = ignore;
    const std::string gb =
        testing::error_of([&] { ops::cross_entropy_backward(gx, gpu(tg), saved); });
    const std::string want = "cross_entropy_backward: " + g.substr(g.find("targets["));
    EXPECT_NE(gb.find(want), std::string::npos) << gb;
    return g;
  };
  EXPECT_NE(same(Tensor::from_vector<int64_t>({3}, {0, 5, 1}), -100).find("targets[1] = 5"),
            std::string::npos);
  EXPECT_NE(same(Tensor::from_vector<int32_t>({3}, {-100, -1, 9}), -100).find("targets[1] = -1"),
            std::string::npos);
  // ignore_index 4: -100 is then out of range, 4 is not.
  EXPECT_NE(same(Tensor::from_vector<int64_t>({3}, {4, -100, 1}), 4).find("targets[1] = -100"),
            std::string::npos);
  // Wrong dtypes, shapes, devices and saved state.
  const Tensor tg = gpu(Tensor::from_vector<int64_t>({3}, {0, 1, 2}));
  EXPECT_THROW(ops::cross_entropy_forward(gx, gpu(Tensor::from_vector<int64_t>({2}, {0, 1}))),
               Error);
  EXPECT_THROW(ops::cross_entropy_forward(gx, Tensor::from_vector<int64_t>({3}, {0, 1, 2})), Error);
  EXPECT_THROW(ops::cross_entropy_forward(gx, gpu(Tensor::from_values({3}, {0, 1, 2}, DType::f32))),
               Error);
  EXPECT_THROW(ops::cross_entropy_forward(gpu(Tensor::zeros({3, 5}, DType::i64)), tg), Error);
  EXPECT_THROW(ops::cross_entropy_forward(gpu(randn({3}, DType::f32, rng)), tg), Error);
  const ops::CrossEntropyResult ok = ops::cross_entropy_forward(gx, tg);
  ops::CrossEntropyResult wrong = ok;
  wrong.count = 2;
  EXPECT_THROW(ops::cross_entropy_backward(gx, tg, wrong), Error);
  const Tensor xb = gpu(x.to(DType::bf16));
  const ops::CrossEntropyResult okb = ops::cross_entropy_forward(xb, tg);
  EXPECT_EQ(okb.lse.dtype(), DType::f32);
  EXPECT_NO_THROW(ops::cross_entropy_backward(xb, tg, okb));
  wrong = okb;
  wrong.lse = gpu(Tensor::zeros({3}, DType::bf16));
  EXPECT_THROW(ops::cross_entropy_backward(xb, tg, wrong), Error);
  wrong.lse = Tensor::zeros({3}, DType::f32);  // on the host
  EXPECT_THROW(ops::cross_entropy_backward(xb, tg, wrong), Error);
}

}  // namespace
}  // namespace hlm
