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

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "core/enum_names.h"
#include "core/profile.h"
#include "core/rng.h"
#include "dist/context_parallel.h"
#include "ops/activations.h"
#include "ops/conv1d.h"
#include "ops/gemm.h"
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

Tensor KdaLayer::conv_weight(int which, DType dt, int64_t c0, int64_t c1) const {
  const Conv& c = conv_[which];
  if (c1 < 0) c1 = c.channels;
  return as_dtype(c.param->value.view({-1, cfg_.conv_kernel}).slice(0, c.row0 + c0, c.row0 + c1),
                  dt)
      .contiguous();
}

Tensor KdaLayer::conv_weights(DType dt) const {
  if (conv_params_.size() == 1)
    return as_dtype(conv_params_.front()->value.view({-1, cfg_.conv_kernel}), dt).contiguous();
  Tensor w =
      Tensor::empty({cfg_.conv_dim(), cfg_.conv_kernel}, dt, conv_params_.front()->value.device());
  int64_t row = 0;
  for (int i = 0; i < 3; ++i) {
    Tensor rows = w.slice(0, row, row + conv_[i].channels);
    ops::copy_into(rows, conv_weight(i, dt));
    row += conv_[i].channels;
  }
  return w;
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

// ---- context parallel (docs/parallel.md, "Context parallelism") ----
//
// The recurrence of one sequence is affine in its initial state: over a run of tokens,
// S_end = M S_0 + S_ext with M = prod_t (I - beta_t k_t k_t^T) Diag(alpha_t) [K, K] per value head
// and S_ext the state reached from S_0 = 0. The core op gives both: S_ext as the final state from
// zeros, M as the final state of the same recurrence run with zero values from S_0 = I (a K-wide
// "value"). Rank r's first sequence starts from S_in(r) = M_{r-1} S_in(r-1) + S_ext_{r-1} over
// the ranks that share it. The backward is the transpose: dS_in(r) = G_r + M_r^T dS_out(r), with
// G_r the state gradient from this rank's own outputs, and dS_out(r) = dS_in(r + 1).

// c[h] (+)= op(a[h]) b[h] per value head: a [HV, K, K], b and c [HV, K, V] (contiguous, one
// device).
void per_head_product(const Tensor& a, bool trans_a, const Tensor& b, Tensor& c) {
  const int64_t HV = a.size(0), K = a.size(1), V = b.size(2);
  std::vector<ops::GemmGroup> groups;
  for (int64_t h = 0; h < HV; ++h) groups.push_back({K, V, K, h * K * K, h * K * V, h * K * V});
  ops::gemm_grouped(a, trans_a, b, false, c, groups, 1.0, 1.0);
}

// [N, ...] zeros with row n = t (t of one row's shape), on t's device.
Tensor one_row(const Tensor& t, int64_t N, int64_t n) {
  Shape s{N};
  for (int64_t d : t.shape()) s.push_back(d);
  Tensor out = Tensor::zeros(s, t.dtype(), t.device());
  Tensor dst = out.slice(0, n, n + 1).view(t.shape());
  ops::copy_into(dst, t);
  return out;
}

// Row n of a [N, ...] tensor as its own contiguous tensor.
Tensor row_of(const Tensor& t, int64_t n) {
  Shape s(t.shape().begin() + 1, t.shape().end());
  return ops::contiguous(t.slice(0, n, n + 1)).view(s);
}

}  // namespace

// What a context-parallel forward passes to its backward (KdaLayer::Saved::cp).
struct KdaCpSaved {
  dist::CpSlice slice;
  bool headwise = false;
  // Chunkwise: M of ranks rank+1, rank+2, ...: the single slices through which this rank's last
  // sequence goes on, whose transposes carry the state gradient back ([HV, K, K] each).
  std::vector<Tensor> chain_M;
};

struct KdaCpRun {
  const dist::CpSlice& slice;
  bool headwise = false;
  KdaState init;  // chunkwise: the states this rank's first sequence continues from
  std::vector<Tensor> chain_M;
};

namespace {

// A contiguous copy of t on its device.
Tensor copy_of(const Tensor& t) {
  Tensor out = Tensor::empty(t.shape(), t.dtype(), t.device());
  ops::copy_into(out, t);
  return out;
}

// The short conv's first W-1 inputs on this rank: every rank sends its last W-1 conv inputs
// q~|k~|v~ [W-1, C]; a rank whose first sequence began before its slice takes the ones of that
// sequence (zeros before its start, possibly from several short ranks) as the initial conv state
// [N_local, W-1, C] of that sequence. Undefined when the slice starts a sequence.
Tensor cp_conv_halo(const dist::CpSlice& cp, const Tensor (&pre)[3], int64_t W) {
  const int64_t Wm = W - 1;
  if (Wm == 0) return Tensor();
  const int R = cp.rank();
  const int64_t T = pre[0].size(0), m = std::min(Wm, T);
  const Tensor tails =
      cat_last({pre[0].slice(0, T - m, T), pre[1].slice(0, T - m, T), pre[2].slice(0, T - m, T)});
  const int64_t C = tails.size(1);
  Tensor tail = Tensor::zeros({Wm, C}, tails.dtype(), tails.device());
  Tensor last = tail.slice(0, Wm - m, Wm);
  ops::copy_into(last, tails);
  const Tensor all = cp.allgather(tail);  // [size Wm, C]: rank j's input at end(j) - Wm + i
  if (!cp.continues(R)) return Tensor();
  const int64_t t0 = cp.begin(R), s0 = cp.sequence_begin(t0);
  std::vector<int64_t> rows;
  const int64_t first = std::max<int64_t>(0, s0 - (t0 - Wm));  // entries before s0 stay zero
  for (int64_t i = first; i < Wm; ++i) {
    const int64_t p = t0 - Wm + i;
    const int j = cp.owner(p);
    rows.push_back(j * Wm + p - (cp.end(j) - Wm));
  }
  Tensor halo = Tensor::zeros({cp.local().num_seqs(), Wm, C}, tails.dtype(), tails.device());
  Tensor known = halo.view({-1, C}).slice(0, first, Wm);
  ops::copy_into(known, ops::gather_rows(all, rows));
  return halo;
}

// The backward of cp_conv_halo: every rank sends the gradient of its halo (dhalo [W-1, C], or
// zeros), and each rank adds the entries that were its conv inputs into dpre (q~, k~, v~ parts of
// ch[i] channels), the later ranks' in rank order.
void cp_conv_halo_backward(const dist::CpSlice& cp, const Tensor& dhalo, Tensor (&dpre)[3],
                           const int64_t (&ch)[3], int64_t W) {
  const int64_t Wm = W - 1;
  if (Wm == 0) return;
  const int R = cp.rank();
  const int64_t C = ch[0] + ch[1] + ch[2];
  const Tensor send =
      dhalo.defined() ? dhalo : Tensor::zeros({Wm, C}, dpre[0].dtype(), dpre[0].device());
  const Tensor all = cp.allgather(send);
  const int64_t t0 = cp.begin(R), t1 = cp.end(R);
  // A later rank's halo reaches back into this slice only through ranks that continue it.
  for (int r = R + 1; r < cp.size() && cp.continues(r); ++r) {
    const int64_t b = cp.begin(r), s0 = cp.sequence_begin(b);
    for (int64_t i = 0; i < Wm; ++i) {
      const int64_t p = b - Wm + i;
      if (p < s0 || p < t0 || p >= t1) continue;
      const Tensor src = all.slice(0, r * Wm + i, r * Wm + i + 1);
      int64_t off = 0;
      for (int part = 0; part < 3; ++part) {
        Tensor dst = dpre[part].slice(0, p - t0, p - t0 + 1);
        ops::add_(dst, src.slice(1, off, off + ch[part]));
        off += ch[part];
      }
    }
  }
}

// Headwise over `headwise`: this rank's heads, qk [h0, h1) and value [hv0, hv1) (nullptr: all).
struct HeadRange {
  int64_t h0, h1, hv0, hv1;
};
HeadRange head_range(const KdaConfig& c, const dist::CpSlice* headwise) {
  if (!headwise) return {0, c.num_heads, 0, c.num_v_heads};
  const int64_t r = headwise->rank(), n = headwise->size(), h = c.num_heads / n,
                hv = c.num_v_heads / n;
  return {r * h, (r + 1) * h, r * hv, (r + 1) * hv};
}

// The channels of conv part i (q, k, v) that belong to the heads of hr.
std::pair<int64_t, int64_t> part_channels(const KdaConfig& c, int i, const HeadRange& hr) {
  return i < 2 ? std::pair{hr.h0 * c.head_k_dim, hr.h1 * c.head_k_dim}
               : std::pair{hr.hv0 * c.head_v_dim, hr.hv1 * c.head_v_dim};
}

// Entries [hv0 per, hv1 per) of a per-value-head parameter (A_log: per = 1, dt_bias: per = K).
Tensor head_rows(const Tensor& t, const HeadRange& hr, int64_t per) {
  return t.size(0) == (hr.hv1 - hr.hv0) * per ? t : copy_of(t.slice(0, hr.hv0 * per, hr.hv1 * per));
}

// Headwise, one all-to-all over parts p_j: rank r gets this rank's block send(p_j, r) ([rows, w_j]
// each; blocks padded to the longest slice), and the block rank r sent lands in
// recv(o_j, r) of the output o_j = a new tensor of shape out(p_j).
template <class Out, class Send, class Recv>
std::vector<Tensor> exchange_blocks(const dist::CpSlice& cp, const std::vector<Tensor>& parts,
                                    const Out& out, const Send& send, const Recv& recv) {
  const int n = cp.size();
  int64_t Tmax = 0, P = 0;
  for (int r = 0; r < n; ++r) Tmax = std::max(Tmax, cp.tokens(r));
  for (const Tensor& t : parts) P += send(t, 0).size(1);
  const Tensor& t0 = parts.front();
  Tensor buf = Tensor::zeros({n, Tmax, P}, t0.dtype(), t0.device());
  auto block = [&](const Tensor& b, int r, int64_t rows) {  // block r's first rows, [rows, P]
    return b.slice(0, r, r + 1).view({Tmax, P}).slice(0, 0, rows);
  };
  for (int r = 0; r < n; ++r) {
    int64_t off = 0;
    for (const Tensor& t : parts) {
      const Tensor b = send(t, r);
      Tensor dst = block(buf, r, b.size(0)).slice(1, off, off + b.size(1));
      ops::copy_into(dst, b);
      off += b.size(1);
    }
  }
  const Tensor got = cp.alltoall(buf);
  std::vector<Tensor> outs;
  for (const Tensor& t : parts) outs.push_back(Tensor::empty(out(t), t.dtype(), t.device()));
  for (int r = 0; r < n; ++r) {
    int64_t off = 0;
    for (Tensor& o : outs) {
      Tensor dst = recv(o, r);
      ops::copy_into(dst, block(got, r, dst.size(0)).slice(1, off, off + dst.size(1)));
      off += dst.size(1);
    }
  }
  return outs;
}

// Token-sharded parts [T_R, n w_j] (this rank's tokens, every rank's heads: rank r's are columns
// [r w_j, (r+1) w_j)) to head-sharded [T, w_j] (every token, this rank's heads).
std::vector<Tensor> seq_to_heads(const dist::CpSlice& cp, const std::vector<Tensor>& parts) {
  const int n = cp.size();
  return exchange_blocks(
      cp, parts,
      [&](const Tensor& t) {
        return Shape{cp.global().total_tokens(), t.size(1) / n};
      },
      [&](const Tensor& t, int r) {
        const int64_t w = t.size(1) / n;
        return t.slice(1, r * w, (r + 1) * w);
      },
      [&](Tensor& o, int r) { return o.slice(0, cp.begin(r), cp.end(r)); });
}

// The inverse: head-sharded parts [T, w_j] to token-sharded [T_R, n w_j].
std::vector<Tensor> heads_to_seq(const dist::CpSlice& cp, const std::vector<Tensor>& parts) {
  const int n = cp.size();
  return exchange_blocks(
      cp, parts,
      [&](const Tensor& t) {
        return Shape{cp.tokens(cp.rank()), n * t.size(1)};
      },
      [&](const Tensor& t, int r) { return t.slice(0, cp.begin(r), cp.end(r)); },
      [&](Tensor& o, int r) {
        const int64_t w = o.size(1) / n;
        return o.slice(1, r * w, (r + 1) * w);
      });
}

// The core over this rank's slice, its first sequence continuing from the state the earlier
// ranks pass on (see "context parallel" above). core(args, keep) runs the op (keep: the real pass,
// whose saved intermediates the backward reads). a has no initial state.
template <class Core>
ops::KdaOutput cp_core(KdaCpRun& cp, ops::KdaArgs a, const Core& core) {
  const dist::CpSlice& sl = cp.slice;
  const int R = sl.rank(), n = sl.size();
  const int64_t T = a.q.size(0), HV = a.v.size(1), K = a.q.size(2), V = a.v.size(2),
                N = sl.local().num_seqs(), SV = HV * K * V, SK = HV * K * K;
  const Device dev = a.q.device();
  const DType dt = a.q.dtype() == DType::f64 ? DType::f64 : DType::f32;
  Tensor ext = Tensor::zeros({HV, K, V}, dt, dev), M = Tensor::zeros({HV, K, K}, dt, dev);
  std::optional<ops::KdaOutput> out;
  if (sl.goes_on(R)) {
    if (!sl.continues(R)) {
      out = core(a, true);  // from zeros: the real pass
      ext = row_of(as_dtype(out->final_state, dt), N - 1);
    } else {
      ext = row_of(as_dtype(core(a, false).final_state, dt), N - 1);
      if (sl.single(R)) {
        ops::KdaArgs am = a;
        am.v = Tensor::zeros({T, HV, K}, a.v.dtype(), dev);
        Tensor eye = Tensor::zeros({1, HV, K, K}, dt);
        for (int64_t h = 0; h < HV; ++h)
          for (int64_t i = 0; i < K; ++i) {
            const int64_t at = (h * K + i) * K + i;
            if (dt == DType::f64)
              eye.data<double>()[at] = 1;
            else
              eye.data<float>()[at] = 1;
          }
        am.initial_state = dev == Device::cpu ? eye : eye.to(dev);
        M = row_of(as_dtype(core(am, false).final_state, dt), 0);
      }
    }
  }
  Tensor pack = Tensor::empty({1, SV + SK}, dt, dev);
  Tensor pe = pack.slice(1, 0, SV), pm = pack.slice(1, SV, SV + SK);
  ops::copy_into(pe, ext.view({1, SV}));
  ops::copy_into(pm, M.view({1, SK}));
  const Tensor all = sl.allgather(pack);  // [n, SV + SK]
  auto ext_of = [&](int j) {
    return copy_of(all.slice(0, j, j + 1).slice(1, 0, SV)).view({HV, K, V});
  };
  auto M_of = [&](int j) {
    return copy_of(all.slice(0, j, j + 1).slice(1, SV, SV + SK)).view({HV, K, K});
  };
  // The backward carries dS_out back through the single slices after this one.
  if (sl.goes_on(R))
    for (int j = R + 1; j < n && sl.single(j) && sl.goes_on(j); ++j) cp.chain_M.push_back(M_of(j));
  if (!sl.continues(R)) return out ? *out : core(a, true);
  // S_in = M_{R-1} (... (M_{j0+1} S_ext_{j0} + S_ext_{j0+1}) ...) + S_ext_{R-1}, j0 the nearest
  // rank whose last sequence does not continue from before it.
  int j0 = R - 1;
  while (sl.continues(j0) && sl.single(j0)) --j0;
  Tensor S = ext_of(j0);
  for (int j = j0 + 1; j < R; ++j) {
    Tensor c = ext_of(j);
    per_head_product(M_of(j), false, S, c);
    S = c;
  }
  cp.init.recurrent = one_row(S, N, 0);
  a.initial_state = cp.init.recurrent;
  return core(a, true);
}

// The core's backward over this rank's slice: bwd(d_final) runs the op's backward. The state
// gradient at the slice end comes from the later ranks: dS_out(R) = dS_in(R + 1), chained
// through the single slices after it by their transposed M.
template <class Bwd>
ops::KdaGrads cp_core_backward(const KdaCpSaved& cs, const ops::KdaArgs& a, const Bwd& bwd) {
  const dist::CpSlice& sl = cs.slice;
  const int R = sl.rank();
  const int64_t HV = a.v.size(1), K = a.q.size(2), V = a.v.size(2), N = sl.local().num_seqs();
  const Device dev = a.q.device();
  const DType dt = a.q.dtype() == DType::f64 ? DType::f64 : DType::f32;
  std::optional<ops::KdaGrads> g;
  Tensor G = Tensor::zeros({HV, K, V}, dt, dev);
  if (sl.continues(R)) {
    g = bwd(Tensor());  // G_R: the state gradient from this rank's own outputs
    G = row_of(as_dtype(g->dinitial_state, dt), 0);
  }
  const Tensor all = sl.allgather(G.view({1, HV * K * V}));
  if (!sl.goes_on(R)) return g ? *g : bwd(Tensor());
  auto G_of = [&](int j) { return copy_of(all.slice(0, j, j + 1)).view({HV, K, V}); };
  const int end = R + 1 + int(cs.chain_M.size());  // its G has no later part
  Tensor D = G_of(end);
  for (int j = end - 1; j > R; --j) {
    Tensor c = G_of(j);
    per_head_product(cs.chain_M[size_t(j - R - 1)], true, D, c);
    D = c;
  }
  return bwd(one_row(D, N, N - 1));
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

Tensor KdaLayer::forward(const Context& ctx, const Tensor& x, const dist::CpSlice& cp, Saved* saved,
                         KdaCpMode mode) const {
  check_input(x);
  const std::string w = where();
  HLM_CHECK(x.size(0) == cp.tokens(cp.rank()),
            "{}: context parallel rank {} holds tokens [{}, {}) of the batch, x has {} rows", w,
            cp.rank(), cp.begin(cp.rank()), cp.end(cp.rank()), x.size(0));
  const bool headwise = mode == KdaCpMode::headwise;
  HLM_CHECK(!headwise || cfg_.num_heads % cp.size() == 0,
            "{}: headwise context parallelism needs num_heads ({}) divisible by the group's {} "
            "ranks",
            w, cfg_.num_heads, cp.size());
  const Tensor xc = ops::contiguous(as_dtype(x, hlm::compute_dtype(x.dtype())));
  const bool save = ctx.training && saved != nullptr;
  if (saved) *saved = Saved{};
  KdaCpRun run{cp, headwise, {}, {}};
  const Tensor y = run_forward(ctx, xc, cp.local(), KdaState{},
                               save && !ctx.recompute ? saved : nullptr, nullptr, &run);
  if (save) {
    saved->x = xc;
    saved->seqs = cp.local();
    saved->initial = run.init;
    saved->x_dtype = x.dtype();
    saved->recompute = ctx.recompute;
    saved->cp =
        std::make_shared<const KdaCpSaved>(KdaCpSaved{cp, headwise, std::move(run.chain_M)});
  }
  return as_dtype(y, x.dtype());
}

Tensor KdaLayer::run_forward(const Context& ctx, const Tensor& xc, const SeqLayout& seqs_in,
                             const KdaState& init_in, Saved* s, KdaState* final_state,
                             KdaCpRun* cp) const {
  const DType cdt = xc.dtype();
  const int64_t T = xc.size(0), HV = cfg_.num_v_heads, K = cfg_.head_k_dim, V = cfg_.head_v_dim;
  auto ls = [&](Linear::Saved Saved::*m) -> Linear::Saved* { return s ? &(s->*m) : nullptr; };
  const bool headwise = cp && cp->headwise;
  // The heads and tokens the conv and the core run on here: all of this call's, or headwise this
  // rank's heads over the whole batch.
  const HeadRange hr = head_range(cfg_, headwise ? &cp->slice : nullptr);
  const int64_t Hh = hr.h1 - hr.h0, HVh = hr.hv1 - hr.hv0;
  const SeqLayout& seqs = headwise ? cp->slice.global() : seqs_in;

  // Projections: the conv inputs q~ | k~ | v~, the decay-gate input z, the beta logits.
  Tensor pre[3], act[3], fin[3];
  pre[0] = q_proj_.forward(ctx, xc, ls(&Saved::q_proj));
  pre[1] = k_proj_.forward(ctx, xc, ls(&Saved::k_proj));
  pre[2] = v_proj_.forward(ctx, xc, ls(&Saved::v_proj));
  Tensor z = f_a_ ? f_b_->forward(ctx, f_a_->forward(ctx, xc, ls(&Saved::f_a)), ls(&Saved::f_b))
                  : f_b_->forward(ctx, xc, ls(&Saved::f_b));
  Tensor b = b_proj_.forward(ctx, xc, ls(&Saved::b_proj));
  if (headwise) {
    const std::vector<Tensor> h = seq_to_heads(cp->slice, {pre[0], pre[1], pre[2], z, b});
    pre[0] = h[0], pre[1] = h[1], pre[2] = h[2], z = h[3], b = h[4];
  } else if (cp) {
    cp->init.conv = cp_conv_halo(cp->slice, pre, cfg_.conv_kernel);
  }
  const KdaState& init = cp ? cp->init : init_in;
  const int64_t Tc = pre[0].size(0);  // the tokens the conv and the core run on
  // The short conv + SiLU per part (channels q | k | v of the conv state).
  int64_t off = 0;
  for (int i = 0; i < 3; ++i) {
    const int64_t ch = conv_[i].channels;
    const Tensor st0 =
        init.conv.defined() ? ops::contiguous(init.conv.slice(2, off, off + ch)) : Tensor();
    const auto [c0, c1] = part_channels(cfg_, i, hr);
    act[i] = ops::causal_conv1d_forward(pre[i], conv_weight(i, cdt, c0, c1), seqs, st0,
                                        /*silu=*/true, final_state ? &fin[i] : nullptr);
    off += ch;
  }
  // The core: l2norm(q) K^-1/2, l2norm(k), v, gate(z), sigmoid(b), per sequence.
  const Tensor q = act[0].view({Tc, Hh, K}), k = act[1].view({Tc, Hh, K}),
               v = act[2].view({Tc, HVh, V}), z3 = z.view({Tc, HVh, K});
  ops::KdaArgs a = core_args(cfg_, q, k, v, z3, b, init.recurrent, seqs,
                             head_rows(A_log_->value, hr, 1), head_rows(dt_bias_->value, hr, K));
  Tensor core_saved;
  profile::Scope ps_core("kda core");
  auto core = [&](const ops::KdaArgs& args, bool keep) {
    return cfg_.core != KdaCoreImpl::chunk ? ops::kda_recurrent(args)
           : keep && s && cfg_.core_save != KdaCoreSave::none
               ? ops::kda_chunk(args, &core_saved, core_save_kind(cfg_))
               : ops::kda_chunk(args);
  };
  const ops::KdaOutput out = cp && !headwise ? cp_core(*cp, a, core) : core(a, true);
  ps_core.end();
  Tensor o = as_dtype(out.o, cdt);
  if (headwise) o = heads_to_seq(cp->slice, {o.view({Tc, HVh * V})})[0].view({T, HV, V});
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
  const int64_t N = x.dim() == 2 ? x.size(0) : -1, HV = cfg_.num_v_heads, K = cfg_.head_k_dim,
                V = cfg_.head_v_dim, Wm = cfg_.conv_kernel - 1, C = cfg_.conv_dim();
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
  const Tensor xc = ops::contiguous(as_dtype(x, cdt));

  // Every projection reads x: under bf16 GEMMs x is rounded once here, and each GEMM writes its
  // output where the next op reads it (q | k | v side by side for the conv; the low-rank gates'
  // first stage in bf16, the operand of their second), so no per-GEMM conversion runs. The
  // products that read x go as grouped GEMMs (Linear::forward_into_many): q, k, v and beta in
  // one, the gates' first stages in another.
  const Linear* first[6] = {&q_proj_, &k_proj_,
                            &v_proj_, f_a_ ? f_a_.get() : f_b_.get(),
                            &b_proj_, g_a_ ? g_a_.get() : g_b_.get()};
  bool round_once = true;
  for (const Linear* l : first) round_once = round_once && l->writes_directly(DType::bf16, cdt);
  const Tensor xg = round_once ? as_dtype(xc, DType::bf16) : xc;
  auto project = [&](const Linear& l, const Tensor& in, Tensor& out) { l.forward_into(in, out); };

  // q, k, v into one [N, C] row per token, and beta's logits.
  Tensor pre = Tensor::empty({N, C}, cdt, x.device());
  Tensor bl = Tensor::empty({N, HV}, cdt, x.device());
  const int64_t Cq = conv_[0].channels, Ck = conv_[1].channels;
  {
    std::vector<Tensor> outs = {pre.slice(1, 0, Cq), pre.slice(1, Cq, Cq + Ck),
                                pre.slice(1, Cq + Ck, C), bl};
    Linear::forward_into_many(xg, {&q_proj_, &k_proj_, &v_proj_, &b_proj_}, outs);
  }
  // The low-rank gates' hidden (their first stages, on x): bf16 where their second stages round
  // it anyway.
  Tensor f_hidden, g_hidden;
  {
    std::vector<const Linear*> ls;
    std::vector<Tensor> outs;
    for (auto [a, b, h] : {std::tuple{f_a_.get(), f_b_.get(), &f_hidden},
                           std::tuple{g_a_.get(), g_b_.get(), &g_hidden}}) {
      if (!a) continue;
      const DType dt =
          b->writes_directly(DType::bf16, cdt) && a->writes_directly(xg.dtype(), DType::bf16)
              ? DType::bf16
              : cdt;
      *h = Tensor::empty({N, a->out_features()}, dt, x.device());
      ls.push_back(a);
      outs.push_back(*h);
    }
    if (!ls.empty()) Linear::forward_into_many(xg, ls, outs);
  }

  // The short conv advanced by one token in the slots' conv states in place.
  Tensor conv_pool = pool.conv;
  const Tensor act = ops::causal_conv1d_update_slots(pre, conv_pool, slots, conv_weights(cdt),
                                                     /*silu=*/true);

  // The decay gate, beta, and the recurrent step in place.
  Tensor z = Tensor::empty({N, HV * K}, cdt, x.device());
  project(*f_b_, f_a_ ? f_hidden : xg, z);
  ops::KdaGateArgs ga;
  ga.z = z.view({N, HV, K});
  ga.A_log = A_log_->value;
  ga.dt_bias = dt_bias_->value;
  ga.kind = cfg_.gate;
  ga.lower_bound = cfg_.lower_bound;
  ops::KdaDecodeArgs da;
  da.q = act.slice(1, 0, Cq).split_dim(1, K);  // [N, H, K], rows of act
  da.k = act.slice(1, Cq, Cq + Ck).split_dim(1, K);
  da.v = act.slice(1, Cq + Ck, C).split_dim(1, V);
  da.g = ops::kda_gate(ga);
  da.beta = ops::sigmoid_forward(bl);
  da.state = pool.recurrent;
  da.state_indices = Tensor::from_vector<int64_t>({N}, slots);  // on the host: read there
  da.use_qk_l2norm = true;
  const Tensor o = ops::kda_decode_step(da);

  // Output gate, gated RMSNorm, output projection.
  Tensor og = Tensor::empty({N, V * HV}, cdt, x.device());
  project(*g_b_, g_a_ ? g_hidden : xg, og);
  const ops::RmsNormResult nr = ops::gated_rmsnorm_forward(
      o, og.view({N, HV, V}), as_dtype(o_norm_->value, cdt), cfg_.norm_eps);
  Tensor y = Tensor::empty({N, cfg_.hidden_size}, x.dtype(), x.device());
  project(o_proj_, nr.y.view({N, HV * V}), y);
  return y;
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
  HLM_CHECK(!(saved.cp && d_final),
            "{}: a context-parallel forward has no final states to take gradients of", w);
  Tensor dfin_conv, dfin_rec;
  if (d_final) {
    check_state(d_final->conv, {N, W - 1, cfg_.conv_dim()}, xc.device(), w,
                "final conv state gradient");
    check_state(d_final->recurrent, {N, HV, K, V}, xc.device(), w,
                "final recurrent state gradient");
    if (d_final->conv.defined()) dfin_conv = ops::contiguous(as_dtype(d_final->conv, cdt));
    if (d_final->recurrent.defined()) dfin_rec = ops::contiguous(as_dtype(d_final->recurrent, cdt));
  }
  const bool headwise = saved.cp && saved.cp->headwise;
  Saved recomputed;
  const Saved* s = &saved;
  if (saved.recompute) {
    Context c;
    c.training = true;
    c.recompute = false;
    // (Chunkwise, the states from the other ranks are in saved.initial; headwise exchanges again.)
    if (headwise) {
      KdaCpRun run{saved.cp->slice, true, {}, {}};
      run_forward(c, xc, saved.seqs, saved.initial, &recomputed, nullptr, &run);
    } else {
      run_forward(c, xc, saved.seqs, saved.initial, &recomputed, nullptr);
    }
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

  // The core (headwise: this rank's heads over the whole batch, d o sent to them first).
  const HeadRange hr = head_range(cfg_, headwise ? &saved.cp->slice : nullptr);
  const SeqLayout& seqs = headwise ? saved.cp->slice.global() : saved.seqs;
  const int64_t Tc = s->q.size(0);  // the tokens the conv and the core ran on
  const Tensor d_o =
      headwise ? seq_to_heads(saved.cp->slice, {gn.dx.view({T, HV * V})})[0].view(s->v.shape())
               : gn.dx;
  const ops::KdaArgs a =
      core_args(cfg_, s->q, s->k, s->v, s->z, s->beta_logits, saved.initial.recurrent, seqs,
                head_rows(A_log_->value, hr, 1), head_rows(dt_bias_->value, hr, K));
  profile::Scope ps_core("kda core");
  auto core_backward = [&](const Tensor& d_fin) {
    return cfg_.core == KdaCoreImpl::chunk
               ? ops::kda_chunk_backward(a, d_o, d_fin, s->core, core_save_kind(cfg_))
               : ops::kda_recurrent_backward(a, d_o, d_fin);
  };
  const ops::KdaGrads cg = saved.cp && !headwise ? cp_core_backward(*saved.cp, a, core_backward)
                                                 : core_backward(dfin_rec);
  ps_core.end();
  accumulate(*A_log_, cg.dA_log, hr.hv0);
  accumulate(*dt_bias_, cg.ddt_bias, hr.hv0 * K);
  Tensor dz = as_dtype(cg.dg, cdt).contiguous().view({Tc, (hr.hv1 - hr.hv0) * K});
  Tensor dbeta = as_dtype(cg.dbeta, cdt).contiguous();

  // Convs (plus the final conv state's gradient), then the q/k/v projections.
  const Tensor dact[3] = {cg.dq, cg.dk, cg.dv};
  const Tensor* pre[3] = {&s->q_pre, &s->k_pre, &s->v_pre};
  Linear* proj[3] = {&q_proj_, &k_proj_, &v_proj_};
  const Linear::Saved* proj_saved[3] = {&s->q_proj, &s->k_proj, &s->v_proj};
  Tensor dinit_conv[3], dpre[3], dx_p[3];
  int64_t off = 0, ch[3];
  for (int i = 0; i < 3; ++i) {
    ch[i] = conv_[i].channels;
    const auto [c0, c1] = part_channels(cfg_, i, hr);
    const Tensor st0 = saved.initial.conv.defined()
                           ? ops::contiguous(saved.initial.conv.slice(2, off, off + ch[i]))
                           : Tensor();
    Tensor dw = Tensor::zeros({c1 - c0, W}, cdt, xc.device());
    ops::CausalConv1dGrads g =
        ops::causal_conv1d_backward(as_dtype(dact[i], cdt).contiguous().view({Tc, c1 - c0}),
                                    *pre[i], conv_weight(i, cdt, c0, c1), seqs, st0, true, dw);
    accumulate(*conv_[i].param, dw, (conv_[i].row0 + c0) * W);
    if (dfin_conv.defined()) {
      const Tensor dfi = dfin_conv.slice(2, off, off + ch[i]);
      Tensor* dinit = st0.defined() ? &g.dinitial_state : nullptr;
      if (!g.dx.is_cpu())
        ops::causal_conv1d_final_state_backward(dfi, cu, W, g.dx, dinit);
      else if (cdt == DType::f64)
        route_final_conv_grad<double>(dfi, g.dx, dinit, cu, W);
      else
        route_final_conv_grad<float>(dfi, g.dx, dinit, cu, W);
    }
    dinit_conv[i] = g.dinitial_state;
    dpre[i] = g.dx;
    off += ch[i];
  }
  if (headwise) {  // back to this rank's tokens, all heads
    const std::vector<Tensor> t =
        heads_to_seq(saved.cp->slice, {dpre[0], dpre[1], dpre[2], dz, dbeta});
    dpre[0] = t[0], dpre[1] = t[1], dpre[2] = t[2], dz = t[3], dbeta = t[4];
  } else if (saved.cp) {  // the halo's gradient goes back to the ranks it came from
    cp_conv_halo_backward(saved.cp->slice,
                          saved.initial.conv.defined()
                              ? row_of(cat_last({dinit_conv[0], dinit_conv[1], dinit_conv[2]}), 0)
                              : Tensor(),
                          dpre, ch, W);
  }
  const Tensor dx_f = f_a_ ? f_a_->backward(ctx, f_b_->backward(ctx, dz, s->f_b), s->f_a)
                           : f_b_->backward(ctx, dz, s->f_b);
  const Tensor dx_b = b_proj_.backward(ctx, dbeta, s->b_proj);
  for (int i = 0; i < 3; ++i) dx_p[i] = proj[i]->backward(ctx, dpre[i], *proj_saved[i]);

  Tensor dx = dx_p[0].clone();
  add_inplace(dx, dx_p[1]);
  add_inplace(dx, dx_p[2]);
  add_inplace(dx, dx_f);
  add_inplace(dx, dx_b);
  add_inplace(dx, dx_g);
  Grads out;
  out.dx = as_dtype(dx, saved.x_dtype);
  if (saved.cp) return out;  // the initial states came from other ranks
  if (saved.initial.conv.defined())
    out.dinitial.conv = cat_last({dinit_conv[0], dinit_conv[1], dinit_conv[2]});
  if (saved.initial.recurrent.defined()) out.dinitial.recurrent = as_dtype(cg.dinitial_state, cdt);
  return out;
}

}  // namespace hlm
