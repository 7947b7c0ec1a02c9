// The BF16 tensor-core forward of the sparse / dense causal MLA attention (dsa_attention_mma.cu):
// interface for dsa_attention.cu. Internal to the CUDA sources.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "ops/cuda/dsa_keys.cuh"

namespace hlm::ops::cuda {

using nv_bf16 = __nv_bfloat16;

// out [T, H, d_v] (null: the lse alone, d_v = 0) and lse [T, H] over the keys `keys`, as
// dsa_attention.cu's forward. Returns false, launching nothing, where the shapes do not fit the
// kernel (D_qk not a multiple of 32, d_v > 512, rows not 16-byte aligned, or too little shared
// memory): the caller then runs its FMA kernel.
bool attention_fwd_mma(const nv_bf16* q, const nv_bf16* kv, const PatternKeys& keys, nv_bf16* out,
                       float* lse, int64_t T, int H, int D, int dv, double scale, const char* what);
bool attention_fwd_mma(const nv_bf16* q, const nv_bf16* kv, const DenseKeys& keys, nv_bf16* out,
                       float* lse, int64_t T, int H, int D, int dv, double scale, const char* what);

// dq [T, H, D_qk] and dkv [nkeys, D_qk] (bf16) from the forward's lse and Delta = dout . out
// ([T, H] f32), as dsa_attention.cu's backward; max_keys bounds the keys of one query (the
// selection's width, or the longest document). For DenseKeys, keys.entry_base must be set. Returns
// false, launching nothing, where the shapes do not fit (as attention_fwd_mma, or D_qk > 576).
// The indexer loss's target p* [T, W] (f32, zeroed here; ops/dsa_indexer_loss.h) from the rows'
// lse [T, H], all heads of a query in one block: false (nothing done) where the shapes do not fit
// (H > 64, D % 32 != 0, shared memory).
bool attention_target_mma(const nv_bf16* q, const nv_bf16* kv, const PatternKeys& keys,
                          const float* lse, float* out, int64_t T, int H, int D, int64_t W,
                          double scale, const char* what);
bool attention_target_mma(const nv_bf16* q, const nv_bf16* kv, const DenseKeys& keys,
                          const float* lse, float* out, int64_t T, int H, int D, int64_t W,
                          double scale, const char* what);

bool attention_bwd_mma(const nv_bf16* q, const nv_bf16* kv, const nv_bf16* dout, const float* lse,
                       const float* delta, const PatternKeys& keys, int64_t nkeys, int64_t max_keys,
                       nv_bf16* dq, nv_bf16* dkv, int64_t T, int H, int D, int dv, double scale,
                       const char* what);
bool attention_bwd_mma(const nv_bf16* q, const nv_bf16* kv, const nv_bf16* dout, const float* lse,
                       const float* delta, const DenseKeys& keys, int64_t nkeys, int64_t max_keys,
                       nv_bf16* dq, nv_bf16* dkv, int64_t T, int H, int D, int dv, double scale,
                       const char* what);

}  // namespace hlm::ops::cuda
