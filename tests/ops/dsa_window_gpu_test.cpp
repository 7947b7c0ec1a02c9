// Query windows of the CUDA DSA ops (context parallelism): every windowed op's rows against the
// same op over the whole batch on the device, bit for bit, and the windows' key gradients summed
// against the whole batch's (f64 within 1e-13, f32 within 1e-6, bf16 within 1e-2 relative L2:
// their partial sums are added in another order, in bf16 each window's rounded), on the batch of
// ops/dsa_window_checks.h (windows cut inside documents, at their edges and one token long). The
// CUDA kernels take the window's per-query geometry and clip each key's readers to the window.
#include <gtest/gtest.h>

#include <cstdlib>

#include "core/device.h"
#include "ops/cuda/dsa_common.cuh"
#include "ops/dsa_window_checks.h"
#include "testing.h"

namespace hlm {
namespace {

TEST(DsaQueryWindowGpu, AttentionRowsAndKeyGradients) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  testing::check_attention_windows(Device::cuda, DType::f64, 1e-13);
  testing::check_attention_windows(Device::cuda, DType::f32, 1e-6);
  // bf16 on the tensor cores (D a multiple of 32): each window's dkv is rounded to bf16 before
  // the sum, the whole batch's once. Then again with the backward's workspace cut to 16 KiB, so
  // it runs in chunks of a few queries (the key side gathered chunk by chunk, each key from its
  // first reader's chunk on).
  testing::check_attention_windows(Device::cuda, DType::bf16, 1e-2, 64, 32);
  setenv("HLM_DSA_ATTN_WORKSPACE", "16384", 1);
  testing::check_attention_windows(Device::cuda, DType::bf16, 1e-2, 64, 32);
  unsetenv("HLM_DSA_ATTN_WORKSPACE");
}

TEST(DsaQueryWindowGpu, IndexerScoresSelectionAndKeyGradients) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  testing::check_indexer_windows(Device::cuda, DType::f64, 1e-13);
  testing::check_indexer_windows(Device::cuda, DType::f32, 1e-6);
}

TEST(DsaQueryWindowGpu, RowsOutsideTheWindowsQueriesAreRefused) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device present";
  const testing::WindowBatch b = testing::window_batch();
  // Rows of the window of global tokens [10, 15): a token after the query (12 for the query at
  // 11), checked on the device, named by its global query.
  const Tensor idx = testing::gpu(Tensor::from_vector<int32_t>({5, 1}, {10, 12, -1, -1, -1}));
  const ops::dsa_detail::QueryWindow w = ops::dsa_detail::window_of(b.seqs, 5, int64_t(10), "op");
  testing::expect_error([&] { ops::cuda::device_rows_pattern(idx, w, 1, "op", "rows", true); },
                        "op: rows[1, 0] = 12 is not a causal token of query 11's document "
                        "(expected -1 or a value in [0, 12))");
}

}  // namespace
}  // namespace hlm
