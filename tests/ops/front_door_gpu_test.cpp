// The front doors of the ops without a CUDA implementation yet: CUDA tensors get the one-line
// hlm::Error "<op>: no CUDA implementation yet (<arg> is ...)" from the device switch, and a
// call that mixes devices is refused by name before anything runs.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "core/rng.h"
#include "ops/embedding.h"
#include "ops/fp8_quant.h"
#include "ops/layernorm.h"
#include "ops/softmax.h"
#include "testing.h"

namespace hlm {
namespace {

using testing::gpu;

// The message of the hlm::Error that f throws ("" when it throws none).
void expect_no_cuda_yet(const char* op, const char* arg, const std::function<void()>& f) {
  const std::string e = testing::error_of(f);
  const std::string want = std::string(op) + ": no CUDA implementation yet (" + arg + " is ";
  EXPECT_NE(e.find(want), std::string::npos) << "expected '" << want << "...', got '" << e << "'";
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
}

TEST(FrontDoorGpu, OpsWithoutCudaKernelsSayWhich) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  const Tensor x = gpu(randn({4, 6}, DType::f32, rng)), w = gpu(randn({6}, DType::f32, rng));
  expect_no_cuda_yet("softmax_forward", "x", [&] { ops::softmax_forward(x); });
  expect_no_cuda_yet("fp8_quantize", "x", [&] {
    ops::fp8_quantize(gpu(randn({2, 128}, DType::f32, rng)), {});
  });
}

TEST(FrontDoorGpu, MixedDevicesAreRefusedByName) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  const Tensor x = gpu(randn({4, 6}, DType::f32, rng)), w = randn({6}, DType::f32, rng);
  const std::string e = testing::error_of([&] { ops::layernorm_forward(x, w, w); });
  EXPECT_NE(e.find("layernorm_forward: w must be on the device of x"), std::string::npos) << e;
  const std::string e2 = testing::error_of([&] {
    ops::softmax_backward(randn({4, 6}, DType::f32, rng), x);
  });
  EXPECT_NE(e2.find("softmax_backward: dy must be on the device of y"), std::string::npos) << e2;
  const std::string e3 = testing::error_of([&] {
    ops::embedding_forward(randn({5, 3}, DType::f32, rng),
                           gpu(Tensor::from_vector<int64_t>({1}, {2})));
  });
  EXPECT_NE(e3.find("embedding_forward: ids must be on the device of table"), std::string::npos)
      << e3;
}

}  // namespace
}  // namespace hlm
