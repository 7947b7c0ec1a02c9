// ops::check_cu_seqlens: valid layouts (i64 / i32, zero-length sequences, N = 0) and every error.
#include "ops/seqlens.h"
#include "testing.h"

namespace hlm {
namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(OpsSeqlens, AcceptsValid) {
  EXPECT_EQ(ops::check_cu_seqlens(Tensor::from_vector<int64_t>({4}, {0, 3, 3, 7}), 7),
            (std::vector<int64_t>{0, 3, 3, 7}));
  EXPECT_EQ(ops::check_cu_seqlens(Tensor::from_vector<int32_t>({3}, {0, 0, 5}), 5),
            (std::vector<int64_t>{0, 0, 5}));
  EXPECT_EQ(ops::check_cu_seqlens(Tensor::from_vector<int64_t>({1}, {0}), 0),
            (std::vector<int64_t>{0}));
  // A strided view is read correctly.
  Tensor big = Tensor::from_vector<int64_t>({6}, {0, 99, 2, 99, 5, 99});
  Tensor strided = big.view({3, 2}).select(1, 0);  // [0, 2, 5]
  EXPECT_EQ(ops::check_cu_seqlens(strided, 5), (std::vector<int64_t>{0, 2, 5}));
  Tensor cu = ops::cu_seqlens_from_lengths({3, 0, 2});
  EXPECT_EQ(ops::check_cu_seqlens(cu, 5), (std::vector<int64_t>{0, 3, 3, 5}));
}

TEST(OpsSeqlens, RejectsInvalidWithClearMessages) {
  auto msg = [](const Tensor& t, int64_t total) {
    return error_of([&] { ops::check_cu_seqlens(t, total); });
  };
  EXPECT_NE(msg(Tensor::from_vector<int64_t>({3}, {3, 4, 5}), 5).find("must start at 0, got 3"),
            std::string::npos);
  EXPECT_NE(msg(Tensor::from_vector<int64_t>({4}, {0, 4, 2, 5}), 5).find("non-decreasing"),
            std::string::npos);
  EXPECT_NE(msg(Tensor::from_vector<int32_t>({3}, {0, 2, 4}), 5).find("must end at"),
            std::string::npos);
  EXPECT_NE(msg(Tensor::from_values({3}, {0, 2, 5}, DType::f32), 5).find("i64 or i32"),
            std::string::npos);
  EXPECT_NE(msg(Tensor::from_vector<int64_t>({1, 2}, {0, 5}), 5).find("1-D"), std::string::npos);
  EXPECT_NE(msg(Tensor::from_vector<int64_t>({0}, {}), 0).find("N+1 >= 1"), std::string::npos);
  EXPECT_THROW(ops::check_cu_seqlens(Tensor(), 0), Error);
  EXPECT_THROW(ops::cu_seqlens_from_lengths({2, -1}), Error);
  // The message names the argument.
  EXPECT_NE(error_of([] {
              ops::check_cu_seqlens(Tensor::from_vector<int64_t>({2}, {1, 2}), 2, "cu_pools");
            }).find("cu_pools"),
            std::string::npos);
}

}  // namespace
}  // namespace hlm
