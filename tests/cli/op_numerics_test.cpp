// `hybridlm op cast` / `hybridlm op fp8_quantize` run as a user runs them: the built binary, on
// safetensors files in a temporary directory. Skips when the binary has not been built
// (hlm_tests does not depend on it: build both, `ninja hybridlm hlm_tests`).
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "core/rng.h"
#include "core/safetensors.h"
#include "ops/fp8_quant.h"
#include "testing.h"

namespace hlm {
namespace {

namespace fs = std::filesystem;

class CliNumerics : public ::testing::Test {
 protected:
  void SetUp() override {
    bin_ = std::string(HLM_BINARY_DIR) + "/hybridlm";
    if (!fs::exists(bin_)) GTEST_SKIP() << "binary " << bin_ << " not built (ninja hybridlm)";
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ =
        fs::temp_directory_path() / fmt::format("hlm_cli_numerics_{}_{}", ::getpid(), info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  // Exit status of `hybridlm args` (stderr kept in err.txt).
  int run(const std::string& args) {
    const std::string cmd = bin_ + " " + args + " > " + path("out.txt") + " 2> " + path("err.txt");
    const int st = std::system(cmd.c_str());
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  }
  std::string err() const {
    std::FILE* f = std::fopen(path("err.txt").c_str(), "r");
    std::string s;
    if (!f) return s;
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
    std::fclose(f);
    return s;
  }
  // A failing command: status 2, one line on stderr, and no output file.
  void expect_failure(const std::string& args, const std::string& out, const std::string& what) {
    EXPECT_EQ(run(args), 2) << args << "\n" << err();
    const std::string e = err();
    EXPECT_FALSE(e.empty()) << args;
    EXPECT_LE(std::count(e.begin(), e.end(), '\n'), 1) << args << ": " << e;
    EXPECT_NE(e.find(what), std::string::npos) << args << ": " << e;
    EXPECT_FALSE(fs::exists(out)) << args << " wrote " << out;
    for (const auto& entry : fs::directory_iterator(dir_))
      EXPECT_EQ(entry.path().string().find(".tmp"), std::string::npos) << "left " << entry.path();
  }

  std::string bin_;
  fs::path dir_;
};

TEST_F(CliNumerics, CastRoundsLikeTheLibrary) {
  Rng rng(testing::test_seed());
  Tensor x = randn({3, 50}, DType::f32, rng, 300.0);
  float* xp = x.data<float>();
  xp[0] = 464.0f;
  xp[1] = 500.0f;
  xp[2] = -1e6f;
  xp[3] = 0x1p-10f;
  safetensors::save(path("in.safetensors"), {{"x", x}});
  for (const char* to : {"e4m3", "e5m2", "bf16"})
    for (const char* sat : {"finite", "none"}) {
      const std::string out = path(fmt::format("y_{}_{}.safetensors", to, sat));
      ASSERT_EQ(run(fmt::format("op cast --to {} --saturate {} --in {} --out {}", to, sat,
                                path("in.safetensors"), out)),
                0)
          << err();
      const auto c = safetensors::load(out);
      const Tensor& y = c.tensors.at("y");
      ASSERT_EQ(y.dtype(), DType::f32);
      ASSERT_EQ(y.shape(), x.shape());
      const Saturate s = std::string(sat) == "none" ? Saturate::none : Saturate::finite;
      for (int64_t i = 0; i < x.numel(); ++i) {
        const float e = std::string(to) == "bf16" ? round_bf16(xp[i])
                                                  : round_fp8(xp[i], ops::parse_fp8_format(to), s);
        const float g = y.data<float>()[i];
        ASSERT_TRUE(f32_bits(g) == f32_bits(e) || (std::isnan(g) && std::isnan(e)))
            << to << " " << sat << " x = " << xp[i] << ": " << g << " vs " << e;
      }
      if (std::string(to) == "e4m3") {
        EXPECT_EQ(y.data<float>()[0], 448.0f);  // the tie at the edge rounds to 448
        if (s == Saturate::none) EXPECT_TRUE(std::isnan(y.data<float>()[1]));
        if (s == Saturate::finite) EXPECT_EQ(y.data<float>()[2], -448.0f);
      }
    }
}

TEST_F(CliNumerics, Fp8QuantizeWritesValuesAndScales) {
  Rng rng(testing::test_seed());
  const Tensor x = randn({130, 256}, DType::f32, rng, 5.0);
  safetensors::save(path("in.safetensors"), {{"x", x}});
  for (const char* fmt_s : {"e4m3", "e5m2"})
    for (const char* tile : {"1x128", "128x128"})
      for (bool pow2 : {false, true}) {
        const std::string out = path(fmt::format("q_{}_{}_{}.safetensors", fmt_s, tile, pow2));
        ASSERT_EQ(run(fmt::format("op fp8_quantize --format {} --tile {}{} --in {} --out {}", fmt_s,
                                  tile, pow2 ? " --pow2" : "", path("in.safetensors"), out)),
                  0)
            << err();
        const auto c = safetensors::load(out);
        const ops::QuantRecipe rc{ops::parse_fp8_format(fmt_s), ops::parse_tile_shape(tile), pow2};
        const ops::Fp8Tensor ref = ops::fp8_quantize(x, rc);
        EXPECT_TRUE(testing::bit_equal(c.tensors.at("q"), ops::fp8_values(ref)));
        EXPECT_TRUE(testing::bit_equal(c.tensors.at("scale_inv"), ref.scale_inv));
        EXPECT_EQ(c.tensors.at("scale_inv").shape(), ops::fp8_scale_shape(130, 256, rc.tile));
      }
}

TEST_F(CliNumerics, BadInputExitsWithStatus2AndWritesNothing) {
  Rng rng(testing::test_seed());
  safetensors::save(path("ok.safetensors"), {{"x", randn({4, 128}, DType::f32, rng)}});
  safetensors::save(path("noX.safetensors"), {{"z", randn({4, 128}, DType::f32, rng)}});
  safetensors::save(path("rank3.safetensors"), {{"x", randn({2, 2, 128}, DType::f32, rng)}});
  safetensors::save(path("cols.safetensors"), {{"x", randn({4, 100}, DType::f32, rng)}});
  safetensors::save(path("int.safetensors"), {{"x", Tensor::zeros({4, 128}, DType::i32)}});
  Tensor nan = randn({4, 128}, DType::f32, rng);
  nan.data<float>()[5] = NAN;
  safetensors::save(path("nan.safetensors"), {{"x", nan}});
  const std::string out = path("out.safetensors");
  auto q = [&](const std::string& in, const std::string& extra = "") {
    return fmt::format("op fp8_quantize {} --in {} --out {}", extra, path(in), out);
  };
  expect_failure(q("noX.safetensors"), out, "'x'");
  expect_failure(q("rank3.safetensors"), out, "2-D");
  expect_failure(q("cols.safetensors"), out, "multiple of 128");
  expect_failure(q("int.safetensors"), out, "F32");
  expect_failure(q("nan.safetensors"), out, "not finite");
  expect_failure(q("missing.safetensors"), out, "missing.safetensors");
  expect_failure(q("ok.safetensors", "--format e3m4"), out, "e3m4");
  expect_failure(q("ok.safetensors", "--tile 128x1"), out, "128x1");
  expect_failure(fmt::format("op cast --to fp4 --in {} --out {}", path("ok.safetensors"), out), out,
                 "fp4");
  expect_failure(fmt::format("op cast --to e4m3 --saturate clamp --in {} --out {}",
                             path("ok.safetensors"), out),
                 out, "clamp");
  expect_failure(fmt::format("op cast --to e4m3 --in {} --out {}", path("noX.safetensors"), out),
                 out, "'x'");
  expect_failure(fmt::format("op cast --in {} --out {}", path("ok.safetensors"), out), out, "--to");
}

}  // namespace
}  // namespace hlm
