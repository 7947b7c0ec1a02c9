// ops::rope and ops::hadamard on the CPU against independent FP64 references: RoPE by the explicit
// cos / sin rotation of each pair (interleaved and split halves, offset, factor, both angle
// modes), the Hadamard rotation by the explicit Sylvester matrix; inverse(forward(x)) == x,
// Hadamard twice == x, in place == out of place, and bad arguments refused.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/rng.h"
#include "ops/hadamard.h"
#include "ops/rope.h"
#include "testing.h"

namespace hlm {
namespace {

using testing::test_seed;

// Document-relative positions of packed documents of these lengths.
std::vector<int64_t> positions(const std::vector<int64_t>& lens) {
  std::vector<int64_t> pos;
  for (int64_t l : lens)
    for (int64_t t = 0; t < l; ++t) pos.push_back(t);
  return pos;
}

// The FP64 rotation of x [T, n, L] (any dtype): pair i of token t turned by pos[t] inv[i].
std::vector<double> rope_ref(const Tensor& x, const std::vector<int64_t>& pos,
                             const std::vector<double>& inv, const ops::RopeOptions& o) {
  const int64_t T = x.size(0), n = x.dim() == 3 ? x.size(1) : 1, L = x.size(-1);
  const int64_t half = o.rope_dim / 2;
  std::vector<double> v = x.to_f64_vector();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < n; ++h)
      for (int64_t i = 0; i < half; ++i) {
        const double ang = double(pos[size_t(t)]) * inv[size_t(i)];
        const double c = std::cos(ang) * o.factor,
                     s = (o.inverse ? -1 : 1) * std::sin(ang) * o.factor;
        const int64_t ia = o.offset + (o.interleave ? 2 * i : i);
        const int64_t ib = o.offset + (o.interleave ? 2 * i + 1 : i + half);
        double& a = v[size_t((t * n + h) * L + ia)];
        double& b = v[size_t((t * n + h) * L + ib)];
        const double a0 = a, b0 = b;
        a = a0 * c - b0 * s;
        b = a0 * s + b0 * c;
      }
  return v;
}

double max_rel(const std::vector<double>& out, const std::vector<double>& ref) {
  double m = 0, e = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    m = std::max(m, std::fabs(ref[i]));
    e = std::max(e, std::fabs(out[i] - ref[i]));
  }
  return m > 0 ? e / m : e;
}

TEST(OpsRope, MatchesExplicitRotationAndInverts) {
  Rng rng(test_seed());
  const std::vector<std::vector<int64_t>> docs = {{1}, {63}, {65}, {5, 0, 40, 17}};
  for (DType dt : {DType::f32, DType::f64})
    for (const auto& lens : docs)
      for (bool interleave : {true, false})
        for (ops::RopeAngle angle : {ops::RopeAngle::f64, ops::RopeAngle::compute}) {
          const std::vector<int64_t> pv = positions(lens);
          const int64_t T = int64_t(pv.size()), n = 3, L = 24;
          ops::RopeOptions o;
          o.offset = 6;
          o.rope_dim = 16;
          o.factor = 1.25;
          o.interleave = interleave;
          o.angle = angle;
          std::vector<double> inv(size_t(o.rope_dim / 2));
          for (size_t i = 0; i < inv.size(); ++i)
            inv[i] = std::pow(10000.0, -2.0 * double(i) / double(o.rope_dim));
          const Tensor pos = Tensor::from_vector<int64_t>({T}, pv);
          const Tensor invt = Tensor::from_vector<double>({int64_t(inv.size())}, inv);
          const Tensor x = randn({T, n, L}, dt, rng);
          const Tensor y = ops::rope(x, pos, invt, o);
          // f32: cos / sin and the products rounded to f32, angles up to ~64 rad formed in f32.
          const double tol = dt == DType::f64 ? 1e-13 : 2e-5;
          EXPECT_LE(max_rel(y.to_f64_vector(), rope_ref(x, pv, inv, o)), tol);
          // In place == out of place, bit for bit; [T, L] rows too.
          Tensor xi = x.clone();
          ops::rope_inplace(xi, pos, invt, o);
          EXPECT_TRUE(testing::bit_equal(xi, y));
          const Tensor x2 = x.view({T * n, L}).slice(0, 0, T).contiguous();
          const Tensor y2 = ops::rope(x2, pos, invt, o);
          EXPECT_LE(max_rel(y2.to_f64_vector(), rope_ref(x2, pv, inv, o)), tol);
          // Inverse undoes forward (factor^2 scales: use factor 1 for the round trip).
          ops::RopeOptions u = o;
          u.factor = 1.0;
          ops::RopeOptions ui = u;
          ui.inverse = true;
          const Tensor back = ops::rope(ops::rope(x, pos, invt, u), pos, invt, ui);
          EXPECT_LE(max_rel(back.to_f64_vector(), x.to_f64_vector()),
                    dt == DType::f64 ? 1e-14 : 1e-6);
          EXPECT_LE(max_rel(ops::rope(x, pos, invt, ui).to_f64_vector(), rope_ref(x, pv, inv, ui)),
                    tol);
        }
}

TEST(OpsRope, BadArguments) {
  Rng rng(test_seed());
  const Tensor x = randn({4, 2, 8}, DType::f32, rng);
  const Tensor pos = Tensor::from_vector<int64_t>({4}, {0, 1, 2, 0});
  const Tensor inv = Tensor::from_vector<double>({2}, {1.0, 0.1});
  ops::RopeOptions o;
  o.rope_dim = 4;
  EXPECT_NO_THROW(ops::rope(x, pos, inv, o));
  EXPECT_THROW(ops::rope(x, pos.to(DType::i32), inv, o), Error);
  EXPECT_THROW(ops::rope(x, Tensor::from_vector<int64_t>({3}, {0, 1, 2}), inv, o), Error);
  EXPECT_THROW(ops::rope(x, pos, inv.to(DType::f32), o), Error);
  EXPECT_THROW(ops::rope(x, pos, Tensor::from_vector<double>({1}, {1.0}), o), Error);
  o.offset = 6;
  EXPECT_THROW(ops::rope(x, pos, inv, o), Error);
  o.offset = 0;
  o.rope_dim = 3;
  EXPECT_THROW(ops::rope(x, pos, inv, o), Error);
  o.rope_dim = 4;
  EXPECT_THROW(ops::rope(randn({4}, DType::f32, rng), pos, inv, o), Error);
  Tensor xt = randn({8, 4}, DType::f32, rng).transpose(0, 1);
  EXPECT_THROW(ops::rope_inplace(xt, pos, inv, o), Error);
}

// The Sylvester matrix entry H_d[i][j] = (-1)^popcount(i & j).
double sylvester(int64_t i, int64_t j) {
  return __builtin_popcountll(uint64_t(i & j)) % 2 ? -1.0 : 1.0;
}

TEST(OpsHadamard, MatchesSylvesterMatrixAndIsItsOwnInverse) {
  Rng rng(test_seed());
  for (DType dt : {DType::f32, DType::f64})
    for (int64_t d : {1, 2, 8, 64, 128, 256})
      for (int64_t rows : {1, 63, 65}) {
        const Tensor x = randn({rows, d}, dt, rng);
        const Tensor y = ops::hadamard(x);
        const std::vector<double> xv = x.to_f64_vector();
        std::vector<double> ref(xv.size());
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < d; ++j) {
            double s = 0;
            for (int64_t i = 0; i < d; ++i) s += xv[size_t(r * d + i)] * sylvester(i, j);
            ref[size_t(r * d + j)] = s / std::sqrt(double(d));
          }
        const double tol = dt == DType::f64 ? 1e-13 : 2e-6 * std::log2(double(2 * d));
        EXPECT_LE(max_rel(y.to_f64_vector(), ref), tol) << "d=" << d << " rows=" << rows;
        EXPECT_LE(max_rel(ops::hadamard(y).to_f64_vector(), xv), dt == DType::f64 ? 1e-14 : 1e-5);
        Tensor xi = x.clone();
        ops::hadamard_inplace(xi);
        EXPECT_TRUE(testing::bit_equal(xi, y));
      }
  // Leading dims [T, H, d].
  const Tensor x3 = randn({5, 3, 16}, DType::f64, rng);
  EXPECT_TRUE(
      testing::bit_equal(ops::hadamard(x3).view({15, 16}), ops::hadamard(x3.view({15, 16}))));
}

TEST(OpsHadamard, BadArguments) {
  Rng rng(test_seed());
  EXPECT_THROW(ops::hadamard(randn({4, 12}, DType::f32, rng)), Error);
  EXPECT_THROW(ops::hadamard(Tensor::zeros({4, 8}, DType::i64)), Error);
  Tensor xt = randn({8, 4}, DType::f32, rng).transpose(0, 1);
  EXPECT_THROW(ops::hadamard_inplace(xt), Error);
  EXPECT_NO_THROW(ops::hadamard(xt));
}

}  // namespace
}  // namespace hlm
