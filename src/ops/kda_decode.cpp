// The front door of the KDA decode step (ops/kda_decode.h): argument checks, state slots, output
// allocation, and the switch to the CPU reference (ops/cpu/kda_decode.cpp) or the CUDA kernel
// (ops/cuda/kda_decode.cu).
#include "ops/kda_decode.h"

#include <cmath>
#include <set>

#include "ops/cpu/kda_decode.h"
#include "ops/cuda/kda_decode.cuh"
#include "ops/dispatch.h"

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
  if (a.state.device() == Device::cuda)
    HLM_CHECK(K == 32 || K == 64 || K == 128 || K == 256,
              "{} on CUDA: K must be 32, 64, 128 or 256, got {}", op, K);
  for (const Tensor* t : {&a.q, &a.k, &a.v, &a.g, &a.beta, &a.state}) {
    // q, k and v: each token's [heads, dim] contiguous, tokens at any stride (the columns of a
    // wider row); the rest contiguous.
    const bool rows = t == &a.q || t == &a.k || t == &a.v;
    HLM_CHECK(rows ? t->stride(2) == 1 && t->stride(1) == t->size(2) && t->stride(0) >= 0
                   : t->is_contiguous(),
              "{}: inputs must be contiguous{}, got {} (strides {})", op,
              rows ? " within each token" : "", t->describe(), shape_str(t->strides()));
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
  constexpr const char* op = "kda_decode_step";
  std::vector<int64_t> slots;
  const Dims d = check(a, slots);
  const double scale = a.scale > 0 ? a.scale : 1.0 / std::sqrt(double(d.K));
  const Device dev = a.state.device();
  Tensor o = detail::new_output({d.N, d.HV, d.V}, DType::f32, dev);
  HLM_DISPATCH(op, dev, kda_decode_step, a, slots, scale, o);
  return o;
}

}  // namespace hlm::ops
