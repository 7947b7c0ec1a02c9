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

std::array<uint32_t, 4> Rng::block() {
  const uint64_t c = counter_++;
  return philox4x32({uint32_t(c), uint32_t(c >> 32), uint32_t(stream_), uint32_t(stream_ >> 32)},
                    {uint32_t(seed_), uint32_t(seed_ >> 32)});
}

uint32_t Rng::next_u32() {
  return block()[0];
}
uint64_t Rng::next_u64() {
  auto b = block();
  return (uint64_t(b[0]) << 32) | b[1];
}
double Rng::uniform() {
  return double(next_u64() >> 11) * 0x1.0p-53;
}
double Rng::normal() {
  auto b = block();
  const uint64_t a = (uint64_t(b[0]) << 32 | b[1]) >> 11, c = (uint64_t(b[2]) << 32 | b[3]) >> 11;
  const double u1 = (double(a) + 1.0) * 0x1.0p-53;  // (0, 1]
  const double u2 = double(c) * 0x1.0p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}
uint64_t Rng::below(uint64_t n) {
  HLM_CHECK(n > 0, "Rng::below(0)");
  const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  uint64_t x;
  do x = next_u64();
  while (x >= limit);
  return x % n;
}

void Rng::fill_uniform(Tensor& t, double lo, double hi) {
  check_device(t, Device::cpu, "fill_uniform");
  std::vector<double> v(size_t(t.numel()));
  for (double& x : v) x = lo + (hi - lo) * uniform();
  t.copy_(Tensor::from_values(t.shape(), v, DType::f64));
}

void Rng::fill_normal(Tensor& t, double mean, double std) {
  check_device(t, Device::cpu, "fill_normal");
  std::vector<double> v(size_t(t.numel()));
  for (double& x : v) x = mean + std * normal();
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
