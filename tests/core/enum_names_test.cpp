#include "core/enum_names.h"

#include <gtest/gtest.h>

#include <string>

#include "core/dtype.h"
#include "core/error.h"
#include "layers/kda/kda_layer.h"
#include "layers/precision.h"
#include "model/config.h"
#include "model/hybrid_model.h"
#include "ops/fp8_quant.h"

namespace hlm {
namespace {

enum class Color : uint8_t { red, green, blue };
constexpr auto kColorNames = enum_names<Color::blue>({"red", "green", "blue"});

TEST(CoreEnumNames, NameFindParse) {
  static_assert(kColorNames.name(Color::green)[0] == 'g');  // usable at compile time
  EXPECT_STREQ(kColorNames.name(Color::red), "red");
  EXPECT_STREQ(kColorNames.name(Color::blue), "blue");
  EXPECT_STREQ(kColorNames.name(Color(7)), "?");
  EXPECT_EQ(kColorNames.find("green"), Color::green);
  EXPECT_EQ(kColorNames.find("Green"), std::nullopt);
  EXPECT_EQ(kColorNames.find(""), std::nullopt);
  EXPECT_EQ(kColorNames.parse("blue", "color"), Color::blue);
  try {
    kColorNames.parse("purple", "color");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(
        std::string(e.what()).find("unknown color 'purple': expected one of red, green, blue"),
        std::string::npos)
        << e.what();
  }
}

// Every name of the library's tables, spelled out here, and each parse taking back its name.
TEST(CoreEnumNames, LibraryTables) {
  const char* dtypes[] = {"f64", "f32", "bf16", "f16", "e4m3", "e5m2", "i64", "i32", "u8"};
  for (int i = 0; i < 9; ++i) {
    EXPECT_STREQ(dtype_name(DType(i)), dtypes[i]);
    EXPECT_EQ(parse_dtype(dtypes[i]), DType(i));
  }
  EXPECT_EQ(parse_dtype("bfloat16"), DType::bf16);
  EXPECT_EQ(parse_dtype("float8_e4m3fn"), DType::e4m3);
  EXPECT_EQ(parse_dtype("half"), DType::f16);
  EXPECT_THROW(parse_dtype("f8"), Error);

  const char* recompute[] = {"none", "selective", "full"};
  for (int i = 0; i < 3; ++i) {
    EXPECT_STREQ(recompute_name(Recompute(i)), recompute[i]);
    EXPECT_EQ(parse_recompute(recompute[i]), Recompute(i));
  }
  EXPECT_THROW(parse_recompute("partial"), Error);

  EXPECT_STREQ(ops::tile_shape_name(ops::TileShape::t1x128), "1x128");
  EXPECT_STREQ(ops::tile_shape_name(ops::TileShape::t128x128), "128x128");
  EXPECT_EQ(ops::parse_tile_shape("128x128"), ops::TileShape::t128x128);

  EXPECT_STREQ(gemm_kind_name(GemmKind::native), "native");
  EXPECT_STREQ(gemm_kind_name(GemmKind::fp8_block), "fp8_block");
  EXPECT_STREQ(module_role_name(ModuleRole::kda_proj), "kda_proj");
  EXPECT_STREQ(module_role_name(ModuleRole::indexer_weights), "indexer_weights");
  EXPECT_STREQ(module_role_name(ModuleRole::other), "other");
  EXPECT_STREQ(layer_kind_name(LayerKind::dsa), "dsa");
  EXPECT_STREQ(layer_kind_name(LayerKind::mla), "mla");
  EXPECT_EQ(layer_kind_symbol(LayerKind::kda), 'K');
  EXPECT_EQ(layer_kind_symbol(LayerKind::mla), 'M');
  EXPECT_EQ(layer_kind_symbol(LayerKind(9)), '?');
  EXPECT_STREQ(kda_naming_name(KdaNaming::glm5_next_transformers), "glm5_next_transformers");
  EXPECT_STREQ(kda_naming_name(KdaNaming::kimi_linear), "kimi_linear");
}

}  // namespace
}  // namespace hlm
