// What a DSA layer reads and writes of an inference cache in one forward call (the storage is
// model/model_cache.h's): the layer's storage tensors and, per sequence of the call, its slot,
// the tokens already cached and its page table (docs/inference.md, "The cache").
//
// Token rows live in pages of `page` tokens: token `pos` of a sequence is storage row
// pages[pos / page] * page + pos % page. A KPool layer keeps pooled keys only for complete pools
// (page / P pool rows per page) and each slot's incomplete pool as raw keys and gates.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace hlm {

struct DsaCacheView {
  Tensor kv;    // [R, r_kv + d_r] latent rows, compute dtype (Mla::attention_operand values)
  Tensor keys;  // indexer P = 1: [R, d_I] scoring keys; KPool: [R / P, d_I] pooled scoring keys;
                // undefined without an indexer
  Tensor tail_k, tail_gate;  // KPool: [slots, P, d_I] the incomplete pool's keys and gates
  int64_t page = 0;          // tokens per page (a multiple of P)
  // Per sequence of the call (in cu_seqlens order):
  std::vector<int64_t> slot;   // its slot (rows of tail_k / tail_gate)
  std::vector<int64_t> start;  // tokens already cached: the position of its first new token
  std::vector<const std::vector<int64_t>*> pages;  // its page table, covering the new tokens too

  int64_t row(size_t n, int64_t pos) const {
    return (*pages[n])[size_t(pos / page)] * page + pos % page;
  }
  // Storage row of pool j (tokens [j P, (j + 1) P)) of sequence n.
  int64_t pool_row(size_t n, int64_t j, int64_t P) const { return row(n, j * P) / P; }
};

}  // namespace hlm
