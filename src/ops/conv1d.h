// Causal depthwise conv1d over packed sequences (docs/kda.md, "The layer"), optional fused SiLU:
//   y_t[c] = act( sum_{j=0}^{W-1} w[c, j] * x_{t-W+1+j}[c] )
// with the positions before a sequence's start taken from its initial conv state, or 0 when no
// state is given (the conv restarts at every sequence boundary; never looks across one).
//
// Shapes: x [T, C] packed (THD), w [C, W] (any W >= 1), seqs: N sequences covering the T tokens,
// conv state [N, W-1, C]: state[n, i] holds the input at position i - (W-1) relative to the
// sequence start (oldest first), i.e. the last W-1 inputs before it. f32 or f64, one dtype,
// computed in that dtype; each output sums over j in order, so a packed batch is bit-identical
// to its sequences run one by one, and the decode step is bit-identical to the full conv.
// CUDA tensors run the CUDA implementation (also bf16; dtype rules in ops/op_checks.h).
#pragma once

#include "core/seq_layout.h"
#include "core/tensor.h"

namespace hlm::ops {

// Returns y [T, C]. initial_state: [N, W-1, C] or an undefined Tensor (zeros). When final_state
// is given it receives a new [N, W-1, C] tensor: the last W-1 inputs of each sequence (reaching
// into the initial state / zeros for sequences shorter than W-1), the state to decode from.
Tensor causal_conv1d_forward(const Tensor& x, const Tensor& w, const SeqLayout& seqs,
                             const Tensor& initial_state = {}, bool silu = false,
                             Tensor* final_state = nullptr);

struct CausalConv1dGrads {
  Tensor dx;              // [T, C]
  Tensor dinitial_state;  // [N, W-1, C]; undefined when no initial_state was given
};
// Recomputes the pre-activation from x (nothing saved but the inputs). dw [C, W] += dL/dw, summed
// per sequence in token order and added to dw sequence by sequence.
CausalConv1dGrads causal_conv1d_backward(const Tensor& dy, const Tensor& x, const Tensor& w,
                                         const SeqLayout& seqs, const Tensor& initial_state,
                                         bool silu, Tensor& dw);

// One decode step: x [N, C] is the next token of each of N sequences; state [N, W-1, C] is
// updated in place (shifted left by one, x appended). Returns y [N, C].
Tensor causal_conv1d_update(const Tensor& x, Tensor& state, const Tensor& w, bool silu = false);

// The same step over a pool of states (continuous batching): sequence n's state is row slots[n]
// of pool [S, W-1, C] (distinct slots in [0, S)), updated in place; the arithmetic of
// causal_conv1d_update on the gathered rows, so the same bits, in one pass. Returns y [N, C].
Tensor causal_conv1d_update_slots(const Tensor& x, Tensor& pool, const std::vector<int64_t>& slots,
                                  const Tensor& w, bool silu = false);

}  // namespace hlm::ops
