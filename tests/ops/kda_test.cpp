// Tests of the KDA core op: kda_chunk against the FP64 recurrence (forward and every gradient),
// both backwards against central finite differences, packed == one by one (bit-identical),
// determinism, the lower-bound gate over long chunks, the front door's outputs (every element
// written) and argument checks.
#include <cmath>

#include "ops/dispatch.h"
#include "ops/kda.h"
#include "testing.h"

namespace hlm {
namespace {

using ops::KdaArgs;
using ops::KdaGateKind;

struct Problem {
  KdaArgs a;
  Tensor d_o, dht;
};

// Realistic magnitudes: l2-normalised q, k; beta in (0.05, 0.95); g in (-5, 0) skewed to 0.
Problem make_problem(Rng& rng, const std::vector<int64_t>& cu, int64_t H, int64_t HV, int64_t K,
                     int64_t V, DType dt, bool h0, bool fused = false) {
  const int64_t T = cu.back(), N = int64_t(cu.size()) - 1;
  Problem p;
  auto unit = [&](const Shape& s) { return testing::randn_unit_rows(s, dt, rng); };
  if (fused) {
    p.a.q = randn({T, H, K}, dt, rng);
    p.a.k = randn({T, H, K}, dt, rng);
    p.a.use_qk_l2norm = true;
    p.a.beta = randn({T, HV}, dt, rng);
    p.a.beta_logits = true;
    p.a.g = randn({T, HV, K}, dt, rng);
    p.a.gate = KdaGateKind::lower_bound;
    p.a.A_log = rand_uniform({HV}, DType::f32, rng, -0.5, 0.5);
    p.a.dt_bias = rand_uniform({HV * K}, DType::f32, rng, -1, 1);
  } else {
    p.a.q = unit({T, H, K});
    p.a.k = unit({T, H, K});
    p.a.beta = rand_uniform({T, HV}, dt, rng, 0.05, 0.95);
    Tensor u = rand_uniform({T, HV, K}, DType::f64, rng, 0, 1);
    double* ud = u.data<double>();
    for (int64_t i = 0; i < u.numel(); ++i) ud[i] = -5.0 * ud[i] * ud[i] * ud[i] - 1e-3;
    p.a.g = u.to(dt);
  }
  p.a.v = randn({T, HV, V}, dt, rng);
  if (h0) p.a.initial_state = randn({N, HV, K, V}, dt == DType::f64 ? dt : DType::f32, rng, 0.5);
  p.a.seqs = SeqLayout::from_offsets(cu, T);
  p.d_o = randn({T, HV, V}, dt, rng);
  p.dht = randn({N, HV, K, V}, dt, rng);
  return p;
}

::testing::AssertionResult rel_close(const Tensor& out, const Tensor& ref, double rel,
                                     const char* what) {
  if (!out.defined() || !ref.defined())
    return ::testing::AssertionFailure() << what << ": undefined";
  auto r = testing::close(out, ref, {rel, 1e30});
  if (!r) r << " [" << what << "]";
  return r;
}

void expect_grads_close(const ops::KdaGrads& g, const ops::KdaGrads& ref, double rel) {
  EXPECT_TRUE(rel_close(g.dq, ref.dq, rel, "dq"));
  EXPECT_TRUE(rel_close(g.dk, ref.dk, rel, "dk"));
  EXPECT_TRUE(rel_close(g.dv, ref.dv, rel, "dv"));
  EXPECT_TRUE(rel_close(g.dg, ref.dg, rel, "dg"));
  EXPECT_TRUE(rel_close(g.dbeta, ref.dbeta, rel, "dbeta"));
  EXPECT_TRUE(rel_close(g.dinitial_state, ref.dinitial_state, rel, "dinitial_state"));
  if (ref.dA_log.defined()) {
    EXPECT_TRUE(rel_close(g.dA_log, ref.dA_log, rel * 10, "dA_log"));
    EXPECT_TRUE(rel_close(g.ddt_bias, ref.ddt_bias, rel * 10, "ddt_bias"));
  }
}

void chunk_vs_recurrent(DType dt, bool h0, bool fused, double rel) {
  Rng rng(testing::test_seed());
  // Sequences of 100, 0, 1, 64, 130 tokens; GVA with 2 value heads per qk head; K != V.
  Problem p = make_problem(rng, {0, 100, 100, 101, 165, 295}, 2, 4, 32, 24, dt, h0, fused);
  auto ref = ops::kda_recurrent(p.a);
  auto out = ops::kda_chunk(p.a);
  EXPECT_EQ(out.o.dtype(), dt);
  EXPECT_TRUE(rel_close(out.o, ref.o, rel, "o"));
  EXPECT_TRUE(rel_close(out.final_state, ref.final_state, rel, "final_state"));
  auto gref = ops::kda_recurrent_backward(p.a, p.d_o, p.dht);
  auto g = ops::kda_chunk_backward(p.a, p.d_o, p.dht);
  expect_grads_close(g, gref, rel);
}

TEST(KdaChunk, MatchesRecurrentF32) {
  chunk_vs_recurrent(DType::f32, false, false, 1e-5);
}
TEST(KdaChunk, MatchesRecurrentF32InitialState) {
  chunk_vs_recurrent(DType::f32, true, false, 1e-5);
}
TEST(KdaChunk, MatchesRecurrentF64) {
  chunk_vs_recurrent(DType::f64, true, false, 1e-12);
}
TEST(KdaChunk, MatchesRecurrentF64NoState) {
  chunk_vs_recurrent(DType::f64, false, false, 1e-12);
}
TEST(KdaChunk, FusedPreprocessMatchesRecurrentF32) {
  chunk_vs_recurrent(DType::f32, true, true, 1e-5);
}
TEST(KdaChunk, FusedPreprocessMatchesRecurrentF64) {
  chunk_vs_recurrent(DType::f64, true, true, 1e-12);
}

// Single long sequence, K = V = 64, scale given explicitly, T not a multiple of 64.
TEST(KdaChunk, MatchesRecurrentLongSequence) {
  Rng rng(testing::test_seed());
  Problem p = make_problem(rng, {0, 333}, 1, 1, 64, 64, DType::f32, true);
  p.a.scale = 0.3;
  auto ref = ops::kda_recurrent(p.a);
  auto out = ops::kda_chunk(p.a);
  EXPECT_TRUE(rel_close(out.o, ref.o, 1e-5, "o"));
  EXPECT_TRUE(rel_close(out.final_state, ref.final_state, 1e-5, "final_state"));
  expect_grads_close(ops::kda_chunk_backward(p.a, p.d_o, p.dht),
                     ops::kda_recurrent_backward(p.a, p.d_o, p.dht), 1e-5);
}

// Finite differences of L = <o, w_o> + <S_final, w_s> for every input.
void grad_check_impl(bool chunk, bool fused) {
  Rng rng(testing::test_seed());
  std::vector<int64_t> cu =
      chunk ? std::vector<int64_t>{0, 70, 71, 90} : std::vector<int64_t>{0, 3, 3, 8};
  Problem p = make_problem(rng, cu, 1, 2, 3, 2, DType::f64, true, fused);
  auto fwd = [&]() { return chunk ? ops::kda_chunk(p.a) : ops::kda_recurrent(p.a); };
  auto loss = [&]() {
    auto o = fwd();
    return testing::dot(o.o, p.d_o) + testing::dot(o.final_state, p.dht);
  };
  auto g = chunk ? ops::kda_chunk_backward(p.a, p.d_o, p.dht)
                 : ops::kda_recurrent_backward(p.a, p.d_o, p.dht);
  EXPECT_TRUE(testing::grad_check(loss, p.a.q, g.dq, 1e-6, 1e-6)) << "dq";
  EXPECT_TRUE(testing::grad_check(loss, p.a.k, g.dk, 1e-6, 1e-6)) << "dk";
  EXPECT_TRUE(testing::grad_check(loss, p.a.v, g.dv, 1e-6, 1e-6)) << "dv";
  EXPECT_TRUE(testing::grad_check(loss, p.a.g, g.dg, 1e-6, 1e-6)) << "dg";
  EXPECT_TRUE(testing::grad_check(loss, p.a.beta, g.dbeta, 1e-6, 1e-6)) << "dbeta";
  EXPECT_TRUE(testing::grad_check(loss, p.a.initial_state, g.dinitial_state, 1e-6, 1e-6))
      << "dinitial_state";
  if (fused) {
    p.a.A_log = p.a.A_log.to(DType::f64);
    p.a.dt_bias = p.a.dt_bias.to(DType::f64);
    auto g2 = chunk ? ops::kda_chunk_backward(p.a, p.d_o, p.dht)
                    : ops::kda_recurrent_backward(p.a, p.d_o, p.dht);
    EXPECT_TRUE(testing::grad_check(loss, p.a.A_log, g2.dA_log, 1e-6, 1e-6)) << "dA_log";
    EXPECT_TRUE(testing::grad_check(loss, p.a.dt_bias, g2.ddt_bias, 1e-6, 1e-6)) << "ddt_bias";
  }
}

TEST(KdaRecurrent, GradCheck) {
  grad_check_impl(false, false);
}
TEST(KdaRecurrent, GradCheckFused) {
  grad_check_impl(false, true);
}
TEST(KdaChunk, GradCheck) {
  grad_check_impl(true, false);
}
TEST(KdaChunk, GradCheckFused) {
  grad_check_impl(true, true);
}

// A packed batch gives bit-identical results to its sequences run one at a time.
TEST(KdaChunk, PackedEqualsSequential) {
  Rng rng(testing::test_seed());
  const std::vector<int64_t> cu{0, 65, 66, 200};
  for (DType dt : {DType::f32, DType::f64}) {
    Problem p = make_problem(rng, cu, 2, 2, 16, 8, dt, true);
    auto out = ops::kda_chunk(p.a);
    auto g = ops::kda_chunk_backward(p.a, p.d_o, p.dht);
    for (size_t n = 0; n + 1 < cu.size(); ++n) {
      const int64_t b = cu[n], e = cu[n + 1];
      KdaArgs s;
      s.q = p.a.q.slice(0, b, e).contiguous();
      s.k = p.a.k.slice(0, b, e).contiguous();
      s.v = p.a.v.slice(0, b, e).contiguous();
      s.g = p.a.g.slice(0, b, e).contiguous();
      s.beta = p.a.beta.slice(0, b, e).contiguous();
      s.initial_state = p.a.initial_state.slice(0, int64_t(n), int64_t(n) + 1).contiguous();
      auto so = ops::kda_chunk(s);
      EXPECT_TRUE(testing::bit_equal(so.o, out.o.slice(0, b, e)));
      EXPECT_TRUE(
          testing::bit_equal(so.final_state, out.final_state.slice(0, int64_t(n), int64_t(n) + 1)));
      auto sg = ops::kda_chunk_backward(s, p.d_o.slice(0, b, e).contiguous(),
                                        p.dht.slice(0, int64_t(n), int64_t(n) + 1).contiguous());
      EXPECT_TRUE(testing::bit_equal(sg.dq, g.dq.slice(0, b, e)));
      EXPECT_TRUE(testing::bit_equal(sg.dk, g.dk.slice(0, b, e)));
      EXPECT_TRUE(testing::bit_equal(sg.dv, g.dv.slice(0, b, e)));
      EXPECT_TRUE(testing::bit_equal(sg.dg, g.dg.slice(0, b, e)));
      EXPECT_TRUE(testing::bit_equal(sg.dbeta, g.dbeta.slice(0, b, e)));
      EXPECT_TRUE(testing::bit_equal(sg.dinitial_state,
                                     g.dinitial_state.slice(0, int64_t(n), int64_t(n) + 1)));
    }
  }
}

TEST(KdaChunk, Deterministic) {
  Rng rng(testing::test_seed());
  Problem p = make_problem(rng, {0, 150, 300}, 2, 4, 32, 32, DType::f32, true);
  auto o1 = ops::kda_chunk(p.a), o2 = ops::kda_chunk(p.a);
  EXPECT_TRUE(testing::bit_equal(o1.o, o2.o));
  EXPECT_TRUE(testing::bit_equal(o1.final_state, o2.final_state));
  auto g1 = ops::kda_chunk_backward(p.a, p.d_o, p.dht),
       g2 = ops::kda_chunk_backward(p.a, p.d_o, p.dht);
  EXPECT_TRUE(testing::bit_equal(g1.dq, g2.dq));
  EXPECT_TRUE(testing::bit_equal(g1.dk, g2.dk));
  EXPECT_TRUE(testing::bit_equal(g1.dg, g2.dg));
  EXPECT_TRUE(testing::bit_equal(g1.dbeta, g2.dbeta));
}

// The training-pair overloads on the CPU: nothing is saved (the saved intermediates are a CUDA
// feature), the results are those of the plain calls, and a backward handed "saved" CPU data
// refuses it.
TEST(KdaChunk, SavedOverloadsOnTheCpu) {
  Rng rng(testing::test_seed());
  Problem p = make_problem(rng, {0, 150, 220}, 1, 2, 32, 32, DType::f32, true);
  Tensor saved = Tensor::zeros({4}, DType::f32);
  const auto o1 = ops::kda_chunk(p.a, &saved), o2 = ops::kda_chunk(p.a);
  EXPECT_FALSE(saved.defined());
  EXPECT_TRUE(testing::bit_equal(o1.o, o2.o));
  EXPECT_TRUE(testing::bit_equal(o1.final_state, o2.final_state));
  const auto g1 = ops::kda_chunk_backward(p.a, p.d_o, p.dht, Tensor()),
             g2 = ops::kda_chunk_backward(p.a, p.d_o, p.dht);
  EXPECT_TRUE(testing::bit_equal(g1.dq, g2.dq));
  EXPECT_TRUE(testing::bit_equal(g1.dg, g2.dg));
  EXPECT_THROW(ops::kda_chunk_backward(p.a, p.d_o, p.dht, Tensor::zeros({4}, DType::f32)), Error);
}

// Lower-bound gate at its floor over long chunks: G reaches about -320 inside a chunk. No
// overflow, no NaN, and the chunked result still matches the recurrence.
TEST(KdaChunk, LowerBoundFloorNoOverflow) {
  Rng rng(testing::test_seed());
  Problem p = make_problem(rng, {0, 200}, 2, 2, 32, 32, DType::f32, true, true);
  p.a.g = rand_uniform({200, 2, 32}, DType::f32, rng, 20, 40);  // sigmoid ~ 1: g ~ -5
  auto ref = ops::kda_recurrent(p.a);
  auto out = ops::kda_chunk(p.a);
  for (double x : out.o.to_f64_vector()) ASSERT_TRUE(std::isfinite(x));
  EXPECT_TRUE(rel_close(out.o, ref.o, 1e-5, "o"));
  EXPECT_TRUE(rel_close(out.final_state, ref.final_state, 1e-5, "final_state"));
  auto g = ops::kda_chunk_backward(p.a, p.d_o, p.dht);
  for (const Tensor* t :
       {&g.dq, &g.dk, &g.dv, &g.dg, &g.dbeta, &g.dinitial_state, &g.dA_log, &g.ddt_bias})
    for (double x : t->to_f64_vector()) ASSERT_TRUE(std::isfinite(x));
  auto gref = ops::kda_recurrent_backward(p.a, p.d_o, p.dht);
  EXPECT_TRUE(rel_close(g.dq, gref.dq, 1e-5, "dq"));
  EXPECT_TRUE(rel_close(g.dk, gref.dk, 1e-5, "dk"));
  EXPECT_TRUE(rel_close(g.dv, gref.dv, 1e-5, "dv"));
  EXPECT_TRUE(rel_close(g.dbeta, gref.dbeta, 1e-5, "dbeta"));
  EXPECT_TRUE(rel_close(g.dinitial_state, gref.dinitial_state, 1e-5, "dinitial_state"));
  // g is saturated: dz is ~0 everywhere; compare absolutely.
  EXPECT_TRUE(testing::close(g.dg, gref.dg, {1, 1e-6}));
}

// Strong decays without the fused gate (raw g near -5 everywhere, long chunks).
TEST(KdaChunk, StrongDecayRawGate) {
  Rng rng(testing::test_seed());
  Problem p = make_problem(rng, {0, 200}, 1, 1, 16, 16, DType::f32, true);
  p.a.g = rand_uniform({200, 1, 16}, DType::f32, rng, -5, -4.9);
  auto out = ops::kda_chunk(p.a);
  auto ref = ops::kda_recurrent(p.a);
  EXPECT_TRUE(rel_close(out.o, ref.o, 1e-5, "o"));
  auto g = ops::kda_chunk_backward(p.a, p.d_o, p.dht);
  auto gref = ops::kda_recurrent_backward(p.a, p.d_o, p.dht);
  EXPECT_TRUE(rel_close(g.dq, gref.dq, 1e-5, "dq"));
  EXPECT_TRUE(rel_close(g.dk, gref.dk, 1e-5, "dk"));
  EXPECT_TRUE(rel_close(g.dv, gref.dv, 1e-5, "dv"));
  EXPECT_TRUE(rel_close(g.dbeta, gref.dbeta, 1e-5, "dbeta"));
  EXPECT_TRUE(rel_close(g.dinitial_state, gref.dinitial_state, 1e-5, "dinitial_state"));
  // dg is a reverse cumsum of terms of both signs that nearly cancel under strong decay:
  // f32 rounding of the summands shows at ~1.5e-5 relative.
  EXPECT_TRUE(rel_close(g.dg, gref.dg, 5e-5, "dg"));
}

TEST(KdaChunk, LengthOneAndEmpty) {
  Rng rng(testing::test_seed());
  Problem p = make_problem(rng, {0, 0, 1, 1}, 1, 1, 8, 4, DType::f64, true);
  auto out = ops::kda_chunk(p.a);
  auto ref = ops::kda_recurrent(p.a);
  EXPECT_TRUE(rel_close(out.o, ref.o, 1e-12, "o"));
  EXPECT_TRUE(rel_close(out.final_state, ref.final_state, 1e-12, "final_state"));
  // An empty sequence passes its state through.
  EXPECT_TRUE(testing::bit_equal(out.final_state.select(0, 0), p.a.initial_state.select(0, 0)));
  auto g = ops::kda_chunk_backward(p.a, p.d_o, p.dht);
  EXPECT_TRUE(testing::bit_equal(g.dinitial_state.select(0, 2), p.dht.select(0, 2)));
  expect_grads_close(g, ops::kda_recurrent_backward(p.a, p.d_o, p.dht), 1e-12);
}

// The front door allocates every output (ops/dispatch.h: NaN-poisoned while the test hook is on)
// and the references write them all: with the hook on, every output and gradient (the fused
// gate's dA_log and d dt_bias included) has the bits of a run with the hook off.
TEST(KdaOp, EveryOutputWritten) {
  Rng rng(testing::test_seed());
  for (DType dt : {DType::f32, DType::f64}) {
    Problem p = make_problem(rng, {0, 70, 71, 200}, 1, 2, 16, 8, dt, true, true);
    const auto o = ops::kda_chunk(p.a), ro = ops::kda_recurrent(p.a);
    const auto g = ops::kda_chunk_backward(p.a, p.d_o, p.dht);
    const auto rg = ops::kda_recurrent_backward(p.a, p.d_o, p.dht);
    ops::set_poison_outputs(true);
    const auto o2 = ops::kda_chunk(p.a), ro2 = ops::kda_recurrent(p.a);
    const auto g2 = ops::kda_chunk_backward(p.a, p.d_o, p.dht);
    const auto rg2 = ops::kda_recurrent_backward(p.a, p.d_o, p.dht);
    ops::set_poison_outputs(false);
    for (auto [x, y] : {std::pair{&o.o, &o2.o},
                        {&o.final_state, &o2.final_state},
                        {&ro.o, &ro2.o},
                        {&ro.final_state, &ro2.final_state}})
      EXPECT_TRUE(testing::bit_equal(*x, *y)) << dtype_name(dt);
    for (auto [x, y] : {std::pair{&g, &g2}, {&rg, &rg2}})
      for (auto f : {&ops::KdaGrads::dq, &ops::KdaGrads::dk, &ops::KdaGrads::dv, &ops::KdaGrads::dg,
                     &ops::KdaGrads::dbeta, &ops::KdaGrads::dinitial_state, &ops::KdaGrads::dA_log,
                     &ops::KdaGrads::ddt_bias}) {
        ASSERT_TRUE((x->*f).defined());
        EXPECT_TRUE(testing::bit_equal(x->*f, y->*f)) << dtype_name(dt);
      }
  }
}

TEST(KdaOp, BadInputs) {
  Rng rng(testing::test_seed());
  Problem p = make_problem(rng, {0, 5, 10}, 1, 2, 4, 4, DType::f32, true);
  auto bad = [&](auto mutate) {
    KdaArgs a = p.a;
    mutate(a);
    EXPECT_THROW(ops::kda_chunk(a), Error);
    EXPECT_THROW(ops::kda_recurrent(a), Error);
    EXPECT_THROW(ops::kda_chunk_backward(a, p.d_o, p.dht), Error);
    EXPECT_THROW(ops::kda_recurrent_backward(a, p.d_o, p.dht), Error);
  };
  // Layouts that do not cover the T = 10 tokens (malformed offsets are rejected when the layout
  // is built: tests/core/seq_layout_test.cpp).
  bad([](KdaArgs& a) { a.seqs = SeqLayout::from_lengths({5, 4}); });
  bad([](KdaArgs& a) { a.seqs = SeqLayout::from_lengths({5, 6}); });
  bad([](KdaArgs& a) { a.seqs = SeqLayout::single(0); });
  bad([](KdaArgs& a) { a.k = a.k.slice(2, 0, 3).contiguous(); });
  bad([](KdaArgs& a) { a.v = a.v.slice(0, 0, 9).contiguous(); });
  bad([](KdaArgs& a) { a.g = a.g.slice(1, 0, 1).contiguous(); });
  bad([](KdaArgs& a) { a.beta = Tensor::zeros({10, 3}, DType::f32); });
  bad([](KdaArgs& a) { a.initial_state = Tensor::zeros({3, 2, 4, 4}, DType::f32); });
  bad([](KdaArgs& a) { a.q = a.q.to(DType::f64); });
  bad([](KdaArgs& a) {  // HV = 3 is not a multiple of H = 2
    a.q = Tensor::zeros({10, 2, 4}, DType::f32);
    a.k = a.q;
    a.v = Tensor::zeros({10, 3, 4}, DType::f32);
  });
  bad([](KdaArgs& a) {
    a.gate = KdaGateKind::lower_bound;
    a.lower_bound = -6;
  });
  bad([](KdaArgs& a) {
    a.gate = KdaGateKind::lower_bound;
    a.lower_bound = 0;
  });
  bad([](KdaArgs& a) { a.gate = KdaGateKind::standard; });  // no A_log
  EXPECT_THROW(ops::kda_chunk_backward(p.a, p.d_o.slice(0, 0, 9), p.dht), Error);
  EXPECT_THROW(ops::kda_recurrent_backward(p.a, p.d_o, p.dht.slice(0, 0, 1)), Error);
  EXPECT_THROW(ops::kda_chunk_backward(p.a, Tensor(), p.dht), Error);  // no d_o
  const Tensor d_o_int = Tensor::zeros(p.d_o.shape(), DType::i64);     // not floating point
  EXPECT_THROW(ops::kda_chunk_backward(p.a, d_o_int, p.dht), Error);
  EXPECT_THROW(ops::kda_recurrent_backward(p.a, d_o_int, p.dht), Error);
}

}  // namespace
}  // namespace hlm
