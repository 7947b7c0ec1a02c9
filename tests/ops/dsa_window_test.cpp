// Query windows of the DSA ops (context parallelism, ops/dsa_common.h): an op given q0 computes the
// queries of global tokens [q0, q0 + T) of the packed batch over all of its keys. Each window's
// rows must be the whole batch's rows of the same op (the same bits: a query's sums run in the
// same order), and the key gradients of the windows that tile the batch must sum to the whole
// batch's (f64, within 1e-13 relative L2: their partial sums are added in another order).
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <vector>

#include "core/rng.h"
#include "ops/dsa_indexer.h"
#include "ops/dsa_indexer_loss.h"
#include "ops/dsa_kpool.h"
#include "ops/dsa_sparse_attention.h"
#include "ops/dsa_window_checks.h"
#include "ops/tensor_ops.h"
#include "testing.h"

namespace hlm {
namespace {

constexpr double kKeyTol = 1e-13;

using testing::rows;
using testing::window_batch;

TEST(DsaQueryWindow, AttentionRowsAndKeyGradients) {
  testing::check_attention_windows(Device::cpu, DType::f64, kKeyTol);
}

TEST(DsaQueryWindow, IndexerScoresSelectionAndKeyGradients) {
  testing::check_indexer_windows(Device::cpu, DType::f64, kKeyTol);
}

TEST(DsaQueryWindow, RefusesRowsOutsideTheBatchAndKeysOfTheWrongLength) {
  const testing::WindowBatch b = window_batch();
  Rng rng(testing::test_seed(), 3);
  const Tensor q = randn({5, 2, 4}, DType::f64, rng), kv = randn({b.T, 4}, DType::f64, rng);
  testing::expect_error([&] { ops::causal_attention(q, kv, b.seqs, 4, 0.5, b.T - 4); },
                        "query rows [69, 74) are not inside the sequence layout's 73 tokens");
  testing::expect_error([&] { ops::causal_attention(q, kv, b.seqs, 4, 0.5, -1); },
                        "are not inside");
  testing::expect_error([&] { ops::causal_attention(q, rows(kv, 0, 5), b.seqs, 4, 0.5, 0); },
                        "kv (the latent cache rows [T, D_qk])");
  // A selected token after the query (global position 12 for the window's query at 11).
  const Tensor idx = Tensor::from_vector<int32_t>({5, 1}, {10, 12, -1, -1, -1});
  testing::expect_error([&] { ops::sparse_attention(q, kv, idx, b.seqs, 4, 0.5, 10); },
                        "is not a causal token of query 11's document");
}

}  // namespace
}  // namespace hlm
