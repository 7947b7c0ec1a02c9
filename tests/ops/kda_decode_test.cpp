// KDA decode step vs the FP64 recurrence (ops::kda_recurrent): several steps of decode equal the
// recurrence over the same tokens, with GVA, the fused L2 norm and a state pool.
#include <gtest/gtest.h>

#include <cmath>

#include "ops/kda.h"
#include "ops/kda_decode.h"
#include "testing.h"

namespace hlm {
namespace {

struct Case {
  int64_t N, H, HV, K, V, steps;
  bool l2norm;
};

// Random decode inputs for `steps` tokens of N sequences, token-major: [steps, N, ...].
struct Inputs {
  Tensor q, k, v, g, beta, h0;
};
Inputs make(const Case& c, Rng& rng) {
  Inputs in;
  in.q = randn({c.steps, c.N, c.H, c.K}, DType::f32, rng);
  in.k = randn({c.steps, c.N, c.H, c.K}, DType::f32, rng);
  if (!c.l2norm) {  // the op expects normalised keys without the fused norm
    for (Tensor* t : {&in.q, &in.k}) {
      Tensor x = *t;
      float* p = x.data<float>();
      for (int64_t r = 0; r < x.numel() / c.K; ++r) {
        double s = 0;
        for (int64_t i = 0; i < c.K; ++i) s += double(p[r * c.K + i]) * p[r * c.K + i];
        for (int64_t i = 0; i < c.K; ++i) p[r * c.K + i] = float(p[r * c.K + i] / std::sqrt(s));
      }
    }
  }
  in.v = randn({c.steps, c.N, c.HV, c.V}, DType::f32, rng);
  in.g = rand_uniform({c.steps, c.N, c.HV, c.K}, DType::f32, rng, -2.0, -0.01);
  in.beta = rand_uniform({c.steps, c.N, c.HV}, DType::f32, rng, 0.05, 0.95);
  in.h0 = randn({c.N, c.HV, c.K, c.V}, DType::f32, rng, 0.3);
  return in;
}

// The same tokens as packed sequences for kda_recurrent: sequence n = tokens (0..steps-1, n).
Tensor pack(const Tensor& x) {  // [steps, N, ...] -> [N * steps, ...]
  Shape s = x.shape();
  Tensor t = x.transpose(0, 1).contiguous();
  s.erase(s.begin());
  s[0] = x.size(0) * x.size(1);
  return t.view(s);
}

void run_case(const Case& c) {
  Rng rng(testing::test_seed() + uint64_t(c.K * 7 + c.HV));
  Inputs in = make(c, rng);
  // Decode, step by step.
  ops::KdaDecodeArgs d;
  d.state = in.h0.clone();
  d.use_qk_l2norm = c.l2norm;
  std::vector<Tensor> outs;
  for (int64_t t = 0; t < c.steps; ++t) {
    d.q = in.q.select(0, t).contiguous();
    d.k = in.k.select(0, t).contiguous();
    d.v = in.v.select(0, t).contiguous();
    d.g = in.g.select(0, t).contiguous();
    d.beta = in.beta.select(0, t).contiguous();
    outs.push_back(ops::kda_decode_step(d));
  }
  // The FP64 recurrence over the packed tokens.
  ops::KdaArgs r;
  r.q = pack(in.q), r.k = pack(in.k), r.v = pack(in.v), r.g = pack(in.g), r.beta = pack(in.beta);
  r.initial_state = in.h0;
  r.use_qk_l2norm = c.l2norm;
  std::vector<int64_t> cu(size_t(c.N + 1));
  for (int64_t n = 0; n <= c.N; ++n) cu[size_t(n)] = n * c.steps;
  r.seqs = SeqLayout::from_offsets(cu, c.N * c.steps);
  ops::KdaOutput ref = ops::kda_recurrent(r);
  for (int64_t t = 0; t < c.steps; ++t) {
    Tensor ref_t = ref.o.view({c.N, c.steps, c.HV, c.V}).select(1, t);
    EXPECT_TRUE(testing::close(outs[size_t(t)], ref_t, testing::tolerance_for(DType::f32)))
        << "step " << t;
  }
  EXPECT_TRUE(testing::close(d.state, ref.final_state, testing::tolerance_for(DType::f32)));
}

TEST(KdaDecode, StepsEqualTheFp64Recurrence) {
  run_case({3, 2, 2, 32, 24, 5, false});
  run_case({2, 1, 3, 64, 40, 4, true});  // GVA, fused L2 norm
}

TEST(KdaDecode, StatePoolSlotsAndSkips) {
  Rng rng(testing::test_seed());
  const int64_t N = 3, H = 2, K = 32, V = 16, P = 5;
  Tensor pool = randn({P, H, K, V}, DType::f32, rng, 0.3);
  ops::KdaDecodeArgs d;
  d.q = randn({N, H, K}, DType::f32, rng), d.k = randn({N, H, K}, DType::f32, rng);
  d.v = randn({N, H, V}, DType::f32, rng);
  d.g = rand_uniform({N, H, K}, DType::f32, rng, -1, -0.1);
  d.beta = rand_uniform({N, H}, DType::f32, rng, 0.1, 0.9);
  d.use_qk_l2norm = true;
  d.state = pool.clone();
  d.state_indices = Tensor::from_vector<int32_t>({N}, {4, -1, 1});
  Tensor o = ops::kda_decode_step(d);
  // Sequence 0 used slot 4, sequence 2 slot 1; sequence 1 was skipped; other slots untouched.
  for (int64_t n : {0, 2}) {
    const int64_t slot = n == 0 ? 4 : 1;
    ops::KdaDecodeArgs one = d;
    one.q = d.q.slice(0, n, n + 1).contiguous(), one.k = d.k.slice(0, n, n + 1).contiguous();
    one.v = d.v.slice(0, n, n + 1).contiguous(), one.g = d.g.slice(0, n, n + 1).contiguous();
    one.beta = d.beta.slice(0, n, n + 1).contiguous();
    one.state = pool.slice(0, slot, slot + 1).clone();
    one.state_indices = Tensor();
    Tensor o1 = ops::kda_decode_step(one);
    EXPECT_TRUE(testing::bit_equal(o.slice(0, n, n + 1).contiguous(), o1));
    EXPECT_TRUE(testing::bit_equal(d.state.slice(0, slot, slot + 1).contiguous(), one.state));
  }
  for (double x : o.select(0, 1).to_f64_vector()) EXPECT_EQ(x, 0.0);
  for (int64_t s : {0, 2, 3})
    EXPECT_TRUE(
        testing::bit_equal(d.state.select(0, s).contiguous(), pool.select(0, s).contiguous()));
  d.state_indices = Tensor::from_vector<int32_t>({N}, {1, 1, 2});
  EXPECT_THROW(ops::kda_decode_step(d), Error);  // a slot used twice
  d.state_indices = Tensor::from_vector<int32_t>({N}, {0, 5, 2});
  EXPECT_THROW(ops::kda_decode_step(d), Error);  // outside the pool
}

}  // namespace
}  // namespace hlm
