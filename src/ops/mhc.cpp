// The front door of mHC (ops/mhc.h): argument checks, output allocation, and the switch to the
// CPU reference (ops/cpu/mhc.cpp) or the CUDA kernels (ops/cuda/mhc.cu); the whole-site functions
// compose the pieces, so they run on the device of their inputs.
#include "ops/mhc.h"

#include <cmath>

#include "ops/cpu/mhc.h"
#include "ops/cuda/mhc.cuh"
#include "ops/dispatch.h"
#include "ops/op_checks.h"
#include "ops/rmsnorm.h"
#include "ops/tensor_ops.h"

namespace hlm::ops {
namespace {

// x [T, n, D]; returns (T, n, D).
struct Dims {
  int64_t T, n, D;
};
Dims check_streams(const Tensor& x, const char* op, int64_t n_expected = -1) {
  detail::require_floating(x, op, "x");
  HLM_CHECK(x.dim() == 3, "{}: x must be [T, n, D], got {}", op, x.describe());
  if (n_expected >= 0)
    HLM_CHECK(x.size(1) == n_expected, "{}: x must have n = {} streams, got {}", op, n_expected,
              x.describe());
  HLM_CHECK(x.size(1) >= 1 && x.size(2) >= 1, "{}: x must have n >= 1 and D >= 1, got {}", op,
            x.describe());
  return {x.size(0), x.size(1), x.size(2)};
}

// The CUDA rules (ops/mhc.h, "Devices and dtypes"), checked after the device-independent ones
// when `ref` is a CUDA tensor: every tensor f32, f64 or bf16; at most kMhcMaxStreams streams
// (n < 0: the op has no limit); accumulators contiguous.
void check_cuda(const char* op, const Tensor& ref, std::initializer_list<detail::Arg> ts,
                int64_t n = -1, std::initializer_list<detail::Arg> accs = {}) {
  if (ref.device() == Device::cpu) return;
  for (const detail::Arg& a : ts) {
    if (!a.t.defined()) continue;
    HLM_CHECK(a.t.dtype() == DType::f32 || a.t.dtype() == DType::f64 || a.t.dtype() == DType::bf16,
              "{}: {} must be f32, f64 or bf16 on CUDA, got {}", op, a.name, a.t.describe());
  }
  HLM_CHECK(n <= cuda::kMhcMaxStreams, "{}: at most {} streams on CUDA, got n = {}", op,
            cuda::kMhcMaxStreams, n);
  for (const detail::Arg& a : accs) detail::require_contiguous(a.t, op, a.name);
}

// A floating tensor of shape s on x's device.
void check_act(const Tensor& t, const Tensor& x, const Shape& s, const char* op, const char* what) {
  detail::require_floating(t, op, what);
  detail::require_same_device(t, x, op, what, "x");
  detail::require_shape(t, s, op, what);
}

void check_cfg(const MhcConfig& c, const char* op) {
  HLM_CHECK(c.n >= 1, "{}: cfg.n (hc_mult) must be >= 1, got {}", op, c.n);
  HLM_CHECK(c.sinkhorn_iters >= 1, "{}: cfg.sinkhorn_iters must be >= 1, got {}", op,
            c.sinkhorn_iters);
  HLM_CHECK(c.hc_eps >= 0 && c.norm_eps >= 0, "{}: hc_eps and norm_eps must be >= 0, got {}, {}",
            op, c.hc_eps, c.norm_eps);
}

void check_params(const MhcParams& p, const Tensor& x, const Dims& d, const MhcConfig& c,
                  const char* op) {
  const int64_t m = c.n_mix();
  check_act(p.fn, x, {m, d.n * d.D}, op, "params.fn");
  check_act(p.base, x, {m}, op, "params.base");
  check_act(p.scale, x, {3}, op, "params.scale");
}

void check_maps(const MhcMappings& m, const Tensor& x, const Dims& d, const char* op) {
  const int64_t n = d.n;
  for (auto [t, name] : {std::pair{&m.inv_rms, "maps.inv_rms"},
                         {&m.mix, "maps.mix"},
                         {&m.comb_logits, "maps.comb_logits"}}) {
    detail::require_real(*t, op, name);
    detail::require_same_device(*t, x, op, name, "x");
  }
  detail::require_shape(m.inv_rms, {d.T}, op, "maps.inv_rms");
  detail::require_shape(m.mix, {d.T, (2 + n) * n}, op, "maps.mix");
  detail::require_shape(m.comb_logits, {d.T, n, n}, op, "maps.comb_logits");
}

// An optional (undefined = zero) gradient input of shape s.
void check_opt(const Tensor& t, const Tensor& x, const Shape& s, const char* op, const char* what) {
  if (!t.defined()) return;
  detail::require_real(t, op, what);
  detail::require_same_device(t, x, op, what, "x");
  detail::require_shape(t, s, op, what);
}

void check_logits(const Tensor& L, const char* op, const char* what, int64_t iters) {
  detail::require_floating(L, op, what);
  HLM_CHECK(L.dim() == 3 && L.size(1) == L.size(2) && L.size(1) >= 1,
            "{}: {} must be [T, n, n] with n >= 1, got {}", op, what, L.describe());
  HLM_CHECK(iters >= 1, "{}: iters must be >= 1, got {}", op, iters);
}

void check_wb(const Tensor& x, const Tensor& y, const Tensor& post, const Tensor& comb,
              const Dims& d, const char* op) {
  check_act(y, x, {d.T, d.D}, op, "y");
  check_act(post, x, {d.T, d.n}, op, "post");
  check_act(comb, x, {d.T, d.n, d.n}, op, "comb");
}

DType cdt(const Tensor& x) {
  return detail::compute_dtype(x.dtype());
}

// [T, D] tensor of e.dtype() from an [T, n, D] x / [T, D] e.
Tensor rows_out(const Tensor& x, DType dt) {
  return detail::new_output({x.size(0), x.size(-1)}, dt, x.device());
}

// The front door of an op that spreads a floating [T, D] `e` over n >= 1 streams: checks e and n,
// allocates the [T, n, D] output (e's dtype) and runs the CPU reference cpu_fn(e, out) or the CUDA
// launcher cuda_fn(e, out).
Tensor spread_over_streams(const char* op, const Tensor& e, int64_t n, const char* what,
                           void (*cpu_fn)(const Tensor&, Tensor&),
                           void (*cuda_fn)(const Tensor&, Tensor&)) {
  detail::require_floating(e, op, what);
  HLM_CHECK(e.dim() == 2, "{}: {} must be [T, D], got {}", op, what, e.describe());
  HLM_CHECK(n >= 1, "{}: n must be >= 1, got {}", op, n);
  check_cuda(op, e, {{e, what}});
  Tensor out = detail::new_output({e.size(0), n, e.size(1)}, e.dtype(), e.device());
  if (e.device() == Device::cpu) {
    cpu_fn(e, out);
  } else {
    cuda_fn(e, out);
  }
  return out;
}

// The CUDA launchers of the two spread ops, as plain functions (a build without CUDA has no
// cuda:: definitions: HLM_CUDA_PATH turns the call into an error).
void cuda_mhc_expand(const Tensor& e, Tensor& out) {
  HLM_CUDA_PATH("mhc_expand", cuda::mhc_expand(e, out));
}
void cuda_mhc_mean_contract_backward(const Tensor& dh, Tensor& dx) {
  HLM_CUDA_PATH("mhc_mean_contract_backward", cuda::mhc_mean_contract_backward(dh, dx));
}

}  // namespace

// ---- public: pieces
// ------------------------------------------------------------------------------

MhcMappings mhc_mappings_forward(const Tensor& x, const MhcParams& p, const MhcConfig& c) {
  const char* op = "mhc_mappings_forward";
  check_cfg(c, op);
  const Dims d = check_streams(x, op, c.n);
  check_params(p, x, d, c, op);
  check_cuda(op, x,
             {{x, "x"}, {p.fn, "params.fn"}, {p.base, "params.base"}, {p.scale, "params.scale"}},
             d.n);
  const DType dt = cdt(x);
  const Device dev = x.device();
  const int64_t n = d.n;
  MhcMappings m{
      detail::new_output({d.T}, dt, dev),       detail::new_output({d.T, c.n_mix()}, dt, dev),
      detail::new_output({d.T, n}, dt, dev),    detail::new_output({d.T, n}, dt, dev),
      detail::new_output({d.T, n, n}, dt, dev), detail::new_output({d.T, n, n}, dt, dev)};
  HLM_DISPATCH(op, dev, mhc_mappings_forward, x, p, c, m);
  return m;
}

Tensor mhc_mappings_backward(const Tensor& x, const MhcParams& p, const MhcConfig& c,
                             const MhcMappings& m, const Tensor& dpre, const Tensor& dpost,
                             const Tensor& dcomb, MhcParamGrads& g) {
  const char* op = "mhc_mappings_backward";
  check_cfg(c, op);
  const Dims d = check_streams(x, op, c.n);
  check_params(p, x, d, c, op);
  check_maps(m, x, d, op);
  check_opt(dpre, x, {d.T, d.n}, op, "dpre");
  check_opt(dpost, x, {d.T, d.n}, op, "dpost");
  check_opt(dcomb, x, {d.T, d.n, d.n}, op, "dcomb");
  detail::require_accumulator(g.dfn, p.fn.shape(), x, op, "grads.dfn");
  detail::require_accumulator(g.dbase, p.base.shape(), x, op, "grads.dbase");
  detail::require_accumulator(g.dscale, p.scale.shape(), x, op, "grads.dscale");
  check_cuda(op, x,
             {{x, "x"},
              {p.fn, "params.fn"},
              {p.base, "params.base"},
              {p.scale, "params.scale"},
              {m.inv_rms, "maps.inv_rms"},
              {m.mix, "maps.mix"},
              {m.comb_logits, "maps.comb_logits"},
              {dpre, "dpre"},
              {dpost, "dpost"},
              {dcomb, "dcomb"}},
             d.n, {{g.dfn, "grads.dfn"}, {g.dbase, "grads.dbase"}, {g.dscale, "grads.dscale"}});
  Tensor dx = detail::new_output(x.shape(), cdt(x), x.device());
  HLM_DISPATCH(op, x.device(), mhc_mappings_backward, x, p, c, m, dpre, dpost, dcomb, g, dx);
  return dx;
}

Tensor mhc_inv_rms(const Tensor& x, double eps) {
  const char* op = "mhc_inv_rms";
  const Dims d = check_streams(x, op);
  check_cuda(op, x, {{x, "x"}});
  Tensor r = detail::new_output({d.T}, cdt(x), x.device());
  HLM_DISPATCH(op, x.device(), mhc_inv_rms, x, eps, r);
  return r;
}

Tensor mhc_inv_rms_backward(const Tensor& x, const Tensor& inv_rms, const Tensor& d_inv_rms) {
  const char* op = "mhc_inv_rms_backward";
  const Dims d = check_streams(x, op);
  for (auto [t, name] : {std::pair{&inv_rms, "inv_rms"}, {&d_inv_rms, "d_inv_rms"}}) {
    detail::require_real(*t, op, name);
    detail::require_same_device(*t, x, op, name, "x");
    detail::require_shape(*t, {d.T}, op, name);
  }
  check_cuda(op, x, {{x, "x"}});
  Tensor dx = detail::new_output(x.shape(), cdt(x), x.device());
  HLM_DISPATCH(op, x.device(), mhc_inv_rms_backward, x, inv_rms, d_inv_rms, dx);
  return dx;
}

Tensor mhc_sinkhorn(const Tensor& logits, double hc_eps, int64_t iters) {
  const char* op = "mhc_sinkhorn";
  check_logits(logits, op, "logits", iters);
  check_cuda(op, logits, {{logits, "logits"}}, logits.size(1));
  Tensor out = detail::new_output(logits.shape(), cdt(logits), logits.device());
  HLM_DISPATCH(op, logits.device(), mhc_sinkhorn, logits, hc_eps, iters, out);
  return out;
}

Tensor mhc_sinkhorn_backward(const Tensor& logits, const Tensor& dcomb, double hc_eps,
                             int64_t iters) {
  const char* op = "mhc_sinkhorn_backward";
  check_logits(logits, op, "logits", iters);
  detail::require_floating(dcomb, op, "dcomb");
  detail::require_same_device(dcomb, logits, op, "dcomb", "logits");
  detail::require_shape(dcomb, logits.shape(), op, "dcomb");
  check_cuda(op, logits, {{logits, "logits"}, {dcomb, "dcomb"}}, logits.size(1));
  Tensor dl = detail::new_output(logits.shape(), cdt(logits), logits.device());
  HLM_DISPATCH(op, logits.device(), mhc_sinkhorn_backward, logits, dcomb, hc_eps, iters, dl);
  return dl;
}

// ---- collapse / write-back ---------------------------------------------------------------------

Tensor mhc_collapse(const Tensor& x, const Tensor& pre) {
  const char* op = "mhc_collapse";
  const Dims d = check_streams(x, op);
  check_act(pre, x, {d.T, d.n}, op, "pre");
  check_cuda(op, x, {{x, "x"}, {pre, "pre"}});
  Tensor u = rows_out(x, x.dtype());
  HLM_DISPATCH(op, x.device(), mhc_collapse, x, pre, u);
  return u;
}

MhcCollapseNormed mhc_collapse_norm(const Tensor& x, const MhcParams& p, const MhcConfig& c,
                                    const Tensor& norm_w, double norm_eps) {
  const char* op = "mhc_collapse_norm";
  check_cfg(c, op);
  const Dims d = check_streams(x, op, c.n);
  check_params(p, x, d, c, op);
  check_act(norm_w, x, {d.D}, op, "norm_w");
  HLM_CHECK(std::isfinite(norm_eps) && norm_eps >= 0,
            "{}: norm_eps must be finite and >= 0, got {}", op, norm_eps);
  check_cuda(op, x,
             {{x, "x"},
              {p.fn, "params.fn"},
              {p.base, "params.base"},
              {p.scale, "params.scale"},
              {norm_w, "norm_w"}},
             d.n);
  const DType dt = cdt(x);
  const Device dev = x.device();
  if (dev == Device::cpu) {
    const MhcMappings m = mhc_mappings_forward(x, p, c);
    const Tensor u = mhc_collapse(x, m.pre);
    const RmsNormResult nr = rmsnorm_forward(as_dtype(u, dt), as_dtype(norm_w, dt), norm_eps);
    return {as_dtype(nr.y, x.dtype()), m.pre, m.post, m.comb};
  }
  MhcCollapseNormed r{
      detail::new_output({d.T, d.D}, x.dtype(), dev), detail::new_output({d.T, d.n}, dt, dev),
      detail::new_output({d.T, d.n}, dt, dev), detail::new_output({d.T, d.n, d.n}, dt, dev)};
  HLM_CUDA_PATH(op, cuda::mhc_collapse_norm(x, p, c, norm_w, norm_eps, r));
  return r;
}

MhcCollapseGrads mhc_collapse_backward(const Tensor& x, const Tensor& pre, const Tensor& du) {
  const char* op = "mhc_collapse_backward";
  const Dims d = check_streams(x, op);
  check_act(pre, x, {d.T, d.n}, op, "pre");
  check_act(du, x, {d.T, d.D}, op, "du");
  const DType dt = cdt(x);
  check_cuda(op, x, {{x, "x"}, {pre, "pre"}, {du, "du"}}, d.n);
  MhcCollapseGrads r{detail::new_output(x.shape(), dt, x.device()),
                     detail::new_output({d.T, d.n}, dt, x.device())};
  HLM_DISPATCH(op, x.device(), mhc_collapse_backward, x, pre, du, r);
  return r;
}

Tensor mhc_write_back(const Tensor& x, const Tensor& y, const Tensor& post, const Tensor& comb) {
  const char* op = "mhc_write_back";
  const Dims d = check_streams(x, op);
  check_wb(x, y, post, comb, d, op);
  check_cuda(op, x, {{x, "x"}, {y, "y"}, {post, "post"}, {comb, "comb"}});
  Tensor out = detail::new_output(x.shape(), x.dtype(), x.device());
  HLM_DISPATCH(op, x.device(), mhc_write_back, x, y, post, comb, out);
  return out;
}

MhcWriteBackGrads mhc_write_back_backward(const Tensor& x, const Tensor& y, const Tensor& post,
                                          const Tensor& comb, const Tensor& dx_out) {
  const char* op = "mhc_write_back_backward";
  const Dims d = check_streams(x, op);
  check_wb(x, y, post, comb, d, op);
  check_act(dx_out, x, x.shape(), op, "dx_out");
  check_cuda(op, x, {{x, "x"}, {y, "y"}, {post, "post"}, {comb, "comb"}, {dx_out, "dx_out"}}, d.n);
  const DType dt = cdt(x);
  const Device dev = x.device();
  MhcWriteBackGrads r{
      detail::new_output(x.shape(), dt, dev), detail::new_output({d.T, d.D}, dt, dev),
      detail::new_output({d.T, d.n}, dt, dev), detail::new_output({d.T, d.n, d.n}, dt, dev)};
  HLM_DISPATCH(op, dev, mhc_write_back_backward, x, y, post, comb, dx_out, r);
  return r;
}

// ---- model level -------------------------------------------------------------------------------

Tensor mhc_expand(const Tensor& e, int64_t n) {
  return spread_over_streams("mhc_expand", e, n, "e", cpu::mhc_expand, cuda_mhc_expand);
}

Tensor mhc_expand_backward(const Tensor& dx) {
  const char* op = "mhc_expand_backward";
  check_streams(dx, op);
  check_cuda(op, dx, {{dx, "dx"}});
  Tensor de = rows_out(dx, dx.dtype());
  HLM_DISPATCH(op, dx.device(), mhc_stream_sum, dx, 1, de);
  return de;
}

Tensor mhc_mean_contract(const Tensor& x) {
  const char* op = "mhc_mean_contract";
  const Dims d = check_streams(x, op);
  check_cuda(op, x, {{x, "x"}});
  Tensor h = rows_out(x, x.dtype());
  HLM_DISPATCH(op, x.device(), mhc_stream_sum, x, d.n, h);
  return h;
}

Tensor mhc_mean_contract_backward(const Tensor& dh, int64_t n) {
  return spread_over_streams("mhc_mean_contract_backward", dh, n, "dh",
                             cpu::mhc_mean_contract_backward, cuda_mhc_mean_contract_backward);
}

// ---- a whole site ------------------------------------------------------------------------------

Tensor mhc_site_begin(const Tensor& x, const MhcParams& p, const MhcConfig& c, MhcSiteSaved& s) {
  s.cfg = c;
  s.params = p;
  s.x = x;
  s.y = Tensor();
  s.maps = mhc_mappings_forward(x, p, c);
  return mhc_collapse(x, s.maps.pre);
}

Tensor mhc_site_end(MhcSiteSaved& s, const Tensor& y) {
  HLM_CHECK(s.x.defined(), "mhc_site_end: saved state is empty (call mhc_site_begin first)");
  s.y = y;
  return mhc_write_back(s.x, y, s.maps.post, s.maps.comb);
}

Tensor mhc_site_backward_dy(const MhcSiteSaved& s, const Tensor& dx_out) {
  const char* op = "mhc_site_backward_dy";
  HLM_CHECK(s.x.defined() && s.y.defined(), "{}: saved state incomplete (run mhc_site_end)", op);
  check_streams(s.x, op);
  check_act(dx_out, s.x, s.x.shape(), op, "dx_out");
  check_act(s.maps.post, s.x, {s.x.size(0), s.x.size(1)}, op, "maps.post");
  check_cuda(op, s.x, {{s.maps.post, "maps.post"}, {dx_out, "dx_out"}});
  Tensor dy = rows_out(s.x, cdt(s.x));
  HLM_DISPATCH(op, s.x.device(), mhc_post_sum, s.maps.post, dx_out, dy);
  return dy;
}

Tensor mhc_site_backward(const MhcSiteSaved& s, const Tensor& dx_out, const Tensor& du,
                         MhcParamGrads& g) {
  const char* op = "mhc_site_backward";
  HLM_CHECK(s.x.defined() && s.y.defined(), "{}: saved state incomplete (run mhc_site_end)", op);
  MhcWriteBackGrads wb = mhc_write_back_backward(s.x, s.y, s.maps.post, s.maps.comb, dx_out);
  MhcCollapseGrads cl = mhc_collapse_backward(s.x, s.maps.pre, du);
  Tensor dmap = mhc_mappings_backward(s.x, s.params, s.cfg, s.maps, cl.dpre, wb.dpost, wb.dcomb, g);
  // dx = write-back + collapse + mapping, added in that order per element.
  Tensor dx = wb.dx;
  HLM_DISPATCH(op, dx.device(), mhc_add3_, dx, cl.dx, dmap);
  return dx;
}

}  // namespace hlm::ops
