// Kimi Delta Attention core op (docs/kda.md, "The recurrence", "The chunked algorithm"). The
// front door (ops/kda.cpp) checks the arguments, allocates the outputs and runs the CPU references
// (ops/cpu/kda_*.cpp) or, for CUDA tensors, the chunked CUDA kernels (kda_chunk only;
// ops/cuda/kda_chunk/).
//
// Per sequence and value head h (qk head h / (HV/H)), with state S in R^{K x V} ([K, V] layout):
//   S <- Diag(exp(g_t)) S;  u = beta_t (v_t - S^T k_t);  S <- S + k_t u^T;  o_t = S^T (scale q_t)
//
// Two implementations with the same interface:
//   kda_recurrent: the step form above, computed in FP64 whatever the input dtype; outputs are f64.
//                  Its backward is the hand-derived reverse-time recurrence (FP64). The oracle.
//   kda_chunk:     the chunked (C = 64) WY form (docs/kda.md, "The chunked algorithm"), computed
//                  in the input dtype (f64 for f64 inputs, f32 otherwise, f32 accumulation);
//                  outputs in that dtype. It is written as separate stages (gate cumsum, intra
//                  matrices, WY, state pass, output; backward: recompute, dAv, reverse state pass,
//                  WY/dq/dk/dg, intra, reverse cumsum) that each map onto one CUDA kernel. OpenMP
//                  over (chunk or sequence, head); deterministic. The backward recomputes
//                  everything from the arguments (FLA's default recompute mode), so it takes the
//                  same KdaArgs as the forward.
//
// Optional fused pre-processing (FLA's chunk_kda options), applied in the computation dtype:
//   use_qk_l2norm: q, k <- x / sqrt(sum x^2 + 1e-6) (eps inside the sqrt), backward through it;
//   beta_logits:   beta <- sigmoid(beta);
//   gate != none:  g holds the raw gate input z and g <- kda_gate(z, A_log, dt_bias) (kda_gate.h).
// Gradients returned are w.r.t. the tensors as passed (raw q, k, z, beta logits when fused).
#pragma once

#include <optional>

#include "core/seq_layout.h"
#include "core/tensor.h"
#include "ops/kda_gate.h"

namespace hlm::ops {

constexpr int64_t kKdaChunk = 64;   // chunk size C
constexpr double kKdaL2Eps = 1e-6;  // inside the sqrt of the q/k L2 norm

struct KdaArgs {
  Tensor q;              // [T, H, K]   (scale is applied inside; raw when use_qk_l2norm)
  Tensor k;              // [T, H, K]
  Tensor v;              // [T, HV, V]  HV % H == 0
  Tensor g;              // [T, HV, K]  log decay (<= 0), or the raw gate input z when gate is set
  Tensor beta;           // [T, HV]     in (0, 1), or logits when beta_logits
  Tensor initial_state;  // optional [N, HV, K, V] f32 or f64, [K, V] layout (undefined: zeros)
  std::optional<SeqLayout> seqs;  // N >= 1 sequences covering the T tokens
                                  // (unset: one sequence of T tokens)
  double scale = 0;               // <= 0: K^-1/2
  bool use_qk_l2norm = false;
  bool beta_logits = false;
  std::optional<KdaGateKind> gate;      // set: g is z and the gate below is fused
  Tensor A_log;                         // [HV] f32 (gate only)
  Tensor dt_bias;                       // [HV*K] f32 (gate only, optional)
  double lower_bound = kKdaLowerBound;  // gate == lower_bound only: check_kda_lower_bound
  // CUDA chunked kernels with bf16 inputs: true takes 3xTF32 in every matrix product (gradients
  // within ~1e-5 of the f32 path); false (default) plain TF32 wherever it was measured harmless
  // (within ~5e-4; ops/cuda/kda_chunk/heuristics.h), 1.2x faster. f32 inputs: always FP32 FMA.
  bool exact_bf16_products = false;
};

struct KdaOutput {
  Tensor o;            // [T, HV, V]
  Tensor final_state;  // [N, HV, K, V] (f64 when computed in f64, else f32)
};

struct KdaGrads {
  Tensor dq, dk;            // [T, H, K]
  Tensor dv;                // [T, HV, V]
  Tensor dg;                // [T, HV, K] (w.r.t. z when the gate is fused)
  Tensor dbeta;             // [T, HV]    (w.r.t. the logits when beta_logits)
  Tensor dinitial_state;    // [N, HV, K, V] (always defined: the gradient of a zero state)
  Tensor dA_log, ddt_bias;  // [HV], [HV*K] when the gate is fused (and the tensor given)
};

KdaOutput kda_recurrent(const KdaArgs& a);
// d_o: [T, HV, V]; d_final_state: optional [N, HV, K, V].
KdaGrads kda_recurrent_backward(const KdaArgs& a, const Tensor& d_o, const Tensor& d_final_state);

KdaOutput kda_chunk(const KdaArgs& a);
KdaGrads kda_chunk_backward(const KdaArgs& a, const Tensor& d_o, const Tensor& d_final_state);
// Training pair: with CUDA tensors, *saved receives what the forward keeps for the backward, and
// the backward given it (with the same `what`) recomputes less, with the same bits:
//   KdaSave::all   every intermediate the backward would recompute (KdaChunkCudaBuffers::saved;
//                  f32, ~5.5 KiB per token and value head at K = V = 128): no recompute;
//   KdaSave::kept  A_qk and M^-1 (KdaChunkCudaBuffers::kept; f32, 512 bytes per token and value
//                  head): the backward recomputes the rest but not the A products and inverse.
// On the CPU *saved is left undefined and the backward recomputes as always.
enum class KdaSave : uint8_t { kept, all };
KdaOutput kda_chunk(const KdaArgs& a, Tensor* saved, KdaSave what = KdaSave::all);
KdaGrads kda_chunk_backward(const KdaArgs& a, const Tensor& d_o, const Tensor& d_final_state,
                            const Tensor& saved, KdaSave what = KdaSave::all);

// Validated shapes of a call (throws hlm::Error naming `op` and the argument on any mismatch).
// The one checker of every KDA core call, CPU or CUDA (the device of q): on CUDA it also checks
// what the kernels support (contiguous f32 / bf16 inputs, K in {32, 64, 128}, V a multiple of 32
// in [32, 128]; ops/cuda/kda_chunk/params.cuh).
struct KdaDims {
  int64_t T, H, HV, K, V, N;
  double scale;
  SeqLayout seqs;           // a.seqs, or one sequence of T tokens
  std::vector<int64_t> cu;  // seqs.offsets(), [N+1]
};
KdaDims kda_check(const KdaArgs& a, const char* op);
// The backward's own arguments: d_o [T, HV, V] and the optional d_final_state [N, HV, K, V] on
// q's device (CUDA: d_o of q's dtype, d_final_state f32, both contiguous and 16-byte aligned).
void kda_check_grads(const KdaArgs& a, const KdaDims& d, const Tensor& d_o,
                     const Tensor& d_final_state, const char* op);

}  // namespace hlm::ops
