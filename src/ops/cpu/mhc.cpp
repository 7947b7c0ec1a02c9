// CPU implementation of mHC (ops/mhc.h; spec/mhc_moe_fp8.md 1.3). One token at a time, every sum
// in a fixed order; parameter gradients reduce over tokens in token order. Activation gradients
// are written (=), parameter gradients accumulate (+=).
#include "ops/mhc.h"

#include <cmath>
#include <vector>

#include "ops/activations.h"
#include "ops/op_checks.h"

namespace hlm::ops {
namespace {

DType comp_dtype(const Tensor& x) {
  return x.dtype() == DType::f64 ? DType::f64 : DType::f32;
}

// `t` as a contiguous tensor of dtype dt (no copy when it already is one).
Tensor as_dt(const Tensor& t, DType dt) {
  return t.dtype() == dt ? t.contiguous() : t.to(dt);
}

void require_act(const Tensor& t, const char* op, const char* what) {
  HLM_CHECK(t.defined(), "{}: {} is undefined", op, what);
  detail::require_cpu(t, op, what);
  HLM_CHECK(is_floating(t.dtype()), "{}: {} must be floating, got {}", op, what, t.describe());
}

// x [T, n, D]; returns (T, n, D).
struct Dims {
  int64_t T, n, D;
};
Dims check_streams(const Tensor& x, const char* op, int64_t n_expected = -1) {
  require_act(x, op, "x");
  HLM_CHECK(x.dim() == 3, "{}: x must be [T, n, D], got {}", op, x.describe());
  if (n_expected >= 0)
    HLM_CHECK(x.size(1) == n_expected, "{}: x must have n = {} streams, got {}", op, n_expected,
              x.describe());
  HLM_CHECK(x.size(1) >= 1 && x.size(2) >= 1, "{}: x must have n >= 1 and D >= 1, got {}", op,
            x.describe());
  return {x.size(0), x.size(1), x.size(2)};
}

void check_cfg(const MhcConfig& c, const char* op) {
  HLM_CHECK(c.n >= 1, "{}: cfg.n (hc_mult) must be >= 1, got {}", op, c.n);
  HLM_CHECK(c.sinkhorn_iters >= 1, "{}: cfg.sinkhorn_iters must be >= 1, got {}", op,
            c.sinkhorn_iters);
  HLM_CHECK(c.hc_eps >= 0 && c.norm_eps >= 0, "{}: hc_eps and norm_eps must be >= 0, got {}, {}",
            op, c.hc_eps, c.norm_eps);
}

void check_params(const MhcParams& p, const Dims& d, const MhcConfig& c, const char* op) {
  const int64_t m = c.n_mix();
  require_act(p.fn, op, "params.fn");
  require_act(p.base, op, "params.base");
  require_act(p.scale, op, "params.scale");
  detail::require_shape(p.fn, {m, d.n * d.D}, op, "params.fn");
  detail::require_shape(p.base, {m}, op, "params.base");
  detail::require_shape(p.scale, {3}, op, "params.scale");
}

// acc += g (acc: f32/f64 of g's shape, any strides). Rounding f64(acc) + f64(g) to acc's dtype is
// the correctly rounded sum, the same as adding in acc's dtype.
void accumulate(Tensor& acc, const Tensor& g, const char* op, const char* what) {
  HLM_CHECK(acc.defined(), "{}: gradient accumulator {} is undefined (expected {})", op, what,
            shape_str(g.shape()));
  detail::require_float(acc, op, what);
  detail::require_shape(acc, g.shape(), op, what);
  Tensor a = acc.to(DType::f64);
  Tensor b = g.to(DType::f64);
  double* pa = a.data<double>();
  const double* pb = b.data<double>();
  for (int64_t i = 0; i < a.numel(); ++i) pa[i] += pb[i];
  acc.copy_(a);
}

template <class T>
T sig(T x) {
  return sigmoid_scalar<T>(x);
}

// ---- Sinkhorn, one token -----------------------------------------------------------------------
// Forward; when `hist` is non-null it receives the 2*iters matrices M_0..M_{2 iters - 1}: M_0 =
// softmax (without eps), then the result of each normalisation step (the last one is comb), plus
// the sums used by each step in `sums` [2 iters][n].
template <class T>
void sinkhorn_token(const T* L, T* out, int64_t n, T eps, int64_t iters, std::vector<T>* hist,
                    std::vector<T>* sums) {
  std::vector<T> M(size_t(n * n));
  // softmax over j (row-wise), then + eps
  for (int64_t i = 0; i < n; ++i) {
    T mx = L[i * n];
    for (int64_t j = 1; j < n; ++j) mx = std::max(mx, L[i * n + j]);
    T s = 0;
    for (int64_t j = 0; j < n; ++j) s += (M[size_t(i * n + j)] = std::exp(L[i * n + j] - mx));
    for (int64_t j = 0; j < n; ++j) M[size_t(i * n + j)] /= s;
  }
  if (hist) hist->assign(M.begin(), M.end());  // P (softmax)
  for (auto& v : M) v += eps;
  std::vector<T> s(static_cast<size_t>(n));
  const int64_t steps = 2 * iters - 1;  // col, then (row, col) x (iters - 1)
  for (int64_t st = 0; st < steps; ++st) {
    const bool col = (st % 2) == 0;
    for (int64_t a = 0; a < n; ++a) {
      T acc = 0;
      for (int64_t b = 0; b < n; ++b) acc += col ? M[size_t(b * n + a)] : M[size_t(a * n + b)];
      s[size_t(a)] = acc + eps;
    }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) M[size_t(i * n + j)] /= s[size_t(col ? j : i)];
    if (hist) hist->insert(hist->end(), M.begin(), M.end());
    if (sums) sums->insert(sums->end(), s.begin(), s.end());
  }
  for (int64_t k = 0; k < n * n; ++k) out[k] = M[size_t(k)];
}

template <class T>
void sinkhorn_token_backward(const T* L, const T* dcomb, T* dL, int64_t n, T eps, int64_t iters) {
  std::vector<T> hist, sums;
  std::vector<T> out(size_t(n * n));
  sinkhorn_token<T>(L, out.data(), n, eps, iters, &hist, &sums);
  const int64_t steps = 2 * iters - 1;
  const size_t nn = size_t(n * n);
  std::vector<T> g(dcomb, dcomb + n * n), gp(nn), r(static_cast<size_t>(n));
  // Step st maps M_in -> M_out = hist[st + 1]; M_out = M_in / s, s = sum + eps along rows or cols.
  // dM_in[i][j] = (g[i][j] - sum_k g[i][k] M_out[i][k]) / s_i   (row step; col step transposed)
  for (int64_t st = steps - 1; st >= 0; --st) {
    const bool col = (st % 2) == 0;
    const T* Mo = hist.data() + size_t(st + 1) * nn;
    const T* s = sums.data() + size_t(st) * size_t(n);
    for (int64_t a = 0; a < n; ++a) {
      T acc = 0;
      for (int64_t b = 0; b < n; ++b) {
        const size_t k = size_t(col ? b * n + a : a * n + b);
        acc += g[k] * Mo[k];
      }
      r[size_t(a)] = acc;
    }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) {
        const int64_t a = col ? j : i;
        gp[size_t(i * n + j)] = (g[size_t(i * n + j)] - r[size_t(a)]) / s[size_t(a)];
      }
    g.swap(gp);
  }
  // softmax (the + eps has zero gradient): dL_ij = P_ij (g_ij - sum_k g_ik P_ik)
  const T* P = hist.data();
  for (int64_t i = 0; i < n; ++i) {
    T acc = 0;
    for (int64_t k = 0; k < n; ++k) acc += g[size_t(i * n + k)] * P[i * n + k];
    for (int64_t j = 0; j < n; ++j) dL[i * n + j] = P[i * n + j] * (g[size_t(i * n + j)] - acc);
  }
}

// ---- mappings -----------------------------------------------------------------------------------
template <class T>
MhcMappings mappings_fwd(const Tensor& x_in, const MhcParams& p, const MhcConfig& c,
                         const Dims& d) {
  const DType dt = dtype_of<T>::value;
  Tensor xc = as_dt(x_in, dt), fnc = as_dt(p.fn, dt), bc = as_dt(p.base, dt),
         sc = as_dt(p.scale, dt);
  const T *x = xc.data<T>(), *fn = fnc.data<T>(), *base = bc.data<T>(), *scale = sc.data<T>();
  const int64_t n = d.n, K = d.n * d.D, m = c.n_mix();
  MhcMappings r;
  r.inv_rms = Tensor::empty({d.T}, dt);
  r.mix = Tensor::empty({d.T, m}, dt);
  r.pre = Tensor::empty({d.T, n}, dt);
  r.post = Tensor::empty({d.T, n}, dt);
  r.comb_logits = Tensor::empty({d.T, n, n}, dt);
  r.comb = Tensor::empty({d.T, n, n}, dt);
  T *ir = r.inv_rms.data<T>(), *mix = r.mix.data<T>(), *pre = r.pre.data<T>(),
    *post = r.post.data<T>(), *Lg = r.comb_logits.data<T>(), *cb = r.comb.data<T>();
  const T heps = T(c.hc_eps);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < d.T; ++t) {
    const T* xt = x + t * K;
    T ss = 0;
    for (int64_t k = 0; k < K; ++k) ss += xt[k] * xt[k];
    const T inv = T(1) / std::sqrt(ss / T(K) + T(c.norm_eps));
    ir[t] = inv;
    T* mt = mix + t * m;
    for (int64_t q = 0; q < m; ++q) {
      const T* f = fn + q * K;
      T acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += f[k] * xt[k];
      mt[q] = acc * inv;
    }
    for (int64_t j = 0; j < n; ++j) {
      pre[t * n + j] = sig(mt[j] * scale[0] + base[j]) + heps;
      post[t * n + j] = T(2) * sig(mt[n + j] * scale[1] + base[n + j]);
    }
    for (int64_t q = 0; q < n * n; ++q)
      Lg[t * n * n + q] = mt[2 * n + q] * scale[2] + base[2 * n + q];
    sinkhorn_token<T>(Lg + t * n * n, cb + t * n * n, n, heps, c.sinkhorn_iters, nullptr, nullptr);
  }
  return r;
}

template <class T>
Tensor mappings_bwd(const Tensor& x_in, const MhcParams& p, const MhcConfig& c, const Dims& d,
                    const MhcMappings& mp, const Tensor& dpre_in, const Tensor& dpost_in,
                    const Tensor& dcomb_in, MhcParamGrads& g) {
  const DType dt = dtype_of<T>::value;
  const int64_t n = d.n, K = d.n * d.D, m = c.n_mix(), nn = n * n;
  Tensor xc = as_dt(x_in, dt), fnc = as_dt(p.fn, dt), bc = as_dt(p.base, dt),
         sc = as_dt(p.scale, dt);
  const T *x = xc.data<T>(), *fn = fnc.data<T>(), *base = bc.data<T>(), *scale = sc.data<T>();
  Tensor irc = as_dt(mp.inv_rms, dt), mixc = as_dt(mp.mix, dt), Lc = as_dt(mp.comb_logits, dt);
  const T *ir = irc.data<T>(), *mix = mixc.data<T>(), *Lg = Lc.data<T>();
  Tensor dpre_c = dpre_in.defined() ? as_dt(dpre_in, dt) : Tensor::zeros({d.T, n}, dt);
  Tensor dpost_c = dpost_in.defined() ? as_dt(dpost_in, dt) : Tensor::zeros({d.T, n}, dt);
  Tensor dcomb_c = dcomb_in.defined() ? as_dt(dcomb_in, dt) : Tensor::zeros({d.T, n, n}, dt);
  const T *dpre = dpre_c.data<T>(), *dpost = dpost_c.data<T>(), *dcomb = dcomb_c.data<T>();

  // Per token: da [m] (gradient of the pre-activation h = mix * scale + base), dp [m] (gradient
  // of the projection fn @ flat), and dx.
  Tensor da_t = Tensor::empty({d.T, m}, dt), dp_t = Tensor::empty({d.T, m}, dt);
  T *da = da_t.data<T>(), *dp = dp_t.data<T>();
  Tensor dx = Tensor::empty({d.T, n, d.D}, dt);
  T* dxp = dx.data<T>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < d.T; ++t) {
    const T* mt = mix + t * m;
    T* at = da + t * m;
    for (int64_t j = 0; j < n; ++j) {
      const T ap = mt[j] * scale[0] + base[j];
      at[j] = dpre[t * n + j] * sig(ap) * sig(-ap);
      const T aq = mt[n + j] * scale[1] + base[n + j];
      at[n + j] = dpost[t * n + j] * T(2) * sig(aq) * sig(-aq);
    }
    sinkhorn_token_backward<T>(Lg + t * nn, dcomb + t * nn, at + 2 * n, n, T(c.hc_eps),
                               c.sinkhorn_iters);
    // dmix = da * scale_group; dp = dmix * inv_rms; d inv_rms = sum_q dmix_q * proj_q, with
    // proj_q = mix_q / inv_rms.
    const T inv = ir[t];
    T dinv = 0;
    T* pt = dp + t * m;
    for (int64_t q = 0; q < m; ++q) {
      const T sgrp = scale[q < n ? 0 : (q < 2 * n ? 1 : 2)];
      const T dmix = at[q] * sgrp;
      pt[q] = dmix * inv;
      dinv += dmix * (mt[q] / inv);
    }
    // dx_k = sum_q dp_q fn[q][k] + dinv * (-inv^3 x_k / K)
    const T* xt = x + t * K;
    T* dxt = dxp + t * K;
    const T coef = -dinv * inv * inv * inv / T(K);
    for (int64_t k = 0; k < K; ++k) dxt[k] = coef * xt[k];
    for (int64_t q = 0; q < m; ++q) {
      const T* f = fn + q * K;
      const T w = pt[q];
      for (int64_t k = 0; k < K; ++k) dxt[k] += w * f[k];
    }
  }
  // Parameter gradients, reduced over tokens in token order.
  Tensor dfn = Tensor::empty({m, K}, dt), dbase = Tensor::empty({m}, dt),
         dscale = Tensor::empty({3}, dt);
  T *dfp = dfn.data<T>(), *dbp = dbase.data<T>(), *dsp = dscale.data<T>();
#pragma omp parallel for schedule(static)
  for (int64_t q = 0; q < m; ++q) {
    T* row = dfp + q * K;
    for (int64_t k = 0; k < K; ++k) row[k] = 0;
    for (int64_t t = 0; t < d.T; ++t) {
      const T w = dp[t * m + q];
      const T* xt = x + t * K;
      for (int64_t k = 0; k < K; ++k) row[k] += w * xt[k];
    }
  }
  for (int64_t q = 0; q < m; ++q) {
    T s = 0;
    for (int64_t t = 0; t < d.T; ++t) s += da[t * m + q];
    dbp[q] = s;
  }
  for (int64_t gi = 0; gi < 3; ++gi) {
    const int64_t q0 = gi == 0 ? 0 : (gi == 1 ? n : 2 * n),
                  q1 = gi == 0 ? n : (gi == 1 ? 2 * n : m);
    T s = 0;
    for (int64_t t = 0; t < d.T; ++t)
      for (int64_t q = q0; q < q1; ++q) s += da[t * m + q] * mix[t * m + q];
    dsp[gi] = s;
  }
  accumulate(g.dfn, dfn, "mhc_mappings_backward", "grads.dfn");
  accumulate(g.dbase, dbase, "mhc_mappings_backward", "grads.dbase");
  accumulate(g.dscale, dscale, "mhc_mappings_backward", "grads.dscale");
  return dx;
}

void check_maps(const MhcMappings& m, const Dims& d, const char* op) {
  const int64_t n = d.n;
  for (auto [t, name] : {std::pair{&m.inv_rms, "maps.inv_rms"},
                         {&m.mix, "maps.mix"},
                         {&m.comb_logits, "maps.comb_logits"}})
    detail::require_float(*t, op, name);
  detail::require_shape(m.inv_rms, {d.T}, op, "maps.inv_rms");
  detail::require_shape(m.mix, {d.T, (2 + n) * n}, op, "maps.mix");
  detail::require_shape(m.comb_logits, {d.T, n, n}, op, "maps.comb_logits");
}

void check_opt(const Tensor& t, const Shape& s, const char* op, const char* what) {
  if (!t.defined()) return;
  detail::require_float(t, op, what);
  detail::require_shape(t, s, op, what);
}

}  // namespace

// ---- public: pieces
// ------------------------------------------------------------------------------

MhcMappings mhc_mappings_forward(const Tensor& x, const MhcParams& p, const MhcConfig& c) {
  const char* op = "mhc_mappings_forward";
  check_cfg(c, op);
  const Dims d = check_streams(x, op, c.n);
  check_params(p, d, c, op);
  return comp_dtype(x) == DType::f64 ? mappings_fwd<double>(x, p, c, d)
                                     : mappings_fwd<float>(x, p, c, d);
}

Tensor mhc_mappings_backward(const Tensor& x, const MhcParams& p, const MhcConfig& c,
                             const MhcMappings& m, const Tensor& dpre, const Tensor& dpost,
                             const Tensor& dcomb, MhcParamGrads& g) {
  const char* op = "mhc_mappings_backward";
  check_cfg(c, op);
  const Dims d = check_streams(x, op, c.n);
  check_params(p, d, c, op);
  check_maps(m, d, op);
  check_opt(dpre, {d.T, d.n}, op, "dpre");
  check_opt(dpost, {d.T, d.n}, op, "dpost");
  check_opt(dcomb, {d.T, d.n, d.n}, op, "dcomb");
  return comp_dtype(x) == DType::f64 ? mappings_bwd<double>(x, p, c, d, m, dpre, dpost, dcomb, g)
                                     : mappings_bwd<float>(x, p, c, d, m, dpre, dpost, dcomb, g);
}

namespace {
template <class T>
Tensor inv_rms_fwd(const Tensor& x_in, double eps, const Dims& d) {
  Tensor xc = as_dt(x_in, dtype_of<T>::value);
  const T* x = xc.data<T>();
  const int64_t K = d.n * d.D;
  Tensor r = Tensor::empty({d.T}, dtype_of<T>::value);
  T* o = r.data<T>();
  for (int64_t t = 0; t < d.T; ++t) {
    T ss = 0;
    for (int64_t k = 0; k < K; ++k) ss += x[t * K + k] * x[t * K + k];
    o[t] = T(1) / std::sqrt(ss / T(K) + T(eps));
  }
  return r;
}
template <class T>
Tensor inv_rms_bwd(const Tensor& x_in, const Tensor& ir_in, const Tensor& dir_in, const Dims& d) {
  const DType dt = dtype_of<T>::value;
  Tensor xc = as_dt(x_in, dt), irc = as_dt(ir_in, dt), dc = as_dt(dir_in, dt);
  const T *x = xc.data<T>(), *ir = irc.data<T>(), *di = dc.data<T>();
  const int64_t K = d.n * d.D;
  Tensor dx = Tensor::empty({d.T, d.n, d.D}, dt);
  T* o = dx.data<T>();
  for (int64_t t = 0; t < d.T; ++t) {
    const T c = -di[t] * ir[t] * ir[t] * ir[t] / T(K);
    for (int64_t k = 0; k < K; ++k) o[t * K + k] = c * x[t * K + k];
  }
  return dx;
}
}  // namespace

Tensor mhc_inv_rms(const Tensor& x, double eps) {
  const Dims d = check_streams(x, "mhc_inv_rms");
  return comp_dtype(x) == DType::f64 ? inv_rms_fwd<double>(x, eps, d)
                                     : inv_rms_fwd<float>(x, eps, d);
}

Tensor mhc_inv_rms_backward(const Tensor& x, const Tensor& inv_rms, const Tensor& d_inv_rms) {
  const char* op = "mhc_inv_rms_backward";
  const Dims d = check_streams(x, op);
  detail::require_float(inv_rms, op, "inv_rms");
  detail::require_shape(inv_rms, {d.T}, op, "inv_rms");
  detail::require_float(d_inv_rms, op, "d_inv_rms");
  detail::require_shape(d_inv_rms, {d.T}, op, "d_inv_rms");
  return comp_dtype(x) == DType::f64 ? inv_rms_bwd<double>(x, inv_rms, d_inv_rms, d)
                                     : inv_rms_bwd<float>(x, inv_rms, d_inv_rms, d);
}

namespace {
void check_logits(const Tensor& L, const char* op, const char* what, int64_t iters) {
  require_act(L, op, what);
  HLM_CHECK(L.dim() == 3 && L.size(1) == L.size(2) && L.size(1) >= 1,
            "{}: {} must be [T, n, n] with n >= 1, got {}", op, what, L.describe());
  HLM_CHECK(iters >= 1, "{}: iters must be >= 1, got {}", op, iters);
}
template <class T>
Tensor sinkhorn_fwd(const Tensor& L_in, double eps, int64_t iters) {
  Tensor Lc = as_dt(L_in, dtype_of<T>::value);
  const int64_t Tn = Lc.size(0), n = Lc.size(1);
  Tensor out = Tensor::empty({Tn, n, n}, dtype_of<T>::value);
  const T* L = Lc.data<T>();
  T* o = out.data<T>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < Tn; ++t)
    sinkhorn_token<T>(L + t * n * n, o + t * n * n, n, T(eps), iters, nullptr, nullptr);
  return out;
}
template <class T>
Tensor sinkhorn_bwd(const Tensor& L_in, const Tensor& g_in, double eps, int64_t iters) {
  const DType dt = dtype_of<T>::value;
  Tensor Lc = as_dt(L_in, dt), gc = as_dt(g_in, dt);
  const int64_t Tn = Lc.size(0), n = Lc.size(1);
  Tensor out = Tensor::empty({Tn, n, n}, dt);
  const T *L = Lc.data<T>(), *g = gc.data<T>();
  T* o = out.data<T>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < Tn; ++t)
    sinkhorn_token_backward<T>(L + t * n * n, g + t * n * n, o + t * n * n, n, T(eps), iters);
  return out;
}
}  // namespace

Tensor mhc_sinkhorn(const Tensor& logits, double hc_eps, int64_t iters) {
  check_logits(logits, "mhc_sinkhorn", "logits", iters);
  return comp_dtype(logits) == DType::f64 ? sinkhorn_fwd<double>(logits, hc_eps, iters)
                                          : sinkhorn_fwd<float>(logits, hc_eps, iters);
}

Tensor mhc_sinkhorn_backward(const Tensor& logits, const Tensor& dcomb, double hc_eps,
                             int64_t iters) {
  const char* op = "mhc_sinkhorn_backward";
  check_logits(logits, op, "logits", iters);
  require_act(dcomb, op, "dcomb");
  detail::require_shape(dcomb, logits.shape(), op, "dcomb");
  return comp_dtype(logits) == DType::f64 ? sinkhorn_bwd<double>(logits, dcomb, hc_eps, iters)
                                          : sinkhorn_bwd<float>(logits, dcomb, hc_eps, iters);
}

// ---- collapse / write-back ---------------------------------------------------------------------
namespace {
template <class T>
Tensor collapse_fwd(const Tensor& x_in, const Tensor& pre_in, const Dims& d) {
  const DType dt = dtype_of<T>::value;
  Tensor xc = as_dt(x_in, dt), pc = as_dt(pre_in, dt);
  const T *x = xc.data<T>(), *pre = pc.data<T>();
  Tensor u = Tensor::empty({d.T, d.D}, dt);
  T* o = u.data<T>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < d.T; ++t)
    for (int64_t e = 0; e < d.D; ++e) {
      T s = 0;
      for (int64_t j = 0; j < d.n; ++j) s += pre[t * d.n + j] * x[(t * d.n + j) * d.D + e];
      o[t * d.D + e] = s;
    }
  return x_in.dtype() == dt ? u : u.to(x_in.dtype());
}
template <class T>
MhcCollapseGrads collapse_bwd(const Tensor& x_in, const Tensor& pre_in, const Tensor& du_in,
                              const Dims& d) {
  const DType dt = dtype_of<T>::value;
  Tensor xc = as_dt(x_in, dt), pc = as_dt(pre_in, dt), dc = as_dt(du_in, dt);
  const T *x = xc.data<T>(), *pre = pc.data<T>(), *du = dc.data<T>();
  MhcCollapseGrads r;
  r.dx = Tensor::empty({d.T, d.n, d.D}, dt);
  r.dpre = Tensor::empty({d.T, d.n}, dt);
  T *dx = r.dx.data<T>(), *dp = r.dpre.data<T>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < d.T; ++t)
    for (int64_t j = 0; j < d.n; ++j) {
      const T* xj = x + (t * d.n + j) * d.D;
      T* dxj = dx + (t * d.n + j) * d.D;
      const T* dut = du + t * d.D;
      T s = 0;
      for (int64_t e = 0; e < d.D; ++e) {
        s += dut[e] * xj[e];
        dxj[e] = pre[t * d.n + j] * dut[e];
      }
      dp[t * d.n + j] = s;
    }
  return r;
}
template <class T>
Tensor write_back_fwd(const Tensor& x_in, const Tensor& y_in, const Tensor& post_in,
                      const Tensor& comb_in, const Dims& d) {
  const DType dt = dtype_of<T>::value;
  Tensor xc = as_dt(x_in, dt), yc = as_dt(y_in, dt), pc = as_dt(post_in, dt),
         cc = as_dt(comb_in, dt);
  const T *x = xc.data<T>(), *y = yc.data<T>(), *post = pc.data<T>(), *comb = cc.data<T>();
  const int64_t n = d.n;
  Tensor out = Tensor::empty({d.T, n, d.D}, dt);
  T* o = out.data<T>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < d.T; ++t)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t e = 0; e < d.D; ++e) {
        T s = post[t * n + i] * y[t * d.D + e];
        for (int64_t j = 0; j < n; ++j) s += comb[(t * n + j) * n + i] * x[(t * n + j) * d.D + e];
        o[(t * n + i) * d.D + e] = s;
      }
  return x_in.dtype() == dt ? out : out.to(x_in.dtype());
}
template <class T>
MhcWriteBackGrads write_back_bwd(const Tensor& x_in, const Tensor& y_in, const Tensor& post_in,
                                 const Tensor& comb_in, const Tensor& g_in, const Dims& d) {
  const DType dt = dtype_of<T>::value;
  Tensor xc = as_dt(x_in, dt), yc = as_dt(y_in, dt), pc = as_dt(post_in, dt),
         cc = as_dt(comb_in, dt), gc = as_dt(g_in, dt);
  const T *x = xc.data<T>(), *y = yc.data<T>(), *post = pc.data<T>(), *comb = cc.data<T>(),
          *g = gc.data<T>();
  const int64_t n = d.n, D = d.D;
  MhcWriteBackGrads r;
  r.dx = Tensor::empty({d.T, n, D}, dt);
  r.dy = Tensor::empty({d.T, D}, dt);
  r.dpost = Tensor::empty({d.T, n}, dt);
  r.dcomb = Tensor::empty({d.T, n, n}, dt);
  T *dx = r.dx.data<T>(), *dy = r.dy.data<T>(), *dpost = r.dpost.data<T>(),
    *dcomb = r.dcomb.data<T>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < d.T; ++t) {
    const T* gt = g + t * n * D;
    for (int64_t e = 0; e < D; ++e) {
      T s = 0;
      for (int64_t i = 0; i < n; ++i) s += post[t * n + i] * gt[i * D + e];
      dy[t * D + e] = s;
    }
    for (int64_t j = 0; j < n; ++j)
      for (int64_t e = 0; e < D; ++e) {
        T s = 0;
        for (int64_t i = 0; i < n; ++i) s += comb[(t * n + j) * n + i] * gt[i * D + e];
        dx[(t * n + j) * D + e] = s;
      }
    for (int64_t i = 0; i < n; ++i) {
      T s = 0;
      for (int64_t e = 0; e < D; ++e) s += gt[i * D + e] * y[t * D + e];
      dpost[t * n + i] = s;
    }
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < n; ++i) {
        T s = 0;
        for (int64_t e = 0; e < D; ++e) s += gt[i * D + e] * x[(t * n + j) * D + e];
        dcomb[(t * n + j) * n + i] = s;
      }
  }
  return r;
}
}  // namespace

Tensor mhc_collapse(const Tensor& x, const Tensor& pre) {
  const char* op = "mhc_collapse";
  const Dims d = check_streams(x, op);
  require_act(pre, op, "pre");
  detail::require_shape(pre, {d.T, d.n}, op, "pre");
  return comp_dtype(x) == DType::f64 ? collapse_fwd<double>(x, pre, d)
                                     : collapse_fwd<float>(x, pre, d);
}

MhcCollapseGrads mhc_collapse_backward(const Tensor& x, const Tensor& pre, const Tensor& du) {
  const char* op = "mhc_collapse_backward";
  const Dims d = check_streams(x, op);
  require_act(pre, op, "pre");
  detail::require_shape(pre, {d.T, d.n}, op, "pre");
  require_act(du, op, "du");
  detail::require_shape(du, {d.T, d.D}, op, "du");
  return comp_dtype(x) == DType::f64 ? collapse_bwd<double>(x, pre, du, d)
                                     : collapse_bwd<float>(x, pre, du, d);
}

namespace {
void check_wb(const Tensor& y, const Tensor& post, const Tensor& comb, const Dims& d,
              const char* op) {
  require_act(y, op, "y");
  detail::require_shape(y, {d.T, d.D}, op, "y");
  require_act(post, op, "post");
  detail::require_shape(post, {d.T, d.n}, op, "post");
  require_act(comb, op, "comb");
  detail::require_shape(comb, {d.T, d.n, d.n}, op, "comb");
}
}  // namespace

Tensor mhc_write_back(const Tensor& x, const Tensor& y, const Tensor& post, const Tensor& comb) {
  const char* op = "mhc_write_back";
  const Dims d = check_streams(x, op);
  check_wb(y, post, comb, d, op);
  return comp_dtype(x) == DType::f64 ? write_back_fwd<double>(x, y, post, comb, d)
                                     : write_back_fwd<float>(x, y, post, comb, d);
}

MhcWriteBackGrads mhc_write_back_backward(const Tensor& x, const Tensor& y, const Tensor& post,
                                          const Tensor& comb, const Tensor& dx_out) {
  const char* op = "mhc_write_back_backward";
  const Dims d = check_streams(x, op);
  check_wb(y, post, comb, d, op);
  require_act(dx_out, op, "dx_out");
  detail::require_shape(dx_out, x.shape(), op, "dx_out");
  return comp_dtype(x) == DType::f64 ? write_back_bwd<double>(x, y, post, comb, dx_out, d)
                                     : write_back_bwd<float>(x, y, post, comb, dx_out, d);
}

// ---- model level -------------------------------------------------------------------------------

Tensor mhc_expand(const Tensor& e, int64_t n) {
  const char* op = "mhc_expand";
  require_act(e, op, "e");
  HLM_CHECK(e.dim() == 2, "{}: e must be [T, D], got {}", op, e.describe());
  HLM_CHECK(n >= 1, "{}: n must be >= 1, got {}", op, n);
  const int64_t T = e.size(0), D = e.size(1);
  Tensor out = Tensor::empty({T, n, D}, e.dtype());
  for (int64_t j = 0; j < n; ++j) {
    Tensor dst = out.select(1, j);
    dst.copy_(e);
  }
  return out;
}

namespace {
template <class T>
Tensor stream_sum(const Tensor& x_in, T scale) {
  const DType dt = dtype_of<T>::value;
  Tensor xc = as_dt(x_in, dt);
  const int64_t Tn = xc.size(0), n = xc.size(1), D = xc.size(2);
  const T* x = xc.data<T>();
  Tensor out = Tensor::empty({Tn, D}, dt);
  T* o = out.data<T>();
  for (int64_t t = 0; t < Tn; ++t)
    for (int64_t e = 0; e < D; ++e) {
      T s = 0;
      for (int64_t j = 0; j < n; ++j) s += x[(t * n + j) * D + e];
      o[t * D + e] = s * scale;
    }
  return x_in.dtype() == dt ? out : out.to(x_in.dtype());
}
}  // namespace

Tensor mhc_expand_backward(const Tensor& dx) {
  check_streams(dx, "mhc_expand_backward");
  return comp_dtype(dx) == DType::f64 ? stream_sum<double>(dx, 1.0) : stream_sum<float>(dx, 1.0f);
}

Tensor mhc_mean_contract(const Tensor& x) {
  const Dims d = check_streams(x, "mhc_mean_contract");
  return comp_dtype(x) == DType::f64 ? stream_sum<double>(x, 1.0 / double(d.n))
                                     : stream_sum<float>(x, 1.0f / float(d.n));
}

Tensor mhc_mean_contract_backward(const Tensor& dh, int64_t n) {
  const char* op = "mhc_mean_contract_backward";
  require_act(dh, op, "dh");
  HLM_CHECK(dh.dim() == 2, "{}: dh must be [T, D], got {}", op, dh.describe());
  HLM_CHECK(n >= 1, "{}: n must be >= 1, got {}", op, n);
  const DType dt = comp_dtype(dh);
  Tensor scaled = as_dt(dh, dt).clone();
  if (dt == DType::f64) {
    double* p = scaled.data<double>();
    for (int64_t i = 0; i < scaled.numel(); ++i) p[i] /= double(n);
  } else {
    float* p = scaled.data<float>();
    for (int64_t i = 0; i < scaled.numel(); ++i) p[i] /= float(n);
  }
  Tensor out = mhc_expand(scaled, n);
  return dh.dtype() == dt ? out : out.to(dh.dtype());
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
  const Dims d = check_streams(s.x, op);
  require_act(dx_out, op, "dx_out");
  detail::require_shape(dx_out, s.x.shape(), op, "dx_out");
  // dy = sum_i post_i dX'_i, the same order as mhc_write_back_backward.
  const DType dt = comp_dtype(s.x);
  Tensor pc = as_dt(s.maps.post, dt), gc = as_dt(dx_out, dt);
  Tensor dy = Tensor::empty({d.T, d.D}, dt);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T *post = pc.data<T>(), *g = gc.data<T>();
    T* o = dy.data<T>();
    for (int64_t t = 0; t < d.T; ++t)
      for (int64_t e = 0; e < d.D; ++e) {
        T acc = 0;
        for (int64_t i = 0; i < d.n; ++i) acc += post[t * d.n + i] * g[(t * d.n + i) * d.D + e];
        o[t * d.D + e] = acc;
      }
  };
  if (dt == DType::f64)
    run(double{});
  else
    run(float{});
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
  const int64_t N = dx.numel();
  if (dx.dtype() == DType::f64) {
    double* a = dx.data<double>();
    const double *b = cl.dx.data<double>(), *c = dmap.data<double>();
    for (int64_t i = 0; i < N; ++i) a[i] = (a[i] + b[i]) + c[i];
  } else {
    float* a = dx.data<float>();
    const float *b = cl.dx.data<float>(), *c = dmap.data<float>();
    for (int64_t i = 0; i < N; ++i) a[i] = (a[i] + b[i]) + c[i];
  }
  return dx;
}

}  // namespace hlm::ops
