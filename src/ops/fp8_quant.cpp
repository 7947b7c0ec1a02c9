// The front door of the FP8 blockwise quantizer (ops/fp8_quant.h): the recipe helpers and the
// scale rule, argument checks, output allocation, and the switch to the CPU reference
// (ops/cpu/fp8_quant.cpp). No CUDA implementation yet.
#include "ops/fp8_quant.h"

#include <fmt/format.h>

#include <cmath>

#include "core/enum_names.h"
#include "ops/cpu/fp8_quant.h"
#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace hlm::ops {

std::string recipe_str(const QuantRecipe& r) {
  return fmt::format("{} {}{}", r.format == Fp8Format::e4m3 ? "e4m3" : "e5m2",
                     tile_shape_name(r.tile), r.pow2 ? " pow2" : "");
}

namespace {

constexpr auto kTileShapeNames = enum_names<TileShape::t128x128>({"1x128", "128x128"});

}  // namespace

const char* tile_shape_name(TileShape t) {
  return kTileShapeNames.name(t);
}

TileShape parse_tile_shape(const std::string& s) {
  return kTileShapeNames.parse(s, "fp8 tile shape");
}

Fp8Format parse_fp8_format(const std::string& s) {
  if (s == "e4m3") return Fp8Format::e4m3;
  if (s == "e5m2") return Fp8Format::e5m2;
  HLM_FAIL("unknown fp8 format '{}' (expected e4m3 or e5m2)", s);
}

DType fp8_dtype(Fp8Format f) {
  return f == Fp8Format::e4m3 ? DType::e4m3 : DType::e5m2;
}

float fp8_scale_inv(float amax, Fp8Format fmt, bool pow2) {
  const float amax_g = std::fmax(amax, kFp8AmaxFloor);
  const float r = amax_g / fp8_max(fmt);  // >= 1e-12 / 57344: a normal float, never 0 or inf
  if (!pow2) return r;
  int e = 0;
  const float m = std::frexp(r, &e);  // r = m * 2^e, m in [0.5, 1)
  return m == 0.5f ? r : std::ldexp(1.0f, e);
}

Shape fp8_scale_shape(int64_t rows, int64_t cols, TileShape tile) {
  const int64_t cb = cols / kFp8TileSize;
  if (tile == TileShape::t1x128) return {rows, cb};
  return {(rows + kFp8TileSize - 1) / kFp8TileSize, cb};
}

namespace {
void check_fp8_tensor(const Fp8Tensor& t, const char* op) {
  HLM_CHECK(t.q.defined() && t.q.dim() == 2 && t.q.dtype() == fp8_dtype(t.recipe.format),
            "{}: q must be a 2-D {} tensor, got {}", op, dtype_name(fp8_dtype(t.recipe.format)),
            t.q.defined() ? t.q.describe() : "undefined");
  HLM_CHECK(t.q.is_contiguous(), "{}: q must be contiguous, got strides {} for {}", op,
            shape_str(t.q.strides()), t.q.describe());
  HLM_CHECK(t.cols() % kFp8TileSize == 0, "{}: q has {} columns, not a multiple of {}", op,
            t.cols(), kFp8TileSize);
  const Shape ss = fp8_scale_shape(t.rows(), t.cols(), t.recipe.tile);
  HLM_CHECK(t.scale_inv.defined() && t.scale_inv.dtype() == DType::f32 && t.scale_inv.shape() == ss,
            "{}: scale_inv must be f32 {} for q {} ({}), got {}", op, shape_str(ss), t.q.describe(),
            recipe_str(t.recipe), t.scale_inv.defined() ? t.scale_inv.describe() : "undefined");
  detail::require_same_device(t.scale_inv, t.q, op, "scale_inv", "q");
}
}  // namespace

Fp8Tensor fp8_quantize(const Tensor& x, const QuantRecipe& rc) {
  const char* op = "fp8_quantize";
  detail::require_real(x, op, "x");
  HLM_CHECK(x.dim() == 2, "{}: x must be 2-D [rows, cols], got {}", op, x.describe());
  const int64_t rows = x.size(0), cols = x.size(1);
  HLM_CHECK(cols % kFp8TileSize == 0,
            "{}: x {} has {} columns, not a multiple of {} (pad with zeros to quantize)", op,
            x.describe(), cols, kFp8TileSize);
  Fp8Tensor out;
  out.recipe = rc;
  out.q = detail::new_output({rows, cols}, fp8_dtype(rc.format), x.device());
  out.scale_inv = detail::new_output(fp8_scale_shape(rows, cols, rc.tile), DType::f32, x.device());
  detail::cpu_only(op, x, "x");
  cpu::fp8_quantize(x, out);
  return out;
}

namespace {

// The front door of an op that reads an Fp8Tensor and writes an f32 tensor of its shape.
Tensor fp8_to_f32(const char* op, const Fp8Tensor& t, void (*cpu_fn)(const Fp8Tensor&, Tensor&)) {
  check_fp8_tensor(t, op);
  Tensor out = detail::new_output(t.q.shape(), DType::f32, t.q.device());
  detail::cpu_only(op, t.q, "q");
  cpu_fn(t, out);
  return out;
}

}  // namespace

Tensor fp8_dequantize(const Fp8Tensor& t) {
  return fp8_to_f32("fp8_dequantize", t, cpu::fp8_dequantize);
}

Tensor fp8_values(const Fp8Tensor& t) {
  return fp8_to_f32("fp8_values", t, cpu::fp8_values);
}

Fp8Tensor fp8_transpose_blocks(const Fp8Tensor& w) {
  const char* op = "fp8_transpose_blocks";
  check_fp8_tensor(w, op);
  HLM_CHECK(w.recipe.tile == TileShape::t128x128, "{}: w must be quantized 128x128, got {}", op,
            recipe_str(w.recipe));
  const int64_t R = w.rows(), C = w.cols(),
                Rp = (R + kFp8TileSize - 1) / kFp8TileSize * kFp8TileSize;
  const Device dev = w.q.device();
  Fp8Tensor t;
  t.recipe = w.recipe;
  t.q = detail::new_output({C, Rp}, w.q.dtype(), dev);
  t.scale_inv = detail::new_output({w.scale_inv.size(1), w.scale_inv.size(0)}, DType::f32, dev);
  detail::cpu_only(op, w.q, "q");
  cpu::fp8_transpose_blocks(w, t);
  return t;
}

Tensor fp8_gemm_tn(const Fp8Tensor& a, const Fp8Tensor& b) {
  const char* op = "fp8_gemm_tn";
  check_fp8_tensor(a, op);
  check_fp8_tensor(b, op);
  HLM_CHECK(a.recipe.tile == TileShape::t1x128, "{}: A must be quantized 1x128, got {}", op,
            recipe_str(a.recipe));
  HLM_CHECK(a.cols() == b.cols(), "{}: A is [{}, {}] and B is [{}, {}]: K differs", op, a.rows(),
            a.cols(), b.rows(), b.cols());
  const Device dev = detail::one_device(op, {a.q, "A"}, {{b.q, "B"}});
  Tensor c = detail::new_output({a.rows(), b.rows()}, DType::f32, dev);
  detail::cpu_only(op, a.q, "A");
  cpu::fp8_gemm_tn(a, b, c);
  return c;
}

}  // namespace hlm::ops
