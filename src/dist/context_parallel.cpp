// CpSlice (dist/context_parallel.h): this rank's run of a packed batch split over a group.
#include "dist/context_parallel.h"

#include <algorithm>

#include "core/error.h"
#include "ops/tensor_ops.h"

namespace hlm::dist {

CpSlice::CpSlice(Comm& comm, const SeqLayout& global, std::vector<int64_t> bounds)
    : comm_(&comm), rank_(comm.rank()), global_(global), bounds_(std::move(bounds)) {
  const int n = comm.size();
  const int64_t T = global.total_tokens();
  HLM_CHECK(int(bounds_.size()) == n + 1,
            "context parallel: the slice bounds must hold group size + 1 = {} offsets, got {}",
            n + 1, bounds_.size());
  HLM_CHECK(bounds_.front() == 0 && bounds_.back() == T,
            "context parallel: the slice bounds must run from 0 to the batch's {} tokens, got {} "
            "to {}",
            T, bounds_.front(), bounds_.back());
  for (int r = 0; r < n; ++r)
    HLM_CHECK(bounds_[size_t(r)] < bounds_[size_t(r) + 1],
              "context parallel: rank {}'s slice [{}, {}) is empty (every rank needs a token)", r,
              bounds_[size_t(r)], bounds_[size_t(r) + 1]);
  flags_.assign(size_t(n), 0);
  for (int r = 0; r < n; ++r) {
    const int64_t b = begin(r), s = sequence_begin(b);
    if (s < b) flags_[size_t(r)] |= kContinues;
    const std::vector<int64_t>& off = global_.offsets();
    // The sequence holding b ends at the first offset above b.
    const int64_t seq_end = *std::upper_bound(off.begin(), off.end(), b);
    if (seq_end >= end(r)) flags_[size_t(r)] |= kSingle;
  }
  // This rank's sequences: the global boundaries strictly inside the slice.
  const int64_t t0 = begin(rank_), t1 = end(rank_);
  std::vector<int64_t> local{0};
  for (int64_t c : global_.offsets())
    if (c > t0 && c < t1 && c - t0 != local.back()) local.push_back(c - t0);
  local.push_back(t1 - t0);
  local_ = SeqLayout::from_offsets(std::move(local), t1 - t0, "context parallel: local layout");
}

std::vector<int64_t> CpSlice::even_bounds(int64_t T, int n) {
  HLM_CHECK(n >= 1 && T >= n,
            "context parallel: {} tokens cannot be split over {} ranks (each needs a token)", T, n);
  std::vector<int64_t> b(size_t(n) + 1);
  for (int r = 0; r <= n; ++r) b[size_t(r)] = int64_t(r) * T / n;
  return b;
}

int64_t CpSlice::sequence_begin(int64_t t) const {
  const std::vector<int64_t>& off = global_.offsets();
  HLM_CHECK(t >= 0 && t < global_.total_tokens(), "context parallel: token {} is outside [0, {})",
            t, global_.total_tokens());
  // The last offset <= t starts the (non-empty) sequence that holds t.
  return *(std::upper_bound(off.begin(), off.end(), t) - 1);
}

int CpSlice::owner(int64_t t) const {
  HLM_CHECK(t >= 0 && t < bounds_.back(), "context parallel: token {} is outside [0, {})", t,
            bounds_.back());
  return int(std::upper_bound(bounds_.begin(), bounds_.end(), t) - bounds_.begin()) - 1;
}

Tensor CpSlice::allgather(const Tensor& t) const {
  return allgather_from(*comm_, t);
}

Tensor CpSlice::alltoall(const Tensor& t) const {
  return alltoall_from(*comm_, t);
}

}  // namespace hlm::dist
