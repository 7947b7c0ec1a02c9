// A C interface to the CUDA chunked KDA kernels for bench/kda_chunk_bench.py, which times them
// and FLA's chunk_kda in one Python process with the same timer (triton.testing.do_bench) on the
// same input tensors. Built as libhlm_kda_bench.so when CUDA is on and the build is
// position-independent (-DCMAKE_POSITION_INDEPENDENT_CODE=ON); see bench/CMakeLists.txt.
//
// Life of a handle: hlm_kda_create copies the caller's device tensors (PyTorch's) into tensors of
// our own and allocates every output and workspace once, so that hlm_kda_forward /
// hlm_kda_forward_backward time the kernels alone; hlm_kda_set_save switches the forward to
// saving its intermediates for the backward (KdaChunkCudaBuffers::saved), which then skips its
// recompute, or to keeping A_qk and M^-1 (KdaChunkCudaBuffers::kept); hlm_kda_fetch copies the
// results back into the caller's tensors; hlm_kda_destroy frees everything. Functions return 0, or
// -1 with the message in hlm_kda_last_error().
//
// The TF32 study (kda_chunk_bench.py --tf32-stages; bench/kda_lab/README.md): with the
// environment variable HLM_KDA_TF32_STAGES set, every call runs the stages of that bit mask
// (ops/cuda/kda_chunk/heuristics.h, KdaStage) with plain TF32 bf16 products and the others with
// 3xTF32, read on every call; unset, the library's choice. A switch of this bench interface, not
// of the library.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "core/device.h"
#include "core/error.h"
#include "core/tensor.h"
#include "ops/cuda/kda_chunk/heuristics.h"
#include "ops/cuda/kda_chunk/params.cuh"
#include "ops/kda.h"

namespace {

using hlm::Device;
using hlm::DType;
using hlm::Shape;
using hlm::Tensor;

std::string g_error;

struct Handle {
  hlm::ops::KdaArgs args;
  hlm::ops::KdaChunkCudaBuffers fwd;
  hlm::ops::KdaChunkBwdCudaBuffers bwd;
  Tensor d_o, d_ht;
  hlm::ops::KdaOutput out;
  hlm::ops::KdaGrads grads;
};

// A contiguous CUDA tensor holding a copy of the caller's device memory.
Tensor copy_in(const void* src, const Shape& shape, DType dt) {
  Tensor t = Tensor::empty(shape, dt, Device::cuda);
  hlm::device_copy(t.raw(), Device::cuda, src, Device::cuda, t.nbytes());
  return t;
}

void copy_out(void* dst, const Tensor& t) {
  if (dst == nullptr || !t.defined()) return;
  hlm::device_copy(dst, Device::cuda, t.contiguous().raw(), Device::cuda, t.nbytes());
}

// The stages whose bf16 products run in plain TF32 (see the top of the file).
unsigned tf32_stages(const hlm::ops::KdaArgs& a) {
  if (const char* e = std::getenv("HLM_KDA_TF32_STAGES"))
    return unsigned(std::strtoul(e, nullptr, 0));
  return hlm::ops::cuda::kda::tf32_stages(a.exact_bf16_products);
}

hlm::ops::KdaOutput forward(const Handle& h) {
  const char* op = "hlm_kda_forward";
  return hlm::ops::cuda::kda::forward(h.args, hlm::ops::kda_check(h.args, op), h.fwd,
                                      tf32_stages(h.args));
}

template <class F>
int guarded(F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
    return -1;
  }
}

}  // namespace

extern "C" {

// The problem, as the caller's device pointers (contiguous, packed [T, ...] layouts):
//   q, k [T, H, K]; v [T, HV, V]; g [T, HV, K]; beta [T, HV], all of `dtype` (0 f32, 1 bf16);
//   h0 [N, HV, K, V] f32 or null; cu_seqlens_host [N+1] (host memory);
//   gate: 0 none (g is the log decay), 1 lower bound, 2 standard (g is the raw gate input, with
//   A_log [HV] f32 and dt_bias [HV*K] f32 on the device); d_o [T, HV, V] (dtype) and d_ht
//   [N, HV, K, V] f32 (null: no gradient of the final state) for the backward.
struct HlmKdaProblem {
  const void *q, *k, *v, *g, *beta;
  const float *A_log, *dt_bias, *h0;
  const int64_t* cu_seqlens_host;
  const void* d_o;
  const float* d_ht;
  int64_t T, H, HV, K, V, N;
  int32_t dtype, gate, use_qk_l2norm, beta_logits;
  double lower_bound, scale;
};

const char* hlm_kda_last_error() {
  return g_error.c_str();
}

int hlm_kda_has_backward() {
  return 1;
}

void* hlm_kda_create(const HlmKdaProblem* p) {
  Handle* h = nullptr;
  const int rc = guarded([&] {
    auto owned = std::make_unique<Handle>();
    const DType dt = p->dtype == 1 ? DType::bf16 : DType::f32;
    hlm::ops::KdaArgs& a = owned->args;
    a.q = copy_in(p->q, {p->T, p->H, p->K}, dt);
    a.k = copy_in(p->k, {p->T, p->H, p->K}, dt);
    a.v = copy_in(p->v, {p->T, p->HV, p->V}, dt);
    a.g = copy_in(p->g, {p->T, p->HV, p->K}, dt);
    a.beta = copy_in(p->beta, {p->T, p->HV}, dt);
    if (p->h0) a.initial_state = copy_in(p->h0, {p->N, p->HV, p->K, p->V}, DType::f32);
    a.seqs = hlm::SeqLayout::from_offsets(
        std::vector<int64_t>(p->cu_seqlens_host, p->cu_seqlens_host + p->N + 1), p->T);
    a.scale = p->scale;
    a.use_qk_l2norm = p->use_qk_l2norm != 0;
    a.beta_logits = p->beta_logits != 0;
    if (p->gate != 0) {
      a.gate = p->gate == 1 ? hlm::ops::KdaGateKind::lower_bound : hlm::ops::KdaGateKind::standard;
      a.A_log = copy_in(p->A_log, {p->HV}, DType::f32);
      if (p->dt_bias) a.dt_bias = copy_in(p->dt_bias, {p->HV * p->K}, DType::f32);
      a.lower_bound = p->lower_bound;
    }
    if (p->d_o) owned->d_o = copy_in(p->d_o, {p->T, p->HV, p->V}, dt);
    if (p->d_ht) owned->d_ht = copy_in(p->d_ht, {p->N, p->HV, p->K, p->V}, DType::f32);
    owned->fwd.o = Tensor::empty({p->T, p->HV, p->V}, dt, Device::cuda);
    owned->fwd.final_state = Tensor::empty({p->N, p->HV, p->K, p->V}, DType::f32, Device::cuda);
    owned->fwd.workspace =
        Tensor::empty({hlm::ops::kda_chunk_cuda_workspace_floats(a)}, DType::f32, Device::cuda);
    if (owned->d_o.defined()) {
      hlm::ops::KdaChunkBwdCudaBuffers& b = owned->bwd;
      b.workspace = Tensor::empty({hlm::ops::kda_chunk_bwd_cuda_workspace_floats(a)}, DType::f32,
                                  Device::cuda);
      b.dq = Tensor::empty({p->T, p->H, p->K}, DType::f32, Device::cuda);
      b.dk = Tensor::empty({p->T, p->H, p->K}, DType::f32, Device::cuda);
      b.dv = Tensor::empty({p->T, p->HV, p->V}, DType::f32, Device::cuda);
      b.dg = Tensor::empty({p->T, p->HV, p->K}, DType::f32, Device::cuda);
      b.dbeta = Tensor::empty({p->T, p->HV}, DType::f32, Device::cuda);
      b.dinitial_state = Tensor::empty({p->N, p->HV, p->K, p->V}, DType::f32, Device::cuda);
      if (p->gate != 0) {
        b.dA_log = Tensor::empty({p->HV}, DType::f32, Device::cuda);
        if (p->dt_bias) b.ddt_bias = Tensor::empty({p->HV * p->K}, DType::f32, Device::cuda);
      }
    }
    h = owned.release();
  });
  return rc == 0 ? h : nullptr;
}

// mode 1: the forward saves the backward's intermediates and the backward reads them (the
// backward's workspace shrinks to its scratch); mode 2: the forward keeps A_qk and M^-1
// (KdaChunkCudaBuffers::kept) and the backward recomputes the rest; mode 0: the backward
// recomputes everything (default).
int hlm_kda_set_save(void* handle, int mode) {
  return guarded([&] {
    HLM_CHECK(mode >= 0 && mode <= 2, "hlm_kda_set_save: mode must be 0, 1 or 2, got {}", mode);
    Handle* h = static_cast<Handle*>(handle);
    const hlm::ops::KdaArgs& a = h->args;
    h->fwd.saved = h->bwd.saved = Tensor();
    h->fwd.kept = h->bwd.kept = Tensor();
    h->bwd.workspace = Tensor();  // freed before the new allocations
    if (mode == 1) {
      h->fwd.saved =
          Tensor::empty({hlm::ops::kda_chunk_cuda_saved_floats(a)}, DType::f32, Device::cuda);
      h->bwd.saved = h->fwd.saved;
    } else if (mode == 2) {
      h->fwd.kept =
          Tensor::empty({hlm::ops::kda_chunk_cuda_kept_floats(a)}, DType::f32, Device::cuda);
      h->bwd.kept = h->fwd.kept;
    }
    if (h->d_o.defined())
      h->bwd.workspace = Tensor::empty(
          {hlm::ops::kda_chunk_bwd_cuda_workspace_floats(a, mode == 1)}, DType::f32, Device::cuda);
  });
}

int hlm_kda_forward(void* handle) {
  return guarded([&] {
    Handle* h = static_cast<Handle*>(handle);
    h->out = forward(*h);
  });
}

int hlm_kda_forward_backward(void* handle) {
  return guarded([&] {
    Handle* h = static_cast<Handle*>(handle);
    HLM_CHECK(h->d_o.defined(), "hlm_kda_forward_backward: the problem has no d_o");
    h->out = forward(*h);
    const char* op = "hlm_kda_forward_backward";
    const hlm::ops::KdaDims d = hlm::ops::kda_check(h->args, op);
    hlm::ops::kda_check_grads(h->args, d, h->d_o, h->d_ht, op);
    h->grads =
        hlm::ops::cuda::kda::backward(h->args, d, h->d_o, h->d_ht, h->bwd, tf32_stages(h->args));
  });
}

// Copies the last results into the caller's device tensors (any pointer may be null):
// o (dtype), ht f32; dq, dk, dv, dg, dbeta and dh0 f32 (the backward's gradients are f32).
int hlm_kda_fetch(void* handle, void* o, float* ht, void* dq, void* dk, void* dv, void* dg,
                  void* dbeta, float* dh0) {
  return guarded([&] {
    Handle* h = static_cast<Handle*>(handle);
    copy_out(o, h->out.o);
    copy_out(ht, h->out.final_state);
    copy_out(dq, h->grads.dq);
    copy_out(dk, h->grads.dk);
    copy_out(dv, h->grads.dv);
    copy_out(dg, h->grads.dg);
    copy_out(dbeta, h->grads.dbeta);
    copy_out(dh0, h->grads.dinitial_state);
  });
}

void hlm_kda_destroy(void* handle) {
  delete static_cast<Handle*>(handle);
}

}  // extern "C"
