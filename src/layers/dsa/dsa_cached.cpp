// DsaLayer::forward_cached (layers/dsa/dsa_layer.h): the DSA layer over an inference cache, on
// the CPU. The new tokens' latent rows and indexer keys are written into the cache first, then
// every query's set is selected among all its sequence's tokens and attended, through the CPU
// ops of the training forward run over the cache's storage rows (a pattern of storage rows in
// place of packed token ids), so the scores, the selection (ops/dsa_common.h's best_indices, the
// rule of topk_select) and each query's slot order are the training forward's.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/profile.h"
#include "layers/dsa/dsa_layer.h"
#include "ops/cpu/dsa_indexer.h"
#include "ops/cpu/dsa_sparse_attention.h"
#include "ops/dsa_common.h"
#include "ops/tensor_ops.h"

namespace hlm {

namespace {

constexpr const char* kOp = "DsaLayer::forward_cached";

// Row r of a contiguous 2-D (or [rows, ...]) CPU tensor, as bytes.
uint8_t* row_ptr(const Tensor& t, int64_t r) {
  return static_cast<uint8_t*>(t.raw()) + size_t(r) * (t.nbytes() / size_t(t.size(0)));
}

// dst row dr = src row sr (the same row width and dtype).
void put_row(const Tensor& dst, int64_t dr, const Tensor& src, int64_t sr) {
  std::memcpy(row_ptr(dst, dr), row_ptr(src, sr), src.nbytes() / size_t(src.size(0)));
}

// A pattern from rows [T, W] of storage rows (-1 = empty slot).
ops::dsa_detail::Pattern pattern_of(const std::vector<int64_t>& rows, int64_t T, int64_t W) {
  ops::dsa_detail::Pattern p;
  p.T = T;
  p.W = W;
  p.row_ptr.assign(size_t(T + 1), 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < W; ++j) {
      const int64_t r = rows[size_t(t * W + j)];
      if (r < 0) continue;
      p.slot.push_back(int32_t(j));
      p.key.push_back(r);
      p.query.push_back(t);
    }
    p.row_ptr[size_t(t + 1)] = p.entries();
  }
  return p;
}

}  // namespace

DsaLayer::Output DsaLayer::forward_cached(const Tensor& x, const SeqLayout& seqs, DsaCacheView& c,
                                          const Tensor& given) const {
  HLM_CHECK(x.defined() && x.is_cpu() && device() == Device::cpu,
            "{}: inference over a cache runs on the CPU (x: {}, parameters on {})", kOp,
            x.defined() ? x.describe() : "undefined", device_name(device()));
  const int64_t T = x.size(0);
  const std::vector<int64_t>& cu = (seqs.check_tokens(T, kOp), seqs.offsets());
  const size_t N = cu.size() - 1;
  HLM_CHECK(c.slot.size() == N && c.start.size() == N && c.pages.size() == N && c.page > 0,
            "{}: the cache view describes {} sequences, the batch has {}", kOp, c.slot.size(), N);
  const DType cdt = compute_dtype();
  const int64_t rkv = config().kv_lora_rank, Dkv = rkv + config().qk_rope_head_dim;
  HLM_CHECK(c.kv.defined() && c.kv.dtype() == cdt && c.kv.dim() == 2 && c.kv.size(1) == Dkv &&
                c.kv.is_contiguous(),
            "{}: the cache's latent rows must be a contiguous {} [R, {}] tensor, got {}", kOp,
            dtype_name(cdt), Dkv, c.kv.defined() ? c.kv.describe() : "undefined");
  for (size_t n = 0; n < N; ++n)
    HLM_CHECK(c.pages[n] && c.start[n] >= 0 &&
                  int64_t(c.pages[n]->size()) * c.page >= c.start[n] + (cu[n + 1] - cu[n]),
              "{}: sequence {} has pages for {} tokens, its {} cached and {} new need more", kOp, n,
              c.pages[n] ? int64_t(c.pages[n]->size()) * c.page : 0, c.start[n], cu[n + 1] - cu[n]);
  std::vector<int64_t> pos(static_cast<size_t>(T));
  std::vector<size_t> seq_of(static_cast<size_t>(T));
  for (size_t n = 0; n < N; ++n)
    for (int64_t t = cu[n]; t < cu[n + 1]; ++t) {
      pos[size_t(t)] = c.start[n] + (t - cu[n]);
      seq_of[size_t(t)] = n;
    }

  const Context ctx;
  profile::Scope ps_proj("projections");
  const Projected p = project(ctx, x, seqs, nullptr, &c.start);
  const Tensor q_abs = ops::contiguous(attention_operand(absorb_query(p.q)));
  const Tensor kv = ops::contiguous(attention_operand(p.kv));
  for (int64_t t = 0; t < T; ++t) put_row(c.kv, c.row(seq_of[size_t(t)], pos[size_t(t)]), kv, t);
  ps_proj.end();

  // Each query's set as positions within its sequence, in the training forward's layout.
  int64_t W = 1;
  std::vector<int32_t> sel;
  const bool sparse = indexer_ && lcfg_.stage == DsaStage::sparse;
  if (given.defined()) {
    HLM_CHECK(
        given.is_cpu() && given.dim() == 2 && given.size(0) == T && given.dtype() == DType::i32,
        "{}: given must be a CPU i32 [{}, W] tensor of positions, got {}", kOp, T,
        given.describe());
    W = given.size(1);
    const Tensor g = given.contiguous();
    sel.assign(g.data<int32_t>(), g.data<int32_t>() + T * W);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < W; ++j) {
        const int32_t s = sel[size_t(t * W + j)];
        HLM_CHECK(s == -1 || (s >= 0 && s <= pos[size_t(t)]),
                  "{}: given[{}, {}] = {} is neither -1 nor a position in [0, {}]", kOp, t, j, s,
                  pos[size_t(t)]);
      }
  } else if (sparse) {
    HLM_PROFILE("indexer");
    const DsaIndexer& ix = *indexer_;
    const IndexerConfig& ic = ix.config();
    const int64_t P = ic.kpool, K = ic.topk, d = ic.head_dim;
    HLM_CHECK(c.keys.defined() && c.keys.dtype() == cdt && c.keys.dim() == 2 &&
                  c.keys.size(1) == d && c.keys.is_contiguous() && c.page % P == 0,
              "{}: the cache's indexer keys must be a contiguous {} [R, {}] tensor (page {} a "
              "multiple of {}), got {}",
              kOp, dtype_name(cdt), d, c.page, P, c.keys.defined() ? c.keys.describe() : "none");
    const DsaIndexer::TokenProjection tp = ix.project_tokens(x, p.c_q, pos);
    ops::IndexerScoreOptions so = ix.score_options();
    // The FP8 emulation is per query head and per key row: applied here once, to the new rows.
    auto emulate = [&](const Tensor& v, const char* what) {
      return so.fp8 ? ops::cpu::indexer_fp8_emulate(ops::contiguous(v), so, kOp, what)
                    : ops::contiguous(v);
    };
    const Tensor qs = emulate(tp.q, "q");
    if (P == 1) {
      const Tensor k = emulate(tp.k, "k");
      for (int64_t t = 0; t < T; ++t)
        put_row(c.keys, c.row(seq_of[size_t(t)], pos[size_t(t)]), k, t);
    } else {
      // The incomplete pool's keys and gates wait in the slot's tail; a pool that completes
      // becomes one pooled key row.
      const Tensor k = ops::contiguous(tp.k), gate = ops::contiguous(tp.gate);
      for (int64_t t = 0; t < T; ++t) {
        const size_t n = seq_of[size_t(t)];
        const int64_t r = pos[size_t(t)], j = r % P;
        const Tensor tk = c.tail_k.select(0, c.slot[n]), tg = c.tail_gate.select(0, c.slot[n]);
        put_row(tk, j, k, t);
        put_row(tg, j, gate, t);
        if (j == P - 1)
          put_row(c.keys, c.pool_row(n, r / P, P), emulate(ix.pool_key(tk, tg), "k"), 0);
      }
    }
    so.fp8 = false;  // applied above
    so.pool = P;
    // Candidates of query t: its tokens 0..r (P = 1) or complete pools j < (r + 1) / P.
    std::vector<int64_t> ncand(static_cast<size_t>(T));
    int64_t Ws = 1;
    for (int64_t t = 0; t < T; ++t) {
      ncand[size_t(t)] = (pos[size_t(t)] + 1) / P;
      Ws = std::max(Ws, ncand[size_t(t)]);
    }
    std::vector<int64_t> rows(static_cast<size_t>(T * Ws), -1);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < ncand[size_t(t)]; ++j)
        rows[size_t(t * Ws + j)] =
            P == 1 ? c.row(seq_of[size_t(t)], j) : c.pool_row(seq_of[size_t(t)], j, P);
    Tensor scores = Tensor::empty({T, Ws}, cdt);
    ops::cpu::indexer_scores(qs, c.keys, ops::contiguous(tp.w), pattern_of(rows, T, Ws), so,
                             so.scale > 0 ? so.scale : 1.0 / std::sqrt(double(d)), scores, kOp);
    const bool tail = P > 1 && ic.kpool_always_select_tail;
    W = P == 1 ? K : K + (tail ? P - 1 : 0);
    sel.assign(size_t(T * W), -1);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int32_t> best;
      if (cdt == DType::f64)
        ops::dsa_detail::best_indices(scores.data<double>() + t * Ws, ncand[size_t(t)], K / P,
                                      best);
      else
        ops::dsa_detail::best_indices(scores.data<float>() + t * Ws, ncand[size_t(t)], K / P, best);
      int32_t* row = sel.data() + t * W;
      for (size_t g = 0; g < best.size(); ++g)
        for (int64_t j = 0; j < P; ++j) row[int64_t(g) * P + j] = int32_t(best[g] * P + j);
      if (tail) {
        const int64_t r = pos[size_t(t)], first = (r + 1) / P * P;
        for (int64_t j = 0; j + 1 < P; ++j)
          if (first + j <= r) row[K + j] = int32_t(first + j);
      }
    }
  } else {
    // Every causal token, ascending (Mla::causal_indices).
    for (int64_t t = 0; t < T; ++t) W = std::max(W, pos[size_t(t)] + 1);
    sel.assign(size_t(T * W), -1);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j <= pos[size_t(t)]; ++j) sel[size_t(t * W + j)] = int32_t(j);
  }

  profile::Scope ps_att("attention");
  std::vector<int64_t> rows(sel.size(), -1);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < W; ++j) {
      const int32_t s = sel[size_t(t * W + j)];
      if (s >= 0) rows[size_t(t * W + j)] = c.row(seq_of[size_t(t)], s);
    }
  Tensor o_lat = Tensor::empty({T, config().num_heads, rkv}, cdt);
  Tensor lse = Tensor::empty({T, config().num_heads}, cdt);
  ops::cpu::sparse_attention(q_abs, c.kv, pattern_of(rows, T, W), rkv,
                             config().softmax_scale_value(), o_lat, lse);
  ps_att.end();
  HLM_PROFILE("output");
  Output out;
  out.y = ops::as_dtype(output(ctx, attention_operand(o_lat), nullptr), x.dtype());
  out.indices = Tensor::from_vector<int32_t>({T, W}, sel);
  return out;
}

}  // namespace hlm
