// The front door of the KDA core op (ops/kda.h): the one argument checker of every call
// (kda_check, kda_check_grads), output allocation, and the switch to the CPU references
// (ops/cpu/kda_chunk.cpp, kda_recurrent.cpp) or the chunked CUDA kernels (ops/cuda/kda_chunk/).
#include "ops/kda.h"

#include <cmath>
#include <cstdint>

#include "ops/cpu/kda.h"
#include "ops/cuda/kda_chunk/params.cuh"
#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace hlm::ops {

namespace {

bool aligned16(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.raw()) % 16 == 0;
}

// A KDA argument on q's device; on CUDA contiguous (the kernels read it in place).
void require_on_q_device(const Tensor& t, const Tensor& q, const char* op, const char* what) {
  detail::require_same_device(t, q, op, what, "q");
  if (t.device() == Device::cuda)
    HLM_CHECK(t.is_contiguous(), "{}: {} must be contiguous on CUDA, got strides {} for {}", op,
              what, shape_str(t.strides()), t.describe());
}

}  // namespace

KdaDims kda_check(const KdaArgs& a, const char* op) {
  HLM_CHECK(a.q.defined(), "{}: q is undefined", op);
  const bool on_cuda = a.q.device() == Device::cuda;
  auto req = [&](const Tensor& t, const char* what, int64_t nd, const char* shape) {
    HLM_CHECK(t.defined(), "{}: {} is undefined", op, what);
    require_on_q_device(t, a.q, op, what);
    HLM_CHECK(is_floating(t.dtype()), "{}: {} must be floating point, got {}", op, what,
              t.describe());
    HLM_CHECK(t.dim() == nd, "{}: {} must be {}, got {}", op, what, shape, t.describe());
  };
  req(a.q, "q", 3, "[T, H, K]");
  req(a.k, "k", 3, "[T, H, K]");
  req(a.v, "v", 3, "[T, HV, V]");
  req(a.g, "g", 3, "[T, HV, K]");
  req(a.beta, "beta", 2, "[T, HV]");
  if (on_cuda)
    HLM_CHECK(a.q.dtype() == DType::f32 || a.q.dtype() == DType::bf16,
              "{}: q must be f32 or bf16 on CUDA, got {}", op, a.q.describe());
  KdaDims d;
  d.T = a.q.size(0), d.H = a.q.size(1), d.K = a.q.size(2);
  d.HV = a.v.size(1), d.V = a.v.size(2);
  HLM_CHECK(d.H > 0 && d.K > 0 && d.HV > 0 && d.V > 0, "{}: empty head dims: q {}, v {}", op,
            a.q.describe(), a.v.describe());
  detail::require_shape(a.k, a.q.shape(), op, "k");
  HLM_CHECK(a.v.size(0) == d.T, "{}: v must be [T={}, HV, V], got {}", op, d.T, a.v.describe());
  HLM_CHECK(d.HV % d.H == 0, "{}: value heads HV={} (v) must be a multiple of qk heads H={} (q)",
            op, d.HV, d.H);
  detail::require_shape(a.g, {d.T, d.HV, d.K}, op, "g");
  detail::require_shape(a.beta, {d.T, d.HV}, op, "beta");
  detail::require_same_dtype(a.k, a.q, op, "k", "q");
  detail::require_same_dtype(a.v, a.q, op, "v", "q");
  detail::require_same_dtype(a.g, a.q, op, "g", "q");
  detail::require_same_dtype(a.beta, a.q, op, "beta", "q");
  if (on_cuda) {  // what the CUDA kernels support
    HLM_CHECK(d.K == 32 || d.K == 64 || d.K == 128,
              "{}: key head dim K must be 32, 64 or 128 on CUDA, got {} (q {})", op, d.K,
              a.q.describe());
    HLM_CHECK(d.V % 32 == 0 && d.V >= 32 && d.V <= 128,
              "{}: value head dim V must be a multiple of 32 in [32, 128] on CUDA, got {} (v {})",
              op, d.V, a.v.describe());
    HLM_CHECK(d.T < (int64_t(1) << 31) - kKdaChunk, "{}: T={} tokens exceed the int32 chunk table",
              op, d.T);
  }
  d.seqs = a.seqs ? *a.seqs : SeqLayout::single(d.T);
  d.seqs.check_tokens(d.T, op, "q");
  HLM_CHECK(d.seqs.num_seqs() >= 1, "{}: the sequence layout must hold N >= 1 sequences, got 0",
            op);
  d.cu = d.seqs.offsets();
  d.N = int64_t(d.cu.size()) - 1;
  if (on_cuda)
    HLM_CHECK(d.N * d.HV * (d.V / 32) < (int64_t(1) << 31),
              "{}: N={} sequences x HV={} heads exceed the grid", op, d.N, d.HV);
  if (a.initial_state.defined()) {
    require_on_q_device(a.initial_state, a.q, op, "initial_state");
    if (on_cuda) {
      HLM_CHECK(a.initial_state.dtype() == DType::f32, "{}: initial_state must be f32, got {}", op,
                a.initial_state.describe());
      HLM_CHECK(aligned16(a.initial_state), "{}: initial_state must be 16-byte aligned", op);
    } else {
      detail::require_float(a.initial_state, op, "initial_state");
    }
    detail::require_shape(a.initial_state, {d.N, d.HV, d.K, d.V}, op, "initial_state");
  }
  if (a.gate) {
    HLM_CHECK(a.A_log.defined() || *a.gate == KdaGateKind::lower_bound,
              "{}: A_log [HV] is required with the standard gate", op);
    for (auto [t, what, n] :
         {std::tuple{&a.A_log, "A_log", d.HV}, std::tuple{&a.dt_bias, "dt_bias", d.HV * d.K}}) {
      if (!t->defined()) continue;
      require_on_q_device(*t, a.q, op, what);
      if (on_cuda)
        HLM_CHECK(t->dtype() == DType::f32, "{}: {} must be f32 on CUDA, got {}", op, what,
                  t->describe());
      detail::require_shape(*t, {n}, op, what);
    }
    if (*a.gate == KdaGateKind::lower_bound) check_kda_lower_bound(a.lower_bound, op);
  }
  HLM_CHECK(std::isfinite(a.scale), "{}: scale must be finite, got {}", op, a.scale);
  d.scale = a.scale > 0 ? a.scale : 1.0 / std::sqrt(double(d.K));
  return d;
}

void kda_check_grads(const KdaArgs& a, const KdaDims& d, const Tensor& d_o,
                     const Tensor& d_final_state, const char* op) {
  const bool on_cuda = a.q.device() == Device::cuda;
  HLM_CHECK(d_o.defined(), "{}: d_o is undefined", op);
  require_on_q_device(d_o, a.q, op, "d_o");
  HLM_CHECK(is_floating(d_o.dtype()), "{}: d_o must be floating point, got {}", op, d_o.describe());
  detail::require_shape(d_o, {d.T, d.HV, d.V}, op, "d_o");
  if (on_cuda) {
    detail::require_same_dtype(d_o, a.q, op, "d_o", "q");
    HLM_CHECK(aligned16(d_o), "{}: d_o must be 16-byte aligned", op);
  }
  if (d_final_state.defined()) {
    require_on_q_device(d_final_state, a.q, op, "d_final_state");
    HLM_CHECK(is_floating(d_final_state.dtype()),
              "{}: d_final_state must be floating point, got {}", op, d_final_state.describe());
    detail::require_shape(d_final_state, {d.N, d.HV, d.K, d.V}, op, "d_final_state");
    if (on_cuda) {
      HLM_CHECK(d_final_state.dtype() == DType::f32, "{}: d_final_state must be f32, got {}", op,
                d_final_state.describe());
      HLM_CHECK(aligned16(d_final_state), "{}: d_final_state must be 16-byte aligned", op);
    }
  }
}

namespace {

// The outputs of a forward and a backward in dtype `dt` on `dev` (final state: `st`).
KdaOutput new_outputs(const KdaDims& d, DType dt, DType st, Device dev) {
  return {detail::new_output({d.T, d.HV, d.V}, dt, dev),
          detail::new_output({d.N, d.HV, d.K, d.V}, st, dev)};
}

KdaGrads new_grads(const KdaArgs& a, const KdaDims& d, DType dt, Device dev) {
  KdaGrads g;
  g.dq = detail::new_output({d.T, d.H, d.K}, dt, dev);
  g.dk = detail::new_output({d.T, d.H, d.K}, dt, dev);
  g.dv = detail::new_output({d.T, d.HV, d.V}, dt, dev);
  g.dg = detail::new_output({d.T, d.HV, d.K}, dt, dev);
  g.dbeta = detail::new_output({d.T, d.HV}, dt, dev);
  g.dinitial_state = detail::new_output({d.N, d.HV, d.K, d.V}, dt, dev);
  if (a.gate && a.A_log.defined()) g.dA_log = detail::new_output({d.HV}, dt, dev);
  if (a.gate && a.dt_bias.defined()) g.ddt_bias = detail::new_output({d.HV * d.K}, dt, dev);
  return g;
}

// The chunked CPU reference computes in f64 for f64 inputs, else in f32.
DType chunk_dtype(const KdaArgs& a) {
  return a.q.dtype() == DType::f64 ? DType::f64 : DType::f32;
}

}  // namespace

KdaOutput kda_recurrent(const KdaArgs& a) {
  constexpr const char* op = "kda_recurrent";
  if (a.q.defined()) detail::require_cpu(a.q, op, "q");
  const KdaDims d = kda_check(a, op);
  KdaOutput out = new_outputs(d, DType::f64, DType::f64, Device::cpu);
  cpu::kda_recurrent_forward(a, d, out.o, out.final_state);
  return out;
}

KdaGrads kda_recurrent_backward(const KdaArgs& a, const Tensor& d_o, const Tensor& d_final) {
  constexpr const char* op = "kda_recurrent_backward";
  if (a.q.defined()) detail::require_cpu(a.q, op, "q");
  const KdaDims d = kda_check(a, op);
  kda_check_grads(a, d, d_o, d_final, op);
  KdaGrads g = new_grads(a, d, DType::f64, Device::cpu);
  cpu::kda_recurrent_backward(a, d, d_o, d_final, g);
  return g;
}

KdaOutput kda_chunk(const KdaArgs& a) {
  return kda_chunk(a, nullptr);
}

KdaOutput kda_chunk(const KdaArgs& a, Tensor* saved, KdaSave what) {
  constexpr const char* op = "kda_chunk";
  if (saved) *saved = Tensor();
  const KdaDims d = kda_check(a, op);
  KdaOutput out;
  switch (a.q.device()) {
    case Device::cpu:
      out = new_outputs(d, chunk_dtype(a), chunk_dtype(a), Device::cpu);
      cpu::kda_chunk_forward(a, d, out.o, out.final_state);
      break;
    case Device::cuda:
      out = new_outputs(d, a.q.dtype(), DType::f32, Device::cuda);
      HLM_CUDA_PATH(op, cuda::kda::chunk_forward(a, d, out, saved, what));
      break;
  }
  return out;
}

KdaGrads kda_chunk_backward(const KdaArgs& a, const Tensor& d_o, const Tensor& d_final) {
  return kda_chunk_backward(a, d_o, d_final, Tensor());
}

KdaGrads kda_chunk_backward(const KdaArgs& a, const Tensor& d_o, const Tensor& d_final,
                            const Tensor& saved, KdaSave what) {
  constexpr const char* op = "kda_chunk_backward";
  const KdaDims d = kda_check(a, op);
  kda_check_grads(a, d, d_o, d_final, op);
  KdaGrads g;
  switch (a.q.device()) {
    case Device::cpu:
      HLM_CHECK(!saved.defined(), "{}: saved intermediates come from a CUDA forward, got {}", op,
                saved.describe());
      g = new_grads(a, d, chunk_dtype(a), Device::cpu);
      cpu::kda_chunk_backward(a, d, d_o, d_final, g);
      break;
    case Device::cuda:
      g = new_grads(a, d, DType::f32, Device::cuda);
      HLM_CUDA_PATH(op, cuda::kda::chunk_backward(a, d, d_o, d_final, saved, what, g));
      break;
  }
  return g;
}

}  // namespace hlm::ops
