// mHC on the CPU (ops/mhc.h, the reference; entry points in ops/cpu/mhc.h; docs/mhc_moe.md, "mHC").
// One token at a time, every sum in a fixed order; parameter gradients reduce over tokens in token
// order. Activation gradients are written (=), parameter gradients accumulate (+=).
#include "ops/cpu/mhc.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/activations.h"
#include "ops/op_checks.h"

namespace hlm::ops::cpu {
namespace {

// `t` as a contiguous tensor of dtype dt (no copy when it already is one).
Tensor as_dt(const Tensor& t, DType dt) {
  return t.dtype() == dt ? t.contiguous() : t.to(dt);
}

// x [T, n, D]; returns (T, n, D).
struct Dims {
  int64_t T, n, D;
};
Dims dims_of(const Tensor& x) {
  return {x.size(0), x.size(1), x.size(2)};
}

// Where a result of dtype dt is computed: `out` itself when it has that dtype, else a temporary
// that finish() rounds into `out` (one conversion per element, as Tensor::to does).
struct ResultIn {
  Tensor& out;
  Tensor t;
  ResultIn(Tensor& o, DType dt) : out(o), t(o.dtype() == dt ? o : Tensor::empty(o.shape(), dt)) {}
  void finish() {
    if (out.dtype() != t.dtype()) out.copy_(t);
  }
};
// acc += g (acc: f32/f64 of g's shape, any strides). Rounding f64(acc) + f64(g) to acc's dtype is
// the correctly rounded sum, the same as adding in acc's dtype.
void accumulate(Tensor& acc, const Tensor& g) {
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
void mappings_fwd(const Tensor& x_in, const MhcParams& p, const MhcConfig& c, const Dims& d,
                  MhcMappings& r) {
  const DType dt = dtype_of<T>::value;
  Tensor xc = as_dt(x_in, dt), fnc = as_dt(p.fn, dt), bc = as_dt(p.base, dt),
         sc = as_dt(p.scale, dt);
  const T *x = xc.data<T>(), *fn = fnc.data<T>(), *base = bc.data<T>(), *scale = sc.data<T>();
  const int64_t n = d.n, K = d.n * d.D, m = c.n_mix();
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
}

template <class T>
void mappings_bwd(const Tensor& x_in, const MhcParams& p, const MhcConfig& c, const Dims& d,
                  const MhcMappings& mp, const Tensor& dpre_in, const Tensor& dpost_in,
                  const Tensor& dcomb_in, MhcParamGrads& g, Tensor& dx) {
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
  accumulate(g.dfn, dfn);
  accumulate(g.dbase, dbase);
  accumulate(g.dscale, dscale);
}

}  // namespace

void mhc_mappings_forward(const Tensor& x, const MhcParams& p, const MhcConfig& c, MhcMappings& m) {
  detail::dispatch_float(m.mix.dtype(),
                         [&](auto tag) { mappings_fwd<decltype(tag)>(x, p, c, dims_of(x), m); });
}

void mhc_mappings_backward(const Tensor& x, const MhcParams& p, const MhcConfig& c,
                           const MhcMappings& m, const Tensor& dpre, const Tensor& dpost,
                           const Tensor& dcomb, MhcParamGrads& g, Tensor& dx) {
  detail::dispatch_float(dx.dtype(), [&](auto tag) {
    mappings_bwd<decltype(tag)>(x, p, c, dims_of(x), m, dpre, dpost, dcomb, g, dx);
  });
}

namespace {
template <class T>
void inv_rms_fwd(const Tensor& x_in, double eps, const Dims& d, Tensor& r) {
  Tensor xc = as_dt(x_in, dtype_of<T>::value);
  const T* x = xc.data<T>();
  const int64_t K = d.n * d.D;
  T* o = r.data<T>();
  for (int64_t t = 0; t < d.T; ++t) {
    T ss = 0;
    for (int64_t k = 0; k < K; ++k) ss += x[t * K + k] * x[t * K + k];
    o[t] = T(1) / std::sqrt(ss / T(K) + T(eps));
  }
}
template <class T>
void inv_rms_bwd(const Tensor& x_in, const Tensor& ir_in, const Tensor& dir_in, const Dims& d,
                 Tensor& dx) {
  const DType dt = dtype_of<T>::value;
  Tensor xc = as_dt(x_in, dt), irc = as_dt(ir_in, dt), dc = as_dt(dir_in, dt);
  const T *x = xc.data<T>(), *ir = irc.data<T>(), *di = dc.data<T>();
  const int64_t K = d.n * d.D;
  T* o = dx.data<T>();
  for (int64_t t = 0; t < d.T; ++t) {
    const T c = -di[t] * ir[t] * ir[t] * ir[t] / T(K);
    for (int64_t k = 0; k < K; ++k) o[t * K + k] = c * x[t * K + k];
  }
}
}  // namespace

void mhc_inv_rms(const Tensor& x, double eps, Tensor& inv_rms) {
  detail::dispatch_float(
      inv_rms.dtype(), [&](auto tag) { inv_rms_fwd<decltype(tag)>(x, eps, dims_of(x), inv_rms); });
}

void mhc_inv_rms_backward(const Tensor& x, const Tensor& inv_rms, const Tensor& d_inv_rms,
                          Tensor& dx) {
  detail::dispatch_float(dx.dtype(), [&](auto tag) {
    inv_rms_bwd<decltype(tag)>(x, inv_rms, d_inv_rms, dims_of(x), dx);
  });
}

namespace {
template <class T>
void sinkhorn_fwd(const Tensor& L_in, double eps, int64_t iters, Tensor& out) {
  Tensor Lc = as_dt(L_in, dtype_of<T>::value);
  const int64_t Tn = Lc.size(0), n = Lc.size(1);
  const T* L = Lc.data<T>();
  T* o = out.data<T>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < Tn; ++t)
    sinkhorn_token<T>(L + t * n * n, o + t * n * n, n, T(eps), iters, nullptr, nullptr);
}
template <class T>
void sinkhorn_bwd(const Tensor& L_in, const Tensor& g_in, double eps, int64_t iters, Tensor& out) {
  const DType dt = dtype_of<T>::value;
  Tensor Lc = as_dt(L_in, dt), gc = as_dt(g_in, dt);
  const int64_t Tn = Lc.size(0), n = Lc.size(1);
  const T *L = Lc.data<T>(), *g = gc.data<T>();
  T* o = out.data<T>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < Tn; ++t)
    sinkhorn_token_backward<T>(L + t * n * n, g + t * n * n, o + t * n * n, n, T(eps), iters);
}
}  // namespace

void mhc_sinkhorn(const Tensor& logits, double hc_eps, int64_t iters, Tensor& comb) {
  detail::dispatch_float(
      comb.dtype(), [&](auto tag) { sinkhorn_fwd<decltype(tag)>(logits, hc_eps, iters, comb); });
}

void mhc_sinkhorn_backward(const Tensor& logits, const Tensor& dcomb, double hc_eps, int64_t iters,
                           Tensor& dlogits) {
  detail::dispatch_float(dlogits.dtype(), [&](auto tag) {
    sinkhorn_bwd<decltype(tag)>(logits, dcomb, hc_eps, iters, dlogits);
  });
}

// ---- collapse / write-back ---------------------------------------------------------------------
namespace {
// sum_i a[i * sa] * b[i * sb] over i = 0 .. n-1, in that order.
template <class T>
T dot_strided(const T* a, int64_t sa, const T* b, int64_t sb, int64_t n) {
  T s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i * sa] * b[i * sb];
  return s;
}
template <class T>
void collapse_fwd(const Tensor& x_in, const Tensor& pre_in, const Dims& d, Tensor& u_out) {
  const DType dt = dtype_of<T>::value;
  Tensor xc = as_dt(x_in, dt), pc = as_dt(pre_in, dt);
  const T *x = xc.data<T>(), *pre = pc.data<T>();
  ResultIn u(u_out, dt);
  T* o = u.t.data<T>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < d.T; ++t)
    for (int64_t e = 0; e < d.D; ++e) {
      T s = 0;
      for (int64_t j = 0; j < d.n; ++j) s += pre[t * d.n + j] * x[(t * d.n + j) * d.D + e];
      o[t * d.D + e] = s;
    }
  u.finish();
}
template <class T>
void collapse_bwd(const Tensor& x_in, const Tensor& pre_in, const Tensor& du_in, const Dims& d,
                  MhcCollapseGrads& r) {
  const DType dt = dtype_of<T>::value;
  Tensor xc = as_dt(x_in, dt), pc = as_dt(pre_in, dt), dc = as_dt(du_in, dt);
  const T *x = xc.data<T>(), *pre = pc.data<T>(), *du = dc.data<T>();
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
}
template <class T>
void write_back_fwd(const Tensor& x_in, const Tensor& y_in, const Tensor& post_in,
                    const Tensor& comb_in, const Dims& d, Tensor& out_t) {
  const DType dt = dtype_of<T>::value;
  Tensor xc = as_dt(x_in, dt), yc = as_dt(y_in, dt), pc = as_dt(post_in, dt),
         cc = as_dt(comb_in, dt);
  const T *x = xc.data<T>(), *y = yc.data<T>(), *post = pc.data<T>(), *comb = cc.data<T>();
  const int64_t n = d.n;
  ResultIn out(out_t, dt);
  T* o = out.t.data<T>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < d.T; ++t)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t e = 0; e < d.D; ++e) {
        T s = post[t * n + i] * y[t * d.D + e];
        for (int64_t j = 0; j < n; ++j) s += comb[(t * n + j) * n + i] * x[(t * n + j) * d.D + e];
        o[(t * n + i) * d.D + e] = s;
      }
  out.finish();
}
template <class T>
void write_back_bwd(const Tensor& x_in, const Tensor& y_in, const Tensor& post_in,
                    const Tensor& comb_in, const Tensor& g_in, const Dims& d,
                    MhcWriteBackGrads& r) {
  const DType dt = dtype_of<T>::value;
  Tensor xc = as_dt(x_in, dt), yc = as_dt(y_in, dt), pc = as_dt(post_in, dt),
         cc = as_dt(comb_in, dt), gc = as_dt(g_in, dt);
  const T *x = xc.data<T>(), *y = yc.data<T>(), *post = pc.data<T>(), *comb = cc.data<T>(),
          *g = gc.data<T>();
  const int64_t n = d.n, D = d.D;
  T *dx = r.dx.data<T>(), *dy = r.dy.data<T>(), *dpost = r.dpost.data<T>(),
    *dcomb = r.dcomb.data<T>();
  // Per token, g_t [n, D]: dy = post^T g_t; dx_j = sum_i comb[j, i] g_t[i]; dpost_i = <g_t[i], y>;
  // dcomb[j, i] = <g_t[i], x_j>.
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < d.T; ++t) {
    const T* gt = g + t * n * D;
    for (int64_t e = 0; e < D; ++e) dy[t * D + e] = dot_strided(post + t * n, 1, gt + e, D, n);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t e = 0; e < D; ++e)
        dx[(t * n + j) * D + e] = dot_strided(comb + (t * n + j) * n, 1, gt + e, D, n);
    for (int64_t i = 0; i < n; ++i) dpost[t * n + i] = dot_strided(gt + i * D, 1, y + t * D, 1, D);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < n; ++i)
        dcomb[(t * n + j) * n + i] = dot_strided(gt + i * D, 1, x + (t * n + j) * D, 1, D);
  }
}
}  // namespace

void mhc_collapse(const Tensor& x, const Tensor& pre, Tensor& u) {
  detail::dispatch_float(detail::compute_dtype(x.dtype()),
                         [&](auto tag) { collapse_fwd<decltype(tag)>(x, pre, dims_of(x), u); });
}

void mhc_collapse_backward(const Tensor& x, const Tensor& pre, const Tensor& du,
                           MhcCollapseGrads& r) {
  detail::dispatch_float(r.dx.dtype(),
                         [&](auto tag) { collapse_bwd<decltype(tag)>(x, pre, du, dims_of(x), r); });
}

void mhc_write_back(const Tensor& x, const Tensor& y, const Tensor& post, const Tensor& comb,
                    Tensor& out) {
  detail::dispatch_float(detail::compute_dtype(x.dtype()), [&](auto tag) {
    write_back_fwd<decltype(tag)>(x, y, post, comb, dims_of(x), out);
  });
}

void mhc_write_back_backward(const Tensor& x, const Tensor& y, const Tensor& post,
                             const Tensor& comb, const Tensor& dx_out, MhcWriteBackGrads& r) {
  detail::dispatch_float(r.dx.dtype(), [&](auto tag) {
    write_back_bwd<decltype(tag)>(x, y, post, comb, dx_out, dims_of(x), r);
  });
}

// ---- model level -------------------------------------------------------------------------------

void mhc_expand(const Tensor& e, Tensor& out) {
  for (int64_t j = 0; j < out.size(1); ++j) {
    Tensor dst = out.select(1, j);
    dst.copy_(e);
  }
}

namespace {
template <class T>
void stream_sum(const Tensor& x_in, T scale, Tensor& out_t) {
  const DType dt = dtype_of<T>::value;
  Tensor xc = as_dt(x_in, dt);
  const int64_t Tn = xc.size(0), n = xc.size(1), D = xc.size(2);
  const T* x = xc.data<T>();
  ResultIn out(out_t, dt);
  T* o = out.t.data<T>();
  for (int64_t t = 0; t < Tn; ++t)
    for (int64_t e = 0; e < D; ++e) {
      T s = 0;
      for (int64_t j = 0; j < n; ++j) s += x[(t * n + j) * D + e];
      o[t * D + e] = s * scale;
    }
  out.finish();
}
}  // namespace

void mhc_stream_sum(const Tensor& x, int64_t divisor, Tensor& out) {
  detail::dispatch_float(detail::compute_dtype(x.dtype()), [&](auto tag) {
    using T = decltype(tag);
    stream_sum<T>(x, T(1) / T(divisor), out);
  });
}

void mhc_mean_contract_backward(const Tensor& dh, Tensor& dx) {
  const int64_t n = dx.size(1);
  const DType dt = detail::compute_dtype(dh.dtype());
  Tensor scaled = as_dt(dh, dt).clone();
  if (dt == DType::f64) {
    double* p = scaled.data<double>();
    for (int64_t i = 0; i < scaled.numel(); ++i) p[i] /= double(n);
  } else {
    float* p = scaled.data<float>();
    for (int64_t i = 0; i < scaled.numel(); ++i) p[i] /= float(n);
  }
  mhc_expand(scaled, dx);
}

void mhc_post_sum(const Tensor& post, const Tensor& dx_out, Tensor& dy) {
  const DType dt = dy.dtype();
  const int64_t T_ = dx_out.size(0), n = dx_out.size(1), D = dx_out.size(2);
  Tensor pc = as_dt(post, dt), gc = as_dt(dx_out, dt);
  detail::dispatch_float(dt, [&](auto tag) {
    using T = decltype(tag);
    const T *p = pc.data<T>(), *g = gc.data<T>();
    T* o = dy.data<T>();
    for (int64_t t = 0; t < T_; ++t)
      for (int64_t e = 0; e < D; ++e) {
        T acc = 0;
        for (int64_t i = 0; i < n; ++i) acc += p[t * n + i] * g[(t * n + i) * D + e];
        o[t * D + e] = acc;
      }
  });
}

void mhc_add3_(Tensor& dx, const Tensor& b_t, const Tensor& c_t) {
  const int64_t N = dx.numel();
  detail::dispatch_float(dx.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* a = dx.data<T>();
    const T *b = b_t.data<T>(), *c = c_t.data<T>();
    for (int64_t i = 0; i < N; ++i) a[i] = (a[i] + b[i]) + c[i];
  });
}

}  // namespace hlm::ops::cpu
