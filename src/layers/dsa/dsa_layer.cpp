// DsaLayer (layers/dsa/dsa_layer.h) on CPU or CUDA tensors: MLA stages + indexer selection +
// sparse attention, forward and backward side by side.
//
// Forward:  p = project(x);  q_abs = absorb_query(p.q);  S = selection (indexer or causal);
//           (o_lat, lse) = sparse_attention(q_abs, p.kv, S);  y = output(o_lat)
//           [training, indexer loss] target = attention_target[_at](q_abs, p.kv[, S]) (detached);
//           loss = indexer.loss_value(target)
// Backward: do_lat = output_backward(dy);  (dq_abs, dkv) = sparse_attention_backward(.., S, ..);
//           dq = absorb_query_backward(dq_abs);  dx = project_backward(dq, dkv);
//           [loss] indexer.loss_backward(target, grad_scale): indexer parameters only (its input
//           gradients dh, dc_q are dropped: the indexer's inputs are detached).
#include "layers/dsa/dsa_layer.h"

#include <algorithm>

#include <cmath>

#include "core/profile.h"
#include "dist/comm.h"
#include "dist/context_parallel.h"
#include "ops/dsa_common.h"
#include "ops/dsa_indexer_loss.h"
#include "ops/dsa_sparse_attention.h"
#include "ops/tensor_ops.h"

namespace hlm {

void DsaLayerConfig::validate() const {
  mla.validate();
  HLM_CHECK(std::isfinite(indexer_loss_coeff) && indexer_loss_coeff >= 0,
            "DsaLayerConfig.indexer_loss_coeff must be finite and >= 0, got {}",
            indexer_loss_coeff);
  if (!indexer) return;
  indexer->validate();
  HLM_CHECK(mla.q_lora_rank > 0,
            "DsaLayerConfig: an indexer needs the MLA q latent c_q, but mla.q_lora_rank is 0");
  HLM_CHECK(indexer->hidden_size == mla.hidden_size,
            "DsaLayerConfig: indexer.hidden_size ({}) must equal mla.hidden_size ({})",
            indexer->hidden_size, mla.hidden_size);
  HLM_CHECK(indexer->q_lora_rank == mla.q_lora_rank,
            "DsaLayerConfig: indexer.q_lora_rank ({}) must equal mla.q_lora_rank ({})",
            indexer->q_lora_rank, mla.q_lora_rank);
  HLM_CHECK((indexer->dtype == DType::f64) == (mla.param_dtype == DType::f64),
            "DsaLayerConfig: indexer.dtype ({}) and mla.param_dtype ({}) must both be f64 or "
            "both not",
            dtype_name(indexer->dtype), dtype_name(mla.param_dtype));
}

namespace {

MlaConfig checked_mla(const DsaLayerConfig& cfg) {
  cfg.validate();
  MlaConfig m = cfg.mla;
  m.form = MlaForm::absorbed;
  return m;
}

std::string join(const std::string& path, const char* name) {
  return path.empty() ? std::string(name) : path + "." + name;
}

Tensor as_dt(const Tensor& t, DType dt) {
  return ops::as_dtype(t, dt);  // Tensor::to on the CPU, the conversion kernel on CUDA
}

}  // namespace

DsaLayer::DsaLayer(const DsaLayerConfig& cfg, const PrecisionPolicy& policy,
                   const std::string& path)
    : Mla(checked_mla(cfg), policy, path), lcfg_(cfg) {
  lcfg_.mla.form = MlaForm::absorbed;
  if (lcfg_.indexer) {
    indexer_ = std::make_unique<DsaIndexer>(*lcfg_.indexer, policy, join(path, "indexer"));
    add_child("indexer", indexer_.get());
  }
}

DsaIndexer& DsaLayer::indexer() {
  HLM_CHECK(indexer_ != nullptr, "DsaLayer::indexer: this layer has no indexer (dense mode)");
  return *indexer_;
}

DsaLayer::Output DsaLayer::forward(const Context& ctx, const Tensor& x, const SeqLayout& seqs,
                                   Saved* saved, const Tensor& given_indices,
                                   const dist::CpSlice* cp) const {
  HLM_CHECK(x.defined() && x.dim() == 2 && x.size(0) >= 1,
            "DsaLayer::forward: x must be [T >= 1, {}], got {}", config().hidden_size,
            x.defined() ? x.describe() : "undefined");
  seqs.check_tokens(x.size(0), "DsaLayer::forward", "x");
  const bool save = saved && ctx.training;
  Saved local;
  Saved* work = nullptr;
  if (ctx.training) work = (save && !ctx.recompute) ? saved : &local;
  Output out = forward_full(x, seqs, ctx.training, work, lcfg_.stage, given_indices, cp);
  if (save) {
    if (ctx.recompute) {
      *saved = Saved{};
      saved->x = x;
      saved->seqs = seqs;
      saved->cp = cp;
      saved->stage = lcfg_.stage;
      saved->has_loss = out.has_indexer_loss;
      saved->given = given_indices;
    }
    saved->full = !ctx.recompute;
  }
  return out;
}

// Checks a given selection: [T, W] integer on x's device, each entry -1 or a causal token of the
// query's own sequence, no duplicates in a row. Returns it as i32. On CUDA the entries are checked
// on the device by the attention op (the same rules, before anything is computed from them).
static Tensor check_given_indices(const Tensor& given, const ops::dsa_detail::QueryWindow& w,
                                  Device dev) {
  const int64_t T = w.T;
  HLM_CHECK(given.dim() == 2 && given.size(0) == T && given.size(1) >= 1 &&
                (given.dtype() == DType::i32 || given.dtype() == DType::i64),
            "DsaLayer::forward: given_indices must be i32/i64 [{}, W >= 1], got {}", T,
            given.describe());
  HLM_CHECK(given.device() == dev,
            "DsaLayer::forward: given_indices must be on x's device ({}), got {}", device_name(dev),
            given.describe());
  // An i32 selection on CUDA is checked on the device by the attention op; an i64 one goes through
  // the host (its values must be range-checked before they are narrowed).
  if (dev != Device::cpu && given.dtype() == DType::i32)
    return given.is_contiguous() ? given : given.clone();
  const Tensor g = given.to(Device::cpu).to(DType::i64).contiguous();
  const int64_t W = g.size(1);
  const int64_t* p = g.data<int64_t>();
  for (size_t m = 0; m < w.docs(); ++m)
    for (int64_t t = w.qcu[m]; t < w.qcu[m + 1]; ++t) {
      std::vector<int64_t> row;
      const int64_t first = w.first(m), self = w.q0 + t;
      for (int64_t j = 0; j < W; ++j) {
        const int64_t s = p[t * W + j];
        if (s == -1) continue;  // padding (any other negative value is an error, not padding)
        HLM_CHECK(s >= first && s <= self,
                  "DsaLayer::forward: given_indices[{}, {}] = {} is neither -1 (padding) nor a "
                  "causal token of the query's sequence [{}, {}]",
                  t, j, s, first, self);
        row.push_back(s);
      }
      std::sort(row.begin(), row.end());
      HLM_CHECK(std::adjacent_find(row.begin(), row.end()) == row.end(),
                "DsaLayer::forward: given_indices row {} selects a token twice", t);
    }
  const Tensor r = g.to(DType::i32);
  return dev == Device::cpu ? r : r.to(dev);
}

DsaLayer::Output DsaLayer::forward_full(const Tensor& x, const SeqLayout& seqs, bool training,
                                        Saved* s, DsaStage stage, const Tensor& given,
                                        const dist::CpSlice* cp) const {
  Context c;
  c.training = training && s != nullptr;
  const int64_t T = x.size(0), rkv = config().kv_lora_rank;
  const double scale = config().softmax_scale_value();
  seqs.check_tokens(T, "DsaLayer");
  // The layout the attention ops run over and this call's query rows: under context parallelism
  // the whole batch's and this rank's slice of it, else the call's own (no window).
  std::optional<int64_t> q0;
  std::vector<int64_t> starts;  // each local sequence's first position (context parallel)
  if (cp) {
    HLM_CHECK(T == cp->tokens(cp->rank()) && seqs.offsets() == cp->local().offsets(),
              "DsaLayer::forward: rank {} holds {} tokens of the context-parallel batch (and its "
              "local layout), got {}",
              cp->rank(), cp->tokens(cp->rank()), T);
    q0 = cp->begin(cp->rank());
    starts.assign(size_t(seqs.num_seqs()), 0);
    if (!starts.empty()) starts[0] = *q0 - cp->sequence_begin(*q0);
  }
  const SeqLayout& on = cp ? cp->global() : seqs;
  const ops::dsa_detail::QueryWindow win =
      ops::dsa_detail::window_of(on, T, q0, "DsaLayer::forward");
  if (s) {
    *s = Saved{};
    s->x = x;
    s->seqs = seqs;
    s->stage = stage;
    s->full = true;
    s->given = given;
    s->cp = cp;
  }
  profile::Scope ps_proj("projections");
  Projected p = project(c, x, seqs, s ? &s->proj : nullptr, cp ? &starts : nullptr);
  ps_proj.end();
  // The attention's operands (bf16 unless kv_b_proj's precision is native: attention_operand).
  profile::Scope ps_abs("absorb q");
  const Tensor q_abs = attention_operand(absorb_query(p.q));
  Tensor kv = attention_operand(p.kv);
  // Context parallel: every rank's queries read the whole batch's latent rows.
  if (cp) kv = dist::allgather_rows(cp->comm(), kv, cp->bounds());
  ps_abs.end();

  const bool want_loss = c.training && indexer_ && lcfg_.indexer_loss;
  const bool use_given = given.defined() && (stage == DsaStage::sparse || !indexer_);
  const bool run_indexer = indexer_ && ((stage == DsaStage::sparse && !use_given) || want_loss);
  DsaIndexer::Output sel;
  if (run_indexer) {
    HLM_PROFILE("indexer");
    sel = indexer_->forward(c, x, p.c_q, seqs, want_loss ? &s->indexer : nullptr, cp);
  }
  // The attended set: the given one, the indexer's selection, or every causal token. On CUDA
  // (and under context parallelism) the last needs no index tensor ([T, longest] would not fit
  // at long T): ops::causal_attention, and Output::indices stays undefined.
  const bool causal_set = !use_given && !(indexer_ && stage == DsaStage::sparse);
  const bool implicit = causal_set && (!x.is_cpu() || cp);
  Tensor indices;
  if (use_given)
    indices = check_given_indices(given, win, x.device());
  else if (!causal_set)
    indices = sel.indices;
  else if (!implicit)
    indices = Mla::causal_indices(seqs.offsets(), T);

  profile::Scope ps_att("attention");
  ops::SparseAttentionOut att = implicit
                                    ? ops::causal_attention(q_abs, kv, on, rkv, scale, q0)
                                    : ops::sparse_attention(q_abs, kv, indices, on, rkv, scale, q0);
  ps_att.end();
  profile::Scope ps_out("output");
  Output out;
  out.y = as_dt(output(c, attention_operand(att.out), s ? &s->out : nullptr), x.dtype());
  out.indices = indices;
  ps_out.end();

  if (want_loss) {
    HLM_PROFILE("indexer loss");
    const bool dense = stage == DsaStage::dense_warmup;
    // The attention ran over the indexer's own selection: its lse is the target's.
    const bool same_set = !use_given && !causal_set;
    Tensor target = dense ? ops::attention_target(q_abs, kv, on, scale, 0, q0)
                          : ops::attention_target_at(q_abs, kv, on, sel.indices, scale,
                                                     same_set ? att.lse : Tensor(), q0);
    if (tp_ && tp_->size() > 1) {  // the mean of the ranks' targets (set_tensor_parallel)
      target = dist::allreduce_from(*tp_, target);
      ops::scale_(target, 1.0 / double(tp_->size()));
    }
    IndexerLossOptions lo;
    lo.stage = dense ? IndexerLossStage::dense : IndexerLossStage::sparse;
    lo.coeff = lcfg_.indexer_loss_coeff;
    lo.reduction = lcfg_.indexer_loss_reduction;
    const IndexerLossResult r = indexer_->loss_value(c, target, lo, s->indexer);
    out.has_indexer_loss = true;
    out.indexer_loss = r.loss;
    out.indexer_loss_rows = r.rows;
    s->has_loss = true;
    s->target = target;
  }
  if (s) {
    s->p = p;
    s->q_abs = q_abs;
    s->indices = indices;
    s->lse = att.lse;
    if (cp) s->kv_all = kv;
  }
  return out;
}

Tensor DsaLayer::backward(const Context& ctx, const Tensor& dy, const Saved& saved,
                          double indexer_grad_scale) {
  HLM_CHECK(saved.x.defined(),
            "DsaLayer::backward: Saved is empty (run forward with ctx.training and a Saved first)");
  HLM_CHECK(std::isfinite(indexer_grad_scale),
            "DsaLayer::backward: indexer_grad_scale must be finite, got {}", indexer_grad_scale);
  const int64_t T = saved.x.size(0), D = config().hidden_size;
  HLM_CHECK(
      dy.defined() && dy.device() == saved.x.device() && dy.shape() == (Shape{T, D}) &&
          (dy.dtype() == DType::f64 || dy.dtype() == DType::f32 || dy.dtype() == DType::bf16),
      "DsaLayer::backward: dy must be an f64, f32 or bf16 tensor [{}, {}] on x's device ({}), "
      "got {}",
      T, D, device_name(saved.x.device()), dy.defined() ? dy.describe() : "undefined");
  (void)ctx;
  Tensor dx;
  if (saved.full) {
    dx = backward_full(dy, saved, indexer_grad_scale);
  } else {
    // Selective recompute: the same deterministic forward rebuilds every activation and the
    // selection.
    Saved full;
    forward_full(saved.x, saved.seqs, true, &full, saved.stage, saved.given, saved.cp);
    dx = backward_full(dy, full, indexer_grad_scale);
  }
  return as_dt(dx, saved.x.dtype());
}

Tensor DsaLayer::backward_full(const Tensor& dy, const Saved& s, double indexer_grad_scale) {
  Context c;
  const int64_t rkv = config().kv_lora_rank;
  const double scale = config().softmax_scale_value();
  profile::Scope ps_out("output");
  const Tensor dol =
      attention_operand(output_backward(c, ops::contiguous(as_dt(dy, compute_dtype())), s.out));
  ps_out.end();
  profile::Scope ps_att("attention");
  const Tensor kv = s.cp ? s.kv_all : attention_operand(s.p.kv);
  const Tensor o_lat = attention_operand(s.out.o_lat);
  const SeqLayout& on = s.cp ? s.cp->global() : s.seqs;
  const std::optional<int64_t> q0 =
      s.cp ? std::optional<int64_t>(s.cp->begin(s.cp->rank())) : std::nullopt;
  ops::SparseAttentionGrads g =
      s.indices.defined()
          ? ops::sparse_attention_backward(s.q_abs, kv, s.indices, on, rkv, scale, o_lat, s.lse,
                                           dol, q0)
          : ops::causal_attention_backward(s.q_abs, kv, on, rkv, scale, o_lat, s.lse, dol, q0);
  // Context parallel: this rank's latent rows' gradient, summed over every rank's queries in the
  // compute dtype (then rounded as the attention's gradients are: attention_operand).
  if (s.cp)
    g.dkv = dist::reduce_scatter_rows(s.cp->comm(), as_dt(g.dkv, compute_dtype()), s.cp->bounds());
  ps_att.end();
  // The attention's gradients as CUDA returns them (bf16 unless native) on both devices.
  profile::Scope ps_abs("absorb q");
  const Tensor dq = absorb_query_backward(attention_operand(g.dq), s.p.q);
  ps_abs.end();
  profile::Scope ps_proj("projections");
  Tensor dx = project_backward(c, dq, attention_operand(g.dkv), s.proj);
  ps_proj.end();
  // Context parallel: every rank runs the indexer backward (its key gradients are summed over the
  // group), also one whose share of the loss is 0.
  if (s.has_loss && (indexer_grad_scale != 0 || s.cp)) {
    HLM_PROFILE("indexer loss");
    IndexerLossOptions lo;
    lo.stage =
        s.stage == DsaStage::dense_warmup ? IndexerLossStage::dense : IndexerLossStage::sparse;
    lo.coeff = lcfg_.indexer_loss_coeff;
    lo.reduction = lcfg_.indexer_loss_reduction;
    lo.grad_scale = indexer_grad_scale;
    indexer_->loss_backward(c, s.target, lo, s.indexer);  // dh, dc_q dropped: detached inputs
  }
  return dx;
}

}  // namespace hlm
