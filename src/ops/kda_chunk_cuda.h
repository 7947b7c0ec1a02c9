// KDA chunked forward and backward (C = 64) on CUDA: the same math and interface as ops::kda_chunk
// (ops/kda.h, spec kda.md 2.1-2.4, 3), for tensors on the GPU. Two kernel families
// (src/ops/cuda/kda_chunk.cu):
//   intra: one block per (chunk, value head): gate (fused or not), q/k L2 norm, beta sigmoid,
//          chunk-local cumsum G, A_qk (incl. diagonal, scale), A_kk (strictly lower, beta_r),
//          M^-1 = (I + A_kk)^-1 (16x16 diagonal blocks by forward substitution, then block rows),
//          W = M^-1 (beta exp(G) k), U = M^-1 (beta v), and the pre-gated
//          qg = scale q exp(G), kg = k exp(G_L - G), exp(G_L);
//   state: one block per (sequence, value head, 32- or 64-wide V tile), sequential over the
//          chunks: V_new = U - W S, O = qg S + A_qk V_new, S <- Diag(exp(G_L)) S + kg^T V_new.
// Matrix products on tensor cores (mma_tf32.cuh: TF32 / 3xTF32 operands for bf16 inputs, FP32 FMA
// for f32), FP32 accumulation and states; deterministic: fixed reduction orders,
// no atomics, bit-identical run to run, and a packed batch gives each sequence the bits it gets
// alone.
//
// Arguments (KdaArgs, as for kda_chunk):
//   q, k [T, H, K], v [T, HV, V], g [T, HV, K], beta [T, HV]: CUDA, contiguous, one dtype,
//     f32 or bf16. g is the log decay (<= 0: exp(G_r - G_s) is formed through a reference row
//     between s and r, which needs G non-increasing within a chunk) or, with `gate`, the raw
//     gate input z (A_log [HV] f32 and dt_bias [HV*K] f32 on CUDA, as kda_gate.h).
//   initial_state: optional [N, HV, K, V] f32 CUDA ([K, V] layout).
//   cu_seqlens: optional [N+1] i64 / i32, on the host or the device (read on the host: a device
//     copy costs one synchronous device-to-host copy); N >= 1, empty sequences allowed.
// Supported shapes: K in {32, 64, 128}; V a multiple of 32 with 32 <= V <= 128; HV % H == 0;
// T < 2^31. Anything else throws hlm::Error naming the argument.
// Outputs: o [T, HV, V] in the input dtype, final_state [N, HV, K, V] f32 (always returned).
// The call is synchronous (it waits for the kernels and reports their errors).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/kda.h"

namespace hlm::ops {

// Optional caller-owned buffers. Each one that is defined is used instead of a fresh allocation
// (an arena, or NaN-poisoned buffers in tests); it must be a contiguous CUDA tensor of the stated
// dtype and shape, 16-byte aligned.
struct KdaChunkCudaBuffers {
  Tensor o;            // [T, HV, V], the input dtype
  Tensor final_state;  // [N, HV, K, V] f32
  Tensor workspace;    // f32, at least kda_chunk_cuda_workspace_floats(a) elements
  // Training: f32, at least kda_chunk_cuda_saved_floats(a) elements. When defined, the forward
  // stores there every intermediate the backward needs (its own workspace then goes unused) and
  // the backward, given it as KdaChunkBwdCudaBuffers::saved, skips its recompute: the same bits
  // as a backward that recomputes, for ~1.1x the forward's time.
  Tensor saved;
  // Training, the lighter alternative to `saved`: f32, at least kda_chunk_cuda_kept_floats(a)
  // elements. When defined, the forward also stores there A_qk and M^-1 of every chunk (512 bytes
  // per token and value head, as FLA keeps its A_qk and A_kk), and the backward, given it as
  // KdaChunkBwdCudaBuffers::kept, recomputes everything else but not those two (its A products
  // and the inverse): the same bits as a backward that recomputes all.
  Tensor kept;
};

// Number of f32 elements of the workspace the call needs (the intermediates W, U, qg, kg, A_qk,
// exp(G_L) of every chunk plus the chunk table). Validates the arguments like the forward.
int64_t kda_chunk_cuda_workspace_floats(const KdaArgs& a);
// Number of f32 elements of KdaChunkCudaBuffers::saved: the workspace's intermediates plus G, q^,
// k^, beta, M^-1, the chunk-start states h and V_new of every chunk (K = V = 128: ~5.5 KiB per
// token and value head).
int64_t kda_chunk_cuda_saved_floats(const KdaArgs& a);
// Number of f32 elements of KdaChunkCudaBuffers::kept: A_qk and M^-1, [2, NC, HV, C, C] (NC the
// number of chunks).
int64_t kda_chunk_cuda_kept_floats(const KdaArgs& a);

KdaOutput kda_chunk_forward_cuda(const KdaArgs& a, const KdaChunkCudaBuffers& buffers = {});

// ------------------------------------------------------------------ backward
// KDA chunked backward (src/ops/cuda/kda_chunk_bwd.cu): exactly the semantics of
// ops::kda_chunk_backward for CUDA tensors (same KdaArgs as the forward, same argument checks and
// supported shapes). It recomputes the forward intermediates (the forward's own kernels, storing
// G, M^-1, the chunk-start states h and V_new as well) unless the forward saved them
// (KdaChunkCudaBuffers::saved), then runs a reverse state pass per
// (sequence, value head, V tile) and per-(chunk, head) kernels for the rest; FP32 arithmetic,
// deterministic (no atomics, fixed reduction orders; a sequence gets the bits it gets alone).
//   d_o: [T, HV, V] CUDA, contiguous, the dtype of q.  d_final_state: optional [N, HV, K, V] f32.
// Returns f32 gradients for f32 and bf16 inputs (as the CPU): dq, dk [T, H, K] (GVA: summed over
// the value heads of a group in order), dv [T, HV, V], dg [T, HV, K] (w.r.t. z when the gate is
// fused), dbeta [T, HV] (w.r.t. the logits when beta_logits), dinitial_state [N, HV, K, V]
// (always), dA_log [HV] / ddt_bias [HV*K] when the gate is fused and the tensor is given. The call
// is synchronous.
struct KdaChunkBwdCudaBuffers {
  // f32, at least kda_chunk_bwd_cuda_workspace_floats(a, saved.defined()) elements
  Tensor workspace;
  // The forward's KdaChunkCudaBuffers::saved, written by kda_chunk_forward_cuda with the same
  // KdaArgs (the same inputs, unchanged since): the backward reads the intermediates from it
  // instead of recomputing them (the results are bit-identical either way).
  Tensor saved;
  // Or the forward's KdaChunkCudaBuffers::kept (same conditions): the recompute reads A_qk and
  // M^-1 from it instead of forming them.
  Tensor kept;
  // Optional outputs (f32, the shapes above; each defined one is written instead of allocated).
  Tensor dq, dk, dv, dg, dbeta, dinitial_state, dA_log, ddt_bias;
};

// The backward's workspace: the recomputed intermediates and the backward's own scratch, or the
// scratch alone when the forward saved the intermediates (`saved`).
int64_t kda_chunk_bwd_cuda_workspace_floats(const KdaArgs& a, bool saved = false);

KdaGrads kda_chunk_backward_cuda(const KdaArgs& a, const Tensor& d_o, const Tensor& d_final_state,
                                 const KdaChunkBwdCudaBuffers& buffers = {});

// Shared by the forward and the backward (src/ops/cuda/kda_chunk*.cu); not a public interface.
namespace kda_cuda_detail {
// Validated shapes and the chunk table of a call (the forward's checks; errors named `op`).
struct Plan {
  int64_t T, H, HV, K, V, N, NC;
  float scale;
  std::vector<int32_t> meta;  // chunk_bos [NC], chunk_len [NC], first_chunk [N+1]
};
Plan plan(const KdaArgs& a, const char* op);
// Device pointers (f32) of the forward intermediates, per task = chunk * HV + value head.
struct Intermediates {
  const int* meta = nullptr;             // device copy of Plan::meta
  float *qg = nullptr, *kg = nullptr;    // [NC, HV, C, K]
  float *w = nullptr, *u = nullptr;      // [NC, HV, C, K], [NC, HV, C, V]
  float *aqk = nullptr, *gl = nullptr;   // [NC, HV, C, C], [NC, HV, K]
  float *G = nullptr, *qn = nullptr;     // [NC, HV, C, K] backward only (else null)
  float *kn = nullptr, *beta = nullptr;  // [NC, HV, C, K], [NC, HV, C]     backward only
  float* minv = nullptr;                 // [NC, HV, C, C]                  backward only
  float *h = nullptr, *vnew = nullptr;   // [NC, HV, K, V], [NC, HV, C, V]  backward only
  float* ht = nullptr;                   // [N, HV, K, V] final state (required)
  bool a_kept = false;  // aqk and minv hold the forward's kept values: read, not formed
};
// Launches the forward's intra and state kernels (no output o), asynchronously.
void recompute(const KdaArgs& a, const Plan& p, const Intermediates& x);
// The layout of the saved intermediates (src/ops/cuda/kda_chunk_bwd.cu): their size in floats,
// and the pointers into a buffer `base` of at least that size (x.ht points into it too).
int64_t saved_floats(const Plan& p);
Intermediates saved_intermediates(const Plan& p, float* base);
// The V tile (32 or 64) of the sequential state passes, forward and reverse, for this call.
int state_tile(const Plan& p);
// Floats of the kept A_qk and M^-1 (KdaChunkCudaBuffers::kept).
int64_t kept_floats(const Plan& p);
}  // namespace kda_cuda_detail

}  // namespace hlm::ops
