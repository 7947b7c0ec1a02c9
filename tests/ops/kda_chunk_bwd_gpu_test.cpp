// KDA chunked backward on CUDA (ops/cuda/kda_chunk/params.cuh, kda_chunk_backward_cuda) against
// the CPU
// kda_chunk_backward on the same inputs: f32 and bf16 inputs (the CPU runs on the bf16-rounded
// values; the gradients are f32 for both, as the CPU returns them), packed sequences of 1, 63, 65
// and 1000 tokens (400 on the CPU emulation) and many short ones (empty ones too), GVA, with and
// without an initial state and a final-state gradient, plain log decay g (mild, and strong enough
// to force the per-element diagonal path), the fused lower-bound (-5) and standard gates with the
// fused q/k L2 norm and beta sigmoid, cu_seqlens on the host and on the device, K = V = 128, K = V
// = 64, K = 64 / V = 32 and K = 32 / V = 96. Every output and the workspace are NaN-poisoned before
// every run; every case runs twice and must give the same bits; the longest sequence run alone must
// give the bits it gets inside the packed batch. Argument checks throw hlm::Error. Tolerances
// (relative L2 against the CPU): 2e-5 for f32 inputs, 3e-3 for bf16 inputs. Each comparison prints
// its errors ("bwd-err" lines); a failure names the case, the tensor and the worst element.
// KdaChunkBwdGpu.Timing prints the backward's time on the two target shapes.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "kda_gpu_inputs.h"
#include "ops/cuda/kda_chunk/params.cuh"
#include "ops/dispatch.h"
#include "ops/kda.h"
#include "testing.h"

namespace hlm {
namespace {

using kda_gpu_test::Gate;
using kda_gpu_test::make_inputs;
using kda_gpu_test::to_device;
using ops::KdaArgs;
using ops::KdaGateKind;
using ops::KdaGrads;

struct Case {
  std::string name;
  std::vector<int64_t> lens;
  int64_t H, HV, K, V;
  DType dt;
  bool h0;   // initial state given
  bool dht;  // d_final_state given
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
      "case '{}': {} H={} HV={} K={} V={} lens [{}] {}, {}, {}{}{}", c.name, dtype_name(c.dt), c.H,
      c.HV, c.K, c.V, lens, gate, c.h0 ? "initial state" : "zero initial state",
      c.dht ? "d_final_state" : "no d_final_state",
      c.cu_on_device ? ", cu_seqlens on the device" : "", c.exact ? ", exact bf16 products" : "");
}

// Fresh NaN-poisoned outputs and workspace.
ops::KdaChunkBwdCudaBuffers poisoned(const KdaArgs& g) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const int64_t T = g.q.size(0), H = g.q.size(1), HV = g.v.size(1), K = g.q.size(2),
                V = g.v.size(2);
  const int64_t N = g.seqs ? g.seqs->num_seqs() : 1;
  auto f = [&](Shape s) { return Tensor::full(s, nan, DType::f32, Device::cuda); };
  ops::KdaChunkBwdCudaBuffers b;
  b.workspace = f({ops::kda_chunk_bwd_cuda_workspace_floats(g)});
  b.dq = f({T, H, K});
  b.dk = f({T, H, K});
  b.dv = f({T, HV, V});
  b.dg = f({T, HV, K});
  b.dbeta = f({T, HV});
  b.dinitial_state = f({N, HV, K, V});
  if (g.gate && g.A_log.defined()) b.dA_log = f({HV});
  if (g.gate && g.dt_bias.defined()) b.ddt_bias = f({HV * K});
  return b;
}

::testing::AssertionResult within(const Tensor& out, const Tensor& ref, double rel,
                                  const std::string& c, const char* what) {
  const Tensor host = out.to(Device::cpu);
  const testing::ErrorStats st = testing::compare(host, ref);
  std::printf("  bwd-err %-8s %-15s rel_l2 %.3e  max_abs %.3e  (%s)\n", dtype_name(out.dtype()),
              what, st.rel_l2, st.max_abs, c.c_str());
  auto r = testing::close(host, ref, {rel, 1e30});
  if (!r) r << " [" << c << ", tensor " << what << "]";
  return r;
}

struct Named {
  const char* name;
  Tensor KdaGrads::*field;
};
const Named kFields[] = {
    {"dq", &KdaGrads::dq},         {"dk", &KdaGrads::dk},
    {"dv", &KdaGrads::dv},         {"dg", &KdaGrads::dg},
    {"dbeta", &KdaGrads::dbeta},   {"dinitial_state", &KdaGrads::dinitial_state},
    {"dA_log", &KdaGrads::dA_log}, {"ddt_bias", &KdaGrads::ddt_bias}};

void run_case(const Case& c) {
  SCOPED_TRACE(describe(c));
  const std::string name = describe(c);
  std::printf("%s\n", name.c_str());
  Rng rng(testing::test_seed() ^ std::hash<std::string>{}(c.name));
  const KdaArgs cpu = make_inputs(c, rng);
  const int64_t T = cpu.q.size(0), N = int64_t(c.lens.size());
  const Tensor d_o = randn({T, c.HV, c.V}, c.dt, rng);
  const Tensor dht = c.dht ? randn({N, c.HV, c.K, c.V}, DType::f32, rng, 0.5) : Tensor();
  const KdaGrads ref = ops::kda_chunk_backward(cpu, d_o, dht);
  KdaArgs gpu = to_device(cpu, c.cu_on_device);
  gpu.exact_bf16_products = c.exact;
  const Tensor d_o_g = d_o.to(Device::cuda);
  const Tensor dht_g = dht.defined() ? dht.to(Device::cuda) : Tensor();
  // bf16 with exact (3xTF32) products: ~1e-5 from the CPU; the long f32 sums dA_log and
  // d dt_bias reach ~3e-5 (3xTF32 is 2^-22 per product, FP32 2^-24).
  const double tol = c.dt == DType::bf16 ? (c.exact ? 1e-4 : 3e-3) : 2e-5;

  const KdaGrads out = ops::kda_chunk_backward_cuda(gpu, d_o_g, dht_g, poisoned(gpu));
  for (const Named& f : kFields) {
    const Tensor& r = ref.*(f.field);
    const Tensor& o = out.*(f.field);
    ASSERT_EQ(r.defined(), o.defined()) << name << ": " << f.name << " defined mismatch";
    if (!r.defined()) continue;
    ASSERT_EQ(o.dtype(), r.dtype()) << name << ": " << f.name << " dtype";
    ASSERT_EQ(o.shape(), r.shape()) << name << ": " << f.name << " shape";
    EXPECT_TRUE(within(o, r, tol, name, f.name));
  }

  if (cpu.gate) {
    // dA_log and d dt_bias are sums over every token in f32 (the CPU's sequential, ours per chunk
    // then over chunks): both against an f64 CPU run, for information.
    KdaArgs c64 = cpu;
    for (Tensor* t : {&c64.q, &c64.k, &c64.v, &c64.g, &c64.beta, &c64.initial_state})
      if (t->defined()) *t = t->to(DType::f64);
    const KdaGrads r64 = ops::kda_chunk_backward(c64, d_o.to(DType::f64),
                                                 dht.defined() ? dht.to(DType::f64) : Tensor());
    for (const Named& f : kFields) {
      const Tensor& r = r64.*(f.field);
      if (!r.defined() || r.numel() > c.HV * c.K) continue;  // dA_log, ddt_bias
      const double eg = testing::compare((out.*(f.field)).to(Device::cpu), r).rel_l2;
      const double ec = testing::compare(ref.*(f.field), r).rel_l2;
      std::printf("  bwd-f64 %-15s vs the f64 CPU: GPU rel_l2 %.3e, CPU f32 rel_l2 %.3e\n", f.name,
                  eg, ec);
    }
  }

  const KdaGrads again = ops::kda_chunk_backward_cuda(gpu, d_o_g, dht_g, poisoned(gpu));
  bool same = true;
  for (const Named& f : kFields) {
    if (!(out.*(f.field)).defined()) continue;
    const bool eq = testing::bit_equal(again.*(f.field), out.*(f.field));
    EXPECT_TRUE(eq) << name << ": " << f.name << " differs run to run";
    same = same && eq;
  }
  std::printf("  bwd-det run twice: %s\n", same ? "bit-identical" : "DIFFERENT");

  // The longest sequence alone (its own d_o and d_final_state slices, default buffers) gives the
  // bits it gets in the packed batch.
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
  const KdaGrads alone = ops::kda_chunk_backward_cuda(
      one, d_o_g.slice(0, b, e), dht_g.defined() ? dht_g.slice(0, n, n + 1) : Tensor());
  bool alone_same = true;
  for (const Named& f : kFields) {
    if (std::strcmp(f.name, "dA_log") == 0 || std::strcmp(f.name, "ddt_bias") == 0) continue;
    const bool state = std::strcmp(f.name, "dinitial_state") == 0;
    const Tensor part =
        state ? (out.*(f.field)).slice(0, n, n + 1) : (out.*(f.field)).slice(0, b, e);
    const bool eq = testing::bit_equal(alone.*(f.field), part);
    EXPECT_TRUE(eq) << name << ": sequence " << n << " alone differs from the packed batch ("
                    << f.name << ")";
    alone_same = alone_same && eq;
  }
  std::printf("  bwd-det sequence %lld alone vs packed: %s\n", (long long)n,
              alone_same ? "bit-identical" : "DIFFERENT");
}

using kda_gpu_test::kOddLens;
using kda_gpu_test::wide;
using kda_gpu_test::WideShape;

TEST(KdaChunkBwdGpu, F32PlainGateGva) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  run_case({"f32 plain h0 dht", kOddLens, 2, 4, 128, 128, DType::f32, true, true, Gate::plain});
  run_case({"f32 plain", kOddLens, 2, 4, 128, 128, DType::f32, false, false, Gate::plain});
}

TEST(KdaChunkBwdGpu, F32LowerBoundGateFused) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  run_case({"f32 lower-bound", kOddLens, 2, 4, 128, 128, DType::f32, false, false,
            Gate::lower_bound, true});
  run_case({"f32 lower-bound h0 dht", kOddLens, 4, 4, 128, 128, DType::f32, true, true,
            Gate::lower_bound});
}

// Mean decay 6 nats per token: nearly every diagonal 16x16 block spans
// more than 80 nats in some channel and takes the per-element exp path.
TEST(KdaChunkBwdGpu, StrongDecayPerElementDiagonal) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  run_case(
      {"f32 strong decay h0 dht", kOddLens, 2, 4, 128, 128, DType::f32, true, true, Gate::strong});
  run_case({"bf16 strong decay",
            {1, 63, 65, 300},
            1,
            2,
            64,
            64,
            DType::bf16,
            false,
            true,
            Gate::strong});
}

TEST(KdaChunkBwdGpu, F32StandardGateFused) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  run_case(
      {"f32 standard h0 dht", kOddLens, 1, 2, 128, 128, DType::f32, true, true, Gate::standard});
}

TEST(KdaChunkBwdGpu, Bf16) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  run_case({"bf16 plain h0 dht", kOddLens, 2, 4, 128, 128, DType::bf16, true, true, Gate::plain});
  run_case({"bf16 lower-bound", kOddLens, 2, 2, 128, 128, DType::bf16, false, false,
            Gate::lower_bound, true});
  run_case(
      {"bf16 standard h0", kOddLens, 2, 4, 128, 128, DType::bf16, true, false, Gate::standard});
}

// KdaArgs::exact_bf16_products: 3xTF32 in every product (the default's
// TF32 stages put the gradients ~4e-4 from the CPU).
TEST(KdaChunkBwdGpu, Bf16ExactProducts) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  run_case({"bf16 plain h0 dht exact", kOddLens, 2, 4, 128, 128, DType::bf16, true, true,
            Gate::plain, false, 0, true});
  run_case({"bf16 lower-bound exact", kOddLens, 2, 2, 128, 128, DType::bf16, false, false,
            Gate::lower_bound, true, 0, true});
}

// Enough (sequence, head) pairs that the reverse state pass takes 64-wide
// V tiles (state_tile: 4 x 24 x 2 = 192 blocks on an H200's 132 SMs); the
// cases above take 32.
TEST(KdaChunkBwdGpu, WideStateTile) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  const WideShape w = wide();
  run_case({"f32 wide tile h0 dht", w.lens, w.H, w.HV, 128, 128, DType::f32, true, true,
            Gate::lower_bound, true});
  run_case({"bf16 wide tile", w.lens, w.H, w.HV, 128, 128, DType::bf16, false, true, Gate::plain});
}

TEST(KdaChunkBwdGpu, ManyShortSequencesK64) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  std::vector<int64_t> lens;
  const int nseq = cuda_emulated() ? 24 : 40;  // fewer on the emulation
  for (int i = 0; i < nseq; ++i) lens.push_back(int64_t(rng.uniform() * 140));  // 0 .. 139
  lens[3] = 0, lens[7] = 1, lens[11] = 64, lens[12] = 128, lens[20] = 0;
  run_case({"f32 short K64 h0 dht", lens, 2, 6, 64, 64, DType::f32, true, true, Gate::plain, true});
  run_case({"f32 short K64 lower-bound", lens, 3, 3, 64, 64, DType::f32, false, true,
            Gate::lower_bound});
  run_case({"bf16 short K64 h0 lower-bound", lens, 1, 2, 64, 64, DType::bf16, true, false,
            Gate::lower_bound});
}

TEST(KdaChunkBwdGpu, SmallOddHeadDims) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  run_case({"f32 K32 V96 h0 dht",
            {1, 63, 65, 200},
            1,
            3,
            32,
            96,
            DType::f32,
            true,
            true,
            Gate::plain,
            false,
            0.3});
  run_case({"f32 K64 V32 lower-bound",
            {130, 2, 64},
            2,
            2,
            64,
            32,
            DType::f32,
            true,
            true,
            Gate::lower_bound});
  run_case({"bf16 K32 V96 standard",
            {1, 63, 65, 200},
            1,
            3,
            32,
            96,
            DType::bf16,
            false,
            true,
            Gate::standard});
}

// One sequence, no layout, T not a multiple of 64.
TEST(KdaChunkBwdGpu, SingleSequenceNoCuSeqlens) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  Case c{"single", {333}, 1, 1, 128, 128, DType::f32, true, true, Gate::lower_bound};
  KdaArgs cpu = make_inputs(c, rng);
  cpu.seqs.reset();
  const Tensor d_o = randn({333, 1, 128}, DType::f32, rng);
  const Tensor dht = randn({1, 1, 128, 128}, DType::f32, rng, 0.5);
  const KdaGrads ref = ops::kda_chunk_backward(cpu, d_o, dht);
  const KdaArgs gpu = to_device(cpu, false);
  const KdaGrads out =
      ops::kda_chunk_backward_cuda(gpu, d_o.to(Device::cuda), dht.to(Device::cuda), poisoned(gpu));
  for (const Named& f : kFields)
    if ((ref.*(f.field)).defined())
      EXPECT_TRUE(within(out.*(f.field), ref.*(f.field), 2e-5, "single sequence", f.name));
}

// ops::kda_chunk / kda_chunk_backward called with CUDA tensors run the
// CUDA kernels: the same bits as calling them directly, and close to the
// CPU on the same inputs.
TEST(KdaChunkBwdGpu, DispatchFromKdaChunk) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  Case c{"dispatch", {1, 63, 65, 200}, 2, 4, 64, 64, DType::f32, true, true, Gate::lower_bound};
  const KdaArgs cpu = make_inputs(c, rng);
  const Tensor d_o = randn({329, 4, 64}, DType::f32, rng);
  const Tensor dht = randn({4, 4, 64, 64}, DType::f32, rng, 0.5);
  const KdaArgs gpu = to_device(cpu, false);
  const Tensor d_o_gpu = d_o.to(Device::cuda), dht_gpu = dht.to(Device::cuda);

  const ops::KdaOutput fwd = ops::kda_chunk(gpu), fwd_direct = ops::kda_chunk_forward_cuda(gpu);
  EXPECT_EQ(fwd.o.device(), Device::cuda);
  EXPECT_TRUE(testing::bit_equal(fwd.o, fwd_direct.o));
  EXPECT_TRUE(testing::bit_equal(fwd.final_state, fwd_direct.final_state));
  const ops::KdaOutput fwd_cpu = ops::kda_chunk(cpu);
  EXPECT_TRUE(within(fwd.o, fwd_cpu.o, 2e-5, "dispatch", "o"));

  const KdaGrads out = ops::kda_chunk_backward(gpu, d_o_gpu, dht_gpu);
  const KdaGrads direct = ops::kda_chunk_backward_cuda(gpu, d_o_gpu, dht_gpu);
  const KdaGrads ref = ops::kda_chunk_backward(cpu, d_o, dht);
  for (const Named& f : kFields) {
    if (!(ref.*(f.field)).defined()) continue;
    EXPECT_TRUE(testing::bit_equal(out.*(f.field), direct.*(f.field))) << f.name;
    EXPECT_TRUE(within(out.*(f.field), ref.*(f.field), 2e-5, "dispatch", f.name));
  }
}

// The front door (ops/kda.cpp) allocates the CUDA outputs, gradients and
// saved buffers (NaN-poisoned while the test hook is on) and the kernels
// write every element: with the hook on, the training pair in each mode
// gives the bits of a run with the hook off. Arguments on two devices, or
// a CUDA call of the CPU-only recurrence, throw.
TEST(KdaChunkBwdGpu, FrontDoorEveryOutputWritten) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  Case c{"front door", {1, 63, 65, 200}, 2, 4, 64, 64, DType::bf16, true, true, Gate::standard};
  const KdaArgs cpu = make_inputs(c, rng);
  const KdaArgs gpu = to_device(cpu, false);
  const Tensor d_o = randn({329, 4, 64}, DType::bf16, rng).to(Device::cuda);
  const Tensor dht = randn({4, 4, 64, 64}, DType::f32, rng, 0.5).to(Device::cuda);
  for (ops::KdaSave what : {ops::KdaSave::all, ops::KdaSave::kept}) {
    Tensor saved, saved2;
    const ops::KdaOutput o = ops::kda_chunk(gpu, &saved, what);
    const KdaGrads g = ops::kda_chunk_backward(gpu, d_o, dht, saved, what);
    ops::set_poison_outputs(true);
    const ops::KdaOutput o2 = ops::kda_chunk(gpu, &saved2, what);
    const KdaGrads g2 = ops::kda_chunk_backward(gpu, d_o, dht, saved2, what);
    ops::set_poison_outputs(false);
    ASSERT_TRUE(saved2.defined());
    EXPECT_TRUE(testing::bit_equal(o.o, o2.o));
    EXPECT_TRUE(testing::bit_equal(o.final_state, o2.final_state));
    for (const Named& f : kFields) {
      ASSERT_TRUE((g.*(f.field)).defined()) << f.name;
      EXPECT_TRUE(testing::bit_equal(g.*(f.field), g2.*(f.field))) << f.name;
    }
  }
  EXPECT_THROW(ops::kda_chunk_backward(cpu, d_o, {}),
               Error);  // d_o on the other device
  EXPECT_THROW(ops::kda_chunk_backward(gpu, d_o.to(Device::cpu), {}), Error);
  EXPECT_THROW(ops::kda_recurrent(gpu), Error);
  EXPECT_THROW(ops::kda_recurrent_backward(gpu, d_o, dht), Error);
}

// The training forward (KdaChunkCudaBuffers::saved) and a backward that
// reads its intermediates give the bits of the plain forward and of a
// backward that recomputes them: the saved buffer and the backward's
// (smaller) workspace NaN-poisoned, f32 and bf16, GVA, fused gates, short
// and long sequences; then the saved buffer reused by a second step on new
// inputs.
void saved_vs_recompute(const Case& c) {
  SCOPED_TRACE(describe(c));
  const std::string name = describe(c);
  Rng rng(testing::test_seed() ^ std::hash<std::string>{}(c.name));
  const KdaArgs gpu = to_device(make_inputs(c, rng), c.cu_on_device);
  const int64_t T = gpu.q.size(0), N = int64_t(c.lens.size());
  const Tensor d_o = randn({T, c.HV, c.V}, c.dt, rng).to(Device::cuda);
  const Tensor dht =
      c.dht ? randn({N, c.HV, c.K, c.V}, DType::f32, rng, 0.5).to(Device::cuda) : Tensor();
  const double nan = std::numeric_limits<double>::quiet_NaN();

  const ops::KdaOutput plain = ops::kda_chunk_forward_cuda(gpu);
  const KdaGrads recomputed = ops::kda_chunk_backward_cuda(gpu, d_o, dht, poisoned(gpu));

  // A training forward's o and final state bit-equal to the plain
  // forward's.
  auto same_as_plain = [&](const ops::KdaChunkCudaBuffers& fbuf, const char* mode) {
    const ops::KdaOutput out = ops::kda_chunk_forward_cuda(gpu, fbuf);
    EXPECT_TRUE(testing::bit_equal(out.o, plain.o)) << name << ": o (" << mode << ")";
    EXPECT_TRUE(testing::bit_equal(out.final_state, plain.final_state))
        << name << ": ht (" << mode << ")";
  };
  ops::KdaChunkCudaBuffers fb;
  fb.saved = Tensor::full({ops::kda_chunk_cuda_saved_floats(gpu)}, nan, DType::f32, Device::cuda);
  same_as_plain(fb, "saved");
  ops::KdaChunkBwdCudaBuffers bb = poisoned(gpu);
  const int64_t scratch = ops::kda_chunk_bwd_cuda_workspace_floats(gpu, true);
  EXPECT_EQ(scratch + ops::kda_chunk_cuda_saved_floats(gpu),
            ops::kda_chunk_bwd_cuda_workspace_floats(gpu));
  bb.workspace = Tensor::full({scratch}, nan, DType::f32, Device::cuda);
  bb.saved = fb.saved;
  // Every gradient of `from` bit-equal to the recomputing backward's.
  auto same_as_recomputed = [&](const KdaGrads& from, const char* mode) {
    bool same = true;
    for (const Named& f : kFields) {
      if (!(recomputed.*(f.field)).defined()) continue;
      const bool eq = testing::bit_equal(from.*(f.field), recomputed.*(f.field));
      EXPECT_TRUE(eq) << name << ": " << f.name << " (" << mode << ") differs";
      same = same && eq;
    }
    std::printf("  %s vs recompute (%s): %s\n", mode, name.c_str(),
                same ? "bit-identical" : "DIFFERENT");
  };
  same_as_recomputed(ops::kda_chunk_backward_cuda(gpu, d_o, dht, bb), "saved");

  // The lighter mode: the forward keeps A_qk and M^-1
  // (KdaChunkCudaBuffers::kept, NaN-poisoned first), the backward
  // recomputes the rest from them.
  ops::KdaChunkCudaBuffers fk;
  fk.kept = Tensor::full({ops::kda_chunk_cuda_kept_floats(gpu)}, nan, DType::f32, Device::cuda);
  same_as_plain(fk, "kept");
  ops::KdaChunkBwdCudaBuffers bk = poisoned(gpu);
  bk.kept = fk.kept;
  same_as_recomputed(ops::kda_chunk_backward_cuda(gpu, d_o, dht, bk), "kept");
  // ... and it reads them: NaN in either half of the kept buffer (A_qk,
  // then M^-1) reaches the gradients, where a backward that recomputed
  // them would give the finite bits checked above. The NaN is the GPU's
  // own (0x7fffffff: every mantissa bit set), the one a TF32 rounding by
  // an integer add would carry into the sign bit and turn into -0.
  const int64_t half = ops::kda_chunk_cuda_kept_floats(gpu) / 2;
  Tensor gpu_nan = Tensor::empty({half}, DType::f32);
  for (int64_t i = 0; i < half; ++i) gpu_nan.data<float>()[i] = std::bit_cast<float>(0x7fffffffu);
  gpu_nan = gpu_nan.to(Device::cuda);
  for (int part = 0; part < 2; ++part) {
    ops::KdaChunkBwdCudaBuffers bn = poisoned(gpu);
    bn.kept = Tensor::empty(fk.kept.shape(), DType::f32, Device::cuda);
    bn.kept.copy_(fk.kept);
    bn.kept.slice(0, part * half, (part + 1) * half).copy_(gpu_nan);
    const KdaGrads g = ops::kda_chunk_backward_cuda(gpu, d_o, dht, bn);
    int64_t nans = 0;
    for (const Named& f : kFields) {
      if (!(g.*(f.field)).defined()) continue;
      const Tensor h = (g.*(f.field)).to(Device::cpu).to(DType::f64);
      for (int64_t i = 0; i < h.numel(); ++i) nans += std::isnan(h.data<double>()[i]);
    }
    EXPECT_GT(nans, 0) << name << ": the backward ignored the kept "
                       << (part == 0 ? "A_qk" : "M^-1");
  }

  // A second step through the same buffers with a new v and d o matches a
  // fresh recomputing backward on those inputs: nothing of the first step
  // leaks into the second.
  KdaArgs g2 = gpu;
  g2.v = randn(gpu.v.shape(), c.dt, rng).to(Device::cuda);
  const Tensor d_o2 = randn({T, c.HV, c.V}, c.dt, rng).to(Device::cuda);
  ops::kda_chunk_forward_cuda(g2, fb);
  const KdaGrads s2 = ops::kda_chunk_backward_cuda(g2, d_o2, dht, bb);
  ops::kda_chunk_forward_cuda(g2, fk);
  const KdaGrads k2 = ops::kda_chunk_backward_cuda(g2, d_o2, dht, bk);
  const KdaGrads r2 = ops::kda_chunk_backward_cuda(g2, d_o2, dht);
  for (const Named& f : kFields)
    if ((r2.*(f.field)).defined()) {
      EXPECT_TRUE(testing::bit_equal(s2.*(f.field), r2.*(f.field)))
          << name << ": second step, " << f.name;
      EXPECT_TRUE(testing::bit_equal(k2.*(f.field), r2.*(f.field)))
          << name << ": second step (kept), " << f.name;
    }
}

TEST(KdaChunkBwdGpu, SavedForwardMatchesRecompute) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  // The emulation runs the long sequence at 130 tokens (still two chunks
  // and a partial one).
  const std::vector<int64_t> lens =
      cuda_emulated() ? std::vector<int64_t>{1, 63, 65, 130} : kOddLens;
  const WideShape w = wide();
  saved_vs_recompute(
      {"saved bf16 lower-bound", lens, 2, 4, 128, 128, DType::bf16, true, true, Gate::lower_bound});
  saved_vs_recompute(
      {"saved f32 plain h0", lens, 1, 2, 128, 128, DType::f32, true, false, Gate::plain, true});
  saved_vs_recompute({"saved bf16 standard K64",
                      {1, 63, 65, 130, 0, 7},
                      2,
                      2,
                      64,
                      64,
                      DType::bf16,
                      false,
                      true,
                      Gate::standard});
  // The wide state tile's saved path on the GPU only: the emulation covers the wide tile in
  // WideStateTile and the saved path in the other cases here.
  if (!cuda_emulated())
    saved_vs_recompute({"saved bf16 wide tile", w.lens, w.H, w.HV, 128, 128, DType::bf16, false,
                        true, Gate::plain});
  saved_vs_recompute(
      {"saved f32 K32 V96", {1, 63, 65, 200}, 1, 3, 32, 96, DType::f32, true, true, Gate::plain});
}

// A copy of CUDA tensor t whose data starts one element past a 16-byte
// boundary.
Tensor misaligned(const Tensor& t) {
  const int64_t n = t.numel();
  const Tensor flat = Tensor::zeros({n + 8}, t.dtype(), Device::cuda);
  Tensor part = flat.slice(0, 1, n + 1);
  part.copy_(t.contiguous().view({n}));
  return part.view(t.shape());
}

// Inputs q, k, v, g not 16-byte aligned take the forward's element-wise
// loads instead of its 16-byte ones: the same bits, forward and backward.
TEST(KdaChunkBwdGpu, UnalignedInputsSameBits) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  for (const Case& c : {Case{"unaligned bf16 lower-bound", kOddLens, 2, 4, 128, 128, DType::bf16,
                             true, true, Gate::lower_bound},
                        Case{"unaligned f32 plain K64",
                             {1, 63, 65, 130},
                             1,
                             2,
                             64,
                             64,
                             DType::f32,
                             false,
                             false,
                             Gate::plain}}) {
    SCOPED_TRACE(describe(c));
    Rng rng(testing::test_seed() ^ std::hash<std::string>{}(c.name));
    const KdaArgs gpu = to_device(make_inputs(c, rng), false);
    const int64_t T = gpu.q.size(0), N = int64_t(c.lens.size());
    const Tensor d_o = randn({T, c.HV, c.V}, c.dt, rng).to(Device::cuda);
    const Tensor dht =
        c.dht ? randn({N, c.HV, c.K, c.V}, DType::f32, rng, 0.5).to(Device::cuda) : Tensor();
    const ops::KdaOutput ref_f = ops::kda_chunk_forward_cuda(gpu);
    const KdaGrads ref_b = ops::kda_chunk_backward_cuda(gpu, d_o, dht);
    for (int which = 0; which < 5; ++which) {  // q, k, v, g alone, then all four
      KdaArgs u = gpu;
      Tensor* ts[] = {&u.q, &u.k, &u.v, &u.g};
      for (int i = 0; i < 4; ++i)
        if (which == i || which == 4) *ts[i] = misaligned(*ts[i]);
      ASSERT_NE(reinterpret_cast<uintptr_t>((which == 4 ? u.q : *ts[which]).raw()) % 16, 0u);
      const ops::KdaOutput f = ops::kda_chunk_forward_cuda(u);
      EXPECT_TRUE(testing::bit_equal(f.o, ref_f.o)) << "o, unaligned input " << which;
      EXPECT_TRUE(testing::bit_equal(f.final_state, ref_f.final_state))
          << "final_state, unaligned input " << which;
      if (which < 4) continue;
      const KdaGrads b = ops::kda_chunk_backward_cuda(u, d_o, dht);
      for (const Named& nf : kFields)
        if ((ref_b.*(nf.field)).defined())
          EXPECT_TRUE(testing::bit_equal(b.*(nf.field), ref_b.*(nf.field)))
              << nf.name << ", unaligned inputs";
    }
  }
}

TEST(KdaChunkBwdGpu, RejectsBadArguments) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  auto gpu_case = [&](int64_t K, int64_t V) {
    Case c{"args", {5, 70}, 1, 1, K, V, DType::f32, true, false, Gate::plain};
    return to_device(make_inputs(c, rng), false);
  };
  auto d_o = [](int64_t V) { return Tensor::zeros({75, 1, V}, DType::f32, Device::cuda); };
  EXPECT_THROW(ops::kda_chunk_backward_cuda(gpu_case(48, 64), d_o(64), {}), Error);
  EXPECT_THROW(ops::kda_chunk_backward_cuda(gpu_case(256, 64), d_o(64), {}), Error);
  EXPECT_THROW(ops::kda_chunk_backward_cuda(gpu_case(64, 40), d_o(40), {}), Error);
  EXPECT_THROW(ops::kda_chunk_backward_cuda(gpu_case(64, 160), d_o(160), {}), Error);
  KdaArgs a = gpu_case(64, 64);
  EXPECT_NO_THROW(ops::kda_chunk_backward_cuda(a, d_o(64), {}));
  EXPECT_THROW(ops::kda_chunk_backward_cuda(a, Tensor(), {}),
               Error);  // no d_o
  EXPECT_THROW(ops::kda_chunk_backward_cuda(a, d_o(32), {}),
               Error);  // d_o shape
  EXPECT_THROW(ops::kda_chunk_backward_cuda(a, d_o(64).to(Device::cpu), {}), Error);
  EXPECT_THROW(
      ops::kda_chunk_backward_cuda(a, Tensor::zeros({75, 1, 64}, DType::bf16, Device::cuda), {}),
      Error);  // d_o dtype
  EXPECT_THROW(ops::kda_chunk_backward_cuda(
                   a, d_o(64), Tensor::zeros({1, 1, 64, 64}, DType::f32, Device::cuda)),
               Error);  // d_final_state: N = 2
  {
    KdaArgs b = a;
    b.q = b.q.to(Device::cpu);
    EXPECT_THROW(ops::kda_chunk_backward_cuda(b, d_o(64), {}), Error);
  }
  {
    KdaArgs b = a;
    b.seqs = SeqLayout::from_lengths({5, 69});
    EXPECT_THROW(ops::kda_chunk_backward_cuda(b, d_o(64), {}), Error);
  }
  {
    KdaArgs b = a;
    b.gate = KdaGateKind::standard;  // needs A_log
    EXPECT_THROW(ops::kda_chunk_backward_cuda(b, d_o(64), {}), Error);
  }
  {
    ops::KdaChunkBwdCudaBuffers buf;
    buf.workspace = Tensor::empty({16}, DType::f32, Device::cuda);  // too small
    EXPECT_THROW(ops::kda_chunk_backward_cuda(a, d_o(64), {}, buf), Error);
  }
  {
    ops::KdaChunkBwdCudaBuffers buf;
    buf.dq = Tensor::empty({75, 1, 32}, DType::f32,
                           Device::cuda);  // wrong shape
    EXPECT_THROW(ops::kda_chunk_backward_cuda(a, d_o(64), {}, buf), Error);
  }
  {  // saved buffers too small, or of the wrong dtype
    const int64_t n = ops::kda_chunk_cuda_saved_floats(a);
    ops::KdaChunkCudaBuffers fb;
    fb.saved = Tensor::empty({n - 64}, DType::f32, Device::cuda);
    EXPECT_THROW(ops::kda_chunk_forward_cuda(a, fb), Error);
    fb.saved = Tensor::empty({n}, DType::bf16, Device::cuda);
    EXPECT_THROW(ops::kda_chunk_forward_cuda(a, fb), Error);
    ops::KdaChunkBwdCudaBuffers buf;
    buf.saved = Tensor::empty({n - 64}, DType::f32, Device::cuda);
    EXPECT_THROW(ops::kda_chunk_backward_cuda(a, d_o(64), {}, buf), Error);
    buf.saved = Tensor::empty({n}, DType::f32, Device::cuda);
    buf.workspace = Tensor::empty({ops::kda_chunk_bwd_cuda_workspace_floats(a, true) - 64},
                                  DType::f32, Device::cuda);
    EXPECT_THROW(ops::kda_chunk_backward_cuda(a, d_o(64), {}, buf), Error);
  }
  {  // kept buffers too small, or given with saved
    const int64_t n = ops::kda_chunk_cuda_kept_floats(a);
    ops::KdaChunkCudaBuffers fb;
    fb.kept = Tensor::empty({n - 64}, DType::f32, Device::cuda);
    EXPECT_THROW(ops::kda_chunk_forward_cuda(a, fb), Error);
    fb.kept = Tensor::empty({n}, DType::f32, Device::cuda);
    fb.saved = Tensor::empty({ops::kda_chunk_cuda_saved_floats(a)}, DType::f32, Device::cuda);
    EXPECT_THROW(ops::kda_chunk_forward_cuda(a, fb), Error);
    ops::KdaChunkBwdCudaBuffers buf;
    buf.kept = Tensor::empty({n - 64}, DType::f32, Device::cuda);
    EXPECT_THROW(ops::kda_chunk_backward_cuda(a, d_o(64), {}, buf), Error);
    buf.kept = fb.kept;
    buf.saved = fb.saved;
    EXPECT_THROW(ops::kda_chunk_backward_cuda(a, d_o(64), {}, buf), Error);
  }
}

// The target shapes: bf16, fused lower-bound gate -5, use_qk_l2norm, beta
// logits, K = V = 128, packed equal-length sequences. cudaEvent time of
// the synchronous call with preallocated buffers (host planning and the
// small chunk-table copy included), median of 5 after a warm-up. Inputs
// are 2048 random tokens tiled along T (the values do not change the
// work). Asserts nothing on speed. The time of each stage:
// bench/kda_lab/kda_stage_timer.
TEST(KdaChunkBwdGpu, Timing) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  if (cuda_emulated()) GTEST_SKIP() << "the CUDA device is the CPU emulation: no timings";
  struct Shape3 {
    int64_t T, H, N;
  };
  for (const Shape3 sh : {Shape3{8192, 32, 1}, Shape3{32768, 64, 8}}) {
    const int64_t T0 = 2048, K = 128, V = 128;
    Rng rng(testing::test_seed());
    Case c{"timing", {T0}, sh.H, sh.H, K, V, DType::bf16, false, true, Gate::lower_bound};
    const KdaArgs small = make_inputs(c, rng);
    const Tensor d_o_small = randn({T0, sh.H, V}, DType::bf16, rng);
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
    KdaArgs a = small;
    a.q = tile(small.q), a.k = tile(small.k), a.v = tile(small.v), a.g = tile(small.g);
    a.beta = tile(small.beta);
    a.A_log = small.A_log.to(Device::cuda), a.dt_bias = small.dt_bias.to(Device::cuda);
    std::vector<int64_t> cu;
    for (int64_t n = 0; n <= sh.N; ++n) cu.push_back(n * sh.T / sh.N);
    a.seqs = SeqLayout::from_offsets(cu, sh.T);
    const Tensor d_o = tile(d_o_small);
    const Tensor dht = Tensor::zeros({sh.N, sh.H, K, V}, DType::f32, Device::cuda);
    ops::KdaChunkBwdCudaBuffers b;
    b.workspace =
        Tensor::empty({ops::kda_chunk_bwd_cuda_workspace_floats(a)}, DType::f32, Device::cuda);
    b.dq = Tensor::empty({sh.T, sh.H, K}, DType::f32, Device::cuda);
    b.dk = Tensor::empty({sh.T, sh.H, K}, DType::f32, Device::cuda);
    b.dv = Tensor::empty({sh.T, sh.H, V}, DType::f32, Device::cuda);
    b.dg = Tensor::empty({sh.T, sh.H, K}, DType::f32, Device::cuda);
    b.dbeta = Tensor::empty({sh.T, sh.H}, DType::f32, Device::cuda);
    b.dinitial_state = Tensor::empty({sh.N, sh.H, K, V}, DType::f32, Device::cuda);
    b.dA_log = Tensor::empty({sh.H}, DType::f32, Device::cuda);
    b.ddt_bias = Tensor::empty({sh.H * K}, DType::f32, Device::cuda);
    ops::KdaChunkCudaBuffers fb;
    fb.o = Tensor::empty({sh.T, sh.H, V}, DType::bf16, Device::cuda);
    fb.final_state = Tensor::empty({sh.N, sh.H, K, V}, DType::f32, Device::cuda);
    fb.workspace =
        Tensor::empty({ops::kda_chunk_cuda_workspace_floats(a)}, DType::f32, Device::cuda);

    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    auto time = [&](auto&& f) {
      f();  // warm-up
      std::vector<double> ms;
      for (int i = 0; i < 5; ++i) {
        cudaEventRecord(e0);
        f();
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float m = 0;
        cudaEventElapsedTime(&m, e0, e1);
        ms.push_back(m);
      }
      std::sort(ms.begin(), ms.end());
      return ms[2];
    };
    const double bwd = time([&] { ops::kda_chunk_backward_cuda(a, d_o, dht, b); });
    const double fwd = time([&] { ops::kda_chunk_forward_cuda(a, fb); });
    // The training pair: the forward saves its intermediates, the backward
    // reads them.
    ops::KdaChunkCudaBuffers fs = fb;
    fs.saved = Tensor::empty({ops::kda_chunk_cuda_saved_floats(a)}, DType::f32, Device::cuda);
    ops::KdaChunkBwdCudaBuffers bs = b;
    bs.workspace = Tensor::empty({ops::kda_chunk_bwd_cuda_workspace_floats(a, true)}, DType::f32,
                                 Device::cuda);
    bs.saved = fs.saved;
    b.workspace = Tensor();  // the recomputing backward's workspace is not
                             // needed any more
    const double fwd_s = time([&] { ops::kda_chunk_forward_cuda(a, fs); });
    const double bwd_s = time([&] { ops::kda_chunk_backward_cuda(a, d_o, dht, bs); });
    const double saved_gb = double(fs.saved.nbytes()) / 1e9;
    fs.saved = bs.saved = Tensor();
    // The lighter pair: the forward keeps A_qk and M^-1, the backward
    // recomputes the rest.
    ops::KdaChunkCudaBuffers fk = fb;
    fk.kept = Tensor::empty({ops::kda_chunk_cuda_kept_floats(a)}, DType::f32, Device::cuda);
    ops::KdaChunkBwdCudaBuffers bk = b;
    bk.workspace =
        Tensor::empty({ops::kda_chunk_bwd_cuda_workspace_floats(a)}, DType::f32, Device::cuda);
    bk.kept = fk.kept;
    const double fwd_k = time([&] { ops::kda_chunk_forward_cuda(a, fk); });
    const double bwd_k = time([&] { ops::kda_chunk_backward_cuda(a, d_o, dht, bk); });
    bk.workspace = Tensor();
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    std::printf(
        "kda timing bf16 lower-bound+l2norm+beta_logits T=%lld H=%lld "
        "N=%lld K=V=128: backward "
        "%.3f ms, forward %.3f ms, fwd+bwd %.3f ms; saved intermediates: "
        "forward %.3f ms, "
        "backward %.3f ms, fwd+bwd %.3f ms (%.2f GB saved); kept A_qk, "
        "M^-1: forward %.3f ms, "
        "backward %.3f ms, fwd+bwd %.3f ms (%.2f GB kept)\n",
        (long long)sh.T, (long long)sh.H, (long long)sh.N, bwd, fwd, fwd + bwd, fwd_s, bwd_s,
        fwd_s + bwd_s, saved_gb, fwd_k, bwd_k, fwd_k + bwd_k, double(fk.kept.nbytes()) / 1e9);
  }
}

}  // namespace
}  // namespace hlm
