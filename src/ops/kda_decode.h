// KDA decode: one recurrent step (docs/kda.md, "The recurrence") for a batch of N sequences,
// one token each, updating the FP32 states in place ([K, V] layout):
//   S <- Diag(exp(g)) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T (scale q)
// With use_qk_l2norm, q and k are first L2-normalised (eps 1e-6 inside the sqrt).
// Value head h reads qk head h / (HV/H) (GVA). `state_indices` (optional i32/i64 [N]) picks the
// slot of a state pool [P, HV, K, V] for each sequence (continuous batching); a negative index
// skips that sequence (its o row is zero). Slots must be distinct. Its values are checked on the
// host: a CPU tensor costs nothing, a CUDA one a copy that waits for the device.
// CPU (FP32, the reference layout of the CUDA kernel) and CUDA (one thread per state column,
// the column in registers; deterministic) implementations.
#pragma once

#include "core/tensor.h"

namespace hlm::ops {

struct KdaDecodeArgs {
  // q, k, v: each token's heads contiguous; the tokens may be strided (columns of a wider row).
  Tensor q, k;           // [N, H, K]   f32 or bf16
  Tensor v;              // [N, HV, V]  dtype of q
  Tensor g;              // [N, HV, K]  f32 log decay
  Tensor beta;           // [N, HV]     f32 in (0, 1)
  Tensor state;          // [P, HV, K, V] f32, updated in place (P = N without state_indices)
  Tensor state_indices;  // optional [N] i32 / i64
  double scale = 0;      // <= 0: K^-1/2
  bool use_qk_l2norm = false;
};

// Returns o [N, HV, V] f32 on the device of the inputs.
Tensor kda_decode_step(const KdaDecodeArgs& a);

}  // namespace hlm::ops
