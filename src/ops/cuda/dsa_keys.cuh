// The key sources of the DSA attention kernels (dsa_attention.cu, dsa_attention_mma.cu): which
// keys each query visits and which queries read each key. Internal to the CUDA sources.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace hlm::ops::cuda {

// The key source of the kernels: an explicit pattern or the dense causal set of each document.
// Query side: the keys of query t, key_at(first(t), j) for j < count(t), in slot order (slot_at).
// Key side: the readers of key s, reader_at(readers_first(s), i) for i < readers_count(s), in
// increasing t (each reader reads s once: the patterns here are token-level, no duplicates).
//   PatternKeys: entries row_ptr[t] .. row_ptr[t+1]-1; the readers come from the inverse map
//                (key_ptr, key_entry, query; null unless uploaded for a backward pass).
//   DenseKeys:   keys doc_start .. t of t's document (slot = key - its document's first token);
//                readers s .. doc_end[s]-1. Over a query window (rows [q0, q0 + nq) of the batch,
//                ops/dsa_common.h) the keys are global tokens and the readers the window's
//                queries among them, as local rows.
// Entries (the tensor-core backward's per-(query, key) rows): query t's keys are the entries
// entry0(t) .. entry0(t) + count(t) - 1 in slot order, and reader i of key s is the entry
// reader_entry(s, r0, i) (r0 = readers_first(s)). PatternKeys: the pattern's entries. DenseKeys:
// entries numbered query by query, entry0(t) = entry_base[t] (uploaded only for that backward:
// the running sum of the window's earlier queries' key counts).
struct PatternKeys {
  const int64_t* row_ptr;
  const int64_t* key;
  const int32_t* slot;
  const int64_t* key_ptr;
  const int64_t* key_entry;
  const int64_t* query;
  int64_t width = 0;  // most keys of one query (the selection's W)
  int64_t q0 = 0;     // a query window's first global token: row t's keys are <= q0 + t
  __device__ __forceinline__ int64_t first(int64_t t) const { return row_ptr[t]; }
  __device__ __forceinline__ int64_t count(int64_t t) const { return row_ptr[t + 1] - row_ptr[t]; }
  __device__ __forceinline__ int64_t key_at(int64_t f, int64_t j) const { return key[f + j]; }
  __device__ __forceinline__ int64_t slot_at(int64_t f, int64_t j) const { return slot[f + j]; }
  __device__ __forceinline__ int64_t readers_first(int64_t s) const { return key_ptr[s]; }
  __device__ __forceinline__ int64_t readers_count(int64_t s) const {
    return key_ptr[s + 1] - key_ptr[s];
  }
  __device__ __forceinline__ int64_t reader_at(int64_t r0, int64_t i) const {
    return query[key_entry[r0 + i]];
  }
  __device__ __forceinline__ int64_t entry0(int64_t t) const { return row_ptr[t]; }
  __device__ __forceinline__ int64_t reader_entry(int64_t, int64_t r0, int64_t i) const {
    return key_entry[r0 + i];
  }
};
struct DenseKeys {
  const int64_t* doc_start;  // [nq] per query row: its document's first token - q0
  const int64_t* key_start;  // [keys] per key: its document's first token
  const int64_t* key_end;    // [keys] per key: one past its document's last token
  const int64_t* entry_base = nullptr;
  int64_t width = 0;       // most keys of one query (the longest document)
  int64_t q0 = 0, nq = 0;  // the query rows: global tokens [q0, q0 + nq)
  __device__ __forceinline__ int64_t first(int64_t t) const { return doc_start[t] + q0; }
  __device__ __forceinline__ int64_t count(int64_t t) const { return t - doc_start[t] + 1; }
  __device__ __forceinline__ int64_t key_at(int64_t f, int64_t j) const { return f + j; }
  __device__ __forceinline__ int64_t slot_at(int64_t, int64_t j) const { return j; }
  __device__ __forceinline__ int64_t readers_first(int64_t s) const {
    return (s > q0 ? s : q0) - q0;
  }
  __device__ __forceinline__ int64_t readers_count(int64_t s) const {
    const int64_t lo = s > q0 ? s : q0, hi = key_end[s] < q0 + nq ? key_end[s] : q0 + nq;
    return hi > lo ? hi - lo : 0;
  }
  __device__ __forceinline__ int64_t reader_at(int64_t r0, int64_t i) const { return r0 + i; }
  __device__ __forceinline__ int64_t entry0(int64_t t) const { return entry_base[t]; }
  __device__ __forceinline__ int64_t reader_entry(int64_t s, int64_t r0, int64_t i) const {
    return entry_base[r0 + i] + (s - key_start[s]);
  }
};

}  // namespace hlm::ops::cuda
