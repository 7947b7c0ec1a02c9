// The FP8 blockwise quantizer on the CPU (ops/fp8_quant.h, the reference; entry points in
// ops/cpu/fp8_quant.h). This is the reference the CUDA quantizer must match bit for bit: every
// step is one FP32 operation with round to nearest.
#include "ops/cpu/fp8_quant.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace hlm::ops::cpu {

namespace {

// Quantize the elements [r0, r1) x [c0, c0 + 128) of the row-major f32 matrix `x` (row stride
// `ld`) with one scale; write codes into q (same layout) and return scale_inv.
float quantize_tile(const float* x, int64_t ld, int64_t r0, int64_t r1, int64_t c0, uint8_t* q,
                    const QuantRecipe& rc) {
  float amax = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = x + r * ld + c0;
    for (int64_t c = 0; c < kFp8TileSize; ++c) amax = std::fmax(amax, std::fabs(row[c]));
  }
  const float s = fp8_scale_inv(amax, rc.format, rc.pow2);
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = x + r * ld + c0;
    uint8_t* qrow = q + r * ld + c0;
    for (int64_t c = 0; c < kFp8TileSize; ++c)
      qrow[c] = float_to_fp8(row[c] / s, rc.format, Saturate::finite);
  }
  return s;
}

}  // namespace

void fp8_quantize(const Tensor& x, Fp8Tensor& out) {
  const char* op = "fp8_quantize";
  const QuantRecipe& rc = out.recipe;
  const int64_t rows = x.size(0), cols = x.size(1);
  const Tensor xf = x.dtype() == DType::f32 ? x.contiguous() : x.to(DType::f32);
  const float* xp = xf.data<float>();
  for (int64_t i = 0; i < rows * cols; ++i)
    HLM_CHECK(std::isfinite(xp[i]), "{}: x[{}, {}] = {} is not finite (recipe {})", op, i / cols,
              i % cols, xp[i], recipe_str(rc));
  uint8_t* q = static_cast<uint8_t*>(out.q.raw());
  float* s = out.scale_inv.data<float>();
  const int64_t cb = cols / kFp8TileSize;
  if (rc.tile == TileShape::t1x128) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < cb; ++b)
        s[r * cb + b] = quantize_tile(xp, cols, r, r + 1, b * kFp8TileSize, q, rc);
  } else {
    const int64_t rb = (rows + kFp8TileSize - 1) / kFp8TileSize;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rb * cb; ++i) {
      const int64_t br = i / cb, bc = i % cb;
      const int64_t r0 = br * kFp8TileSize, r1 = std::min(rows, r0 + kFp8TileSize);
      s[i] = quantize_tile(xp, cols, r0, r1, bc * kFp8TileSize, q, rc);
    }
  }
}

void fp8_dequantize(const Fp8Tensor& t, Tensor& out) {
  const int64_t rows = t.rows(), cols = t.cols(), cb = cols / kFp8TileSize;
  const Tensor sc = t.scale_inv.contiguous();
  const float* s = sc.data<float>();
  const uint8_t* q = static_cast<const uint8_t*>(t.q.raw());
  float* o = out.data<float>();
  const bool tile = t.recipe.tile == TileShape::t1x128;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t sr = tile ? r : r / kFp8TileSize;
    for (int64_t c = 0; c < cols; ++c)
      o[r * cols + c] =
          fp8_to_float(q[r * cols + c], t.recipe.format) * s[sr * cb + c / kFp8TileSize];
  }
}

void fp8_values(const Fp8Tensor& t, Tensor& out) {
  const uint8_t* q = static_cast<const uint8_t*>(t.q.raw());
  float* o = out.data<float>();
  for (int64_t i = 0; i < t.q.numel(); ++i) o[i] = fp8_to_float(q[i], t.recipe.format);
}

void fp8_transpose_blocks(const Fp8Tensor& w, Fp8Tensor& t) {
  const int64_t R = w.rows(), C = w.cols(), Rp = t.q.size(1);
  t.q.zero_();
  const uint8_t* src = static_cast<const uint8_t*>(w.q.raw());
  uint8_t* dst = static_cast<uint8_t*>(t.q.raw());
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) dst[c * Rp + r] = src[r * C + c];
  t.scale_inv.copy_(w.scale_inv.transpose(0, 1));
}

void fp8_gemm_tn(const Fp8Tensor& a, const Fp8Tensor& b, Tensor& c) {
  const int64_t M = a.rows(), N = b.rows(), K = a.cols(), KB = K / kFp8TileSize;

  // fp8 codes -> exact float values (a 256-entry table per format), B transposed to [K, N] so the
  // inner loop runs over n with every C element keeping its own ascending-k order.
  float lut_a[256], lut_b[256];
  for (int i = 0; i < 256; ++i) {
    lut_a[i] = fp8_to_float(uint8_t(i), a.recipe.format);
    lut_b[i] = fp8_to_float(uint8_t(i), b.recipe.format);
  }
  const uint8_t* qa = static_cast<const uint8_t*>(a.q.raw());
  const uint8_t* qb = static_cast<const uint8_t*>(b.q.raw());
  std::vector<float> bt(size_t(K * N));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) bt[size_t(k * N + n)] = lut_b[qb[n * K + k]];
  // Per-row scales of B for every K block: sb[n * KB + kb].
  const Tensor sbt = b.scale_inv.contiguous();
  const float* sbp = sbt.data<float>();
  std::vector<float> sb(size_t(N * KB));
  const bool b_tile = b.recipe.tile == TileShape::t1x128;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t kb = 0; kb < KB; ++kb)
      sb[size_t(n * KB + kb)] = sbp[(b_tile ? n : n / kFp8TileSize) * KB + kb];
  const Tensor sat = a.scale_inv.contiguous();
  const float* sa = sat.data<float>();

  float* cp = c.data<float>();
#pragma omp parallel
  {
    std::vector<float> part(static_cast<size_t>(N));
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) {
      float* acc = cp + m * N;
      for (int64_t n = 0; n < N; ++n) acc[n] = 0.0f;
      for (int64_t kb = 0; kb < KB; ++kb) {
        for (int64_t n = 0; n < N; ++n) part[size_t(n)] = 0.0f;
        for (int64_t k = kb * kFp8TileSize; k < (kb + 1) * kFp8TileSize; ++k) {
          const float av = lut_a[qa[m * K + k]];
          if (av == 0.0f) continue;  // adds exact zeros only: skipping changes no bit
          const float* brow = bt.data() + k * N;
          // av * brow[n] is exact in FP32 (fp8 x fp8 significands fit), so a fused multiply-add
          // here would round identically.
          for (int64_t n = 0; n < N; ++n) part[size_t(n)] += av * brow[n];
        }
        const float s_a = sa[m * KB + kb];
        for (int64_t n = 0; n < N; ++n) {
          const float s = s_a * sb[size_t(n * KB + kb)];
          const float t = part[size_t(n)] * s;
          acc[n] = acc[n] + t;
        }
      }
    }
  }
}

}  // namespace hlm::ops::cpu
