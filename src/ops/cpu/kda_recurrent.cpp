// kda_recurrent: the KDA step form (docs/kda.md, "The recurrence") in FP64, forward and the
// hand-derived reverse-time backward. Parallel over (sequence, value head); each task owns its
// outputs.
//
// Forward, per token t (qs = scale q_t, alpha = exp(g_t)):
//   S_a = Diag(alpha) S_{t-1};  p = S_a^T k;  u = beta (v - p);  S_t = S_a + k u^T;  o = S_t^T qs
// Backward, given dS (gradient w.r.t. S_t from later tokens and dS_final) and do_t:
//   dS += qs do^T;  dq = scale S_t do
//   dk = dS u;  du = dS^T k;  dv = beta du;  dbeta = (v - p) . du;  dp = -beta du
//   dS_a = dS + k dp^T;  dk += S_a dp
//   dg = alpha * rowsum(S_{t-1} * dS_a);  dS_{t-1} = Diag(alpha) dS_a
// S_{t-1} is recomputed from checkpoints every kCk tokens (memory O(T/kCk K V) per task).
#include <cmath>
#include <vector>

#include "ops/cpu/kda.h"

namespace hlm::ops::cpu {
namespace {

constexpr int64_t kCk = 64;

struct Ptrs {
  const double *q, *k, *v, *g, *beta, *h0;
};

// One step of the forward; S is K x V row-major. p, u are scratch of size V.
inline void step_fwd(const KdaDims& d, const double* qt, const double* kt, const double* vt,
                     const double* gt, double bt, double* S, double* p, double* u) {
  const int64_t K = d.K, V = d.V;
  for (int64_t i = 0; i < K; ++i) {
    const double a = std::exp(gt[i]);
    for (int64_t j = 0; j < V; ++j) S[i * V + j] *= a;
  }
  for (int64_t j = 0; j < V; ++j) p[j] = 0;
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = 0; j < V; ++j) p[j] += S[i * V + j] * kt[i];
  for (int64_t j = 0; j < V; ++j) u[j] = bt * (vt[j] - p[j]);
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = 0; j < V; ++j) S[i * V + j] += kt[i] * u[j];
  (void)qt;
}

}  // namespace

void kda_recurrent_forward(const KdaArgs& a, const KdaDims& d, Tensor& o_out, Tensor& final_state) {
  const kda_detail::Prepared pr = kda_detail::prepare(a, d, DType::f64);
  const int64_t T = d.T, H = d.H, HV = d.HV, K = d.K, V = d.V, Gq = HV / H;
  const double *q = pr.q.data<double>(), *k = pr.k.data<double>(), *g = pr.g.data<double>(),
               *v = nullptr, *beta = pr.beta.data<double>(), *h0 = pr.h0.data<double>();
  Tensor vc = a.v.to(DType::f64);
  v = vc.data<double>();
  double* o = o_out.data<double>();
  double* hT = final_state.data<double>();
  const double scale = d.scale;
#pragma omp parallel for collapse(2) schedule(dynamic) if (T * HV * K * V >= (1 << 16))
  for (int64_t n = 0; n < d.N; ++n)
    for (int64_t h = 0; h < HV; ++h) {
      const int64_t hq = h / Gq;
      double* S = hT + (n * HV + h) * K * V;
      std::copy(h0 + (n * HV + h) * K * V, h0 + (n * HV + h + 1) * K * V, S);
      std::vector<double> p(static_cast<size_t>(V)), u(static_cast<size_t>(V));
      for (int64_t t = d.cu[n]; t < d.cu[n + 1]; ++t) {
        const double* qt = q + (t * H + hq) * K;
        step_fwd(d, qt, k + (t * H + hq) * K, v + (t * HV + h) * V, g + (t * HV + h) * K,
                 beta[t * HV + h], S, p.data(), u.data());
        double* ot = o + (t * HV + h) * V;
        for (int64_t j = 0; j < V; ++j) ot[j] = 0;
        for (int64_t i = 0; i < K; ++i)
          for (int64_t j = 0; j < V; ++j) ot[j] += S[i * V + j] * qt[i];
        for (int64_t j = 0; j < V; ++j) ot[j] *= scale;
      }
    }
}

void kda_recurrent_backward(const KdaArgs& a, const KdaDims& d, const Tensor& d_o,
                            const Tensor& d_final, KdaGrads& r) {
  const int64_t T = d.T, H = d.H, HV = d.HV, K = d.K, V = d.V, Gq = HV / H;
  const kda_detail::Prepared pr = kda_detail::prepare(a, d, DType::f64);
  Tensor vc = a.v.to(DType::f64), doc = d_o.to(DType::f64);
  Tensor dhtc =
      d_final.defined() ? d_final.to(DType::f64) : Tensor::zeros({d.N, HV, K, V}, DType::f64);
  const double *q = pr.q.data<double>(), *k = pr.k.data<double>(), *g = pr.g.data<double>(),
               *v = vc.data<double>(), *beta = pr.beta.data<double>(), *h0 = pr.h0.data<double>(),
               *dO = doc.data<double>(), *dht = dhtc.data<double>();
  // Per value head gradients of q, k (summed over the GVA group afterwards).
  Tensor dqv = Tensor::empty({T, HV, K}, DType::f64), dkv = Tensor::empty({T, HV, K}, DType::f64);
  double *dq = dqv.data<double>(), *dk = dkv.data<double>(), *dv = r.dv.data<double>(),
         *dg = r.dg.data<double>(), *db = r.dbeta.data<double>(),
         *dh0 = r.dinitial_state.data<double>();
  const double scale = d.scale;
#pragma omp parallel for collapse(2) schedule(dynamic) if (T * HV * K * V >= (1 << 16))
  for (int64_t n = 0; n < d.N; ++n)
    for (int64_t h = 0; h < HV; ++h) {
      const int64_t hq = h / Gq, bos = d.cu[n], L = d.cu[n + 1] - d.cu[n];
      const int64_t KV = K * V, nck = (L + kCk - 1) / kCk;
      // Checkpoints: the state before token bos + c * kCk.
      std::vector<double> ck(static_cast<size_t>(std::max<int64_t>(nck, 1) * KV));
      std::vector<double> S(h0 + (n * HV + h) * KV, h0 + (n * HV + h + 1) * KV);
      std::vector<double> p(static_cast<size_t>(V)), u(static_cast<size_t>(V)),
          du(static_cast<size_t>(V)), dp(static_cast<size_t>(V));
      for (int64_t t = 0; t < L; ++t) {
        if (t % kCk == 0) std::copy(S.begin(), S.end(), ck.begin() + (t / kCk) * KV);
        const int64_t tt = bos + t;
        step_fwd(d, nullptr, k + (tt * H + hq) * K, v + (tt * HV + h) * V, g + (tt * HV + h) * K,
                 beta[tt * HV + h], S.data(), p.data(), u.data());
      }
      // dS: gradient w.r.t. the current state.
      std::vector<double> dS(dht + (n * HV + h) * KV, dht + (n * HV + h + 1) * KV);
      std::vector<double> blk(
          static_cast<size_t>((kCk + 1) * KV));  // states S_{c0-1} .. S_{c1-1} of a block
      for (int64_t c = nck - 1; c >= 0; --c) {
        const int64_t t0 = c * kCk, t1 = std::min(L, t0 + kCk);
        std::copy(ck.begin() + c * KV, ck.begin() + (c + 1) * KV, blk.begin());
        for (int64_t t = t0; t < t1; ++t) {
          double* Sn = blk.data() + (t - t0 + 1) * KV;
          std::copy(blk.data() + (t - t0) * KV, blk.data() + (t - t0 + 1) * KV, Sn);
          const int64_t tt = bos + t;
          step_fwd(d, nullptr, k + (tt * H + hq) * K, v + (tt * HV + h) * V, g + (tt * HV + h) * K,
                   beta[tt * HV + h], Sn, p.data(), u.data());
        }
        for (int64_t t = t1 - 1; t >= t0; --t) {
          const int64_t tt = bos + t;
          const double* Sp = blk.data() + (t - t0) * KV;      // S_{t-1}
          const double* St = blk.data() + (t - t0 + 1) * KV;  // S_t
          const double *qt = q + (tt * H + hq) * K, *kt = k + (tt * H + hq) * K,
                       *vt = v + (tt * HV + h) * V, *gt = g + (tt * HV + h) * K,
                       *dot = dO + (tt * HV + h) * V;
          const double bt = beta[tt * HV + h];
          double *dqt = dq + (tt * HV + h) * K, *dkt = dk + (tt * HV + h) * K,
                 *dvt = dv + (tt * HV + h) * V, *dgt = dg + (tt * HV + h) * K;
          // Recover p = S_a^T k and u from S_{t-1}.
          for (int64_t j = 0; j < V; ++j) p[j] = 0;
          for (int64_t i = 0; i < K; ++i) {
            const double ai = std::exp(gt[i]);
            for (int64_t j = 0; j < V; ++j) p[j] += ai * Sp[i * V + j] * kt[i];
          }
          for (int64_t j = 0; j < V; ++j) u[j] = bt * (vt[j] - p[j]);
          // o = scale S_t^T q
          for (int64_t i = 0; i < K; ++i) {
            double s = 0;
            for (int64_t j = 0; j < V; ++j) {
              s += St[i * V + j] * dot[j];
              dS[size_t(i * V + j)] += scale * qt[i] * dot[j];
            }
            dqt[i] = scale * s;
          }
          // S_t = S_a + k u^T
          for (int64_t j = 0; j < V; ++j) du[j] = 0;
          for (int64_t i = 0; i < K; ++i) {
            double s = 0;
            for (int64_t j = 0; j < V; ++j) {
              s += dS[size_t(i * V + j)] * u[j];
              du[j] += dS[size_t(i * V + j)] * kt[i];
            }
            dkt[i] = s;
          }
          double dbt = 0;
          for (int64_t j = 0; j < V; ++j) {
            dvt[j] = bt * du[j];
            dbt += (vt[j] - p[j]) * du[j];
            dp[j] = -bt * du[j];
          }
          db[tt * HV + h] = dbt;
          // p = S_a^T k; S_a = Diag(alpha) S_{t-1}
          for (int64_t i = 0; i < K; ++i) {
            const double ai = std::exp(gt[i]);
            double s = 0, sg = 0;
            for (int64_t j = 0; j < V; ++j) {
              const double dsa = dS[size_t(i * V + j)] + kt[i] * dp[j];
              s += ai * Sp[i * V + j] * dp[j];
              sg += Sp[i * V + j] * dsa;
              dS[size_t(i * V + j)] = ai * dsa;
            }
            dkt[i] += s;
            dgt[i] = ai * sg;
          }
        }
      }
      std::copy(dS.begin(), dS.end(), dh0 + (n * HV + h) * KV);
    }
  // GVA: sum the value heads of each qk head in a fixed order.
  r.dq.zero_();
  r.dk.zero_();
  double *rq = r.dq.data<double>(), *rk = r.dk.data<double>();
#pragma omp parallel for schedule(static) if (T * HV * K >= (1 << 16))
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < HV; ++h)
      for (int64_t i = 0; i < K; ++i) {
        rq[(t * H + h / Gq) * K + i] += dq[(t * HV + h) * K + i];
        rk[(t * H + h / Gq) * K + i] += dk[(t * HV + h) * K + i];
      }
  kda_detail::finish_grads(a, d, pr, r);
}

}  // namespace hlm::ops::cpu
