// Inputs shared by the KDA GPU tests (kda_chunk_gpu_test.cpp, kda_chunk_bwd_gpu_test.cpp): the
// CPU problems they build and their copy to the device, and the sequence shapes that differ
// between a GPU and the CPU emulation. `Case` is each test's own case struct
// with the fields name, lens, H, HV, K, V, dt, h0, gate, scale.
#pragma once

#include <vector>

#include "core/device.h"
#include "ops/kda.h"
#include "testing.h"

namespace hlm::kda_gpu_test {

// plain: g in (-5, 0); strong: g in (-12, 0) (diagonal blocks spanning > 80 nats take the
// per-element exp path); fused gates: z with A_log, dt_bias.
enum class Gate { plain, strong, lower_bound, standard };

// CPU inputs. Plain: l2-normalised q, k, beta in (0.05, 0.95), g in (-5, 0) skewed to 0 (strong:
// g in (-12, 0)). Fused gates: raw q, k (use_qk_l2norm), beta logits, raw z with A_log and
// dt_bias.
template <class Case>
inline ops::KdaArgs make_inputs(const Case& c, Rng& rng) {
  std::vector<int64_t> cu{0};
  for (int64_t l : c.lens) cu.push_back(cu.back() + l);
  const int64_t T = cu.back(), N = int64_t(c.lens.size());
  ops::KdaArgs a;
  auto unit = [&](const Shape& s) { return testing::randn_unit_rows(s, c.dt, rng); };
  if (c.gate == Gate::plain || c.gate == Gate::strong) {
    a.q = unit({T, c.H, c.K});
    a.k = unit({T, c.H, c.K});
    a.beta = rand_uniform({T, c.HV}, c.dt, rng, 0.05, 0.95);
    Tensor u = rand_uniform({T, c.HV, c.K}, DType::f64, rng, 0, 1);
    double* ud = u.data<double>();
    for (int64_t i = 0; i < u.numel(); ++i)
      ud[i] = c.gate == Gate::plain ? -5.0 * ud[i] * ud[i] * ud[i] - 1e-3 : -12.0 * ud[i] - 1e-3;
    a.g = u.to(c.dt);
  } else {
    a.q = randn({T, c.H, c.K}, c.dt, rng);
    a.k = randn({T, c.H, c.K}, c.dt, rng);
    a.use_qk_l2norm = true;
    a.beta = randn({T, c.HV}, c.dt, rng);
    a.beta_logits = true;
    a.g = randn({T, c.HV, c.K}, c.dt, rng, 2.0);
    if (c.gate == Gate::lower_bound) {
      a.gate = ops::KdaGateKind::lower_bound;
      a.lower_bound = -5.0;
      a.A_log = rand_uniform({c.HV}, DType::f32, rng, -0.5, 0.5);
    } else {
      a.gate = ops::KdaGateKind::standard;
      a.A_log = rand_uniform({c.HV}, DType::f32, rng, -1.0, 1.0);
    }
    a.dt_bias = rand_uniform({c.HV * c.K}, DType::f32, rng, -1, 1);
  }
  a.v = randn({T, c.HV, c.V}, c.dt, rng);
  if (c.h0) a.initial_state = randn({N, c.HV, c.K, c.V}, DType::f32, rng, 0.5);
  a.seqs = SeqLayout::from_offsets(cu, T);
  a.scale = c.scale;
  return a;
}

inline ops::KdaArgs to_device(const ops::KdaArgs& c, bool cu_on_device) {
  ops::KdaArgs g = c;
  for (Tensor* t : {&g.q, &g.k, &g.v, &g.g, &g.beta, &g.initial_state, &g.A_log, &g.dt_bias})
    if (t->defined()) *t = t->to(Device::cuda);
  // The layout read back from a cu_seqlens tensor on the device (one small synchronous copy).
  if (cu_on_device) g.seqs = SeqLayout::from_tensor(c.seqs->cu_seqlens(Device::cuda), c.v.size(0));
  return g;
}

// The long sequence: 1000 tokens (16 chunks) on a GPU, 200 (4 chunks, the last one partial: the
// same inter-chunk code) on the CPU emulation of CI, where the test time grows with it.
inline const std::vector<int64_t> kOddLens =
    cuda_emulated() ? std::vector<int64_t>{1, 63, 65, 200} : std::vector<int64_t>{1, 63, 65, 1000};
// The wide-state-tile cases need N x HV x V / 64 >= 132 (the SMs) blocks of the state pass: on a
// GPU 4 sequences (the longest 300 tokens) x 24 value heads (8 q/k heads); on the emulation, where
// the time grows with tokens x heads, 12 short sequences x 6 value heads (2 q/k heads): 144 blocks.
struct WideShape {
  std::vector<int64_t> lens;
  int64_t H, HV;
};
inline WideShape wide() {
  if (cuda_emulated()) return {{1, 63, 65, 2, 5, 9, 17, 30, 1, 3, 8, 20}, 2, 6};
  return {{1, 63, 65, 300}, 8, 24};
}

}  // namespace hlm::kda_gpu_test
