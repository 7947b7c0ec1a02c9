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
#pragma once

#include <cstdint>
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

  dist::Comm& comm() const { return comm_; }
  int rank() const { return comm_.rank(); }
  int size() const { return comm_.size(); }
  // The rank that owns parameter i, and this rank's parameters (what its AdamW shard updates).
  int owner(size_t i) const;
  std::vector<std::pair<std::string, Param*>> owned() const;

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

  dist::Comm& comm_;
  dist::Comm* device_comm_ = nullptr;
  std::vector<std::pair<std::string, Param*>> params_;
  std::vector<int> owner_;          // per parameter
  std::vector<int64_t> offset_;     // per parameter: its first element in the flat order
  std::vector<int64_t> seg_begin_;  // per rank: its first parameter index
  int64_t seg_elems_ = 0;           // the largest rank's gradient elements (the buffer's stride)
  int64_t seg_bytes_ = 0;           // the largest rank's value bytes
  DType grad_dtype_ = DType::f32;
};

}  // namespace hlm::train
