// DsaLayer::forward_cached (layers/dsa/dsa_layer.h): the DSA layer over an inference cache, on the
// CPU or CUDA. The new tokens' latent rows and indexer keys are written into the cache first, then
// every query's set is selected among all its sequence's tokens and attended, through the ops of
// the training forward run over the cache's storage rows (storage rows in place of packed token
// ids: ops::indexer_scores_cached, ops::cached_sparse_attention, ops::sparse_attention_pattern), so
// the scores, the selection (ops/dsa_common.h's best_indices, the rule of topk_select) and each
// query's slot order are the training forward's. The sparse stage's candidates come from the page
// tables where the op runs (on CUDA the device builds them: no per-candidate list is copied), and
// its top-k, expansion to cache rows and attention run there too (nothing read back); the dense
// and given sets are built on the host.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/profile.h"
#include "layers/dsa/dsa_layer.h"
#include "ops/dsa_common.h"
#include "ops/dsa_indexer.h"
#include "ops/dsa_sparse_attention.h"
#include "ops/tensor_ops.h"

namespace hlm {

namespace {

constexpr const char* kOp = "DsaLayer::forward_cached";

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

// [a; b]: the rows of two contiguous [*, C] tensors of one device and dtype, stacked.
Tensor stack_rows(const Tensor& a, const Tensor& b) {
  Tensor out = Tensor::empty({a.size(0) + b.size(0), a.size(1)}, a.dtype(), a.device());
  Tensor top = out.slice(0, 0, a.size(0)), bottom = out.slice(0, a.size(0), out.size(0));
  if (a.size(0) > 0) ops::copy_into(top, a);
  if (b.size(0) > 0) ops::copy_into(bottom, b);
  return out;
}

}  // namespace

DsaLayer::Output DsaLayer::forward_cached(const Tensor& x, const SeqLayout& seqs, DsaCacheView& c,
                                          const Tensor& given) const {
  HLM_CHECK(x.defined() && x.device() == device() && c.kv.defined() && c.kv.device() == device(),
            "{}: x, the parameters and the cache must be on one device (x: {}, parameters on {}, "
            "cache on {})",
            kOp, x.defined() ? x.describe() : "undefined", device_name(device()),
            c.kv.defined() ? device_name(c.kv.device()) : "none");
  const Device dev = device();
  const int64_t T = x.size(0);
  const std::vector<int64_t>& cu = (seqs.check_tokens(T, kOp), seqs.offsets());
  const size_t N = cu.size() - 1;
  HLM_CHECK(c.slot.size() == N && c.start.size() == N && c.pages.size() == N && c.page > 0,
            "{}: the cache view describes {} sequences, the batch has {}", kOp, c.slot.size(), N);
  const DType cdt = compute_dtype(), adt = attention_dtype();
  const int64_t rkv = config().kv_lora_rank, Dkv = rkv + config().qk_rope_head_dim;
  HLM_CHECK(c.kv.dtype() == adt && c.kv.dim() == 2 && c.kv.size(1) == Dkv && c.kv.is_contiguous(),
            "{}: the cache's latent rows must be a contiguous {} [R, {}] tensor, got {}", kOp,
            dtype_name(adt), Dkv, c.kv.describe());
  for (size_t n = 0; n < N; ++n)
    HLM_CHECK(c.pages[n] && c.start[n] >= 0 &&
                  int64_t(c.pages[n]->size()) * c.page >= c.start[n] + (cu[n + 1] - cu[n]),
              "{}: sequence {} has pages for {} tokens, its {} cached and {} new need more", kOp, n,
              c.pages[n] ? int64_t(c.pages[n]->size()) * c.page : 0, c.start[n], cu[n + 1] - cu[n]);
  std::vector<int64_t> pos(static_cast<size_t>(T)), row(static_cast<size_t>(T));
  std::vector<size_t> seq_of(static_cast<size_t>(T));
  for (size_t n = 0; n < N; ++n)
    for (int64_t t = cu[n]; t < cu[n + 1]; ++t) {
      pos[size_t(t)] = c.start[n] + (t - cu[n]);
      seq_of[size_t(t)] = n;
      row[size_t(t)] = c.row(n, pos[size_t(t)]);
    }

  const Context ctx;
  profile::Scope ps_proj("projections");
  const Projected p = project(ctx, x, seqs, nullptr, &c.start);
  // The attention's operands as the training forward gives them (attention_operand: bf16 tensors
  // on CUDA under a bf16 operand, else the compute dtype holding bf16 values or not), and as the
  // cache keeps the latents.
  const Tensor q_abs = ops::contiguous(ops::as_dtype(attention_operand(absorb_query(p.q)), adt));
  ops::scatter_rows(c.kv, row, ops::as_dtype(attention_operand(p.kv), adt));
  ps_proj.end();

  // The output projection of the attended latents; indices: each query's set as positions
  // within its sequence, in the training forward's layout.
  auto finish = [&](const Tensor& o_lat, Tensor indices) {
    HLM_PROFILE("output");
    Output out;
    out.y = ops::as_dtype(output(ctx, attention_operand(o_lat), nullptr), x.dtype());
    out.indices = std::move(indices);
    return out;
  };
  int64_t W = 1;
  std::vector<int32_t> sel;
  const bool sparse = indexer_ && lcfg_.stage == DsaStage::sparse;
  if (given.defined()) {
    HLM_CHECK(given.dim() == 2 && given.size(0) == T && given.dtype() == DType::i32,
              "{}: given must be an i32 [{}, W] tensor of positions, got {}", kOp, T,
              given.describe());
    W = given.size(1);
    const Tensor g = given.is_cpu() ? given.contiguous() : given.to(Device::cpu);
    sel.assign(g.data<int32_t>(), g.data<int32_t>() + T * W);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < W; ++j) {
        const int32_t s = sel[size_t(t * W + j)];
        HLM_CHECK(s == -1 || (s >= 0 && s <= pos[size_t(t)]),
                  "{}: given[{}, {}] = {} is neither -1 nor a position in [0, {}]", kOp, t, j, s,
                  pos[size_t(t)]);
      }
  } else if (sparse) {
    profile::Scope ps_ix("indexer");
    const DsaIndexer& ix = *indexer_;
    const IndexerConfig& ic = ix.config();
    const int64_t P = ic.kpool, K = ic.topk, d = ic.head_dim;
    HLM_CHECK(c.keys.defined() && c.keys.dtype() == cdt && c.keys.dim() == 2 &&
                  c.keys.size(1) == d && c.keys.is_contiguous() && c.keys.device() == dev &&
                  c.page % P == 0,
              "{}: the cache's indexer keys must be a contiguous {} [R, {}] tensor (page {} a "
              "multiple of {}), got {}",
              kOp, dtype_name(cdt), d, c.page, P, c.keys.defined() ? c.keys.describe() : "none");
    const DsaIndexer::TokenProjection tp = ix.project_tokens(x, p.c_q, pos);
    ops::IndexerScoreOptions so = ix.score_options();
    // The FP8 emulation is per query head and per key row: applied here once, to the new rows.
    // On CUDA its finiteness check is not read back (that would wait for the device): a
    // non-finite q or k sets `nonfinite`, which makes this layer's output NaN, and the sampler
    // then reports a non-finite logit.
    Tensor nonfinite;
    if (so.fp8 && dev == Device::cuda) nonfinite = Tensor::zeros({1}, DType::i32, dev);
    auto emulate = [&](const Tensor& v, const char* what) {
      if (!so.fp8) return ops::contiguous(v);
      return nonfinite.defined() ? ops::indexer_fp8_emulate(v, so, kOp, what, nonfinite)
                                 : ops::indexer_fp8_emulate(v, so, kOp, what);
    };
    const Tensor qs = emulate(tp.q, "q");
    if (P == 1) {
      ops::scatter_rows(c.keys, row, emulate(tp.k, "k"));
    } else {
      // A pool that completes becomes one pooled key row: its tokens come from this call's new
      // rows or, when cached before, from the slot's tail (the incomplete pool's keys and gates).
      // Then the tail keeps each sequence's last P tokens, token r at row r % P: the incomplete
      // pool's, and a completed pool's when a rejected draft completed it (the next call's pool
      // takes its first tokens from there).
      HLM_CHECK(c.tail_k.defined() && c.tail_k.dim() == 3 && c.tail_k.size(1) == P &&
                    c.tail_k.size(2) == d && c.tail_gate.shape() == c.tail_k.shape(),
                "{}: the cache's KPool tails must be [slots, {}, {}]", kOp, P, d);
      const int64_t SP = c.tail_k.size(0) * P;
      const Tensor k = ops::contiguous(tp.k), gate = ops::contiguous(tp.gate);
      Tensor tail_k = c.tail_k.view({SP, d}), tail_g = c.tail_gate.view({SP, d});
      std::vector<int64_t> from, pool_rows, tail_to, tail_from;
      for (size_t n = 0; n < N; ++n) {
        const int64_t s0 = c.start[n], s1 = s0 + (cu[n + 1] - cu[n]), slot = c.slot[n];
        for (int64_t j = s0 / P; j < s1 / P; ++j) {
          pool_rows.push_back(c.pool_row(n, j, P));
          for (int64_t i = 0; i < P; ++i) {
            const int64_t r = j * P + i;  // [tails; new rows]
            from.push_back(r < s0 ? slot * P + i : SP + cu[n] + (r - s0));
          }
        }
        for (int64_t r = std::max(s0, s1 - P); r < s1; ++r) {
          tail_to.push_back(slot * P + r % P);
          tail_from.push_back(cu[n] + (r - s0));
        }
      }
      if (!pool_rows.empty()) {
        const Tensor pk = ops::gather_rows(stack_rows(tail_k, k), from);
        const Tensor pg = ops::gather_rows(stack_rows(tail_g, gate), from);
        ops::scatter_rows(c.keys, pool_rows, emulate(ix.pool_keys(pk, pg), "k"));
      }
      ops::scatter_rows(tail_k, tail_to, ops::gather_rows(k, tail_from));
      ops::scatter_rows(tail_g, tail_to, ops::gather_rows(gate, tail_from));
    }
    so.fp8 = false;  // applied above
    so.pool = P;
    // Candidates of query t: its tokens 0..r (P = 1) or complete pools j < (r + 1) / P, scored
    // from the page tables (on CUDA no per-candidate list crosses to the device).
    ops::CachedSelection cs;
    cs.pos = pos;
    cs.ncand.resize(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) cs.ncand[size_t(t)] = (pos[size_t(t)] + 1) / P;
    for (size_t n : seq_of) cs.seq_of.push_back(int64_t(n));
    cs.pages = c.pages;
    cs.page = c.page;
    cs.K = K;
    cs.P = P;
    cs.tail = P > 1 && ic.kpool_always_select_tail;
    const Tensor scores = ops::indexer_scores_cached(qs, c.keys, ops::contiguous(tp.w), cs, so);
    // The selection and the attention in one op (on the device for CUDA: nothing read back).
    ps_ix.end();
    profile::Scope ps_att("attention");
    ops::CachedAttentionOut att =
        ops::cached_sparse_attention(q_abs, c.kv, scores, cs, rkv, config().softmax_scale_value());
    if (nonfinite.defined()) ops::nan_if_flagged_(att.out, nonfinite);
    ps_att.end();
    return finish(att.out, std::move(att.sel));
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
  const ops::SparseAttentionOut att = ops::sparse_attention_pattern(
      q_abs, c.kv, pattern_of(rows, T, W), rkv, config().softmax_scale_value());
  ps_att.end();
  return finish(att.out, Tensor::from_vector<int32_t>({T, W}, sel));
}

}  // namespace hlm
