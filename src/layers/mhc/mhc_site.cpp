// MhcSite (layers/mhc/mhc_site.h): parameters, init and the two halves of forward and backward of
// one mHC site over ops/mhc.h.
//
// Backward, per token (ops/mhc.h has the formulas):
//   write-back half:  dy = sum_i post_i dX'_i;  dX_wb_j = sum_i comb[j][i] dX'_i;
//                     dpost_i = <dX'_i, y>;     dcomb[j][i] = <dX'_i, X_j>
//   collapse half:    dX_cl_j = pre_j du;       dpre_j = <du, X_j>
//                     dX_map = mapping backward (Sinkhorn, sigmoids, mix, inv_rms) of
//                              (dpre, dpost, dcomb); d fn, d base, d scale +=
//                     dX = (dX_wb + dX_cl) + dX_map
#include "layers/mhc/mhc_site.h"

#include <cmath>

#include "ops/tensor_ops.h"

namespace hlm {

const char* mhc_site_kind_name(MhcSiteKind k) {
  return k == MhcSiteKind::attn ? "attn" : "ffn";
}

void MhcSiteConfig::validate() const {
  HLM_CHECK(hidden_size >= 1, "MhcSiteConfig.hidden_size must be >= 1, got {}", hidden_size);
  HLM_CHECK(hc_mult >= 1, "MhcSiteConfig.hc_mult must be >= 1, got {}", hc_mult);
  HLM_CHECK(init != MhcInit::residual || hc_mult >= 2,
            "MhcSiteConfig.hc_mult must be >= 2 with MhcInit::residual, got {}", hc_mult);
  HLM_CHECK(std::isfinite(hc_eps) && hc_eps >= 0,
            "MhcSiteConfig.hc_eps must be finite and >= 0, got {}", hc_eps);
  HLM_CHECK(std::isfinite(norm_eps) && norm_eps >= 0,
            "MhcSiteConfig.norm_eps must be finite and >= 0, got {}", norm_eps);
  HLM_CHECK(sinkhorn_iters >= 1, "MhcSiteConfig.sinkhorn_iters must be >= 1, got {}",
            sinkhorn_iters);
  HLM_CHECK(std::isfinite(init_std) && init_std >= 0,
            "MhcSiteConfig.init_std must be finite and >= 0, got {}", init_std);
  HLM_CHECK(std::isfinite(init_gating), "MhcSiteConfig.init_gating must be finite, got {}",
            init_gating);
  HLM_CHECK(init != MhcInit::residual || 1.0 / double(hc_mult) - hc_eps > 0,
            "MhcSiteConfig.hc_eps = {} must be below 1 / hc_mult with MhcInit::residual", hc_eps);
  HLM_CHECK(dtype == DType::f64 || dtype == DType::f32 || dtype == DType::bf16,
            "MhcSiteConfig.dtype must be f64, f32 or bf16, got {}", dtype_name(dtype));
}

ops::MhcConfig MhcSiteConfig::op_config() const {
  ops::MhcConfig c;
  c.n = hc_mult;
  c.hc_eps = hc_eps;
  c.norm_eps = norm_eps;
  c.sinkhorn_iters = sinkhorn_iters;
  return c;
}

MhcSite::MhcSite(const MhcSiteConfig& cfg, MhcSiteKind kind, const PrecisionPolicy& policy,
                 const std::string& layer_path)
    : cfg_(cfg), kind_(kind), path_(layer_path) {
  cfg_.validate();
  const std::string site = cfg_.naming == MhcNaming::transformers
                               ? std::string(mhc_site_kind_name(kind)) + "_hc."
                               : std::string("hc_") + mhc_site_kind_name(kind) + "_";
  const GemmPrecision prec = policy.resolve(path_ + "." + site + "fn", ModuleRole::mhc);
  HLM_CHECK(prec.kind == GemmKind::native,
            "MhcSite({}): the mHC mappings must resolve to native FP32, got {}", path_,
            precision_str(prec));
  const int64_t n = cfg_.hc_mult, D = cfg_.hidden_size, m = (2 + n) * n;
  const DType pdt = hlm::compute_dtype(cfg_.dtype);
  const std::string pre = path_.empty() ? "" : path_ + ".";

  Tensor fn = Tensor::empty({m, n * D}, DType::f64);
  init_normal_named(fn, cfg_.seed, pre + site + "fn", cfg_.init_std);
  std::vector<double> base(size_t(m), 0.0), scale(3, 1.0);
  if (cfg_.init == MhcInit::residual) {
    const double p = 1.0 / double(n) - cfg_.hc_eps;  // sigmoid(b) = p  ->  pre = 1/n
    for (int64_t j = 0; j < n; ++j) base[size_t(j)] = std::log(p / (1.0 - p));
    const double d = 1e-3;  // off-diagonal softmax mass
    const double diag = std::log(double(n - 1) * (1.0 - d) / d);
    for (int64_t i = 0; i < n; ++i) base[size_t(2 * n + n * i + i)] = diag;
    scale.assign(3, cfg_.init_gating);
  }
  fn_ = &add_param(site + "fn", fn.to(pdt), true, true);
  base_ = &add_param(site + "base", Tensor::from_values({m}, base, pdt), true, true);
  scale_ = &add_param(site + "scale", Tensor::from_values({3}, scale, pdt), true, true);
}

Tensor MhcSite::collapse_norm(const Tensor& x, const Tensor& norm_w, double eps, Saved& s) const {
  check_streams(x, "collapse_norm");
  s = Saved{};
  s.x = x;
  s.training = false;
  ops::MhcCollapseNormed r = ops::mhc_collapse_norm(x, params(), cfg_.op_config(), norm_w, eps);
  s.maps.pre = r.pre;
  s.maps.post = r.post;
  s.maps.comb = r.comb;
  s.collapsed = true;
  return r.a;
}

void MhcSite::check_streams(const Tensor& x, const char* what) const {
  HLM_CHECK(
      x.defined() && x.device() == fn_->value.device(),
      "MhcSite({}, {})::{}: x must be a defined tensor on the parameters' device ({}), got {}",
      path_, mhc_site_kind_name(kind_), what, device_name(fn_->value.device()),
      x.defined() ? x.describe() : "undefined");
  HLM_CHECK(x.dtype() == DType::f64 || x.dtype() == DType::f32 || x.dtype() == DType::bf16,
            "MhcSite({}, {})::{}: x must be f64, f32 or bf16, got {}", path_,
            mhc_site_kind_name(kind_), what, x.describe());
  HLM_CHECK(x.dim() == 3 && x.size(1) == cfg_.hc_mult && x.size(2) == cfg_.hidden_size,
            "MhcSite({}, {})::{}: x must be [T, {}, {}], got {}", path_, mhc_site_kind_name(kind_),
            what, cfg_.hc_mult, cfg_.hidden_size, x.describe());
}

Tensor MhcSite::collapse(const Context& ctx, const Tensor& x, Saved& s) const {
  check_streams(x, "collapse");
  s = Saved{};
  s.x = x;
  s.training = ctx.training;
  s.maps = ops::mhc_mappings_forward(x, params(), cfg_.op_config());
  s.collapsed = true;
  return ops::mhc_collapse(x, s.maps.pre);
}

Tensor MhcSite::write_back(const Context& ctx, const Tensor& y, Saved& s) const {
  HLM_CHECK(s.collapsed && s.x.defined() && s.maps.comb.defined(),
            "MhcSite({}, {})::write_back: call collapse first (Saved holds no mappings)", path_,
            mhc_site_kind_name(kind_));
  const int64_t T = s.x.size(0);
  HLM_CHECK(y.defined() && y.device() == s.x.device() && is_floating(y.dtype()) &&
                y.shape() == Shape({T, cfg_.hidden_size}),
            "MhcSite({}, {})::write_back: y must be a floating tensor [{}, {}] on x's device ({}), "
            "got {}",
            path_, mhc_site_kind_name(kind_), T, cfg_.hidden_size, device_name(s.x.device()),
            y.defined() ? y.describe() : "undefined");
  Tensor xo = ops::mhc_write_back(s.x, y, s.maps.post, s.maps.comb);
  s.collapsed = false;
  if (!s.training || !ctx.training) {
    s = Saved{};  // inference: nothing to keep
  } else {
    s.y = y;
    if (ctx.recompute) s.maps = ops::MhcMappings{};  // backward recomputes them from X
  }
  return xo;
}

MhcSite::Partial MhcSite::backward_write_back(const Context& ctx, const Tensor& dx_out,
                                              const Saved& s) const {
  HLM_CHECK(s.training && s.x.defined() && s.y.defined(),
            "MhcSite({}, {})::backward_write_back: Saved is incomplete (run collapse and "
            "write_back with ctx.training)",
            path_, mhc_site_kind_name(kind_));
  HLM_CHECK(dx_out.defined() && is_floating(dx_out.dtype()) && dx_out.shape() == s.x.shape(),
            "MhcSite({}, {})::backward_write_back: dX' must be floating {}, got {}", path_,
            mhc_site_kind_name(kind_), shape_str(s.x.shape()),
            dx_out.defined() ? dx_out.describe() : "undefined");
  Partial p;
  if (!s.maps.comb.defined()) p.maps = ops::mhc_mappings_forward(s.x, params(), cfg_.op_config());
  const ops::MhcMappings& m = s.maps.comb.defined() ? s.maps : p.maps;
  ops::MhcWriteBackGrads wb = ops::mhc_write_back_backward(s.x, s.y, m.post, m.comb, dx_out);
  p.dy = ops::as_dtype(wb.dy, s.y.dtype());
  p.dx = wb.dx;
  p.dpost = wb.dpost;
  p.dcomb = wb.dcomb;
  (void)ctx;
  return p;
}

Tensor MhcSite::backward_collapse(const Context& ctx, const Tensor& du, const Saved& s,
                                  const Partial& p) {
  const char* kn = mhc_site_kind_name(kind_);
  HLM_CHECK(s.training && s.x.defined() && s.y.defined(),
            "MhcSite({}, {})::backward_collapse: Saved is incomplete", path_, kn);
  HLM_CHECK(p.dx.defined() && p.dx.shape() == s.x.shape() && p.dpost.defined() && p.dcomb.defined(),
            "MhcSite({}, {})::backward_collapse: Partial is empty (run backward_write_back first)",
            path_, kn);
  const int64_t T = s.x.size(0);
  HLM_CHECK(du.defined() && is_floating(du.dtype()) && du.shape() == Shape({T, cfg_.hidden_size}),
            "MhcSite({}, {})::backward_collapse: du must be floating [{}, {}], got {}", path_, kn,
            T, cfg_.hidden_size, du.defined() ? du.describe() : "undefined");
  const ops::MhcMappings& m = p.maps.comb.defined() ? p.maps : s.maps;
  HLM_CHECK(m.pre.defined(), "MhcSite({}, {})::backward_collapse: no mappings in Saved or Partial",
            path_, kn);
  const std::string where = fmt::format("MhcSite({}, {})::backward_collapse", path_, kn);
  ops::MhcParamGrads g{ensure_grad(*fn_, where), ensure_grad(*base_, where),
                       ensure_grad(*scale_, where)};
  ops::MhcCollapseGrads cl = ops::mhc_collapse_backward(s.x, m.pre, du);
  Tensor dmap =
      ops::mhc_mappings_backward(s.x, params(), cfg_.op_config(), m, cl.dpre, p.dpost, p.dcomb, g);
  // dX = write-back + collapse + mapping, in that order per element (as ops::mhc_site_backward).
  const DType cdt = hlm::compute_dtype(s.x.dtype());
  Tensor dx = Tensor::empty(s.x.shape(), cdt, s.x.device());
  const int64_t N = dx.numel();
  if (!dx.is_cpu()) {
    ops::copy_into(dx, p.dx);  // (a + b) + c, one rounding per addition, as below
    ops::add_(dx, cl.dx);
    ops::add_(dx, dmap);
    (void)ctx;
    return ops::as_dtype(dx, s.x.dtype());
  }
  if (cdt == DType::f64) {
    const Tensor a = p.dx.dtype() == DType::f64 ? p.dx.contiguous() : p.dx.to(DType::f64);
    const Tensor b = cl.dx.contiguous(), c = dmap.contiguous();
    const double *pa = a.data<double>(), *pb = b.data<double>(), *pc = c.data<double>();
    double* o = dx.data<double>();
    for (int64_t i = 0; i < N; ++i) o[i] = (pa[i] + pb[i]) + pc[i];
  } else {
    const Tensor a = p.dx.dtype() == DType::f32 ? p.dx.contiguous() : p.dx.to(DType::f32);
    const Tensor b = cl.dx.contiguous(), c = dmap.contiguous();
    const float *pa = a.data<float>(), *pb = b.data<float>(), *pc = c.data<float>();
    float* o = dx.data<float>();
    for (int64_t i = 0; i < N; ++i) o[i] = (pa[i] + pb[i]) + pc[i];
  }
  (void)ctx;
  return s.x.dtype() == cdt ? dx : dx.to(s.x.dtype());
}

}  // namespace hlm
