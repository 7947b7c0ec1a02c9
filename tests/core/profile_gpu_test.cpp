// The profiler's launch counts (core/profile.h): in the CUDA emulation build every scope also
// counts the kernel launches and cuBLAS calls made inside it, its children's included; checked
// against the emulation's own counters around the same calls. Host mode does not synchronise.
#include <gtest/gtest.h>

#ifdef HLM_CUDA_EMU
#include "cuda_emu.h"
#endif

#include <string>

#include "core/device.h"
#include "core/profile.h"
#include "ops/gemm.h"
#include "ops/tensor_ops.h"
#include "testing.h"

namespace hlm {
namespace {

const profile::Entry* find(const std::vector<profile::Entry>& es, const std::string& path) {
  for (const profile::Entry& e : es)
    if (e.path == path) return &e;
  return nullptr;
}

TEST(ProfileGpu, ScopesCountTheirLaunchesOnTheEmulation) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  if (!profile::counts_launches()) GTEST_SKIP() << "launches are counted on the emulation only";
#ifdef HLM_CUDA_EMU
  Rng rng(testing::test_seed());
  auto randn = [&](const Shape& shape) {
    Tensor t = Tensor::zeros(shape, DType::f32);
    rng.fill_normal(t, 0.0, 1.0);
    return testing::gpu(t);
  };
  Tensor x = randn({8, 16});
  const Tensor y = randn({8, 16}), b = randn({16, 4});
  Tensor c = Tensor::zeros({8, 4}, DType::f32, Device::cuda);
  profile::set_enabled(true);
  profile::reset();
  uint64_t l0 = 0, b0 = 0, l1 = 0, b1 = 0, li = 0, bi = 0;
  {
    device_synchronize();
    l0 = emu::kernel_launches();
    b0 = emu::blas_calls();
    profile::Scope outer("outer");
    ops::add_(x, y);
    {
      profile::Scope inner("inner");
      const uint64_t li0 = emu::kernel_launches(), bi0 = emu::blas_calls();
      ops::gemm(x, false, b, false, c);
      ops::add_(x, y);
      li = emu::kernel_launches() - li0;
      bi = emu::blas_calls() - bi0;
    }
    outer.end();
    l1 = emu::kernel_launches();
    b1 = emu::blas_calls();
  }
  const std::vector<profile::Entry> es = profile::entries();
  profile::set_enabled(false);
  profile::reset();
  const profile::Entry* o = find(es, "outer");
  const profile::Entry* i = find(es, "outer/inner");
  ASSERT_TRUE(o && i);
  EXPECT_EQ(o->calls, 1);
  EXPECT_EQ(o->launches, int64_t(l1 - l0));
  EXPECT_EQ(o->blas, int64_t(b1 - b0));
  EXPECT_EQ(i->launches, int64_t(li));
  EXPECT_EQ(i->blas, int64_t(bi));
  EXPECT_EQ(i->blas, 1);                // one f32 GEMM: one cuBLAS call
  EXPECT_GE(i->launches, 1);            // the add
  EXPECT_GT(o->launches, i->launches);  // the outer add
  EXPECT_NE(profile::report().find("kernels"), std::string::npos);
#endif
}

// Host mode records the scopes without synchronising the device (device mode synchronises at
// each scope's entry and exit); the launches by kernel name count the add's kernel.
TEST(ProfileGpu, HostModeDoesNotSynchroniseAndKernelsAreNamed) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Tensor x = Tensor::zeros({4, 8}, DType::f32, Device::cuda);
  const Tensor y = Tensor::full({4, 8}, 1.0, DType::f32).to(Device::cuda);
  for (const profile::Mode m : {profile::Mode::host, profile::Mode::device}) {
    profile::set_mode(m);
    profile::reset();
    reset_transfer_stats();
    const auto k0 = profile::launches_by_kernel();
    {
      profile::Scope s("add");
      ops::add_(x, y);
    }
    const uint64_t syncs = transfer_stats().synchronizes;
    const auto k1 = profile::launches_by_kernel();
    const std::vector<profile::Entry> es = profile::entries();
    profile::set_mode(profile::Mode::off);
    profile::reset();
    const profile::Entry* e = find(es, "add");
    ASSERT_TRUE(e);
    EXPECT_EQ(e->calls, 1);
    EXPECT_EQ(syncs, m == profile::Mode::host ? 0u : 2u);
    if (profile::counts_launches()) {
      const std::string table = profile::launch_report(k0, k1, 1);
      EXPECT_NE(table.find("kernel"), std::string::npos);
      int64_t all = 0;
      for (const auto& [name, n] : k1) all += n;
      for (const auto& [name, n] : k0) all -= n;
      EXPECT_EQ(all, e->launches);  // the scope's launches, by name
      EXPECT_GE(all, 1);
    } else {
      EXPECT_TRUE(k1.empty());
    }
  }
}

}  // namespace
}  // namespace hlm
