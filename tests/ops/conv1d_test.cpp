// ops::causal_conv1d_*: forward against an FP64 loop reference over packed sequences (with and
// without initial state and SiLU, W = 1..5, zero-length and length-1 sequences), gradients (dx,
// dw, d initial state) against central finite differences, packed == one sequence at a time
// bit-identical, the decode step == the full conv bit-identical, final state, bad input.
#include <cmath>

#include "core/seq_layout.h"
#include "ops/conv1d.h"
#include "testing.h"

namespace hlm {
namespace {

using testing::bit_equal;
using testing::close;
using testing::dot;
using testing::grad_check;
using testing::test_seed;
using testing::tolerance_for;

Tensor minus(const Tensor& a, const Tensor& b) {
  auto va = a.to_f64_vector(), vb = b.to_f64_vector();
  for (size_t i = 0; i < va.size(); ++i) va[i] -= vb[i];
  return Tensor::from_values(a.shape(), va, DType::f64);
}

// FP64 reference, straight from the definition.
Tensor ref_conv(const Tensor& x, const Tensor& w, const std::vector<int64_t>& lens,
                const Tensor& state, bool silu) {
  const int64_t c = x.size(1), width = w.size(1);
  const auto vx = x.to_f64_vector(), vw = w.to_f64_vector();
  const auto vs = state.defined() ? state.to_f64_vector() : std::vector<double>();
  std::vector<double> y(vx.size(), 0.0);
  int64_t bos = 0;
  for (size_t n = 0; n < lens.size(); ++n) {
    for (int64_t t = 0; t < lens[n]; ++t)
      for (int64_t ch = 0; ch < c; ++ch) {
        double z = 0;
        for (int64_t j = 0; j < width; ++j) {
          const int64_t p = t - width + 1 + j;  // local position of the input
          double v = 0;
          if (p >= 0)
            v = vx[size_t((bos + p) * c + ch)];
          else if (state.defined())
            v = vs[size_t((int64_t(n) * (width - 1) + p + width - 1) * c + ch)];
          z += vw[size_t(ch * width + j)] * v;
        }
        y[size_t((bos + t) * c + ch)] = silu ? z / (1 + std::exp(-z)) : z;
      }
    bos += lens[n];
  }
  return Tensor::from_values(x.shape(), y, DType::f64);
}

int64_t total(const std::vector<int64_t>& lens) {
  int64_t s = 0;
  for (auto l : lens) s += l;
  return s;
}

TEST(OpsConv1d, ForwardMatchesFp64Reference) {
  Rng rng(test_seed());
  const std::vector<std::vector<int64_t>> layouts = {{1}, {7}, {3, 0, 1, 5}, {2, 65, 1}};
  for (DType dt : {DType::f32, DType::f64})
    for (int64_t width : {1, 2, 4, 5})
      for (const auto& lens : layouts)
        for (int with_state = 0; with_state < 2; ++with_state)
          for (int silu = 0; silu < 2; ++silu) {
            const int64_t c = 9, n = int64_t(lens.size());
            Tensor x = randn({total(lens), c}, dt, rng), w = randn({c, width}, dt, rng);
            Tensor st = with_state ? randn({n, width - 1, c}, dt, rng) : Tensor();
            const SeqLayout cu = SeqLayout::from_lengths(lens);
            Tensor y = ops::causal_conv1d_forward(x, w, cu, st, silu);
            EXPECT_TRUE(close(y, ref_conv(x, w, lens, st, silu), tolerance_for(dt)))
                << dtype_name(dt) << " W=" << width << " state=" << with_state << " silu=" << silu;
          }
}

TEST(OpsConv1d, GradientsMatchFiniteDifferences) {
  Rng rng(test_seed());
  for (int64_t width : {1, 3, 4})
    for (int silu = 0; silu < 2; ++silu) {
      const std::vector<int64_t> lens = {2, 0, 5, 1};
      const int64_t c = 3, n = int64_t(lens.size());
      Tensor x = randn({total(lens), c}, DType::f64, rng), w = randn({c, width}, DType::f64, rng);
      Tensor st = randn({n, width - 1, c}, DType::f64, rng);
      const SeqLayout cu = SeqLayout::from_lengths(lens);
      Tensor probe = randn({total(lens), c}, DType::f64, rng);
      auto loss = [&] { return dot(ops::causal_conv1d_forward(x, w, cu, st, silu), probe); };
      Tensor dw0 = randn({c, width}, DType::f64, rng);
      Tensor dw = dw0.clone();
      auto g = ops::causal_conv1d_backward(probe, x, w, cu, st, silu, dw);
      EXPECT_TRUE(grad_check(loss, x, g.dx)) << "W=" << width << " silu=" << silu;
      EXPECT_TRUE(grad_check(loss, w, minus(dw, dw0))) << "W=" << width << " silu=" << silu;
      if (width > 1) EXPECT_TRUE(grad_check(loss, st, g.dinitial_state)) << "W=" << width;
      // Without a state: same dx as with a zero state, no d state.
      Tensor dw_a = Tensor::zeros({c, width}, DType::f64), dw_b = dw_a.clone();
      auto g0 = ops::causal_conv1d_backward(probe, x, w, cu, Tensor(), silu, dw_a);
      auto gz = ops::causal_conv1d_backward(probe, x, w, cu, Tensor::zeros(st.shape(), DType::f64),
                                            silu, dw_b);
      EXPECT_FALSE(g0.dinitial_state.defined());
      EXPECT_TRUE(bit_equal(g0.dx, gz.dx));
      EXPECT_TRUE(bit_equal(dw_a, dw_b));
    }
}

TEST(OpsConv1d, PackedEqualsSequencesOneByOneBitIdentical) {
  Rng rng(test_seed());
  for (DType dt : {DType::f32, DType::f64})
    for (int silu = 0; silu < 2; ++silu) {
      const std::vector<int64_t> lens = {5, 1, 0, 17, 3};
      const int64_t c = 11, width = 4, n = int64_t(lens.size()), nt = total(lens);
      Tensor x = randn({nt, c}, dt, rng), w = randn({c, width}, dt, rng);
      Tensor st = randn({n, width - 1, c}, dt, rng), dy = randn({nt, c}, dt, rng);
      const SeqLayout cu = SeqLayout::from_lengths(lens);
      Tensor fin;
      Tensor y = ops::causal_conv1d_forward(x, w, cu, st, silu, &fin);
      Tensor dw = randn({c, width}, dt, rng), dw1 = dw.clone();
      auto g = ops::causal_conv1d_backward(dy, x, w, cu, st, silu, dw);
      int64_t bos = 0;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t len = lens[size_t(i)];
        Tensor xi = x.slice(0, bos, bos + len), dyi = dy.slice(0, bos, bos + len);
        Tensor sti = st.slice(0, i, i + 1);
        const SeqLayout cui = SeqLayout::from_lengths({len});
        Tensor fini;
        Tensor yi = ops::causal_conv1d_forward(xi, w, cui, sti, silu, &fini);
        auto gi = ops::causal_conv1d_backward(dyi, xi, w, cui, sti, silu, dw1);
        EXPECT_TRUE(bit_equal(yi, y.slice(0, bos, bos + len))) << "sequence " << i;
        EXPECT_TRUE(bit_equal(gi.dx, g.dx.slice(0, bos, bos + len))) << "sequence " << i;
        EXPECT_TRUE(bit_equal(gi.dinitial_state, g.dinitial_state.slice(0, i, i + 1)));
        EXPECT_TRUE(bit_equal(fini, fin.slice(0, i, i + 1)));
        bos += len;
      }
      EXPECT_TRUE(bit_equal(dw1, dw));  // dw accumulated sequence by sequence either way
    }
}

TEST(OpsConv1d, FinalStateAndDecodeMatchFullConv) {
  Rng rng(test_seed());
  for (DType dt : {DType::f32, DType::f64})
    for (int64_t width : {1, 2, 4})
      for (int silu = 0; silu < 2; ++silu) {
        // Prefill lengths (one shorter than W-1, one empty), then 6 decode steps each.
        const std::vector<int64_t> pre = {5, 1, 0};
        const int64_t c = 7, n = 3, steps = 6;
        Tensor w = randn({c, width}, dt, rng), st0 = randn({n, width - 1, c}, dt, rng);
        Tensor xpre = randn({total(pre), c}, dt, rng);
        std::vector<Tensor> xdec;
        for (int64_t s = 0; s < steps; ++s) xdec.push_back(randn({n, c}, dt, rng));
        // Full conv over prefill + decode tokens, one sequence each.
        std::vector<int64_t> full_lens;
        for (auto l : pre) full_lens.push_back(l + steps);
        Tensor xfull = Tensor::empty({total(full_lens), c}, dt);
        int64_t bos = 0, pbos = 0;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t lp = pre[size_t(i)];
          xfull.slice(0, bos, bos + lp).copy_(xpre.slice(0, pbos, pbos + lp));
          for (int64_t s = 0; s < steps; ++s)
            xfull.slice(0, bos + lp + s, bos + lp + s + 1)
                .copy_(xdec[size_t(s)].slice(0, i, i + 1));
          bos += lp + steps;
          pbos += lp;
        }
        Tensor yfull =
            ops::causal_conv1d_forward(xfull, w, SeqLayout::from_lengths(full_lens), st0, silu);
        Tensor state;
        ops::causal_conv1d_forward(xpre, w, SeqLayout::from_lengths(pre), st0, silu, &state);
        for (int64_t s = 0; s < steps; ++s) {
          Tensor y = ops::causal_conv1d_update(xdec[size_t(s)], state, w, silu);
          bos = 0;
          for (int64_t i = 0; i < n; ++i) {
            const int64_t t = bos + pre[size_t(i)] + s;
            EXPECT_TRUE(bit_equal(y.slice(0, i, i + 1), yfull.slice(0, t, t + 1)))
                << dtype_name(dt) << " W=" << width << " step " << s << " seq " << i;
            bos += full_lens[size_t(i)];
          }
        }
        // The rolled state equals the final state of the full conv.
        Tensor fin;
        ops::causal_conv1d_forward(xfull, w, SeqLayout::from_lengths(full_lens), st0, silu, &fin);
        EXPECT_TRUE(bit_equal(state, fin));
      }
}

// The step over a pool of states through slots: the bits of causal_conv1d_update on the gathered
// rows, written back to those rows; the pool's other rows untouched.
TEST(OpsConv1d, UpdateThroughSlotsEqualsGatheredUpdate) {
  Rng rng(test_seed());
  for (DType dt : {DType::f32, DType::f64})
    for (int64_t width : {1, 2, 4}) {
      const int64_t S = 6, c = 9;
      const std::vector<int64_t> slots = {4, 0, 5};
      const int64_t n = int64_t(slots.size());
      Tensor w = randn({c, width}, dt, rng), pool = randn({S, width - 1, c}, dt, rng);
      const Tensor pool0 = pool.clone();
      Tensor gathered = Tensor::empty({n, width - 1, c}, dt);
      for (int64_t i = 0; i < n; ++i)
        gathered.slice(0, i, i + 1).copy_(pool0.slice(0, slots[size_t(i)], slots[size_t(i)] + 1));
      for (int step = 0; step < 3; ++step) {
        const Tensor x = randn({n, c}, dt, rng);
        const Tensor want = ops::causal_conv1d_update(x, gathered, w, step != 1);
        const Tensor got = ops::causal_conv1d_update_slots(x, pool, slots, w, step != 1);
        EXPECT_TRUE(bit_equal(got, want)) << dtype_name(dt) << " W=" << width << " step " << step;
        for (int64_t i = 0; i < n; ++i)
          EXPECT_TRUE(bit_equal(pool.slice(0, slots[size_t(i)], slots[size_t(i)] + 1),
                                gathered.slice(0, i, i + 1)));
      }
      for (int64_t r : {1, 2, 3})
        EXPECT_TRUE(bit_equal(pool.slice(0, r, r + 1), pool0.slice(0, r, r + 1))) << "row " << r;
    }
}

TEST(OpsConv1d, BadInputs) {
  Rng rng(test_seed());
  Tensor x = randn({6, 4}, DType::f32, rng), w = randn({4, 3}, DType::f32, rng);
  const SeqLayout cu = SeqLayout::from_lengths({2, 4});
  EXPECT_THROW(ops::causal_conv1d_forward(x, randn({5, 3}, DType::f32, rng), cu), Error);
  EXPECT_THROW(ops::causal_conv1d_forward(x, randn({4, 0}, DType::f32, rng), cu), Error);
  EXPECT_THROW(ops::causal_conv1d_forward(x, w, SeqLayout::from_lengths({2, 3})), Error);
  EXPECT_THROW(ops::causal_conv1d_forward(x, w, SeqLayout::from_lengths({4, 4})), Error);
  EXPECT_THROW(ops::causal_conv1d_forward(x, w, cu, randn({2, 3, 4}, DType::f32, rng)), Error);
  EXPECT_THROW(ops::causal_conv1d_forward(x, w.to(DType::f64), cu), Error);
  Tensor dw = Tensor::zeros({4, 3}, DType::f32);
  EXPECT_THROW(ops::causal_conv1d_backward(randn({6, 5}, DType::f32, rng), x, w, cu, {}, false, dw),
               Error);
  Tensor state = randn({3, 2, 4}, DType::f32, rng);
  EXPECT_THROW(ops::causal_conv1d_update(randn({2, 4}, DType::f32, rng), state, w), Error);
  // Through slots: a slot outside the pool, a slot twice, a count that is not N, a pool of the
  // wrong width or dtype; the pool is left as it was.
  Tensor pool = randn({3, 2, 4}, DType::f32, rng);
  const Tensor pool0 = pool.clone();
  const Tensor x2 = randn({2, 4}, DType::f32, rng);
  EXPECT_THROW(ops::causal_conv1d_update_slots(x2, pool, {0, 3}, w), Error);
  EXPECT_THROW(ops::causal_conv1d_update_slots(x2, pool, {0, -1}, w), Error);
  EXPECT_THROW(ops::causal_conv1d_update_slots(x2, pool, {1, 1}, w), Error);
  EXPECT_THROW(ops::causal_conv1d_update_slots(x2, pool, {1}, w), Error);
  Tensor narrow = randn({3, 1, 4}, DType::f32, rng), f64 = randn({3, 2, 4}, DType::f64, rng);
  EXPECT_THROW(ops::causal_conv1d_update_slots(x2, narrow, {0, 1}, w), Error);
  EXPECT_THROW(ops::causal_conv1d_update_slots(x2, f64, {0, 1}, w), Error);
  EXPECT_TRUE(bit_equal(pool, pool0));
}

}  // namespace
}  // namespace hlm
