// The launcher of the CUDA chunked KDA backward (params.cuh; docs/kda.md, "CUDA chunked backward"),
// C = 64: the semantics of the CPU ops::kda_chunk_backward (src/ops/cpu/kda_chunk.cpp), stage by
// stage.
//
// Notation as in intra.cu (per chunk of L <= C tokens, value head h, rows r, s from the chunk
// start, padded rows exactly zero; S = h[c] the state at the chunk start, dS' = dh[c] the
// gradient w.r.t. the state at the chunk END):
//   B1 recompute (the forward's kernels, launch.cu): G, q^, k^, beta, A_qk, M^-1, W, U, qg, kg,
//   exp(G_L),
//      h[c] and V_new of every chunk.
//   B3 reverse state pass, per (sequence, value head, 32-wide V tile), chunks last to first, dS
//      starting at d_final_state (or 0):
//        dh[c] = dS;  dV_new = A_qk^T dO + kg dS;  dS <- Diag(exp G_L) dS + qg^T dO - W^T dV_new
//      and dinitial_state = the final dS.
//   B4a per (chunk, head, slice of 64 channels), contractions over V:
//        dA_qk = tril_incl(dO V_new^T);  dq = scale exp(G) (dO S^T);  dk = exp(G_L - G) (V_new
//        dS'^T) dW = -dV_new S^T;  dG = q dq - k dk;  dG_{L-1} += sum_r k dk + exp(G_L) rowsum(S .
//        dS')
//   B4b per (chunk, head, side: keys | values), WY backward: dKB = M^-T dW, dVB = M^-T dV_new,
//        dA_kk = -stril(dKB W^T + dVB U^T), dv = beta dVB, dbeta = v.dVB + (exp(G) k).dKB,
//        dk += beta exp(G) dKB, dG += beta exp(G) k dKB (dA_kk and dbeta as per-side partials)
//   B4c per (chunk, head, slice of 64 channels), intra backward from a = scale dA_qk (s <= r)
//      and b = dA_kk (s < r), with E_rs = exp(G_r - G_s) per channel:
//        dq_r += sum_s a_rs k_s E_rs;  R_r = sum_s b_rs k_s E_rs;  dk_r += beta_r R_r;
//        dbeta_r += k_r . R_r;  P_s = sum_r (a_rs q_r + beta_r b_rs k_r) E_rs;  dk_s += P_s;
//        dG_r += q_r dq^intra_r + beta_r k_r R_r;  dG_s -= k_s P_s
//      then dg = reverse cumsum of dG in the chunk, the fused gate's chain rule (dz, per-chunk
//      partial sums of dA_log and d dt_bias); dbeta^intra and dA_log as per-slice partials.
//   B5 per (chunk, qk head): dq, dk summed over the value heads of the group in order, then the
//      L2-norm backward dx = rstd (dx^ - x^ (x^ . dx^)); dbeta = the WY part + the slices'
//      partials, then the beta sigmoid's chain rule.
//   B6 per value head: dA_log, d dt_bias = the per-chunk partials summed in chunk order.
//
// exp safety (docs/kda.md, "exp safety and other numerical pitfalls"), as in the forward: exp(-G)
// alone is never formed. B4c splits E_rs per 16-row block i with the reference row n = 16 i: E_rs =
// exp(G_r - G_n) exp(G_n - G_s), both factors <= 1 for s < n (off-diagonal blocks); inside the
// diagonal block the split is used while its span max_d (G_n - G_s) <= 80 nats (both factors finite
// and normal; the coefficients above the diagonal are exact zeros, never multiplied with an
// infinite factor), otherwise E_rs is formed per element for s <= r only. The other factors are
// exp(G) and exp(G_L - G), <= 1.
//
// Determinism: no atomics; every reduction has a fixed order (per-thread loops, butterfly
// shuffles over fixed lanes, chunk-ordered sums of partials); every per-token result depends only
// on its own chunk's data and its sequence's state chain, so a sequence gets the same bits alone
// as in a packed batch. FP32 states and workspace; the matrix products on tensor cores
// (mma_tf32.cuh: TF32 operands, 3xTF32 in the intra backward and with exact_bf16_products, FP32
// accumulation, for bf16 inputs; FP32 FMA for f32), the
// elementwise work in FP32.
// The stages' kernels: B3 bwd_state.cu, B4a bwd_products.cu, B4b bwd_wy.cu, B4c bwd_intra.cu,
// B5 / B6 bwd_finish.cu. This file plans the workspace, checks the caller's buffers and launches
// the stages in order.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/device.h"
#include "ops/cuda/kda_chunk/common.cuh"
#include "ops/cuda/kda_chunk/heuristics.h"
#include "ops/cuda/kda_chunk/params.cuh"
#include "ops/dispatch.h"

namespace hlm::ops {
namespace cuda::kda {
namespace {

constexpr const char* kOp = "kda_chunk_backward_cuda";

// A caller buffer (checked) or a fresh f32 CUDA tensor.
Tensor output(const Tensor& given, const Shape& shape, const char* what) {
  return output_buffer(given, DType::f32, shape, kOp, what);
}

}  // namespace

BwdLayout bwd_layout(const Plan& p) {
  const int64_t tasks = p.NC * p.HV, C = kC;
  BwdLayout l;
  Offsets s;  // the intermediates
  l.meta = s.take(int64_t(p.meta.size()));
  l.qg = s.take(tasks * C * p.K);
  l.kg = s.take(tasks * C * p.K);
  l.w = s.take(tasks * C * p.K);
  l.u = s.take(tasks * C * p.V);
  l.aqk = s.take(tasks * C * C);
  l.gl = s.take(tasks * p.K);
  l.G = s.take(tasks * C * p.K);
  l.qn = s.take(tasks * C * p.K);
  l.kn = s.take(tasks * C * p.K);
  l.beta = s.take(tasks * C);
  l.minv = s.take(tasks * C * C);
  l.h = s.take(tasks * p.K * p.V);
  l.vnew = s.take(tasks * C * p.V);
  l.ht = s.take(p.N * p.HV * p.K * p.V);
  l.saved = s.end;
  Offsets b;  // the scratch
  l.dvnew = b.take(tasks * C * p.V);
  l.dh = b.take(tasks * p.K * p.V);
  l.daqk = b.take(tasks * C * C);
  l.dakk = b.take(tasks * C * C);
  l.dakv = b.take(tasks * C * C);
  l.dw = b.take(tasks * C * p.K);
  l.dq = b.take(tasks * C * p.K);
  l.dk = b.take(tasks * C * p.K);
  l.dG = b.take(tasks * C * p.K);
  l.dbw = b.take(tasks * 2 * C);
  l.dbi = b.take(tasks * slices(int(p.K)) * C);
  l.pA = b.take(tasks * slices(int(p.K)));
  l.pdt = b.take(tasks * p.K);
  l.scratch = b.end;
  return l;
}

int64_t saved_floats(const Plan& p) {
  return bwd_layout(p).saved;
}

Intermediates saved_intermediates(const Plan& p, float* base) {
  const BwdLayout l = bwd_layout(p);
  Intermediates x;
  x.meta = reinterpret_cast<const int*>(base + l.meta);
  x.qg = base + l.qg, x.kg = base + l.kg, x.w = base + l.w, x.u = base + l.u;
  x.aqk = base + l.aqk, x.gl = base + l.gl, x.G = base + l.G, x.qn = base + l.qn;
  x.kn = base + l.kn, x.beta = base + l.beta, x.minv = base + l.minv, x.h = base + l.h;
  x.vnew = base + l.vnew, x.ht = base + l.ht;
  return x;
}

BwdCall bwd_plan(const KdaArgs& a, const KdaDims& d, const Tensor& d_o, const Tensor& d_final_state,
                 const KdaChunkBwdCudaBuffers& buffers) {
  BwdCall c;
  c.plan = plan(d);
  c.layout = bwd_layout(c.plan);
  const Plan& pl = c.plan;
  const BwdLayout& l = c.layout;

  KdaGrads& g = c.grads;
  g.dq = output(buffers.dq, {pl.T, pl.H, pl.K}, "buffers.dq");
  g.dk = output(buffers.dk, {pl.T, pl.H, pl.K}, "buffers.dk");
  g.dv = output(buffers.dv, {pl.T, pl.HV, pl.V}, "buffers.dv");
  g.dg = output(buffers.dg, {pl.T, pl.HV, pl.K}, "buffers.dg");
  g.dbeta = output(buffers.dbeta, {pl.T, pl.HV}, "buffers.dbeta");
  g.dinitial_state =
      output(buffers.dinitial_state, {pl.N, pl.HV, pl.K, pl.V}, "buffers.dinitial_state");
  if (a.gate && a.A_log.defined()) g.dA_log = output(buffers.dA_log, {pl.HV}, "buffers.dA_log");
  if (a.gate && a.dt_bias.defined())
    g.ddt_bias = output(buffers.ddt_bias, {pl.HV * pl.K}, "buffers.ddt_bias");

  const bool saved = buffers.saved.defined(), kept = buffers.kept.defined();
  HLM_CHECK(!(saved && kept), "{}: buffers.saved and buffers.kept are alternatives; give one", kOp);
  c.workspace = workspace_buffer(buffers.workspace, saved ? l.scratch : l.saved + l.scratch, kOp,
                                 "buffers.workspace");
  if (saved) {  // B1 done by the forward
    c.inter = workspace_buffer(buffers.saved, l.saved, kOp, "buffers.saved");
    c.x = saved_intermediates(pl, c.inter.data<float>());
    c.scratch = c.workspace.data<float>();
  } else {  // B1: the forward's kernels, storing what the backward needs
    c.inter = c.workspace;
    float* sv = c.inter.data<float>();
    c.x = saved_intermediates(pl, sv);
    if (kept) {  // A_qk and M^-1 as the forward kept them
      const Tensor kb = workspace_buffer(buffers.kept, kept_floats(pl), kOp, "buffers.kept");
      c.x.aqk = kb.data<float>();
      c.x.minv = c.x.aqk + pl.NC * pl.HV * kC * kC;
      c.x.a_kept = true;
    }
    static_assert(sizeof(int32_t) == sizeof(float), "the chunk table shares the f32 workspace");
    device_copy(sv + l.meta, Device::cuda, pl.meta.data(), Device::cpu,
                pl.meta.size() * sizeof(int32_t));
    c.scratch = sv + l.saved;
    c.recompute = true;
  }
  return c;
}

template <class Tin>
BwdParams<Tin> bwd_params(const KdaArgs& a, const BwdCall& c, const Tensor& d_o,
                          const Tensor& d_final) {
  const Plan& pl = c.plan;
  const BwdLayout& l = c.layout;
  const Intermediates& x = c.x;
  const KdaGrads& g = c.grads;
  float* ws = c.scratch;
  BwdParams<Tin> bp{};
  bp.q = static_cast<const Tin*>(a.q.raw());
  bp.k = static_cast<const Tin*>(a.k.raw());
  bp.v = static_cast<const Tin*>(a.v.raw());
  bp.z = static_cast<const Tin*>(a.g.raw());
  bp.dO = static_cast<const Tin*>(d_o.raw());
  bp.dht = d_final.defined() ? d_final.data<float>() : nullptr;
  bp.A_log = (a.gate && a.A_log.defined()) ? a.A_log.data<float>() : nullptr;
  bp.dt_bias = (a.gate && a.dt_bias.defined()) ? a.dt_bias.data<float>() : nullptr;
  bp.chunk_bos = x.meta;
  bp.chunk_len = x.meta + pl.NC;
  bp.first_chunk = x.meta + 2 * pl.NC;
  bp.qg = x.qg, bp.kg = x.kg, bp.w = x.w, bp.u = x.u;
  bp.aqk = x.aqk, bp.gl = x.gl, bp.G = x.G, bp.qn = x.qn;
  bp.kn = x.kn, bp.beta = x.beta, bp.minv = x.minv, bp.h = x.h;
  bp.vnew = x.vnew;
  bp.dvnew = ws + l.dvnew, bp.dh = ws + l.dh, bp.daqk = ws + l.daqk, bp.dakk = ws + l.dakk;
  bp.dakv = ws + l.dakv;
  bp.dw = ws + l.dw, bp.dq = ws + l.dq, bp.dk = ws + l.dk, bp.dG = ws + l.dG;
  bp.dbw = ws + l.dbw, bp.dbi = ws + l.dbi, bp.pA = ws + l.pA, bp.pdt = ws + l.pdt;
  bp.o_dq = g.dq.data<float>();
  bp.o_dk = g.dk.data<float>();
  bp.o_dv = g.dv.data<float>();
  bp.o_dg = g.dg.data<float>();
  bp.o_dbeta = g.dbeta.data<float>();
  bp.o_dh0 = g.dinitial_state.data<float>();
  bp.o_dA = g.dA_log.defined() ? g.dA_log.data<float>() : nullptr;
  bp.o_ddt = g.ddt_bias.defined() ? g.ddt_bias.data<float>() : nullptr;
  bp.NC = int(pl.NC), bp.H = int(pl.H), bp.HV = int(pl.HV), bp.V = int(pl.V);
  bp.scale = pl.scale;
  bp.gate = !a.gate                            ? kGateNone
            : *a.gate == KdaGateKind::standard ? kGateStandard
                                               : kGateLowerBound;
  bp.lower_bound = float(a.lower_bound);
  bp.l2norm = a.use_qk_l2norm;
  bp.beta_logits = a.beta_logits;
  return bp;
}

template BwdParams<float> bwd_params<float>(const KdaArgs&, const BwdCall&, const Tensor&,
                                            const Tensor&);
template BwdParams<__nv_bfloat16> bwd_params<__nv_bfloat16>(const KdaArgs&, const BwdCall&,
                                                            const Tensor&, const Tensor&);

namespace {

// B3 .. B6 in order.
template <class Tin>
void run_stages(const KdaArgs& a, const BwdCall& c, const Tensor& d_o, const Tensor& d_final,
                unsigned tf32) {
  const Plan& pl = c.plan;
  const BwdParams<Tin> bp = bwd_params<Tin>(a, c, d_o, d_final);
  launch_state_bwd<Tin>(pl, bp, tf32);
  if (pl.NC > 0) {
    launch_bwd_products<Tin>(pl, bp, tf32);
    launch_wy_bwd<Tin>(pl, bp, tf32);
    launch_intra_bwd<Tin>(pl, bp, tf32);
    launch_qk_bwd<Tin>(pl, bp);
  }
  if (bp.o_dA || bp.o_ddt) launch_gate_sums<Tin>(pl, bp);
}

}  // namespace

KdaGrads backward(const KdaArgs& a, const KdaDims& d, const Tensor& d_o,
                  const Tensor& d_final_state, const KdaChunkBwdCudaBuffers& buffers,
                  unsigned tf32) {
  const BwdCall c = bwd_plan(a, d, d_o, d_final_state, buffers);
  if (c.recompute) recompute(a, c.plan, c.x, tf32);
  if (a.q.dtype() == DType::bf16)
    run_stages<__nv_bfloat16>(a, c, d_o, d_final_state, tf32);
  else
    run_stages<float>(a, c, d_o, d_final_state, tf32);
  device_synchronize();
  const cudaError_t err = cudaGetLastError();
  HLM_CHECK(err == cudaSuccess, "{}: kernels: {}", kOp, cudaGetErrorString(err));
  return c.grads;
}

void chunk_backward(const KdaArgs& a, const KdaDims& d, const Tensor& d_o,
                    const Tensor& d_final_state, const Tensor& saved, KdaSave what, KdaGrads& g) {
  KdaChunkBwdCudaBuffers b;
  (what == KdaSave::all ? b.saved : b.kept) = saved;
  b.dq = g.dq, b.dk = g.dk, b.dv = g.dv, b.dg = g.dg, b.dbeta = g.dbeta;
  b.dinitial_state = g.dinitial_state, b.dA_log = g.dA_log, b.ddt_bias = g.ddt_bias;
  backward(a, d, d_o, d_final_state, b, tf32_stages(a.exact_bf16_products));
}

}  // namespace cuda::kda

int64_t kda_chunk_bwd_cuda_workspace_floats(const KdaArgs& a, bool saved) {
  const cuda::kda::BwdLayout l =
      cuda::kda::bwd_layout(cuda::kda::plan(cuda::kda::check_call(a, cuda::kda::kOp)));
  return saved ? l.scratch : l.saved + l.scratch;
}

int64_t kda_chunk_cuda_saved_floats(const KdaArgs& a) {
  return cuda::kda::saved_floats(cuda::kda::plan(cuda::kda::check_call(a, cuda::kda::kOp)));
}

KdaGrads kda_chunk_backward_cuda(const KdaArgs& a, const Tensor& d_o, const Tensor& d_final_state,
                                 const KdaChunkBwdCudaBuffers& buffers) {
  const KdaDims d = cuda::kda::check_call(a, cuda::kda::kOp);
  kda_check_grads(a, d, d_o, d_final_state, cuda::kda::kOp);
  return cuda::kda::backward(a, d, d_o, d_final_state, buffers,
                             cuda::kda::tf32_stages(a.exact_bf16_products));
}

}  // namespace hlm::ops
