// The host interface of the CUDA chunked KDA forward and backward (C = 64): the same math and
// interface as ops::kda_chunk / ops::kda_chunk_backward (ops/kda.h; docs/kda.md, "CUDA chunked
// forward" and "CUDA chunked backward") for tensors on the GPU. Plain C++ (no CUDA header): the
// caller-owned buffers and their sizes, the entry points, and for the stage files of this folder
// and the kernel lab (bench/kda_lab/) the plan of a call, the kernel parameter blocks and the stage
// launchers.
//
// The stages, one file each (kernels and their launcher; launch.cu / bwd_launch.cu run them):
//   intra.cu        forward intra kernel, one block per (chunk, value head): gate (fused or not),
//                   q/k L2 norm, beta sigmoid, chunk-local cumsum G, A_qk (incl. diagonal, scale),
//                   A_kk (strictly lower, beta_r), M^-1 = (I + A_kk)^-1, W = M^-1 (beta exp(G) k),
//                   U = M^-1 (beta v), qg = scale q exp(G), kg = k exp(G_L - G), exp(G_L);
//   state.cu        forward state pass, one block per (sequence, value head, 32- or 64-wide V
//                   tile), sequential over the chunks: V_new = U - W S, O = qg S + A_qk V_new,
//                   S <- Diag(exp(G_L)) S + kg^T V_new;
//   bwd_state.cu    reverse state pass (B3); bwd_products.cu contractions over V (B4a);
//   bwd_wy.cu       WY backward (B4b); bwd_intra.cu intra backward, dg cumsum, gate chain rule
//                   (B4c); bwd_finish.cu GVA sums, L2-norm and beta chain rules, gate parameter
//                   sums (B5, B6).
// Launch planning (V tile of the state passes, per-stage TF32) is in heuristics.h, the device
// helpers in common.cuh. Matrix products on tensor cores (ops/cuda/mma_tf32.cuh: TF32 / 3xTF32
// operands for bf16 inputs, FP32 FMA for f32), FP32 accumulation and states; deterministic: fixed
// reduction orders, no atomics, bit-identical run to run, and a packed batch gives each sequence
// the bits it gets alone.
//
// Arguments (KdaArgs, checked by ops::kda_check, ops/kda.cpp):
//   q, k [T, H, K], v [T, HV, V], g [T, HV, K], beta [T, HV]: CUDA, contiguous, one dtype,
//     f32 or bf16. g is the log decay (<= 0: exp(G_r - G_s) is formed through a reference row
//     between s and r, which needs G non-increasing within a chunk) or, with `gate`, the raw
//     gate input z (A_log [HV] f32 and dt_bias [HV*K] f32 on CUDA, as kda_gate.h).
//   initial_state: optional [N, HV, K, V] f32 CUDA ([K, V] layout).
//   seqs: optional SeqLayout of N >= 1 sequences covering T (empty sequences allowed); the
//     chunk table is its chunks(kC), made once per layout.
// Supported shapes: K in {32, 64, 128}; V a multiple of 32 with 32 <= V <= 128; HV % H == 0;
// T < 2^31. Anything else throws hlm::Error naming the argument.
// Outputs: o [T, HV, V] in the input dtype, final_state [N, HV, K, V] f32 (always returned).
// The calls are synchronous (they wait for the kernels and report their errors).
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
// KDA chunked backward: exactly the semantics of ops::kda_chunk_backward for CUDA tensors (same
// KdaArgs as the forward, same argument checks and supported shapes). It recomputes the forward
// intermediates (the forward's own kernels, storing G, M^-1, the chunk-start states h and V_new
// as well) unless the forward saved them (KdaChunkCudaBuffers::saved), then runs a reverse state
// pass per (sequence, value head, V tile) and per-(chunk, head) kernels for the rest; FP32
// arithmetic, deterministic (no atomics, fixed reduction orders; a sequence gets the bits it gets
// alone).
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

// ------------------------------------------------------------------ internals
// Shared by the files of src/ops/cuda/kda_chunk/, the front door (ops/kda.cpp) and the kernel lab
// (bench/kda_lab/); not a public interface.
namespace cuda::kda {

// The chunk table of a validated call (ops::kda_check), SeqLayout::chunks(kC) of its layout:
// chunks never cross a sequence boundary; the last one of a sequence may be short.
struct Plan {
  int64_t T, H, HV, K, V, N, NC;
  float scale;
  std::vector<int32_t> meta;  // chunk_bos [NC], chunk_len [NC], first_chunk [N+1]
};
Plan plan(const KdaDims& d);

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

// The forward's own workspace (launch.cu): offsets in floats (multiples of 64: 256-byte aligned
// slices).
struct FwdLayout {
  int64_t qg, kg, w, u, aqk, gl, meta, total;
};
FwdLayout fwd_layout(const Plan& p);

// The backward's workspace (bwd_launch.cu), in two regions: the forward intermediates (meta ..
// ht: `saved`, written by the recompute or kept from the forward) at offset 0 of their base, and
// the backward's scratch (dvnew .. pdt) at offset 0 of theirs. One workspace holds both, the
// scratch at `saved`; with the forward's saved buffer the workspace holds the scratch alone.
// Offsets in floats (multiples of 64).
struct BwdLayout {
  int64_t meta, qg, kg, w, u, aqk, gl, G, qn, kn, beta, minv, h, vnew, ht, saved;
  int64_t dvnew, dh, daqk, dakk, dakv, dw, dq, dk, dG, dbw, dbi, pA, pdt, scratch;
};
BwdLayout bwd_layout(const Plan& p);
// The saved intermediates: their size in floats, and the pointers into a buffer `base` of at least
// that size (x.ht points into it too).
int64_t saved_floats(const Plan& p);
Intermediates saved_intermediates(const Plan& p, float* base);
// Floats of the kept A_qk and M^-1 (KdaChunkCudaBuffers::kept).
int64_t kept_floats(const Plan& p);

enum GateKind : int { kGateNone = 0, kGateStandard = 1, kGateLowerBound = 2 };

// Intra-chunk kernel. task = chunk * HV + h indexes the per-(chunk, head) workspace slices.
template <class Tin>
struct IntraParams {
  const Tin* q;          // [T, H, K]
  const Tin* k;          // [T, H, K]
  const Tin* v;          // [T, HV, V]
  const Tin* g;          // [T, HV, K] log decay, or the raw gate input z (gate != none)
  const Tin* beta;       // [T, HV] in (0, 1), or logits (beta_logits)
  const float* A_log;    // [HV] or null (exp(A_log) = 1); gate only
  const float* dt_bias;  // [HV * K] or null (0); gate only
  const int* chunk_bos;  // [NC] first token of each chunk
  const int* chunk_len;  // [NC] 1..C
  float* qg;             // [NC, HV, C, K] scale q exp(G)
  float* kg;             // [NC, HV, C, K] k exp(G_{L-1} - G)
  float* w;              // [NC, HV, C, K] M^-1 (beta exp(G) k)
  float* u;              // [NC, HV, C, V] M^-1 (beta v)
  float* aqk;            // [NC, HV, C, C] A_qk (scale included)
  float* gl;             // [NC, HV, K]    exp(G_{L-1})
  // Backward recompute only (null in the forward): G, the normalised q and k, beta (after the
  // sigmoid) and M^-1 of all C rows of the chunk (padded rows: G = G_{L-1}, q = k = beta = 0,
  // M^-1 rows of the identity).
  float* G_out;     // [NC, HV, C, K]
  float* qn_out;    // [NC, HV, C, K]
  float* kn_out;    // [NC, HV, C, K]
  float* beta_out;  // [NC, HV, C]
  float* minv_out;  // [NC, HV, C, C] (also the forward's, when it keeps M^-1 for the backward)
  // Backward recompute from the forward's kept A_qk (then read-only at aqk) and M^-1: the A
  // products and the inverse are skipped; null otherwise.
  const float* minv_in;  // [NC, HV, C, C]
  int H, HV, V;
  float scale;
  int gate;           // GateKind
  float lower_bound;  // gate == lower bound
  bool l2norm;        // q, k <- x / sqrt(sum x^2 + 1e-6)
  bool beta_logits;   // beta <- sigmoid(beta)
  bool vec16;         // q, k, v, g (and dt_bias) 16-byte aligned: loaded 16 bytes at a time
};

// State-pass kernel.
template <class Tin>
struct StateParams {
  const float* qg;         // [NC, HV, C, K]
  const float* kg;         // [NC, HV, C, K]
  const float* w;          // [NC, HV, C, K]
  const float* u;          // [NC, HV, C, V]
  const float* aqk;        // [NC, HV, C, C]
  const float* gl;         // [NC, HV, K]
  const float* h0;         // [N, HV, K, V] or null (zeros)
  const int* chunk_bos;    // [NC]
  const int* chunk_len;    // [NC]
  const int* first_chunk;  // [N+1] chunks of sequence n: first_chunk[n] .. first_chunk[n+1]-1
  Tin* o;                  // [T, HV, V], or null (backward recompute: no output)
  float* ht;               // [N, HV, K, V]
  float* h_out;            // [NC, HV, K, V] state at each chunk start, or null (forward)
  float* vnew_out;         // [NC, HV, C, V] V_new of each chunk, or null (forward)
  int HV, V;
};

// All backward kernels.
// One block shared by all backward kernels. task = chunk * HV + h.
template <class Tin>
struct BwdParams {
  // inputs
  const Tin* q;            // [T, H, K] raw
  const Tin* k;            // [T, H, K] raw
  const Tin* v;            // [T, HV, V]
  const Tin* z;            // [T, HV, K] the raw gate input (gate != none)
  const Tin* dO;           // [T, HV, V]
  const float* dht;        // [N, HV, K, V] or null (zeros)
  const float* A_log;      // [HV] or null
  const float* dt_bias;    // [HV * K] or null
  const int* chunk_bos;    // [NC]
  const int* chunk_len;    // [NC]
  const int* first_chunk;  // [N+1]
  // recomputed forward intermediates
  const float *qg, *kg, *w, *u, *aqk, *gl, *G, *qn, *kn, *beta, *minv, *h, *vnew;
  // backward workspace
  float* dvnew;  // [NC, HV, C, V]
  float* dh;     // [NC, HV, K, V] gradient w.r.t. the state at the end of each chunk
  float* daqk;   // [NC, HV, C, C]
  float* dakk;   // [NC, HV, C, C] X_K = dKB W^T (the WY backward's key side)
  float* dakv;   // [NC, HV, C, C] X_V = dVB U^T (value side); dA_kk = -stril(X_K + X_V)
  float* dw;     // [NC, HV, C, K]
  float* dq;     // [NC, HV, C, K] per value head
  float* dk;     // [NC, HV, C, K] per value head
  float* dG;     // [NC, HV, C, K] gradient w.r.t. G
  float* dbw;    // [NC, HV, 2, C] dbeta from the WY backward (key side, value side)
  float* dbi;    // [NC, HV, NS, C] intra dbeta per channel slice of the intra backward
  float* pA;     // [NC, HV, NS] dA_log partials (per channel slice)
  float* pdt;    // [NC, HV, K] d dt_bias partials
  // outputs (f32)
  float* o_dq;     // [T, H, K]
  float* o_dk;     // [T, H, K]
  float* o_dv;     // [T, HV, V]
  float* o_dg;     // [T, HV, K]
  float* o_dbeta;  // [T, HV]
  float* o_dh0;    // [N, HV, K, V]
  float* o_dA;     // [HV] or null
  float* o_ddt;    // [HV * K] or null
  int NC, H, HV, V;
  float scale;
  int gate;
  float lower_bound;
  bool l2norm, beta_logits;
};

// The stage launchers (one per stage file; Tin = float or __nv_bfloat16): each launches its
// kernel(s) on the default stream, asynchronously, and turns a failed launch into hlm::Error.
// tf32: the stages (bits 1 << KdaStage, heuristics.h) whose bf16 products run in plain TF32
// rather than 3xTF32 (f32 inputs always take FP32 FMA).
template <class Tin>  // intra.cu; needs p.NC > 0
void launch_intra(const Plan& p, const IntraParams<Tin>& ip, unsigned tf32);
template <class Tin>  // state.cu
void launch_state(const Plan& p, const StateParams<Tin>& sp, unsigned tf32);
template <class Tin>  // bwd_state.cu
void launch_state_bwd(const Plan& p, const BwdParams<Tin>& bp, unsigned tf32);
template <class Tin>  // bwd_products.cu; needs p.NC > 0
void launch_bwd_products(const Plan& p, const BwdParams<Tin>& bp, unsigned tf32);
template <class Tin>  // bwd_wy.cu; needs p.NC > 0
void launch_wy_bwd(const Plan& p, const BwdParams<Tin>& bp, unsigned tf32);
template <class Tin>  // bwd_intra.cu; needs p.NC > 0
void launch_intra_bwd(const Plan& p, const BwdParams<Tin>& bp, unsigned tf32);
template <class Tin>  // bwd_finish.cu; needs p.NC > 0
void launch_qk_bwd(const Plan& p, const BwdParams<Tin>& bp);
template <class Tin>  // bwd_finish.cu; needs bp.o_dA or bp.o_ddt
void launch_gate_sums(const Plan& p, const BwdParams<Tin>& bp);

// The parameter blocks of one call (launch.cu): the inputs of `a`, the intermediates `x`, and the
// output o (null: the backward's recompute, no output).
template <class Tin>
IntraParams<Tin> intra_params(const KdaArgs& a, const Plan& p, const Intermediates& x);
template <class Tin>
StateParams<Tin> state_params(const KdaArgs& a, const Plan& p, const Intermediates& x, Tin* o);
// Launches the forward's intra and state kernels without the output o (the backward's recompute,
// storing what x points to), asynchronously.
void recompute(const KdaArgs& a, const Plan& p, const Intermediates& x, unsigned tf32);

// The forward of a validated call (d = ops::kda_check(a, ...)), synchronous.
KdaOutput forward(const KdaArgs& a, const KdaDims& d, const KdaChunkCudaBuffers& buffers,
                  unsigned tf32);
// For the front door: the outputs out.o, out.final_state given; *saved (when not null) receives a
// new buffer of the intermediates the backward reads (KdaSave::all) or A_qk and M^-1 (kept).
void chunk_forward(const KdaArgs& a, const KdaDims& d, KdaOutput& out, Tensor* saved, KdaSave what);

// One backward call, planned (bwd_launch.cu): the buffers checked or allocated, the chunk table on
// the device; what the stage launchers need.
struct BwdCall {
  Plan plan;
  BwdLayout layout;
  KdaGrads grads;            // the outputs (f32)
  Tensor workspace, inter;   // the workspace, and the buffer the intermediates live in
  Intermediates x;           // the forward intermediates
  float* scratch = nullptr;  // the backward's scratch (BwdLayout dvnew .. pdt)
  bool recompute = false;    // x is still to be formed by recompute()
};
// d_o, d_final_state as checked by ops::kda_check_grads.
BwdCall bwd_plan(const KdaArgs& a, const KdaDims& d, const Tensor& d_o, const Tensor& d_final_state,
                 const KdaChunkBwdCudaBuffers& buffers);
template <class Tin>
BwdParams<Tin> bwd_params(const KdaArgs& a, const BwdCall& c, const Tensor& d_o,
                          const Tensor& d_final_state);
// The backward of a validated call, synchronous.
KdaGrads backward(const KdaArgs& a, const KdaDims& d, const Tensor& d_o,
                  const Tensor& d_final_state, const KdaChunkBwdCudaBuffers& buffers,
                  unsigned tf32);
// For the front door: the gradients g allocated (f32, the shapes of KdaGrads); `saved` as the
// forward's chunk_forward gave it with the same `what` (undefined: recompute all).
void chunk_backward(const KdaArgs& a, const KdaDims& d, const Tensor& d_o,
                    const Tensor& d_final_state, const Tensor& saved, KdaSave what, KdaGrads& g);

}  // namespace cuda::kda
}  // namespace hlm::ops
