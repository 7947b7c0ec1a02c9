// Shared by the GPU tests of the layer ops, LayerNorm, RoPE and the Hadamard rotation: a GPU output
// checked against the CPU op on the same inputs (f32: max error / max |ref| <= 2e-5; f64: <= 1e-12;
// bf16: relative L2 <= 2e-3 against the CPU f32 op on the bf16-rounded inputs), errors printed. A
// bf16 output is itself rounded to bf16: its rounding alone (the relative L2 of the reference
// rounded to bf16, "floor", printed) can pass 2e-3 on short rows (bf16 unit roundoff 2^-8), so the
// bound of a bf16 output is max(2e-3, 1.05 floor): nothing but the output rounding may add up.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/rng.h"
#include "testing.h"

namespace hlm::gpu_compare {

// The largest error of out against ref over the largest |ref| (NaN / Inf mismatches asserted
// absent): the f32 / f64 metric of the module and model GPU tests.
inline double max_rel_err(const Tensor& out, const Tensor& ref) {
  const testing::ErrorStats e = testing::compare(out.to(DType::f64), ref.to(DType::f64));
  double m = 0;
  for (double v : ref.to_f64_vector()) m = std::max(m, std::fabs(v));
  EXPECT_EQ(e.nan_mismatch, 0);
  return m > 0 ? e.max_abs / m : e.max_abs;
}

// bf16_bound > 0 replaces the bf16 bound by a fixed relative L2 bound (the layer ops' 3e-3).
// ref_scale > 0 is the least denominator of the f32 / f64 metric: for an output that can be zero
// up to rounding (the gradient of a top-1 router's normalised weight, which is 1 whatever the
// logit), the magnitude of the inputs it is computed from, so that two roundings of zero compare
// as equal instead of as 100% apart.
inline void check(const char* what, const Tensor& out_gpu, const Tensor& ref, DType dt,
                  double bf16_bound = 0, double ref_scale = 0) {
  const Tensor o = testing::cpu(out_gpu).to(ref.dtype());
  const testing::ErrorStats e = testing::compare(o, ref);
  double mref = 0;
  for (double v : ref.to_f64_vector()) mref = std::max(mref, std::fabs(v));
  mref = std::max(mref, ref_scale);
  const double maxrel = mref > 0 ? e.max_abs / mref : e.max_abs;
  const bool bf16_out = out_gpu.dtype() == DType::bf16;
  const double floor =
      bf16_out ? testing::compare(testing::round_bf16(ref).to(ref.dtype()), ref).rel_l2 : 0.0;
  std::printf("  %-28s %-5s max_err/max|ref| %.3e  rel_l2 %.3e  bf16 floor %.3e\n", what,
              dtype_name(dt), maxrel, e.rel_l2, floor);
  EXPECT_EQ(e.nan_mismatch, 0) << what;
  if (dt == DType::f32) {
    EXPECT_LE(maxrel, 2e-5) << what << " " << e.report(ref);
  } else if (dt == DType::f64) {
    EXPECT_LE(maxrel, 1e-12) << what << " " << e.report(ref);
  } else {
    const double bound = bf16_bound > 0 ? bf16_bound : std::max(2e-3, 1.05 * floor);
    EXPECT_LE(e.rel_l2, bound) << what << " " << e.report(ref);
  }
}

// Inputs for dtype dt: the CPU reference sees x (f32 / f64) or the bf16-rounded x in f32.
struct Pair {
  Tensor ref, dev;
};
inline Pair make(const Shape& s, DType dt, Rng& rng, double std = 1.0) {
  const DType cdt = dt == DType::f64 ? DType::f64 : DType::f32;
  Tensor x = randn(s, cdt, rng, std);
  if (dt == DType::bf16) return {testing::round_bf16(x), testing::gpu(x.to(DType::bf16))};
  return {x, testing::gpu(x)};
}

}  // namespace hlm::gpu_compare
