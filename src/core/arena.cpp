#include "core/arena.h"

#include <algorithm>

namespace hlm {

static constexpr size_t kAlign = 64;

Arena::Arena(size_t capacity_bytes, Device dev)
    : storage_(std::make_shared<Storage>(dev, std::max<size_t>(capacity_bytes, kAlign))) {}

size_t Arena::footprint(const Shape& shape, DType dt) {
  return (size_t(shape_numel(shape)) * dtype_size(dt) + kAlign - 1) / kAlign * kAlign;
}

Tensor Arena::alloc(const Shape& shape, DType dt) {
  const size_t need = footprint(shape, dt);
  HLM_CHECK(used_ + need <= storage_->nbytes, "arena full: {} {} needs {} bytes, {} of {} are used",
            dtype_name(dt), shape_str(shape), need, used_, storage_->nbytes);
  Tensor t = Tensor::wrap(storage_, used_, shape, dt);
  used_ += need;
  peak_ = std::max(peak_, used_);
  return t;
}

}  // namespace hlm
