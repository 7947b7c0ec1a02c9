// FP8 blockwise quantization (DeepSeek-V3 / TransformerEngine Float8BlockScaling; our
// contract: docs/fp8.md, "The FP8 quantizer").
//
// A recipe is data, not a code path (TransformerEngine style): the format (E4M3 / E5M2), the tile
// shape (1x128: one scale per row and 128 consecutive columns; 128x128: one scale per block of 128
// rows by 128 columns) and the scale rule (pow2 or not).
//
// For x [rows, cols] (f32 or f64; an f64 input is first rounded to f32) and one tile X_t:
//   amax_t    = max |x| over the tile (FP32)
//   amax_g    = max(amax_t, 1e-12f)                              (all-zero tiles: no 0/0, no NaN)
//   scale_inv = amax_g / fp8_max                                 (FP32 division), or with pow2:
//   scale_inv = 2^ceil(log2(amax_g / fp8_max))                   (the exact power of two >= the
//               FP32 quotient; = 1 / 2^floor(log2(fp8_max/amax_g)), TE's rule, in exact arithmetic)
//   q         = fp8_rne_satfinite(x / scale_inv)                 (FP32 true division, then the
//               saturating cast of cuda_fp8.h: |v| > fp8_max gives +-fp8_max)
//   dequant   = float(q) * scale_inv                             (FP32)
// Shapes: cols must be a multiple of 128 (hlm::Error otherwise; callers that need other widths pad
// with zeros, which changes no amax). rows is free: 1x128 scale_inv is [rows, cols/128]; 128x128
// scale_inv is [ceil(rows/128), cols/128] and the last block row is partial (its amax runs over the
// rows that exist, which is exactly what zero padding to a multiple of 128 would give).
// A non-finite input element (NaN, +-inf) is an error naming its position: a non-finite amax is a
// bad step (docs/fp8.md, "The FP8 quantizer"), and a NaN must never hide inside a finite scale.
#pragma once

#include <cstdint>
#include <string>

#include "core/tensor.h"

namespace hlm::ops {

constexpr int64_t kFp8TileSize = 128;  // the 128 of 1x128 and 128x128
constexpr float kFp8AmaxFloor = 1e-12f;

enum class TileShape : uint8_t { t1x128, t128x128 };

struct QuantRecipe {
  Fp8Format format = Fp8Format::e4m3;
  TileShape tile = TileShape::t1x128;
  bool pow2 = false;  // power-of-two scale_inv (rounded up: the tile max never saturates)
};

// "e4m3 1x128", "e5m2 128x128 pow2"
std::string recipe_str(const QuantRecipe& r);
const char* tile_shape_name(TileShape t);          // "1x128" / "128x128"
TileShape parse_tile_shape(const std::string& s);  // "1x128" / "128x128", else hlm::Error
Fp8Format parse_fp8_format(const std::string& s);  // "e4m3" / "e5m2", else hlm::Error
DType fp8_dtype(Fp8Format f);                      // DType::e4m3 / DType::e5m2

// A quantized matrix: q [rows, cols] in DType::e4m3 / e5m2, scale_inv f32 (shapes above).
struct Fp8Tensor {
  Tensor q;
  Tensor scale_inv;
  QuantRecipe recipe;
  int64_t rows() const { return q.size(0); }
  int64_t cols() const { return q.size(1); }
};

// The scale rule alone: scale_inv for one tile with absolute maximum `amax` (finite, >= 0).
float fp8_scale_inv(float amax, Fp8Format fmt, bool pow2);

// Shape of scale_inv for a [rows, cols] input under `tile`.
Shape fp8_scale_shape(int64_t rows, int64_t cols, TileShape tile);

// Quantize a 2-D f32/f64 CPU tensor (any strides). Deterministic; threads over rows.
Fp8Tensor fp8_quantize(const Tensor& x, const QuantRecipe& recipe);
// float(q) * scale_inv as a new f32 [rows, cols] tensor.
Tensor fp8_dequantize(const Fp8Tensor& t);
// The fp8 values of q as a new f32 tensor (no scaling).
Tensor fp8_values(const Fp8Tensor& t);

// The 128x128 quantization of W^T, exactly, from that of W [R, C]: q^T [C, pad128(R)] (the padded
// columns hold zero codes) and scale_inv^T [C/128, ceil(R/128)]. This is how the dgrad GEMM gets a
// K-major weight without re-quantizing (2-D blocks transpose exactly; docs/fp8.md, "The blockwise
// FP8 GEMM").
Fp8Tensor fp8_transpose_blocks(const Fp8Tensor& w);

// The blockwise FP8 GEMM in "TN" form (both operands K-contiguous, as cuBLASLt and DeepGEMM take
// them): C [M, N] f32 = A B^T for A [M, K] quantized 1x128 and B [N, K] quantized 1x128 or
// 128x128, K % 128 == 0. The promotion scheme of DeepSeek-V3 / DeepGEMM, with each step one FP32
// operation rounded to nearest (no fused multiply-add), for every (m, n):
//   acc = 0
//   for kb = 0, 1, ... (ascending):       s = sa(m, kb) * sb(n, kb)
//     p = 0; for k in block kb (ascending): p = p + qa[m, k] * qb[n, k]   (products are exact)
//     acc = acc + p * s
//   C[m, n] = acc
Tensor fp8_gemm_tn(const Fp8Tensor& a, const Fp8Tensor& b);

}  // namespace hlm::ops
