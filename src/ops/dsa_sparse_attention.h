// Sparse MLA attention over selected indices (docs/dsa.md, "Sparse attention"; the absorbed MQA
// form of "MLA"), forward and backward: CPU reference and CUDA kernels.
//
// One KV head: the cache row kv[s] in R^{D_qk} ([c_kv ; k_pe], or just c_kv for NoPE) is the key of
// every head, and its first d_v channels are the value. For query t with selected set
// S_t = {indices[t, j] != -1} and head h:
//   l_j   = scale * q[t, h] . kv[S_tj]                      (over all D_qk channels)
//   lse   = log sum_j exp(l_j)                              (natural log; FlashMLA returns base 2:
//                                                            lse2 = lse * log2(e))
//   out   = sum_j exp(l_j - lse) * kv[S_tj][:d_v]
// Computed in the input dtype (f32: f32 softmax and accumulation; f64: f64), the selected keys in
// slot order. An empty row gives out = 0 and lse = -inf (and zero gradients).
// Dtypes: q, kv, out, d_out, dq, dkv share one dtype: f32 or f64 on the CPU; f32, f64 or bf16 on
// CUDA (contiguous; bf16 computes in f32). lse is in the computation dtype (f32 for bf16). The CUDA
// kernels (ops/cuda/dsa_attention.cu) use an online softmax over key tiles: the same math, not the
// CPU's bits.
// Indices are global token positions (i32 or i64, -1 = empty); each must be a causal token of the
// query's own document (seqs) and appear at most once per row, otherwise hlm::Error (FlashMLA
// would count a duplicate twice; we refuse it).
// Backward: D = dout . out;  dp_j = dout . v_j;  ds_j = p_j (dp_j - D);  dq = scale sum_j ds_j k_j;
// dkv[s][:D_qk] = scale sum_{t,h,j: S_tj = s} ds q[t,h];  dkv[s][:d_v] += sum p dout[t,h].
// dkv is gathered per key over its readers in increasing (t, slot) order: deterministic, no
// atomics.
#pragma once

#include <optional>

#include "core/seq_layout.h"
#include "core/tensor.h"

namespace hlm::ops {

namespace dsa_detail {
struct Pattern;
}

struct SparseAttentionOut {
  Tensor out;  // [T, H, d_v]
  Tensor lse;  // [T, H], natural log
};

// q [T, H, D_qk], kv [T, D_qk] (same dtype, see above), indices [T, W].
// q0 (context parallelism): q (and out, lse, indices, d_out, dq) holds the
// queries of global tokens [q0, q0 + T) of the packed batch seqs, kv (and dkv) all its tokens
// [T_total, D_qk]; the result is those rows of the whole batch's.
SparseAttentionOut sparse_attention(const Tensor& q, const Tensor& kv, const Tensor& indices,
                                    const SeqLayout& seqs, int64_t d_v, double scale,
                                    std::optional<int64_t> q0 = {});

struct SparseAttentionGrads {
  Tensor dq;   // [T, H, D_qk]
  Tensor dkv;  // [T, D_qk]
};
SparseAttentionGrads sparse_attention_backward(const Tensor& q, const Tensor& kv,
                                               const Tensor& indices, const SeqLayout& seqs,
                                               int64_t d_v, double scale, const Tensor& out,
                                               const Tensor& lse, const Tensor& d_out,
                                               std::optional<int64_t> q0 = {});

// The same attention over storage rows of an inference cache (layers/dsa/dsa_cached.cpp): p (built
// on the host) lists each query's rows of kv [R, D_qk] in slot order, each checked to be in
// [0, R); no document or causality rule applies. q [p.T, H, D_qk]. CUDA copies the pattern to the
// device.
SparseAttentionOut sparse_attention_pattern(const Tensor& q, const Tensor& kv,
                                            const dsa_detail::Pattern& p, int64_t d_v,
                                            double scale);

// The selection and attention of the DSA layer's forward over an inference cache
// (layers/dsa/dsa_cached.cpp). Query t, at position pos[t] of sequence seq_of[t] (whose page table
// is pages[seq_of[t]]: position p is cache row pages[p / page] page + p % page), selects the best
// min(K / P, ncand[t]) of its candidates' scores[t, 0 .. ncand[t]) (pools of P tokens, or tokens
// for P = 1) by the rule of topk_select, each expanded to its P tokens (columns g P .. g P + P - 1,
// pools ascending), and with `tail` its incomplete pool's tokens ncand[t] P .. pos[t] (columns
// K ..); then attends them in that slot order over the cache rows kv (sparse_attention's math).
// CPU: on the host. CUDA: the top-k, the expansion to cache rows and the attention on the device;
// the per-query numbers and the page tables are copied there, nothing is read back.
struct CachedSelection {
  std::vector<int64_t> pos, ncand, seq_of;         // per query
  std::vector<const std::vector<int64_t>*> pages;  // per sequence
  int64_t page = 0, K = 0, P = 1;
  bool tail = false;
  int64_t width() const { return K + (tail ? P - 1 : 0); }
};
struct CachedAttentionOut {
  Tensor out, lse;  // as sparse_attention's
  Tensor sel;       // i32 [T, width()]: the selected positions (-1 empty), on the op's device
};
// q [T, H, D_qk], kv [R, D_qk] (one device, q's dtype), scores [T, >= max ncand] in q's
// computation dtype.
CachedAttentionOut cached_sparse_attention(const Tensor& q, const Tensor& kv, const Tensor& scores,
                                           const CachedSelection& s, int64_t d_v, double scale);

// Dense causal attention: the same math over the causal set of each query's own document (keys
// doc_start .. t in increasing order, i.e. sparse_attention with every causal token ascending),
// without an index tensor. Same argument checks and dtype rules as sparse_attention. The CPU runs
// the reference over dsa_detail::causal_pattern (O(T^2) host work, bit-identical to
// sparse_attention with the full causal index tensor); CUDA derives each query's keys and each
// key's readers (the queries s .. doc_end - 1, in increasing t) from the per-token layout on the
// device: O(T) host work and memory, and the bits of the CUDA sparse_attention with that tensor.
// q0: a query window, as for sparse_attention.
SparseAttentionOut causal_attention(const Tensor& q, const Tensor& kv, const SeqLayout& seqs,
                                    int64_t d_v, double scale, std::optional<int64_t> q0 = {});
SparseAttentionGrads causal_attention_backward(const Tensor& q, const Tensor& kv,
                                               const SeqLayout& seqs, int64_t d_v, double scale,
                                               const Tensor& out, const Tensor& lse,
                                               const Tensor& d_out, std::optional<int64_t> q0 = {});

}  // namespace hlm::ops
