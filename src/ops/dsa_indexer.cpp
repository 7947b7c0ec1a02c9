// The front door of the DSA indexer ops (ops/dsa_indexer.h): argument checks (the score layouts
// become checked patterns, ops/dsa_common.h), output allocation, and the switch to the CPU
// reference (ops/cpu/dsa_indexer.cpp) or the CUDA kernels (ops/cuda/dsa_indexer.cu; top-k
// selection: ops/cuda/dsa_select.cu). The dense layout's pattern is built for the CPU only: the
// CUDA kernels derive it on the device. The explicit rows' pattern is built where the op runs (on
// the device for CUDA: ops/cuda/dsa_common.cuh).
#include "ops/dsa_indexer.h"

#include <cmath>

#include "ops/cpu/dsa_indexer.h"
#include "ops/cuda/dsa_common.cuh"
#include "ops/cuda/dsa_indexer.cuh"
#include "ops/cuda/dsa_select.cuh"
#include "ops/dispatch.h"
#include "ops/dsa_common.h"
#include "ops/op_checks.h"

namespace hlm::ops {
namespace {

using dsa_detail::Pattern;

struct ScoreArgs {
  Tensor q, k, w;               // contiguous
  dsa_detail::QueryWindow win;  // the queries' rows of the batch
  std::vector<int64_t> cu;      // the whole batch's offsets (win.cu)
  int64_t T = 0, H = 0, D = 0;
  double scale = 0;  // resolved (d_I^-1/2 for opt.scale == 0)
  Device dev = Device::cpu;
};

ScoreArgs check_score_args(const Tensor& q, const Tensor& k, const Tensor& w, const Tensor& rows,
                           const SeqLayout& seqs, const IndexerScoreOptions& opt, const char* op,
                           const std::optional<int64_t>& q0) {
  detail::require_float_dev(q, op, "q");
  HLM_CHECK(q.dim() == 3, "{}: q must be [T, H_I, d_I], got {}", op, q.describe());
  HLM_CHECK(opt.pool >= 1, "{}: pool must be >= 1, got {}", op, opt.pool);
  ScoreArgs a;
  a.T = q.size(0), a.H = q.size(1), a.D = q.size(2);
  a.dev = detail::one_device(op, {q, "q"}, {{rows, "rows"}});
  a.win = dsa_detail::window_of(seqs, a.T, q0, op);
  a.cu = a.win.cu;
  const int64_t nkeys = dsa_detail::pool_offsets(a.cu, opt.pool).back();
  detail::require_like(k, q, {nkeys, a.D}, op,
                       opt.pool == 1 ? "k (token keys [T, d_I])" : "k (pooled keys [NP, d_I])",
                       "q");
  detail::require_like(w, q, {a.T, a.H}, op, "w", "q");
  if (opt.fp8)
    HLM_CHECK(opt.fp8_amax_floor > 0, "{}: fp8_amax_floor must be positive, got {}", op,
              opt.fp8_amax_floor);
  HLM_CHECK(opt.scale >= 0, "{}: scale must be positive (or 0 for d_I^-1/2), got {}", op,
            opt.scale);
  a.scale = opt.scale > 0 ? opt.scale : 1.0 / std::sqrt(double(a.D));
  a.q = q.contiguous(), a.k = k.contiguous(), a.w = w.contiguous();
  return a;
}

Tensor new_scores(const ScoreArgs& a, int64_t W) {
  return detail::new_output({a.T, W}, detail::compute_dtype(a.q.dtype()), a.dev);
}

// The checked pattern of explicit rows, where the op runs: on the host for the CPU reference, on
// the device for the CUDA kernels (the rows are not copied to the host).
struct RowsPattern {
  Pattern host;
  cuda::DsaPatternDev dev;
  int64_t W = 0;
};
RowsPattern rows_pattern_of(const ScoreArgs& a, const Tensor& rows, int64_t pool, const char* op,
                            bool with_inverse) {
  RowsPattern p;
  if (a.dev == Device::cpu) {
    p.host = dsa_detail::rows_pattern(rows, a.win, pool, op, "rows", with_inverse);
  } else {
    HLM_CUDA_PATH(op,
                  p.dev = cuda::device_rows_pattern(rows, a.win, pool, op, "rows", with_inverse));
  }
  p.W = rows.size(1);  // checked: rows is [T, W]
  return p;
}

IndexerScoreGrads new_grads(const ScoreArgs& a) {
  return {detail::new_output(a.q.shape(), a.q.dtype(), a.dev),
          detail::new_output(a.k.shape(), a.q.dtype(), a.dev),
          detail::new_output(a.w.shape(), a.q.dtype(), a.dev)};
}

}  // namespace

Tensor indexer_scores(const Tensor& q, const Tensor& k, const Tensor& w, const SeqLayout& seqs,
                      const IndexerScoreOptions& opt, int64_t W, std::optional<int64_t> q0) {
  const char* op = "indexer_scores";
  const ScoreArgs a = check_score_args(q, k, w, Tensor(), seqs, opt, op, q0);
  const int64_t need = dsa_detail::max_keys_per_doc(a.cu, opt.pool);
  HLM_CHECK(W == 0 || W >= need, "{}: W must be 0 or >= {} (the most keys of a document), got {}",
            op, need, W);
  Tensor out = new_scores(a, W == 0 ? need : W);
  if (a.dev == Device::cpu) {
    const Pattern p = dsa_detail::causal_pattern(a.win, opt.pool, out.size(1));
    cpu::indexer_scores(a.q, a.k, a.w, p, opt, a.scale, out, op);
  } else {
    HLM_CUDA_PATH(op, cuda::indexer_scores_dense(a.q, a.k, a.w, a.win, opt, a.scale, out, op));
  }
  return out;
}

Tensor indexer_scores_at(const Tensor& q, const Tensor& k, const Tensor& w, const SeqLayout& seqs,
                         const Tensor& rows, const IndexerScoreOptions& opt,
                         std::optional<int64_t> q0) {
  const char* op = "indexer_scores_at";
  const ScoreArgs a = check_score_args(q, k, w, rows, seqs, opt, op, q0);
  const RowsPattern p = rows_pattern_of(a, rows, opt.pool, op, false);
  Tensor out = new_scores(a, p.W);
  if (a.dev == Device::cpu) {
    cpu::indexer_scores(a.q, a.k, a.w, p.host, opt, a.scale, out, op);
  } else {
    HLM_CUDA_PATH(op, cuda::indexer_scores_rows(a.q, a.k, a.w, p.dev, opt, a.scale, out, op));
  }
  return out;
}

namespace {

// The checks of the scoring over cache rows (T queries, key rows k [R, d_I]).
ScoreArgs check_rows_args(const Tensor& q, const Tensor& k, const Tensor& w, int64_t T,
                          const IndexerScoreOptions& opt, const char* op) {
  detail::require_float_dev(q, op, "q");
  HLM_CHECK(q.dim() == 3 && q.size(0) == T, "{}: q must be [T = {}, H_I, d_I], got {}", op, T,
            q.describe());
  HLM_CHECK(k.defined() && k.dim() == 2, "{}: k must be [R, d_I], got {}", op,
            k.defined() ? k.describe() : "undefined");
  ScoreArgs a;
  a.T = q.size(0), a.H = q.size(1), a.D = q.size(2);
  detail::require_like(k, q, {k.size(0), a.D}, op, "k (key rows [R, d_I])", "q");
  detail::require_like(w, q, {a.T, a.H}, op, "w", "q");
  a.dev = q.device();
  HLM_CHECK(!opt.fp8 || opt.fp8_amax_floor > 0, "{}: fp8_amax_floor must be positive, got {}", op,
            opt.fp8_amax_floor);
  HLM_CHECK(opt.scale >= 0, "{}: scale must be positive (or 0 for d_I^-1/2), got {}", op,
            opt.scale);
  a.scale = opt.scale > 0 ? opt.scale : 1.0 / std::sqrt(double(a.D));
  a.q = q.contiguous(), a.k = k.contiguous(), a.w = w.contiguous();
  return a;
}

}  // namespace

Tensor indexer_scores_pattern(const Tensor& q, const Tensor& k, const Tensor& w,
                              const dsa_detail::Pattern& p_, const IndexerScoreOptions& opt) {
  const char* op = "indexer_scores_pattern";
  const ScoreArgs a = check_rows_args(q, k, w, p_.T, opt, op);
  Pattern p = p_;
  dsa_detail::check_pattern(p, k.size(0), op, "the key rows");
  Tensor out = new_scores(a, p.W);
  if (a.dev == Device::cpu) {
    cpu::indexer_scores(a.q, a.k, a.w, p, opt, a.scale, out, op);
  } else {
    HLM_CUDA_PATH(op, cuda::indexer_scores_rows(a.q, a.k, a.w, cuda::upload_pattern(p, false), opt,
                                                a.scale, out, op));
  }
  return out;
}

Tensor indexer_scores_cached(const Tensor& q, const Tensor& k, const Tensor& w,
                             const CachedSelection& s, const IndexerScoreOptions& opt) {
  const char* op = "indexer_scores_cached";
  const int64_t T = int64_t(s.ncand.size());
  const ScoreArgs a = check_rows_args(q, k, w, T, opt, op);
  HLM_CHECK(int64_t(s.pos.size()) == T && int64_t(s.seq_of.size()) == T && s.page > 0 && s.P >= 1 &&
                s.page % s.P == 0,
            "{}: T positions, candidate counts and sequences, and a page size that is a multiple "
            "of P; got {}, {} and {}, page {}, P {}",
            op, s.pos.size(), T, s.seq_of.size(), s.page, s.P);
  // Every page of every table holds page / P key rows of k.
  const int64_t per_page = s.page / s.P, R = k.size(0);
  for (const std::vector<int64_t>* pg : s.pages) {
    HLM_CHECK(pg != nullptr, "{}: a sequence has no page table", op);
    for (int64_t p : *pg)
      HLM_CHECK(p >= 0 && (p + 1) * per_page <= R,
                "{}: page {} holds key rows outside the {} rows of k", op, p, R);
  }
  int64_t W = 1;
  std::vector<int64_t> row_ptr(size_t(T + 1), 0);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t n = s.seq_of[size_t(t)], c = s.ncand[size_t(t)];
    HLM_CHECK(n >= 0 && n < int64_t(s.pages.size()) && c == (s.pos[size_t(t)] + 1) / s.P &&
                  int64_t(s.pages[size_t(n)]->size()) * s.page > s.pos[size_t(t)],
              "{}: query {} (position {}, sequence {}) has no page for its position or a wrong "
              "candidate count",
              op, t, s.pos[size_t(t)], n);
    W = std::max(W, c);
    row_ptr[size_t(t + 1)] = row_ptr[size_t(t)] + c;
  }
  Tensor out = new_scores(a, W);
  if (a.dev == Device::cpu) {
    Pattern p;
    p.T = T, p.W = W, p.nkeys = R;
    p.row_ptr = row_ptr;
    for (int64_t t = 0; t < T; ++t) {
      const std::vector<int64_t>& pg = *s.pages[size_t(s.seq_of[size_t(t)])];
      for (int64_t j = 0; j < s.ncand[size_t(t)]; ++j) {
        const int64_t tok = j * s.P;
        p.slot.push_back(int32_t(j));
        p.key.push_back((pg[size_t(tok / s.page)] * s.page + tok % s.page) / s.P);
        p.query.push_back(t);
      }
    }
    cpu::indexer_scores(a.q, a.k, a.w, p, opt, a.scale, out, op);
    return out;
  }
  HLM_CUDA_PATH(op, {
    cuda::DsaPatternDev d = cuda::pattern_for_entries(T, W, R, row_ptr);
    cuda::cached_candidates(Tensor::from_vector<int64_t>({T}, s.ncand).to(Device::cuda),
                            Tensor::from_vector<int64_t>({T}, s.seq_of).to(Device::cuda),
                            cuda::upload_page_table(s.pages), s.page, s.P, d.row_ptr, d.slot, d.key,
                            d.query);
    cuda::indexer_scores_rows(a.q, a.k, a.w, d, opt, a.scale, out, op);
  });
  return out;
}

namespace {

// Both overloads: nonfinite null throws on a non-finite CUDA value, else sets the flag.
Tensor fp8_emulate(const Tensor& x, const IndexerScoreOptions& opt, const char* op,
                   const char* what, Tensor* nonfinite) {
  detail::require_float_dev(x, op, what);
  HLM_CHECK(x.dim() >= 1 && opt.fp8_amax_floor > 0,
            "{}: fp8 emulation of {} needs a tensor [..., d] and a positive amax floor, got {} "
            "and {}",
            op, what, x.describe(), opt.fp8_amax_floor);
  if (x.is_cpu()) return cpu::indexer_fp8_emulate(x.contiguous(), opt, op, what);
  if (nonfinite)
    HLM_CHECK(nonfinite->defined() && nonfinite->dtype() == DType::i32 && nonfinite->numel() == 1 &&
                  nonfinite->device() == x.device() && nonfinite->is_contiguous(),
              "{}: the non-finite flag must be an i32 [1] tensor on x's device, got {}", op,
              nonfinite->defined() ? nonfinite->describe() : "undefined");
  Tensor out;
  HLM_CUDA_PATH(op, out = cuda::indexer_fp8_emulate(x.contiguous(), opt, op, what, nonfinite));
  return out;
}

}  // namespace

Tensor indexer_fp8_emulate(const Tensor& x, const IndexerScoreOptions& opt, const char* op,
                           const char* what) {
  return fp8_emulate(x, opt, op, what, nullptr);
}

Tensor indexer_fp8_emulate(const Tensor& x, const IndexerScoreOptions& opt, const char* op,
                           const char* what, Tensor& nonfinite) {
  return fp8_emulate(x, opt, op, what, &nonfinite);
}

IndexerScoreGrads indexer_scores_backward(const Tensor& q, const Tensor& k, const Tensor& w,
                                          const SeqLayout& seqs, const Tensor& d_scores_,
                                          const IndexerScoreOptions& opt,
                                          std::optional<int64_t> q0) {
  const char* op = "indexer_scores_backward";
  const ScoreArgs a = check_score_args(q, k, w, Tensor(), seqs, opt, op, q0);
  HLM_CHECK(d_scores_.defined() && d_scores_.dim() == 2, "{}: d_scores must be [T, W], got {}", op,
            d_scores_.describe());
  const int64_t need = dsa_detail::max_keys_per_doc(a.cu, opt.pool);
  HLM_CHECK(d_scores_.size(1) >= need, "{}: d_scores must have W >= {} columns, got {}", op, need,
            d_scores_.describe());
  detail::require_compute_like(d_scores_, a.q, {a.T, d_scores_.size(1)}, op, "d_scores", "q");
  const Tensor d_scores = d_scores_.contiguous();
  IndexerScoreGrads g = new_grads(a);
  if (a.dev == Device::cpu) {
    const Pattern p = dsa_detail::causal_pattern(a.win, opt.pool, d_scores.size(1));
    cpu::indexer_scores_backward(a.q, a.k, a.w, p, opt, a.scale, d_scores, g, op);
  } else {
    HLM_CUDA_PATH(op, cuda::indexer_scores_dense_backward(a.q, a.k, a.w, a.win, opt, a.scale,
                                                          d_scores, g, op));
  }
  return g;
}

IndexerScoreGrads indexer_scores_at_backward(const Tensor& q, const Tensor& k, const Tensor& w,
                                             const SeqLayout& seqs, const Tensor& rows,
                                             const Tensor& d_scores_,
                                             const IndexerScoreOptions& opt,
                                             std::optional<int64_t> q0) {
  const char* op = "indexer_scores_at_backward";
  const ScoreArgs a = check_score_args(q, k, w, rows, seqs, opt, op, q0);
  const RowsPattern p = rows_pattern_of(a, rows, opt.pool, op, true);
  detail::require_compute_like(d_scores_, a.q, {a.T, p.W}, op, "d_scores", "q");
  const Tensor d_scores = d_scores_.contiguous();
  IndexerScoreGrads g = new_grads(a);
  if (a.dev == Device::cpu) {
    cpu::indexer_scores_backward(a.q, a.k, a.w, p.host, opt, a.scale, d_scores, g, op);
  } else {
    HLM_CUDA_PATH(op, cuda::indexer_scores_rows_backward(a.q, a.k, a.w, p.dev, opt, a.scale,
                                                         d_scores, g, op));
  }
  return g;
}

Tensor topk_select(const Tensor& scores_, const SeqLayout& seqs, int64_t k, int64_t pool,
                   std::optional<int64_t> q0) {
  const char* op = "topk_select";
  detail::require_real(scores_, op, "scores");
  HLM_CHECK(scores_.dim() == 2, "{}: scores must be [T, W], got {}", op, scores_.describe());
  HLM_CHECK(k >= 1, "{}: k must be >= 1, got {}", op, k);
  HLM_CHECK(pool >= 1, "{}: pool must be >= 1, got {}", op, pool);
  const int64_t T = scores_.size(0);
  const dsa_detail::QueryWindow win = dsa_detail::window_of(seqs, T, q0, op);
  const int64_t need = dsa_detail::max_keys_per_doc(win.cu, pool);
  HLM_CHECK(scores_.size(1) >= need,
            "{}: scores must have W >= {} columns (the most {} of a "
            "document), got {}",
            op, need, pool == 1 ? "tokens" : "pools", scores_.describe());
  const Tensor scores = scores_.contiguous();
  Tensor out = detail::new_output({T, k}, DType::i32, scores.device());
  if (scores.is_cpu())
    cpu::topk_select(scores, win, k, pool, out);
  else
    HLM_CUDA_PATH(op, cuda::topk_select(scores, win, k, pool, out));
  return out;
}

}  // namespace hlm::ops
