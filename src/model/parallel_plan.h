// How a training job of this model is laid out over GPUs (docs/parallel.md, "Laying out a job"):
// the groups, and per GPU the memory of a step and the bytes each kind of parallelism moves. A
// plan computed from the model's shapes (nothing is allocated); `hybridlm inspect --parallel`
// prints it.
//
// Layout: world = dp x cp x tp ranks, numbered with tp fastest, then cp, then dp
// (rank = (d cp + c) tp + t). ep divides dp x cp: the dp x cp ranks of one tp rank form groups of
// ep consecutive ranks (in (d, c) order) that share the routed experts, each holding E / ep of
// them. The routed experts are not split by tp (expert tensor parallelism 1): every tp rank holds
// its group's experts whole.
//
// Memory per GPU (BF16 weights, FP32 gradients, AdamW with a distributed optimizer):
//   held       = S / tp + (P - P_e - S) + P_e / ep           parameters on the GPU: S the ones
//                tp splits (tensor_parallel_split_count: the attention layers' per-head
//                projections and the dense MLPs), the rest whole on every tp rank
//   weights    = 2 held;  gradients = 4 held                 (reduced in place)
//   optimizer  = 12 ((S / tp + P - P_e - S) / (dp cp) + P_e / ep / (dp cp / ep))
//                FP32 masters and both moments, sharded over the ranks that hold the same
//                parameters (every parameter's state is stored once per tp rank)
//   activations: the training estimate (model/config_limits.h) of T / (dp cp) tokens in
//                sequences of L / cp, divided by tp
// P: parameters, P_e: the routed experts' (routed_expert_parameter_count), T tokens per step, L
// the sequence length. Each DP rank holds whole sequences (T a multiple of dp L); cp splits every
// sequence into cp slices of L / cp tokens.
//
// Bytes sent per GPU per step (ring collectives: an all-gather or a reduce-scatter of S bytes over
// n ranks sends S (n - 1) / n, an all-reduce twice that):
//   dp gradients   reduce-scatter of the FP32 gradients: 4 (held_dense (n_d-1)/n_d +
//                  held_experts (n_e-1)/n_e), n_d = dp cp, n_e = dp cp / ep
//   dp parameters  all-gather of the updated BF16 weights: 2 (the same)
//   ep all-to-all  dispatch and combine, forward and backward, per MoE layer: 4 t k D 2 (ep-1)/ep
//                  (t = T / (dp cp) tokens on the GPU, k experts per token, uniform routing)
//   cp             KDA chunkwise as KdaLayer runs it (docs/parallel.md), per KDA layer: all-gathers
//                  of each rank's FP32 [S_ext | M] [HV, K, V + K] and last W-1 conv inputs
//                  forward, and of the state gradient [HV, K, V] and those inputs' gradients
//                  backward: 4 (cp - 1) (HV K (2V + K) + 2 (W - 1) (2 H K + HV V));
//                  DSA as DsaLayer runs it, per DSA layer (the MTP block's included): all-gather
//                  of the t tokens' BF16 latent rows and FP32 indexer keys (with KPool also their
//                  FP32 compress gates: every rank pools the whole batch) forward, reduce-scatter
//                  of their FP32 gradients backward: (cp - 1) t (6 (r_kv + d_r) + 8 g d_I),
//                  g = 2 with KPool, else 1
//   tp             as the model runs it (HybridModelOptions::tensor_comm): an all-reduce of the
//                  BF16 [t, D] output of every attention layer and dense MLP, forward and backward
//                  (2 t D 2 2 (tp-1)/tp each); an all-gather of a MoE layer's rows, forward and
//                  backward (2 t D 2 (tp-1)/tp); and per DSA layer with the indexer loss an
//                  all-reduce of its FP32 target [t, index_topk] (2 t K 4 (tp-1)/tp)
// Compute per GPU: 6 x active parameters (less the embedding) x T / world (the GEMMs; the
// attention's and the KDA core's FLOPs are not counted).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace hlm {

struct ParallelLayout {
  int64_t dp = 1, ep = 1, cp = 1, tp = 1;
  int64_t world() const { return dp * cp * tp; }
  // "dp=8,ep=8,cp=2" (keys dp, ep, cp, tp in any order; each at most once; values >= 1; the rest
  // 1): hlm::Error naming what is wrong.
  static ParallelLayout parse(const std::string& s);
};

struct ParallelPlan {
  ParallelLayout layout;
  int64_t tokens = 0, seq_len = 0;           // per step (all GPUs), per sequence
  int64_t tokens_per_gpu = 0;                // T / (dp cp)
  int64_t experts_per_gpu = 0;               // E / ep
  int64_t held_dense = 0, held_experts = 0;  // parameters on one GPU
  // bytes per GPU
  uint64_t weights = 0, gradients = 0, optimizer = 0, activations = 0;
  uint64_t memory() const { return weights + gradients + optimizer + activations; }
  // bytes sent per GPU per step
  uint64_t dp_gradients = 0, dp_parameters = 0, ep_alltoall = 0, cp_exchange = 0, tp_allreduce = 0;
  uint64_t traffic() const {
    return dp_gradients + dp_parameters + ep_alltoall + cp_exchange + tp_allreduce;
  }
  double flops_per_gpu = 0;
  // The groups of rank r (their members, ascending).
  std::vector<int64_t> tp_group(int64_t r) const;
  std::vector<int64_t> cp_group(int64_t r) const;
  std::vector<int64_t> dp_group(int64_t r) const;
  std::vector<int64_t> ep_group(int64_t r) const;
};

// The plan of a training step of `tokens` tokens in sequences of `seq_len` (mtp: the MTP block is
// trained). hlm::Error when the layout does not fit the model or the step: ep not dividing dp cp
// or the routed experts, tp not dividing the heads, tokens not a multiple of dp seq_len, seq_len
// not a multiple of cp.
ParallelPlan plan_parallel(const ModelConfig& c, const ParallelLayout& l, int64_t tokens,
                           int64_t seq_len, bool mtp);

}  // namespace hlm
