// The launcher of the CUDA chunked KDA forward (params.cuh): the chunk table, the forward's
// workspace, the parameter blocks of the intra (intra.cu) and state (state.cu) stages, and the
// entry points. The arguments are checked by ops::kda_check (ops/kda.cpp); the caller's buffers
// here.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/device.h"
#include "ops/cuda/kda_chunk/common.cuh"
#include "ops/cuda/kda_chunk/heuristics.h"
#include "ops/cuda/kda_chunk/params.cuh"
#include "ops/dispatch.h"

namespace hlm::ops {
namespace cuda::kda {
namespace {

constexpr const char* kOp = "kda_chunk_forward_cuda";

}  // namespace

Plan plan(const KdaDims& d) {
  Plan p;
  p.T = d.T, p.H = d.H, p.K = d.K, p.HV = d.HV, p.V = d.V, p.N = d.N;
  p.scale = float(d.scale);
  // Chunk table: chunks never cross a sequence boundary; the last one of a sequence may be short.
  const SeqLayout::ChunkTable& table = d.seqs.chunks(kC);
  p.NC = table.num_chunks;
  p.meta = table.meta;
  return p;
}

FwdLayout fwd_layout(const Plan& p) {
  const int64_t tasks = p.NC * p.HV;
  FwdLayout l;
  Offsets s;
  l.qg = s.take(tasks * kC * p.K);
  l.kg = s.take(tasks * kC * p.K);
  l.w = s.take(tasks * kC * p.K);
  l.u = s.take(tasks * kC * p.V);
  l.aqk = s.take(tasks * kC * kC);
  l.gl = s.take(tasks * p.K);
  l.meta = s.take(int64_t(p.meta.size()));  // int32 stored in f32 slots (same size)
  l.total = s.end;
  return l;
}

int64_t kept_floats(const Plan& p) {
  return 2 * p.NC * p.HV * kC * kC;
}

template <class Tin>
IntraParams<Tin> intra_params(const KdaArgs& a, const Plan& pl, const Intermediates& x) {
  IntraParams<Tin> ip;
  ip.q = static_cast<const Tin*>(a.q.raw());
  ip.k = static_cast<const Tin*>(a.k.raw());
  ip.v = static_cast<const Tin*>(a.v.raw());
  ip.g = static_cast<const Tin*>(a.g.raw());
  ip.beta = static_cast<const Tin*>(a.beta.raw());
  ip.gate = !a.gate                            ? kGateNone
            : *a.gate == KdaGateKind::standard ? kGateStandard
                                               : kGateLowerBound;
  ip.A_log = (a.gate && a.A_log.defined()) ? a.A_log.data<float>() : nullptr;
  ip.dt_bias = (a.gate && a.dt_bias.defined()) ? a.dt_bias.data<float>() : nullptr;
  ip.chunk_bos = x.meta;
  ip.chunk_len = x.meta + pl.NC;
  ip.qg = x.qg;
  ip.kg = x.kg;
  ip.w = x.w;
  ip.u = x.u;
  ip.aqk = x.aqk;
  ip.gl = x.gl;
  ip.G_out = x.G;
  ip.qn_out = x.qn;
  ip.kn_out = x.kn;
  ip.beta_out = x.beta;
  ip.minv_out = x.a_kept ? nullptr : x.minv;
  ip.minv_in = x.a_kept ? x.minv : nullptr;
  HLM_CHECK(!x.G == !x.qn && !x.G == !x.kn && !x.G == !x.beta, "{}: G, qn, kn, beta go together",
            kOp);
  ip.H = int(pl.H), ip.HV = int(pl.HV), ip.V = int(pl.V);
  ip.scale = pl.scale;
  ip.lower_bound = float(a.lower_bound);
  ip.l2norm = a.use_qk_l2norm;
  ip.beta_logits = a.beta_logits;
  ip.vec16 = aligned16(a.q) && aligned16(a.k) && aligned16(a.v) && aligned16(a.g) &&
             (!ip.dt_bias || aligned16(a.dt_bias));
  return ip;
}

template <class Tin>
StateParams<Tin> state_params(const KdaArgs& a, const Plan& pl, const Intermediates& x, Tin* o) {
  StateParams<Tin> sp;
  sp.qg = x.qg;
  sp.kg = x.kg;
  sp.w = x.w;
  sp.u = x.u;
  sp.aqk = x.aqk;
  sp.gl = x.gl;
  sp.h0 = a.initial_state.defined() ? a.initial_state.data<float>() : nullptr;
  sp.chunk_bos = x.meta;
  sp.chunk_len = x.meta + pl.NC;
  sp.first_chunk = x.meta + 2 * pl.NC;
  sp.o = o;
  sp.ht = x.ht;
  sp.h_out = x.h;
  sp.vnew_out = x.vnew;
  sp.HV = int(pl.HV), sp.V = int(pl.V);
  return sp;
}

template IntraParams<float> intra_params<float>(const KdaArgs&, const Plan&, const Intermediates&);
template IntraParams<__nv_bfloat16> intra_params<__nv_bfloat16>(const KdaArgs&, const Plan&,
                                                                const Intermediates&);
template StateParams<float> state_params<float>(const KdaArgs&, const Plan&, const Intermediates&,
                                                float*);
template StateParams<__nv_bfloat16> state_params<__nv_bfloat16>(const KdaArgs&, const Plan&,
                                                                const Intermediates&,
                                                                __nv_bfloat16*);

namespace {

// The intra stage (for chunks to do), then the state pass.
template <class Tin>
void run_kernels(const KdaArgs& a, const Plan& pl, const Intermediates& x, Tin* o, unsigned tf32) {
  if (pl.NC > 0) launch_intra<Tin>(pl, intra_params<Tin>(a, pl, x), tf32);
  launch_state<Tin>(pl, state_params<Tin>(a, pl, x, o), tf32);
}

}  // namespace

void recompute(const KdaArgs& a, const Plan& p, const Intermediates& x, unsigned tf32) {
  if (a.q.dtype() == DType::bf16)
    run_kernels<__nv_bfloat16>(a, p, x, nullptr, tf32);
  else
    run_kernels<float>(a, p, x, nullptr, tf32);
}

KdaOutput forward(const KdaArgs& a, const KdaDims& d, const KdaChunkCudaBuffers& buffers,
                  unsigned tf32) {
  const Plan pl = plan(d);
  const FwdLayout lay = fwd_layout(pl);
  const DType dt = a.q.dtype();

  KdaOutput out;
  out.o = output_buffer(buffers.o, dt, {pl.T, pl.HV, pl.V}, kOp, "buffers.o");
  out.final_state = output_buffer(buffers.final_state, DType::f32, {pl.N, pl.HV, pl.K, pl.V}, kOp,
                                  "buffers.final_state");
  // The intermediates: in the caller's `saved` buffer in the backward's layout (with G, q^, k^,
  // beta, M^-1, h and V_new), or in the forward's own workspace.
  const bool save = buffers.saved.defined(), keep = buffers.kept.defined();
  HLM_CHECK(!(save && keep), "{}: buffers.saved and buffers.kept are alternatives; give one", kOp);
  const Tensor ws = save ? workspace_buffer(buffers.saved, saved_floats(pl), kOp, "buffers.saved")
                         : workspace_buffer(buffers.workspace, lay.total, kOp);
  float* wsp = ws.data<float>();
  Intermediates x;
  if (save) {
    x = saved_intermediates(pl, wsp);
  } else {
    x.meta = reinterpret_cast<const int*>(wsp + lay.meta);
    x.qg = wsp + lay.qg;
    x.kg = wsp + lay.kg;
    x.w = wsp + lay.w;
    x.u = wsp + lay.u;
    x.aqk = wsp + lay.aqk;
    x.gl = wsp + lay.gl;
  }
  if (keep) {  // A_qk and M^-1 into the caller's buffer, for the backward
    const Tensor kb = workspace_buffer(buffers.kept, kept_floats(pl), kOp, "buffers.kept");
    x.aqk = kb.data<float>();
    x.minv = x.aqk + pl.NC * pl.HV * kC * kC;
  }
  static_assert(sizeof(int32_t) == sizeof(float), "the chunk table shares the f32 workspace");
  device_copy(const_cast<int*>(x.meta), Device::cuda, pl.meta.data(), Device::cpu,
              pl.meta.size() * sizeof(int32_t));
  x.ht = out.final_state.data<float>();
  if (dt == DType::bf16)
    run_kernels<__nv_bfloat16>(a, pl, x, static_cast<__nv_bfloat16*>(out.o.raw()), tf32);
  else
    run_kernels<float>(a, pl, x, out.o.data<float>(), tf32);
  return out;
}

void chunk_forward(const KdaArgs& a, const KdaDims& d, KdaOutput& out, Tensor* saved,
                   KdaSave what) {
  KdaChunkCudaBuffers b;
  b.o = out.o;
  b.final_state = out.final_state;
  Tensor* buf = what == KdaSave::all ? &b.saved : &b.kept;
  if (saved) {
    const Plan pl = plan(d);
    *buf = detail::new_output({what == KdaSave::all ? saved_floats(pl) : kept_floats(pl)},
                              DType::f32, Device::cuda);
  }
  forward(a, d, b, tf32_stages(a.exact_bf16_products));
  if (saved) *saved = *buf;
}

}  // namespace cuda::kda

int64_t kda_chunk_cuda_workspace_floats(const KdaArgs& a) {
  return cuda::kda::fwd_layout(cuda::kda::plan(cuda::kda::check_call(a, cuda::kda::kOp))).total;
}

int64_t kda_chunk_cuda_kept_floats(const KdaArgs& a) {
  return cuda::kda::kept_floats(cuda::kda::plan(cuda::kda::check_call(a, cuda::kda::kOp)));
}

KdaOutput kda_chunk_forward_cuda(const KdaArgs& a, const KdaChunkCudaBuffers& buffers) {
  return cuda::kda::forward(a, cuda::kda::check_call(a, cuda::kda::kOp), buffers,
                            cuda::kda::tf32_stages(a.exact_bf16_products));
}

}  // namespace hlm::ops
