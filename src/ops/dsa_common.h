// Shared plumbing of the DSA ops (internal to src/ops/dsa_*, their tests, and the DSA layer's
// forward over an inference cache, which runs the CPU ops on patterns of its own): the sequence
// layout's offsets, KPool pool offsets, and the "pattern" every DSA op iterates over. Host code:
// the front doors (ops/dsa_*.cpp) build the patterns of CPU ops while they check the arguments and
// hand them to the implementations; for CUDA tensors the same pattern is built and checked on the
// device (ops/cuda/dsa_common.cuh, device_rows_pattern).
//
// A pattern lists, for each query t of a packed batch, the (slot, key row) pairs the op visits:
// slot is the column in the op's [T, W] row layout, key row indexes the key tensor (a token for
// token-level ops, a pool for KPool ops). Rows are visited in slot order. The inverse map lists,
// for each key row, the entries that read it in increasing (t, slot) order: backward passes sum key
// gradients through it in that fixed order, one key per thread, so no atomics are needed and the
// result does not depend on the thread count.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "core/seq_layout.h"
#include "core/tensor.h"

namespace hlm::ops::dsa_detail {

// sum_i a[i] b[i], in index order.
template <class F>
inline F dot(const F* a, const F* b, int64_t n) {
  F s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// The top-k rule of every DSA selection: the best min(k, n) of row[0, n) by (higher score first,
// NaN last, lower index first on ties), in increasing index order, into cand (resized to them).
template <class F>
void best_indices(const F* row, int64_t n, int64_t k, std::vector<int32_t>& cand) {
  cand.resize(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) cand[size_t(j)] = int32_t(j);
  const int64_t m = std::min(k, n);
  if (m >= n) return;
  auto better = [row](int32_t a, int32_t b) {
    const F x = row[a], y = row[b];
    const bool nx = std::isnan(x), ny = std::isnan(y);
    if (nx != ny) return ny;
    if (!nx && x != y) return x > y;
    return a < b;
  };
  std::nth_element(cand.begin(), cand.begin() + m, cand.end(), better);
  cand.resize(size_t(m));
  std::sort(cand.begin(), cand.end());
}

// The offsets [N+1] of a layout, after checking that it covers the op's T tokens.
const std::vector<int64_t>& seq_offsets(const SeqLayout& seqs, int64_t T, const char* op);

// The queries an op computes: global tokens [q0, q0 + T) of the packed batch cu, as local rows
// 0 .. T-1, while the keys are the whole batch's (context parallelism gives each rank such a
// window; docs/parallel.md). The whole batch is the window q0 = 0, T = cu.back(). Every DSA op
// walks its queries document by document through a window: local row t of window document m
// (rows [qcu[m], qcu[m+1])) is a query of document doc[m] at document-relative position pos(m, t).
struct QueryWindow {
  std::vector<int64_t> cu;   // [N+1] the whole batch's offsets
  int64_t q0 = 0, T = 0;     // the global id of local row 0, the number of rows
  std::vector<int64_t> doc;  // [M] the documents that hold rows of the window, in order
  std::vector<int64_t> qcu;  // [M+1] local row offsets of each (qcu[0] = 0, qcu[M] = T)
  size_t docs() const { return doc.size(); }
  int64_t first(size_t m) const { return cu[size_t(doc[m])]; }  // the document's first token
  int64_t pos(size_t m, int64_t t) const { return q0 + t - first(m); }
};
// The window of the whole batch.
QueryWindow whole_window(const std::vector<int64_t>& cu);
// The window of an op's T query rows: with q0, rows [*q0, *q0 + T) of seqs (0 <= *q0 and *q0 + T
// <= the layout's tokens, else throws naming op); without, the whole batch (seqs must cover T
// tokens, as seq_offsets checks).
QueryWindow window_of(const SeqLayout& seqs, int64_t T, const std::optional<int64_t>& q0,
                      const char* op);

// Start of each document's pools in the global pool numbering: doc i has floor(L_i / P) complete
// pools, numbered cu_pools[i] .. cu_pools[i+1]-1. (P = 1 gives the sequence offsets.)
std::vector<int64_t> pool_offsets(const std::vector<int64_t>& cu, int64_t pool);

// Longest document (P = 1) or largest pool count of a document.
int64_t max_keys_per_doc(const std::vector<int64_t>& cu, int64_t pool);

struct Pattern {
  int64_t T = 0, W = 0, nkeys = 0;
  std::vector<int64_t> row_ptr;    // [T+1] entries of query t: row_ptr[t] .. row_ptr[t+1]-1
  std::vector<int32_t> slot;       // [E] column in the [T, W] layout
  std::vector<int64_t> key;        // [E] key row
  std::vector<int64_t> query;      // [E] the query t of the entry
  std::vector<int64_t> key_ptr;    // [nkeys+1] inverse map
  std::vector<int64_t> key_entry;  // entries reading each key, in increasing (t, slot) order
  int64_t entries() const { return int64_t(slot.size()); }
};

// Dense causal pattern: query t (document-relative position r) visits keys of its own document
// whose last token is visible: with P = 1 the tokens s <= t (slot r' = s - doc start), with P > 1
// the complete pools p < floor((r + 1) / P) (slot p, key row cu_pools[doc] + p). W must be at least
// max_keys_per_doc. Over a window: its rows, keys of the whole batch.
Pattern causal_pattern(const QueryWindow& w, int64_t pool, int64_t W);
inline Pattern causal_pattern(const std::vector<int64_t>& cu, int64_t pool, int64_t W) {
  return causal_pattern(whole_window(cu), pool, W);
}

// Pattern of explicit key rows [T, W] (i32 or i64; -1 = empty slot, skipped). Every other entry
// must be a causal key of the query's own document (as in causal_pattern) and appear at most once
// in its row; anything else throws, naming `what`. The inverse map is built only with_inverse
// (backward passes); forward passes leave key_ptr / key_entry empty. Over a window: rows [w.T, W]
// of its queries, key rows of the whole batch.
Pattern rows_pattern(const Tensor& rows, const QueryWindow& w, int64_t pool, const char* op,
                     const char* what, bool with_inverse = true);
inline Pattern rows_pattern(const Tensor& rows, const std::vector<int64_t>& cu, int64_t pool,
                            const char* op, const char* what, bool with_inverse = true) {
  return rows_pattern(rows, whole_window(cu), pool, op, what, with_inverse);
}

// Checks a host-built pattern over nkeys key rows (the forward over an inference cache): row_ptr
// has T + 1 ascending entries ending at the entry count, every slot is in [0, W), every key row in
// [0, nkeys); otherwise throws, naming op and what. Sets p.nkeys.
void check_pattern(Pattern& p, int64_t nkeys, const char* op, const char* what);

// Page tables of different lengths as one row-major [N, max_pages] table (zeros past each end),
// for a device copy.
struct PageTable {
  std::vector<int64_t> flat;
  int64_t max_pages = 1;
};
PageTable page_table(const std::vector<const std::vector<int64_t>*>& pages);
// Builds the inverse map of a pattern whose forward part is filled.
void build_inverse(Pattern& p);

}  // namespace hlm::ops::dsa_detail
