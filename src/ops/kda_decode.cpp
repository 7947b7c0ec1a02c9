#include "ops/kda_decode.h"

#include <cmath>
#include <set>

namespace hlm::ops {
namespace {

struct Dims {
  int64_t N, H, HV, K, V, P;
};

Dims check(const KdaDecodeArgs& a, std::vector<int64_t>& slots) {
  const char* op = "kda_decode_step";
  for (auto [t, n] : {std::pair{&a.q, "q"},
                      {&a.k, "k"},
                      {&a.v, "v"},
                      {&a.g, "g"},
                      {&a.beta, "beta"},
                      {&a.state, "state"}})
    HLM_CHECK(t->defined(), "{}: {} is missing", op, n);
  HLM_CHECK(a.q.dim() == 3, "{}: q must be [N, H, K], got {}", op, a.q.describe());
  const int64_t N = a.q.size(0), H = a.q.size(1), K = a.q.size(2);
  HLM_CHECK(a.v.dim() == 3 && a.v.size(0) == N, "{}: v must be [N={}, HV, V], got {}", op, N,
            a.v.describe());
  const int64_t HV = a.v.size(1), V = a.v.size(2);
  HLM_CHECK(H > 0 && HV % H == 0, "{}: HV={} must be a multiple of H={}", op, HV, H);
  HLM_CHECK(a.k.shape() == a.q.shape(), "{}: k must have q's shape {}, got {}", op,
            shape_str(a.q.shape()), a.k.describe());
  HLM_CHECK(a.g.shape() == (Shape{N, HV, K}), "{}: g must be [{}, {}, {}], got {}", op, N, HV, K,
            a.g.describe());
  HLM_CHECK(a.beta.shape() == (Shape{N, HV}), "{}: beta must be [{}, {}], got {}", op, N, HV,
            a.beta.describe());
  HLM_CHECK(a.q.dtype() == DType::f32 || a.q.dtype() == DType::bf16,
            "{}: q must be f32 or bf16, got {}", op, a.q.describe());
  HLM_CHECK(a.k.dtype() == a.q.dtype() && a.v.dtype() == a.q.dtype(),
            "{}: q, k and v must share a dtype ({}, {}, {})", op, dtype_name(a.q.dtype()),
            dtype_name(a.k.dtype()), dtype_name(a.v.dtype()));
  HLM_CHECK(
      a.g.dtype() == DType::f32 && a.beta.dtype() == DType::f32 && a.state.dtype() == DType::f32,
      "{}: g, beta and state must be f32", op);
  HLM_CHECK(
      a.state.dim() == 4 && a.state.size(1) == HV && a.state.size(2) == K && a.state.size(3) == V,
      "{}: state must be [P, {}, {}, {}], got {}", op, HV, K, V, a.state.describe());
  const int64_t P = a.state.size(0);
  for (const Tensor* t : {&a.q, &a.k, &a.v, &a.g, &a.beta, &a.state}) {
    HLM_CHECK(t->is_contiguous(), "{}: inputs must be contiguous, got {}", op, t->describe());
    HLM_CHECK(t->device() == a.state.device(), "{}: all inputs must be on the state's device", op);
  }
  slots.resize(size_t(N));
  if (a.state_indices.defined()) {
    const Tensor& si = a.state_indices;
    HLM_CHECK(
        si.dim() == 1 && si.size(0) == N && (si.dtype() == DType::i32 || si.dtype() == DType::i64),
        "{}: state_indices must be i32/i64 [{}], got {}", op, N, si.describe());
    const auto vals = si.to_f64_vector();
    std::set<int64_t> seen;
    for (int64_t n = 0; n < N; ++n) {
      const int64_t s = int64_t(vals[size_t(n)]);
      HLM_CHECK(s < P, "{}: state_indices[{}] = {} is outside the pool of {} states", op, n, s, P);
      HLM_CHECK(s < 0 || seen.insert(s).second, "{}: state slot {} is used twice", op, s);
      slots[size_t(n)] = s;
    }
  } else {
    HLM_CHECK(P == N, "{}: without state_indices the state needs N={} rows, got {}", op, N, P);
    for (int64_t n = 0; n < N; ++n) slots[size_t(n)] = n;
  }
  return {N, H, HV, K, V, P};
}

}  // namespace

Tensor kda_decode_step(const KdaDecodeArgs& a) {
  std::vector<int64_t> slots;
  const Dims d = check(a, slots);
  const double scale = a.scale > 0 ? a.scale : 1.0 / std::sqrt(double(d.K));
  if (a.state.device() == Device::cuda) {
#ifdef HLM_HAVE_CUDA
    Tensor o = Tensor::empty({d.N, d.HV, d.V}, DType::f32, Device::cuda);
    cuda::kda_decode_step(a, slots, scale, o);
    return o;
#else
    HLM_FAIL("kda_decode_step: no CUDA support in this build");
#endif
  }
  const Tensor q = a.q.to(DType::f32), k = a.k.to(DType::f32), v = a.v.to(DType::f32);
  const float *pq = q.data<float>(), *pk = k.data<float>(), *pv = v.data<float>();
  const float *pg = a.g.data<float>(), *pb = a.beta.data<float>();
  float* ps = a.state.data<float>();
  Tensor o = Tensor::zeros({d.N, d.HV, d.V}, DType::f32);
  float* po = o.data<float>();
  const int64_t G = d.HV / d.H, K = d.K, V = d.V;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t n = 0; n < d.N; ++n)
    for (int64_t h = 0; h < d.HV; ++h) {
      if (slots[size_t(n)] < 0) continue;
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
  return o;
}

}  // namespace hlm::ops
