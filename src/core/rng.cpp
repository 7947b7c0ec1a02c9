#include "core/rng.h"

#include <cmath>
#include <vector>

namespace hlm {

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t(M0) * c[0], p1 = uint64_t(M1) * c[2];
    c = {uint32_t(p1 >> 32) ^ c[1] ^ k[0], uint32_t(p1), uint32_t(p0 >> 32) ^ c[3] ^ k[1],
         uint32_t(p0)};
    k[0] += W0;
    k[1] += W1;
  }
  return c;
}

std::array<uint32_t, 4> Rng::block_at(uint64_t c) const {
  return philox4x32({uint32_t(c), uint32_t(c >> 32), uint32_t(stream_), uint32_t(stream_ >> 32)},
                    {uint32_t(seed_), uint32_t(seed_ >> 32)});
}

std::array<uint32_t, 4> Rng::block() {
  return block_at(counter_++);
}

namespace {

double uniform_of(const std::array<uint32_t, 4>& b) {
  return double(((uint64_t(b[0]) << 32) | b[1]) >> 11) * 0x1.0p-53;
}

double normal_of(const std::array<uint32_t, 4>& b) {
  const uint64_t a = (uint64_t(b[0]) << 32 | b[1]) >> 11, c = (uint64_t(b[2]) << 32 | b[3]) >> 11;
  const double u1 = (double(a) + 1.0) * 0x1.0p-53;  // (0, 1]
  const double u2 = double(c) * 0x1.0p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

}  // namespace

uint32_t Rng::next_u32() {
  return block()[0];
}
uint64_t Rng::next_u64() {
  auto b = block();
  return (uint64_t(b[0]) << 32) | b[1];
}
double Rng::uniform() {
  return uniform_of(block());
}
double Rng::normal() {
  return normal_of(block());
}
uint64_t Rng::below(uint64_t n) {
  HLM_CHECK(n > 0, "Rng::below(0)");
  const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  uint64_t x;
  do x = next_u64();
  while (x >= limit);
  return x % n;
}

// Element i takes the block at counter + i, so the elements are drawn in parallel with the values
// (and the final counter) of the sequential draws.
void Rng::fill_uniform(Tensor& t, double lo, double hi) {
  check_device(t, Device::cpu, "fill_uniform");
  const int64_t n = t.numel();
  std::vector<double> v(static_cast<size_t>(n));
  const uint64_t base = counter_;
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = lo + (hi - lo) * uniform_of(block_at(base + i));
  counter_ = base + uint64_t(n);
  t.copy_(Tensor::from_values(t.shape(), v, DType::f64));
}

void Rng::fill_normal(Tensor& t, double mean, double std) {
  check_device(t, Device::cpu, "fill_normal");
  const int64_t n = t.numel();
  std::vector<double> v(static_cast<size_t>(n));
  const uint64_t base = counter_;
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = mean + std * normal_of(block_at(base + i));
  counter_ = base + uint64_t(n);
  t.copy_(Tensor::from_values(t.shape(), v, DType::f64));
}

Tensor randn(const Shape& shape, DType dt, Rng& rng, double std) {
  Tensor t = Tensor::empty(shape, dt);
  rng.fill_normal(t, 0.0, std);
  return t;
}

Tensor rand_uniform(const Shape& shape, DType dt, Rng& rng, double lo, double hi) {
  Tensor t = Tensor::empty(shape, dt);
  rng.fill_uniform(t, lo, hi);
  return t;
}

}  // namespace hlm
