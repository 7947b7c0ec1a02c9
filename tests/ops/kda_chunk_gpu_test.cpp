// KDA chunked forward on CUDA (ops/cuda/kda_chunk/params.cuh) against the CPU kda_chunk on the
// same inputs:
// f32 and bf16 inputs (the CPU runs on the bf16-rounded values), packed sequences of 1, 63, 65
// and 1000 tokens (400 on the CPU emulation) and many short ones (empty ones too), GVA, with and
// without an initial state, plain log decay g (mild, and strong enough to force the per-element
// diagonal path), the fused lower-bound (-5) and standard gates with the fused q/k L2 norm and beta
// sigmoid, cu_seqlens on the host and on the device, K = V = 128, K = V = 64, K = 64 / V = 32 and K
// = 32 / V = 96. Outputs, the final state and the workspace are NaN-poisoned before every run;
// every case runs twice and must give the same bits; the longest sequence run alone must give the
// bits it gets inside the packed batch. Argument checks throw hlm::Error. Tolerances (relative L2
// against the CPU): 2e-5 for f32 inputs, 3e-3 for bf16 inputs. Each comparison prints its errors; a
// failure names the case, the tensor and the worst element.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>

#include "kda_gpu_inputs.h"
#include "ops/cuda/kda_chunk/params.cuh"
#include "ops/kda.h"
#include "testing.h"

namespace hlm {
namespace {

using kda_gpu_test::Gate;
using kda_gpu_test::make_inputs;
using kda_gpu_test::to_device;
using ops::KdaArgs;
using ops::KdaGateKind;

struct Case {
  std::string name;
  std::vector<int64_t> lens;
  int64_t H, HV, K, V;
  DType dt;
  bool h0;
  Gate gate;
  bool cu_on_device = false;
  double scale = 0;
  bool exact = false;  // KdaArgs::exact_bf16_products
};

std::string describe(const Case& c) {
  std::string lens;
  for (size_t i = 0; i < c.lens.size() && i < 8; ++i)
    lens += (i ? "," : "") + std::to_string(c.lens[i]);
  if (c.lens.size() > 8) lens += ",... (" + std::to_string(c.lens.size()) + " sequences)";
  const char* gate = c.gate == Gate::plain         ? "plain g"
                     : c.gate == Gate::strong      ? "plain strong-decay g"
                     : c.gate == Gate::lower_bound ? "fused lower-bound gate -5"
                                                   : "fused standard gate";
  return fmt::format(
      "case '{}': {} H={} HV={} K={} V={} lens [{}] {} {}{}{}", c.name, dtype_name(c.dt), c.H, c.HV,
      c.K, c.V, lens, gate, c.h0 ? "with initial state" : "zero initial state",
      c.cu_on_device ? ", cu_seqlens on the device" : "", c.exact ? ", exact bf16 products" : "");
}

// Fresh NaN-poisoned outputs and workspace.
ops::KdaChunkCudaBuffers poisoned(const KdaArgs& g) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const int64_t T = g.q.size(0), HV = g.v.size(1), K = g.q.size(2), V = g.v.size(2);
  const int64_t N = g.seqs ? g.seqs->num_seqs() : 1;
  ops::KdaChunkCudaBuffers b;
  b.o = Tensor::full({T, HV, V}, nan, g.q.dtype(), Device::cuda);
  b.final_state = Tensor::full({N, HV, K, V}, nan, DType::f32, Device::cuda);
  b.workspace =
      Tensor::full({ops::kda_chunk_cuda_workspace_floats(g)}, nan, DType::f32, Device::cuda);
  return b;
}

::testing::AssertionResult within(const Tensor& out, const Tensor& ref, double rel,
                                  const std::string& what) {
  const Tensor host = out.to(Device::cpu);
  const testing::ErrorStats st = testing::compare(host, ref);
  std::printf("  %s: rel_l2 %.3e, max_abs %.3e\n", what.c_str(), st.rel_l2, st.max_abs);
  auto r = testing::close(host, ref, {rel, 1e30});
  if (!r) r << " [" << what << "]";
  return r;
}

void run_case(const Case& c) {
  SCOPED_TRACE(describe(c));
  Rng rng(testing::test_seed() ^ std::hash<std::string>{}(c.name));
  const KdaArgs cpu = make_inputs(c, rng);
  const ops::KdaOutput ref = ops::kda_chunk(cpu);
  KdaArgs gpu = to_device(cpu, c.cu_on_device);
  gpu.exact_bf16_products = c.exact;
  // o is bf16 for bf16 inputs (its rounding alone is ~1.7e-3); the final state is f32, and with
  // exact products as close as the f32 path's.
  const double tol = c.dt == DType::bf16 ? 3e-3 : 2e-5;
  const double tol_state = c.dt == DType::bf16 && !c.exact ? 3e-3 : 2e-5;

  const ops::KdaOutput out = ops::kda_chunk_forward_cuda(gpu, poisoned(gpu));
  ASSERT_EQ(out.o.dtype(), c.dt);
  ASSERT_EQ(out.final_state.dtype(), DType::f32);
  EXPECT_TRUE(within(out.o, ref.o, tol, describe(c) + ", tensor o [T, HV, V]"));
  EXPECT_TRUE(within(out.final_state, ref.final_state, tol_state,
                     describe(c) + ", tensor final_state [N, HV, K, V]"));

  const ops::KdaOutput again = ops::kda_chunk_forward_cuda(gpu, poisoned(gpu));
  EXPECT_TRUE(testing::bit_equal(again.o, out.o)) << describe(c) << ": o differs run to run";
  EXPECT_TRUE(testing::bit_equal(again.final_state, out.final_state))
      << describe(c) << ": final_state differs run to run";

  // The longest sequence alone gives the bits it gets in the packed batch (and allocates its own
  // buffers: the default path).
  size_t longest = 0;
  for (size_t i = 1; i < c.lens.size(); ++i)
    if (c.lens[i] > c.lens[longest]) longest = i;
  int64_t b = 0;
  for (size_t i = 0; i < longest; ++i) b += c.lens[i];
  const int64_t e = b + c.lens[longest], n = int64_t(longest);
  KdaArgs one = gpu;
  for (Tensor* t : {&one.q, &one.k, &one.v, &one.g, &one.beta}) *t = t->slice(0, b, e);
  if (one.initial_state.defined()) one.initial_state = one.initial_state.slice(0, n, n + 1);
  one.seqs.reset();
  const ops::KdaOutput alone = ops::kda_chunk_forward_cuda(one);
  EXPECT_TRUE(testing::bit_equal(alone.o, out.o.slice(0, b, e)))
      << describe(c) << ": sequence " << n << " alone differs from the packed batch (o)";
  EXPECT_TRUE(testing::bit_equal(alone.final_state, out.final_state.slice(0, n, n + 1)))
      << describe(c) << ": sequence " << n << " alone differs from the packed batch (final_state)";
}

using kda_gpu_test::kOddLens;
using kda_gpu_test::wide;
using kda_gpu_test::WideShape;

TEST(KdaChunkGpu, F32PlainGateInitialState) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  run_case({"f32 plain h0", kOddLens, 2, 4, 128, 128, DType::f32, true, Gate::plain});
}

TEST(KdaChunkGpu, F32LowerBoundGateFused) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  run_case(
      {"f32 lower-bound", kOddLens, 2, 4, 128, 128, DType::f32, false, Gate::lower_bound, true});
  run_case({"f32 lower-bound h0", kOddLens, 4, 4, 128, 128, DType::f32, true, Gate::lower_bound});
}

// Mean decay 6 nats per token: nearly every diagonal 16x16 block spans
// more than 80 nats in some channel and takes the per-element exp path
// (the other cases take the split-reference product).
TEST(KdaChunkGpu, StrongDecayPerElementDiagonal) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  run_case({"f32 strong decay h0", kOddLens, 2, 4, 128, 128, DType::f32, true, Gate::strong});
  run_case({"bf16 strong decay", {1, 63, 65, 300}, 1, 2, 64, 64, DType::bf16, false, Gate::strong});
}

TEST(KdaChunkGpu, F32StandardGateFused) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  run_case({"f32 standard h0", kOddLens, 1, 2, 128, 128, DType::f32, true, Gate::standard});
}

TEST(KdaChunkGpu, Bf16) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  run_case({"bf16 plain h0", kOddLens, 2, 4, 128, 128, DType::bf16, true, Gate::plain});
  run_case(
      {"bf16 lower-bound", kOddLens, 2, 2, 128, 128, DType::bf16, false, Gate::lower_bound, true});
}

// KdaArgs::exact_bf16_products: 3xTF32 in every product, the final state
// within the f32 path's bound (plain TF32 in the default stages: ~3e-4).
TEST(KdaChunkGpu, Bf16ExactProducts) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  run_case({"bf16 plain h0 exact", kOddLens, 2, 4, 128, 128, DType::bf16, true, Gate::plain, false,
            0, true});
  run_case({"bf16 lower-bound exact", kOddLens, 2, 2, 128, 128, DType::bf16, false,
            Gate::lower_bound, true, 0, true});
}

// Enough (sequence, head) pairs that the state pass takes 64-wide V tiles
// (state_tile: at least one block per SM; 4 x 24 x 2 = 192 blocks on an
// H200's 132 SMs); the cases above take 32.
TEST(KdaChunkGpu, WideStateTile) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  const WideShape w = wide();
  run_case(
      {"f32 wide tile h0", w.lens, w.H, w.HV, 128, 128, DType::f32, true, Gate::lower_bound, true});
  run_case({"bf16 wide tile", w.lens, w.H, w.HV, 128, 128, DType::bf16, false, Gate::plain});
}

TEST(KdaChunkGpu, ManyShortSequencesK64) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  std::vector<int64_t> lens;
  const int nseq = cuda_emulated() ? 24 : 40;  // fewer on the emulation
  for (int i = 0; i < nseq; ++i) lens.push_back(int64_t(rng.uniform() * 140));  // 0 .. 139
  lens[3] = 0, lens[7] = 1, lens[11] = 64, lens[12] = 128;
  run_case({"f32 short K64 h0", lens, 2, 6, 64, 64, DType::f32, true, Gate::plain, true});
  run_case({"f32 short K64 lower-bound", lens, 3, 3, 64, 64, DType::f32, false, Gate::lower_bound});
  run_case(
      {"bf16 short K64 h0 lower-bound", lens, 1, 2, 64, 64, DType::bf16, true, Gate::lower_bound});
}

TEST(KdaChunkGpu, SmallOddHeadDims) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  run_case({"f32 K32 V96 h0",
            {1, 63, 65, 200},
            1,
            3,
            32,
            96,
            DType::f32,
            true,
            Gate::plain,
            false,
            0.3});
  run_case(
      {"f32 K64 V32 lower-bound", {130, 2, 64}, 2, 2, 64, 32, DType::f32, true, Gate::lower_bound});
  run_case({"bf16 K32 V96", {1, 63, 65, 200}, 1, 3, 32, 96, DType::bf16, false, Gate::plain});
}

// One sequence, no layout, T not a multiple of 64.
TEST(KdaChunkGpu, SingleSequenceNoCuSeqlens) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  Case c{"single", {333}, 1, 1, 128, 128, DType::f32, true, Gate::plain};
  KdaArgs cpu = make_inputs(c, rng);
  cpu.seqs.reset();
  const ops::KdaOutput ref = ops::kda_chunk(cpu);
  const KdaArgs gpu = to_device(cpu, false);
  const ops::KdaOutput out = ops::kda_chunk_forward_cuda(gpu, poisoned(gpu));
  EXPECT_TRUE(within(out.o, ref.o, 2e-5, "single sequence, o"));
  EXPECT_TRUE(within(out.final_state, ref.final_state, 2e-5, "single sequence, final_state"));
}

TEST(KdaChunkGpu, RejectsBadArguments) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  auto gpu_case = [&](int64_t K, int64_t V) {
    Case c{"args", {5, 70}, 1, 1, K, V, DType::f32, true, Gate::plain};
    return to_device(make_inputs(c, rng), false);
  };
  EXPECT_THROW(ops::kda_chunk_forward_cuda(gpu_case(48, 64)),
               Error);  // K not 32/64/128
  EXPECT_THROW(ops::kda_chunk_forward_cuda(gpu_case(256, 64)),
               Error);  // K too large
  EXPECT_THROW(ops::kda_chunk_forward_cuda(gpu_case(64, 40)),
               Error);  // V not a multiple of 32
  EXPECT_THROW(ops::kda_chunk_forward_cuda(gpu_case(64, 160)),
               Error);  // V too large
  KdaArgs a = gpu_case(64, 64);
  {
    KdaArgs b = a;
    b.q = b.q.to(Device::cpu);
    EXPECT_THROW(ops::kda_chunk_forward_cuda(b), Error);  // host tensor
  }
  {
    KdaArgs b = a;
    b.initial_state = Tensor::zeros({1, 1, 64, 64}, DType::f32, Device::cuda);  // N = 2
    EXPECT_THROW(ops::kda_chunk_forward_cuda(b), Error);
  }
  {
    KdaArgs b = a;
    b.seqs = SeqLayout::from_lengths({5, 69});  // does not end at T = 75
    EXPECT_THROW(ops::kda_chunk_forward_cuda(b), Error);
  }
  {
    KdaArgs b = a;
    b.gate = KdaGateKind::lower_bound;
    b.lower_bound = -6.0;
    EXPECT_THROW(ops::kda_chunk_forward_cuda(b), Error);
  }
  {
    KdaArgs b = a;
    b.gate = KdaGateKind::standard;  // needs A_log
    EXPECT_THROW(ops::kda_chunk_forward_cuda(b), Error);
  }
  {
    ops::KdaChunkCudaBuffers buf;
    buf.workspace = Tensor::empty({16}, DType::f32, Device::cuda);  // too small
    EXPECT_THROW(ops::kda_chunk_forward_cuda(a, buf), Error);
  }
}

// Opt-in timing (--gtest_also_run_disabled_tests): bf16, plain g, K = V =
// 128, packed equal-length sequences, the forward rows of
// bench/RESULTS.md, "Anchors and targets". Wall time of the synchronous
// call with preallocated buffers (host planning and one small
// host-to-device copy included), median of 5 after a warm-up. Inputs are
// 2048 random tokens tiled along T (the values do not change the work).
TEST(KdaChunkGpu, DISABLED_Timing) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  if (cuda_emulated()) GTEST_SKIP() << "the CUDA device is the CPU emulation: no timings";
  struct Shape3 {
    int64_t T, H, N;
  };
  for (const Shape3 sh : {Shape3{8192, 32, 1}, Shape3{32768, 64, 8}}) {
    const int64_t T0 = 2048, K = 128, V = 128;
    Rng rng(testing::test_seed());
    Case c{"timing", {T0}, sh.H, sh.H, K, V, DType::bf16, true, Gate::plain};
    const KdaArgs small = make_inputs(c, rng);
    auto tile = [&](const Tensor& x) {
      Shape s = x.shape();
      s[0] = sh.T;
      Tensor big = Tensor::empty(s, x.dtype());
      const size_t row = x.nbytes() / size_t(x.size(0));
      for (int64_t t0 = 0; t0 < sh.T; t0 += T0)
        std::memcpy(static_cast<char*>(big.raw()) + size_t(t0) * row, x.raw(),
                    size_t(std::min(T0, sh.T - t0)) * row);
      return big.to(Device::cuda);
    };
    KdaArgs a;
    a.q = tile(small.q), a.k = tile(small.k), a.v = tile(small.v), a.g = tile(small.g);
    a.beta = tile(small.beta);
    std::vector<int64_t> cu;
    for (int64_t n = 0; n <= sh.N; ++n) cu.push_back(n * sh.T / sh.N);
    a.seqs = SeqLayout::from_offsets(cu, sh.T);
    a.initial_state = Tensor::zeros({sh.N, sh.H, K, V}, DType::f32, Device::cuda);
    ops::KdaChunkCudaBuffers b;
    b.o = Tensor::empty({sh.T, sh.H, V}, DType::bf16, Device::cuda);
    b.final_state = Tensor::empty({sh.N, sh.H, K, V}, DType::f32, Device::cuda);
    b.workspace =
        Tensor::empty({ops::kda_chunk_cuda_workspace_floats(a)}, DType::f32, Device::cuda);
    ops::kda_chunk_forward_cuda(a, b);
    std::vector<double> ms;
    for (int i = 0; i < 5; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      ops::kda_chunk_forward_cuda(a, b);
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    std::printf(
        "kda_chunk_forward_cuda bf16 T=%lld H=%lld N=%lld K=V=128: %.3f "
        "ms (%.2f Mtok/s)\n",
        (long long)sh.T, (long long)sh.H, (long long)sh.N, ms[2], double(sh.T) / ms[2] / 1e3);
  }
}

}  // namespace
}  // namespace hlm
