// Output allocation of the ops' front doors (ops/dispatch.h).
#include "ops/dispatch.h"

#include <atomic>

#include "core/device.h"

namespace hlm::ops {
namespace {
std::atomic<bool> g_poison{false};
}

void set_poison_outputs(bool on) {
  g_poison = on;
}

bool poison_outputs() {
  return g_poison;
}

namespace detail {
Tensor new_output(const Shape& shape, DType dt, Device dev) {
  Tensor t = Tensor::empty(shape, dt, dev);
  if (g_poison && t.nbytes() > 0) device_memset(dev, t.raw(), 0xFF, t.nbytes());
  return t;
}
}  // namespace detail

}  // namespace hlm::ops
