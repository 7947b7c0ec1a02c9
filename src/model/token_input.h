// The token inputs of `hybridlm forward` read from safetensors files, validated before the model
// runs (docs/parity.md; docs/robustness.md):
//   --tokens: input_ids, an integer tensor (I64, I32 or U8: a float id would be truncated, and a
//     NaN one has no value at all), either [B, T] (each row one sequence of T tokens; no
//     cu_seqlens: the rows are the sequences) or [T] with an optional cu_seqlens (I64 or I32
//     [N+1], the FlashAttention convention; one sequence when absent). Every id must lie in
//     [0, vocab_size). Any other tensor in the file is an error (it would be ignored).
//   --dsa-indices: per DSA layer i of the main stack an optional "layers.<i>", integer (I64 or
//     I32) [B, T, W] with positions local to the row, or [T, W] global token ids for [T] input;
//     each entry -1 (padding) or a token of the query's own sequence at or before it (the layer
//     checks causality). A name that is not the layers.<i> of a DSA layer is an error.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "model/config.h"

namespace hlm {

struct TokenBatch {
  Tensor tokens;          // [B * T] i64, rows end to end
  Tensor cu_seqlens;      // [N + 1] i64
  bool rows = false;      // input_ids was [B, T]
  int64_t batch = 1;      // B (1 for [T] input)
  int64_t length = 0;     // T of a row ([B, T]) or of the whole input ([T])
  int64_t sequences = 0;  // N
  int64_t max_seq_len = 0;
  int64_t num_tokens() const { return tokens.numel(); }
};

// `what` names the file in messages.
TokenBatch read_token_batch(const safetensors::Contents& in, int64_t vocab_size,
                            const std::string& what);

// One entry per DSA layer of the main stack (in order): [B * T, W] i64 global ids, or undefined
// where the file has none for that layer.
std::vector<Tensor> read_dsa_indices(const safetensors::Contents& in, const ModelConfig& cfg,
                                     const TokenBatch& batch, const std::string& what);

}  // namespace hlm
