// The CUDA copy / elementwise ops of ops/tensor_ops.h against their CPU loops on the same inputs:
// conversions between f32 / f64 / bf16 from strided views, copies into strided destinations,
// add_, add_bias_, sum_rows, scale_ and the final conv state gradient scatter, all bit-identical.
#include <gtest/gtest.h>

#include <cmath>

#include "core/device.h"
#include "core/rng.h"
#include "ops/tensor_ops.h"
#include "testing.h"

namespace hlm {
namespace {

using testing::cpu;
using testing::gpu;

TEST(TensorOpsGpu, ConvertCopyAddSumScale) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  const Tensor x64 = randn({37, 53}, DType::f64, rng);
  for (DType from : {DType::f32, DType::f64, DType::bf16})
    for (DType to : {DType::f32, DType::f64, DType::bf16}) {
      const Tensor x = x64.to(from);
      const Tensor xt = x.transpose(0, 1);  // strided source
      const Tensor ref = xt.to(to);
      // as_dtype returns a strided view as it is when the dtype already matches; contiguous then
      // gathers it (the pair the layers use).
      const Tensor out = ops::contiguous(ops::as_dtype(gpu(x).transpose(0, 1), to));
      EXPECT_TRUE(out.is_contiguous());
      EXPECT_TRUE(testing::bit_equal(cpu(out), ref))
          << dtype_name(from) << " -> " << dtype_name(to);
      // Into a strided destination (a column slice).
      Tensor dst_c = Tensor::zeros({53, 50}, to);
      Tensor dst_g = gpu(dst_c);
      Tensor dc = dst_c.slice(1, 5, 42), dg = dst_g.slice(1, 5, 42);
      dc.copy_(xt.slice(1, 0, 37));
      ops::copy_into(dg, gpu(x).transpose(0, 1).slice(1, 0, 37));
      EXPECT_TRUE(testing::bit_equal(cpu(dst_g), dst_c));
    }
  for (DType dt : {DType::f32, DType::f64}) {
    const Tensor a = randn({65, 129}, dt, rng), b = randn({65, 129}, DType::bf16, rng);
    Tensor ac = a.clone(), ag = gpu(a);
    ops::add_(ac, b);
    ops::add_(ag, gpu(b));
    EXPECT_TRUE(testing::bit_equal(cpu(ag), ac));
    const Tensor bias = randn({129}, DType::f32, rng);
    ops::add_bias_(ac, bias);
    ops::add_bias_(ag, gpu(bias));
    EXPECT_TRUE(testing::bit_equal(cpu(ag), ac));
    EXPECT_TRUE(testing::bit_equal(cpu(ops::sum_rows(ag, dt)), ops::sum_rows(ac, dt)));
    Tensor sc = ac.transpose(0, 1), sg = ag.transpose(0, 1);
    ops::scale_(sc, -0.3);
    ops::scale_(sg, -0.3);
    EXPECT_TRUE(testing::bit_equal(cpu(ag), ac));
    ops::scale_(sg, 0.0);
    for (double v : cpu(ag).to_f64_vector()) EXPECT_EQ(v, 0.0);
  }
}

// A strided view of a CUDA tensor (a transpose, a column slice) made contiguous, and copied to the
// host, holds the view's elements: the values the same view of the host tensor holds.
TEST(TensorOpsGpu, StridedViewsOfCudaTensorsCopy) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  const Tensor x = randn({5, 7}, DType::f32, rng);
  const Tensor xg = gpu(x);
  const Tensor t = xg.transpose(0, 1);
  ASSERT_FALSE(t.is_contiguous());
  const Tensor tc = t.contiguous();
  EXPECT_TRUE(tc.is_contiguous());
  EXPECT_EQ(tc.device(), Device::cuda);
  EXPECT_TRUE(testing::bit_equal(cpu(tc), x.transpose(0, 1).contiguous()));
  EXPECT_TRUE(testing::bit_equal(t.to(Device::cpu), x.transpose(0, 1).contiguous()));
}

TEST(TensorOpsGpu, FinalConvStateBackward) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  const std::vector<int64_t> cu = {0, 1, 1, 64, 66, 366};
  const int64_t N = 5, T = 366, C = 37;
  for (int64_t W : {1, 2, 4})
    for (bool with_init : {false, true}) {
      const Tensor dfin = randn({N, W - 1, C}, DType::f32, rng);
      Tensor dx_c = randn({T, C}, DType::f32, rng), dx_g = gpu(dx_c);
      Tensor di_c = randn({N, W - 1, C}, DType::f32, rng), di_g = gpu(di_c);
      ops::causal_conv1d_final_state_backward(dfin, cu, W, dx_c, with_init ? &di_c : nullptr);
      ops::causal_conv1d_final_state_backward(gpu(dfin), cu, W, dx_g, with_init ? &di_g : nullptr);
      EXPECT_TRUE(testing::bit_equal(cpu(dx_g), dx_c)) << "W " << W;
      EXPECT_TRUE(testing::bit_equal(cpu(di_g), di_c)) << "W " << W;
    }
}

TEST(TensorOpsGpu, NanIfFlaggedReadsNothingBack) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
    const Tensor a = randn({33, 7}, DType::f32, rng).to(dt);
    Tensor b = gpu(a);
    reset_transfer_stats();
    ops::nan_if_flagged_(b, gpu(Tensor::zeros({1}, DType::i32)));
    Tensor c = gpu(a);
    ops::nan_if_flagged_(c, gpu(Tensor::full({1}, 3, DType::i32)));
    EXPECT_EQ(transfer_stats().to_host, 0u);
    EXPECT_TRUE(testing::bit_equal(cpu(b), a));
    for (double v : cpu(c).to_f64_vector()) EXPECT_TRUE(std::isnan(v));
  }
  Tensor t = gpu(Tensor::zeros({2}, DType::f32));
  testing::expect_error([&] { ops::nan_if_flagged_(t, Tensor::zeros({1}, DType::i32)); },
                        "on t's device");
}

}  // namespace
}  // namespace hlm
