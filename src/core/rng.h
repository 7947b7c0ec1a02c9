// Deterministic counter-based RNG (Philox-4x32-10, Salmon et al., SC'11). The value drawn for
// element i of stream s under a seed depends only on (seed, s, i): no hidden state, so the same
// tensor is produced whatever the thread count, and a run can resume from (seed, counter).
#pragma once

#include <array>
#include <cstdint>

#include "core/tensor.h"

namespace hlm {

// One Philox-4x32-10 block: 4 random 32-bit words for counter `ctr` under key `key`.
std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> ctr, std::array<uint32_t, 2> key);

class Rng {
 public:
  explicit Rng(uint64_t seed, uint64_t stream = 0) : seed_(seed), stream_(stream) {}
  uint64_t seed() const { return seed_; }
  uint64_t stream() const { return stream_; }
  uint64_t counter() const { return counter_; }
  void set_counter(uint64_t c) { counter_ = c; }

  // Sequential draws (advance the counter by one block per call).
  uint32_t next_u32();
  uint64_t next_u64();
  double uniform();            // [0, 1), 53 random bits
  double normal();             // standard normal (Box-Muller)
  uint64_t below(uint64_t n);  // uniform integer in [0, n), unbiased
  // Fill a CPU floating tensor (contiguous or not) with U[lo, hi) / N(mean, std).
  void fill_uniform(Tensor& t, double lo, double hi);
  void fill_normal(Tensor& t, double mean, double std);

 private:
  std::array<uint32_t, 4> block();                     // the block at the counter, then counter++
  std::array<uint32_t, 4> block_at(uint64_t c) const;  // the block at counter c
  uint64_t seed_, stream_, counter_ = 0;
};

// Convenience constructors for tests and initialisation.
Tensor randn(const Shape& shape, DType dt, Rng& rng, double std = 1.0);
Tensor rand_uniform(const Shape& shape, DType dt, Rng& rng, double lo, double hi);

}  // namespace hlm
