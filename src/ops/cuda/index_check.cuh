// The check of integer indices on the device (embedding ids, cross-entropy targets), for the front
// doors that refuse a bad index with the CPU reference's message without copying every index to
// the host. Host interface, includable from C++.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace hlm::ops::cuda {

struct IndexScan {
  int64_t first_bad = -1;  // smallest flat position whose value is bad; -1 when none
  int64_t bad_value = 0;   // the value at first_bad
  int64_t kept = 0;        // positions whose value is not `ignore` (all when !has_ignore)
};

// idx: i64 or i32, contiguous, on the device, any shape (flat positions). A value is bad when it
// is outside [0, bound) and (with has_ignore) not equal to `ignore`. One launch of one block and a
// copy of three integers to the host (synchronises with the device).
IndexScan scan_indices(const Tensor& idx, int64_t bound, bool has_ignore, int64_t ignore);

}  // namespace hlm::ops::cuda
