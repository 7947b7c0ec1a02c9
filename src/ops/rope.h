// Rotary position embedding on a channel range of every row:
//   x [T, L] or [T, n, L]; channels [offset, offset + rope_dim) of each row of token t are rotated
//   pair by pair, pair i (i < rope_dim / 2) by the angle pos[t] * inv_freq[i]:
//     c = cos(angle) * factor,  s = sin(angle) * factor   (cos / sin rounded to the computation
//                                                           dtype, then scaled)
//     forward: (a, b) -> (a c - b s, a s + b c);  inverse (the transpose, for backward):
//              (a, b) -> (a c + b s, -a s + b c)
//   pairs (2i, 2i + 1) when interleaved, (i, i + rope_dim / 2) otherwise (NeoX halves).
//   The angle is formed in f64 (RopeAngle::f64: double(pos) * inv_freq) or in the computation
//   dtype (RopeAngle::compute: F(pos) * F(inv_freq), as the f32 reference implementations do);
//   cos / sin are evaluated in f64 in both cases. Other channels pass through unchanged.
// pos: i64 [T] (document-relative positions), inv_freq: f64 [rope_dim / 2], both on x's device.
// CPU: f32 / f64. CUDA (ops/cuda/rope.cu): also bf16, computed in f32 (f64 for f64).
#pragma once

#include "core/tensor.h"

namespace hlm::ops {

enum class RopeAngle { f64, compute };

struct RopeOptions {
  int64_t offset = 0;    // first rotated channel
  int64_t rope_dim = 0;  // rotated channels (even); 0 = identity
  double factor = 1.0;   // cos / sin scale (YaRN attention factor)
  bool interleave = true;
  bool inverse = false;
  RopeAngle angle = RopeAngle::compute;
};

// Returns the rotated copy of x.
Tensor rope(const Tensor& x, const Tensor& pos, const Tensor& inv_freq, const RopeOptions& opt);
// Rotates x (contiguous) in place.
void rope_inplace(Tensor& x, const Tensor& pos, const Tensor& inv_freq, const RopeOptions& opt);

}  // namespace hlm::ops
