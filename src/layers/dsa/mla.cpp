// MLA (layers/dsa/mla.h) on CPU or CUDA tensors (CUDA runs the absorbed form): forward and
// backward side by side.
//
// Forward (expanded):
//   x -> q_a_proj -> RMSNorm -> q_b_proj -> q [T, H, dqk] -> RoPE(q[..., d_n:])
//   x -> kv_a_proj_with_mqa -> [lat ; kp]; c_kv = RMSNorm(lat); kp = RoPE(kp); kv = [c_kv ; kp]
//   c_kv -> kv_b_proj -> per head [k_nope_h ; v_h];  k_h = [k_nope_h ; kp]
//   o = causal softmax attention(q, k, v) per sequence;  y = o_proj(o)
// Forward (absorbed): q_abs_h = [qn_h W_UK_h ; qp_h];  o_lat = causal_attention(q_abs, kv,
//   d_v = r_kv) (every causal token);  o_h = o_lat_h W_UV_h^T;  y = o_proj(concat o_h).
// Attention (per sequence, head h, query t, keys s <= t of t's sequence):
//   l_s = scale q_t . k_s;  lse = log sum_s exp(l_s);  p_s = exp(l_s - lse);  o_t = sum_s p_s v_s
// Backward:
//   D_t = do_t . o_t;  ds_s = p_s (do_t . v_s - D_t)
//   dq_t = scale sum_s ds_s k_s;  dk_s = scale sum_t ds_ts q_t;  dv_s = sum_t p_ts do_t
//   RoPE backward: the transposed rotation;  RMSNorm and Linear backward from ops / Linear.
//   Expanded: dkp = sum_h dk_h[d_n:] (head order); absorbed: dW_UK_h += qn_h^T dq_lat_h,
//   dqn_h = dq_lat_h W_UK_h^T, dW_UV_h += do_h^T o_lat_h, do_lat_h = do_h W_UV_h.
// Determinism: the expanded attention runs OpenMP over queries (forward, dq) and over keys (dk,
// dv), each sum in index order; no atomics.
#include "layers/dsa/mla.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <utility>

#include "core/rng.h"
#include "ops/dsa_sparse_attention.h"
#include "ops/gemm.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/tensor_ops.h"

namespace hlm {

// ---- config -----------------------------------------------------------------------------------

double yarn_get_mscale(double factor, double mscale) {
  return factor <= 1.0 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0;
}

void MlaConfig::validate() const {
  auto positive = [](int64_t v, const char* name) {
    HLM_CHECK(v > 0, "MlaConfig.{} must be > 0, got {}", name, v);
  };
  positive(hidden_size, "hidden_size");
  positive(num_heads, "num_heads");
  HLM_CHECK(q_lora_rank >= 0, "MlaConfig.q_lora_rank must be >= 0 (0: plain q_proj), got {}",
            q_lora_rank);
  positive(kv_lora_rank, "kv_lora_rank");
  positive(qk_nope_head_dim, "qk_nope_head_dim");
  HLM_CHECK(qk_rope_head_dim >= 0, "MlaConfig.qk_rope_head_dim must be >= 0, got {}",
            qk_rope_head_dim);
  positive(v_head_dim, "v_head_dim");
  HLM_CHECK(std::isfinite(rms_norm_eps) && rms_norm_eps > 0,
            "MlaConfig.rms_norm_eps must be positive and finite, got {}", rms_norm_eps);
  if (rotary()) {
    HLM_CHECK(qk_rope_head_dim % 2 == 0,
              "MlaConfig.qk_rope_head_dim must be even with rope on (interleaved pairs), got {}",
              qk_rope_head_dim);
    HLM_CHECK(std::isfinite(rope_theta) && rope_theta > 1,
              "MlaConfig.rope_theta must be finite and > 1, got {}", rope_theta);
  }
  if (yarn) {
    HLM_CHECK(rotary(),
              "MlaConfig.yarn: YaRN rope scaling needs rotary channels (rope on and "
              "qk_rope_head_dim > 0); got rope = {}, qk_rope_head_dim = {}",
              rope, qk_rope_head_dim);
    const YarnConfig& y = *yarn;
    HLM_CHECK(std::isfinite(y.factor) && y.factor >= 1,
              "MlaConfig.yarn.factor must be finite and >= 1, got {}", y.factor);
    HLM_CHECK(
        std::isfinite(y.original_max_position_embeddings) && y.original_max_position_embeddings > 0,
        "MlaConfig.yarn.original_max_position_embeddings must be > 0, got {}",
        y.original_max_position_embeddings);
    HLM_CHECK(std::isfinite(y.beta_fast) && y.beta_fast > 0,
              "MlaConfig.yarn.beta_fast must be > 0, got {}", y.beta_fast);
    HLM_CHECK(std::isfinite(y.beta_slow) && y.beta_slow > 0,
              "MlaConfig.yarn.beta_slow must be > 0, got {}", y.beta_slow);
    HLM_CHECK(std::isfinite(y.mscale) && std::isfinite(y.mscale_all_dim),
              "MlaConfig.yarn.mscale and mscale_all_dim must be finite, got {} and {}", y.mscale,
              y.mscale_all_dim);
    HLM_CHECK(std::isfinite(y.attention_factor) && y.attention_factor >= 0,
              "MlaConfig.yarn.attention_factor must be >= 0 (0: derived), got {}",
              y.attention_factor);
  }
  HLM_CHECK(std::isfinite(softmax_scale) && softmax_scale >= 0,
            "MlaConfig.softmax_scale must be >= 0 (0: derived), got {}", softmax_scale);
  HLM_CHECK(param_dtype == DType::f64 || param_dtype == DType::f32 || param_dtype == DType::bf16,
            "MlaConfig.param_dtype must be f64, f32 or bf16, got {}", dtype_name(param_dtype));
  HLM_CHECK(std::isfinite(init_std) && init_std >= 0, "MlaConfig.init_std must be >= 0, got {}",
            init_std);
}

double MlaConfig::softmax_scale_value() const {
  if (softmax_scale > 0) return softmax_scale;
  double s = 1.0 / std::sqrt(double(qk_nope_head_dim + qk_rope_head_dim));
  if (yarn && yarn->mscale_all_dim != 0) {
    const double m = yarn_get_mscale(yarn->factor, yarn->mscale_all_dim);
    s *= m * m;
  }
  return s;
}

std::vector<double> MlaConfig::rope_inv_freq() const {
  if (!rotary()) return {};
  const int64_t d = qk_rope_head_dim, half = d / 2;
  std::vector<double> inv(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i)
    inv[size_t(i)] = std::pow(rope_theta, -double(2 * i) / double(d));
  if (!yarn) return inv;
  const YarnConfig& y = *yarn;
  // The pair index whose wavelength makes b full turns over the original context.
  auto corr = [&](double b) {
    return double(d) * std::log(y.original_max_position_embeddings / (2 * std::numbers::pi * b)) /
           (2 * std::log(rope_theta));
  };
  const double low = std::max(std::floor(corr(y.beta_fast)), 0.0);
  double high = std::min(std::ceil(corr(y.beta_slow)), double(d - 1));
  if (high == low) high += 0.001;
  for (int64_t i = 0; i < half; ++i) {
    const double ramp = std::clamp((double(i) - low) / (high - low), 0.0, 1.0);
    inv[size_t(i)] = inv[size_t(i)] / y.factor * ramp + inv[size_t(i)] * (1 - ramp);
  }
  return inv;
}

double MlaConfig::rope_attention_factor() const {
  if (!yarn) return 1.0;
  if (yarn->attention_factor > 0) return yarn->attention_factor;
  return yarn_get_mscale(yarn->factor, yarn->mscale) /
         yarn_get_mscale(yarn->factor, yarn->mscale_all_dim);
}

// ---- helpers ----------------------------------------------------------------------------------

namespace {

// The copies and conversions go through ops/tensor_ops.h, which runs Tensor's own on the CPU (the
// same bits) and the CUDA kernels on CUDA tensors.
Tensor as_dt(const Tensor& t, DType dt) {
  return ops::as_dtype(t, dt);
}

// t in dtype dt, contiguous, on t's device.
Tensor contig(const Tensor& t, DType dt) {
  return ops::contiguous(ops::as_dtype(t, dt));
}

// A new contiguous tensor of dtype dt holding t's values (for in-place transforms).
Tensor fresh(const Tensor& t, DType dt) {
  Tensor out = Tensor::empty(t.shape(), dt, t.device());
  ops::copy_into(out, t);
  return out;
}

// dst (a view) = src.
void put(Tensor dst, const Tensor& src) {
  ops::copy_into(dst, src);
}

std::string join(const std::string& path, const char* name) {
  return path.empty() ? std::string(name) : path + "." + name;
}

ops::GemmOptions gemm_opt(const GemmPrecision& p) {
  return ops::GemmOptions{p.kind != GemmKind::native};
}

// a += b (same shape, a contiguous f32 or f64; b read as a's dtype), one addition per element.
void add_into(Tensor& a, const Tensor& b) {
  ops::add_(a, b);
}

std::vector<int64_t> positions_of(const std::vector<int64_t>& cu, int64_t T) {
  std::vector<int64_t> pos(static_cast<size_t>(T));
  for (size_t n = 0; n + 1 < cu.size(); ++n)
    for (int64_t t = cu[n]; t < cu[n + 1]; ++t) pos[size_t(t)] = t - cu[n];
  return pos;
}

// Loops with less work than this (multiply-adds, roughly) run on one thread: a parallel region
// costs more than it saves on tiny shapes, much more when the cores are shared.
constexpr int64_t kParallelWork = 1 << 15;

// Rotates channels [off, off + d_r) of every row of x ([T, n, L] or [T, L], contiguous; in
// place, ops::rope_inplace) by the angle of the row's position: interleaved pairs (2i, 2i + 1)
// with angle pos * inv_freq[i] (formed in the computation dtype, as the f32 reference
// implementations do), cos and sin scaled by `factor`; inverse = the transpose, for backward.
void rope(Tensor& x, int64_t off, int64_t d_r, const std::vector<int64_t>& pos,
          const std::vector<double>& inv_freq, double factor, bool inverse) {
  ops::RopeOptions o;
  o.offset = off;
  o.rope_dim = d_r;
  o.factor = factor;
  o.interleave = true;
  o.inverse = inverse;
  o.angle = ops::RopeAngle::compute;
  ops::rope_inplace(
      x, Tensor::from_vector<int64_t>({int64_t(pos.size())}, pos).to(x.device()),
      Tensor::from_vector<double>({int64_t(inv_freq.size())}, inv_freq).to(x.device()), o);
}

template <class F>
inline F dotp(const F* a, const F* b, int64_t n) {
  F s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

struct Docs {
  std::vector<int64_t> start, end;  // [T] the token's sequence [start, end)
};
Docs docs_of(const std::vector<int64_t>& cu, int64_t T) {
  Docs d{std::vector<int64_t>(size_t(T)), std::vector<int64_t>(size_t(T))};
  for (size_t n = 0; n + 1 < cu.size(); ++n)
    for (int64_t t = cu[n]; t < cu[n + 1]; ++t)
      d.start[size_t(t)] = cu[n], d.end[size_t(t)] = cu[n + 1];
  return d;
}

// Multiply-adds of a causal attention pass: (query, key) pairs times `per_pair`.
int64_t attention_work(const Docs& dc, int64_t per_pair) {
  int64_t pairs = 0;
  for (size_t t = 0; t < dc.start.size(); ++t) pairs += int64_t(t) - dc.start[t] + 1;
  return pairs * per_pair;
}

// Causal multi-head attention with per-head keys and values (the expanded form).
// q, k [T, H, Dk], v [T, H, Dv] contiguous -> o [T, H, Dv], lse [T, H].
template <class F>
void mha_forward(const Tensor& qt, const Tensor& kt, const Tensor& vt, const Docs& dc, F scale,
                 Tensor& ot, Tensor& lset) {
  const int64_t T = qt.size(0), H = qt.size(1), Dk = qt.size(2), Dv = vt.size(2);
  const F* q = qt.data<F>();
  const F* k = kt.data<F>();
  const F* v = vt.data<F>();
  F* o = ot.data<F>();
  F* lse = lset.data<F>();
  const int64_t work = attention_work(dc, H * (Dk + Dv));
#pragma omp parallel for schedule(dynamic, 4) if (work > kParallelWork)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s0 = dc.start[size_t(t)], n = t - s0 + 1;
    std::vector<F> l(static_cast<size_t>(n));
    for (int64_t h = 0; h < H; ++h) {
      const F* qr = q + (t * H + h) * Dk;
      F m = -std::numeric_limits<F>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        l[size_t(j)] = scale * dotp(qr, k + ((s0 + j) * H + h) * Dk, Dk);
        m = std::max(m, l[size_t(j)]);
      }
      F sum = 0;
      for (int64_t j = 0; j < n; ++j) sum += (l[size_t(j)] = std::exp(l[size_t(j)] - m));
      F* orow = o + (t * H + h) * Dv;
      for (int64_t c = 0; c < Dv; ++c) orow[c] = 0;
      for (int64_t j = 0; j < n; ++j) {
        const F pj = l[size_t(j)] / sum;
        const F* vr = v + ((s0 + j) * H + h) * Dv;
        for (int64_t c = 0; c < Dv; ++c) orow[c] += pj * vr[c];
      }
      lse[t * H + h] = m + std::log(sum);
    }
  }
}

template <class F>
void mha_backward(const Tensor& qt, const Tensor& kt, const Tensor& vt, const Tensor& ot,
                  const Tensor& lset, const Tensor& dot_, const Docs& dc, F scale, Tensor& dqt,
                  Tensor& dkt, Tensor& dvt) {
  const int64_t T = qt.size(0), H = qt.size(1), Dk = qt.size(2), Dv = vt.size(2);
  const F* q = qt.data<F>();
  const F* k = kt.data<F>();
  const F* v = vt.data<F>();
  const F* o = ot.data<F>();
  const F* lse = lset.data<F>();
  const F* dout = dot_.data<F>();
  F* dq = dqt.data<F>();
  F* dk = dkt.data<F>();
  F* dv = dvt.data<F>();
  const int64_t work = attention_work(dc, H * (Dk + Dv));
  std::vector<F> Dt(size_t(T * H));
  for (int64_t i = 0; i < T * H; ++i) Dt[size_t(i)] = dotp(dout + i * Dv, o + i * Dv, Dv);
  // Query t, key s, head h: the probability p = exp(scale q.k - lse) and the logit gradient
  // ds = p (dout_t . v_s - D_t).
  auto p_ds = [&](int64_t t, int64_t s, int64_t h) {
    const F p =
        std::exp(scale * dotp(q + (t * H + h) * Dk, k + (s * H + h) * Dk, Dk) - lse[t * H + h]);
    const F ds =
        p * (dotp(dout + (t * H + h) * Dv, v + (s * H + h) * Dv, Dv) - Dt[size_t(t * H + h)]);
    return std::pair<F, F>{p, ds};
  };
  // dq: per query, keys in increasing order.
#pragma omp parallel for schedule(dynamic, 4) if (work > kParallelWork)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s0 = dc.start[size_t(t)];
    for (int64_t h = 0; h < H; ++h) {
      F* dqr = dq + (t * H + h) * Dk;
      for (int64_t c = 0; c < Dk; ++c) dqr[c] = 0;
      for (int64_t s = s0; s <= t; ++s) {
        const F* kr = k + (s * H + h) * Dk;
        const F ds = p_ds(t, s, h).second;
        for (int64_t c = 0; c < Dk; ++c) dqr[c] += ds * kr[c];
      }
      for (int64_t c = 0; c < Dk; ++c) dqr[c] *= scale;
    }
  }
  // dk, dv: per key, readers (queries t >= s of the same sequence) in increasing order.
#pragma omp parallel for schedule(dynamic, 4) if (work > kParallelWork)
  for (int64_t s = 0; s < T; ++s) {
    const int64_t e = dc.end[size_t(s)];
    for (int64_t h = 0; h < H; ++h) {
      F* dkr = dk + (s * H + h) * Dk;
      F* dvr = dv + (s * H + h) * Dv;
      for (int64_t c = 0; c < Dk; ++c) dkr[c] = 0;
      for (int64_t c = 0; c < Dv; ++c) dvr[c] = 0;
      for (int64_t t = s; t < e; ++t) {
        const F* qr = q + (t * H + h) * Dk;
        const F* dor = dout + (t * H + h) * Dv;
        const auto [p, ds] = p_ds(t, s, h);
        for (int64_t c = 0; c < Dk; ++c) dkr[c] += ds * qr[c];
        for (int64_t c = 0; c < Dv; ++c) dvr[c] += p * dor[c];
      }
      for (int64_t c = 0; c < Dk; ++c) dkr[c] *= scale;
    }
  }
}

// out[t, c] = sum_h src[t, h, off + c] in head order ([T, H, L] -> [T, n]).
template <class F>
void sum_heads(const Tensor& src, int64_t off, int64_t n, Tensor& out) {
  const int64_t T = src.size(0), H = src.size(1), L = src.size(2);
  const F* s = src.data<F>();
  F* o = out.data<F>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < n; ++c) {
      F acc = 0;
      for (int64_t h = 0; h < H; ++h) acc += s[(t * H + h) * L + off + c];
      o[t * n + c] = acc;
    }
}

void check_x(const Tensor& x, int64_t D, Device dev, const char* what) {
  HLM_CHECK(x.defined() && x.device() == dev,
            "{}: x must be a defined tensor on the parameters' device ({}), got {}", what,
            device_name(dev), x.defined() ? x.describe() : "undefined");
  HLM_CHECK(x.dtype() == DType::f64 || x.dtype() == DType::f32 || x.dtype() == DType::bf16,
            "{}: x must be f64, f32 or bf16, got {}", what, x.describe());
  HLM_CHECK(x.dim() == 2 && x.size(1) == D, "{}: x must be [T, {}] (hidden_size), got {}", what, D,
            x.describe());
  HLM_CHECK(x.size(0) >= 1, "{}: x has no tokens ({})", what, x.describe());
}

void check_act(const Tensor& t, const Shape& s, Device dev, const char* op, const char* what) {
  HLM_CHECK(t.defined() && t.device() == dev,
            "{}: {} must be a defined tensor on the parameters' device ({}), got {}", op, what,
            device_name(dev), t.defined() ? t.describe() : "undefined");
  HLM_CHECK(t.dtype() == DType::f64 || t.dtype() == DType::f32 || t.dtype() == DType::bf16,
            "{}: {} must be f64, f32 or bf16, got {}", op, what, t.describe());
  HLM_CHECK(t.shape() == s, "{}: {} must have shape {}, got {}", op, what, shape_str(s),
            t.describe());
}

}  // namespace

// ---- the module -------------------------------------------------------------------------------

Mla::Mla(const MlaConfig& cfg, const PrecisionPolicy& policy, const std::string& path)
    : cfg_(cfg), path_(path) {
  cfg_.validate();
  const int64_t D = cfg_.hidden_size, H = cfg_.num_heads, rq = cfg_.q_lora_rank,
                rkv = cfg_.kv_lora_rank, dn = cfg_.qk_nope_head_dim, dr = cfg_.qk_rope_head_dim,
                dv = cfg_.v_head_dim;
  const DType dt = cfg_.param_dtype;
  auto prec = [&](const char* name) {
    return policy.resolve(join(path_, name), ModuleRole::mla_proj);
  };
  if (rq > 0) {
    q_norm_ = &add_param("q_a_layernorm.weight", Tensor::full({rq}, 1.0, dt), false, true);
    q_a_proj_.init(D, rq, false, prec("q_a_proj"), dt);
    add_child("q_a_proj", &q_a_proj_);
    q_b_proj_.init(rq, H * (dn + dr), false, prec("q_b_proj"), dt);
    add_child("q_b_proj", &q_b_proj_);
  } else {
    q_proj_.init(D, H * (dn + dr), false, prec("q_proj"), dt);
    add_child("q_proj", &q_proj_);
  }
  kv_norm_ = &add_param("kv_a_layernorm.weight", Tensor::full({rkv}, 1.0, dt), false, true);
  kv_a_proj_.init(D, rkv + dr, false, prec("kv_a_proj_with_mqa"), dt);
  add_child("kv_a_proj_with_mqa", &kv_a_proj_);
  kv_b_proj_.init(rkv, H * (dn + dv), false, prec("kv_b_proj"), dt);
  add_child("kv_b_proj", &kv_b_proj_);
  o_proj_.init(H * dv, D, false, prec("o_proj"), dt);
  add_child("o_proj", &o_proj_);
  inv_freq_ = cfg_.rope_inv_freq();
  rope_factor_ = cfg_.rope_attention_factor();
}

DType Mla::compute_dtype() const {
  return hlm::compute_dtype(cfg_.param_dtype);
}

Device Mla::device() const {
  return kv_norm_->value.device();
}

void Mla::init_weights(uint64_t seed) {
  // Only MLA's own parameters (a derived layer may own more children): norms first, then the
  // projections in registration order, as named_parameters() lists them for a plain Mla.
  std::vector<Param*> params;
  if (q_norm_) params.push_back(q_norm_);
  params.push_back(kv_norm_);
  for (Linear* l : {&q_a_proj_, &q_b_proj_, &q_proj_, &kv_a_proj_, &kv_b_proj_, &o_proj_})
    if (l->in_features() > 0) params.push_back(&l->weight());
  for (size_t i = 0; i < params.size(); ++i) {
    Param* p = params[i];
    if (p == q_norm_ || p == kv_norm_) {
      p->value.fill_(1.0);
    } else {
      Rng rng(seed, i);
      rng.fill_normal(p->value, 0.0, cfg_.init_std);
    }
  }
}

Tensor Mla::attention_operand(const Tensor& t) const {
  if (kv_b_proj_.precision().kind == GemmKind::native) return t;
  const Tensor b = ops::as_dtype(t, DType::bf16);
  return t.is_cpu() ? b.to(t.dtype() == DType::bf16 ? compute_dtype() : t.dtype()) : b;
}

DType Mla::attention_dtype() const {
  return attention_dtype(kv_b_proj_.precision().kind, compute_dtype(), device());
}

DType Mla::attention_dtype(GemmKind kv_b, DType compute, Device device) {
  return kv_b == GemmKind::native || device != Device::cuda ? compute : DType::bf16;
}

Tensor Mla::causal_indices(const std::vector<int64_t>& cu, int64_t T) {
  int64_t W = 1;
  for (size_t n = 0; n + 1 < cu.size(); ++n) W = std::max(W, cu[n + 1] - cu[n]);
  Tensor idx = Tensor::full({T, W}, -1.0, DType::i32);
  int32_t* p = idx.data<int32_t>();
  for (size_t n = 0; n + 1 < cu.size(); ++n)
    for (int64_t t = cu[n]; t < cu[n + 1]; ++t)
      for (int64_t s = cu[n]; s <= t; ++s) p[t * W + (s - cu[n])] = int32_t(s);
  return idx;
}

Mla::Projected Mla::project(const Context& ctx, const Tensor& x, const SeqLayout& seqs,
                            ProjSaved* s, const std::vector<int64_t>* starts) const {
  check_x(x, cfg_.hidden_size, device(), "Mla::project");
  const int64_t T = x.size(0), H = cfg_.num_heads, rkv = cfg_.kv_lora_rank,
                dn = cfg_.qk_nope_head_dim, dr = cfg_.qk_rope_head_dim, dqk = dn + dr;
  const std::vector<int64_t> cu = (seqs.check_tokens(T, "Mla"), seqs.offsets());
  const bool save = s && ctx.training;
  const DType cdt = compute_dtype();
  const Tensor xc = contig(x, cdt);
  std::vector<int64_t> pos = positions_of(cu, T);
  if (starts) {
    HLM_CHECK(int64_t(starts->size()) + 1 == int64_t(cu.size()),
              "Mla::project: {} start positions for {} sequences", starts->size(), cu.size() - 1);
    for (size_t n = 0; n + 1 < cu.size(); ++n)
      for (int64_t t = cu[n]; t < cu[n + 1]; ++t) pos[size_t(t)] += (*starts)[n];
  }
  // Inference: the GEMMs that read x take it rounded to bf16 once, when both round it.
  const Linear& first_q = cfg_.q_lora_rank > 0 ? q_a_proj_ : q_proj_;
  const Tensor xg = !save && first_q.writes_directly(DType::bf16, cdt) &&
                            kv_a_proj_.writes_directly(DType::bf16, cdt)
                        ? as_dt(xc, DType::bf16)
                        : xc;
  auto from_x = [&](const Linear& l, Linear::Saved* ls) {
    if (save || !l.writes_directly(xg.dtype(), cdt)) return l.forward(ctx, xc, ls);
    Tensor y = Tensor::empty({T, l.out_features()}, cdt, x.device());
    l.forward_into(xg, y);
    return y;
  };
  // Inference with x rounded once: the two products that read it as one grouped GEMM.
  Tensor qa_pre, kva_pre;
  if (xg.dtype() != xc.dtype()) {
    qa_pre = Tensor::empty({T, first_q.out_features()}, cdt, x.device());
    kva_pre = Tensor::empty({T, kv_a_proj_.out_features()}, cdt, x.device());
    std::vector<Tensor> outs = {qa_pre, kva_pre};
    Linear::forward_into_many(xg, {&first_q, &kv_a_proj_}, outs);
  }
  Projected p;
  Tensor q2;
  if (cfg_.q_lora_rank > 0) {
    const Tensor qa = qa_pre.defined() ? qa_pre : from_x(q_a_proj_, save ? &s->q_a : nullptr);
    ops::RmsNormResult nr = ops::rmsnorm_forward(qa, as_dt(q_norm_->value, cdt), cfg_.rms_norm_eps);
    p.c_q = nr.y;
    q2 = q_b_proj_.forward(ctx, p.c_q, save ? &s->q_b : nullptr);
    if (save) s->q_a_out = qa, s->q_rstd = nr.rstd;
  } else {
    q2 = qa_pre.defined() ? qa_pre : from_x(q_proj_, save ? &s->q_a : nullptr);
  }
  p.q = ops::contiguous(q2).view({T, H, dqk});
  if (cfg_.rotary()) rope(p.q, dn, dr, pos, inv_freq_, rope_factor_, false);

  const Tensor kva = kva_pre.defined() ? kva_pre : from_x(kv_a_proj_, save ? &s->kv_a : nullptr);
  const Tensor lat = ops::contiguous(kva.slice(1, 0, rkv));
  ops::RmsNormResult nk = ops::rmsnorm_forward(lat, as_dt(kv_norm_->value, cdt), cfg_.rms_norm_eps);
  p.kv = Tensor::empty({T, rkv + dr}, cdt, x.device());
  put(p.kv.slice(1, 0, rkv), nk.y);
  if (dr > 0) {
    put(p.kv.slice(1, rkv, rkv + dr), kva.slice(1, rkv, rkv + dr));
    if (cfg_.rotary()) rope(p.kv, rkv, dr, pos, inv_freq_, rope_factor_, false);
  }
  if (save) {
    s->kv_lat_raw = lat;
    s->kv_rstd = nk.rstd;
    s->positions = pos;
  }
  return p;
}

Tensor Mla::project_backward(const Context& ctx, const Tensor& dq, const Tensor& dkv,
                             const ProjSaved& s) {
  const char* op = "Mla::project_backward";
  HLM_CHECK(s.kv_rstd.defined(), "{}: ProjSaved is empty (project was not run with training)", op);
  const int64_t T = s.kv_rstd.size(0), H = cfg_.num_heads, rkv = cfg_.kv_lora_rank,
                dn = cfg_.qk_nope_head_dim, dr = cfg_.qk_rope_head_dim, dqk = dn + dr;
  check_act(dq, {T, H, dqk}, device(), op, "dq");
  check_act(dkv, {T, rkv + dr}, device(), op, "dkv");
  const DType cdt = compute_dtype();
  // q path
  Tensor dqc = fresh(dq, cdt);
  if (cfg_.rotary()) rope(dqc, dn, dr, s.positions, inv_freq_, rope_factor_, true);
  Tensor dx;
  if (cfg_.q_lora_rank > 0) {
    const Tensor dcq = q_b_proj_.backward(ctx, dqc.view({T, H * dqk}), s.q_b);
    Tensor& gw = ensure_grad(*q_norm_, "Mla");
    const Tensor dqa =
        ops::rmsnorm_backward(dcq, s.q_a_out, as_dt(q_norm_->value, cdt), s.q_rstd, gw);
    dx = q_a_proj_.backward(ctx, dqa, s.q_a);
  } else {
    dx = q_proj_.backward(ctx, dqc.view({T, H * dqk}), s.q_a);
  }
  // kv path
  Tensor dkvc = fresh(dkv, cdt);
  if (cfg_.rotary()) rope(dkvc, rkv, dr, s.positions, inv_freq_, rope_factor_, true);
  Tensor& gkw = ensure_grad(*kv_norm_, "Mla");
  const Tensor dlat = ops::rmsnorm_backward(ops::contiguous(dkvc.slice(1, 0, rkv)), s.kv_lat_raw,
                                            as_dt(kv_norm_->value, cdt), s.kv_rstd, gkw);
  Tensor dkva = Tensor::empty({T, rkv + dr}, cdt, dkvc.device());
  put(dkva.slice(1, 0, rkv), dlat);
  if (dr > 0) put(dkva.slice(1, rkv, rkv + dr), dkvc.slice(1, rkv, rkv + dr));
  const Tensor dx2 = kv_a_proj_.backward(ctx, dkva, s.kv_a);
  dx = ops::contiguous(dx);
  add_into(dx, dx2);
  return dx;
}

namespace {

// The elements of t (a view whose last dimension is contiguous) from its first to its last, as
// one contiguous 1-D view.
Tensor flat_span(const Tensor& t) {
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return t.as_strided({last + 1}, {1});
}

// out[:, h, :] = a[:, h, :] op(W_h) for every head h, W_h the rows [w_row0 + h w_rows_per_head,
// + w_rows) of w: [w_rows, n] (trans_w false) or [w_rows, k] read transposed (trans_w). a: [T, H,
// k] in cdt (or bf16 under a bf16 product with an f32 cdt: the rounding the product applies), out:
// a [T, H, n] view in cdt; both with a contiguous last dimension. One grouped GEMM over the heads,
// each head's rows read and written in place (row strides), where its dtype rules allow, so a
// decode step of a few rows is one launch, not H; else one product per head. The same products
// either way (the CPU's grouped GEMM is the per-head loop; cuBLAS's grouped call may round
// differently from its single products).
void per_head_gemm(const Tensor& a, const Tensor& weight, int64_t w_row0, int64_t w_rows_per_head,
                   int64_t w_rows, bool trans_w, DType cdt, const ops::GemmOptions& opt,
                   Tensor out) {
  const int64_t T = a.size(0), H = a.size(1), k = a.size(2), n = out.size(2);
  const bool grouped = T > 0 && k > 0 && (!opt.round_bf16 || cdt == DType::f32) &&
                       a.stride(2) == 1 && out.stride(2) == 1 && out.dtype() == cdt;
  if (!grouped) {
    const Tensor w = as_dt(weight, cdt);
    for (int64_t h = 0; h < H; ++h) {
      Tensor o = out.select(1, h);
      const int64_t r0 = w_row0 + h * w_rows_per_head;
      ops::gemm(a.select(1, h), false, w.slice(0, r0, r0 + w_rows), trans_w, o, 1.0, 0.0, opt);
    }
    return;
  }
  // Under round_bf16 a bf16 weight is read as it is (the product rounds f32 operands to bf16).
  const Tensor w = opt.round_bf16 && weight.dtype() == DType::bf16
                       ? ops::contiguous(weight)
                       : ops::contiguous(as_dt(weight, cdt));
  const Tensor af = flat_span(a);
  Tensor cf = flat_span(out);
  // A row stride is only read between rows: with one row, any value >= the row length.
  const int64_t lda = T > 1 ? a.stride(0) : k, ldc = T > 1 ? out.stride(0) : n;
  std::vector<ops::GemmGroup> groups;
  for (int64_t h = 0; h < H; ++h)
    groups.push_back(ops::GemmGroup{T, n, k, h * a.stride(1),
                                    (w_row0 + h * w_rows_per_head) * w.size(1), h * out.stride(1),
                                    lda, 0, ldc});
  ops::gemm_grouped(af, false, w, trans_w, cf, groups, 1.0, 0.0, opt);
}

// gw[rows of head h] += a[:, h, :]^T b[:, h, :] for every head h, the rows [g_row0 + h
// g_rows_per_head, + ka) of gw [., kb] (contiguous; f32 or f64). a: [T, H, ka], b: [T, H, kb],
// both in gw's dtype. One grouped GEMM over the heads where its dtype rules allow, else one
// accumulating product per head (the CPU's grouped GEMM: the same products in head order).
void per_head_weight_grad(const Tensor& a, const Tensor& b, Tensor& gw, int64_t g_row0,
                          int64_t g_rows_per_head, const ops::GemmOptions& opt) {
  const int64_t T = a.size(0), H = a.size(1), ka = a.size(2), kb = b.size(2);
  const bool grouped = T > 0 && gw.is_contiguous() &&
                       (opt.round_bf16 ? gw.dtype() == DType::f32 : gw.dtype() == a.dtype());
  if (!grouped) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t r0 = g_row0 + h * g_rows_per_head;
      Tensor g = gw.slice(0, r0, r0 + ka);
      ops::gemm(a.select(1, h), true, b.select(1, h), false, g, 1.0, 1.0, opt);
    }
    return;
  }
  const Tensor at = ops::contiguous(a.transpose(0, 1)), bt = ops::contiguous(b.transpose(0, 1));
  std::vector<ops::GemmGroup> groups;
  for (int64_t h = 0; h < H; ++h)
    groups.push_back(
        ops::GemmGroup{ka, kb, T, h * T * ka, h * T * kb, (g_row0 + h * g_rows_per_head) * kb});
  ops::gemm_grouped(at, true, bt, false, gw, groups, 1.0, 1.0, opt);
}

}  // namespace

Tensor Mla::absorb_query(const Tensor& q) const {
  const int64_t T = q.size(0), H = cfg_.num_heads, rkv = cfg_.kv_lora_rank,
                dn = cfg_.qk_nope_head_dim, dr = cfg_.qk_rope_head_dim, dv = cfg_.v_head_dim;
  check_act(q, {T, H, dn + dr}, device(), "Mla::absorb_query", "q");
  const DType cdt = compute_dtype();
  const Tensor qc = contig(q, cdt);
  Tensor qa = Tensor::empty({T, H, rkv + dr}, cdt, q.device());
  // q_abs[:, h, :r_kv] = q_nope[:, h] W_UK_h, W_UK_h the rows [h (d_n + d_v), + d_n) ([d_n, r_kv]).
  per_head_gemm(qc.slice(2, 0, dn), kv_b_proj_.weight_value(), 0, dn + dv, dn, false, cdt,
                gemm_opt(kv_b_proj_.precision()), qa.slice(2, 0, rkv));
  if (dr > 0) put(qa.slice(2, rkv, rkv + dr), qc.slice(2, dn, dn + dr));
  return qa;
}

Tensor Mla::absorb_query_backward(const Tensor& dq_abs, const Tensor& q) {
  const char* op = "Mla::absorb_query_backward";
  const int64_t T = q.size(0), H = cfg_.num_heads, rkv = cfg_.kv_lora_rank,
                dn = cfg_.qk_nope_head_dim, dr = cfg_.qk_rope_head_dim, dv = cfg_.v_head_dim;
  check_act(q, {T, H, dn + dr}, device(), op, "q");
  check_act(dq_abs, {T, H, rkv + dr}, device(), op, "dq_abs");
  const DType cdt = compute_dtype();
  const Tensor qc = contig(q, cdt), dqa = contig(dq_abs, cdt);
  Tensor& gw = ensure_grad(kv_b_proj_.weight(), "Mla");
  const ops::GemmOptions opt = gemm_opt(kv_b_proj_.precision());
  Tensor dq = Tensor::empty({T, H, dn + dr}, cdt, q.device());
  const Tensor dlat = dqa.slice(2, 0, rkv);  // [T, H, r_kv]
  // dq_nope[:, h] = dlat[:, h] W_UK_h^T;  dW_UK_h += q_nope[:, h]^T dlat[:, h].
  per_head_gemm(dlat, kv_b_proj_.weight_value(), 0, dn + dv, dn, true, cdt, opt,
                dq.slice(2, 0, dn));
  per_head_weight_grad(qc.slice(2, 0, dn), dlat, gw, 0, dn + dv, opt);
  if (dr > 0) put(dq.slice(2, dn, dn + dr), dqa.slice(2, rkv, rkv + dr));
  return dq;
}

Tensor Mla::output(const Context& ctx, const Tensor& o_lat, OutSaved* s) const {
  const int64_t T = o_lat.size(0), H = cfg_.num_heads, rkv = cfg_.kv_lora_rank,
                dn = cfg_.qk_nope_head_dim, dv = cfg_.v_head_dim;
  check_act(o_lat, {T, H, rkv}, device(), "Mla::output", "o_lat");
  const DType cdt = compute_dtype();
  const ops::GemmOptions opt = gemm_opt(kv_b_proj_.precision());
  const bool save = s && ctx.training;
  // Inference: a bf16 o_lat (the attention's operand) goes to a bf16 product as it is (the
  // rounding the product would apply to its f32 copy).
  const bool as_is = !save && opt.round_bf16 && cdt == DType::f32 && o_lat.dtype() == DType::bf16 &&
                     o_lat.stride(2) == 1;
  const Tensor ol = as_is ? o_lat : contig(o_lat, cdt);
  Tensor heads = Tensor::empty({T, H * dv}, cdt, o_lat.device());
  // heads[:, h] = o_lat[:, h] W_UV_h^T, W_UV_h the rows [h (d_n + d_v) + d_n, + d_v) ([d_v, r_kv]).
  per_head_gemm(ol, kv_b_proj_.weight_value(), dn, dn + dv, dv, true, cdt, opt,
                heads.view({T, H, dv}));
  const Tensor y = o_proj_.forward(ctx, heads, save ? &s->o_proj : nullptr);
  if (save) s->o_lat = ol;
  return y;
}

Tensor Mla::output_backward(const Context& ctx, const Tensor& dy, const OutSaved& s) {
  const char* op = "Mla::output_backward";
  HLM_CHECK(s.o_lat.defined(), "{}: OutSaved is empty (output was not run with training)", op);
  const int64_t T = s.o_lat.size(0), H = cfg_.num_heads, rkv = cfg_.kv_lora_rank,
                dn = cfg_.qk_nope_head_dim, dv = cfg_.v_head_dim;
  check_act(dy, {T, cfg_.hidden_size}, device(), op, "dy");
  const DType cdt = compute_dtype();
  const Tensor dheads = o_proj_.backward(ctx, contig(dy, cdt), s.o_proj);
  Tensor& gw = ensure_grad(kv_b_proj_.weight(), "Mla");
  const ops::GemmOptions opt = gemm_opt(kv_b_proj_.precision());
  Tensor dol = Tensor::empty({T, H, rkv}, cdt, dy.device());
  const Tensor dh = ops::contiguous(dheads).view({T, H, dv});
  // do_lat[:, h] = dheads[:, h] W_UV_h;  dW_UV_h += dheads[:, h]^T o_lat[:, h].
  per_head_gemm(dh, kv_b_proj_.weight_value(), dn, dn + dv, dv, false, cdt, opt, dol);
  per_head_weight_grad(dh, s.o_lat, gw, dn, dn + dv, opt);
  return dol;
}

Tensor Mla::forward(const Context& ctx, const Tensor& x, const SeqLayout& seqs,
                    Saved* saved) const {
  check_x(x, cfg_.hidden_size, device(), "Mla::forward");
  const std::vector<int64_t> cu = (seqs.check_tokens(x.size(0), "Mla::forward"), seqs.offsets());
  const bool save = saved && ctx.training;
  // CUDA runs the absorbed form whatever the configured one: the same function in exact
  // arithmetic, with one KV head for the attention kernels (the expanded per-head attention is a
  // CPU reference only).
  const MlaForm form = x.is_cpu() ? cfg_.form : MlaForm::absorbed;
  Saved* full = nullptr;
  if (save) {
    *saved = Saved{};
    saved->x = x;
    saved->seqs = seqs;
    saved->form = form;
    saved->full = !ctx.recompute;
    if (saved->full) full = saved;
  }
  const Tensor y = forward_full(x, cu, seqs, full, form);
  return as_dt(y, x.dtype());
}

Tensor Mla::forward_full(const Tensor& x, const std::vector<int64_t>& cu, const SeqLayout& seqs,
                         Saved* s, MlaForm form) const {
  Context c;
  c.training = s != nullptr;
  const int64_t T = x.size(0), H = cfg_.num_heads, rkv = cfg_.kv_lora_rank,
                dn = cfg_.qk_nope_head_dim, dr = cfg_.qk_rope_head_dim, dv = cfg_.v_head_dim,
                dqk = dn + dr;
  const DType cdt = compute_dtype();
  const double scale = cfg_.softmax_scale_value();
  Projected p = project(c, x, seqs, s ? &s->proj : nullptr);
  Tensor y;
  if (form == MlaForm::expanded) {
    const Tensor kvb =
        kv_b_proj_.forward(c, p.kv.slice(1, 0, rkv).contiguous(), s ? &s->kv_b : nullptr)
            .contiguous()
            .view({T, H, dn + dv});
    Tensor k = Tensor::empty({T, H, dqk}, cdt), v = Tensor::empty({T, H, dv}, cdt);
    k.slice(2, 0, dn).copy_(kvb.slice(2, 0, dn));
    v.copy_(kvb.slice(2, dn, dn + dv));
    for (int64_t h = 0; h < H && dr > 0; ++h)
      k.select(1, h).slice(1, dn, dqk).copy_(p.kv.slice(1, rkv, rkv + dr));
    Tensor attn = Tensor::empty({T, H, dv}, cdt), lse = Tensor::empty({T, H}, cdt);
    const Docs dc = docs_of(cu, T);
    if (cdt == DType::f64)
      mha_forward<double>(p.q, k, v, dc, scale, attn, lse);
    else
      mha_forward<float>(p.q, k, v, dc, float(scale), attn, lse);
    y = o_proj_.forward(c, attn.view({T, H * dv}), s ? &s->o_proj : nullptr);
    if (s) s->k = k, s->v = v, s->attn = attn, s->lse = lse;
  } else {
    const Tensor qa = attention_operand(absorb_query(p.q));
    ops::SparseAttentionOut r =
        ops::causal_attention(qa, attention_operand(p.kv), seqs, rkv, scale);
    y = output(c, attention_operand(r.out), s ? &s->out : nullptr);
    if (s) s->q_abs = qa, s->lse = r.lse;
  }
  if (s) s->p = p;
  return y;
}

Tensor Mla::backward(const Context& ctx, const Tensor& dy, const Saved& saved) {
  HLM_CHECK(saved.x.defined(),
            "Mla::backward: Saved is empty (run forward with ctx.training and a Saved first)");
  const int64_t T = saved.x.size(0);
  check_act(dy, {T, cfg_.hidden_size}, device(), "Mla::backward", "dy");
  const Tensor dyc = contig(dy, compute_dtype());
  Tensor dx;
  if (saved.full) {
    dx = backward_full(dyc, saved);
  } else {
    // Selective recompute: rebuild every activation from the saved input, then run backward.
    Saved full;
    full.x = saved.x;
    full.seqs = saved.seqs;
    full.form = saved.form;
    full.full = true;
    const std::vector<int64_t> cu =
        (saved.seqs.check_tokens(T, "Mla::backward"), saved.seqs.offsets());
    forward_full(saved.x, cu, saved.seqs, &full, saved.form);
    dx = backward_full(dyc, full);
  }
  (void)ctx;
  return as_dt(dx, saved.x.dtype());
}

Tensor Mla::backward_full(const Tensor& dy, const Saved& s) {
  Context c;
  const int64_t T = s.x.size(0), H = cfg_.num_heads, rkv = cfg_.kv_lora_rank,
                dn = cfg_.qk_nope_head_dim, dr = cfg_.qk_rope_head_dim, dv = cfg_.v_head_dim,
                dqk = dn + dr;
  const DType cdt = compute_dtype();
  const double scale = cfg_.softmax_scale_value();
  if (s.form == MlaForm::expanded) {
    const Tensor dattn = o_proj_.backward(c, dy, s.o_proj).contiguous().view({T, H, dv});
    Tensor dq = Tensor::empty({T, H, dqk}, cdt), dk = Tensor::empty({T, H, dqk}, cdt),
           dvv = Tensor::empty({T, H, dv}, cdt);
    const std::vector<int64_t> cu = (s.seqs.check_tokens(T, "Mla::backward"), s.seqs.offsets());
    const Docs dc = docs_of(cu, T);
    if (cdt == DType::f64)
      mha_backward<double>(s.p.q, s.k, s.v, s.attn, s.lse, dattn, dc, scale, dq, dk, dvv);
    else
      mha_backward<float>(s.p.q, s.k, s.v, s.attn, s.lse, dattn, dc, float(scale), dq, dk, dvv);
    Tensor dkvb = Tensor::empty({T, H, dn + dv}, cdt);
    dkvb.slice(2, 0, dn).copy_(dk.slice(2, 0, dn));
    dkvb.slice(2, dn, dn + dv).copy_(dvv);
    const Tensor dckv = kv_b_proj_.backward(c, dkvb.view({T, H * (dn + dv)}), s.kv_b);
    Tensor dkv = Tensor::empty({T, rkv + dr}, cdt);
    dkv.slice(1, 0, rkv).copy_(dckv);
    if (dr > 0) {
      Tensor dkp = Tensor::empty({T, dr}, cdt);
      if (cdt == DType::f64)
        sum_heads<double>(dk, dn, dr, dkp);
      else
        sum_heads<float>(dk, dn, dr, dkp);
      dkv.slice(1, rkv, rkv + dr).copy_(dkp);
    }
    return project_backward(c, dq, dkv, s.proj);
  }
  const Tensor dol = output_backward(c, dy, s.out);
  const ops::SparseAttentionGrads g =
      ops::causal_attention_backward(s.q_abs, attention_operand(s.p.kv), s.seqs, rkv, scale,
                                     attention_operand(s.out.o_lat), s.lse, attention_operand(dol));
  const Tensor dq = absorb_query_backward(attention_operand(g.dq), s.p.q);
  return project_backward(c, dq, attention_operand(g.dkv), s.proj);
}

}  // namespace hlm
