// Context parallelism: one packed batch split along its tokens over the ranks of a group
// (docs/parallel.md, "Context parallelism").
//
// A CpSlice says which contiguous run of the packed batch this rank holds and, for every rank of
// the group, whether its slice starts inside a sequence (so it continues one that an earlier rank
// holds the start of) and whether its last sequence goes on into the next rank. The layers that
// look along the sequence (KDA's short conv and chunked recurrence) read it to pass on what
// crosses a slice boundary; the token-wise layers need nothing. Every rank builds the same
// description from the same global layout, so the ranks agree on every exchange without sending
// the layout.
//
// Rank r of the group holds tokens [bounds[r], bounds[r+1]) of the global batch: the ranks' slices
// follow the group's rank order, each non-empty. local() is the global layout cut to the slice
// (the sequences that overlap it, each clipped; a sequence cut by a boundary is one sequence on
// either side).
#pragma once

#include <cstdint>
#include <vector>

#include "core/seq_layout.h"
#include "core/tensor.h"
#include "dist/comm.h"

namespace hlm::dist {

class CpSlice {
 public:
  // comm: the context-parallel group (kept by reference: it must outlive the slice). global: the
  // whole packed batch (T >= size() tokens). bounds: [size() + 1] token offsets, 0 = b_0 < b_1 <
  // ... < b_size = T. Errors (hlm::Error) name what does not fit.
  CpSlice(Comm& comm, const SeqLayout& global, std::vector<int64_t> bounds);

  // The even split: rank r holds tokens [floor(r T / n), floor((r + 1) T / n)). T >= n.
  static std::vector<int64_t> even_bounds(int64_t T, int n);

  Comm& comm() const { return *comm_; }
  int rank() const { return rank_; }
  int size() const { return int(bounds_.size()) - 1; }
  const SeqLayout& global() const { return global_; }
  const SeqLayout& local() const { return local_; }  // this rank's sequences
  int64_t begin(int r) const { return bounds_[size_t(r)]; }
  int64_t end(int r) const { return bounds_[size_t(r) + 1]; }
  int64_t tokens(int r) const { return end(r) - begin(r); }
  const std::vector<int64_t>& bounds() const { return bounds_; }  // [size() + 1]
  // Rank r's first token is not the start of its sequence (r > 0 and a sequence spans b_r).
  bool continues(int r) const { return flags_[size_t(r)] & kContinues; }
  // Rank r's last sequence goes on in rank r + 1 (continues(r + 1)).
  bool goes_on(int r) const { return r + 1 < size() && continues(r + 1); }
  // Rank r's slice lies inside one sequence (its local layout has one sequence).
  bool single(int r) const { return flags_[size_t(r)] & kSingle; }
  // The first token of the sequence that holds global token t (t in [0, T)).
  int64_t sequence_begin(int64_t t) const;
  // The rank that holds global token t.
  int owner(int64_t t) const;

  // Comm::allgather and Comm::alltoall over the group for a tensor on any device
  // (dist::allgather_from / alltoall_from: a host communicator with GPU tensors copies them).
  Tensor allgather(const Tensor& t) const;
  Tensor alltoall(const Tensor& t) const;

 private:
  static constexpr uint8_t kContinues = 1, kSingle = 2;
  Comm* comm_;
  int rank_;
  SeqLayout global_, local_;
  std::vector<int64_t> bounds_;
  std::vector<uint8_t> flags_;
};

}  // namespace hlm::dist
