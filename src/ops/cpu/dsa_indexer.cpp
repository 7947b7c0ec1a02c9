// The DSA indexer scoring and top-k selection on the CPU (ops/dsa_indexer.h, the reference;
// entry points in ops/cpu/dsa_indexer.h).
#include "ops/cpu/dsa_indexer.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "ops/fp8_quant.h"

namespace hlm::ops::cpu {

Tensor indexer_fp8_emulate(const Tensor& x, const IndexerScoreOptions& opt, const char* op,
                           const char* what) {
  const int64_t D = x.size(-1), rows = x.numel() / std::max<int64_t>(D, 1);
  const std::vector<double> v = x.to_f64_vector();
  std::vector<double> o(v.size());
  const float floor_ = float(opt.fp8_amax_floor);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c0 = 0; c0 < D; c0 += kFp8TileSize) {
      const int64_t c1 = std::min(D, c0 + kFp8TileSize);
      float amax = 0;
      for (int64_t c = c0; c < c1; ++c) {
        const float f = float(v[size_t(r * D + c)]);
        HLM_CHECK(std::isfinite(f),
                  "{}: fp8 emulation: {} holds a non-finite value at row {}, "
                  "channel {}",
                  op, what, r, c);
        amax = std::max(amax, std::fabs(f));
      }
      const float s = fp8_scale_inv(std::max(amax, floor_), Fp8Format::e4m3, opt.fp8_pow2);
      for (int64_t c = c0; c < c1; ++c) {
        const float f = float(v[size_t(r * D + c)]);
        const uint8_t code = float_to_fp8(f / s, Fp8Format::e4m3, Saturate::finite);
        o[size_t(r * D + c)] = double(fp8_to_float(code, Fp8Format::e4m3) * s);
      }
    }
  return Tensor::from_values(x.shape(), o, x.dtype());
}

namespace {

using dsa_detail::dot;
using dsa_detail::Pattern;

struct ScoreArgs {
  Tensor q, k, w;  // contiguous; q and k fp8-emulated under opt.fp8
  int64_t T = 0, H = 0, D = 0;
  double scale = 0;
};

ScoreArgs args_of(const Tensor& q, const Tensor& k, const Tensor& w, const IndexerScoreOptions& opt,
                  double scale, const char* op) {
  ScoreArgs a;
  a.T = q.size(0), a.H = q.size(1), a.D = q.size(2);
  a.q = opt.fp8 ? cpu::indexer_fp8_emulate(q, opt, op, "q") : q;
  a.k = opt.fp8 ? cpu::indexer_fp8_emulate(k, opt, op, "k") : k;
  a.w = w;
  a.scale = scale;
  return a;
}

template <class F>
void score_fwd(const ScoreArgs& a, bool relu, const Pattern& p, Tensor& out) {
  const F* q = a.q.data<F>();
  const F* k = a.k.data<F>();
  const F* w = a.w.data<F>();
  F* o = out.data<F>();
  const int64_t H = a.H, D = a.D, W = p.W;
  const F scale = F(a.scale);
  std::fill(o, o + p.T * W, -std::numeric_limits<F>::infinity());
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t t = 0; t < p.T; ++t) {
    for (int64_t e = p.row_ptr[size_t(t)]; e < p.row_ptr[size_t(t + 1)]; ++e) {
      const F* kr = k + p.key[size_t(e)] * D;
      F s = 0;
      for (int64_t h = 0; h < H; ++h) {
        F z = scale * dot(q + (t * H + h) * D, kr, D);
        if (relu) z = z > F(0) ? z : F(0);
        s += w[t * H + h] * z;
      }
      o[t * W + p.slot[size_t(e)]] = s;
    }
  }
}

template <class F>
void score_bwd(const ScoreArgs& a, bool relu, const Pattern& p, const Tensor& dsc,
               IndexerScoreGrads& r) {
  const F* q = a.q.data<F>();
  const F* k = a.k.data<F>();
  const F* w = a.w.data<F>();
  const F* g = dsc.data<F>();
  const int64_t H = a.H, D = a.D, W = p.W;
  const F scale = F(a.scale);
  r.dq.zero_();
  r.dk.zero_();
  r.dw.zero_();
  F* dq = r.dq.data<F>();
  F* dk = r.dk.data<F>();
  F* dw = r.dw.data<F>();
  // dz[e, h] = d I(t, s) * w[t, h] * ReLU'(z) * scale: the gradient of the logit q[t,h] . k[s].
  std::vector<F> dz(static_cast<size_t>(p.entries() * H));
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t t = 0; t < p.T; ++t) {
    for (int64_t e = p.row_ptr[size_t(t)]; e < p.row_ptr[size_t(t + 1)]; ++e) {
      const F gi = g[t * W + p.slot[size_t(e)]];
      const F* kr = k + p.key[size_t(e)] * D;
      for (int64_t h = 0; h < H; ++h) {
        const F* qr = q + (t * H + h) * D;
        const F z = scale * dot(qr, kr, D);
        const bool on = !relu || z > F(0);
        dw[t * H + h] += gi * (on ? z : F(0));
        const F d = on ? gi * w[t * H + h] * scale : F(0);
        dz[size_t(e * H + h)] = d;
        F* dqr = dq + (t * H + h) * D;
        for (int64_t c = 0; c < D; ++c) dqr[c] += d * kr[c];
      }
    }
  }
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t s = 0; s < p.nkeys; ++s) {
    F* dkr = dk + s * D;
    for (int64_t i = p.key_ptr[size_t(s)]; i < p.key_ptr[size_t(s + 1)]; ++i) {
      const int64_t e = p.key_entry[size_t(i)];
      const int64_t t = p.query[size_t(e)];
      for (int64_t h = 0; h < H; ++h) {
        const F d = dz[size_t(e * H + h)];
        const F* qr = q + (t * H + h) * D;
        for (int64_t c = 0; c < D; ++c) dkr[c] += d * qr[c];
      }
    }
  }
}

template <class F>
void topk_rows(const Tensor& sc, const dsa_detail::QueryWindow& w, int64_t kk, int64_t pool,
               Tensor& out) {
  const F* s = sc.data<F>();
  const int64_t W = sc.size(1);
  const std::vector<int64_t> cp = dsa_detail::pool_offsets(w.cu, pool);
  int32_t* o = out.data<int32_t>();
  for (size_t d = 0; d < w.docs(); ++d) {
    const int64_t base = cp[size_t(w.doc[d])];
#pragma omp parallel for schedule(dynamic, 8)
    for (int64_t t = w.qcu[d]; t < w.qcu[d + 1]; ++t) {
      const int64_t n = (w.pos(d, t) + 1) / pool;
      thread_local std::vector<int32_t> cand;
      dsa_detail::best_indices(s + t * W, n, kk, cand);
      const int64_t m = int64_t(cand.size());
      int32_t* orow = o + t * kk;
      for (int64_t j = 0; j < m; ++j) orow[j] = int32_t(base + cand[size_t(j)]);
      for (int64_t j = m; j < kk; ++j) orow[j] = -1;
    }
  }
}

}  // namespace

void indexer_scores(const Tensor& q, const Tensor& k, const Tensor& w, const Pattern& p,
                    const IndexerScoreOptions& opt, double scale, Tensor& scores, const char* op) {
  const ScoreArgs a = args_of(q, k, w, opt, scale, op);
  if (q.dtype() == DType::f64)
    score_fwd<double>(a, opt.relu, p, scores);
  else
    score_fwd<float>(a, opt.relu, p, scores);
}

void indexer_scores_backward(const Tensor& q, const Tensor& k, const Tensor& w, const Pattern& p,
                             const IndexerScoreOptions& opt, double scale, const Tensor& d_scores,
                             IndexerScoreGrads& g, const char* op) {
  const ScoreArgs a = args_of(q, k, w, opt, scale, op);
  if (q.dtype() == DType::f64)
    score_bwd<double>(a, opt.relu, p, d_scores, g);
  else
    score_bwd<float>(a, opt.relu, p, d_scores, g);
}

void topk_select(const Tensor& scores, const dsa_detail::QueryWindow& w, int64_t k, int64_t pool,
                 Tensor& out) {
  if (scores.dtype() == DType::f64)
    topk_rows<double>(scores, w, k, pool, out);
  else
    topk_rows<float>(scores, w, k, pool, out);
}

}  // namespace hlm::ops::cpu
