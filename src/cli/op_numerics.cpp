// `hybridlm op cast` and `hybridlm op fp8_quantize`: the number formats and the FP8 blockwise
// quantizer on tensors from a safetensors file, for cross-checking against PyTorch / cuda_fp8.h
// (docs/fp8.md).
//   hybridlm op cast --to e4m3|e5m2|bf16|f16 [--saturate finite|none] --in IN --out OUT
//       reads x (F32, BF16 or F16), writes y (F32 holding the rounded values). --saturate applies
//       to the fp8 formats (cuda_fp8.h __NV_SATFINITE / __NV_NOSAT; default finite).
//   hybridlm op fp8_quantize --format e4m3|e5m2 --tile 1x128|128x128 [--pow2] --in IN --out OUT
//       reads x [rows, cols] (F32, BF16 or F16; cols a multiple of 128), writes q (F32 holding the
//       fp8 values) and scale_inv (F32; [rows, cols/128] or [ceil(rows/128), cols/128]).
// Every error (missing tensor, wrong dtype or rank, bad shape, unknown option value) exits with
// status 2 and one line on stderr, and writes nothing (the output is saved only at the end, and
// atomically).
#include <memory>
#include <string>

#include "cli/command.h"
#include "core/error.h"
#include "ops/fp8_quant.h"

namespace hlm::cli {
namespace {

// x as a contiguous f32 tensor; F64 is refused (casting it through f32 would round twice).
Tensor read_x(const OpInputs& in) {
  const Tensor& t = in.get("x");
  HLM_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::bf16 || t.dtype() == DType::f16,
            "{}: tensor 'x' must be F32 (or BF16 / F16), got {}", in.path(), dtype_name(t.dtype()));
  return t.to(DType::f32);
}

struct CastArgs {
  std::string in, out, to, saturate = "finite";
};

void run_cast(const CastArgs& a) {
  const OpInputs in(a.in);
  const Tensor x = read_x(in);
  const Saturate sat = a.saturate == "none" ? Saturate::none : Saturate::finite;
  Tensor y = Tensor::empty(x.shape(), DType::f32);
  const float* xp = x.data<float>();
  float* yp = y.data<float>();
  const int64_t n = x.numel();
  if (a.to == "bf16") {
    for (int64_t i = 0; i < n; ++i) yp[i] = round_bf16(xp[i]);
  } else if (a.to == "f16") {
    for (int64_t i = 0; i < n; ++i) yp[i] = f16_to_float(float_to_f16(xp[i]));
  } else {
    const Fp8Format f = ops::parse_fp8_format(a.to);
    for (int64_t i = 0; i < n; ++i) yp[i] = round_fp8(xp[i], f, sat);
  }
  safetensors::save(a.out, {{"y", y}});
}

struct QuantArgs {
  std::string in, out, format = "e4m3", tile = "1x128";
  bool pow2 = false;
};

void run_fp8_quantize(const QuantArgs& a) {
  const ops::QuantRecipe rc{ops::parse_fp8_format(a.format), ops::parse_tile_shape(a.tile), a.pow2};
  const OpInputs in(a.in);
  const Tensor x = read_x(in);
  HLM_CHECK(x.dim() == 2, "{}: tensor 'x' must be 2-D [rows, cols], got shape {}", in.path(),
            shape_str(x.shape()));
  HLM_CHECK(x.size(1) % ops::kFp8TileSize == 0,
            "{}: tensor 'x' {} has {} columns, not a multiple of {}", in.path(),
            shape_str(x.shape()), x.size(1), ops::kFp8TileSize);
  const ops::Fp8Tensor q = ops::fp8_quantize(x, rc);
  safetensors::save(a.out, {{"q", ops::fp8_values(q)}, {"scale_inv", q.scale_inv}});
}

std::function<void()> setup_cast(CLI::App& app) {
  auto a = std::make_shared<CastArgs>();
  app.add_option("--in", a->in, "input safetensors file with tensor x")
      ->required()
      ->check(input_file());
  app.add_option("--out", a->out, "output safetensors file (tensor y)")->required();
  app.add_option("--to", a->to, "target format")
      ->required()
      ->check(CLI::IsMember({"e4m3", "e5m2", "bf16", "f16"}));
  app.add_option("--saturate", a->saturate, "fp8 overflow: finite (SATFINITE) or none (NOSAT)")
      ->check(CLI::IsMember({"finite", "none"}));
  return [a] { run_cast(*a); };
}

std::function<void()> setup_fp8_quantize(CLI::App& app) {
  auto a = std::make_shared<QuantArgs>();
  app.add_option("--in", a->in, "input safetensors file with tensor x [rows, cols]")
      ->required()
      ->check(input_file());
  app.add_option("--out", a->out, "output safetensors file (q, scale_inv)")->required();
  app.add_option("--format", a->format, "fp8 format")->check(CLI::IsMember({"e4m3", "e5m2"}));
  app.add_option("--tile", a->tile, "tile shape")->check(CLI::IsMember({"1x128", "128x128"}));
  app.add_flag("--pow2", a->pow2, "power-of-two scales");
  return [a] { run_fp8_quantize(*a); };
}

}  // namespace

HLM_REGISTER_OP("cast", "round x to e4m3 / e5m2 / bf16 / f16 (values written as F32)", setup_cast);
HLM_REGISTER_OP("fp8_quantize", "blockwise FP8 quantization of x [rows, cols]: q and scale_inv",
                setup_fp8_quantize);

}  // namespace hlm::cli
