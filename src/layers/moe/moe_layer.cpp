// MoeLayer (layers/moe/moe_layer.h): router, routed experts through per-expert Linear workers,
// shared expert, fixed-order combine, aux loss, bias update.
//
// Forward (per token t, assignments a = t*K + k):
//   logits = x W_r^T;  (idx, w) = router(logits, bias)
//   eo[a]  = down_e(swiglu_clamped(gate_up_e(x_t)))            e = idx[a]; expert rows ascending
//   y_t    = sum_k w[a] eo[a]  (+ shared(x_t))                  k ascending, then the shared expert
// Backward:
//   dw[a]  = <dy_t, eo[a]>;  dO[a] = w[a] dy_t
//   per expert: dh = down_e.backward(dO_e); dgu = swiglu_clamped_backward(gu_e, dh);
//               dx_e = gate_up_e.backward(dgu)                  (d W_e += through the aliased
//               grads)
//   dlogits = router_backward(dw) (+ d_aux * aux_backward);     dx_r = gate.backward(dlogits)
//   dx_t   = sum_k dx_e[a] + dx_shared_t + dx_r_t               (in that order)
#include "layers/moe/moe_layer.h"

#include <algorithm>
#include <cmath>
#include <memory>

#include "core/profile.h"
#include "dist/comm.h"
#include "dist/context_parallel.h"
#include "ops/gemm.h"
#include "ops/tensor_ops.h"

namespace hlm {

namespace {

// Copies and conversions on the input's device (ops/tensor_ops.h: Tensor's own on the CPU).
Tensor as_dtype(const Tensor& t, DType dt) {
  return ops::contiguous(ops::as_dtype(t, dt));
}

// out[rows[r], :] = parts' rows in order: the rows of the experts' outputs (concatenated in expert
// order, `counts` rows each) put back at their assignments. Byte copies: a gather by the inverse
// permutation, on the parts' device.
Tensor scatter_rows(const std::vector<Tensor>& parts, const std::vector<std::vector<int64_t>>& rows,
                    int64_t n_rows, int64_t C, DType dt, Device dev) {
  int64_t total = 0;
  for (const Tensor& p : parts)
    if (p.defined()) total += p.size(0);
  HLM_CHECK(total == n_rows, "MoeLayer: {} expert rows for {} assignments", total, n_rows);
  Tensor cat = Tensor::empty({n_rows, C}, dt, dev);
  std::vector<int64_t> perm(size_t(n_rows), 0);
  int64_t off = 0;
  for (size_t e = 0; e < parts.size(); ++e) {
    if (!parts[e].defined()) continue;
    const int64_t n = parts[e].size(0);
    Tensor dst = cat.slice(0, off, off + n);
    ops::copy_into(dst, parts[e]);
    for (int64_t q = 0; q < n; ++q) perm[size_t(rows[e][size_t(q)])] = off + q;
    off += n;
  }
  return ops::gather_rows(cat, perm);
}

// A stable counting sort of the assignments a (idx[a]: the expert, in [0, E)) by expert:
// counts[e] assignments per expert, order[p] = the assignment at sorted position p, pos its
// inverse.
void sort_by_expert(const std::vector<int64_t>& idx, int64_t E, std::vector<int64_t>& counts,
                    std::vector<int64_t>& order, std::vector<int64_t>& pos) {
  const size_t N = idx.size();
  counts.assign(static_cast<size_t>(E), 0);
  std::vector<int64_t> start(static_cast<size_t>(E), 0);
  order.resize(N);
  pos.resize(N);
  for (int64_t e : idx) ++counts[size_t(e)];
  for (int64_t e = 1; e < E; ++e) start[size_t(e)] = start[size_t(e - 1)] + counts[size_t(e - 1)];
  for (size_t a = 0; a < N; ++a) {
    const int64_t p = start[size_t(idx[a])]++;
    order[size_t(p)] = int64_t(a);
    pos[a] = p;
  }
}

}  // namespace

// ---- config ---------------------------------------------------------------------------------

void MoeConfig::validate() const {
  const char* c = "MoeConfig";
  HLM_CHECK(hidden_size >= 1, "{}.hidden_size must be >= 1, got {}", c, hidden_size);
  HLM_CHECK(n_experts >= 1, "{}.n_experts must be >= 1, got {}", c, n_experts);
  HLM_CHECK(top_k >= 1 && top_k <= n_experts, "{}.top_k must be in [1, n_experts = {}], got {}", c,
            n_experts, top_k);
  HLM_CHECK(n_group >= 1 && n_experts % n_group == 0,
            "{}.n_group must be >= 1 and divide n_experts = {}, got {}", c, n_experts, n_group);
  HLM_CHECK(n_group == 1 || n_experts / n_group >= 2,
            "{}.n_group = {} leaves groups of {} expert(s); the group score (top-2 sum) needs >= 2",
            c, n_group, n_experts / n_group);
  HLM_CHECK(topk_group >= 1 && topk_group <= n_group,
            "{}.topk_group must be in [1, n_group = {}], got {}", c, n_group, topk_group);
  HLM_CHECK(top_k <= topk_group * (n_experts / n_group),
            "{}.top_k = {} exceeds the experts of the kept groups (topk_group {} x {})", c, top_k,
            topk_group, n_experts / n_group);
  HLM_CHECK(std::isfinite(routed_scaling_factor) && routed_scaling_factor > 0,
            "{}.routed_scaling_factor must be finite and > 0, got {}", c, routed_scaling_factor);
  HLM_CHECK(moe_intermediate_size >= 1, "{}.moe_intermediate_size must be >= 1, got {}", c,
            moe_intermediate_size);
  HLM_CHECK(n_shared_experts >= 0, "{}.n_shared_experts must be >= 0, got {}", c, n_shared_experts);
  HLM_CHECK(!std::isnan(swiglu_limit), "{}.swiglu_limit must not be NaN", c);
  HLM_CHECK(std::isfinite(aux_loss_coeff) && aux_loss_coeff >= 0,
            "{}.aux_loss_coeff must be finite and >= 0, got {}", c, aux_loss_coeff);
  HLM_CHECK(dtype == DType::f64 || dtype == DType::f32 || dtype == DType::bf16,
            "{}.dtype must be f64, f32 or bf16, got {}", c, dtype_name(dtype));
  HLM_CHECK(std::isfinite(init_std) && init_std >= 0, "{}.init_std must be finite and >= 0, got {}",
            c, init_std);
  HLM_CHECK(ep_size >= 1 && n_experts % ep_size == 0,
            "{}.ep_size must be >= 1 and divide n_experts = {}, got {}", c, n_experts, ep_size);
  HLM_CHECK(ep_rank >= 0 && ep_rank < ep_size, "{}.ep_rank must be in [0, ep_size = {}), got {}", c,
            ep_size, ep_rank);
}

ops::MoeRouterConfig MoeConfig::router_config() const {
  ops::MoeRouterConfig r;
  r.n_experts = n_experts;
  r.top_k = top_k;
  r.n_group = n_group;
  r.topk_group = topk_group;
  r.norm_topk_prob = norm_topk_prob;
  r.routed_scaling_factor = routed_scaling_factor;
  return r;
}

DenseMlpConfig MoeConfig::shared_config() const {
  DenseMlpConfig s;
  s.hidden_size = hidden_size;
  s.intermediate_size = moe_intermediate_size * std::max<int64_t>(n_shared_experts, 1);
  s.swiglu_limit = swiglu_limit;
  s.dtype = dtype;
  s.seed = seed;
  s.init_std = init_std;
  return s;
}

// ---- router gate ------------------------------------------------------------------------------

void MoeRouterGate::init_gate(int64_t hidden, int64_t n_experts, DType dt) {
  init(hidden, n_experts, false, GemmPrecision{GemmKind::native}, dt);
  weight().keep_fp32 = true;  // the router runs in FP32: its weight survives bf16 casts
  corr_bias_ = &add_param("e_score_correction_bias", Tensor::zeros({n_experts}, dt), true, true);
}

// ---- layer ------------------------------------------------------------------------------------

MoeLayer::MoeLayer(const MoeConfig& cfg, const PrecisionPolicy& policy, const std::string& path)
    : cfg_(cfg), path_(path) {
  cfg_.validate();
  const int64_t D = cfg_.hidden_size, E = cfg_.n_experts, I = cfg_.moe_intermediate_size,
                El = cfg_.local_experts(), e0 = cfg_.first_expert();
  const std::string pre = path_.empty() ? "" : path_ + ".";
  const DType keep_dt = hlm::compute_dtype(cfg_.dtype);
  gate_up_ = &add_param("experts.gate_up_proj", Tensor::zeros({El, 2 * I, D}, cfg_.dtype));
  down_ = &add_param("experts.down_proj", Tensor::zeros({El, D, I}, cfg_.dtype));
  gate_.init_gate(D, E, keep_dt);
  const GemmPrecision rp = policy.resolve(pre + "gate", ModuleRole::router);
  HLM_CHECK(rp.kind == GemmKind::native, "MoeLayer({}): the router must resolve to native, got {}",
            path_, precision_str(rp));
  gate_.set_precision(rp);
  add_child("gate", &gate_);
  if (cfg_.n_shared_experts > 0) {
    shared_ = std::make_unique<DenseMlp>(cfg_.shared_config(), policy, pre + "shared_experts",
                                         ModuleRole::moe_expert);
    add_child("shared_experts", shared_.get());
  }
  const GemmPrecision ep = policy.resolve(pre + "experts", ModuleRole::moe_expert);
  gate_up_w_.init(D, 2 * I, false, ep, cfg_.dtype);
  down_w_.init(I, D, false, ep, cfg_.dtype);
  alias_workers(-1, false);  // drop the workers' own (zero) weights
  init_normal_named(gate_.weight().value, cfg_.seed, pre + "gate.weight", cfg_.init_std);
  // An expert-parallel rank's experts get the values they have in the whole parameter.
  init_normal_named(gate_up_->value, cfg_.seed, pre + "experts.gate_up_proj", cfg_.init_std,
                    uint64_t(e0 * 2 * I * D));
  init_normal_named(down_->value, cfg_.seed, pre + "experts.down_proj", cfg_.init_std,
                    uint64_t(e0 * D * I));
}

DType MoeLayer::compute_dtype(DType x_dt) const {
  return hlm::compute_dtype(x_dt);
}

void MoeLayer::alias_workers(int64_t e, bool with_grads) const {
  if (e < 0) {  // release: hold no reference to the parameters between uses
    gate_up_w_.weight().value = down_w_.weight().value = Tensor();
    gate_up_w_.weight().grad = down_w_.weight().grad = Tensor();
    return;
  }
  gate_up_w_.weight().value = gate_up_->value.select(0, e);
  down_w_.weight().value = down_->value.select(0, e);
  if (with_grads) {
    gate_up_w_.weight().grad = gate_up_->grad.select(0, e);
    down_w_.weight().grad = down_->grad.select(0, e);
  } else {
    gate_up_w_.weight().grad = Tensor();
    down_w_.weight().grad = Tensor();
  }
}

void MoeLayer::run_router(const Context& ctx, const Tensor& xc, const Tensor& replay,
                          Saved& s) const {
  s.logits = gate_.forward(ctx, xc, ctx.training ? &s.router : nullptr);
  s.route = ops::moe_router_forward(s.logits, gate_.correction_bias_value(), cfg_.router_config(),
                                    replay);
  s.topk_idx = s.route.topk_idx;
}

bool MoeLayer::use_grouped(const Tensor& xc) const {
  if (xc.is_cpu()) return false;
  const GemmPrecision& p = gate_up_w_.precision();
  if (p.kind == GemmKind::bf16)  // f32 activations, f32 gradients (bf16 or f32 weights)
    return xc.dtype() == DType::f32 && gate_up_->value.dtype() != DType::f64 &&
           down_->value.dtype() != DType::f64;
  return p.kind == GemmKind::native && gate_up_->value.dtype() == xc.dtype() &&
         down_->value.dtype() == xc.dtype();
}

bool MoeLayer::use_routed(const Context& ctx, const Tensor& xc) const {
  return !ctx.training && use_grouped(xc) &&
         xc.size(0) * cfg_.top_k <= kRoutedRowsPerExpert * gate_up_->value.size(0);
}

void MoeLayer::run_experts_grouped(const Tensor& xc, const std::vector<int64_t>& idx, int64_t K,
                                   Saved& s, bool keep) const {
  const int64_t Tn = xc.size(0), D = cfg_.hidden_size, E = gate_up_->value.size(0);
  const int64_t I = cfg_.moe_intermediate_size, N = Tn * K;
  const bool bf16 = gate_up_w_.precision().kind == GemmKind::bf16;
  const ops::GemmOptions opt{bf16};
  // A stable counting sort of the assignments by expert (on the host: the group sizes are the
  // GEMM's arguments).
  profile::Scope ps_sort("sort");
  std::vector<int64_t> counts, order, pos;
  sort_by_expert(idx, E, counts, order, pos);
  std::vector<int64_t> toks(static_cast<size_t>(N));
  for (int64_t p = 0; p < N; ++p) toks[size_t(p)] = order[size_t(p)] / K;
  std::vector<ops::GemmGroup> g_up, g_down;
  for (int64_t e = 0, off = 0; e < E; off += counts[size_t(e)], ++e) {
    const int64_t n = counts[size_t(e)];
    if (n == 0) continue;
    g_up.push_back({n, 2 * I, D, off * D, e * 2 * I * D, off * 2 * I});
    g_down.push_back({n, D, I, off * I, e * D * I, off * D});
  }
  ps_sort.end();
  profile::Scope ps_gather("gather");
  // Under a bf16 GEMM x is rounded once, before the gather: T rows converted, not T K, and half
  // the bytes gathered (rounding commutes with the row copy).
  const Tensor xp = ops::gather_rows(bf16 ? ops::as_dtype(xc, DType::bf16) : xc, toks);
  ps_gather.end();
  profile::Scope ps_gemm("grouped GEMMs + SwiGLU");
  Tensor gu = Tensor::empty({N, 2 * I}, xc.dtype(), xc.device());
  ops::gemm_grouped(xp, false, gate_up_->value, true, gu, g_up, 1.0, 0.0, opt);
  Tensor h = ops::swiglu_clamped_forward(gu, cfg_.swiglu_limit);
  if (bf16) h = ops::as_dtype(h, DType::bf16);
  Tensor eo = Tensor::empty({N, D}, xc.dtype(), xc.device());
  ops::gemm_grouped(h, false, down_->value, true, eo, g_down, 1.0, 0.0, opt);
  ps_gemm.end();
  HLM_PROFILE("scatter");
  s.eo = ops::gather_rows(eo, pos);
  s.grouped = true;
  if (keep) {
    s.counts = std::move(counts);
    s.order = std::move(order);
    s.pos = std::move(pos);
    s.xp = xp;
    s.gu = gu;
    s.h = h;
  }
}

Tensor MoeLayer::backward_experts_grouped(const Tensor& deo, const Saved& s) const {
  const int64_t D = cfg_.hidden_size, E = gate_up_->value.size(0), I = cfg_.moe_intermediate_size;
  const int64_t N = int64_t(s.order.size());
  const bool bf16 = gate_up_w_.precision().kind == GemmKind::bf16;
  const ops::GemmOptions opt{bf16};
  std::vector<ops::GemmGroup> g_dh, g_ddown, g_dx, g_dup;
  for (int64_t e = 0, off = 0; e < E; off += s.counts[size_t(e)], ++e) {
    const int64_t n = s.counts[size_t(e)];
    if (n == 0) continue;
    g_dh.push_back({n, I, D, off * D, e * D * I, off * I});               // dO_e W_down_e
    g_ddown.push_back({D, I, n, off * D, off * I, e * D * I});            // dO_e^T h_e
    g_dx.push_back({n, D, 2 * I, off * 2 * I, e * 2 * I * D, off * D});   // dgu_e W_up_e
    g_dup.push_back({2 * I, D, n, off * 2 * I, off * D, e * 2 * I * D});  // dgu_e^T x_e
  }
  profile::Scope ps_gather("gather");
  Tensor dop = ops::gather_rows(deo, s.order);
  if (bf16) dop = ops::as_dtype(dop, DType::bf16);
  ps_gather.end();
  profile::Scope ps_gemm("grouped GEMMs + SwiGLU");
  const DType cdt = s.gu.dtype();
  Tensor dh = Tensor::empty({N, I}, cdt, deo.device());
  ops::gemm_grouped(dop, false, down_->value, false, dh, g_dh, 1.0, 0.0, opt);
  ops::gemm_grouped(dop, true, s.h, false, down_->grad, g_ddown, 1.0, 1.0, opt);
  Tensor dgu = ops::swiglu_clamped_backward(s.gu, dh, cfg_.swiglu_limit);
  if (bf16) dgu = ops::as_dtype(dgu, DType::bf16);
  Tensor dxp = Tensor::empty({N, D}, cdt, deo.device());
  ops::gemm_grouped(dgu, false, gate_up_->value, false, dxp, g_dx, 1.0, 0.0, opt);
  ops::gemm_grouped(dgu, true, s.xp, false, gate_up_->grad, g_dup, 1.0, 1.0, opt);
  ps_gemm.end();
  HLM_PROFILE("scatter");
  return ops::gather_rows(dxp, s.pos);
}

void MoeLayer::run_experts(const Context& ctx, const Tensor& xc, const std::vector<int64_t>& idx,
                           int64_t K, Saved& s) const {
  if (use_grouped(xc)) {
    run_experts_grouped(xc, idx, K, s, ctx.training);
    return;
  }
  const int64_t Tn = xc.size(0), D = cfg_.hidden_size, E = gate_up_->value.size(0);
  std::vector<std::vector<int64_t>> rows(static_cast<size_t>(E));
  for (size_t a = 0; a < idx.size(); ++a) rows[size_t(idx[a])].push_back(int64_t(a));
  std::vector<Tensor> outs(static_cast<size_t>(E));
  s.experts.assign(static_cast<size_t>(E), ExpertSaved{});
  for (int64_t e = 0; e < E; ++e) {
    const auto& r = rows[size_t(e)];
    if (r.empty()) continue;
    std::vector<int64_t> toks(r.size());
    for (size_t q = 0; q < r.size(); ++q) toks[q] = r[q] / K;
    ExpertSaved& es = s.experts[size_t(e)];
    alias_workers(e, false);
    const Tensor gu = gate_up_w_.forward(ctx, ops::gather_rows(xc, toks),
                                         ctx.training ? &es.gate_up : nullptr);    // [n, 2I]
    const Tensor h = ops::swiglu_clamped_forward(gu, cfg_.swiglu_limit);           // [n, I]
    const Tensor eo = down_w_.forward(ctx, h, ctx.training ? &es.down : nullptr);  // [n, D]
    outs[size_t(e)] = ops::contiguous(ops::as_dtype(eo, xc.dtype()));
    if (ctx.training) {
      es.rows = r;
      es.gu = gu;
    }
  }
  alias_workers(-1, false);
  s.eo = scatter_rows(outs, rows, Tn * K, D, xc.dtype(), xc.device());
}

// ---- expert parallel (docs/parallel.md, "Expert parallelism") ----

struct MoeLayer::EpDispatch {
  // The assignments a = t K + k sorted by expert (stably): order[p] = a, pos[a] = p. The experts
  // of rank q are a contiguous run of that order, sent to q as send_rows[q] rows; recv_rows[q]
  // rows came from rank q, grouped by this rank's experts in ascending order.
  std::vector<int64_t> order, pos, send_rows, recv_rows;
  Saved inner;  // run_experts over the rows received (one assignment per row)
};

void MoeLayer::run_experts_ep(const Context& ctx, const Tensor& xc, dist::Comm& ep,
                              Saved& s) const {
  const int64_t Tn = xc.size(0), K = cfg_.top_k, E = cfg_.n_experts, El = cfg_.local_experts();
  const int n = ep.size();
  HLM_CHECK(n == cfg_.ep_size && ep.rank() == cfg_.ep_rank,
            "MoeLayer({}): the expert-parallel group is rank {} of {}, the config says {} of {}",
            path_, ep.rank(), n, cfg_.ep_rank, cfg_.ep_size);
  auto d = std::make_shared<EpDispatch>();
  // A stable counting sort of the assignments by expert: the runs for each rank in rank order.
  const int64_t N = Tn * K;
  std::vector<int64_t> counts;
  sort_by_expert(s.topk_idx.to_i64_vector(), E, counts, d->order, d->pos);
  // Every rank learns how many rows it gets for each of its experts from each rank.
  const std::vector<int64_t> got_counts =  // [n, El]: from rank q, expert j
      dist::alltoall_from(ep, Tensor::from_vector<int64_t>({int64_t(n), El}, counts))
          .to_i64_vector();
  d->send_rows.assign(size_t(n), 0);
  d->recv_rows.assign(size_t(n), 0);
  std::vector<int64_t> local_idx;
  for (int q = 0; q < n; ++q)
    for (int64_t j = 0; j < El; ++j) {
      d->send_rows[size_t(q)] += counts[size_t(q * El + j)];
      const int64_t c = got_counts[size_t(q * El + j)];
      d->recv_rows[size_t(q)] += c;
      local_idx.insert(local_idx.end(), size_t(c), j);
    }
  // Rows out, the experts here, outputs back.
  std::vector<int64_t> toks(static_cast<size_t>(N));
  for (int64_t p = 0; p < N; ++p) toks[size_t(p)] = d->order[size_t(p)] / K;
  const Tensor rows =
      dist::alltoallv_from(ep, ops::gather_rows(xc, toks), d->send_rows, d->recv_rows);
  run_experts(ctx, rows, local_idx, 1, d->inner);
  const Tensor back = dist::alltoallv_from(ep, d->inner.eo, d->recv_rows, d->send_rows);
  s.eo = ops::gather_rows(back, d->pos);
  if (!ctx.training) d->inner = Saved{};
  s.ep_dispatch = d;
}

Tensor MoeLayer::backward_experts(const Context& ctx, const Tensor& dO, const Saved& R) const {
  if (R.grouped) return backward_experts_grouped(dO, R);
  const int64_t E = gate_up_->value.size(0), N = dO.size(0), D = cfg_.hidden_size;
  const DType cdt = dO.dtype();
  std::vector<Tensor> dparts(static_cast<size_t>(E));
  std::vector<std::vector<int64_t>> drows(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    const ExpertSaved& es = R.experts[size_t(e)];
    if (es.rows.empty()) continue;
    alias_workers(e, true);
    const Tensor dh = down_w_.backward(ctx, ops::gather_rows(dO, es.rows), es.down);  // [n, I]
    const Tensor dgu = ops::swiglu_clamped_backward(es.gu, dh, cfg_.swiglu_limit);    // [n, 2I]
    const Tensor dxe = gate_up_w_.backward(ctx, dgu, es.gate_up);                     // [n, D]
    dparts[size_t(e)] = as_dtype(dxe, cdt);
    drows[size_t(e)] = es.rows;
  }
  alias_workers(-1, false);
  return scatter_rows(dparts, drows, N, D, cdt, dO.device());
}

void MoeLayer::check_input(const Tensor& x) const {
  HLM_CHECK(x.defined() && x.device() == gate_up_->value.device(),
            "MoeLayer({}): x must be a defined tensor on the parameters' device ({}), got {}",
            path_, device_name(gate_up_->value.device()), x.defined() ? x.describe() : "undefined");
  HLM_CHECK(x.dtype() == DType::f64 || x.dtype() == DType::f32 || x.dtype() == DType::bf16,
            "MoeLayer({}): x must be f64, f32 or bf16, got {}", path_, x.describe());
  HLM_CHECK(x.dim() == 2 && x.size(1) == cfg_.hidden_size,
            "MoeLayer({}): x must be [T, {}], got {}", path_, cfg_.hidden_size, x.describe());
}

namespace {

// The whole sequences of a context-parallel slice (seqs = cp.local()): each local sequence's
// length in the global batch and its expert counts summed over every slice that holds part of
// it (one all-gather of [S, E] counts per global sequence; integer sums, in rank order).
std::shared_ptr<const ops::MoeAuxWhole> aux_whole(const Tensor& topk_idx, int64_t E,
                                                  const SeqLayout& seqs, const dist::CpSlice& cp) {
  HLM_CHECK(seqs.offsets() == cp.local().offsets(),
            "MoeLayer: under context parallelism the layout must be the slice's own");
  const std::vector<int64_t>& g = cp.global().offsets();
  const int64_t S = cp.global().num_seqs(), K = topk_idx.size(1), b0 = cp.begin(cp.rank());
  // The global sequence of each local one (the last that starts at or before its first token).
  std::vector<int64_t> of;
  for (int64_t q = 0; q < seqs.num_seqs(); ++q) {
    const int64_t t = b0 + seqs.offsets()[size_t(q)];
    of.push_back(int64_t(std::upper_bound(g.begin(), g.end(), t) - g.begin()) - 1);
  }
  const std::vector<int64_t> idx = topk_idx.to_i64_vector();
  std::vector<int64_t> mine(size_t(S * E), 0);
  for (int64_t q = 0; q < seqs.num_seqs(); ++q)
    for (int64_t t = seqs.offsets()[size_t(q)]; t < seqs.offsets()[size_t(q) + 1]; ++t)
      for (int64_t k = 0; k < K; ++k) ++mine[size_t(of[size_t(q)] * E + idx[size_t(t * K + k)])];
  const Tensor all = cp.allgather(Tensor::from_vector<int64_t>({S * E}, mine)).to(Device::cpu);
  const int64_t* a = all.data<int64_t>();
  auto w = std::make_shared<ops::MoeAuxWhole>();
  for (int64_t q = 0; q < seqs.num_seqs(); ++q) {
    const int64_t gs = of[size_t(q)];
    w->lengths.push_back(g[size_t(gs) + 1] - g[size_t(gs)]);
    for (int64_t e = 0; e < E; ++e) {
      int64_t c = 0;
      for (int r = 0; r < cp.size(); ++r) c += a[(int64_t(r) * S + gs) * E + e];
      w->counts.push_back(c);
    }
  }
  return w;
}

}  // namespace

MoeLayer::Output MoeLayer::forward(const Context& ctx, const Tensor& x, const Tensor& cu_seqlens,
                                   Saved* saved, const Tensor& replay_idx) const {
  check_input(x);
  return forward(ctx, x, SeqLayout::from_tensor(cu_seqlens, x.size(0), "MoeLayer cu_seqlens"),
                 saved, replay_idx);
}

MoeLayer::Output MoeLayer::forward(const Context& ctx, const Tensor& x, const SeqLayout& seqs,
                                   Saved* saved, const Tensor& replay_idx, dist::Comm* ep,
                                   bool stats, const dist::CpSlice* cp) const {
  check_input(x);
  HLM_CHECK((cfg_.ep_size > 1) == (ep != nullptr), "MoeLayer({}): {} (config ep_size {})", path_,
            ep ? "an expert-parallel group was given to a layer that holds every expert"
               : "an expert-parallel layer needs its group",
            cfg_.ep_size);
  const int64_t Tn = x.size(0), K = cfg_.top_k, D = cfg_.hidden_size;
  const std::string op = fmt::format("MoeLayer({})", path_);
  seqs.check_tokens(Tn, op.c_str(), "x");
  const DType cdt = hlm::compute_dtype(x.dtype());
  const Tensor xc = as_dtype(x, cdt);
  const bool keep = saved && ctx.training;
  const Context fctx = keep ? ctx : Context{false, false};
  Saved local;
  Saved& s = keep ? *saved : local;
  s = Saved{};
  profile::Scope ps_router("router");
  run_router(fctx, xc, replay_idx, s);
  ps_router.end();
  profile::Scope ps_experts("routed experts");
  if (ep)
    run_experts_ep(fctx, xc, *ep, s);
  else if (use_routed(fctx, xc))
    s.eo = ops::moe_routed_experts(xc, gate_up_->value, down_->value, s.topk_idx, cfg_.swiglu_limit,
                                   gate_up_w_.precision().kind == GemmKind::bf16);
  else
    run_experts(fctx, xc, s.topk_idx.to_i64_vector(), K, s);
  ps_experts.end();
  profile::Scope ps_shared("shared expert + combine");
  Tensor ys;
  if (shared_) ys = shared_->forward(fctx, xc, keep ? &s.shared : nullptr);
  Tensor y = ops::moe_combine(s.eo.view({Tn, K, D}), s.route.topk_weight, ys);
  Output out;
  out.y = ops::as_dtype(y, x.dtype());
  out.topk_idx = s.route.topk_idx;
  out.topk_weight = s.route.topk_weight;
  if (stats) out.counts = ops::moe_expert_load(s.route.topk_idx, cfg_.n_experts);
  if (stats && cfg_.aux_loss_coeff > 0) {
    if (cp && cp->size() > 1) s.aux_whole = aux_whole(s.route.topk_idx, cfg_.n_experts, seqs, *cp);
    out.aux_loss = ops::moe_seq_aux_loss(s.logits, s.route.topk_idx, seqs, cfg_.aux_loss_coeff,
                                         s.aux_whole.get());
  }
  if (keep) {
    s.x = xc;
    s.x_dtype = x.dtype();
    s.seqs = seqs;
    s.ep = ep;
    if (ctx.recompute) {
      s.router = Linear::Saved{};
      s.logits = Tensor();
      s.route = ops::MoeRouterResult{};
      s.eo = Tensor();
      s.experts.clear();
      s.grouped = false;
      s.counts.clear();
      s.order.clear();
      s.pos.clear();
      s.xp = s.gu = s.h = Tensor();
      s.ep_dispatch.reset();
      s.recomputed = true;
    }
  }
  return out;
}

Tensor MoeLayer::backward(const Context& ctx, const Tensor& dy, const Saved& saved, double d_aux) {
  HLM_CHECK(saved.x.defined() && saved.topk_idx.defined(),
            "MoeLayer({})::backward: Saved is empty (run forward with ctx.training)", path_);
  const int64_t Tn = saved.x.size(0), K = cfg_.top_k, D = cfg_.hidden_size;
  HLM_CHECK(dy.defined() && is_floating(dy.dtype()) && dy.shape() == Shape({Tn, D}) &&
                dy.device() == saved.x.device(),
            "MoeLayer({})::backward: dy must be floating [{}, {}] on x's device ({}), got {}",
            path_, Tn, D, device_name(saved.x.device()),
            dy.defined() ? dy.describe() : "undefined");
  HLM_CHECK(std::isfinite(d_aux), "MoeLayer({})::backward: d_aux must be finite, got {}", path_,
            d_aux);
  const DType cdt = saved.x.dtype();
  // Under recompute: rerun the router (replaying the saved selection) and the experts.
  Saved re;
  if (saved.recomputed) {  // (expert parallel: every rank of the group recomputes together)
    const Context rctx{true, false};
    run_router(rctx, saved.x, saved.topk_idx, re);
    if (saved.ep)
      run_experts_ep(rctx, saved.x, *saved.ep, re);
    else
      run_experts(rctx, saved.x, re.topk_idx.to_i64_vector(), K, re);
  }
  const Saved& R = saved.recomputed ? re : saved;
  const Saved& X = R.ep_dispatch ? R.ep_dispatch->inner : R;  // where the experts ran
  HLM_CHECK(R.eo.defined() && (X.grouped || int64_t(X.experts.size()) == gate_up_->value.size(0)),
            "MoeLayer({})::backward: Saved holds no expert state", path_);
  const std::string where = fmt::format("MoeLayer({})::backward", path_);
  ensure_grad(*gate_up_, where);
  ensure_grad(*down_, where);

  const Tensor dyc = as_dtype(dy, cdt);
  const ops::MoeCombineGrads cg =
      ops::moe_combine_backward(dyc, R.eo.view({Tn, K, D}), R.route.topk_weight);
  const Tensor dO = cg.deo.view({Tn * K, D});

  profile::Scope ps_experts("routed experts");
  Tensor dxk;
  if (const EpDispatch* d = R.ep_dispatch.get()) {  // the gradients to the experts' ranks and back
    const Tensor drows =
        dist::alltoallv_from(*saved.ep, ops::gather_rows(dO, d->order), d->send_rows, d->recv_rows);
    const Tensor dx_rows = backward_experts(ctx, drows, d->inner);
    dxk = ops::gather_rows(dist::alltoallv_from(*saved.ep, dx_rows, d->recv_rows, d->send_rows),
                           d->pos);
  } else {
    dxk = backward_experts(ctx, dO, R);
  }
  ps_experts.end();
  profile::Scope ps_shared("shared expert");
  Tensor dxs;
  if (shared_) dxs = as_dtype(shared_->backward(ctx, dyc, saved.shared), cdt);
  ps_shared.end();
  HLM_PROFILE("router + combine");

  const ops::MoeRouterConfig rc = cfg_.router_config();
  Tensor dl = ops::moe_router_backward(R.logits, R.route, rc, cg.dw);
  if (cfg_.aux_loss_coeff > 0 && d_aux != 0) {
    const Tensor da = ops::moe_seq_aux_loss_backward(
        R.logits, R.topk_idx, saved.seqs, cfg_.aux_loss_coeff, d_aux, saved.aux_whole.get());
    ops::add_(dl, da);
  }
  const Tensor dxr = as_dtype(gate_.backward(ctx, dl, R.router), cdt);
  // dx = sum_k dxk[t, k] + dxs + dxr, in that order.
  Tensor dx = ops::moe_combine(dxk.view({Tn, K, D}), Tensor(), dxs);
  ops::add_(dx, dxr);
  return ops::as_dtype(dx, saved.x_dtype);
}

void MoeLayer::keep_gemm_weights_in_bf16() {
  Module::keep_gemm_weights_in_bf16();  // the router and the shared expert
  for (auto [p, lin] : {std::pair<Param*, const Linear*>{gate_up_, &gate_up_w_}, {down_, &down_w_}})
    if (lin->precision().kind == GemmKind::bf16 && p->value.dtype() == DType::f32) {
      p->value = ops::as_dtype(p->value, DType::bf16);
      p->grad = Tensor();
    }
}

void MoeLayer::update_bias(const Tensor& counts, double rate) {
  HLM_CHECK(std::isfinite(rate), "MoeLayer({})::update_bias: rate must be finite, got {}", path_,
            rate);
  ops::moe_bias_update(gate_.correction_bias().value, counts, rate);
}

}  // namespace hlm
