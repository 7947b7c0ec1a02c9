// The CUDA sparse and dense causal MLA attention (forward, backward) and the indexer loss's
// attention targets (dense causal and explicit) against the CPU ops on the same inputs: f32 (max
// error / max |ref| <= 2e-5), f64 (<= 1e-12), bf16 inputs (the CPU f32 op on the bf16-rounded
// inputs; outputs stored in bf16 within bf16 rounding of the reference, see check(); the f32 ones,
// lse and targets, as f32). Single documents of 1, 63 and 65 tokens and packed documents;
// selections with -1 holes, rows with fewer and with more causal keys than W, empty rows; the
// causal attention also bit for bit against the CUDA sparse attention over every causal token.
// Outputs NaN-poisoned, bit-identical run to run, every comparison prints its errors; bad
// arguments on CUDA throw.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>

#include "core/device.h"
#include "core/rng.h"
#include "core/seq_layout.h"
#include "ops/cuda/dsa_attention.cuh"
#include "ops/cuda/dsa_common.cuh"
#include "ops/dispatch.h"
#include "ops/dsa_common.h"
#include "ops/dsa_indexer_loss.h"
#include "ops/dsa_sparse_attention.h"
#include "testing.h"

namespace hlm {
namespace {

using testing::cpu;
using testing::gpu;

using Poison = testing::PoisonOutputs;
using testing::round_bf16;
// A GPU output against the CPU reference; `dt` is the output's storage dtype. f32 / f64: max
// error / max |ref| <= 2e-5 / 1e-12. bf16 (computed in f32 from the same bf16 values as the CPU
// f32 op, then rounded): rounding to bf16 alone moves a value by up to 2^-8 of itself and gives a
// relative L2 error of about 1.6e-3 on random data, above 2e-3 on small tensors (2.3e-3 seen on the
// 40 values of a 1-token dkv). So every element must lie within that rounding of the reference
// plus the f32 bound, |out - ref| <= 2^-8 |ref| + 2e-5 max |ref|, and the relative L2 error within
// 2^-8. Non-finite reference entries (-inf lse) must match exactly. `extra` widens the bf16
// element bound by an absolute term: the tensor-core forward rounds the softmax weights p_j to
// bf16 (relative error <= 2^-9 each) before the value product, which moves out = sum p_j v_j /
// sum p_j by at most 2^-9 sum p_j |v_j| / sum p_j <= 2^-9 max |v| (tc_extra).
void check(const char* what, const Tensor& out_gpu, const Tensor& ref, DType dt, double extra = 0) {
  const Tensor o = cpu(out_gpu).to(ref.dtype());
  const testing::ErrorStats e = testing::compare(o, ref);
  double mref = 0;
  const std::vector<double> rv = ref.to_f64_vector(), ov = o.to_f64_vector();
  int64_t nonfinite_bad = 0;
  for (size_t i = 0; i < rv.size(); ++i) {
    if (std::isfinite(rv[i])) {
      mref = std::max(mref, std::fabs(rv[i]));
    } else if (!(ov[i] == rv[i])) {
      ++nonfinite_bad;
    }
  }
  const double maxrel = mref > 0 ? e.max_abs / mref : e.max_abs;
  std::printf("  %-26s %-5s max_err/max|ref| %.3e  rel_l2 %.3e", what, dtype_name(dt), maxrel,
              e.rel_l2);
  EXPECT_EQ(e.nan_mismatch, 0) << what << " " << e.report(ref);
  EXPECT_EQ(nonfinite_bad, 0) << what;
  if (dt == DType::bf16) {
    // max |out - ref| / (2^-8 |ref| + 2e-5 max |ref| + extra) (an all-zero reference: 2e-5
    // absolute, as the f32 bound)
    const double sc = mref > 0 ? mref : 1.0;
    double worst = 0;
    for (size_t i = 0; i < rv.size(); ++i)
      if (std::isfinite(rv[i]))
        worst = std::max(worst, std::fabs(ov[i] - rv[i]) /
                                    (std::ldexp(std::fabs(rv[i]), -8) + 2e-5 * sc + extra));
    const double floor = testing::compare(round_bf16(ref), ref).rel_l2;
    std::printf("  (bf16 rounding alone: rel_l2 %.3e; worst element %.2f of its bound)", floor,
                worst);
    EXPECT_LE(worst, 1.0) << what << " " << e.report(ref);
    EXPECT_LE(e.rel_l2, std::ldexp(1.0, -8)) << what << " " << e.report(ref);
  }
  std::printf("\n");
  if (dt == DType::f32) {
    EXPECT_LE(maxrel, 2e-5) << what << " " << e.report(ref);
  } else if (dt == DType::f64) {
    EXPECT_LE(maxrel, 1e-12) << what << " " << e.report(ref);
  }
}

void same_bits(const char* what, const Tensor& a, const Tensor& b) {
  EXPECT_TRUE(testing::bit_equal(cpu(a), cpu(b))) << what << ": second run differs";
}

// Inputs in dtype dt: the CPU reference sees x (f32 / f64) or the bf16-rounded x in f32.
struct Pair {
  Tensor ref, dev;
};
Pair make(const Shape& s, DType dt, Rng& rng, double std = 1.0) {
  const Tensor x = randn(s, dt == DType::f64 ? DType::f64 : DType::f32, rng, std);
  if (dt == DType::bf16) return {round_bf16(x), gpu(x.to(DType::bf16))};
  return {x, gpu(x)};
}
DType compute_of(DType dt) {
  return dt == DType::f64 ? DType::f64 : DType::f32;
}

// The bf16 forward's extra element bound (check()): 2^-9 max |v| over the value channels of kv.
double tc_extra(DType dt, const Tensor& kv_ref, int64_t dv) {
  if (dt != DType::bf16) return 0;
  double m = 0;
  const std::vector<double> v = kv_ref.to_f64_vector();
  const int64_t D = kv_ref.size(1);
  for (size_t i = 0; i < v.size(); ++i)
    if (int64_t(i) % D < dv) m = std::max(m, std::fabs(v[i]));
  return std::ldexp(m, -9);
}

int64_t total_of(const std::vector<int64_t>& lens) {
  int64_t T = 0;
  for (int64_t l : lens) T += l;
  return T;
}

// A random selection [T, W] (i32 or i64): each row holds a random number (0 .. W) of its causal
// tokens at random slots, -1 elsewhere; every 7th row is empty, every 5th takes as many keys as
// fit (all its causal tokens when it has fewer than W, W of them when it has more).
Tensor random_selection(const std::vector<int64_t>& lens, int64_t W, Rng& rng, bool i64) {
  const int64_t T = total_of(lens);
  std::vector<double> v(size_t(T * W), -1.0);
  int64_t t = 0, start = 0;
  for (int64_t L : lens) {
    for (int64_t r = 0; r < L; ++r, ++t) {
      std::vector<int64_t> cand, slots;
      for (int64_t s = start; s <= t; ++s) cand.push_back(s);
      for (int64_t j = 0; j < W; ++j) slots.push_back(j);
      for (int64_t j = W - 1; j > 0; --j)
        std::swap(slots[size_t(j)], slots[rng.below(uint64_t(j + 1))]);
      for (int64_t j = int64_t(cand.size()) - 1; j > 0; --j)
        std::swap(cand[size_t(j)], cand[rng.below(uint64_t(j + 1))]);
      int64_t n = int64_t(rng.below(uint64_t(W + 1)));
      if (t % 5 == 2) n = W;
      if (t % 7 == 3) n = 0;
      n = std::min<int64_t>(n, int64_t(cand.size()));
      for (int64_t j = 0; j < n; ++j) v[size_t(t * W + slots[size_t(j)])] = double(cand[size_t(j)]);
    }
    start += L;
  }
  return Tensor::from_values({T, W}, v, i64 ? DType::i64 : DType::i32);
}

struct Shape4 {
  int64_t H, D, dv;
};

// Forward and backward of one case; the CPU backward gets the GPU forward's out and lse (as f32
// for bf16), so both sides of the backward see the same inputs.
void attention_case(DType dt, const std::vector<int64_t>& lens, int64_t W, Shape4 s, Rng& rng) {
  const int64_t T = total_of(lens);
  const SeqLayout cu = SeqLayout::from_lengths(lens);
  const double scale = 1.0 / std::sqrt(double(s.D));
  const Pair q = make({T, s.H, s.D}, dt, rng), kv = make({T, s.D}, dt, rng);
  const Pair dout = make({T, s.H, s.dv}, dt, rng);
  const Tensor sel = random_selection(lens, W, rng, W % 2 == 0);
  std::printf("sparse attention %s T=%lld H=%lld D=%lld dv=%lld W=%lld docs=%zu\n", dtype_name(dt),
              (long long)T, (long long)s.H, (long long)s.D, (long long)s.dv, (long long)W,
              lens.size());
  const auto f_ref = ops::sparse_attention(q.ref, kv.ref, sel, cu, s.dv, scale);
  const auto f_dev = ops::sparse_attention(q.dev, kv.dev, gpu(sel), cu, s.dv, scale);
  ASSERT_EQ(f_dev.out.dtype(), dt);
  ASSERT_EQ(f_dev.lse.dtype(), compute_of(dt));
  check("forward out", f_dev.out, f_ref.out, dt, tc_extra(dt, kv.ref, s.dv));
  check("forward lse", f_dev.lse, f_ref.lse, compute_of(dt));
  const Tensor out_in = cpu(f_dev.out).to(compute_of(dt)), lse_in = cpu(f_dev.lse);
  const auto g_ref =
      ops::sparse_attention_backward(q.ref, kv.ref, sel, cu, s.dv, scale, out_in, lse_in, dout.ref);
  const auto g_dev = ops::sparse_attention_backward(q.dev, kv.dev, gpu(sel), cu, s.dv, scale,
                                                    f_dev.out, f_dev.lse, dout.dev);
  ASSERT_EQ(g_dev.dq.dtype(), dt);
  ASSERT_EQ(g_dev.dkv.dtype(), dt);
  check("backward dq", g_dev.dq, g_ref.dq, dt);
  check("backward dkv", g_dev.dkv, g_ref.dkv, dt);
  const auto f2 = ops::sparse_attention(q.dev, kv.dev, gpu(sel), cu, s.dv, scale);
  const auto g2 = ops::sparse_attention_backward(q.dev, kv.dev, gpu(sel), cu, s.dv, scale,
                                                 f_dev.out, f_dev.lse, dout.dev);
  same_bits("out", f2.out, f_dev.out);
  same_bits("lse", f2.lse, f_dev.lse);
  same_bits("dq", g2.dq, g_dev.dq);
  same_bits("dkv", g2.dkv, g_dev.dkv);
}

// Every causal token of its document, ascending, -1 padded to W: the index tensor that makes
// sparse_attention the dense causal attention.
Tensor all_causal(const std::vector<int64_t>& lens, int64_t W) {
  const int64_t T = total_of(lens);
  std::vector<int32_t> v(size_t(T * W), -1);
  int64_t t = 0, start = 0;
  for (int64_t L : lens) {
    for (int64_t r = 0; r < L; ++r, ++t)
      for (int64_t s = start; s <= t; ++s) v[size_t(t * W + s - start)] = int32_t(s);
    start += L;
  }
  return Tensor::from_vector<int32_t>({T, W}, v);
}

// causal_attention forward and backward against the CPU op (as attention_case), run twice for the
// bits, and against the CUDA sparse_attention with every causal token ascending (the same kernels
// over the same keys and readers in the same order: identical bits).
void causal_case(DType dt, const std::vector<int64_t>& lens, Shape4 s, Rng& rng) {
  const int64_t T = total_of(lens);
  const SeqLayout cu = SeqLayout::from_lengths(lens);
  const double scale = 1.0 / std::sqrt(double(s.D));
  const Pair q = make({T, s.H, s.D}, dt, rng), kv = make({T, s.D}, dt, rng);
  const Pair dout = make({T, s.H, s.dv}, dt, rng);
  std::printf("causal attention %s T=%lld H=%lld D=%lld dv=%lld docs=%zu\n", dtype_name(dt),
              (long long)T, (long long)s.H, (long long)s.D, (long long)s.dv, lens.size());
  const auto f_ref = ops::causal_attention(q.ref, kv.ref, cu, s.dv, scale);
  const auto f_dev = ops::causal_attention(q.dev, kv.dev, cu, s.dv, scale);
  ASSERT_EQ(f_dev.out.dtype(), dt);
  ASSERT_EQ(f_dev.lse.dtype(), compute_of(dt));
  check("causal forward out", f_dev.out, f_ref.out, dt, tc_extra(dt, kv.ref, s.dv));
  check("causal forward lse", f_dev.lse, f_ref.lse, compute_of(dt));
  const Tensor out_in = cpu(f_dev.out).to(compute_of(dt)), lse_in = cpu(f_dev.lse);
  const auto g_ref =
      ops::causal_attention_backward(q.ref, kv.ref, cu, s.dv, scale, out_in, lse_in, dout.ref);
  const auto g_dev = ops::causal_attention_backward(q.dev, kv.dev, cu, s.dv, scale, f_dev.out,
                                                    f_dev.lse, dout.dev);
  ASSERT_EQ(g_dev.dq.dtype(), dt);
  ASSERT_EQ(g_dev.dkv.dtype(), dt);
  check("causal backward dq", g_dev.dq, g_ref.dq, dt);
  check("causal backward dkv", g_dev.dkv, g_ref.dkv, dt);
  const auto f2 = ops::causal_attention(q.dev, kv.dev, cu, s.dv, scale);
  const auto g2 = ops::causal_attention_backward(q.dev, kv.dev, cu, s.dv, scale, f_dev.out,
                                                 f_dev.lse, dout.dev);
  same_bits("causal out", f2.out, f_dev.out);
  same_bits("causal lse", f2.lse, f_dev.lse);
  same_bits("causal dq", g2.dq, g_dev.dq);
  same_bits("causal dkv", g2.dkv, g_dev.dkv);
  int64_t longest = 0;
  for (int64_t l : lens) longest = std::max(longest, l);
  const Tensor idx = gpu(all_causal(lens, longest));
  const auto fs = ops::sparse_attention(q.dev, kv.dev, idx, cu, s.dv, scale);
  const auto gs = ops::sparse_attention_backward(q.dev, kv.dev, idx, cu, s.dv, scale, f_dev.out,
                                                 f_dev.lse, dout.dev);
  EXPECT_TRUE(testing::bit_equal(cpu(fs.out), cpu(f_dev.out))) << "out vs sparse_attention";
  EXPECT_TRUE(testing::bit_equal(cpu(fs.lse), cpu(f_dev.lse))) << "lse vs sparse_attention";
  EXPECT_TRUE(testing::bit_equal(cpu(gs.dq), cpu(g_dev.dq))) << "dq vs sparse_attention";
  EXPECT_TRUE(testing::bit_equal(cpu(gs.dkv), cpu(g_dev.dkv))) << "dkv vs sparse_attention";
}

void target_case(DType dt, const std::vector<int64_t>& lens, int64_t W, Shape4 s, Rng& rng) {
  const int64_t T = total_of(lens);
  const SeqLayout cu = SeqLayout::from_lengths(lens);
  const double scale = 1.0 / std::sqrt(double(s.D));
  // std 2: peaked softmaxes, so the heads' distributions differ.
  const Pair q = make({T, s.H, s.D}, dt, rng, 2.0), kv = make({T, s.D}, dt, rng);
  std::printf("attention target %s T=%lld H=%lld D=%lld W=%lld docs=%zu\n", dtype_name(dt),
              (long long)T, (long long)s.H, (long long)s.D, (long long)W, lens.size());
  int64_t longest = 0;
  for (int64_t l : lens) longest = std::max(longest, l);
  for (int64_t Wd : {int64_t(0), longest + 3}) {
    const Tensor d_ref = ops::attention_target(q.ref, kv.ref, cu, scale, Wd);
    const Tensor d_dev = ops::attention_target(q.dev, kv.dev, cu, scale, Wd);
    ASSERT_EQ(d_dev.dtype(), compute_of(dt));
    check(Wd == 0 ? "dense target (W = 0)" : "dense target (W > longest)", d_dev, d_ref,
          compute_of(dt));
    same_bits("dense target", ops::attention_target(q.dev, kv.dev, cu, scale, Wd), d_dev);
  }
  const Tensor sel = random_selection(lens, W, rng, W % 2 == 1);
  const Tensor a_ref = ops::attention_target_at(q.ref, kv.ref, cu, sel, scale);
  const Tensor a_dev = ops::attention_target_at(q.dev, kv.dev, cu, gpu(sel), scale);
  ASSERT_EQ(a_dev.dtype(), compute_of(dt));
  check("explicit target", a_dev, a_ref, compute_of(dt));
  same_bits("explicit target", ops::attention_target_at(q.dev, kv.dev, cu, gpu(sel), scale), a_dev);
  // With the attention's lse over the same selection (the DSA layer's call): the same target up
  // to the rounding of the lse, on both devices.
  const Tensor lse_ref = ops::sparse_attention(q.ref, kv.ref, sel, cu, s.dv, scale).lse;
  const Tensor lse_dev = ops::sparse_attention(q.dev, kv.dev, gpu(sel), cu, s.dv, scale).lse;
  check("explicit target, lse given (CPU)",
        gpu(ops::attention_target_at(q.ref, kv.ref, cu, sel, scale, lse_ref)), a_ref,
        compute_of(dt));
  check("explicit target, lse given",
        ops::attention_target_at(q.dev, kv.dev, cu, gpu(sel), scale, lse_dev), a_ref,
        compute_of(dt));
  testing::expect_error(
      [&] {
        ops::attention_target_at(q.dev, kv.dev, cu, gpu(sel), scale,
                                 gpu(Tensor::zeros({T + 1, s.H}, lse_dev.dtype())));
      },
      "lse must have shape");
}

const std::vector<std::vector<int64_t>> kLens = {{1}, {63}, {65}, {1, 63, 65}};

TEST(DsaAttentionGpu, SparseAttentionForwardBackward) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Poison poison;
  Rng rng(testing::test_seed());
  for (DType dt : {DType::f32, DType::f64, DType::bf16})
    for (const auto& lens : kLens)
      for (int64_t W : {16, 40}) attention_case(dt, lens, W, {4, 40, 32}, rng);
}

TEST(DsaAttentionGpu, CausalAttentionForwardBackward) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Poison poison;
  Rng rng(testing::test_seed());
  for (DType dt : {DType::f32, DType::f64, DType::bf16})
    for (const auto& lens : kLens) causal_case(dt, lens, {4, 40, 32}, rng);
}

TEST(DsaAttentionGpu, AttentionTargets) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Poison poison;
  Rng rng(testing::test_seed());
  for (DType dt : {DType::f32, DType::f64, DType::bf16})
    for (const auto& lens : kLens)
      for (int64_t W : {16, 40}) target_case(dt, lens, W, {4, 40, 32}, rng);
}

// Head groups of 16 with a partial last group (H = 20), more channels than one block serves
// (d_v, D_qk > 1024: two channel blocks), key tiles shortened to fit shared memory (f64), and the
// NoPE form d_v = D_qk with an odd D_qk (rows padded to whole 16-byte packs).
TEST(DsaAttentionGpu, ManyHeadsAndWideRows) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Poison poison;
  Rng rng(testing::test_seed());
  for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
    attention_case(dt, {5, 4}, 6, {20, 48, 33}, rng);
    attention_case(dt, {5, 4}, 6, {2, 1040, 1030}, rng);
    attention_case(dt, {3, 6}, 4, {3, 25, 25}, rng);
    causal_case(dt, {5, 4}, {20, 48, 33}, rng);
    causal_case(dt, {5, 4}, {2, 1040, 1030}, rng);
    causal_case(dt, {3, 6}, {3, 25, 25}, rng);
    target_case(dt, {5, 4}, 6, {20, 48, 33}, rng);
    target_case(dt, {5, 4}, 6, {2, 1040, 1030}, rng);
  }
}

// The bf16 tensor-core forward and backward (dsa_attention_mma.cu: D_qk a multiple of 32): head
// groups of 16 (H = 2), 32 (H = 20, padded) and 64 (H = 40 padded, H = 80 in two groups), d_v a
// multiple of 16 or not, rows of more than one 64-key tile (W = 100 over documents of 130 tokens),
// and the shorter key tiles that D_qk = 576 needs at 64 heads (32 rows forward, 16 backward). The
// FMA kernels' cases above have D_qk % 32 != 0.
TEST(DsaAttentionGpu, TensorCoreForwardBackward) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Poison poison;
  Rng rng(testing::test_seed());
  const DType dt = DType::bf16;
  for (const auto& lens : kLens) attention_case(dt, lens, 40, {2, 64, 64}, rng);
  attention_case(dt, {130, 7}, 100, {20, 96, 40}, rng);
  attention_case(dt, {66, 3}, 70, {80, 32, 32}, rng);
  causal_case(dt, {1, 63, 65}, {40, 64, 48}, rng);
  causal_case(dt, {130}, {2, 32, 32}, rng);
  attention_case(dt, {9, 4}, 12, {64, 576, 512}, rng);
  causal_case(dt, {9, 4}, {64, 576, 512}, rng);
}

// Median of 3 wall times (ms) of f() and a device synchronize, after a warm-up call.
double time_ms(const std::function<void()>& f) {
  f();
  device_synchronize();
  std::vector<double> ms;
  for (int i = 0; i < 3; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    device_synchronize();
    ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[1];
}

// A real GPU only: the GLM-5.3-Flash shape (H = 64, D_qk = 576, d_v = 512) against the CPU on a
// short packed batch, then timings of the CUDA entry points (ops/cuda/dsa_attention.cuh): the
// dense causal attention on one document of T tokens, and (the selection's device pattern built
// once, timed apart) top-k 2048 random causal keys per query, bf16.
TEST(DsaAttentionGpu, GlmShapeAgreesAndTimings) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  if (cuda_emulated()) GTEST_SKIP() << "the CUDA device is the CPU emulation: large shapes skipped";
  Rng rng(testing::test_seed());
  const int64_t H = 64, D = 576, dv = 512;
  {
    Poison poison;
    for (DType dt : {DType::f32, DType::bf16}) {
      attention_case(dt, {300, 212}, 256, {H, D, dv}, rng);
      target_case(dt, {300, 212}, 256, {H, D, dv}, rng);
      causal_case(dt, {300, 212}, {H, D, dv}, rng);
    }
  }
  const double scale = 1.0 / std::sqrt(double(D));
  // The dense causal attention (no index tensor, the absorbed MLA's) on one document of T tokens.
  for (int64_t T : {4096, 8192}) {
    const std::vector<int64_t> cu{0, T};
    const ops::dsa_detail::QueryWindow win = ops::dsa_detail::whole_window(cu);
    const Tensor q = gpu(randn({T, H, D}, DType::f32, rng).to(DType::bf16));
    const Tensor kv = gpu(randn({T, D}, DType::f32, rng).to(DType::bf16));
    const Tensor dout = gpu(randn({T, H, dv}, DType::f32, rng, 0.1).to(DType::bf16));
    Tensor out = Tensor::empty({T, H, dv}, DType::bf16, Device::cuda);
    Tensor lse = Tensor::empty({T, H}, DType::f32, Device::cuda);
    Tensor dq = Tensor::empty({T, H, D}, DType::bf16, Device::cuda);
    Tensor dkv = Tensor::empty({T, D}, DType::bf16, Device::cuda);
    const double f = time_ms([&] { ops::cuda::causal_attention(q, kv, win, dv, scale, out, lse); });
    const double b = time_ms([&] {
      ops::cuda::causal_attention_backward(q, kv, win, dv, scale, out, lse, dout, dq, dkv);
    });
    const double E = double(T) * double(T + 1) / 2;
    std::printf(
        "causal attention bf16 T=%lld H=%lld D=%lld dv=%lld (%.3g entries): forward %.2f ms "
        "(%.1f TFLOP/s), backward %.2f ms\n",
        (long long)T, (long long)H, (long long)D, (long long)dv, E, f,
        2 * E * double(H) * double(D + dv) / f / 1e9, b);
  }
  for (int64_t T : {4096, 8192}) {
    const int64_t K = 2048;
    std::vector<int32_t> rv(size_t(T * K), -1), cand;
    for (int64_t t = 0; t < T; ++t) {
      cand.resize(size_t(t + 1));
      for (int64_t s = 0; s <= t; ++s) cand[size_t(s)] = int32_t(s);
      const int64_t n = std::min<int64_t>(K, t + 1);
      for (int64_t j = 0; j < n; ++j) {
        std::swap(cand[size_t(j)], cand[size_t(j) + rng.below(uint64_t(t + 1 - j))]);
        rv[size_t(t * K + j)] = cand[size_t(j)];
      }
    }
    const std::vector<int64_t> cu{0, T};
    const ops::dsa_detail::QueryWindow win = ops::dsa_detail::whole_window(cu);
    const Tensor idx = gpu(Tensor::from_vector<int32_t>({T, K}, rv));
    const auto pattern = [&] {
      return ops::cuda::device_rows_pattern(idx, cu, 1, "timing", "indices", true);
    };
    const ops::cuda::DsaPatternDev p = pattern();
    const Tensor q = gpu(randn({T, H, D}, DType::f32, rng).to(DType::bf16));
    const Tensor kv = gpu(randn({T, D}, DType::f32, rng).to(DType::bf16));
    const Tensor dout = gpu(randn({T, H, dv}, DType::f32, rng, 0.1).to(DType::bf16));
    Tensor out = Tensor::empty({T, H, dv}, DType::bf16, Device::cuda);
    Tensor lse = Tensor::empty({T, H}, DType::f32, Device::cuda);
    Tensor dq = Tensor::empty({T, H, D}, DType::bf16, Device::cuda);
    Tensor dkv = Tensor::empty({T, D}, DType::bf16, Device::cuda);
    Tensor tgt = Tensor::empty({T, K}, DType::f32, Device::cuda);
    Tensor dense = Tensor::empty({T, T}, DType::f32, Device::cuda);
    const double up = time_ms([&] { (void)pattern(); });
    const double f = time_ms([&] { ops::cuda::sparse_attention(q, kv, p, dv, scale, out, lse); });
    const double b = time_ms([&] {
      ops::cuda::sparse_attention_backward(q, kv, p, dv, scale, out, lse, dout, dq, dkv);
    });
    const double ta = time_ms([&] { ops::cuda::attention_target(q, kv, p, scale, tgt); });
    const double td = time_ms([&] { ops::cuda::attention_target_dense(q, kv, win, scale, dense); });
    const double E = double(p.entries), Hd = double(H);
    std::printf(
        "GLM shape bf16 T=%lld H=%lld D=%lld dv=%lld top-k %lld (%.3g entries): device pattern "
        "%.2f ms; forward %.2f ms (%.1f TFLOP/s), backward %.2f ms, target_at %.2f ms, dense "
        "target %.2f ms\n",
        (long long)T, (long long)H, (long long)D, (long long)dv, (long long)K, E, up, f,
        2 * E * Hd * double(D + dv) / f / 1e9, b, ta, td);
  }
}

TEST(DsaAttentionGpu, BadArgumentsThrow) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  Rng rng(testing::test_seed());
  const SeqLayout cu = SeqLayout::from_lengths({3, 2});
  const Tensor q = gpu(randn({5, 2, 8}, DType::f32, rng)), kv = gpu(randn({5, 8}, DType::f32, rng));
  const Tensor qb = gpu(randn({5, 2, 8}, DType::f32, rng).to(DType::bf16));
  const Tensor kvb = gpu(randn({5, 8}, DType::f32, rng).to(DType::bf16));
  const Tensor sel = gpu(Tensor::from_vector<int32_t>({5, 2}, {0, -1, 0, 1, 2, 1, 3, -1, 4, 3}));
  const Tensor dout = gpu(randn({5, 2, 4}, DType::f32, rng));
  EXPECT_NO_THROW(ops::sparse_attention(qb, kvb, sel, cu, 4, 0.5));
  testing::expect_error(
      [&] { ops::sparse_attention(q, kvb, sel, cu, 4, 0.5); },
      "sparse_attention: kv (the latent cache rows [T, D_qk]) must have the dtype "
      "of q");
  testing::expect_error([&] { ops::sparse_attention(q, kv.slice(1, 0, 6), sel, cu, 4, 0.5); },
                        "sparse_attention: kv");
  testing::expect_error(
      [&] {
        ops::sparse_attention(q, kv, gpu(randn({5, 2}, DType::f32, rng)), cu, 4, 0.5);
      },
      "sparse_attention: indices must be i64 or i32");
  testing::expect_error(
      [&] {
        ops::sparse_attention(q, randn({5, 8}, DType::f32, rng), sel, cu, 4, 0.5);
      },
      "must be on the device of q");
  testing::expect_error(
      [&] {
        ops::sparse_attention(gpu(randn({5, 2, 8}, DType::f32, rng).to(DType::f16)), kv, sel, cu, 4,
                              0.5);
      },
      "sparse_attention: q must be f32, f64 or bf16 on CUDA");
  const auto f = ops::sparse_attention(q, kv, sel, cu, 4, 0.5);
  const auto fb = ops::sparse_attention(qb, kvb, sel, cu, 4, 0.5);
  EXPECT_NO_THROW(ops::sparse_attention_backward(qb, kvb, sel, cu, 4, 0.5, fb.out, fb.lse,
                                                 gpu(cpu(dout).to(DType::bf16))));
  // lse is f32 next to bf16 inputs (not bf16), out and d_out go with q.
  testing::expect_error(
      [&] {
        ops::sparse_attention_backward(qb, kvb, sel, cu, 4, 0.5, fb.out,
                                       gpu(cpu(fb.lse).to(DType::bf16)),
                                       gpu(cpu(dout).to(DType::bf16)));
      },
      "sparse_attention_backward: lse must be f32");
  testing::expect_error(
      [&] { ops::sparse_attention_backward(qb, kvb, sel, cu, 4, 0.5, fb.out, fb.lse, dout); },
      "sparse_attention_backward: d_out must have the dtype of q");
  testing::expect_error(
      [&] {
        ops::sparse_attention_backward(q, kv, sel, cu, 4, 0.5, f.out, f.lse,
                                       gpu(randn({5, 2, 3}, DType::f32, rng)));
      },
      "sparse_attention_backward: d_out must have shape");
  testing::expect_error(
      [&] {
        ops::sparse_attention(q, kv, gpu(Tensor::from_vector<int32_t>({5, 1}, {0, 1, 2, 4, 3})), cu,
                              4, 0.5);
      },
      "is not a causal token");
  testing::expect_error([&] { ops::attention_target(q, kvb, cu, 0.5); },
                        "attention_target: kv (the latent cache rows [T, D_qk]) must have the "
                        "dtype of q");
  testing::expect_error([&] { ops::attention_target(q, kv, cu, 0.5, 2); },
                        "attention_target: W must be 0 or >= 3");
  testing::expect_error([&] { ops::attention_target_at(qb, kv, cu, sel, 0.5); },
                        "attention_target_at: kv");
  const auto fc = ops::causal_attention(qb, kvb, cu, 4, 0.5);
  EXPECT_NO_THROW(ops::causal_attention_backward(qb, kvb, cu, 4, 0.5, fc.out, fc.lse,
                                                 gpu(cpu(dout).to(DType::bf16))));
  testing::expect_error(
      [&] { ops::causal_attention(q, kvb, cu, 4, 0.5); },
      "causal_attention: kv (the latent cache rows [T, D_qk]) must have the dtype of q");
  testing::expect_error(
      [&] {
        ops::causal_attention(q, randn({5, 8}, DType::f32, rng), cu, 4, 0.5);
      },
      "must be on the device of q");
  testing::expect_error([&] { ops::causal_attention(q, kv, cu, 9, 0.5); },
                        "causal_attention: d_v must be in [1, D_qk = 8]");
  testing::expect_error(
      [&] {
        ops::causal_attention(q, kv, SeqLayout::from_lengths({3, 3}), 4, 0.5);
      },
      "causal_attention");
  testing::expect_error(
      [&] {
        ops::causal_attention_backward(qb, kvb, cu, 4, 0.5, fc.out,
                                       gpu(cpu(fc.lse).to(DType::bf16)),
                                       gpu(cpu(dout).to(DType::bf16)));
      },
      "causal_attention_backward: lse must be f32");
  testing::expect_error(
      [&] { ops::causal_attention_backward(qb, kvb, cu, 4, 0.5, fc.out, fc.lse, dout); },
      "causal_attention_backward: d_out must have the dtype of q");
  testing::expect_error(
      [&] { ops::causal_attention_backward(q, kv, cu, 4, 0.5, f.out, f.lse.slice(0, 0, 4), dout); },
      "causal_attention_backward: lse must have shape");
  // The CPU keeps its rules: bf16 is refused there.
  testing::expect_error([&] { ops::sparse_attention(cpu(qb), cpu(kvb), cpu(sel), cu, 4, 0.5); },
                        "sparse_attention: q must be f32 or f64");
}

}  // namespace
}  // namespace hlm
