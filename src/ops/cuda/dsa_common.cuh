// The CUDA side's view of the DSA ops' shared plumbing (ops/dsa_common.h). Host interface,
// includable from C++.
//
// The CUDA ops take an explicit selection's pattern (dsa_detail::Pattern) as device arrays, which
// the front doors build on the device from the index tensor (device_rows_pattern: checked there,
// no copy of the rows to the host). A dense causal op needs no pattern: its kernels derive each
// query's keys from the per-token geometry below.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/dsa_common.h"

namespace hlm::ops::cuda {

// A pattern on the device: i64 arrays except slot (i32). key_ptr / key_entry (the inverse map) are
// uploaded only when asked for (backward passes); otherwise undefined.
struct DsaPatternDev {
  int64_t T = 0, W = 0, nkeys = 0, entries = 0;
  int64_t q0 = 0;    // a query window's first global token (query row t reads keys <= q0 + t)
  Tensor row_ptr;    // [T+1]
  Tensor slot;       // [E] i32
  Tensor key;        // [E]
  Tensor query;      // [E]
  Tensor key_ptr;    // [nkeys+1]
  Tensor key_entry;  // [E]
};
// A host-built pattern copied to the device.
DsaPatternDev upload_pattern(const dsa_detail::Pattern& p, bool with_inverse);
// A pattern whose entries a kernel fills from page tables (the forward over an inference cache):
// row_ptr [T+1] copied, slot / key / query allocated for its last entry count; and the page
// tables as [N, max_pages] (dsa_detail::page_table).
DsaPatternDev pattern_for_entries(int64_t T, int64_t W, int64_t nkeys,
                                  const std::vector<int64_t>& row_ptr);
Tensor upload_page_table(const std::vector<const std::vector<int64_t>*>& pages);

// dsa_detail::rows_pattern of CUDA rows [T, W] (i32 or i64; strided rows are copied first) built
// on the device: the same arrays (rows in slot order, each key's readers in increasing (t, slot)
// order), the same refusals with the same messages (the first bad row wins; in it, the first
// column out of range, else the smallest repeated value). The host reads back a few numbers only:
// the entry count and the first problem found. with_inverse: also key_ptr / key_entry (backward
// passes). Over a query window: rows [w.T, W] of its queries, key rows of the whole batch.
DsaPatternDev device_rows_pattern(const Tensor& rows, const dsa_detail::QueryWindow& w,
                                  int64_t pool, const char* op, const char* what,
                                  bool with_inverse);
inline DsaPatternDev device_rows_pattern(const Tensor& rows, const std::vector<int64_t>& cu,
                                         int64_t pool, const char* op, const char* what,
                                         bool with_inverse) {
  return device_rows_pattern(rows, dsa_detail::whole_window(cu), pool, op, what, with_inverse);
}

// Per-query geometry of a query window (dsa_detail::QueryWindow: rows [q0, q0 + T) of a packed
// batch; the whole batch: q0 = 0) for keys grouped in pools of P tokens (P = 1: tokens), for
// local rows t:
//   doc_start[t] = the first token of t's document, minus q0 (so t - doc_start[t] is t's
//                  document-relative position r; negative where the document began before the
//                  window),
//   key_base[t]  = the global id of the document's first key (its first token for P = 1, its first
//                  pool, pool_offsets, for P > 1).
// Query t sees keys key_base[t] + [0, (r + 1) / P).
// Per key s of the whole batch (P = 1 only; the dense causal attention's readers):
//   key_start[s] / key_end[s] = the first token of s's document / one past its last token.
// For the whole batch key_start and doc_start are one array.
struct DsaLayoutDev {
  int64_t T = 0, P = 1, nkeys = 0, q0 = 0;
  Tensor doc_start;  // [T] i64
  Tensor key_base;   // [T] i64
  Tensor key_start;  // [nkeys] i64 (P = 1)
  Tensor key_end;    // [nkeys] i64 (P = 1)
};
DsaLayoutDev upload_layout(const dsa_detail::QueryWindow& w, int64_t P);

}  // namespace hlm::ops::cuda
