// KdaLayer (layers/kda/kda_layer.h): the KDA layer, forward and backward, on the CPU.
//
// Explicit forward and backward, no autograd. Activation gradients are written (=); parameter
// gradients are accumulated (+=) into Param::grad.
//
// Forward (per packed batch, compute dtype c = f64 for f64 x, else f32):
//   q~ = x Wq^T [T, HK],  k~ = x Wk^T [T, HK],  v~ = x Wv^T [T, HV V]
//   q = silu(conv(q~; wq, s_q)),  k = silu(conv(k~; wk, s_k)),  v = silu(conv(v~; wv, s_v))
//       (s_*: the channels of the conv state [N, W-1, 2HK + HV V] that belong to q~, k~, v~)
//   z = (x Wfa^T) Wfb^T  (or x Wf^T)            [T, HV K]  raw gate input
//   b = x Wb^T                                  [T, HV]    beta logits
//   o, S_T = core(q, k, v, z, b; S_0)           [T, HV, V] (l2norm, scale, sigmoid(b) and the
//                                                           gate(z; A_log, dt_bias) fused)
//   og = (x Wga^T) Wgb^T (+ bg)  (or x Wg^T + bg)  [T, HV V]
//   o' = o rstd w_norm sigmoid(og),  rstd = 1 / sqrt(mean_V(o^2) + eps)   per (token, head)
//   y = o' Wo^T                                 [T, D]
// Final conv state of sequence n (length L): state'[n, i] = q~|k~|v~ at local position
//   L - (W-1) + i, or, for positions before the start, s[n, i + L] (zeros without a state).
//
// Backward (the ops give each piece; see ops/*.h for their formulas):
//   do', dWo        = o_proj backward of dy
//   do, dog, dw_norm = gated RMSNorm backward
//   dx_g, dWga, dWgb = output-gate projections backward of dog
//   dq, dk, dv, dz, db, dS_0, dA_log, ddt_bias = core backward of (do, dS_T)
//   dx_f, dWfa, dWfb = decay-gate projections backward of dz;  dx_b, dWb = b_proj backward of db
//   dq~ (and ds_q), dwq = conv backward of dq (likewise k, v), plus the final conv state's
//       gradient routed back to the position it was copied from (an input, or the initial state)
//   dx_q, dWq = q_proj backward of dq~ (likewise k, v)
//   dx = dx_q + dx_k + dx_v + dx_f + dx_b + dx_g   (summed in this order)
// Selective recompute: with ctx.recompute the forward saves only x, cu_seqlens and the initial
// states, and backward first re-runs the forward into a full Saved (the same computation, so the
// gradients are bit-identical to a run without recompute).
#include "layers/kda/kda_layer.h"

#include <cmath>

#include "core/enum_names.h"
#include "core/profile.h"
#include "core/rng.h"
#include "ops/activations.h"
#include "ops/conv1d.h"
#include "ops/kda.h"
#include "ops/kda_decode.h"
#include "ops/rmsnorm.h"
#include "ops/tensor_ops.h"

namespace hlm {

namespace {

constexpr auto kKdaNamingNames =
    enum_names<KdaNaming::kimi_linear>({"glm5_next", "glm5_next_transformers", "kimi_linear"});

}  // namespace

const char* kda_naming_name(KdaNaming n) {
  return kKdaNamingNames.name(n);
}

// ---- config -----------------------------------------------------------------------------------

void KdaConfig::validate() const {
  auto positive = [](int64_t v, const char* field) {
    HLM_CHECK(v > 0, "KdaConfig: {} must be positive, got {}", field, v);
  };
  positive(hidden_size, "hidden_size");
  positive(num_heads, "num_heads");
  positive(num_v_heads, "num_v_heads");
  positive(head_k_dim, "head_k_dim");
  positive(head_v_dim, "head_v_dim");
  HLM_CHECK(num_v_heads % num_heads == 0,
            "KdaConfig: num_v_heads ({}) must be a multiple of num_heads ({}) (GVA)", num_v_heads,
            num_heads);
  HLM_CHECK(conv_kernel >= 1, "KdaConfig: conv_kernel must be >= 1, got {}", conv_kernel);
  HLM_CHECK(decay_rank >= 0, "KdaConfig: decay_rank must be >= 0 (0: full-rank f_proj), got {}",
            decay_rank);
  HLM_CHECK(output_gate_rank >= 0,
            "KdaConfig: output_gate_rank must be >= 0 (0: full-rank g_proj), got {}",
            output_gate_rank);
  if (gate == ops::KdaGateKind::lower_bound)
    ops::check_kda_lower_bound(lower_bound, "KdaConfig (lower-bound gate)");
  HLM_CHECK(std::isfinite(norm_eps) && norm_eps > 0,
            "KdaConfig: norm_eps must be positive and finite, got {}", norm_eps);
}

KdaConfig KdaConfig::glm5_3_flash() {
  return KdaConfig{};
}

KdaConfig KdaConfig::kimi_linear_48b() {
  KdaConfig c;
  c.hidden_size = 2304;
  c.num_heads = c.num_v_heads = 32;
  c.head_k_dim = c.head_v_dim = 128;
  c.conv_kernel = 4;
  c.decay_rank = c.output_gate_rank = 128;
  c.gate = ops::KdaGateKind::standard;
  c.norm_eps = 1e-5;
  c.naming = KdaNaming::kimi_linear;
  return c;
}

// ---- helpers ----------------------------------------------------------------------------------

namespace {

// On CUDA the conversions, contiguous copies and additions below go through ops/tensor_ops.h
// (the same one rounding / one addition per element as the CPU loops).
Tensor as_dtype(const Tensor& t, DType dt) {
  return t.dtype() == dt ? t : t.is_cpu() ? t.to(dt) : ops::as_dtype(t, dt);
}

// dst[i] += src[i] over n elements (one addition per element, in dst's dtype).
template <class T>
void add_n(T* dst, const Tensor& src, int64_t n) {
  const Tensor s = as_dtype(src, dtype_of<T>::value).contiguous();
  const T* p = s.data<T>();
  for (int64_t i = 0; i < n; ++i) dst[i] += p[i];
}

// Param::grad[offset .. offset + g.numel()) += g (flat, row-major).
void accumulate(Param& p, const Tensor& g, int64_t offset = 0) {
  Tensor& gr = ensure_grad(p, "KdaLayer");
  HLM_CHECK(offset + g.numel() <= gr.numel(), "KdaLayer: gradient {} does not fit '{}' {}",
            g.describe(), p.name, gr.describe());
  if (!gr.is_cpu()) {
    Tensor dst = gr.view({-1}).slice(0, offset, offset + g.numel());
    ops::add_(dst, ops::contiguous(g).view({-1}));
    return;
  }
  if (gr.dtype() == DType::f64)
    add_n(gr.data<double>() + offset, g, g.numel());
  else
    add_n(gr.data<float>() + offset, g, g.numel());
}

// a += b elementwise (same shape, a contiguous of dtype f32/f64).
void add_inplace(Tensor& a, const Tensor& b) {
  HLM_CHECK(a.shape() == b.shape() && a.is_contiguous(), "KdaLayer: add of {} and {}", a.describe(),
            b.describe());
  if (!a.is_cpu()) {
    ops::add_(a, b);
    return;
  }
  if (a.dtype() == DType::f64)
    add_n(a.data<double>(), b, a.numel());
  else
    add_n(a.data<float>(), b, a.numel());
}

// Concatenation of [..., C_i] tensors along the last dimension.
Tensor cat_last(const std::vector<Tensor>& parts) {
  Shape s = parts.front().shape();
  int64_t c = 0;
  for (const Tensor& p : parts) c += p.size(-1);
  s.back() = c;
  int64_t off = 0;
  Tensor out = Tensor::empty(s, parts.front().dtype(), parts.front().device());
  for (const Tensor& p : parts) {
    Tensor dst = out.slice(out.dim() - 1, off, off + p.size(-1));
    if (out.is_cpu())
      dst.copy_(p);
    else
      ops::copy_into(dst, p);
    off += p.size(-1);
  }
  return out;
}

// The gradient of the final conv state [N, W-1, C] routed back to where each entry was copied
// from: the conv input x~ [T, C] (dx, +=) or the initial conv state (dinit, +=; dropped when the
// state was zeros).
template <class T>
void route_final_conv_grad(const Tensor& dfin_, Tensor& dx, Tensor* dinit,
                           const std::vector<int64_t>& cu, int64_t width) {
  const Tensor dfin = as_dtype(dfin_, dtype_of<T>::value).contiguous();
  const int64_t c = dx.size(1), wm = width - 1;
  const T* pf = dfin.data<T>();
  T* px = dx.data<T>();
  T* ps = dinit ? dinit->data<T>() : nullptr;
  for (size_t n = 0; n + 1 < cu.size(); ++n) {
    const int64_t bos = cu[n], len = cu[n + 1] - bos;
    for (int64_t i = 0; i < wm; ++i) {
      const int64_t p = len - wm + i;  // local position the entry was copied from
      const T* src = pf + (int64_t(n) * wm + i) * c;
      if (p >= 0) {
        T* dst = px + (bos + p) * c;
        for (int64_t ch = 0; ch < c; ++ch) dst[ch] += src[ch];
      } else if (ps) {
        T* dst = ps + (int64_t(n) * wm + p + wm) * c;
        for (int64_t ch = 0; ch < c; ++ch) dst[ch] += src[ch];
      }
    }
  }
}

// Shape and dtype checks of an optional state tensor.
void check_state(const Tensor& t, const Shape& shape, Device dev, const std::string& where,
                 const char* what) {
  if (!t.defined()) return;
  HLM_CHECK(t.device() == dev &&
                (t.dtype() == DType::f64 || t.dtype() == DType::f32 || t.dtype() == DType::bf16),
            "{}: {} must be an f64, f32 or bf16 tensor on the device of x ({}), got {}", where,
            what, device_name(dev), t.describe());
  HLM_CHECK(t.shape() == shape, "{}: {} must have shape {}, got {}", where, what, shape_str(shape),
            t.describe());
}

}  // namespace

// ---- construction -----------------------------------------------------------------------------

KdaLayer::KdaLayer(const KdaConfig& config, const PrecisionPolicy& policy, const std::string& path,
                   DType dt)
    : cfg_(config), path_(path) {
  cfg_.validate();
  HLM_CHECK(dt == DType::f64 || dt == DType::f32 || dt == DType::bf16,
            "{}: parameter dtype must be f64, f32 or bf16, got {}", where(), dtype_name(dt));
  const int64_t D = cfg_.hidden_size, HV = cfg_.num_v_heads, K = cfg_.head_k_dim,
                V = cfg_.head_v_dim, W = cfg_.conv_kernel;
  auto add_linear = [&](Linear& l, const std::string& name, int64_t in, int64_t out, bool bias,
                        ModuleRole role) {
    l.init(in, out, bias, policy.resolve(path_.empty() ? name : path_ + "." + name, role), dt);
    add_child(name, &l);
    linears_.emplace_back(name, &l);
  };
  const std::string gate_prefix =
      cfg_.naming == KdaNaming::glm5_next_transformers ? "forget_gate." : "";
  add_linear(q_proj_, "q_proj", D, cfg_.qk_dim(), false, ModuleRole::kda_proj);
  add_linear(k_proj_, "k_proj", D, cfg_.qk_dim(), false, ModuleRole::kda_proj);
  add_linear(v_proj_, "v_proj", D, cfg_.v_dim(), false, ModuleRole::kda_proj);
  f_b_ = std::make_unique<Linear>();
  if (cfg_.decay_rank > 0) {
    f_a_ = std::make_unique<Linear>();
    add_linear(*f_a_, gate_prefix + "f_a_proj", D, cfg_.decay_rank, false, ModuleRole::kda_gate);
    add_linear(*f_b_, gate_prefix + "f_b_proj", cfg_.decay_rank, HV * K, false,
               ModuleRole::kda_gate);
  } else {
    add_linear(*f_b_, gate_prefix + "f_proj", D, HV * K, false, ModuleRole::kda_gate);
  }
  add_linear(b_proj_, "b_proj", D, HV, false, ModuleRole::kda_gate);
  g_b_ = std::make_unique<Linear>();
  if (cfg_.output_gate_rank > 0) {
    g_a_ = std::make_unique<Linear>();
    add_linear(*g_a_, "g_a_proj", D, cfg_.output_gate_rank, false, ModuleRole::kda_gate);
    add_linear(*g_b_, "g_b_proj", cfg_.output_gate_rank, cfg_.v_dim(), cfg_.output_gate_bias,
               ModuleRole::kda_gate);
  } else {
    add_linear(*g_b_, "g_proj", D, cfg_.v_dim(), cfg_.output_gate_bias, ModuleRole::kda_gate);
  }
  add_linear(o_proj_, "o_proj", cfg_.v_dim(), D, false, ModuleRole::kda_proj);

  // Conv weights [C, 1, W] (HF Conv1d layout, groups = C).
  const int64_t chans[3] = {cfg_.qk_dim(), cfg_.qk_dim(), cfg_.v_dim()};
  if (cfg_.naming == KdaNaming::kimi_linear) {
    const char* names[3] = {"q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"};
    for (int i = 0; i < 3; ++i) {
      Param& p = add_param(names[i], Tensor::zeros({chans[i], 1, W}, dt));
      conv_params_.push_back(&p);
      conv_[i] = Conv{&p, 0, chans[i]};
    }
  } else {
    Param& p = add_param("conv1d.weight", Tensor::zeros({cfg_.conv_dim(), 1, W}, dt));
    conv_params_.push_back(&p);
    int64_t row = 0;
    for (int i = 0; i < 3; ++i) {
      conv_[i] = Conv{&p, row, chans[i]};
      row += chans[i];
    }
  }
  const DType keep = hlm::compute_dtype(dt);
  A_log_ = &add_param(gate_prefix + "A_log", Tensor::zeros({HV}, keep), true, true);
  dt_bias_ = &add_param(gate_prefix + "dt_bias", Tensor::zeros({HV * K}, keep), true, true);
  o_norm_ = &add_param("o_norm.weight", Tensor::full({V}, 1.0, dt), false, true);
}

std::string KdaLayer::where() const {
  return fmt::format("KdaLayer '{}'", path_);
}

std::vector<std::pair<std::string, Linear*>> KdaLayer::linears() {
  return linears_;
}

void KdaLayer::init_weights(uint64_t seed, double init_std) {
  // Fixed stream numbers per parameter role, independent of the naming option.
  auto fill_linear = [&](Linear& l, uint64_t stream) {
    Rng rng(seed, stream);
    Tensor w = Tensor::empty(l.weight().value.shape(), DType::f64);
    if (init_std > 0) {
      rng.fill_normal(w, 0.0, init_std);
    } else {
      const double bound = 1.0 / std::sqrt(double(l.in_features()));
      rng.fill_uniform(w, -bound, bound);
    }
    l.weight().value.copy_(w);
    if (l.bias()) l.bias()->value.zero_();
  };
  fill_linear(q_proj_, 1);
  fill_linear(k_proj_, 2);
  fill_linear(v_proj_, 3);
  if (f_a_) fill_linear(*f_a_, 4);
  fill_linear(*f_b_, 5);
  fill_linear(b_proj_, 6);
  if (g_a_) fill_linear(*g_a_, 7);
  fill_linear(*g_b_, 8);
  fill_linear(o_proj_, 10);
  const int64_t W = cfg_.conv_kernel;
  for (int i = 0; i < 3; ++i) {
    Rng rng(seed, 11 + uint64_t(i));
    Tensor w = Tensor::empty({conv_[i].channels, W}, DType::f64);
    const double bound = 1.0 / std::sqrt(double(W));
    rng.fill_uniform(w, -bound, bound);
    conv_[i]
        .param->value.view({-1, W})
        .slice(0, conv_[i].row0, conv_[i].row0 + conv_[i].channels)
        .copy_(w);
  }
  {
    Rng rng(seed, 14);
    Tensor a = Tensor::zeros({cfg_.num_v_heads}, DType::f64);
    if (cfg_.gate == ops::KdaGateKind::standard) {
      rng.fill_uniform(a, 1.0, 16.0);
      double* p = a.data<double>();
      for (int64_t i = 0; i < a.numel(); ++i) p[i] = std::log(p[i]);
    }
    A_log_->value.copy_(a);
  }
  {
    Rng rng(seed, 15);
    Tensor b = Tensor::empty(dt_bias_->value.shape(), DType::f64);
    rng.fill_uniform(b, std::log(1e-3), std::log(1e-1));
    double* p = b.data<double>();
    for (int64_t i = 0; i < b.numel(); ++i) {
      const double dt = std::max(std::exp(p[i]), 1e-4);
      p[i] = dt + std::log(-std::expm1(-dt));  // softplus^-1(dt)
    }
    dt_bias_->value.copy_(b);
  }
  o_norm_->value.fill_(1.0);
}

Tensor KdaLayer::conv_weight(int which, DType dt) const {
  const Conv& c = conv_[which];
  return as_dtype(c.param->value.view({-1, cfg_.conv_kernel}).slice(0, c.row0, c.row0 + c.channels),
                  dt)
      .contiguous();
}

// ---- forward ----------------------------------------------------------------------------------

namespace {

// The ops-level kind of what the core's forward keeps (core_save != none).
ops::KdaSave core_save_kind(const KdaConfig& cfg) {
  return cfg.core_save == KdaCoreSave::all ? ops::KdaSave::all : ops::KdaSave::kept;
}

// The core op's arguments (gate, l2norm and beta sigmoid fused).
ops::KdaArgs core_args(const KdaConfig& cfg, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& z, const Tensor& b, const Tensor& s0, const SeqLayout& seqs,
                       const Tensor& A_log, const Tensor& dt_bias) {
  ops::KdaArgs a;
  a.q = q;
  a.k = k;
  a.v = v;
  a.g = z;
  a.beta = b;
  a.initial_state = s0;
  a.seqs = seqs;
  a.use_qk_l2norm = true;
  a.beta_logits = true;
  a.gate = cfg.gate;
  a.A_log = A_log;
  a.dt_bias = dt_bias;
  a.lower_bound = cfg.lower_bound;
  return a;
}

}  // namespace

void KdaLayer::check_input(const Tensor& x) const {
  const std::string w = where();
  HLM_CHECK(x.defined() && x.device() == q_proj_.weight_value().device(),
            "{}: x must be a defined tensor on the device of the parameters ({}), got {}", w,
            device_name(q_proj_.weight_value().device()), x.defined() ? x.describe() : "undefined");
  HLM_CHECK(x.is_cpu() || cfg_.core == KdaCoreImpl::chunk,
            "{}: the FP64 recurrent core (config.core = recurrent) runs on the CPU only; x is {}",
            w, x.describe());
  HLM_CHECK(x.dtype() == DType::f64 || x.dtype() == DType::f32 || x.dtype() == DType::bf16,
            "{}: x must be f64, f32 or bf16, got {}", w, x.describe());
  HLM_CHECK(x.dim() == 2 && x.size(1) == cfg_.hidden_size,
            "{}: x must be [T, hidden_size = {}], got {}", w, cfg_.hidden_size, x.describe());
}

Tensor KdaLayer::forward(const Context& ctx, const Tensor& x, const Tensor& cu_seqlens,
                         const KdaState* initial, Saved* saved, KdaState* final_state) const {
  check_input(x);
  const std::string what = where() + ": cu_seqlens";
  const SeqLayout seqs = SeqLayout::from_tensor(cu_seqlens, x.size(0), what.c_str());
  HLM_CHECK(seqs.num_seqs() >= 1, "{}: cu_seqlens must hold N+1 >= 2 entries, got 1", where());
  return forward(ctx, x, seqs, initial, saved, final_state);
}

Tensor KdaLayer::forward(const Context& ctx, const Tensor& x, const SeqLayout& seqs,
                         const KdaState* initial, Saved* saved, KdaState* final_state) const {
  check_input(x);
  const std::string w = where();
  const int64_t T = x.size(0);
  seqs.check_tokens(T, w.c_str(), "x");
  HLM_CHECK(seqs.num_seqs() >= 1, "{}: the sequence layout must hold N >= 1 sequences, got 0", w);
  const int64_t N = seqs.num_seqs();
  const DType cdt = hlm::compute_dtype(x.dtype());
  KdaState init;
  if (initial) {
    check_state(initial->conv, {N, cfg_.conv_kernel - 1, cfg_.conv_dim()}, x.device(), w,
                "initial conv state [N, W-1, 2HK + HV V]");
    check_state(initial->recurrent, {N, cfg_.num_v_heads, cfg_.head_k_dim, cfg_.head_v_dim},
                x.device(), w, "initial recurrent state [N, HV, K, V]");
    if (initial->conv.defined()) init.conv = ops::contiguous(as_dtype(initial->conv, cdt));
    if (initial->recurrent.defined())
      init.recurrent = ops::contiguous(as_dtype(initial->recurrent, cdt));
  }
  const Tensor xc = ops::contiguous(as_dtype(x, cdt));
  const bool save = ctx.training && saved != nullptr;
  if (saved) *saved = Saved{};
  Saved* full = save && !ctx.recompute ? saved : nullptr;
  const Tensor y = run_forward(ctx, xc, seqs, init, full, final_state);
  if (save) {
    saved->x = xc;
    saved->seqs = seqs;
    saved->initial = init;
    saved->x_dtype = x.dtype();
    saved->recompute = ctx.recompute;
  }
  return as_dtype(y, x.dtype());
}

Tensor KdaLayer::run_forward(const Context& ctx, const Tensor& xc, const SeqLayout& seqs,
                             const KdaState& init, Saved* s, KdaState* final_state) const {
  const DType cdt = xc.dtype();
  const int64_t T = xc.size(0), H = cfg_.num_heads, HV = cfg_.num_v_heads, K = cfg_.head_k_dim,
                V = cfg_.head_v_dim;
  auto ls = [&](Linear::Saved Saved::*m) -> Linear::Saved* { return s ? &(s->*m) : nullptr; };

  // Projections, then the short conv + SiLU per part (channels q | k | v of the conv state).
  Tensor pre[3], act[3], fin[3];
  pre[0] = q_proj_.forward(ctx, xc, ls(&Saved::q_proj));
  pre[1] = k_proj_.forward(ctx, xc, ls(&Saved::k_proj));
  pre[2] = v_proj_.forward(ctx, xc, ls(&Saved::v_proj));
  int64_t off = 0;
  for (int i = 0; i < 3; ++i) {
    const int64_t ch = conv_[i].channels;
    const Tensor st0 =
        init.conv.defined() ? ops::contiguous(init.conv.slice(2, off, off + ch)) : Tensor();
    act[i] = ops::causal_conv1d_forward(pre[i], conv_weight(i, cdt), seqs, st0, /*silu=*/true,
                                        final_state ? &fin[i] : nullptr);
    off += ch;
  }
  // Decay-gate input z, beta logits.
  const Tensor z =
      f_a_ ? f_b_->forward(ctx, f_a_->forward(ctx, xc, ls(&Saved::f_a)), ls(&Saved::f_b))
           : f_b_->forward(ctx, xc, ls(&Saved::f_b));
  const Tensor b = b_proj_.forward(ctx, xc, ls(&Saved::b_proj));
  // The core: l2norm(q) K^-1/2, l2norm(k), v, gate(z), sigmoid(b), per sequence.
  const Tensor q = act[0].view({T, H, K}), k = act[1].view({T, H, K}), v = act[2].view({T, HV, V}),
               z3 = z.view({T, HV, K});
  const ops::KdaArgs a =
      core_args(cfg_, q, k, v, z3, b, init.recurrent, seqs, A_log_->value, dt_bias_->value);
  Tensor core_saved;
  profile::Scope ps_core("kda core");
  const ops::KdaOutput out = cfg_.core != KdaCoreImpl::chunk ? ops::kda_recurrent(a)
                             : s && cfg_.core_save != KdaCoreSave::none
                                 ? ops::kda_chunk(a, &core_saved, core_save_kind(cfg_))
                                 : ops::kda_chunk(a);
  ps_core.end();
  const Tensor o = as_dtype(out.o, cdt);
  // Output gate, gated RMSNorm over V (one weight for all heads), output projection.
  const Tensor og =
      g_a_ ? g_b_->forward(ctx, g_a_->forward(ctx, xc, ls(&Saved::g_a)), ls(&Saved::g_b))
           : g_b_->forward(ctx, xc, ls(&Saved::g_b));
  const Tensor og3 = og.view({T, HV, V});
  const ops::RmsNormResult nr =
      ops::gated_rmsnorm_forward(o, og3, as_dtype(o_norm_->value, cdt), cfg_.norm_eps);
  const Tensor y = o_proj_.forward(ctx, nr.y.view({T, HV * V}), ls(&Saved::o_proj));

  if (final_state) {
    final_state->conv = cat_last({fin[0], fin[1], fin[2]});
    final_state->recurrent = as_dtype(out.final_state, cdt);
  }
  if (s) {
    s->q_pre = pre[0];
    s->k_pre = pre[1];
    s->v_pre = pre[2];
    s->q = q;
    s->k = k;
    s->v = v;
    s->z = z3;
    s->beta_logits = b;
    s->o = o;
    s->og = og3;
    s->rstd = nr.rstd;
    s->core = core_saved;
  }
  return y;
}

Tensor KdaLayer::decode_step(const Tensor& x, const KdaState& pool,
                             const std::vector<int64_t>& slots) const {
  check_input(x);
  const std::string w = where();
  const int64_t N = x.dim() == 2 ? x.size(0) : -1, H = cfg_.num_heads, HV = cfg_.num_v_heads,
                K = cfg_.head_k_dim, V = cfg_.head_v_dim, Wm = cfg_.conv_kernel - 1,
                C = cfg_.conv_dim();
  HLM_CHECK(N >= 1 && int64_t(slots.size()) == N,
            "{}: decode_step takes x [N >= 1, D] and N slots, got {} and {} slots", w, x.describe(),
            slots.size());
  const DType cdt = hlm::compute_dtype(x.dtype());
  HLM_CHECK(cdt == DType::f32, "{}: decode_step computes in f32, x is {}", w, x.describe());
  HLM_CHECK(pool.conv.defined() && pool.recurrent.defined() && pool.conv.dim() == 3 &&
                pool.conv.size(1) == Wm && pool.conv.size(2) == C &&
                pool.recurrent.shape() == Shape({pool.conv.size(0), HV, K, V}) &&
                pool.conv.dtype() == DType::f32 && pool.recurrent.dtype() == DType::f32 &&
                pool.conv.device() == x.device() && pool.recurrent.device() == x.device() &&
                pool.conv.is_contiguous() && pool.recurrent.is_contiguous(),
            "{}: decode_step needs contiguous f32 state pools [S, {}, {}] and [S, {}, {}, {}] on "
            "x's device",
            w, Wm, C, HV, K, V);
  const int64_t S = pool.conv.size(0);
  const Context ctx{false, false};
  const Tensor xc = ops::contiguous(as_dtype(x, cdt));

  // Projections; the short conv of each part advanced by one token from the slots' conv states.
  Tensor conv = ops::gather_rows(pool.conv.view({S, Wm * C}), slots).view({N, Wm, C});
  Tensor act[3], st[3];
  const Linear* proj[3] = {&q_proj_, &k_proj_, &v_proj_};
  int64_t off = 0;
  for (int i = 0; i < 3; ++i) {
    const int64_t ch = conv_[i].channels;
    st[i] = ops::contiguous(conv.slice(2, off, off + ch));
    act[i] = ops::causal_conv1d_update(proj[i]->forward(ctx, xc, nullptr), st[i],
                                       conv_weight(i, cdt), /*silu=*/true);
    off += ch;
  }
  Tensor pool_conv = pool.conv.view({S, Wm * C});
  ops::scatter_rows(pool_conv, slots, cat_last({st[0], st[1], st[2]}).view({N, Wm * C}));

  // The decay gate, beta, and the recurrent step in place.
  const Tensor z = f_a_ ? f_b_->forward(ctx, f_a_->forward(ctx, xc, nullptr), nullptr)
                        : f_b_->forward(ctx, xc, nullptr);
  ops::KdaGateArgs ga;
  ga.z = z.view({N, HV, K});
  ga.A_log = A_log_->value;
  ga.dt_bias = dt_bias_->value;
  ga.kind = cfg_.gate;
  ga.lower_bound = cfg_.lower_bound;
  ops::KdaDecodeArgs da;
  da.q = act[0].view({N, H, K});
  da.k = act[1].view({N, H, K});
  da.v = act[2].view({N, HV, V});
  da.g = ops::kda_gate(ga);
  da.beta = ops::sigmoid_forward(b_proj_.forward(ctx, xc, nullptr)).view({N, HV});
  da.state = pool.recurrent;
  da.state_indices = Tensor::from_vector<int64_t>({N}, slots);
  if (!x.is_cpu()) da.state_indices = da.state_indices.to(x.device());
  da.use_qk_l2norm = true;
  const Tensor o = ops::kda_decode_step(da);

  // Output gate, gated RMSNorm, output projection.
  const Tensor og = g_a_ ? g_b_->forward(ctx, g_a_->forward(ctx, xc, nullptr), nullptr)
                         : g_b_->forward(ctx, xc, nullptr);
  const ops::RmsNormResult nr = ops::gated_rmsnorm_forward(
      o, og.view({N, HV, V}), as_dtype(o_norm_->value, cdt), cfg_.norm_eps);
  return as_dtype(o_proj_.forward(ctx, nr.y.view({N, HV * V}), nullptr), x.dtype());
}

// ---- backward ---------------------------------------------------------------------------------

KdaLayer::Grads KdaLayer::backward(const Context& ctx, const Tensor& dy, const Saved& saved,
                                   const KdaState* d_final) {
  const std::string w = where();
  HLM_CHECK(saved.x.defined(),
            "{}: backward needs the Saved of a training forward (Saved has no input)", w);
  const Tensor& xc = saved.x;
  const DType cdt = xc.dtype();
  const int64_t T = xc.size(0), D = cfg_.hidden_size, HV = cfg_.num_v_heads, K = cfg_.head_k_dim,
                V = cfg_.head_v_dim, W = cfg_.conv_kernel;
  HLM_CHECK(dy.defined() && dy.device() == xc.device() &&
                (dy.dtype() == DType::f64 || dy.dtype() == DType::f32 || dy.dtype() == DType::bf16),
            "{}: dy must be an f64, f32 or bf16 tensor on the device of x ({}), got {}", w,
            device_name(xc.device()), dy.defined() ? dy.describe() : "undefined");
  HLM_CHECK(dy.dim() == 2 && dy.size(0) == T && dy.size(1) == D,
            "{}: dy must be [T = {}, hidden_size = {}], got {}", w, T, D, dy.describe());
  saved.seqs.check_tokens(T, w.c_str(), "the saved input");
  const std::vector<int64_t>& cu = saved.seqs.offsets();
  const int64_t N = saved.seqs.num_seqs();
  Tensor dfin_conv, dfin_rec;
  if (d_final) {
    check_state(d_final->conv, {N, W - 1, cfg_.conv_dim()}, xc.device(), w,
                "final conv state gradient");
    check_state(d_final->recurrent, {N, HV, K, V}, xc.device(), w,
                "final recurrent state gradient");
    if (d_final->conv.defined()) dfin_conv = ops::contiguous(as_dtype(d_final->conv, cdt));
    if (d_final->recurrent.defined()) dfin_rec = ops::contiguous(as_dtype(d_final->recurrent, cdt));
  }
  Saved recomputed;
  const Saved* s = &saved;
  if (saved.recompute) {
    Context c;
    c.training = true;
    c.recompute = false;
    run_forward(c, xc, saved.seqs, saved.initial, &recomputed, nullptr);
    s = &recomputed;
  }
  HLM_CHECK(s->o.defined(), "{}: Saved holds no activations (forward ran with saved = nullptr?)",
            w);
  const Tensor dyc = ops::contiguous(as_dtype(dy, cdt));

  // Output projection, gated RMSNorm, output gate.
  const Tensor d_on = o_proj_.backward(ctx, dyc, s->o_proj);
  Tensor dw_norm = Tensor::zeros({V}, cdt, xc.device());
  const ops::GatedRmsNormGrads gn = ops::gated_rmsnorm_backward(
      d_on.view({T, HV, V}), s->o, s->og, as_dtype(o_norm_->value, cdt), s->rstd, dw_norm);
  accumulate(*o_norm_, dw_norm);
  const Tensor dog = gn.dgate.view({T, HV * V});
  const Tensor dx_g = g_a_ ? g_a_->backward(ctx, g_b_->backward(ctx, dog, s->g_b), s->g_a)
                           : g_b_->backward(ctx, dog, s->g_b);

  // The core.
  const ops::KdaArgs a =
      core_args(cfg_, s->q, s->k, s->v, s->z, s->beta_logits, saved.initial.recurrent, saved.seqs,
                A_log_->value, dt_bias_->value);
  profile::Scope ps_core("kda core");
  const ops::KdaGrads cg =
      cfg_.core == KdaCoreImpl::chunk
          ? ops::kda_chunk_backward(a, gn.dx, dfin_rec, s->core, core_save_kind(cfg_))
          : ops::kda_recurrent_backward(a, gn.dx, dfin_rec);
  ps_core.end();
  accumulate(*A_log_, cg.dA_log);
  accumulate(*dt_bias_, cg.ddt_bias);
  const Tensor dz = as_dtype(cg.dg, cdt).contiguous().view({T, HV * K});
  const Tensor dx_f = f_a_ ? f_a_->backward(ctx, f_b_->backward(ctx, dz, s->f_b), s->f_a)
                           : f_b_->backward(ctx, dz, s->f_b);
  const Tensor dx_b = b_proj_.backward(ctx, as_dtype(cg.dbeta, cdt).contiguous(), s->b_proj);

  // Convs (plus the final conv state's gradient), then the q/k/v projections.
  const Tensor dact[3] = {cg.dq, cg.dk, cg.dv};
  const Tensor* pre[3] = {&s->q_pre, &s->k_pre, &s->v_pre};
  Linear* proj[3] = {&q_proj_, &k_proj_, &v_proj_};
  const Linear::Saved* proj_saved[3] = {&s->q_proj, &s->k_proj, &s->v_proj};
  Tensor dinit_conv[3], dx_p[3];
  int64_t off = 0;
  for (int i = 0; i < 3; ++i) {
    const int64_t ch = conv_[i].channels;
    const Tensor st0 = saved.initial.conv.defined()
                           ? ops::contiguous(saved.initial.conv.slice(2, off, off + ch))
                           : Tensor();
    Tensor dw = Tensor::zeros({ch, W}, cdt, xc.device());
    ops::CausalConv1dGrads g =
        ops::causal_conv1d_backward(as_dtype(dact[i], cdt).contiguous().view({T, ch}), *pre[i],
                                    conv_weight(i, cdt), saved.seqs, st0, true, dw);
    accumulate(*conv_[i].param, dw, conv_[i].row0 * W);
    if (dfin_conv.defined()) {
      const Tensor dfi = dfin_conv.slice(2, off, off + ch);
      Tensor* dinit = st0.defined() ? &g.dinitial_state : nullptr;
      if (!g.dx.is_cpu())
        ops::causal_conv1d_final_state_backward(dfi, cu, W, g.dx, dinit);
      else if (cdt == DType::f64)
        route_final_conv_grad<double>(dfi, g.dx, dinit, cu, W);
      else
        route_final_conv_grad<float>(dfi, g.dx, dinit, cu, W);
    }
    dinit_conv[i] = g.dinitial_state;
    dx_p[i] = proj[i]->backward(ctx, g.dx, *proj_saved[i]);
    off += ch;
  }

  Tensor dx = dx_p[0].clone();
  add_inplace(dx, dx_p[1]);
  add_inplace(dx, dx_p[2]);
  add_inplace(dx, dx_f);
  add_inplace(dx, dx_b);
  add_inplace(dx, dx_g);
  Grads out;
  out.dx = as_dtype(dx, saved.x_dtype);
  if (saved.initial.conv.defined())
    out.dinitial.conv = cat_last({dinit_conv[0], dinit_conv[1], dinit_conv[2]});
  if (saved.initial.recurrent.defined()) out.dinitial.recurrent = as_dtype(cg.dinitial_state, cdt);
  return out;
}

}  // namespace hlm
