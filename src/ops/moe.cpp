// The front door of the MoE ops (ops/moe.h): argument checks, output allocation, and the switch
// to the CPU reference (ops/cpu/moe.cpp) or the CUDA kernels (ops/cuda/moe.cu, moe_experts.cu).
// CUDA tensors are made contiguous here (ops::contiguous) and the parameters the kernels read in
// the computation dtype converted to it (ops::as_dtype).
#include "ops/moe.h"

#include <cmath>
#include <vector>

#include "ops/cpu/moe.h"
#include "ops/cuda/moe.cuh"
#include "ops/dispatch.h"
#include "ops/op_checks.h"
#include "ops/tensor_ops.h"

namespace hlm::ops {
namespace {

// Defined and f32 / f64, or on CUDA also bf16 (any strides: the front door makes it contiguous).
void require_real_dev(const Tensor& t, const char* op, const char* what) {
  HLM_CHECK(t.defined(), "{}: {} is undefined", op, what);
  if (t.device() == Device::cpu) {
    detail::require_real(t, op, what);
    return;
  }
  HLM_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::f64 || t.dtype() == DType::bf16,
            "{}: {} must be f32, f64 or bf16 on CUDA, got {}", op, what, t.describe());
}

// t contiguous on its device, in dtype dt (undefined stays undefined): what a CUDA kernel reads.
Tensor dev_input(const Tensor& t, DType dt) {
  return t.defined() ? ops::contiguous(ops::as_dtype(t, dt)) : Tensor();
}
Tensor dev_input(const Tensor& t) {
  return t.defined() ? ops::contiguous(t) : Tensor();
}

void check_acc(const Tensor& acc, const Tensor& x, const Shape& s, const char* op,
               const char* what) {
  detail::require_accumulator(acc, s, x, op, what);
  HLM_CHECK(acc.is_contiguous(), "{}: gradient accumulator {} must be contiguous, got {}", op, what,
            acc.describe());
}

// ---- router
// ---------------------------------------------------------------------------------------
void check_router_cfg(const MoeRouterConfig& c, const char* op) {
  const int64_t E = c.n_experts;
  HLM_CHECK(E >= 1, "{}: cfg.n_experts must be >= 1, got {}", op, E);
  HLM_CHECK(c.top_k >= 1 && c.top_k <= E, "{}: cfg.top_k must be in [1, n_experts = {}], got {}",
            op, E, c.top_k);
  HLM_CHECK(c.n_group >= 1 && E % c.n_group == 0,
            "{}: cfg.n_group must be >= 1 and divide n_experts = {}, got {}", op, E, c.n_group);
  HLM_CHECK(c.topk_group >= 1 && c.topk_group <= c.n_group,
            "{}: cfg.topk_group must be in [1, n_group = {}], got {}", op, c.n_group, c.topk_group);
  const int64_t gs = E / c.n_group;
  if (c.n_group > 1)
    HLM_CHECK(gs >= 2, "{}: groups must hold >= 2 experts (group score = top-2 sum), got {}", op,
              gs);
  HLM_CHECK(c.top_k <= c.topk_group * gs,
            "{}: cfg.top_k = {} exceeds the experts of the kept groups (topk_group {} x {})", op,
            c.top_k, c.topk_group, gs);
  HLM_CHECK(c.routed_scaling_factor > 0 && std::isfinite(c.routed_scaling_factor),
            "{}: cfg.routed_scaling_factor must be finite and > 0, got {}", op,
            c.routed_scaling_factor);
}

void check_logits(const Tensor& logits, const MoeRouterConfig& c, const char* op) {
  detail::require_real(logits, op, "logits");
  HLM_CHECK(logits.dim() == 2 && logits.size(1) == c.n_experts,
            "{}: logits must be [T, n_experts = {}], got {}", op, c.n_experts, logits.describe());
}

// Index tensor [Tn, K] with values in [0, E) (distinct per row when asked); returns the values.
std::vector<int64_t> check_topk_idx(const Tensor& idx, int64_t Tn, int64_t E, const char* op,
                                    const char* what, bool distinct) {
  detail::require_int(idx, op, what);
  HLM_CHECK(idx.dim() == 2 && idx.size(0) == Tn && idx.size(1) >= 1,
            "{}: {} must be [T = {}, K], got {}", op, what, Tn, idx.describe());
  std::vector<int64_t> vals = detail::index_values(idx);
  const int64_t K = idx.size(1);
  for (int64_t t = 0; t < Tn; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t v = vals[size_t(t * K + k)];
      HLM_CHECK(v >= 0 && v < E, "{}: {}[{}, {}] = {} is outside [0, {})", op, what, t, k, v, E);
      if (distinct)
        for (int64_t q = 0; q < k; ++q)
          HLM_CHECK(vals[size_t(t * K + q)] != v, "{}: {}[{}] repeats expert {}", op, what, t, v);
    }
  return vals;
}

// The experts' shapes from x [T, D] and the weights (K is set by the caller).
struct ExpertDims {
  int64_t T, D, E, I, K, Is;
  bool shared;
};

ExpertDims check_experts(const Tensor& x, const MoeWeights& w, const char* op) {
  require_real_dev(x, op, "x");
  HLM_CHECK(x.dim() == 2, "{}: x must be [T, D], got {}", op, x.describe());
  ExpertDims d{};
  d.T = x.size(0);
  d.D = x.size(1);
  require_real_dev(w.gate_up, op, "w.gate_up");
  HLM_CHECK(w.gate_up.dim() == 3 && w.gate_up.size(2) == d.D && w.gate_up.size(1) % 2 == 0 &&
                w.gate_up.size(0) >= 1 && w.gate_up.size(1) >= 2,
            "{}: w.gate_up must be [E, 2I, D = {}], got {}", op, d.D, w.gate_up.describe());
  d.E = w.gate_up.size(0);
  d.I = w.gate_up.size(1) / 2;
  require_real_dev(w.down, op, "w.down");
  detail::require_shape(w.down, {d.E, d.D, d.I}, op, "w.down");
  d.shared = w.shared_gate_up.defined() || w.shared_down.defined();
  if (d.shared) {
    require_real_dev(w.shared_gate_up, op, "w.shared_gate_up");
    HLM_CHECK(w.shared_gate_up.dim() == 2 && w.shared_gate_up.size(1) == d.D &&
                  w.shared_gate_up.size(0) % 2 == 0 && w.shared_gate_up.size(0) >= 2,
              "{}: w.shared_gate_up must be [2I_s, D = {}], got {}", op, d.D,
              w.shared_gate_up.describe());
    d.Is = w.shared_gate_up.size(0) / 2;
    require_real_dev(w.shared_down, op, "w.shared_down");
    detail::require_shape(w.shared_down, {d.D, d.Is}, op, "w.shared_down");
  }
  detail::one_device(op, {x, "x"},
                     {{w.gate_up, "w.gate_up"},
                      {w.down, "w.down"},
                      {w.shared_gate_up, "w.shared_gate_up"},
                      {w.shared_down, "w.shared_down"}});
  return d;
}

// gu [..., 2I] -> the shape of h [..., I].
Shape check_swiglu(const Tensor& gu, const char* op) {
  require_real_dev(gu, op, "gu");
  HLM_CHECK(gu.dim() >= 1 && gu.size(-1) % 2 == 0, "{}: gu must be [..., 2I], got {}", op,
            gu.describe());
  Shape s = detail::leading_shape(gu);
  s.push_back(gu.size(-1) / 2);
  return s;
}

}  // namespace

MoeRouterResult moe_router_forward(const Tensor& logits, const Tensor& bias,
                                   const MoeRouterConfig& cfg, const Tensor& replay_idx) {
  const char* op = "moe_router_forward";
  check_router_cfg(cfg, op);
  check_logits(logits, cfg, op);
  if (bias.defined()) {
    detail::require_real(bias, op, "bias");
    detail::require_shape(bias, {cfg.n_experts}, op, "bias");
  }
  const Device dev =
      detail::one_device(op, {logits, "logits"}, {{bias, "bias"}, {replay_idx, "replay_idx"}});
  std::vector<int64_t> rv;
  if (replay_idx.defined()) {
    rv = check_topk_idx(replay_idx, logits.size(0), cfg.n_experts, op, "replay_idx", true);
    HLM_CHECK(replay_idx.size(1) == cfg.top_k, "{}: replay_idx must be [T, top_k = {}], got {}", op,
              cfg.top_k, replay_idx.describe());
  }
  const DType dt = detail::compute_dtype(logits.dtype());
  const int64_t Tn = logits.size(0);
  MoeRouterResult r{detail::new_output({Tn, cfg.n_experts}, dt, dev),
                    detail::new_output({Tn, cfg.top_k}, DType::i64, dev),
                    detail::new_output({Tn, cfg.top_k}, dt, dev)};
  if (dev == Device::cpu)
    cpu::moe_router_forward(logits, bias, cfg, replay_idx.defined() ? &rv : nullptr, r);
  else
    HLM_CUDA_PATH(op, cuda::moe_router_forward(dev_input(logits), dev_input(bias, dt), cfg,
                                               dev_input(replay_idx), r));
  return r;
}

Tensor moe_router_backward(const Tensor& logits, const MoeRouterResult& r,
                           const MoeRouterConfig& cfg, const Tensor& dweight) {
  const char* op = "moe_router_backward";
  check_router_cfg(cfg, op);
  check_logits(logits, cfg, op);
  const std::vector<int64_t> iv =
      check_topk_idx(r.topk_idx, logits.size(0), cfg.n_experts, op, "r.topk_idx", false);
  HLM_CHECK(r.topk_idx.size(1) == cfg.top_k, "{}: r.topk_idx must be [T, top_k = {}], got {}", op,
            cfg.top_k, r.topk_idx.describe());
  detail::require_real(dweight, op, "dweight");
  detail::require_shape(dweight, r.topk_idx.shape(), op, "dweight");
  const Device dev = detail::one_device(op, {logits, "logits"},
                                        {{r.topk_idx, "r.topk_idx"}, {dweight, "dweight"}});
  Tensor dl = detail::new_output({logits.size(0), cfg.n_experts},
                                 detail::compute_dtype(logits.dtype()), dev);
  if (dev == Device::cpu)
    cpu::moe_router_backward(logits, iv, cfg, dweight, dl);
  else
    HLM_CUDA_PATH(op, cuda::moe_router_backward(dev_input(logits), dev_input(r.topk_idx), cfg,
                                                dev_input(dweight, dl.dtype()), dl));
  return dl;
}

Tensor moe_expert_load(const Tensor& topk_idx, int64_t n_experts) {
  const char* op = "moe_expert_load";
  HLM_CHECK(n_experts >= 1, "{}: n_experts must be >= 1, got {}", op, n_experts);
  detail::require_int(topk_idx, op, "topk_idx");
  HLM_CHECK(topk_idx.dim() == 2, "{}: topk_idx must be [T, K], got {}", op, topk_idx.describe());
  const std::vector<int64_t> v =
      check_topk_idx(topk_idx, topk_idx.size(0), n_experts, op, "topk_idx", false);
  Tensor load = detail::new_output({n_experts}, DType::i64, topk_idx.device());
  if (topk_idx.is_cpu())
    cpu::moe_expert_load(v, load);
  else
    HLM_CUDA_PATH(op, cuda::moe_expert_load(dev_input(topk_idx), load));
  return load;
}

void moe_bias_update(Tensor& bias, const Tensor& load, double rate) {
  const char* op = "moe_bias_update";
  detail::require_real(bias, op, "bias");
  HLM_CHECK(bias.dim() == 1, "{}: bias must be [E], got {}", op, bias.describe());
  HLM_CHECK(load.defined() && (load.is_cpu() || load.device() == bias.device()),
            "{}: load must be a CPU tensor{}", op,
            bias.is_cpu() ? "" : " or on the device of bias");
  detail::require_shape(load, bias.shape(), op, "load");
  if (bias.is_cpu()) {
    cpu::moe_bias_update(bias, load, rate);
    return;
  }
  detail::require_contiguous(bias, op, "bias");
  // The load as the kernel reads it: a host load as f64 (exact for counts below 2^53), a device
  // load as i64 / i32 / f32 / f64 (bf16 widened to f32).
  Tensor ld;
  if (load.is_cpu())
    ld = Tensor::from_values(load.shape(), load.to_f64_vector(), DType::f64).to(bias.device());
  else if (load.dtype() == DType::bf16)
    ld = dev_input(load, DType::f32);
  else
    ld = dev_input(load);
  HLM_CHECK(ld.dtype() == DType::i64 || ld.dtype() == DType::i32 || ld.dtype() == DType::f32 ||
                ld.dtype() == DType::f64,
            "{}: load must be i64, i32, f32, f64 or bf16 on CUDA, got {}", op, load.describe());
  HLM_CUDA_PATH(op, cuda::moe_bias_update(bias, ld, rate));
}

// ---- sequence-wise aux loss ---------------------------------------------------------------------
namespace {
struct AuxArgs {
  std::vector<int64_t> cu, idx;
  int64_t K = 0;
  Device dev = Device::cpu;
};
AuxArgs check_aux(const Tensor& logits, const Tensor& topk_idx, const SeqLayout& seqs,
                  const MoeAuxWhole* whole, const char* op) {
  detail::require_real(logits, op, "logits");
  HLM_CHECK(logits.dim() == 2, "{}: logits must be [T, E], got {}", op, logits.describe());
  AuxArgs a;
  a.dev = detail::one_device(op, {logits, "logits"}, {{topk_idx, "topk_idx"}});
  a.idx = check_topk_idx(topk_idx, logits.size(0), logits.size(1), op, "topk_idx", false);
  a.K = topk_idx.size(1);
  seqs.check_tokens(logits.size(0), op, "logits");
  a.cu = seqs.offsets();
  if (whole) {
    const int64_t N = seqs.num_seqs(), E = logits.size(1);
    HLM_CHECK(int64_t(whole->lengths.size()) == N && int64_t(whole->counts.size()) == N * E,
              "{}: whole must hold {} lengths and {} x {} counts, got {} and {}", op, N, N, E,
              whole->lengths.size(), whole->counts.size());
    for (int64_t q = 0; q < N; ++q) {
      HLM_CHECK(whole->lengths[size_t(q)] >= seqs.length(q),
                "{}: sequence {} has {} tokens here but {} in whole", op, q, seqs.length(q),
                whole->lengths[size_t(q)]);
      int64_t sum = 0;
      for (int64_t e = 0; e < E; ++e) {
        const int64_t c = whole->counts[size_t(q * E + e)];
        HLM_CHECK(c >= 0 && c <= whole->lengths[size_t(q)],
                  "{}: whole count {} of sequence {}, expert {}, outside [0, {}]", op, c, q, e,
                  whole->lengths[size_t(q)]);
        sum += c;
      }
      HLM_CHECK(sum == a.K * whole->lengths[size_t(q)],
                "{}: sequence {}'s whole counts sum to {}, not K x length = {}", op, q, sum,
                a.K * whole->lengths[size_t(q)]);
    }
  }
  return a;
}
}  // namespace

double moe_seq_aux_loss(const Tensor& logits, const Tensor& topk_idx, const SeqLayout& seqs,
                        double coeff, const MoeAuxWhole* whole) {
  const char* op = "moe_seq_aux_loss";
  const AuxArgs a = check_aux(logits, topk_idx, seqs, whole, op);
  if (a.dev == Device::cpu)
    return cpu::moe_seq_aux_loss(logits, a.idx, a.K, a.cu, coeff, 0.0, nullptr, whole);
  double loss = 0;
  HLM_CUDA_PATH(op, loss = cuda::moe_seq_aux_loss(dev_input(logits), dev_input(topk_idx), a.cu,
                                                  coeff, 0.0, nullptr, whole));
  return loss;
}

Tensor moe_seq_aux_loss_backward(const Tensor& logits, const Tensor& topk_idx,
                                 const SeqLayout& seqs, double coeff, double dloss,
                                 const MoeAuxWhole* whole) {
  const char* op = "moe_seq_aux_loss_backward";
  const AuxArgs a = check_aux(logits, topk_idx, seqs, whole, op);
  Tensor dl = detail::new_output(logits.shape(), detail::compute_dtype(logits.dtype()), a.dev);
  if (a.dev == Device::cpu)
    cpu::moe_seq_aux_loss(logits, a.idx, a.K, a.cu, coeff, dloss, &dl, whole);
  else
    HLM_CUDA_PATH(op, cuda::moe_seq_aux_loss(dev_input(logits), dev_input(topk_idx), a.cu, coeff,
                                             dloss, &dl, whole));
  return dl;
}

// ---- clamped SwiGLU -----------------------------------------------------------------------------
Tensor swiglu_clamped_forward(const Tensor& gu, double limit) {
  return swiglu_clamped_forward(gu, limit, gu.dtype());
}

Tensor swiglu_clamped_forward(const Tensor& gu_, double limit, DType out_dtype) {
  const char* op = "swiglu_clamped_forward";
  const Shape hs = check_swiglu(gu_, op);
  HLM_CHECK(out_dtype == gu_.dtype() || (out_dtype == DType::bf16 && gu_.dtype() == DType::f32),
            "{}: h is written in gu's dtype or, for an f32 gu, bf16; asked for {} from {}", op,
            dtype_name(out_dtype), gu_.describe());
  const Tensor gu = gu_.is_cpu() ? gu_.contiguous() : dev_input(gu_);
  if (gu.is_cpu() && out_dtype != gu.dtype()) {
    Tensor h = detail::new_output(hs, gu.dtype(), gu.device());
    cpu::swiglu_clamped_forward(gu, limit, h);
    return h.to(out_dtype);
  }
  Tensor h = detail::new_output(hs, out_dtype, gu.device());
  HLM_DISPATCH(op, gu.device(), swiglu_clamped_forward, gu, limit, h);
  return h;
}

Tensor swiglu_clamped_backward(const Tensor& gu_, const Tensor& dh_, double limit) {
  const char* op = "swiglu_clamped_backward";
  const Shape hs = check_swiglu(gu_, op);
  require_real_dev(dh_, op, "dh");
  detail::require_shape(dh_, hs, op, "dh");
  const Device dev = detail::one_device(op, {gu_, "gu"}, {{dh_, "dh"}});
  const bool cpu = dev == Device::cpu;
  const Tensor gu = cpu ? gu_.contiguous() : dev_input(gu_);
  const Tensor dh = cpu ? (dh_.dtype() == gu.dtype() ? dh_.contiguous() : dh_.to(gu.dtype()))
                        : dev_input(dh_, gu.dtype());
  Tensor dgu = detail::new_output(gu.shape(), gu.dtype(), dev);
  HLM_DISPATCH(op, dev, swiglu_clamped_backward, gu, dh, limit, dgu);
  return dgu;
}

// ---- experts ------------------------------------------------------------------------------------
namespace {

// eo [T, K, D] f32 / f64 (on CUDA also bf16) and, when defined, w [T, K] of its dtype (or f32
// when eo is bf16) and device.
void check_combine(const Tensor& eo, const Tensor& w, const char* op) {
  require_real_dev(eo, op, "eo");
  HLM_CHECK(eo.dim() == 3, "{}: eo must be [T, K, D], got {}", op, eo.describe());
  if (!w.defined()) return;
  require_real_dev(w, op, "w");
  HLM_CHECK(w.dtype() == eo.dtype() || (eo.dtype() == DType::bf16 && w.dtype() == DType::f32),
            "{}: w must have the dtype of eo ({}){}, got {}", op, dtype_name(eo.dtype()),
            eo.dtype() == DType::bf16 ? " or f32" : "", w.describe());
  detail::require_same_device(w, eo, op, "w", "eo");
  detail::require_shape(w, {eo.size(0), eo.size(1)}, op, "w");
}

// A tensor of eo's dtype, device and of shape s (shared, dout).
void check_like_eo(const Tensor& t, const Tensor& eo, const Shape& s, const char* op,
                   const char* what) {
  require_real_dev(t, op, what);
  detail::require_same_dtype(t, eo, op, what, "eo");
  detail::require_same_device(t, eo, op, what, "eo");
  detail::require_shape(t, s, op, what);
}

}  // namespace

Tensor moe_combine(const Tensor& eo_, const Tensor& w_, const Tensor& shared_) {
  const char* op = "moe_combine";
  check_combine(eo_, w_, op);
  const int64_t T = eo_.size(0), D = eo_.size(2);
  if (shared_.defined()) check_like_eo(shared_, eo_, {T, D}, op, "shared");
  Tensor out = detail::new_output({T, D}, eo_.dtype(), eo_.device());
  if (!eo_.is_cpu()) {
    HLM_CUDA_PATH(op, cuda::moe_combine(dev_input(eo_), dev_input(w_), dev_input(shared_), out));
    return out;
  }
  const Tensor eo = eo_.contiguous(), w = w_.defined() ? w_.contiguous() : Tensor(),
               shared = shared_.defined() ? shared_.contiguous() : Tensor();
  cpu::moe_combine(eo, w, shared, out);
  return out;
}

MoeCombineGrads moe_combine_backward(const Tensor& dout_, const Tensor& eo_, const Tensor& w_) {
  const char* op = "moe_combine_backward";
  check_combine(eo_, w_, op);
  HLM_CHECK(w_.defined(), "{}: w is undefined", op);
  check_like_eo(dout_, eo_, {eo_.size(0), eo_.size(2)}, op, "dout");
  MoeCombineGrads r{detail::new_output(w_.shape(), w_.dtype(), eo_.device()),
                    detail::new_output(eo_.shape(), eo_.dtype(), eo_.device())};
  if (!eo_.is_cpu()) {
    HLM_CUDA_PATH(op,
                  cuda::moe_combine_backward(dev_input(dout_), dev_input(eo_), dev_input(w_), r));
    return r;
  }
  cpu::moe_combine_backward(dout_.contiguous(), eo_.contiguous(), w_.contiguous(), r);
  return r;
}

Tensor moe_experts_forward(const Tensor& x, const MoeWeights& w, const Tensor& topk_idx,
                           const Tensor& topk_weight, double swiglu_limit, MoeSaved& saved) {
  const char* op = "moe_experts_forward";
  ExpertDims d = check_experts(x, w, op);
  const std::vector<int64_t> idx = check_topk_idx(topk_idx, d.T, d.E, op, "topk_idx", false);
  d.K = topk_idx.size(1);
  require_real_dev(topk_weight, op, "topk_weight");
  detail::require_shape(topk_weight, topk_idx.shape(), op, "topk_weight");
  const Device dev =
      detail::one_device(op, {x, "x"}, {{topk_idx, "topk_idx"}, {topk_weight, "topk_weight"}});
  Tensor out = detail::new_output({d.T, d.D}, detail::compute_dtype(x.dtype()), dev);
  if (dev == Device::cpu)
    cpu::moe_experts_forward(x, w, idx, d.K, topk_weight, swiglu_limit, out, saved);
  else
    HLM_CUDA_PATH(op, cuda::moe_experts_forward(x, w, dev_input(topk_idx), idx, topk_weight,
                                                swiglu_limit, out, saved));
  return out;
}

MoeGrads moe_experts_backward(const MoeSaved& s, const MoeWeights& w, const Tensor& dout,
                              MoeWeightGrads& g) {
  const char* op = "moe_experts_backward";
  HLM_CHECK(s.x.defined() && s.eo.defined(), "{}: saved state is empty (run the forward)", op);
  ExpertDims d = check_experts(s.x, w, op);
  d.K = s.topk_idx.size(1);
  HLM_CHECK(s.gu.defined() && s.gu.shape() == Shape({d.T, d.K, 2 * d.I}),
            "{}: saved state does not match the weights (gu {}, expected [{}, {}, {}])", op,
            s.gu.describe(), d.T, d.K, 2 * d.I);
  require_real_dev(dout, op, "dout");
  detail::require_shape(dout, {d.T, d.D}, op, "dout");
  check_acc(g.dgate_up, s.x, w.gate_up.shape(), op, "g.dgate_up");
  check_acc(g.ddown, s.x, w.down.shape(), op, "g.ddown");
  if (d.shared) {
    check_acc(g.dshared_gate_up, s.x, w.shared_gate_up.shape(), op, "g.dshared_gate_up");
    check_acc(g.dshared_down, s.x, w.shared_down.shape(), op, "g.dshared_down");
  }
  const Device dev = detail::one_device(op, {s.x, "saved x"},
                                        {{dout, "dout"},
                                         {s.topk_idx, "saved topk_idx"},
                                         {s.topk_weight, "saved topk_weight"},
                                         {s.gu, "saved gu"},
                                         {s.h, "saved h"},
                                         {s.eo, "saved eo"},
                                         {s.sgu, "saved sgu"},
                                         {s.sh, "saved sh"}});
  const DType dt = detail::compute_dtype(s.x.dtype());
  MoeGrads r{detail::new_output({d.T, d.D}, dt, dev), detail::new_output({d.T, d.K}, dt, dev)};
  if (dev == Device::cpu) {
    cpu::moe_experts_backward(s, w, dout, g, r);
    return r;
  }
  // The saved selection's values (the experts' row counts for the grouped GEMMs), checked.
  const std::vector<int64_t> idx =
      check_topk_idx(s.topk_idx, d.T, d.E, op, "saved topk_idx", false);
  HLM_CUDA_PATH(op, cuda::moe_experts_backward(s, w, idx, dout, g, r));
  return r;
}

Tensor moe_routed_experts(const Tensor& x, const Tensor& gate_up, const Tensor& down,
                          const Tensor& topk_idx, double swiglu_limit, bool round_bf16) {
  const char* op = "moe_routed_experts";
  for (auto [t, what] :
       {std::pair<const Tensor*, const char*>{&x, "x"}, {&gate_up, "gate_up"}, {&down, "down"}})
    HLM_CHECK(t->defined(), "{}: {} is undefined", op, what);
  HLM_CHECK(x.dim() == 2, "{}: x must be [T, D], got {}", op, x.describe());
  ExpertDims d{};
  d.T = x.size(0);
  d.D = x.size(1);
  HLM_CHECK(gate_up.dim() == 3 && gate_up.size(2) == d.D && gate_up.size(1) % 2 == 0 &&
                gate_up.size(0) >= 1 && gate_up.size(1) >= 2,
            "{}: gate_up must be [E, 2I, D = {}], got {}", op, d.D, gate_up.describe());
  d.E = gate_up.size(0);
  d.I = gate_up.size(1) / 2;
  detail::require_shape(down, {d.E, d.D, d.I}, op, "down");
  detail::one_device(op, {x, "x"}, {{gate_up, "gate_up"}, {down, "down"}});
  HLM_CHECK(!std::isnan(swiglu_limit), "{}: swiglu_limit must not be NaN", op);
  if (round_bf16) {
    HLM_CHECK(x.dtype() == DType::f32, "{} (round_bf16): x must be f32, got {}", op, x.describe());
    for (auto [t, what] :
         {std::pair<const Tensor*, const char*>{&gate_up, "gate_up"}, {&down, "down"}})
      HLM_CHECK(t->dtype() == DType::f32 || t->dtype() == DType::bf16,
                "{} (round_bf16): {} must be f32 or bf16, got {}", op, what, t->describe());
  } else {
    HLM_CHECK(x.dtype() == DType::f32 || x.dtype() == DType::f64,
              "{}: x must be f32 or f64, got {}", op, x.describe());
    detail::require_same_dtype(gate_up, x, op, "gate_up", "x");
    detail::require_same_dtype(down, x, op, "down", "x");
  }
  detail::require_int(topk_idx, op, "topk_idx");
  HLM_CHECK(topk_idx.dim() == 2 && topk_idx.size(0) == d.T && topk_idx.size(1) >= 1,
            "{}: topk_idx must be [T = {}, K], got {}", op, d.T, topk_idx.describe());
  const Device dev = detail::one_device(op, {x, "x"}, {{topk_idx, "topk_idx"}});
  const int64_t N = d.T * topk_idx.size(1);
  Tensor eo = detail::new_output({N, d.D}, x.dtype(), dev);
  if (N == 0) return eo;
  if (dev == Device::cpu) {
    const std::vector<int64_t> idx = check_topk_idx(topk_idx, d.T, d.E, op, "topk_idx", false);
    cpu::moe_routed_experts(x.contiguous(), gate_up.contiguous(), down.contiguous(), idx,
                            swiglu_limit, round_bf16, eo);
  } else {
    HLM_CUDA_PATH(op, cuda::moe_routed_experts(dev_input(x), dev_input(gate_up), dev_input(down),
                                               dev_input(topk_idx), swiglu_limit, round_bf16, eo));
  }
  return eo;
}

}  // namespace hlm::ops
