// The MoE router, load balancing and experts on the CPU (ops/moe.h, the reference; entry points in
// ops/cpu/moe.h; docs/mhc_moe.md, "MoE"). Activation gradients are written (=), parameter gradients
// accumulate (+=). Per-expert work goes through ops::gemm on the rows routed to that expert
// (gathered in ascending token order); every combine and scatter-add runs in a fixed order (k
// ascending per token, then the shared expert).
#include "ops/cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "core/formats.h"
#include "ops/activations.h"
#include "ops/gemm.h"
#include "ops/op_checks.h"

namespace hlm::ops::cpu {
namespace {

Tensor as_dt(const Tensor& t, DType dt) {
  return t.dtype() == dt ? t.contiguous() : t.to(dt);
}
template <class T>
T sig(T x) {
  return sigmoid_scalar<T>(x);
}

// acc[offset .. offset + g.numel()) += g (acc: contiguous f32/f64; g of the computation dtype T).
template <class T>
void accumulate_at(Tensor& acc, int64_t offset, const Tensor& g) {
  const T* pg = g.data<T>();
  const int64_t n = g.numel();
  if (acc.dtype() == DType::f64) {
    double* p = acc.data<double>() + offset;
    for (int64_t i = 0; i < n; ++i) p[i] = double(p[i] + double(pg[i]));
  } else {
    float* p = acc.data<float>() + offset;
    for (int64_t i = 0; i < n; ++i) p[i] = float(double(p[i]) + double(pg[i]));
  }
}

// ---- router
// ---------------------------------------------------------------------------------------
// Select top-k experts of one token. sel [E]; out idx [K].
template <class T>
void select_token(const T* sel, const MoeRouterConfig& c, int64_t* idx, std::vector<int64_t>& buf) {
  const int64_t E = c.n_experts, G = c.n_group, gs = E / G;
  // (score desc, index asc): the strict weak order used for groups and experts alike.
  auto better = [](T a, int64_t ia, T b, int64_t ib) { return a > b || (a == b && ia < ib); };
  buf.clear();
  if (G > 1) {
    std::vector<T> gscore(static_cast<size_t>(G));
    for (int64_t g = 0; g < G; ++g) {
      // top-2 sum of the group (index order breaks ties; the sum does not depend on it)
      int64_t b1 = g * gs;
      for (int64_t e = g * gs + 1; e < (g + 1) * gs; ++e)
        if (better(sel[e], e, sel[b1], b1)) b1 = e;
      int64_t b2 = -1;
      for (int64_t e = g * gs; e < (g + 1) * gs; ++e)
        if (e != b1 && (b2 < 0 || better(sel[e], e, sel[b2], b2))) b2 = e;
      gscore[size_t(g)] = sel[b1] + sel[b2];
    }
    std::vector<int64_t> gi(static_cast<size_t>(G));
    std::iota(gi.begin(), gi.end(), 0);
    std::sort(gi.begin(), gi.end(), [&](int64_t a, int64_t b) {
      return better(gscore[size_t(a)], a, gscore[size_t(b)], b);
    });
    for (int64_t q = 0; q < c.topk_group; ++q)
      for (int64_t e = gi[size_t(q)] * gs; e < (gi[size_t(q)] + 1) * gs; ++e) buf.push_back(e);
  } else {
    buf.resize(static_cast<size_t>(E));
    std::iota(buf.begin(), buf.end(), 0);
  }
  std::partial_sort(buf.begin(), buf.begin() + c.top_k, buf.end(),
                    [&](int64_t a, int64_t b) { return better(sel[a], a, sel[b], b); });
  for (int64_t k = 0; k < c.top_k; ++k) idx[k] = buf[size_t(k)];
}

template <class T>
void router_fwd(const Tensor& logits_in, const Tensor& bias_in, const MoeRouterConfig& c,
                const std::vector<int64_t>* replay, MoeRouterResult& r) {
  const DType dt = dtype_of<T>::value;
  Tensor lc = as_dt(logits_in, dt);
  Tensor bc = bias_in.defined() ? as_dt(bias_in, dt) : Tensor::zeros({c.n_experts}, dt);
  const T *l = lc.data<T>(), *b = bc.data<T>();
  const int64_t Tn = lc.size(0), E = c.n_experts, K = c.top_k;
  T *s = r.scores.data<T>(), *w = r.topk_weight.data<T>();
  int64_t* idx = r.topk_idx.data<int64_t>();
#pragma omp parallel
  {
    std::vector<T> sel(static_cast<size_t>(E));
    std::vector<int64_t> buf;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < Tn; ++t) {
      T* st = s + t * E;
      for (int64_t e = 0; e < E; ++e) {
        st[e] = sig(l[t * E + e]);
        sel[size_t(e)] = st[e] + b[e];
      }
      int64_t* it = idx + t * K;
      if (replay)
        for (int64_t k = 0; k < K; ++k) it[k] = (*replay)[size_t(t * K + k)];
      else
        select_token<T>(sel.data(), c, it, buf);
      T sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += st[it[k]];
      const T denom = c.norm_topk_prob ? sum + T(c.norm_eps) : T(1);
      for (int64_t k = 0; k < K; ++k) w[t * K + k] = st[it[k]] / denom * T(c.routed_scaling_factor);
    }
  }
}

template <class T>
void router_bwd(const Tensor& logits_in, const std::vector<int64_t>& idx, const MoeRouterConfig& c,
                const Tensor& dw_in, Tensor& dl) {
  const DType dt = dtype_of<T>::value;
  Tensor lc = as_dt(logits_in, dt), dwc = as_dt(dw_in, dt);
  const T *l = lc.data<T>(), *dw = dwc.data<T>();
  const int64_t Tn = lc.size(0), E = c.n_experts, K = c.top_k;
  dl.zero_();
  T* d = dl.data<T>();
  const T scale = T(c.routed_scaling_factor);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < Tn; ++t) {
    const int64_t* it = idx.data() + t * K;
    T sum = 0, gs = 0;
    for (int64_t k = 0; k < K; ++k) {
      const T sk = sig(l[t * E + it[k]]);
      sum += sk;
      gs += scale * dw[t * K + k] * sk;
    }
    const T denom = sum + T(c.norm_eps);
    for (int64_t k = 0; k < K; ++k) {
      const T x = l[t * E + it[k]];
      const T g = scale * dw[t * K + k];
      const T ds = c.norm_topk_prob ? g / denom - gs / (denom * denom) : g;
      d[t * E + it[k]] += ds * sig(x) * sig(-x);
    }
  }
}

}  // namespace

void moe_router_forward(const Tensor& logits, const Tensor& bias, const MoeRouterConfig& cfg,
                        const std::vector<int64_t>* replay, MoeRouterResult& r) {
  if (r.scores.dtype() == DType::f64)
    router_fwd<double>(logits, bias, cfg, replay, r);
  else
    router_fwd<float>(logits, bias, cfg, replay, r);
}

void moe_router_backward(const Tensor& logits, const std::vector<int64_t>& idx,
                         const MoeRouterConfig& cfg, const Tensor& dweight, Tensor& dlogits) {
  if (dlogits.dtype() == DType::f64)
    router_bwd<double>(logits, idx, cfg, dweight, dlogits);
  else
    router_bwd<float>(logits, idx, cfg, dweight, dlogits);
}

void moe_expert_load(const std::vector<int64_t>& idx, Tensor& load) {
  load.zero_();
  int64_t* p = load.data<int64_t>();
  for (int64_t e : idx) ++p[e];
}

void moe_bias_update(Tensor& bias, const Tensor& load, double rate) {
  const std::vector<double> l = load.to_f64_vector();
  std::vector<double> b = bias.to_f64_vector();
  const int64_t E = int64_t(l.size());
  double mean = 0;
  for (double v : l) mean += v;
  mean /= double(E);
  for (int64_t i = 0; i < E; ++i) {
    const double diff = mean - l[size_t(i)];
    const double sg = diff > 0 ? 1.0 : (diff < 0 ? -1.0 : 0.0);
    // Update in the bias's own dtype: b + rate * sign, rounded once.
    b[size_t(i)] = b[size_t(i)] + (bias.dtype() == DType::f32 ? double(float(rate)) : rate) * sg;
  }
  Tensor nb = Tensor::from_values(bias.shape(), b, DType::f64);
  bias.copy_(nb);
}

// ---- sequence-wise aux loss ---------------------------------------------------------------------
namespace {
struct AuxArgs {
  int64_t T, E, K;
  std::vector<int64_t> cu, idx;
  int64_t n_seq = 0;                   // non-empty sequences
  const MoeAuxWhole* whole = nullptr;  // the whole sequences of pieces (context parallel)
};
// The sigmoid scores of one token's logits l[0..E) into s and their sum S, from which the loss
// takes s_e / S. When every logit is so negative that the sum underflows (S below the smallest
// normal number, e.g. all logits < -88 in FP32, where S = 0 and s_e / S = 0 / 0), the scores are
// rescaled instead: s_e = exp(u_e - max_j u_j) with u = log sigmoid(l) = min(l, 0) -
// log1p(exp(-|l|)), the same ratios s_e / S computed without underflow (all logits -inf: the
// uniform limit). Otherwise the plain sum, as before, bit for bit.
template <class T>
T aux_scores(const T* l, int64_t E, T* s) {
  T S = 0;
  for (int64_t e = 0; e < E; ++e) S += (s[e] = sig(l[e]));
  if (S >= std::numeric_limits<T>::min() || std::isnan(S)) return S;
  T m = -std::numeric_limits<T>::infinity();
  for (int64_t e = 0; e < E; ++e) {
    const T x = l[e];
    s[e] = std::min(x, T(0)) - std::log1p(std::exp(-std::fabs(x)));
    m = std::max(m, s[e]);
  }
  S = 0;
  for (int64_t e = 0; e < E; ++e) S += (s[e] = std::isinf(m) ? T(1) : std::exp(s[e] - m));
  return S;
}

// Returns the loss; with dl non-null, also writes dlogits * dloss.
template <class T>
double aux_impl(const Tensor& logits_in, const AuxArgs& a, double coeff, T* dl, double dloss) {
  Tensor lc = as_dt(logits_in, dtype_of<T>::value);
  const T* l = lc.data<T>();
  const int64_t E = a.E, K = a.K;
  T total = 0;
  std::vector<T> f(static_cast<size_t>(E)), P(static_cast<size_t>(E)), s(static_cast<size_t>(E));
  for (size_t q = 0; q + 1 < a.cu.size(); ++q) {
    const int64_t t0 = a.cu[q], t1 = a.cu[q + 1];
    if (t1 == t0) continue;
    // T_s and the counts: the whole sequence's under context parallelism, else this one's.
    const int64_t Ts = a.whole ? a.whole->lengths[q] : t1 - t0;
    std::fill(f.begin(), f.end(), T(0));
    std::fill(P.begin(), P.end(), T(0));
    for (int64_t t = t0; t < t1; ++t) {
      if (!a.whole)
        for (int64_t k = 0; k < K; ++k) f[size_t(a.idx[size_t(t * K + k)])] += T(1);
      const T S = aux_scores(l + t * E, E, s.data());
      for (int64_t e = 0; e < E; ++e) P[size_t(e)] += s[size_t(e)] / S;
    }
    if (a.whole)
      for (int64_t e = 0; e < E; ++e) f[size_t(e)] = T(a.whole->counts[size_t(int64_t(q) * E + e)]);
    const T fscale = T(E) / (T(K) * T(Ts));
    T Ls = 0;
    for (int64_t e = 0; e < E; ++e) {
      f[size_t(e)] *= fscale;
      P[size_t(e)] /= T(Ts);
      Ls += f[size_t(e)] * P[size_t(e)];
    }
    total += T(coeff) * Ls;
    if (dl) {
      // dL/ds_{e,t} = coeff / (N T_s S_t) (f_e - sum_i f_i s'_{i,t}); then * sigmoid'.
      const T base = T(dloss) * T(coeff) / (T(a.n_seq) * T(Ts));
      for (int64_t t = t0; t < t1; ++t) {
        const T S = aux_scores(l + t * E, E, s.data());
        T fs = 0;
        for (int64_t e = 0; e < E; ++e) fs += f[size_t(e)] * s[size_t(e)] / S;
        for (int64_t e = 0; e < E; ++e) {
          const T x = l[t * E + e];
          // s_e / S = s'_{e,t}; s_e is sigmoid(x) itself unless aux_scores rescaled it.
          dl[t * E + e] = base / S * (f[size_t(e)] - fs) * s[size_t(e)] * sig(-x);
        }
      }
    }
  }
  return a.n_seq > 0 ? double(total) / double(a.n_seq) : 0.0;
}
}  // namespace

double moe_seq_aux_loss(const Tensor& logits, const std::vector<int64_t>& idx, int64_t K,
                        const std::vector<int64_t>& cu, double coeff, double dloss, Tensor* dlogits,
                        const MoeAuxWhole* whole) {
  AuxArgs a;
  a.whole = whole;
  a.T = logits.size(0);
  a.E = logits.size(1);
  a.K = K;
  a.cu = cu;
  a.idx = idx;
  for (size_t s = 0; s + 1 < a.cu.size(); ++s) a.n_seq += a.cu[s + 1] > a.cu[s] ? 1 : 0;
  if (dlogits) dlogits->zero_();
  if (detail::compute_dtype(logits.dtype()) == DType::f64)
    return aux_impl<double>(logits, a, coeff, dlogits ? dlogits->data<double>() : nullptr, dloss);
  return aux_impl<float>(logits, a, coeff, dlogits ? dlogits->data<float>() : nullptr, dloss);
}

// ---- clamped SwiGLU -----------------------------------------------------------------------------
namespace {
bool clamps(double limit) {
  return limit > 0 && std::isfinite(limit);
}
template <class T>
void swiglu_rows(const T* gu, T* h, int64_t rows, int64_t I, double limit) {
  const bool c = clamps(limit);
  const T lim = T(limit);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < I; ++i) {
      T g = gu[r * 2 * I + i], u = gu[r * 2 * I + I + i];
      if (c) g = std::min(g, lim), u = std::clamp(u, -lim, lim);
      h[r * I + i] = g * sig(g) * u;
    }
}
template <class T>
void swiglu_rows_bwd(const T* gu, const T* dh, T* dgu, int64_t rows, int64_t I, double limit) {
  const bool c = clamps(limit);
  const T lim = T(limit);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < I; ++i) {
      const T g0 = gu[r * 2 * I + i], u0 = gu[r * 2 * I + I + i];
      const bool gpass = !c || g0 <= lim, upass = !c || (u0 >= -lim && u0 <= lim);
      const T g = c ? std::min(g0, lim) : g0, u = c ? std::clamp(u0, -lim, lim) : u0;
      const T s = sig(g);
      const T d = dh[r * I + i];
      dgu[r * 2 * I + i] = gpass ? d * u * s * (T(1) + g * (T(1) - s)) : T(0);
      dgu[r * 2 * I + I + i] = upass ? d * g * s : T(0);
    }
}
}  // namespace

void swiglu_clamped_forward(const Tensor& gu, double limit, Tensor& h) {
  const int64_t I = gu.size(-1) / 2, rows = detail::leading_rows(gu);
  if (gu.dtype() == DType::f64)
    swiglu_rows<double>(gu.data<double>(), h.data<double>(), rows, I, limit);
  else
    swiglu_rows<float>(gu.data<float>(), h.data<float>(), rows, I, limit);
}

void swiglu_clamped_backward(const Tensor& gu, const Tensor& dh, double limit, Tensor& dgu) {
  const int64_t I = gu.size(-1) / 2, rows = detail::leading_rows(gu);
  if (gu.dtype() == DType::f64)
    swiglu_rows_bwd<double>(gu.data<double>(), dh.data<double>(), dgu.data<double>(), rows, I,
                            limit);
  else
    swiglu_rows_bwd<float>(gu.data<float>(), dh.data<float>(), dgu.data<float>(), rows, I, limit);
}

// ---- combine ------------------------------------------------------------------------------------
namespace {
// out[t] = sum_k w[t, k] eo[t, k] (+ shared[t]), k ascending, then the shared expert; w ==
// nullptr: the plain sum; shared == nullptr: none. eo [T, K, D], w [T, K], shared and out [T, D].
template <class T>
void combine_rows(const T* eo, const T* w, const T* shared, int64_t Tn, int64_t K, int64_t D,
                  T* out) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < Tn; ++t)
    for (int64_t c = 0; c < D; ++c) {
      T acc = 0;
      for (int64_t k = 0; k < K; ++k) {
        const T v = eo[(t * K + k) * D + c];
        acc += w ? w[t * K + k] * v : v;
      }
      if (shared) acc += shared[t * D + c];
      out[t * D + c] = acc;
    }
}

// dw[t, k] = <dout_t, eo[t, k]> (channels ascending), deo[t, k] = w[t, k] dout_t.
template <class T>
void combine_rows_backward(const T* dout, const T* eo, const T* w, int64_t Tn, int64_t K, int64_t D,
                           T* dw, T* deo) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < Tn; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t a = t * K + k;
      T acc = 0;
      for (int64_t c = 0; c < D; ++c) {
        acc += dout[t * D + c] * eo[a * D + c];
        deo[a * D + c] = w[a] * dout[t * D + c];
      }
      dw[a] = acc;
    }
}

template <class T>
const T* data_or_null(const Tensor& t) {
  return t.defined() ? t.data<T>() : nullptr;
}
}  // namespace

void moe_combine(const Tensor& eo, const Tensor& w, const Tensor& shared, Tensor& out) {
  detail::dispatch_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    combine_rows<T>(eo.data<T>(), data_or_null<T>(w), data_or_null<T>(shared), eo.size(0),
                    eo.size(1), eo.size(2), out.data<T>());
  });
}

void moe_combine_backward(const Tensor& dout, const Tensor& eo, const Tensor& w,
                          MoeCombineGrads& r) {
  detail::dispatch_float(eo.dtype(), [&](auto tag) {
    using T = decltype(tag);
    combine_rows_backward<T>(dout.data<T>(), eo.data<T>(), w.data<T>(), eo.size(0), eo.size(1),
                             eo.size(2), r.dw.data<T>(), r.deo.data<T>());
  });
}

// ---- experts ------------------------------------------------------------------------------------
namespace {
struct ExpertDims {
  int64_t T, D, E, I, K;
  bool shared;
};

ExpertDims dims_of(const Tensor& x, const MoeWeights& w, int64_t K) {
  return {x.size(0),
          x.size(1),
          w.gate_up.size(0),
          w.gate_up.size(1) / 2,
          K,
          w.shared_gate_up.defined() || w.shared_down.defined()};
}

// Rows of `src` [N, C] (contiguous, dtype T) listed in `rows`, gathered into a new [n, C].
template <class T>
Tensor gather_rows(const Tensor& src, const std::vector<int64_t>& rows, int64_t C) {
  Tensor out = Tensor::empty({int64_t(rows.size()), C}, src.dtype());
  const T* s = src.data<T>();
  T* o = out.data<T>();
  for (size_t r = 0; r < rows.size(); ++r)
    std::copy(s + rows[r] * C, s + rows[r] * C + C, o + int64_t(r) * C);
  return out;
}
template <class T>
void scatter_rows(const Tensor& src, const std::vector<int64_t>& rows, int64_t C, Tensor& dst) {
  const T* s = src.data<T>();
  T* o = dst.data<T>();
  for (size_t r = 0; r < rows.size(); ++r)
    std::copy(s + int64_t(r) * C, s + int64_t(r) * C + C, o + rows[r] * C);
}

// For each expert e in order that has assignments: fn(e, rows, toks) with its assignments
// a = t*K + k (rows, ascending) and their tokens t = a / K (toks).
template <class Fn>
void for_each_expert(const std::vector<int64_t>& idx, int64_t E, int64_t K, Fn&& fn) {
  std::vector<std::vector<int64_t>> rows(static_cast<size_t>(E)), toks(static_cast<size_t>(E));
  for (size_t i = 0; i < idx.size(); ++i) {
    rows[size_t(idx[i])].push_back(int64_t(i));
    toks[size_t(idx[i])].push_back(int64_t(i) / K);
  }
  for (int64_t e = 0; e < E; ++e)
    if (!rows[size_t(e)].empty()) fn(e, rows[size_t(e)], toks[size_t(e)]);
}
using Rows = std::vector<int64_t>;  // the rows / toks of for_each_expert

template <class T>
void experts_fwd(const Tensor& x_in, const MoeWeights& w, const std::vector<int64_t>& idx,
                 const Tensor& tw_in, double limit, const ExpertDims& d, Tensor& out, MoeSaved& s) {
  const DType dt = dtype_of<T>::value;
  const int64_t T_ = d.T, D = d.D, I = d.I, K = d.K;
  Tensor x = as_dt(x_in, dt), tw = as_dt(tw_in, dt);
  Tensor gu_w = as_dt(w.gate_up, dt), dn_w = as_dt(w.down, dt);
  s.x = x;
  s.limit = limit;
  s.topk_idx = Tensor::empty({T_, K}, DType::i64);
  std::copy(idx.begin(), idx.end(), s.topk_idx.data<int64_t>());
  s.topk_weight = tw;
  s.gu = Tensor::empty({T_ * K, 2 * I}, dt);
  s.h = Tensor::empty({T_ * K, I}, dt);
  s.eo = Tensor::empty({T_ * K, D}, dt);
  for_each_expert(idx, d.E, K, [&](int64_t e, const Rows& rows, const Rows& toks) {
    Tensor xe = gather_rows<T>(x, toks, D);
    Tensor gue = matmul(xe, false, gu_w.select(0, e), true);  // [n, 2I]
    Tensor he = ops::swiglu_clamped_forward(gue, limit);      // [n, I]
    Tensor eoe = matmul(he, false, dn_w.select(0, e), true);  // [n, D]
    scatter_rows<T>(gue, rows, 2 * I, s.gu);
    scatter_rows<T>(he, rows, I, s.h);
    scatter_rows<T>(eoe, rows, D, s.eo);
  });
  Tensor so;
  if (d.shared && T_ > 0) {
    s.sgu = matmul(x, false, as_dt(w.shared_gate_up, dt), true);
    s.sh = ops::swiglu_clamped_forward(s.sgu, limit);
    so = matmul(s.sh, false, as_dt(w.shared_down, dt), true);
  }
  combine_rows<T>(s.eo.data<T>(), tw.data<T>(), data_or_null<T>(so), T_, K, D, out.data<T>());
  s.gu = s.gu.view({T_, K, 2 * I});
  s.h = s.h.view({T_, K, I});
  s.eo = s.eo.view({T_, K, D});
}

template <class T>
void experts_bwd(const MoeSaved& s, const MoeWeights& w, const Tensor& dout_in, MoeWeightGrads& g,
                 const ExpertDims& d, MoeGrads& r) {
  const DType dt = dtype_of<T>::value;
  const int64_t T_ = d.T, D = d.D, I = d.I, K = d.K;
  Tensor dout = as_dt(dout_in, dt);
  Tensor gu_w = as_dt(w.gate_up, dt), dn_w = as_dt(w.down, dt);
  const std::vector<int64_t> idx = detail::index_values(s.topk_idx);
  // Weighted output gradient per assignment: dO[a] = w_a dout_t.
  Tensor dO = Tensor::empty({T_ * K, D}, dt);
  combine_rows_backward<T>(dout.data<T>(), s.eo.data<T>(), s.topk_weight.data<T>(), T_, K, D,
                           r.dtopk_weight.data<T>(), dO.data<T>());
  Tensor gu_all = s.gu.view({T_ * K, 2 * I}), h_all = s.h.view({T_ * K, I});
  Tensor dxk = Tensor::zeros({T_ * K, D}, dt);
  for_each_expert(idx, d.E, K, [&](int64_t e, const Rows& rows, const Rows& toks) {
    Tensor xe = gather_rows<T>(s.x, toks, D);
    Tensor dOe = gather_rows<T>(dO, rows, D);
    Tensor he = gather_rows<T>(h_all, rows, I);
    Tensor gue = gather_rows<T>(gu_all, rows, 2 * I);
    Tensor dhe = matmul(dOe, false, dn_w.select(0, e), false);      // [n, I]
    Tensor ddn = matmul(dOe, true, he, false);                      // [D, I]
    Tensor dgue = ops::swiglu_clamped_backward(gue, dhe, s.limit);  // [n, 2I]
    Tensor dgu = matmul(dgue, true, xe, false);                     // [2I, D]
    Tensor dxe = matmul(dgue, false, gu_w.select(0, e), false);     // [n, D]
    accumulate_at<T>(g.ddown, e * D * I, ddn);
    accumulate_at<T>(g.dgate_up, e * 2 * I * D, dgu);
    scatter_rows<T>(dxe, rows, D, dxk);
  });
  Tensor sdx;
  if (d.shared && T_ > 0) {
    Tensor sgu_w = as_dt(w.shared_gate_up, dt), sdn_w = as_dt(w.shared_down, dt);
    Tensor dsh = matmul(dout, false, sdn_w, false);  // [T, Is]
    accumulate_at<T>(g.dshared_down, 0, matmul(dout, true, s.sh, false));
    Tensor dsgu = ops::swiglu_clamped_backward(s.sgu, dsh, s.limit);
    accumulate_at<T>(g.dshared_gate_up, 0, matmul(dsgu, true, s.x, false));
    sdx = matmul(dsgu, false, sgu_w, false);
  }
  combine_rows<T>(dxk.data<T>(), nullptr, data_or_null<T>(sdx), T_, K, D, r.dx.data<T>());
}
}  // namespace

void moe_experts_forward(const Tensor& x, const MoeWeights& w, const std::vector<int64_t>& idx,
                         int64_t K, const Tensor& topk_weight, double swiglu_limit, Tensor& out,
                         MoeSaved& saved) {
  const ExpertDims d = dims_of(x, w, K);
  if (out.dtype() == DType::f64)
    experts_fwd<double>(x, w, idx, topk_weight, swiglu_limit, d, out, saved);
  else
    experts_fwd<float>(x, w, idx, topk_weight, swiglu_limit, d, out, saved);
}

void moe_experts_backward(const MoeSaved& s, const MoeWeights& w, const Tensor& dout,
                          MoeWeightGrads& g, MoeGrads& r) {
  const ExpertDims d = dims_of(s.x, w, s.topk_idx.size(1));
  if (r.dx.dtype() == DType::f64)
    experts_bwd<double>(s, w, dout, g, d, r);
  else
    experts_bwd<float>(s, w, dout, g, d, r);
}

namespace {

// The input values of a routed-experts GEMM as the products take them.
template <class A>
std::vector<A> gemv_operand(const Tensor& t, bool round_bf16) {
  std::vector<A> v(static_cast<size_t>(t.numel()));
  if (t.dtype() == DType::f64) {
    std::copy_n(t.data<double>(), v.size(), v.begin());
  } else if (t.dtype() == DType::bf16) {
    const bf16* p = t.data<bf16>();
    for (size_t i = 0; i < v.size(); ++i) v[i] = A(bf16_to_float(p[i]));
  } else {
    const float* p = t.data<float>();
    for (size_t i = 0; i < v.size(); ++i) v[i] = A(round_bf16 ? hlm::round_bf16(p[i]) : p[i]);
  }
  return v;
}

// sum_k w[k] x[k] (k < n) in the CUDA kernel's order: lane l sums the spans of 8 consecutive k
// starting at 8 l, 8 l + 256, ... in ascending k with fused multiply-adds, then the 32 partial
// sums are added by the xor butterfly (lane 0's result).
template <class A>
A warp_order_dot(const A* w, const A* x, int64_t n) {
  constexpr int64_t kSpan = 8;
  A p[32];
  for (int l = 0; l < 32; ++l) {
    A acc = 0;
    for (int64_t k0 = kSpan * l; k0 < n; k0 += 32 * kSpan)
      for (int64_t k = k0; k < std::min(n, k0 + kSpan); ++k) acc = std::fma(w[k], x[k], acc);
    p[l] = acc;
  }
  for (int off = 16; off > 0; off >>= 1) {
    A q[32];
    for (int l = 0; l < 32; ++l) q[l] = p[l] + p[l ^ off];
    std::copy_n(q, 32, p);
  }
  return p[0];
}

template <class A>
void routed_experts(const Tensor& x, const Tensor& gate_up, const Tensor& down,
                    const std::vector<int64_t>& idx, double limit, bool rb, Tensor& eo) {
  const int64_t T = x.size(0), D = x.size(1), I = gate_up.size(1) / 2;
  const int64_t K = int64_t(idx.size()) / std::max<int64_t>(T, 1);
  const std::vector<A> xv = gemv_operand<A>(x, rb), gu_w = gemv_operand<A>(gate_up, rb),
                       dn_w = gemv_operand<A>(down, rb);
  A* out = eo.data<A>();
  std::vector<A> gu(static_cast<size_t>(2 * I)), h(static_cast<size_t>(I));
  for (int64_t a = 0; a < T * K; ++a) {
    const int64_t t = a / K, e = idx[size_t(a)];
    for (int64_t n = 0; n < 2 * I; ++n)
      gu[size_t(n)] = warp_order_dot(&gu_w[size_t((e * 2 * I + n) * D)], &xv[size_t(t * D)], D);
    swiglu_rows<A>(gu.data(), h.data(), 1, I, limit);
    if (rb)
      for (A& v : h) v = A(hlm::round_bf16(float(v)));
    for (int64_t n = 0; n < D; ++n)
      out[a * D + n] = warp_order_dot(&dn_w[size_t((e * D + n) * I)], h.data(), I);
  }
}

}  // namespace

void moe_routed_experts(const Tensor& x, const Tensor& gate_up, const Tensor& down,
                        const std::vector<int64_t>& idx, double swiglu_limit, bool round_bf16,
                        Tensor& eo) {
  if (x.dtype() == DType::f64)
    routed_experts<double>(x, gate_up, down, idx, swiglu_limit, round_bf16, eo);
  else
    routed_experts<float>(x, gate_up, down, idx, swiglu_limit, round_bf16, eo);
}

}  // namespace hlm::ops::cpu
