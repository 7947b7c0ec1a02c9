// Data parallelism with a distributed optimizer (docs/parallel.md, "Data parallelism"): the N
// processes of a communicator train one model on one global batch, each on a part of it, so that
// their loss curve is the one-process run's (to rounding) and repeats bit for bit for a given N.
//
// One step, on every rank r of N:
//   batch   = the global batch (a pure function of the seed and the step, the same everywhere)
//   part    = shard_batch(batch, r, N): whole sequences, contiguous, balanced by tokens
//   forward(part) with the global batch's loss denominators (global_normalizers), so each
//           rank's losses and gradients are its shares of the global batch's
//   indexer rows (known only after the forward) summed over the ranks; backward with each DSA
//           layer's share factor
//   reduce_gradients: each parameter's gradient summed over the ranks in rank order, into its
//           owner only (a reduce-scatter over a flat buffer)
//   the owner's AdamW shard steps with the global gradient norm (the shards' sums of squares
//           added in rank order); share_values: every rank gets the owners' new values (an
//           all-gather)
//   MoE bias update from the expert counts summed over the ranks
// Each parameter belongs to one rank (contiguous runs of the parameter order, balanced by size):
// only its owner holds its FP32 master and AdamW moments. A checkpoint gathers the shards to rank
// 0 and is written in the one-process layout, so it resumes at any N.
//
// Expert parallelism of degree ep on top (ExpertGroups): the routed experts' weights are split
// over the ep ranks of an expert group, each holding rows [s E / ep, (s + 1) E / ep) of every
// expert tensor. The ranks holding the same experts (one per expert group) are an expert-data
// group: the expert weights' gradients are summed over it and their optimizer state sharded over
// it, as the dense parameters' over all N. Every token of a rank's part is routed with the global
// router and its rows run on the ranks of its experts (MoeLayer's all-to-alls within the expert
// group), so each expert's gradient summed over its expert-data group is the global batch's.
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/safetensors.h"
#include "dist/comm.h"
#include "layers/module.h"
#include "train/adamw.h"
#include "train/data.h"

namespace hlm::train {

// Rank `rank`'s part of a global batch split over `size` ranks: a contiguous run of whole
// sequences, the run boundaries at the sequences nearest to equal token counts, every part at
// least one sequence (hlm::Error when the batch has fewer sequences than ranks). Tokens, targets
// and the loss mask are sliced and cu_seqlens rebased; eval_positions are dropped (training only).
Batch shard_batch(const Batch& global, int rank, int size);

// The global batch's denominators of the mean losses (HybridModel's ModelInputs normalizers):
// targets that are not ignored, MTP targets (position i's target is that of i + 1 in the same
// sequence) and non-empty sequences.
struct LossNormalizers {
  int64_t lm = 0, mtp = 0, sequences = 0;
};
LossNormalizers global_normalizers(const Batch& global);

// The process groups of expert parallelism of degree ep over a job of N processes (ep divides
// N): expert group g is the ranks [g ep, (g + 1) ep), rank r holding expert share r % ep; the
// expert-data group of share s is the ranks r with r % ep == s, in rank order. So world rank 0
// is share 0 of expert group 0 and rank 0 of its expert-data group. On GPUs (gpu = true) each
// group also gets an NCCL communicator (dist/nccl_comm.h) for the tensors.
struct ExpertGroups {
  int ep = 1;
  std::unique_ptr<dist::Comm> experts, experts_device;  // this rank's expert group
  std::unique_ptr<dist::Comm> data, data_device;        // this rank's expert-data group
  // The group the MoE layers dispatch over: NCCL's on GPUs, else the host's.
  dist::Comm* dispatch() const { return experts_device ? experts_device.get() : experts.get(); }
};
// Every rank of `world` calls with the same ep (hlm::Error when it does not divide N).
ExpertGroups make_expert_groups(dist::Comm& world, int ep, bool gpu);

class DataParallel {
 public:
  // params: every parameter of the model in a fixed order (Module::named_parameters), the same
  // on every rank, contiguous, all on one device (which may change between calls: a trainer
  // moves its model after setup). comm: the host communicator (metadata, norms, the optimizer
  // state, counts); device_comm: a communicator of the same ranks whose memory is the GPU
  // (dist/nccl_comm.h), which moves the gradients and values of CUDA parameters (nullptr: the
  // parameters stay on the CPU; hlm::Error if they are found on a GPU).
  DataParallel(dist::Comm& comm, std::vector<std::pair<std::string, Param*>> params,
               dist::Comm* device_comm = nullptr);
  // With expert parallelism: the parameters in `experts` (among params; each [E / ep, ...], this
  // rank's share) are kept over groups.data instead (groups outlives this object).
  DataParallel(dist::Comm& comm, std::vector<std::pair<std::string, Param*>> params,
               dist::Comm* device_comm, const ExpertGroups& groups,
               const std::vector<Param*>& experts);
  ~DataParallel();

  dist::Comm& comm() const { return comm_; }
  int rank() const { return comm_.rank(); }
  int size() const { return comm_.size(); }
  // The rank that owns dense parameter i (of those not expert-parallel), and this rank's
  // parameters, dense and expert (what its AdamW shard updates).
  int owner(size_t i) const;
  std::vector<std::pair<std::string, Param*>> owned() const;

  // Expert parallelism: rank 0 gets each of `local` (this rank's shares [E / ep, ...] of expert
  // tensors, host or device, the same list on every rank) whole, [E, ...] on the host, the
  // shares stacked in share order; the other ranks an empty vector. Every rank calls. Without
  // expert parallelism: `local` itself on rank 0.
  std::vector<Tensor> gather_experts(const std::vector<Tensor>& local) const;
  // The expert tensor `name`'s rows of this rank's share, from a whole [E, ...] tensor (a view);
  // other names pass through.
  Tensor expert_share(const std::string& name, const Tensor& whole) const;

  // Every owned parameter's gradient becomes the sum over the ranks (rank order); the gradients
  // of the other parameters are left as they are (this rank's shares, no longer needed).
  void reduce_gradients();
  // The global gradient norm of the reduced gradients: the shards' sums of squares (each in
  // AdamW's order) added in rank order; the same on every rank.
  GradNorm grad_norm(const AdamW& shard) const;
  // Every rank gets each parameter's value from its owner.
  void share_values();

  // The optimizer state in the one-process layout (AdamW::state_dict's names and dtypes): rank 0
  // gets every parameter's tensors (host copies), the other ranks an empty map. Every rank calls.
  safetensors::TensorMap gather_state(const AdamW& shard, const std::string& prefix) const;
  // This rank's entries of a whole state (what AdamW::load_state_dict of the shard takes); a
  // tensor under `prefix` that belongs to no parameter is an error naming it.
  safetensors::TensorMap shard_state(const safetensors::TensorMap& whole,
                                     const std::string& prefix) const;

  // Sums over the ranks, in rank order (the same bits everywhere).
  void allreduce(std::vector<double>& v) const;
  void allreduce(std::vector<int64_t>& v) const;

 private:
  // The communicator that moves the parameters' data, on their device `dev` (now).
  dist::Comm& data_comm(Device* dev) const;
  // The dense parameters' gathered state on rank 0 (the others: empty).
  safetensors::TensorMap gather_own_state(const safetensors::TensorMap& local,
                                          const std::string& prefix) const;

  dist::Comm& comm_;
  dist::Comm* device_comm_ = nullptr;
  std::vector<std::pair<std::string, Param*>> params_;
  std::vector<int> owner_;          // per parameter
  std::vector<int64_t> offset_;     // per parameter: its first element in the flat order
  std::vector<int64_t> seg_begin_;  // per rank: its first parameter index
  int64_t seg_elems_ = 0;           // the largest rank's gradient elements (the buffer's stride)
  int64_t seg_bytes_ = 0;           // the largest rank's value bytes
  DType grad_dtype_ = DType::f32;
  // Expert parallelism: the groups, the expert weights' names, and their data parallelism over
  // groups_->data.
  const ExpertGroups* groups_ = nullptr;
  std::set<std::string> expert_names_;
  std::unique_ptr<DataParallel> experts_;
};

}  // namespace hlm::train
