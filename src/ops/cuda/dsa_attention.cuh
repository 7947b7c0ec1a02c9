// The CUDA side of the sparse and the dense causal MLA attention (ops/dsa_sparse_attention.h) and
// of the indexer loss's attention target (ops/dsa_indexer_loss.h): host interface of
// dsa_attention.cu, includable from C++. The front doors check the arguments (q, kv, out, d_out:
// f32, f64 or bf16, one dtype, contiguous; lse and the targets in the computation dtype, f32 for
// bf16), build the pattern of an explicit selection on the device (device_rows_pattern,
// ops/cuda/dsa_common.cuh) and allocate the outputs. Kernels run on the default stream.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/cuda/dsa_common.cuh"
#include "ops/dsa_common.h"

namespace hlm::ops::cuda {

// out [T, H, d_v] (q's dtype), lse [T, H] (computation dtype, natural log).
void sparse_attention(const Tensor& q, const Tensor& kv, const DsaPatternDev& p, int64_t d_v,
                      double scale, Tensor& out, Tensor& lse);
// dq [T, H, D_qk], dkv [T, D_qk] (q's dtype).
void sparse_attention_backward(const Tensor& q, const Tensor& kv, const DsaPatternDev& p,
                               int64_t d_v, double scale, const Tensor& out, const Tensor& lse,
                               const Tensor& d_out, Tensor& dq, Tensor& dkv);

// The same over the dense causal set of each query's document (keys doc_start .. t) of the packed
// batch `cu`: no host pattern, the kernels derive each query's keys and each key's readers (the
// queries s .. doc_end - 1) from the per-token layout (upload_layout).
void causal_attention(const Tensor& q, const Tensor& kv, const dsa_detail::QueryWindow& w,
                      int64_t d_v, double scale, Tensor& out, Tensor& lse);
void causal_attention_backward(const Tensor& q, const Tensor& kv, const dsa_detail::QueryWindow& w,
                               int64_t d_v, double scale, const Tensor& out, const Tensor& lse,
                               const Tensor& d_out, Tensor& dq, Tensor& dkv);

// p* [T, W] (computation dtype) over the entries of an explicit pattern; 0 elsewhere. lse: the
// rows' log-sum-exp [T, H] when known (undefined: computed here first).
void attention_target(const Tensor& q, const Tensor& kv, const DsaPatternDev& p, double scale,
                      Tensor& out, const Tensor& lse = {});
// p* [T, W] over the dense causal sets of the packed batch `cu` (column j = document token j;
// 0 beyond the query's position): no host pattern, the keys come from the per-token layout.
void attention_target_dense(const Tensor& q, const Tensor& kv, const dsa_detail::QueryWindow& w,
                            double scale, Tensor& out);

}  // namespace hlm::ops::cuda
