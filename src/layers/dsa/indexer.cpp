// DsaIndexer (layers/dsa/indexer.h): forward, selection, the KL loss and its analytic backward.
//
// Backward chain (docs/dsa.md, "Indexer KL loss" and "Pool-level KL for KPool: our design"), for
// the loss L of the chosen stage:
//   dI                = ops::indexer_kl_loss(...).d_scores * grad_scale      [T, W]
//   (dq, dkey, dw)    = ops::indexer_scores[_at]_backward(q, key, w, dI)
//   d weights_proj(h) = dw * H_I^-1/2                          -> weights_proj.backward -> dh
//   dq                <- Hd dq (Hd symmetric orthogonal: its own transpose), then RoPE^-1
//                     -> wq_b.backward -> dc_q
//   P = 1:  dk        <- Hd dkey, then RoPE^-1
//   P > 1:  dpooled   <- Hd dkey; (dk, dgate, dape) = ops::kpool_compress_backward(k, gate, ape,
//           dpooled); dk <- RoPE^-1 dk; dgate -> gate.backward -> dh; ape.grad += dape
//   LayerNorm backward (k_norm.weight/bias grads +=) -> d wk(h) -> wk.backward -> dh
// dh sums its contributions in the fixed order weights_proj, wk, gate. RoPE^-1 is the rotation by
// the negated angle (RoPE is orthogonal per pair). Parameter gradients accumulate (+=) in the
// gradient dtype (f32, or f64 for f64 parameters); dh and dc_q are written (=).
#include "layers/dsa/indexer.h"

#include <cmath>
#include <optional>
#include <vector>

#include "core/rng.h"
#include "dist/context_parallel.h"
#include "ops/dsa_kpool.h"
#include "ops/hadamard.h"
#include "ops/layernorm.h"
#include "ops/rope.h"
#include "ops/tensor_ops.h"

namespace hlm {

// ---------------------------------------------------------------------------------------------
// Config

namespace {

bool is_pow2(int64_t n) {
  return n > 0 && (n & (n - 1)) == 0;
}

}  // namespace

void IndexerConfig::validate() const {
  auto positive = [](int64_t v, const char* name, const char* hf) {
    HLM_CHECK(v >= 1, "IndexerConfig: {} ({}) must be >= 1, got {}", name, hf, v);
  };
  positive(hidden_size, "hidden_size", "hidden_size");
  positive(q_lora_rank, "q_lora_rank", "q_lora_rank");
  positive(n_heads, "n_heads", "index_n_heads");
  positive(head_dim, "head_dim", "index_head_dim");
  positive(topk, "topk", "index_topk");
  HLM_CHECK(kpool >= 1, "IndexerConfig: kpool (index_kpool) must be >= 1, got {}", kpool);
  HLM_CHECK(topk % kpool == 0,
            "IndexerConfig: topk (index_topk) = {} must be divisible by kpool (index_kpool) = {}",
            topk, kpool);
  HLM_CHECK(!hadamard || is_pow2(head_dim),
            "IndexerConfig: head_dim (index_head_dim) = {} must be a power of two for the "
            "Hadamard rotation (hadamard = true)",
            head_dim);
  HLM_CHECK(rope_dim >= 0 && rope_dim % 2 == 0 && rope_dim <= head_dim,
            "IndexerConfig: rope_dim (qk_rope_head_dim) must be even and in [0, head_dim = {}], "
            "got {}",
            head_dim, rope_dim);
  HLM_CHECK(rope_dim == 0 || (std::isfinite(rope_theta) && rope_theta > 0),
            "IndexerConfig: rope_theta must be a positive number when rope_dim > 0, got {}",
            rope_theta);
  HLM_CHECK(std::isfinite(k_norm_eps) && k_norm_eps > 0,
            "IndexerConfig: k_norm_eps must be a positive number, got {}", k_norm_eps);
  HLM_CHECK(dtype == DType::f64 || dtype == DType::f32 || dtype == DType::bf16,
            "IndexerConfig: dtype must be f64, f32 or bf16, got {}", dtype_name(dtype));
  HLM_CHECK(std::isfinite(init_std) && init_std >= 0,
            "IndexerConfig: init_std must be a finite number >= 0, got {}", init_std);
}

int64_t IndexerConfig::index_width() const {
  return (kpool > 1 && kpool_always_select_tail) ? topk + kpool - 1 : topk;
}

// ---------------------------------------------------------------------------------------------
// Elementwise helpers (contiguous f32 / f64 tensors; on CUDA through ops/tensor_ops.h, which runs
// Tensor's own copies on the CPU)

namespace {

template <class F>
void dispatch(DType dt, F&& f) {
  if (dt == DType::f64)
    f(double{});
  else if (dt == DType::f32)
    f(float{});
  else
    HLM_FAIL("DsaIndexer: internal compute tensor must be f32 or f64, got {}", dtype_name(dt));
}

// A contiguous tensor of dtype dt holding t's values (t itself when it already is one).
Tensor as_dt(const Tensor& t, DType dt) {
  return ops::contiguous(ops::as_dtype(t, dt));
}

// A fresh contiguous copy in dtype dt (for in-place transforms).
Tensor copy_as(const Tensor& t, DType dt) {
  Tensor out = Tensor::empty(t.shape(), dt, t.device());
  ops::copy_into(out, t);
  return out;
}

// x *= s: on the CPU the product in x's dtype (s rounded to it first); CUDA forms it in f64 and
// rounds once (ops::scale_), which can differ in the last place.
void scale_inplace(Tensor& x, double s) {
  if (!x.is_cpu()) {
    ops::scale_(x, s);
    return;
  }
  dispatch(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* p = x.data<T>();
    const T f = T(s);
    for (int64_t i = 0, n = x.numel(); i < n; ++i) p[i] *= f;
  });
}

// a += b (same shape and dtype, contiguous), one addition per element.
void add_inplace(Tensor& a, const Tensor& b) {
  HLM_CHECK(a.shape() == b.shape() && a.dtype() == b.dtype(),
            "DsaIndexer: internal add of {} and {}", a.describe(), b.describe());
  ops::add_(a, b);
}

// Param::grad += g (allocated as zeros of grad_dtype_for(value) when undefined).
void accumulate_grad(Param& p, const Tensor& g) {
  const DType gd = grad_dtype_for(p.value.dtype());
  if (!p.grad.defined()) p.grad = Tensor::zeros(p.value.shape(), gd, p.value.device());
  HLM_CHECK(p.grad.shape() == p.value.shape() && p.grad.is_contiguous() &&
                (p.grad.dtype() == DType::f32 || p.grad.dtype() == DType::f64),
            "DsaIndexer: gradient of '{}' is {}, expected a contiguous f32/f64 {}", p.name,
            p.grad.describe(), shape_str(p.value.shape()));
  HLM_CHECK(g.shape() == p.value.shape(), "DsaIndexer: gradient for '{}' has shape {}, expected {}",
            p.name, shape_str(g.shape()), shape_str(p.value.shape()));
  add_inplace(p.grad, as_dt(g, p.grad.dtype()));
}

// RoPE on channels [0, dr) of x [T, nh, d] or [T, d] (in place, ops::rope_inplace), position
// pos[t]: angle_i = pos * theta^(-2i / dr), i < dr / 2, formed in f64 (cos / sin rounded to the
// dtype); pairs (2i, 2i + 1) when interleaved, (i, i + dr / 2) otherwise (NeoX); with inverse
// the transposed rotation.
void rope_rows(Tensor& x, const std::vector<int64_t>& pos, int64_t dr, double theta,
               bool interleave, bool inverse) {
  if (dr == 0) return;
  std::vector<double> inv(size_t(dr / 2));
  for (int64_t i = 0; i < dr / 2; ++i)
    inv[size_t(i)] = std::pow(theta, -2.0 * double(i) / double(dr));
  ops::RopeOptions o;
  o.rope_dim = dr;
  o.interleave = interleave;
  o.inverse = inverse;
  o.angle = ops::RopeAngle::f64;
  ops::rope_inplace(x, Tensor::from_vector<int64_t>({int64_t(pos.size())}, pos).to(x.device()),
                    Tensor::from_vector<double>({dr / 2}, inv).to(x.device()), o);
}

std::vector<int64_t> positions_of(const std::vector<int64_t>& cu) {
  std::vector<int64_t> pos(size_t(cu.back()));
  for (size_t n = 0; n + 1 < cu.size(); ++n)
    for (int64_t t = cu[n]; t < cu[n + 1]; ++t) pos[size_t(t)] = t - cu[n];
  return pos;
}

// Each token's position in its sequence: of the call's own layout, or (context parallel) of the
// whole batch's for this rank's slice.
std::vector<int64_t> positions_of(const SeqLayout& seqs, const dist::CpSlice* cp) {
  if (!cp) return positions_of(seqs.offsets());
  const int64_t b = cp->begin(cp->rank());
  std::vector<int64_t> pos(size_t(cp->tokens(cp->rank())));
  for (size_t t = 0; t < pos.size(); ++t) {
    const int64_t g = b + int64_t(t);
    pos[t] = g - cp->sequence_begin(g);
  }
  return pos;
}

// The layout the ops run over and the query rows of this call: the whole batch's layout and this
// rank's first token under context parallelism, else the call's own layout (no window).
struct OpRows {
  const SeqLayout& seqs;
  std::optional<int64_t> q0;
};
OpRows op_rows(const SeqLayout& own, const dist::CpSlice* cp) {
  if (!cp) return {own, std::nullopt};
  return {cp->global(), cp->begin(cp->rank())};
}

void check_input(const Tensor& x, int64_t width, Device dev, const char* name, const char* what) {
  HLM_CHECK(x.defined(), "DsaIndexer::forward: {} is undefined", name);
  HLM_CHECK(x.device() == dev,
            "DsaIndexer::forward: {} must be on the parameters' device ({}), got {}", name,
            device_name(dev), x.describe());
  HLM_CHECK(x.dtype() == DType::f64 || x.dtype() == DType::f32 || x.dtype() == DType::bf16,
            "DsaIndexer::forward: {} must be f64, f32 or bf16, got {}", name, x.describe());
  HLM_CHECK(x.dim() == 2 && x.size(1) == width,
            "DsaIndexer::forward: {} must be [T, {} = {}], got {}", name, what, width,
            x.describe());
}

Tensor init_normal(const Shape& shape, DType dt, uint64_t seed, uint64_t stream, double std) {
  Rng rng(seed, stream);
  Tensor t = randn(shape, DType::f64, rng, std);
  return t.to(dt);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Module

DsaIndexer::DsaIndexer(const IndexerConfig& cfg, const PrecisionPolicy& policy,
                       const std::string& path)
    : cfg_(cfg), path_(path) {
  cfg_.validate();
  const int64_t D = cfg_.hidden_size, H = cfg_.n_heads, d = cfg_.head_dim, P = cfg_.kpool;
  const DType dt = cfg_.dtype;
  auto sub = [&](const char* name) {
    return path_.empty() ? std::string(name) : path_ + "." + name;
  };

  wq_b_.init(cfg_.q_lora_rank, H * d, false,
             policy.resolve(sub("wq_b"), ModuleRole::indexer_qk_proj), dt);
  wk_.init(D, d, false, policy.resolve(sub("wk"), ModuleRole::indexer_qk_proj), dt);
  GemmPrecision wp = policy.resolve(sub("weights_proj"), ModuleRole::indexer_weights);
  if (cfg_.weights_proj_fp32) wp = GemmPrecision{};  // native: exact FP32 (f64 in f64 mode)
  weights_proj_.init(D, H, false, wp, dt);
  add_child("wq_b", &wq_b_);
  add_child("wk", &wk_);
  auto param = [&](const std::string& name, Tensor v) -> Param& {
    const bool keep = is_keep_fp32_name(name);
    return add_param(name, std::move(v), keep, keep);
  };
  k_norm_w_ = &param("k_norm.weight", Tensor::full({d}, 1.0, dt));
  k_norm_b_ = &param("k_norm.bias", Tensor::zeros({d}, dt));
  k_norm_b_->no_weight_decay = true;
  add_child("weights_proj", &weights_proj_);

  wq_b_.weight().value = init_normal({H * d, cfg_.q_lora_rank}, dt, cfg_.seed, 1, cfg_.init_std);
  wk_.weight().value = init_normal({d, D}, dt, cfg_.seed, 2, cfg_.init_std);
  weights_proj_.weight().value = init_normal({H, D}, dt, cfg_.seed, 3, cfg_.init_std);

  if (P > 1) {
    gate_ =
        &param("index_kpool_compress_gate", init_normal({d, D}, dt, cfg_.seed, 4, cfg_.init_std));
    // keep_fp32 through is_keep_fp32_name ("index_kpool_compress_ape"); f64 in f64 mode.
    const DType adt = hlm::compute_dtype(dt);
    ape_ = &param("index_kpool_compress_ape", Tensor::zeros({P, d}, adt));
    gate_lin_.init(D, d, false,
                   policy.resolve(sub("index_kpool_compress_gate"), ModuleRole::indexer_kpool), dt);
  }
  fp8_scoring_ = cfg_.fp8_scoring || (P > 1 && policy.dsa_indexer_kpool_use_quantization);
}

DType DsaIndexer::compute_dtype() const {
  return hlm::compute_dtype(wq_b_.weight_value().dtype());
}

ops::IndexerScoreOptions DsaIndexer::score_options() const {
  ops::IndexerScoreOptions o;
  o.pool = cfg_.kpool;
  o.relu = cfg_.scoring_relu;
  o.fp8 = fp8_scoring_;
  o.fp8_pow2 = cfg_.fp8_pow2_scales;
  return o;
}

void DsaIndexer::project_into(const Tensor& h_in, const Tensor& cq_in,
                              const std::vector<int64_t>& pos, Saved& s, bool infer) const {
  const Device dev = wk_.weight_value().device();
  check_input(h_in, cfg_.hidden_size, dev, "h", "hidden_size");
  check_input(cq_in, cfg_.q_lora_rank, dev, "c_q", "q_lora_rank");
  const int64_t T = h_in.size(0);
  HLM_CHECK(cq_in.size(0) == T, "DsaIndexer::forward: c_q has {} rows, h has {}", cq_in.size(0), T);
  HLM_CHECK(int64_t(pos.size()) == T, "DsaIndexer: {} positions for {} tokens", pos.size(), T);
  const DType cdt = compute_dtype();
  const int64_t H = cfg_.n_heads, d = cfg_.head_dim, P = cfg_.kpool, dr = cfg_.rope_dim;
  const Context lin_ctx{true, false};

  s.h = as_dt(h_in, cdt);
  s.c_q = as_dt(cq_in, cdt);
  s.recomputed = false;
  // Inference: the GEMMs that read h take it rounded to bf16 once, when all of them round it.
  bool round_once = infer && wk_.writes_directly(DType::bf16, cdt) &&
                    weights_proj_.writes_directly(DType::bf16, cdt) &&
                    (P == 1 || gate_lin_.writes_directly(DType::bf16, cdt));
  const Tensor hg = round_once ? as_dt(s.h, DType::bf16) : s.h;
  if (P > 1) gate_lin_.weight().value = gate_->value;
  // With h rounded once, the products that read it as one grouped GEMM.
  std::vector<const Linear*> from_h = {&wk_, &weights_proj_};
  if (P > 1) from_h.push_back(&gate_lin_);
  std::vector<Tensor> on_h;
  if (round_once) {
    for (const Linear* l : from_h)
      on_h.push_back(Tensor::empty({T, l->out_features()}, cdt, s.h.device()));
    Linear::forward_into_many(hg, from_h, on_h);
  }
  auto project = [&](const Linear& l, Linear::Saved* ls) {
    for (size_t i = 0; i < on_h.size(); ++i)
      if (from_h[i] == &l) return on_h[i];
    return l.forward(lin_ctx, s.h, ls);
  };

  // q = wq_b(c_q) [T, H, d], RoPE, Hadamard.
  s.q = ops::contiguous(wq_b_.forward(lin_ctx, s.c_q, &s.wq_b)).view({T, H, d});
  rope_rows(s.q, pos, dr, cfg_.rope_theta, cfg_.rope_interleave, false);
  if (cfg_.hadamard) ops::hadamard_inplace(s.q);

  // k = LayerNorm(wk(h)) [T, d] (FP32 / f64 compute), RoPE.
  s.k_lin = ops::contiguous(project(wk_, &s.wk));
  const auto ln = ops::layernorm_forward(s.k_lin, as_dt(k_norm_w_->value, cdt),
                                         as_dt(k_norm_b_->value, cdt), cfg_.k_norm_eps);
  s.k = ln.y;
  s.k_mean = ln.mean;
  s.k_rstd = ln.rstd;
  rope_rows(s.k, pos, dr, cfg_.rope_theta, cfg_.rope_interleave, false);
  // Token keys are rotated here (P = 1); pooled keys after the pooling (run_internals, pool_key).
  if (P == 1 && cfg_.hadamard) ops::hadamard_inplace(s.k);
  if (P > 1) s.gate_out = ops::contiguous(project(gate_lin_, &s.gate));

  // w = weights_proj(h) * H^-1/2.
  s.w = ops::contiguous(project(weights_proj_, &s.weights_proj));
  scale_inplace(s.w, 1.0 / std::sqrt(double(H)));
}

void DsaIndexer::run_internals(const Tensor& h_in, const Tensor& cq_in, const SeqLayout& seqs,
                               bool select, Saved& s, const dist::CpSlice* cp) const {
  const Device dev = wk_.weight_value().device();
  check_input(h_in, cfg_.hidden_size, dev, "h", "hidden_size");
  check_input(cq_in, cfg_.q_lora_rank, dev, "c_q", "q_lora_rank");
  const int64_t T = h_in.size(0);
  seqs.check_tokens(T, "DsaIndexer::forward");
  if (cp)
    HLM_CHECK(T == cp->tokens(cp->rank()) && seqs.offsets() == cp->local().offsets(),
              "DsaIndexer::forward: rank {} holds {} tokens of the context-parallel batch, got {} "
              "(and the slice's own layout)",
              cp->rank(), cp->tokens(cp->rank()), T);
  project_into(h_in, cq_in, positions_of(seqs, cp), s);
  s.seqs = seqs;
  s.cp = cp;
  const OpRows on = op_rows(seqs, cp);
  const int64_t P = cfg_.kpool;

  // Keys for scoring: token keys (P = 1) or Hadamard of the pooled keys (P > 1); under context
  // parallelism the whole batch's, gathered (every rank pools the whole batch: O(T d_I)).
  Tensor k = s.k, gate = s.gate_out;
  if (cp) {
    s.k_all = k = dist::allgather_rows(cp->comm(), s.k, cp->bounds());
    if (P > 1) s.gate_all = gate = dist::allgather_rows(cp->comm(), s.gate_out, cp->bounds());
  }
  Tensor keys;
  if (P == 1) {
    keys = k;
  } else {
    s.pooled = ops::kpool_compress(k, gate, as_dt(ape_->value, compute_dtype()), on.seqs);
    if (cfg_.hadamard) ops::hadamard_inplace(s.pooled);
    keys = s.pooled;
  }

  s.scores = ops::indexer_scores(s.q, keys, s.w, on.seqs, score_options(), 0, on.q0);
  if (!select) return;
  if (P == 1) {
    s.indices = ops::topk_select(s.scores, on.seqs, cfg_.topk, 1, on.q0);
    s.pools = Tensor();
  } else {
    ops::KPoolSelection sel =
        ops::kpool_select(s.scores, on.seqs, cfg_.topk, P, cfg_.kpool_always_select_tail, on.q0);
    s.indices = sel.indices;
    s.pools = sel.pools;
  }
}

DsaIndexer::TokenProjection DsaIndexer::project_tokens(const Tensor& h, const Tensor& c_q,
                                                       const std::vector<int64_t>& pos) const {
  Saved s;
  project_into(h, c_q, pos, s, /*infer=*/true);
  return TokenProjection{s.q, s.k, s.gate_out, s.w};
}

Tensor DsaIndexer::pool_keys(const Tensor& k, const Tensor& gate) const {
  const int64_t P = cfg_.kpool;
  HLM_CHECK(P > 1 && k.dim() == 2 && k.size(0) % P == 0 && k.size(1) == cfg_.head_dim &&
                gate.shape() == k.shape(),
            "DsaIndexer::pool_keys: needs KPool and k, gate [M * {}, {}], got {} and {}", P,
            cfg_.head_dim, k.describe(), gate.describe());
  Tensor pooled = ops::kpool_compress(k, gate, as_dt(ape_->value, compute_dtype()),
                                      SeqLayout::single(k.size(0)));
  if (cfg_.hadamard) ops::hadamard_inplace(pooled);
  return pooled;
}

DsaIndexer::Output DsaIndexer::forward(const Context& ctx, const Tensor& h, const Tensor& c_q,
                                       const SeqLayout& seqs, Saved* saved,
                                       const dist::CpSlice* cp) const {
  Saved s;
  run_internals(h, c_q, seqs, true, s, cp);
  Output out{s.indices, s.pools, s.scores, s.w};
  if (saved != nullptr && ctx.training) {
    if (ctx.recompute) {
      Saved r;
      r.h = s.h;
      r.c_q = s.c_q;
      r.seqs = s.seqs;
      r.cp = s.cp;
      r.indices = s.indices;
      r.pools = s.pools;
      r.recomputed = true;
      *saved = std::move(r);
    } else {
      *saved = std::move(s);
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Loss

const DsaIndexer::Saved& DsaIndexer::full_saved(const Saved& saved, Saved& local) const {
  HLM_CHECK(saved.h.defined() && saved.c_q.defined() && saved.indices.defined(),
            "DsaIndexer loss: Saved is empty (run forward with ctx.training and a Saved*)");
  if (!saved.recomputed) {
    HLM_CHECK(saved.q.defined() && saved.scores.defined(),
              "DsaIndexer loss: Saved has no intermediates and is not marked recomputed");
    return saved;
  }
  run_internals(saved.h, saved.c_q, saved.seqs, false, local, saved.cp);
  local.indices = saved.indices;
  local.pools = saved.pools;
  return local;
}

DsaIndexer::LossEval DsaIndexer::eval_loss(const Saved& s, const Tensor& target,
                                           const IndexerLossOptions& opt) const {
  const DType cdt = compute_dtype();
  const int64_t T = s.h.size(0), P = cfg_.kpool;
  const bool dense = opt.stage == IndexerLossStage::dense;
  HLM_CHECK(target.defined() && target.device() == s.h.device() &&
                (target.dtype() == DType::f64 || target.dtype() == DType::f32),
            "DsaIndexer loss: target must be an f32 or f64 tensor on the indexer's device ({}), "
            "got {}",
            device_name(s.h.device()), target.defined() ? target.describe() : "undefined");
  HLM_CHECK(std::isfinite(opt.coeff) && std::isfinite(opt.grad_scale),
            "DsaIndexer loss: coeff and grad_scale must be finite, got {} and {}", opt.coeff,
            opt.grad_scale);
  const Tensor tok = as_dt(target, cdt);
  LossEval ev;
  const ops::IndexerScoreOptions so = score_options();
  const OpRows on = op_rows(s.seqs, s.cp);
  if (dense) {
    ev.scores = s.scores;
    if (P == 1) {
      HLM_CHECK(tok.shape() == s.scores.shape(),
                "DsaIndexer loss (dense): target must be [T, W] = {} in the dense causal token "
                "layout (ops::attention_target with W = 0), got {}",
                shape_str(s.scores.shape()), target.describe());
      ev.target = tok;
    } else {
      HLM_CHECK(tok.dim() == 2 && tok.size(0) == T,
                "DsaIndexer loss (dense): target must be [T = {}, W] in the dense causal token "
                "layout, got {}",
                T, target.describe());
      ev.target = ops::kpool_pool_target_dense(tok, on.seqs, P, s.scores.size(1), on.q0);
    }
  } else {
    HLM_CHECK(tok.dim() == 2 && tok.size(0) == T && tok.size(1) == cfg_.index_width(),
              "DsaIndexer loss (sparse): target must be [T = {}, {}] aligned with the selection "
              "(ops::attention_target_at over Output::indices), got {}",
              T, cfg_.index_width(), target.describe());
    if (P == 1) {
      ev.target = tok;
      ev.scores =
          ops::indexer_scores_at(s.q, s.cp ? s.k_all : s.k, s.w, on.seqs, s.indices, so, on.q0);
    } else {
      ev.target = ops::kpool_pool_target_sparse(tok, s.pools, P);
      ev.scores = ops::indexer_scores_at(s.q, s.pooled, s.w, on.seqs, s.pools, so, on.q0);
    }
  }
  ev.kl = ops::indexer_kl_loss(ev.scores, ev.target, opt.coeff, opt.reduction);
  return ev;
}

IndexerLossResult DsaIndexer::loss_value(const Context& ctx, const Tensor& target,
                                         const IndexerLossOptions& opt, const Saved& saved) const {
  Saved local;
  return eval_loss(full_saved(saved, local), target, opt).result();
}

IndexerLossResult DsaIndexer::loss_backward(const Context& ctx, const Tensor& target,
                                            const IndexerLossOptions& opt, const Saved& saved) {
  Saved local;
  const Saved& s = full_saved(saved, local);
  const LossEval ev = eval_loss(s, target, opt);
  IndexerLossResult r = ev.result();

  const int64_t T = s.h.size(0), H = cfg_.n_heads, d = cfg_.head_dim, P = cfg_.kpool;
  const DType cdt = compute_dtype();
  s.seqs.check_tokens(T, "DsaIndexer::backward");
  const std::vector<int64_t> pos = positions_of(s.seqs, s.cp);
  const OpRows on = op_rows(s.seqs, s.cp);
  // Context parallel: a gradient of the whole batch's keys, summed over the ranks, this rank's
  // rows.
  auto own_rows = [&](const Tensor& whole) {
    return s.cp ? dist::reduce_scatter_rows(s.cp->comm(), as_dt(whole, cdt), s.cp->bounds())
                : whole;
  };
  const Context lin_ctx{true, false};
  const ops::IndexerScoreOptions so = score_options();
  const bool dense = opt.stage == IndexerLossStage::dense;

  Tensor ds = ops::contiguous(ev.kl.d_scores);
  if (opt.grad_scale != 1.0) {
    ds = ds.clone();
    scale_inplace(ds, opt.grad_scale);
  }
  const Tensor& keys = P > 1 ? s.pooled : s.cp ? s.k_all : s.k;
  ops::IndexerScoreGrads g;
  if (dense)
    g = ops::indexer_scores_backward(s.q, keys, s.w, on.seqs, ds, so, on.q0);
  else
    g = ops::indexer_scores_at_backward(s.q, keys, s.w, on.seqs, P == 1 ? s.indices : s.pools, ds,
                                        so, on.q0);

  // Head weights.
  Tensor dwp = copy_as(g.dw, cdt);
  scale_inplace(dwp, 1.0 / std::sqrt(double(H)));
  Tensor dh = ops::contiguous(weights_proj_.backward(lin_ctx, dwp, s.weights_proj));

  // Queries: Hadamard^T = Hadamard, RoPE^-1, wq_b.
  Tensor dq = copy_as(g.dq, cdt);
  if (cfg_.hadamard) ops::hadamard_inplace(dq);
  rope_rows(dq, pos, cfg_.rope_dim, cfg_.rope_theta, cfg_.rope_interleave, true);
  r.dc_q = ops::contiguous(wq_b_.backward(lin_ctx, dq.view({T, H * d}), s.wq_b));

  // Keys.
  Tensor dk;
  Tensor dh_gate;
  if (P == 1) {
    dk = copy_as(own_rows(g.dk), cdt);
    if (cfg_.hadamard) ops::hadamard_inplace(dk);
  } else {
    Tensor dpooled = copy_as(g.dk, cdt);
    if (cfg_.hadamard) ops::hadamard_inplace(dpooled);
    const ops::KPoolCompressGrads cg =
        ops::kpool_compress_backward(s.cp ? s.k_all : s.k, s.cp ? s.gate_all : s.gate_out,
                                     as_dt(ape_->value, cdt), on.seqs, dpooled);
    dk = copy_as(own_rows(cg.dk), cdt);
    gate_lin_.weight().value = gate_->value;
    if (!gate_->grad.defined())
      gate_->grad = Tensor::zeros(gate_->value.shape(), grad_dtype_for(gate_->value.dtype()),
                                  gate_->value.device());
    gate_lin_.weight().grad = gate_->grad;
    dh_gate = ops::contiguous(gate_lin_.backward(lin_ctx, own_rows(cg.dgate), s.gate));
    accumulate_grad(*ape_, cg.dape);
  }
  rope_rows(dk, pos, cfg_.rope_dim, cfg_.rope_theta, cfg_.rope_interleave, true);
  Tensor dlnw = Tensor::zeros({d}, cdt, dk.device()), dlnb = Tensor::zeros({d}, cdt, dk.device());
  const Tensor dklin = ops::layernorm_backward(dk, s.k_lin, as_dt(k_norm_w_->value, cdt), s.k_mean,
                                               s.k_rstd, dlnw, dlnb);
  accumulate_grad(*k_norm_w_, dlnw);
  accumulate_grad(*k_norm_b_, dlnb);
  add_inplace(dh, as_dt(wk_.backward(lin_ctx, dklin, s.wk), cdt));
  if (dh_gate.defined()) add_inplace(dh, as_dt(dh_gate, cdt));
  r.dh = dh;
  (void)ctx;
  return r;
}

}  // namespace hlm
