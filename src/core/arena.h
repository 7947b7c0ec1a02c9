// Arena: one allocation planned up front, carved into workspace tensors (64-byte aligned) by a
// bump pointer. Hot paths take their scratch from an arena instead of allocating; the peak use is
// a printed number. reset() releases everything at once (tensors carved earlier must not be used
// afterwards: their bytes will be handed out again).
#pragma once

#include <memory>

#include "core/tensor.h"

namespace hlm {

class Arena {
 public:
  Arena(size_t capacity_bytes, Device dev = Device::cpu);
  Tensor alloc(const Shape& shape, DType dt);  // throws hlm::Error when the arena is full
  void reset() { used_ = 0; }
  size_t used() const { return used_; }
  size_t peak() const { return peak_; }
  size_t capacity() const { return storage_->nbytes; }
  Device device() const { return storage_->device; }
  // Bytes `alloc` takes for a tensor (rounded up to the alignment), for planning a capacity.
  static size_t footprint(const Shape& shape, DType dt);

 private:
  std::shared_ptr<Storage> storage_;
  size_t used_ = 0, peak_ = 0;
};

}  // namespace hlm
