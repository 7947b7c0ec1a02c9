// CPU reference of the DSA indexer scoring and top-k selection (see ops/dsa_indexer.h).
#include <algorithm>
#include <cmath>
#include <limits>

#include "ops/dsa_common.h"
#include "ops/dsa_indexer.h"
#include "ops/fp8_quant.h"
#include "ops/op_checks.h"

namespace hlm::ops {
namespace {

using dsa_detail::Pattern;

struct ScoreArgs {
  Tensor q, k, w;  // contiguous
  std::vector<int64_t> cu;
  int64_t T = 0, H = 0, D = 0;
  double scale = 0;
};

// Quantise-dequantise each 128-channel block of every row of x (see IndexerScoreOptions::fp8).
Tensor fp8_emulate(const Tensor& x, const IndexerScoreOptions& opt, const char* op,
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

ScoreArgs check_score_args(const Tensor& q, const Tensor& k, const Tensor& w,
                           const Tensor& cu_seqlens, const IndexerScoreOptions& opt,
                           const char* op) {
  detail::require_float(q, op, "q");
  detail::require_float(k, op, "k");
  detail::require_float(w, op, "w");
  detail::require_same_dtype(k, q, op, "k", "q");
  detail::require_same_dtype(w, q, op, "w", "q");
  HLM_CHECK(q.dim() == 3, "{}: q must be [T, H_I, d_I], got {}", op, q.describe());
  HLM_CHECK(opt.pool >= 1, "{}: pool must be >= 1, got {}", op, opt.pool);
  ScoreArgs a;
  a.T = q.size(0), a.H = q.size(1), a.D = q.size(2);
  a.cu = dsa_detail::read_cu_seqlens(cu_seqlens, a.T, op);
  const int64_t nkeys = dsa_detail::pool_offsets(a.cu, opt.pool).back();
  detail::require_shape(k, {nkeys, a.D}, op,
                        opt.pool == 1 ? "k (token keys [T, d_I])" : "k (pooled keys [NP, d_I])");
  detail::require_shape(w, {a.T, a.H}, op, "w");
  a.q = q.contiguous(), a.k = k.contiguous(), a.w = w.contiguous();
  if (opt.fp8) {
    HLM_CHECK(opt.fp8_amax_floor > 0, "{}: fp8_amax_floor must be positive, got {}", op,
              opt.fp8_amax_floor);
    a.q = fp8_emulate(a.q, opt, op, "q");
    a.k = fp8_emulate(a.k, opt, op, "k");
  }
  a.scale = opt.scale > 0 ? opt.scale : 1.0 / std::sqrt(double(a.D));
  HLM_CHECK(opt.scale >= 0, "{}: scale must be positive (or 0 for d_I^-1/2), got {}", op,
            opt.scale);
  return a;
}

template <class F>
inline F dotp(const F* a, const F* b, int64_t n) {
  F s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
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
        F z = scale * dotp(q + (t * H + h) * D, kr, D);
        if (relu) z = z > F(0) ? z : F(0);
        s += w[t * H + h] * z;
      }
      o[t * W + p.slot[size_t(e)]] = s;
    }
  }
}

template <class F>
IndexerScoreGrads score_bwd(const ScoreArgs& a, bool relu, const Pattern& p, const Tensor& d_in) {
  const Tensor dsc = d_in.contiguous();
  const F* q = a.q.data<F>();
  const F* k = a.k.data<F>();
  const F* w = a.w.data<F>();
  const F* g = dsc.data<F>();
  const int64_t H = a.H, D = a.D, W = p.W;
  const F scale = F(a.scale);
  IndexerScoreGrads r;
  r.dq = Tensor::zeros(a.q.shape(), a.q.dtype());
  r.dk = Tensor::zeros(a.k.shape(), a.k.dtype());
  r.dw = Tensor::zeros(a.w.shape(), a.w.dtype());
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
        const F z = scale * dotp(qr, kr, D);
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
  return r;
}

Tensor run_fwd(const ScoreArgs& a, const IndexerScoreOptions& opt, const Pattern& p) {
  Tensor out = Tensor::empty({a.T, p.W}, a.q.dtype());
  if (a.q.dtype() == DType::f64)
    score_fwd<double>(a, opt.relu, p, out);
  else
    score_fwd<float>(a, opt.relu, p, out);
  return out;
}

IndexerScoreGrads run_bwd(const ScoreArgs& a, const IndexerScoreOptions& opt, const Pattern& p,
                          const Tensor& d_scores, const char* op) {
  detail::require_float(d_scores, op, "d_scores");
  detail::require_same_dtype(d_scores, a.q, op, "d_scores", "q");
  detail::require_shape(d_scores, {a.T, p.W}, op, "d_scores");
  return a.q.dtype() == DType::f64 ? score_bwd<double>(a, opt.relu, p, d_scores)
                                   : score_bwd<float>(a, opt.relu, p, d_scores);
}

template <class F>
void topk_rows(const Tensor& scores, const std::vector<int64_t>& cu, int64_t kk, int64_t pool,
               Tensor& out) {
  const Tensor sc = scores.contiguous();
  const F* s = sc.data<F>();
  const int64_t W = sc.size(1);
  const std::vector<int64_t> cp = dsa_detail::pool_offsets(cu, pool);
  int32_t* o = out.data<int32_t>();
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
#pragma omp parallel for schedule(dynamic, 8)
    for (int64_t t = cu[d]; t < cu[d + 1]; ++t) {
      const int64_t n = (t - cu[d] + 1) / pool;
      const F* row = s + t * W;
      thread_local std::vector<int32_t> cand;
      cand.resize(size_t(n));
      for (int64_t j = 0; j < n; ++j) cand[size_t(j)] = int32_t(j);
      const int64_t m = std::min(kk, n);
      if (m < n) {
        // Strict total order: higher score first, NaN last, lower index first on ties.
        auto better = [row](int32_t a, int32_t b) {
          const F x = row[a], y = row[b];
          const bool nx = std::isnan(x), ny = std::isnan(y);
          if (nx != ny) return ny;
          if (!nx && x != y) return x > y;
          return a < b;
        };
        std::nth_element(cand.begin(), cand.begin() + m, cand.end(), better);
        std::sort(cand.begin(), cand.begin() + m);
      }
      int32_t* orow = o + t * kk;
      for (int64_t j = 0; j < m; ++j) orow[j] = int32_t(cp[d] + cand[size_t(j)]);
      for (int64_t j = m; j < kk; ++j) orow[j] = -1;
    }
  }
}

}  // namespace

Tensor indexer_scores(const Tensor& q, const Tensor& k, const Tensor& w, const Tensor& cu_seqlens,
                      const IndexerScoreOptions& opt, int64_t W) {
  const char* op = "indexer_scores";
  const ScoreArgs a = check_score_args(q, k, w, cu_seqlens, opt, op);
  const int64_t need = dsa_detail::max_keys_per_doc(a.cu, opt.pool);
  HLM_CHECK(W == 0 || W >= need, "{}: W must be 0 or >= {} (the most keys of a document), got {}",
            op, need, W);
  const Pattern p = dsa_detail::causal_pattern(a.cu, opt.pool, W == 0 ? need : W);
  return run_fwd(a, opt, p);
}

Tensor indexer_scores_at(const Tensor& q, const Tensor& k, const Tensor& w,
                         const Tensor& cu_seqlens, const Tensor& rows,
                         const IndexerScoreOptions& opt) {
  const char* op = "indexer_scores_at";
  const ScoreArgs a = check_score_args(q, k, w, cu_seqlens, opt, op);
  const Pattern p = dsa_detail::rows_pattern(rows, a.cu, opt.pool, op, "rows");
  return run_fwd(a, opt, p);
}

IndexerScoreGrads indexer_scores_backward(const Tensor& q, const Tensor& k, const Tensor& w,
                                          const Tensor& cu_seqlens, const Tensor& d_scores,
                                          const IndexerScoreOptions& opt) {
  const char* op = "indexer_scores_backward";
  const ScoreArgs a = check_score_args(q, k, w, cu_seqlens, opt, op);
  HLM_CHECK(d_scores.defined() && d_scores.dim() == 2, "{}: d_scores must be [T, W], got {}", op,
            d_scores.describe());
  const int64_t need = dsa_detail::max_keys_per_doc(a.cu, opt.pool);
  HLM_CHECK(d_scores.size(1) >= need, "{}: d_scores must have W >= {} columns, got {}", op, need,
            d_scores.describe());
  const Pattern p = dsa_detail::causal_pattern(a.cu, opt.pool, d_scores.size(1));
  return run_bwd(a, opt, p, d_scores, op);
}

IndexerScoreGrads indexer_scores_at_backward(const Tensor& q, const Tensor& k, const Tensor& w,
                                             const Tensor& cu_seqlens, const Tensor& rows,
                                             const Tensor& d_scores,
                                             const IndexerScoreOptions& opt) {
  const char* op = "indexer_scores_at_backward";
  const ScoreArgs a = check_score_args(q, k, w, cu_seqlens, opt, op);
  const Pattern p = dsa_detail::rows_pattern(rows, a.cu, opt.pool, op, "rows");
  return run_bwd(a, opt, p, d_scores, op);
}

Tensor topk_select(const Tensor& scores, const Tensor& cu_seqlens, int64_t k, int64_t pool) {
  const char* op = "topk_select";
  detail::require_float(scores, op, "scores");
  HLM_CHECK(scores.dim() == 2, "{}: scores must be [T, W], got {}", op, scores.describe());
  HLM_CHECK(k >= 1, "{}: k must be >= 1, got {}", op, k);
  HLM_CHECK(pool >= 1, "{}: pool must be >= 1, got {}", op, pool);
  const int64_t T = scores.size(0);
  const std::vector<int64_t> cu = dsa_detail::read_cu_seqlens(cu_seqlens, T, op);
  const int64_t need = dsa_detail::max_keys_per_doc(cu, pool);
  HLM_CHECK(scores.size(1) >= need,
            "{}: scores must have W >= {} columns (the most {} of a "
            "document), got {}",
            op, need, pool == 1 ? "tokens" : "pools", scores.describe());
  Tensor out = Tensor::empty({T, k}, DType::i32);
  if (scores.dtype() == DType::f64)
    topk_rows<double>(scores, cu, k, pool, out);
  else
    topk_rows<float>(scores, cu, k, pool, out);
  return out;
}

}  // namespace hlm::ops
