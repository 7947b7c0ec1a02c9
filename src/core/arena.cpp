#include "core/arena.h"

#include <algorithm>

namespace hlm {

static constexpr size_t kAlign = 64;

Arena::Arena(size_t capacity_bytes, Device dev)
    : storage_(std::make_shared<Storage>(dev, std::max<size_t>(capacity_bytes, kAlign))) {}

// Checked: shape_nbytes refuses overflow, and the rounding cannot wrap below 2^63.
size_t Arena::footprint(const Shape& shape, DType dt) {
  return (shape_nbytes(shape, dt) + kAlign - 1) / kAlign * kAlign;
}

Tensor Arena::alloc(const Shape& shape, DType dt) {
  const size_t need = footprint(shape, dt);
  HLM_CHECK(need <= storage_->nbytes - used_, "arena full: {} {} needs {} bytes, {} of {} are used",
            dtype_name(dt), shape_str(shape), need, used_, storage_->nbytes);
  Tensor t = Tensor::wrap(storage_, used_, shape, dt);
  used_ += need;
  peak_ = std::max(peak_, used_);
  return t;
}

}  // namespace hlm
