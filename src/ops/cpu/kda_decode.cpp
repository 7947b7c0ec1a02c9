// The KDA decode step on the CPU (ops/kda_decode.h, the reference; entry points in
// ops/cpu/kda_decode.h), in FP32, one state column at a time:
//   S <- Diag(exp(g)) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T (scale q)
// (q and k L2-normalised first with use_qk_l2norm); sums over K in index order.
#include "ops/cpu/kda_decode.h"

#include <algorithm>
#include <cmath>

namespace hlm::ops::cpu {

namespace {
struct Dims {
  int64_t N, H, HV, K, V;
};
}  // namespace

void kda_decode_step(const KdaDecodeArgs& a, const std::vector<int64_t>& slots, double scale,
                     Tensor& o) {
  const Dims d{a.q.size(0), a.q.size(1), a.v.size(1), a.q.size(2), a.v.size(2)};
  const Tensor q = a.q.to(DType::f32).contiguous(), k = a.k.to(DType::f32).contiguous(),
               v = a.v.to(DType::f32).contiguous();
  const float *pq = q.data<float>(), *pk = k.data<float>(), *pv = v.data<float>();
  const float *pg = a.g.data<float>(), *pb = a.beta.data<float>();
  float* ps = a.state.data<float>();
  float* po = o.data<float>();
  const int64_t G = d.HV / d.H, K = d.K, V = d.V;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t n = 0; n < d.N; ++n)
    for (int64_t h = 0; h < d.HV; ++h) {
      if (slots[size_t(n)] < 0) {  // a skipped sequence: its o rows are zero
        std::fill(po + (n * d.HV + h) * V, po + (n * d.HV + h + 1) * V, 0.0f);
        continue;
      }
      const float* qh = pq + (n * d.H + h / G) * K;
      const float* kh = pk + (n * d.H + h / G) * K;
      // Normalisation factors (1 without the L2 norm), sums in a fixed order.
      float qs = 1.0f, ks = 1.0f;
      if (a.use_qk_l2norm) {
        float sq = 0, sk = 0;
        for (int64_t i = 0; i < K; ++i) sq += qh[i] * qh[i], sk += kh[i] * kh[i];
        qs = 1.0f / std::sqrt(sq + 1e-6f), ks = 1.0f / std::sqrt(sk + 1e-6f);
      }
      const float* gh = pg + (n * d.HV + h) * K;
      const float b = pb[n * d.HV + h];
      float* S = ps + (slots[size_t(n)] * d.HV + h) * K * V;
      for (int64_t j = 0; j < V; ++j) {
        // Column j of the state: decay, predict, correct, read.
        float pred = 0;
        for (int64_t i = 0; i < K; ++i) pred += S[i * V + j] * std::exp(gh[i]) * (kh[i] * ks);
        const float u = b * (pv[(n * d.HV + h) * V + j] - pred);
        float out = 0;
        for (int64_t i = 0; i < K; ++i) {
          const float s = S[i * V + j] * std::exp(gh[i]) + (kh[i] * ks) * u;
          S[i * V + j] = s;
          out += s * (qh[i] * qs * float(scale));
        }
        po[(n * d.HV + h) * V + j] = out;
      }
    }
}

}  // namespace hlm::ops::cpu
