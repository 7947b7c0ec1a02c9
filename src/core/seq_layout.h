// SeqLayout: where the sequences of a packed batch lie. Activations are [T, ...] for all tokens of
// all N sequences end to end; sequence n holds tokens [offsets[n], offsets[n+1]) (FlashAttention's
// cu_seqlens convention: 0 = c_0 <= c_1 <= ... <= c_N = T; empty sequences are allowed).
//
// A layout is checked once, when it is built (at the model's entry for a batch, or by an op called
// on its own with a cu_seqlens tensor), and passed down by reference: the layers and ops that look
// along the sequence (conv, cumsum, chunking, pooling, causal masks, top-k) trust it and check only
// that it covers their T tokens (check_tokens). What several ops derive from it is made once and
// cached: the cu_seqlens tensor on each device, and the chunk table of each chunk size.
//
// Copies share one immutable state (cheap to pass by value); the caches are thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor.h"

namespace hlm {

class SeqLayout {
 public:
  // One sequence of 0 tokens.
  SeqLayout();

  // Checked: `offsets` [N+1] must start at 0, be non-decreasing and end at total_tokens
  // (N >= 0). Errors name `what`.
  static SeqLayout from_offsets(std::vector<int64_t> offsets, int64_t total_tokens,
                                const char* what = "cu_seqlens");
  // From a cu_seqlens tensor: 1-D i64 / i32 [N+1] on any device (a CUDA tensor costs one small
  // synchronous copy); undefined: one sequence of total_tokens.
  static SeqLayout from_tensor(const Tensor& cu_seqlens, int64_t total_tokens,
                               const char* what = "cu_seqlens");
  static SeqLayout from_lengths(const std::vector<int64_t>& lengths);
  static SeqLayout single(int64_t total_tokens);

  int64_t total_tokens() const;
  int64_t num_seqs() const;
  const std::vector<int64_t>& offsets() const;  // [N+1]
  int64_t begin(int64_t n) const { return offsets()[size_t(n)]; }
  int64_t end(int64_t n) const { return offsets()[size_t(n) + 1]; }
  int64_t length(int64_t n) const { return end(n) - begin(n); }
  int64_t max_length() const;

  // Throws unless the layout covers exactly T tokens: "<op>: the sequence layout covers N tokens,
  // <what> has T".
  void check_tokens(int64_t T, const char* op, const char* what = "the input") const;

  // cu_seqlens as an i64 tensor [N+1] on `dev` (made once per device, then shared).
  const Tensor& cu_seqlens(Device dev = Device::cpu) const;

  // Chunks of at most `chunk` tokens that never cross a sequence boundary (the last chunk of a
  // sequence may be short; an empty sequence has none), in token order.
  struct ChunkTable {
    int64_t chunk = 0;       // C
    int64_t num_chunks = 0;  // NC
    // int32, packed [bos (NC) | len (NC) | first_chunk (N+1)]: chunk c covers tokens
    // [bos[c], bos[c] + len[c]); sequence n owns chunks [first_chunk[n], first_chunk[n+1]).
    std::vector<int32_t> meta;
    const int32_t* bos() const { return meta.data(); }
    const int32_t* len() const { return meta.data() + num_chunks; }
    const int32_t* first_chunk() const { return meta.data() + 2 * num_chunks; }
  };
  // The table for chunk size C >= 1 (made once per C). T must fit int32 with a chunk to spare.
  const ChunkTable& chunks(int64_t chunk) const;
  // The packed meta of chunks(C) as an i32 tensor on `dev` (made once per C and device).
  const Tensor& chunk_meta(int64_t chunk, Device dev) const;

 private:
  struct State;
  explicit SeqLayout(std::shared_ptr<State> s);
  std::shared_ptr<State> s_;
};

}  // namespace hlm
