// DsaIndexer (layers/dsa/indexer.h): scores against a naive FP64 loop written here (projections,
// LayerNorm, RoPE, an explicit Sylvester Hadamard matrix, KPool pooling, weighted ReLU head sum),
// selection against a brute-force ranking as sets, every parameter gradient of the KL loss against
// central finite differences (dense warm-up and sparse stage, with and without KPool and RoPE),
// packed batch == documents, precision flags, keep-in-FP32 of ape, and bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <iostream>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "core/rng.h"
#include "core/seq_layout.h"
#include "layers/dsa/indexer.h"
#include "ops/dsa_indexer_loss.h"
#include "testing.h"

namespace hlm {
namespace {

using hlm::testing::cu_of;
using hlm::testing::expect_error;
using hlm::testing::total;

using hlm::testing::bit_equal;
using hlm::testing::grad_check;
using hlm::testing::test_seed;
using Vec = std::vector<double>;

IndexerConfig tiny_config(int64_t P, int64_t rope, DType dt, int64_t K) {
  IndexerConfig c;
  c.hidden_size = 6;
  c.q_lora_rank = 5;
  c.n_heads = 3;
  c.head_dim = 8;
  c.topk = K;
  c.rope_dim = rope;
  c.rope_theta = 50.0;  // large angles at small positions
  c.kpool = P;
  c.dtype = dt;
  c.seed = 7;
  return c;
}

PrecisionPolicy native_policy() {
  PrecisionPolicy p;
  p.default_kind = GemmKind::native;
  return p;
}

// Fresh random values for every parameter, scaled so that the ReLU, LayerNorm, gate softmax and
// the KL all see O(1) inputs.
void randomize(DsaIndexer& m, Rng& rng) {
  for (auto& [name, p] : m.named_parameters()) {
    Tensor v = randn(p->value.shape(), DType::f64, rng, 0.6);
    if (name == "k_norm.weight") {
      auto x = v.to_f64_vector();
      for (auto& e : x) e = 1.0 + 0.5 * e;
      v = Tensor::from_values(v.shape(), x, DType::f64);
    }
    p->value = v.to(p->value.dtype());
  }
}

// ---- the naive FP64 reference --------------------------------------------------------------

struct Naive {
  Vec q;       // [T, H, d] after RoPE and Hadamard
  Vec k;       // [T, d]: P = 1 final keys; P > 1 LayerNorm + RoPE keys before pooling
  Vec pooled;  // [NP, d] after Hadamard (P > 1)
  Vec w;       // [T, H]
  Vec scores;  // dense layout [T, W], -inf outside the causal candidates
  int64_t W = 0;
};

Vec param(DsaIndexer& m, const std::string& name) {
  Param* p = m.find_parameter(name);
  EXPECT_NE(p, nullptr) << name;
  return p->value.to_f64_vector();
}

// y [T, N] = x [T, K] W [N, K]^T
Vec matmul_t(const Vec& x, const Vec& W, int64_t T, int64_t K, int64_t N) {
  Vec y(size_t(T * N), 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k)
        y[size_t(t * N + n)] += x[size_t(t * K + k)] * W[size_t(n * K + k)];
  return y;
}

// Rotates pairs of one vector v[0, d) by position pos.
void naive_rope(double* v, int64_t pos, int64_t dr, double theta, bool interleave) {
  for (int64_t i = 0; i < dr / 2; ++i) {
    const double ang = double(pos) / std::pow(theta, double(2 * i) / double(dr));
    const int64_t a = interleave ? 2 * i : i, b = interleave ? 2 * i + 1 : i + dr / 2;
    const double x = v[a], y = v[b];
    v[a] = std::cos(ang) * x - std::sin(ang) * y;
    v[b] = std::sin(ang) * x + std::cos(ang) * y;
  }
}

// The explicit normalised Sylvester matrix: Hd[i][j] = (-1)^popcount(i & j) / sqrt(d).
Vec hadamard_matrix(int64_t d) {
  Vec m(size_t(d * d));
  for (int64_t i = 0; i < d; ++i)
    for (int64_t j = 0; j < d; ++j)
      m[size_t(i * d + j)] =
          (__builtin_popcountll(uint64_t(i & j)) % 2 ? -1.0 : 1.0) / std::sqrt(double(d));
  return m;
}

void apply_matrix(double* v, const Vec& M, int64_t d) {
  Vec out(size_t(d), 0.0);
  for (int64_t i = 0; i < d; ++i)
    for (int64_t j = 0; j < d; ++j) out[size_t(i)] += M[size_t(i * d + j)] * v[j];
  std::copy(out.begin(), out.end(), v);
}

Naive naive_indexer(DsaIndexer& m, const Vec& h, const Vec& cq, const std::vector<int64_t>& lens) {
  const IndexerConfig& c = m.config();
  const int64_t T = total(lens), D = c.hidden_size, R = c.q_lora_rank, H = c.n_heads,
                d = c.head_dim, P = c.kpool, dr = c.rope_dim;
  const Vec Hd = hadamard_matrix(d);
  Naive n;
  std::vector<int64_t> pos, doc_start;
  for (int64_t L : lens)
    for (int64_t r = 0; r < L; ++r)
      pos.push_back(r), doc_start.push_back(int64_t(pos.size()) - 1 - r);

  n.q = matmul_t(cq, param(m, "wq_b.weight"), T, R, H * d);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t hh = 0; hh < H; ++hh) {
      double* v = &n.q[size_t((t * H + hh) * d)];
      naive_rope(v, pos[size_t(t)], dr, c.rope_theta, c.rope_interleave);
      if (c.hadamard) apply_matrix(v, Hd, d);
    }
  const Vec kl = matmul_t(h, param(m, "wk.weight"), T, D, d);
  const Vec lw = param(m, "k_norm.weight"), lb = param(m, "k_norm.bias");
  n.k.assign(size_t(T * d), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < d; ++i) mean += kl[size_t(t * d + i)] / double(d);
    for (int64_t i = 0; i < d; ++i) var += std::pow(kl[size_t(t * d + i)] - mean, 2) / double(d);
    for (int64_t i = 0; i < d; ++i)
      n.k[size_t(t * d + i)] =
          (kl[size_t(t * d + i)] - mean) / std::sqrt(var + c.k_norm_eps) * lw[size_t(i)] +
          lb[size_t(i)];
    naive_rope(&n.k[size_t(t * d)], pos[size_t(t)], dr, c.rope_theta, c.rope_interleave);
    if (P == 1 && c.hadamard) apply_matrix(&n.k[size_t(t * d)], Hd, d);
  }
  std::vector<int64_t> pool_off{0};
  if (P > 1) {
    const Vec g = matmul_t(h, param(m, "index_kpool_compress_gate"), T, D, d);
    const Vec A = param(m, "index_kpool_compress_ape");
    int64_t s0 = 0;
    for (int64_t L : lens) {
      for (int64_t p = 0; p < L / P; ++p) {
        Vec kp(size_t(d), 0.0);
        for (int64_t ch = 0; ch < d; ++ch) {
          Vec z(static_cast<size_t>(P));
          double zmax = -INFINITY, den = 0;
          for (int64_t j = 0; j < P; ++j)
            z[size_t(j)] = g[size_t((s0 + p * P + j) * d + ch)] + A[size_t(j * d + ch)],
            zmax = std::max(zmax, z[size_t(j)]);
          for (int64_t j = 0; j < P; ++j) den += std::exp(z[size_t(j)] - zmax);
          for (int64_t j = 0; j < P; ++j)
            kp[size_t(ch)] +=
                std::exp(z[size_t(j)] - zmax) / den * n.k[size_t((s0 + p * P + j) * d + ch)];
        }
        if (c.hadamard) apply_matrix(kp.data(), Hd, d);
        n.pooled.insert(n.pooled.end(), kp.begin(), kp.end());
      }
      pool_off.push_back(pool_off.back() + L / P);
      s0 += L;
    }
  }
  n.w = matmul_t(h, param(m, "weights_proj.weight"), T, D, H);
  for (auto& x : n.w) x /= std::sqrt(double(H));
  for (int64_t L : lens) n.W = std::max(n.W, P == 1 ? L : L / P);
  n.scores.assign(size_t(T * n.W), -INFINITY);
  int64_t doc = -1;
  for (int64_t t = 0; t < T; ++t) {
    if (pos[size_t(t)] == 0) ++doc;
    const int64_t r = pos[size_t(t)], ncand = P == 1 ? r + 1 : (r + 1) / P;
    for (int64_t j = 0; j < ncand; ++j) {
      const double* key = P == 1 ? &n.k[size_t((doc_start[size_t(t)] + j) * d)]
                                 : &n.pooled[size_t((pool_off[size_t(doc)] + j) * d)];
      double I = 0;
      for (int64_t hh = 0; hh < H; ++hh) {
        double dot = 0;
        for (int64_t i = 0; i < d; ++i) dot += n.q[size_t((t * H + hh) * d + i)] * key[i];
        I += n.w[size_t(t * H + hh)] * std::max(0.0, dot / std::sqrt(double(d)));
      }
      n.scores[size_t(t * n.W + j)] = I;
    }
  }
  return n;
}

Tensor tensor_of(const Vec& v, const Shape& s, DType dt = DType::f64) {
  return Tensor::from_values(s, v, dt);
}

TEST(DsaIndexerLayer, ScoresMatchNaiveFp64Loop) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{7, 1, 5};
  const int64_t T = total(lens);
  struct Case {
    int64_t P, rope;
    bool interleave;
  };
  for (const Case cs :
       {Case{1, 0, true}, Case{1, 4, true}, Case{1, 4, false}, Case{2, 0, true}, Case{3, 4, false}})
    for (DType dt : {DType::f64, DType::f32}) {
      IndexerConfig c = tiny_config(cs.P, cs.rope, dt, cs.P * 2);
      c.rope_interleave = cs.interleave;
      DsaIndexer m(c, native_policy(), "model.layers.3.self_attn.indexer");
      randomize(m, rng);
      const Tensor h = randn({T, 6}, DType::f64, rng), cq = randn({T, 5}, DType::f64, rng);
      Context ctx;
      DsaIndexer::Saved s;
      const auto out = m.forward(ctx, h.to(dt), cq.to(dt), cu_of(lens), &s);
      const Naive n = naive_indexer(m, h.to(dt).to_f64_vector(), cq.to(dt).to_f64_vector(), lens);
      const std::string what = fmt::format("P {} rope {} interleave {} {}", cs.P, cs.rope,
                                           cs.interleave, dtype_name(dt));
      const auto tol = hlm::testing::tolerance_for(dt);
      ASSERT_EQ(out.scores.shape(), (Shape{T, n.W})) << what;
      EXPECT_EQ(out.scores.dtype(), dt) << what;
      // -inf positions must agree exactly (compare reports NaN/Inf mismatches).
      EXPECT_TRUE(hlm::testing::close(out.scores, tensor_of(n.scores, {T, n.W}), tol)) << what;
      EXPECT_TRUE(hlm::testing::close(s.q, tensor_of(n.q, {T, 3, 8}), tol)) << what;
      EXPECT_TRUE(hlm::testing::close(s.k, tensor_of(n.k, {T, 8}), tol)) << what;
      EXPECT_TRUE(hlm::testing::close(out.weights, tensor_of(n.w, {T, 3}), tol)) << what;
      if (cs.P > 1) {
        const int64_t NP = int64_t(n.pooled.size()) / 8;
        EXPECT_TRUE(hlm::testing::close(s.pooled, tensor_of(n.pooled, {NP, 8}), tol)) << what;
      }
    }
}

// The Hadamard rotation is orthogonal: exact-path scores are the same with it off (to rounding),
// while the rotated q differs from the unrotated one.
TEST(DsaIndexerLayer, HadamardPreservesExactScores) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{9};
  IndexerConfig c = tiny_config(1, 4, DType::f64, 4);
  DsaIndexer a(c, native_policy(), "idx");
  c.hadamard = false;
  DsaIndexer b(c, native_policy(), "idx");
  randomize(a, rng);
  for (auto& [name, p] : a.named_parameters()) b.find_parameter(name)->value = p->value.clone();
  const Tensor h = randn({9, 6}, DType::f64, rng), cq = randn({9, 5}, DType::f64, rng);
  DsaIndexer::Saved sa, sb;
  const auto oa = a.forward(Context{}, h, cq, cu_of(lens), &sa);
  const auto ob = b.forward(Context{}, h, cq, cu_of(lens), &sb);
  EXPECT_TRUE(hlm::testing::close(oa.scores, ob.scores, {1e-13, 1e-13}));
  EXPECT_GT(hlm::testing::compare(sa.q, sb.q).max_abs, 1e-3);
}

// ---- selection ------------------------------------------------------------------------------

// Brute force: candidates of t ranked by (higher score, lower index), the first min(n, K / P)
// taken; KPool pools expanded to their tokens plus the tail. Returns the token set.
std::set<int64_t> brute_select(const Vec& scores, int64_t W, int64_t t, int64_t r, int64_t s0,
                               int64_t K, int64_t P, bool tail) {
  const int64_t n = P == 1 ? r + 1 : (r + 1) / P;
  std::vector<int64_t> cand(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) cand[size_t(j)] = j;
  std::stable_sort(cand.begin(), cand.end(), [&](int64_t a, int64_t b) {
    return scores[size_t(t * W + a)] > scores[size_t(t * W + b)];
  });
  std::set<int64_t> out;
  for (int64_t i = 0; i < std::min<int64_t>(n, K / P); ++i)
    for (int64_t j = 0; j < P; ++j) out.insert(s0 + cand[size_t(i)] * P + j);
  if (P > 1 && tail)
    for (int64_t s = (r + 1) / P * P; s <= r; ++s) out.insert(s0 + s);
  return out;
}

void expect_selection_matches(const DsaIndexer::Output& out, const std::vector<int64_t>& lens,
                              int64_t K, int64_t P, bool tail, const std::string& what) {
  const int64_t T = total(lens), W = out.scores.size(1);
  const int64_t width = (P > 1 && tail) ? K + P - 1 : K;
  ASSERT_EQ(out.indices.shape(), (Shape{T, width})) << what;
  ASSERT_EQ(out.indices.dtype(), DType::i32) << what;
  const Vec sc = out.scores.to_f64_vector(), idx = out.indices.to_f64_vector();
  int64_t t = 0, s0 = 0;
  for (int64_t L : lens) {
    for (int64_t r = 0; r < L; ++r, ++t) {
      const auto want = brute_select(sc, W, t, r, s0, K, P, tail);
      std::set<int64_t> got;
      int64_t pad = 0;
      for (int64_t j = 0; j < width; ++j) {
        const int64_t v = int64_t(idx[size_t(t * width + j)]);
        if (v == -1)
          ++pad;
        else
          EXPECT_TRUE(got.insert(v).second) << what << " duplicate " << v << " in row " << t;
      }
      EXPECT_EQ(got, want) << what << " row " << t;
      EXPECT_EQ(pad, width - int64_t(want.size())) << what << " row " << t;
    }
    s0 += L;
  }
}

TEST(DsaIndexerLayer, SelectionMatchesBruteForceAsSets) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{13, 3, 1, 9};
  const int64_t T = total(lens);
  for (int64_t P : {1, 2, 3})
    for (int64_t K : {P, 2 * P, 3 * P})
      for (bool tail : {true, false}) {
        if (P == 1 && !tail) continue;
        IndexerConfig c = tiny_config(P, 0, DType::f32, K);
        c.kpool_always_select_tail = tail;
        DsaIndexer m(c, native_policy(), "idx");
        randomize(m, rng);
        const auto out = m.forward(Context{}, randn({T, 6}, DType::f32, rng),
                                   randn({T, 5}, DType::f32, rng), cu_of(lens), nullptr);
        expect_selection_matches(out, lens, K, P, tail,
                                 fmt::format("P {} K {} tail {}", P, K, tail));
        if (P > 1) EXPECT_EQ(out.pools.shape(), (Shape{T, K / P}));
      }
}

// All keys equal (wk = 0, so LayerNorm gives its bias; gate and ape 0, so every pool averages
// equal keys exactly): every score of a row ties and the lowest indices must win.
TEST(DsaIndexerLayer, TiesSelectLowerIndexFirst) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{10, 6};
  const int64_t T = 16;
  for (int64_t P : {1, 2}) {
    const int64_t K = 2 * P;
    DsaIndexer m(tiny_config(P, 0, DType::f64, K), native_policy(), "idx");
    randomize(m, rng);
    m.wk().weight().value.zero_();
    m.k_norm_bias().value.copy_(tensor_of({0.5, -0.25, 1, 0.75, -1, 0.5, 0.125, 2}, {8}));
    if (P > 1) {
      m.kpool_gate()->value.zero_();
      m.kpool_ape()->value.zero_();
    }
    const Tensor h = randn({T, 6}, DType::f64, rng);
    const auto out = m.forward(Context{}, h, randn({T, 5}, DType::f64, rng), cu_of(lens), nullptr);
    const Vec idx = out.indices.to_f64_vector(), sc = out.scores.to_f64_vector();
    const int64_t width = m.index_width(), W = out.scores.size(1);
    int64_t t = 0, s0 = 0;
    for (int64_t L : lens) {
      for (int64_t r = 0; r < L; ++r, ++t) {
        const int64_t n = P == 1 ? r + 1 : (r + 1) / P;
        for (int64_t j = 1; j < n; ++j)
          ASSERT_EQ(sc[size_t(t * W + j)], sc[size_t(t * W)]) << "scores must tie, row " << t;
        // Expected: the first min(n, K/P) candidates, then -1s; KPool tail after column K.
        std::vector<double> want(size_t(width), -1);
        const int64_t take = std::min<int64_t>(n, K / P);
        for (int64_t i = 0; i < take * P; ++i) want[size_t(i)] = double(s0 + i);
        if (P > 1)
          for (int64_t s = (r + 1) / P * P, j = K; s <= r; ++s, ++j)
            want[size_t(j)] = double(s0 + s);
        for (int64_t j = 0; j < width; ++j)
          EXPECT_EQ(idx[size_t(t * width + j)], want[size_t(j)])
              << "P " << P << " row " << t << " col " << j;
      }
      s0 += L;
    }
  }
}

// A document no longer than K selects all its causal tokens (KPool: pools + tail cover [0, t]).
TEST(DsaIndexerLayer, ShortDocumentsSelectAllCausalTokens) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{8, 5, 1};
  const int64_t T = total(lens);
  for (int64_t P : {1, 4}) {
    DsaIndexer m(tiny_config(P, 0, DType::f32, 8), native_policy(), "idx");
    randomize(m, rng);
    const auto out = m.forward(Context{}, randn({T, 6}, DType::f32, rng),
                               randn({T, 5}, DType::f32, rng), cu_of(lens), nullptr);
    const Vec idx = out.indices.to_f64_vector();
    const int64_t width = m.index_width();
    EXPECT_EQ(width, P == 1 ? 8 : 11);
    int64_t t = 0, s0 = 0;
    for (int64_t L : lens) {
      for (int64_t r = 0; r < L; ++r, ++t) {
        std::set<int64_t> got, want;
        for (int64_t j = 0; j < width; ++j)
          if (idx[size_t(t * width + j)] >= 0) got.insert(int64_t(idx[size_t(t * width + j)]));
        for (int64_t s = 0; s <= r; ++s) want.insert(s0 + s);
        EXPECT_EQ(got, want) << "P " << P << " row " << t;
      }
      s0 += L;
    }
  }
}

// ---- packed batch == documents one by one ------------------------------------------------------

TEST(DsaIndexerLayer, PackedBatchEqualsDocumentsBitwise) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{7, 1, 10, 4};
  const int64_t T = total(lens);
  for (int64_t P : {1, 3})
    for (int64_t rope : {0, 4}) {
      const int64_t K = 2 * P;
      DsaIndexer m(tiny_config(P, rope, DType::f32, K), native_policy(), "idx");
      randomize(m, rng);
      const Tensor h = randn({T, 6}, DType::f32, rng), cq = randn({T, 5}, DType::f32, rng);
      DsaIndexer::Saved s;
      const auto out = m.forward(Context{}, h, cq, cu_of(lens), &s);
      int64_t s0 = 0, p0 = 0;
      for (int64_t L : lens) {
        auto part = [&](const Tensor& x) { return x.slice(0, s0, s0 + L).contiguous(); };
        DsaIndexer::Saved s1;
        const auto o1 = m.forward(Context{}, part(h), part(cq), cu_of({L}), &s1);
        const int64_t ncol = P == 1 ? L : L / P;
        const std::string what = fmt::format("P {} rope {} doc at {}", P, rope, s0);
        EXPECT_TRUE(bit_equal(o1.scores, part(out.scores).slice(1, 0, ncol).contiguous())) << what;
        EXPECT_TRUE(bit_equal(o1.weights, part(out.weights))) << what;
        EXPECT_TRUE(bit_equal(s1.q, part(s.q))) << what;
        if (P > 1) {
          EXPECT_TRUE(bit_equal(s1.pooled, s.pooled.slice(0, p0, p0 + L / P).contiguous())) << what;
          const Vec a = o1.pools.to_f64_vector(), b = part(out.pools).to_f64_vector();
          for (size_t i = 0; i < a.size(); ++i)
            EXPECT_EQ(a[i] < 0 ? -1 : a[i] + double(p0), b[i]) << what;
        }
        const Vec a = o1.indices.to_f64_vector(), b = part(out.indices).to_f64_vector();
        ASSERT_EQ(a.size(), b.size());
        for (size_t i = 0; i < a.size(); ++i)
          EXPECT_EQ(a[i] < 0 ? -1 : a[i] + double(s0), b[i]) << what;
        s0 += L;
        p0 += L / P;
      }
    }
}

// ---- gradients of the loss ----------------------------------------------------------------------

struct LossSetup {
  Tensor qm, kv;  // main attention (absorbed form), detached
  double scale = 0.5;
};

Tensor make_target(const LossSetup& ls, const Tensor& cu, IndexerLossStage stage,
                   const Tensor& indices) {
  const SeqLayout seqs = SeqLayout::from_tensor(cu, ls.qm.size(0));
  return stage == IndexerLossStage::dense
             ? ops::attention_target(ls.qm, ls.kv, seqs, ls.scale)
             : ops::attention_target_at(ls.qm, ls.kv, seqs, indices, ls.scale);
}

TEST(DsaIndexerLayer, LossGradientsMatchFiniteDifferences) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{9, 6};
  const int64_t T = 15;
  const Tensor cu = cu_of(lens);
  for (int64_t P : {1, 2})
    for (int64_t rope : {0, 4})
      for (IndexerLossStage stage : {IndexerLossStage::dense, IndexerLossStage::sparse}) {
        const int64_t K = P == 1 ? 3 : 4;
        const std::string what = fmt::format("P {} rope {} {}", P, rope,
                                             stage == IndexerLossStage::dense ? "dense" : "sparse");
        DsaIndexer m(tiny_config(P, rope, DType::f64, K), native_policy(), "idx");
        randomize(m, rng);
        Tensor h = randn({T, 6}, DType::f64, rng), cq = randn({T, 5}, DType::f64, rng);
        LossSetup ls{randn({T, 2, 4}, DType::f64, rng), randn({T, 4}, DType::f64, rng, 1.5)};
        IndexerLossOptions opt;
        opt.stage = stage;
        opt.coeff = 3.0;
        const Context ctx;
        DsaIndexer::Saved base;
        m.forward(ctx, h, cq, cu, &base);
        const Tensor tgt = make_target(ls, cu, stage, base.indices);
        m.zero_grad();
        const IndexerLossResult res = m.loss_backward(ctx, tgt, opt, base);
        EXPECT_GT(res.loss, 0.0) << what;
        // The selection is discrete: finite differences keep the base selection fixed.
        auto loss = [&] {
          DsaIndexer::Saved s;
          m.forward(ctx, h, cq, cu, &s);
          s.indices = base.indices;
          s.pools = base.pools;
          return m.loss_value(ctx, tgt, opt, s).loss;
        };
        EXPECT_NEAR(loss(), res.loss, 1e-14) << what;
        for (auto& [name, p] : m.named_parameters()) {
          ASSERT_TRUE(p->grad.defined()) << what << " " << name;
          // A gradient that is (near) zero everywhere would make the check vacuous.
          double gmax = 0;
          for (double g : p->grad.to_f64_vector()) gmax = std::max(gmax, std::fabs(g));
          EXPECT_GT(gmax, 1e-3) << what << " " << name;
          EXPECT_TRUE(grad_check(loss, p->value, p->grad, 1e-6, 1e-7, 20)) << what << " " << name;
        }
        // The optional input gradients.
        EXPECT_TRUE(grad_check(loss, h, res.dh, 1e-6, 1e-7, 16)) << what << " dh";
        EXPECT_TRUE(grad_check(loss, cq, res.dc_q, 1e-6, 1e-7, 16)) << what << " dc_q";
      }
}

// Gradients accumulate (+=); grad_scale scales them, not the loss; ctx.recompute gives the same
// gradients bit for bit and keeps only the inputs and the selection.
TEST(DsaIndexerLayer, GradientsAccumulateScaleAndRecompute) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{8, 5};
  const int64_t T = 13;
  const Tensor cu = cu_of(lens);
  for (int64_t P : {1, 2}) {
    DsaIndexer m(tiny_config(P, 4, DType::f32, 2 * P), native_policy(), "idx");
    randomize(m, rng);
    const Tensor h = randn({T, 6}, DType::f32, rng), cq = randn({T, 5}, DType::f32, rng);
    LossSetup ls{randn({T, 2, 4}, DType::f32, rng), randn({T, 4}, DType::f32, rng)};
    IndexerLossOptions opt;
    opt.stage = IndexerLossStage::sparse;
    Context full, rec;
    rec.recompute = true;
    DsaIndexer::Saved s_full, s_rec;
    const auto o_full = m.forward(full, h, cq, cu, &s_full);
    const auto o_rec = m.forward(rec, h, cq, cu, &s_rec);
    EXPECT_TRUE(bit_equal(o_full.indices, o_rec.indices));
    EXPECT_TRUE(s_rec.recomputed);
    EXPECT_FALSE(s_rec.q.defined());
    EXPECT_FALSE(s_rec.scores.defined());
    const Tensor tgt = make_target(ls, cu, opt.stage, o_full.indices);

    m.zero_grad();
    const auto r1 = m.loss_backward(full, tgt, opt, s_full);
    std::vector<Tensor> g1;
    for (auto& [n, p] : m.named_parameters()) g1.push_back(p->grad.clone());
    m.zero_grad();
    const auto r2 = m.loss_backward(rec, tgt, opt, s_rec);
    EXPECT_EQ(r1.loss, r2.loss);
    EXPECT_TRUE(bit_equal(r1.dh, r2.dh));
    size_t i = 0;
    for (auto& [n, p] : m.named_parameters()) EXPECT_TRUE(bit_equal(p->grad, g1[i++])) << n;
    // Second call with grad_scale 2: grad = g1 + 2 g1 = 3 g1 (exact in f32: 3 g1 is g1 + 2 g1
    // rounded once, as is the accumulation).
    IndexerLossOptions opt2 = opt;
    opt2.grad_scale = 2.0;
    const auto r3 = m.loss_backward(full, tgt, opt2, s_full);
    EXPECT_EQ(r3.loss, r1.loss);
    i = 0;
    for (auto& [n, p] : m.named_parameters()) {
      const Vec a = p->grad.to_f64_vector(), b = g1[i++].to_f64_vector();
      for (size_t e = 0; e < a.size(); ++e)
        EXPECT_NEAR(a[e], 3 * b[e], 1e-6 * (1 + std::fabs(b[e]))) << n << " " << e;
    }
  }
}

// ---- precision ------------------------------------------------------------------------------

TEST(DsaIndexerLayer, PrecisionFlagsResolvePerModule) {
  IndexerConfig c = tiny_config(4, 0, DType::f32, 8);
  for (bool qk_off : {false, true})
    for (bool kpool_on : {false, true}) {
      PrecisionPolicy pol;
      pol.default_kind = GemmKind::fp8_block;
      pol.grad_format = Fp8Format::e5m2;
      pol.dsa_indexer_qk_proj_disable_quantization = qk_off;
      pol.dsa_indexer_kpool_use_quantization = kpool_on;
      DsaIndexer m(c, pol, "model.layers.3.self_attn.indexer");
      const GemmKind qk = qk_off ? GemmKind::bf16 : GemmKind::fp8_block;
      EXPECT_EQ(m.wq_b().precision().kind, qk) << qk_off;
      EXPECT_EQ(m.wk().precision().kind, qk) << qk_off;
      if (!qk_off) EXPECT_EQ(m.wq_b().precision().grad_format, Fp8Format::e5m2);
      EXPECT_EQ(m.weights_proj().precision().kind, GemmKind::bf16);
      EXPECT_EQ(m.kpool_gate_precision().kind, kpool_on ? GemmKind::fp8_block : GemmKind::bf16);
      EXPECT_EQ(m.fp8_scoring(), kpool_on);
    }
  // modules_to_not_convert on the indexer path; weights_proj_fp32; token-level FP8 scoring.
  PrecisionPolicy pol;
  pol.default_kind = GemmKind::fp8_block;
  pol.modules_to_not_convert = {"layers.3.self_attn.indexer"};
  DsaIndexer a(c, pol, "model.layers.3.self_attn.indexer");
  EXPECT_EQ(a.wq_b().precision().kind, GemmKind::bf16);
  DsaIndexer b(c, pol, "model.layers.7.self_attn.indexer");
  EXPECT_EQ(b.wq_b().precision().kind, GemmKind::fp8_block);
  IndexerConfig c2 = tiny_config(1, 0, DType::f32, 8);
  c2.weights_proj_fp32 = true;
  c2.fp8_scoring = true;
  DsaIndexer d(c2, pol, "model.layers.7.self_attn.indexer");
  EXPECT_EQ(d.weights_proj().precision().kind, GemmKind::native);
  EXPECT_TRUE(d.fp8_scoring());
  DsaIndexer e(tiny_config(1, 0, DType::f32, 8), pol, "x");
  EXPECT_FALSE(e.fp8_scoring());
}

// The FP8 scoring path (E4M3, one power-of-two scale per 128-vector) against the exact path on a
// realistic head dim: scores differ, selected sets mostly agree. Measured figures are printed.
TEST(DsaIndexerLayer, Fp8ScoringDiffersButSelectionMostlyAgrees) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{96, 64};
  const int64_t T = 160;
  for (int64_t P : {1, 4}) {
    IndexerConfig c;
    c.hidden_size = 64;
    c.q_lora_rank = 32;
    c.n_heads = 4;
    c.head_dim = 128;
    c.topk = 16;
    c.kpool = P;
    c.init_std = 0.1;
    c.seed = 11;
    PrecisionPolicy exact_pol = native_policy(), fp8_pol = native_policy();
    if (P == 1)
      c.fp8_scoring = false;
    else
      fp8_pol.dsa_indexer_kpool_use_quantization = true;
    IndexerConfig c8 = c;
    if (P == 1) c8.fp8_scoring = true;
    DsaIndexer ex(c, exact_pol, "idx"), q8(c8, fp8_pol, "idx");
    ASSERT_FALSE(ex.fp8_scoring());
    ASSERT_TRUE(q8.fp8_scoring());
    if (P > 1) {
      Tensor A = randn({P, 128}, DType::f32, rng);
      ex.kpool_ape()->value.copy_(A);
      q8.kpool_ape()->value.copy_(A);
    }
    const Tensor h = randn({T, 64}, DType::f32, rng), cq = randn({T, 32}, DType::f32, rng);
    const auto oe = ex.forward(Context{}, h, cq, cu_of(lens), nullptr);
    const auto o8 = q8.forward(Context{}, h, cq, cu_of(lens), nullptr);
    const auto st = hlm::testing::compare(o8.scores, oe.scores);
    EXPECT_EQ(st.nan_mismatch, 0);
    EXPECT_GT(st.max_abs, 0.0) << "the FP8 path must differ from the exact path";
    EXPECT_LT(st.rel_l2, 0.1);
    // Overlap of the selected token sets on the rows where the selection is a real choice.
    const Vec ie = oe.indices.to_f64_vector(), i8 = o8.indices.to_f64_vector();
    const int64_t width = ex.index_width();
    double overlap = 0;
    int64_t rows = 0, identical = 0;
    int64_t t = 0;
    for (int64_t L : lens)
      for (int64_t r = 0; r < L; ++r, ++t) {
        if (r + 1 <= c.topk + (P > 1 ? P - 1 : 0)) continue;
        std::set<int64_t> a, b;
        for (int64_t j = 0; j < width; ++j) {
          if (ie[size_t(t * width + j)] >= 0) a.insert(int64_t(ie[size_t(t * width + j)]));
          if (i8[size_t(t * width + j)] >= 0) b.insert(int64_t(i8[size_t(t * width + j)]));
        }
        int64_t common = 0;
        for (int64_t x : a) common += b.count(x);
        overlap += double(common) / double(a.size());
        identical += a == b;
        ++rows;
      }
    overlap /= double(rows);
    std::cout << "[ measured ] P " << P << ": FP8 vs exact scores rel_l2 " << st.rel_l2
              << ", max_abs " << st.max_abs << "; selected-set overlap " << overlap << " over "
              << rows << " rows, identical sets " << identical << "/" << rows << "\n";
    EXPECT_GT(overlap, 0.85) << "P " << P;
    EXPECT_LT(identical, rows) << "P " << P << ": FP8 should flip at least one near-tie";
  }
}

// ---- parameters, dtypes, init ---------------------------------------------------------------

TEST(DsaIndexerLayer, ParametersNamesInitAndApeStaysFp32) {
  Rng rng(test_seed());
  IndexerConfig c = tiny_config(4, 0, DType::f32, 8);
  DsaIndexer m(c, native_policy(), "idx");
  std::vector<std::string> names;
  for (auto& [n, p] : m.named_parameters()) names.push_back(n);
  EXPECT_EQ(names,
            (std::vector<std::string>{"k_norm.weight", "k_norm.bias", "index_kpool_compress_gate",
                                      "index_kpool_compress_ape", "wq_b.weight", "wk.weight",
                                      "weights_proj.weight"}));
  Param* ape = m.kpool_ape();
  EXPECT_TRUE(ape->keep_fp32);
  EXPECT_TRUE(ape->no_weight_decay);
  EXPECT_EQ(ape->value.shape(), (Shape{4, 8}));
  // zeros init (docs/dsa.md, "The indexer module")
  for (double v : ape->value.to_f64_vector()) EXPECT_EQ(v, 0.0);
  EXPECT_EQ(m.kpool_gate()->value.shape(), (Shape{8, 6}));
  EXPECT_EQ(m.find_parameter("wq_b.weight")->value.shape(), (Shape{24, 5}));
  // Deterministic init: same seed, same values; another seed differs.
  DsaIndexer m2(c, native_policy(), "idx");
  c.seed = 8;
  DsaIndexer m3(c, native_policy(), "idx");
  EXPECT_TRUE(bit_equal(m.wq_b().weight().value, m2.wq_b().weight().value));
  EXPECT_TRUE(bit_equal(m.kpool_gate()->value, m2.kpool_gate()->value));
  EXPECT_GT(hlm::testing::compare(m.wq_b().weight().value, m3.wq_b().weight().value).max_abs, 0);
  const auto sd = hlm::testing::compare(m.wk().weight().value, Tensor::zeros({8, 6}, DType::f32));
  EXPECT_GT(sd.max_abs, 0.0);  // N(0, init_std), not zeros

  // to_dtype(bf16): every parameter bf16 except ape; forward and backward still run in f32.
  randomize(m, rng);
  m.to_dtype(DType::bf16);
  for (auto& [n, p] : m.named_parameters())
    EXPECT_EQ(p->value.dtype(), n == "index_kpool_compress_ape" ? DType::f32 : DType::bf16) << n;
  const std::vector<int64_t> lens{11};
  const SeqLayout cu = hlm::testing::seqs_of(lens);
  const Tensor h = randn({11, 6}, DType::f32, rng).to(DType::bf16);
  const Tensor cq = randn({11, 5}, DType::f32, rng).to(DType::bf16);
  DsaIndexer::Saved s;
  const auto out = m.forward(Context{}, h, cq, cu, &s);
  EXPECT_EQ(out.scores.dtype(), DType::f32);
  // bf16 parameters computed in f32 equal the f32 module holding the same (bf16-exact) values.
  DsaIndexer f(c, native_policy(), "idx");
  for (auto& [n, p] : m.named_parameters()) f.find_parameter(n)->value = p->value.to(DType::f32);
  const auto of = f.forward(Context{}, h.to(DType::f32), cq.to(DType::f32), cu, nullptr);
  EXPECT_TRUE(bit_equal(out.scores, of.scores));
  m.zero_grad();
  const Tensor tgt = ops::attention_target(randn({11, 2, 4}, DType::f32, rng),
                                           randn({11, 4}, DType::f32, rng), cu, 0.5);
  m.loss_backward(Context{}, tgt, IndexerLossOptions{}, s);
  EXPECT_EQ(ape->grad.dtype(), DType::f32);
  EXPECT_EQ(m.kpool_gate()->grad.dtype(), DType::f32);
  EXPECT_GT(hlm::testing::compare(ape->grad, Tensor::zeros({4, 8}, DType::f32)).max_abs, 0);
  // to_dtype(f64) follows to f64 (FP64 reference runs), and back to bf16 keeps ape f32.
  m.to_dtype(DType::f64);
  EXPECT_EQ(ape->value.dtype(), DType::f64);
  m.to_dtype(DType::bf16);
  EXPECT_EQ(ape->value.dtype(), DType::f32);
}

// ---- bad config / input -----------------------------------------------------------------------

TEST(DsaIndexerLayer, BadConfigAndInputThrowClearErrors) {
  Rng rng(test_seed());
  auto bad = [&](auto mutate, const std::string& needle) {
    IndexerConfig c = tiny_config(2, 0, DType::f32, 4);
    mutate(c);
    expect_error([&] { c.validate(); }, needle);
    expect_error([&] { DsaIndexer m(c, native_policy(), "idx"); }, needle);
  };
  bad([](IndexerConfig& c) { c.kpool = 0; }, "kpool");
  bad([](IndexerConfig& c) { c.topk = 6, c.kpool = 4; }, "divisible by kpool");
  bad([](IndexerConfig& c) { c.head_dim = 12; }, "power of two");
  bad([](IndexerConfig& c) { c.n_heads = 0; }, "n_heads");
  bad([](IndexerConfig& c) { c.topk = 0; }, "topk");
  bad([](IndexerConfig& c) { c.hidden_size = -1; }, "hidden_size");
  bad([](IndexerConfig& c) { c.rope_dim = 3; }, "rope_dim");
  bad([](IndexerConfig& c) { c.rope_dim = 10; }, "rope_dim");
  bad([](IndexerConfig& c) { c.k_norm_eps = 0; }, "k_norm_eps");
  bad([](IndexerConfig& c) { c.dtype = DType::i32; }, "dtype");
  {
    IndexerConfig c = tiny_config(1, 0, DType::f32, 4);
    c.head_dim = 12;
    c.hadamard = false;
    EXPECT_NO_THROW(c.validate());  // non-power-of-two is fine without the rotation
  }
  // Inputs.
  DsaIndexer m(tiny_config(2, 0, DType::f32, 4), native_policy(), "idx");
  const Tensor h = randn({6, 6}, DType::f32, rng), cq = randn({6, 5}, DType::f32, rng);
  const Tensor cu = cu_of({4, 2});
  const Context ctx;
  expect_error(
      [&] {
        m.forward(ctx, randn({6, 7}, DType::f32, rng), cq, cu, nullptr);
      },
      "h must be");
  expect_error(
      [&] {
        m.forward(ctx, h, randn({5, 5}, DType::f32, rng), cu, nullptr);
      },
      "c_q has 5 rows");
  expect_error([&] { m.forward(ctx, h, cq, cu_of({4, 1}), nullptr); }, "cu_seqlens");
  expect_error(
      [&] {
        m.forward(ctx, h, cq, Tensor::from_vector<int64_t>({3}, {0, 5, 4}), nullptr);
      },
      "cu_seqlens");
  expect_error(
      [&] {
        m.forward(ctx, Tensor::zeros({6, 6}, DType::i32), cq, cu, nullptr);
      },
      "h must be");
  expect_error([&] { m.forward(ctx, Tensor(), cq, cu, nullptr); }, "h is undefined");
  DsaIndexer::Saved s;
  m.forward(ctx, h, cq, cu, &s);
  IndexerLossOptions sparse;
  sparse.stage = IndexerLossStage::sparse;
  expect_error(
      [&] {
        m.loss_backward(ctx, Tensor::zeros({6, 3}, DType::f32), sparse, s);
      },
      "aligned with the selection");
  expect_error(
      [&] {
        m.loss_backward(ctx, Tensor::zeros({5, 4}, DType::f32), IndexerLossOptions{}, s);
      },
      "dense");
  expect_error(
      [&] {
        m.loss_backward(ctx, Tensor::zeros({6, 4}, DType::i64), IndexerLossOptions{}, s);
      },
      "target must be an f32 or f64");
  DsaIndexer::Saved empty;
  expect_error(
      [&] {
        m.loss_backward(ctx, Tensor::zeros({6, 4}, DType::f32), IndexerLossOptions{}, empty);
      },
      "Saved is empty");
  // Not training: nothing saved.
  Context eval;
  eval.training = false;
  DsaIndexer::Saved s2;
  m.forward(eval, h, cq, cu, &s2);
  EXPECT_FALSE(s2.h.defined());
}

// Edge shapes: empty documents, documents shorter than P (no pool at all: the selection is the
// tail, and the pool-level loss has no row), a single token, an empty batch.
TEST(DsaIndexerLayer, EdgeShapes) {
  Rng rng(test_seed());
  for (int64_t P : {1, 4}) {
    DsaIndexer m(tiny_config(P, 0, DType::f64, 4), native_policy(), "idx");
    randomize(m, rng);
    for (const std::vector<int64_t>& lens :
         {std::vector<int64_t>{3, 0, 2}, std::vector<int64_t>{1}, std::vector<int64_t>{0, 0}}) {
      const int64_t T = total(lens);
      const SeqLayout cu = hlm::testing::seqs_of(lens);
      DsaIndexer::Saved s;
      const auto out = m.forward(Context{}, randn({T, 6}, DType::f64, rng),
                                 randn({T, 5}, DType::f64, rng), cu, &s);
      expect_selection_matches(out, lens, 4, P, true, fmt::format("P {} T {}", P, T));
      const Tensor tgt = ops::attention_target(randn({T, 2, 4}, DType::f64, rng),
                                               randn({T, 4}, DType::f64, rng), cu, 0.5);
      m.zero_grad();
      const auto r = m.loss_backward(Context{}, tgt, IndexerLossOptions{}, s);
      if (P == 4 || T == 0) {
        // No candidate pool anywhere (or no token): no row, zero loss, zero gradients.
        EXPECT_EQ(r.rows, 0);
        EXPECT_EQ(r.loss, 0.0);
        for (auto& [n, p] : m.named_parameters())
          for (double g : p->grad.to_f64_vector()) EXPECT_EQ(g, 0.0) << n;
      } else {
        EXPECT_EQ(r.rows, T);
      }
      EXPECT_EQ(r.dh.shape(), (Shape{T, 6}));
    }
  }
}

}  // namespace
}  // namespace hlm
