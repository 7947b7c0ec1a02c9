// The front door of the KPool ops (ops/dsa_kpool.h): argument checks, output allocation, and the
// switch to the CPU reference (ops/cpu/dsa_kpool.cpp) or the CUDA kernels (ops/cuda/dsa_kpool.cu
// for the compression, ops/cuda/dsa_select.cu for the selection and the pool targets).
#include "ops/dsa_kpool.h"

#include "ops/cpu/dsa_kpool.h"
#include "ops/cuda/dsa_kpool.cuh"
#include "ops/cuda/dsa_select.cuh"
#include "ops/dispatch.h"
#include "ops/dsa_common.h"
#include "ops/dsa_indexer.h"
#include "ops/op_checks.h"

namespace hlm::ops {
namespace {

struct CompressDims {
  std::vector<int64_t> cu;
  int64_t T = 0, D = 0, P = 0, NP = 0;
  Device dev = Device::cpu;
};

CompressDims check_compress(const Tensor& k, const Tensor& gate, const Tensor& ape,
                            const SeqLayout& seqs, const char* op) {
  detail::require_float_dev(k, op, "k");
  HLM_CHECK(k.dim() == 2, "{}: k must be [T, d_I], got {}", op, k.describe());
  detail::require_like(gate, k, k.shape(), op, "gate", "k");
  // ape is a parameter: k's dtype, or f32 when k is bf16.
  detail::require_float_dev(ape, op, "ape");
  HLM_CHECK(ape.dtype() == k.dtype() || (k.dtype() == DType::bf16 && ape.dtype() == DType::f32),
            "{}: ape must have the dtype of k ({}){}, got {}", op, dtype_name(k.dtype()),
            k.dtype() == DType::bf16 ? " or f32" : "", ape.describe());
  detail::require_same_device(ape, k, op, "ape", "k");
  HLM_CHECK(ape.dim() == 2 && ape.size(0) >= 1 && ape.size(1) == k.size(1),
            "{}: ape must be [P, d_I] with P >= 1 and d_I = {}, got {}", op, k.size(1),
            ape.describe());
  CompressDims a;
  a.T = k.size(0), a.D = k.size(1), a.P = ape.size(0);
  a.dev = k.device();
  a.cu = dsa_detail::seq_offsets(seqs, a.T, op);
  a.NP = dsa_detail::pool_offsets(a.cu, a.P).back();
  return a;
}

void check_kp(int64_t K, int64_t P, const char* op) {
  HLM_CHECK(P >= 1, "{}: the pool size P must be >= 1, got {}", op, P);
  HLM_CHECK(K >= 1, "{}: K (index_topk) must be >= 1, got {}", op, K);
  HLM_CHECK(K % P == 0, "{}: K (index_topk = {}) must be divisible by the pool size P = {}", op, K,
            P);
}

}  // namespace

Tensor kpool_pool_offsets(const SeqLayout& seqs, int64_t T, int64_t P) {
  HLM_CHECK(P >= 1, "kpool_pool_offsets: the pool size P must be >= 1, got {}", P);
  const std::vector<int64_t> cu = dsa_detail::seq_offsets(seqs, T, "kpool_pool_offsets");
  return Tensor::from_vector<int64_t>({int64_t(cu.size())}, dsa_detail::pool_offsets(cu, P));
}

Tensor kpool_compress(const Tensor& k_, const Tensor& gate_, const Tensor& ape_,
                      const SeqLayout& seqs) {
  const char* op = "kpool_compress";
  const CompressDims a = check_compress(k_, gate_, ape_, seqs, op);
  const Tensor k = k_.contiguous(), gate = gate_.contiguous(), ape = ape_.contiguous();
  Tensor out = detail::new_output({a.NP, a.D}, k.dtype(), a.dev);
  HLM_DISPATCH(op, a.dev, kpool_compress, k, gate, ape, a.cu, out);
  return out;
}

KPoolCompressGrads kpool_compress_backward(const Tensor& k_, const Tensor& gate_,
                                           const Tensor& ape_, const SeqLayout& seqs,
                                           const Tensor& d_pooled_) {
  const char* op = "kpool_compress_backward";
  const CompressDims a = check_compress(k_, gate_, ape_, seqs, op);
  detail::require_like(d_pooled_, k_, {a.NP, a.D}, op, "d_pooled", "k");
  const Tensor k = k_.contiguous(), gate = gate_.contiguous(), ape = ape_.contiguous(),
               d_pooled = d_pooled_.contiguous();
  KPoolCompressGrads g{detail::new_output(k.shape(), k.dtype(), a.dev),
                       detail::new_output(k.shape(), k.dtype(), a.dev),
                       detail::new_output(ape.shape(), ape.dtype(), a.dev)};
  HLM_DISPATCH(op, a.dev, kpool_compress_backward, k, gate, ape, a.cu, d_pooled, g);
  return g;
}

KPoolSelection kpool_select(const Tensor& pool_scores, const SeqLayout& seqs, int64_t K, int64_t P,
                            bool always_select_tail, std::optional<int64_t> q0) {
  const char* op = "kpool_select";
  check_kp(K, P, op);
  detail::require_real(pool_scores, op, "pool_scores");
  HLM_CHECK(pool_scores.dim() == 2, "{}: pool_scores must be [T, W], got {}", op,
            pool_scores.describe());
  const int64_t T = pool_scores.size(0);
  const dsa_detail::QueryWindow win = dsa_detail::window_of(seqs, T, q0, op);
  KPoolSelection sel;
  sel.pools = topk_select(pool_scores, seqs, K / P, P, q0);
  sel.indices =
      detail::new_output({T, K + (always_select_tail ? P - 1 : 0)}, DType::i32, sel.pools.device());
  if (sel.pools.is_cpu())
    cpu::kpool_select_indices(sel.pools, win, K, P, always_select_tail, sel.indices);
  else
    HLM_CUDA_PATH(
        op, cuda::kpool_select_indices(sel.pools, win, K, P, always_select_tail, sel.indices));
  return sel;
}

Tensor kpool_pool_target_dense(const Tensor& token_target, const SeqLayout& seqs, int64_t P,
                               int64_t Wp, std::optional<int64_t> q0) {
  const char* op = "kpool_pool_target_dense";
  HLM_CHECK(P >= 1, "{}: the pool size P must be >= 1, got {}", op, P);
  detail::require_real(token_target, op, "token_target");
  HLM_CHECK(token_target.dim() == 2, "{}: token_target must be [T, W], got {}", op,
            token_target.describe());
  const int64_t T = token_target.size(0);
  const dsa_detail::QueryWindow win = dsa_detail::window_of(seqs, T, q0, op);
  const std::vector<int64_t>& cu = win.cu;
  const int64_t need_t = dsa_detail::max_keys_per_doc(cu, 1);
  const int64_t need_p = dsa_detail::max_keys_per_doc(cu, P);
  HLM_CHECK(token_target.size(1) >= need_t, "{}: token_target needs W >= {} columns, got {}", op,
            need_t, token_target.describe());
  HLM_CHECK(Wp == 0 || Wp >= need_p, "{}: Wp must be 0 or >= {}, got {}", op, need_p, Wp);
  const Tensor tt = token_target.contiguous();
  Tensor out = detail::new_output({T, Wp == 0 ? need_p : Wp}, tt.dtype(), tt.device());
  if (tt.is_cpu())
    cpu::kpool_pool_target_dense(tt, win, P, out);
  else
    HLM_CUDA_PATH(op, cuda::kpool_pool_target_dense(tt, win, P, out));
  return out;
}

Tensor kpool_pool_target_sparse(const Tensor& token_target, const Tensor& pools, int64_t P) {
  const char* op = "kpool_pool_target_sparse";
  HLM_CHECK(P >= 1, "{}: the pool size P must be >= 1, got {}", op, P);
  detail::require_real(token_target, op, "token_target");
  detail::require_int(pools, op, "pools");
  HLM_CHECK(pools.dim() == 2, "{}: pools must be [T, K / P], got {}", op, pools.describe());
  const int64_t T = pools.size(0), G = pools.size(1);
  HLM_CHECK(token_target.dim() == 2 && token_target.size(0) == T &&
                (token_target.size(1) == G * P || token_target.size(1) == G * P + P - 1),
            "{}: token_target must be [T = {}, K = {} or K + P - 1 = {}], got {}", op, T, G * P,
            G * P + P - 1, token_target.describe());
  const Device dev = detail::one_device(op, {token_target, "token_target"}, {{pools, "pools"}});
  const Tensor tt = token_target.contiguous();
  Tensor out = detail::new_output({T, G}, tt.dtype(), dev);
  if (dev == Device::cpu)
    cpu::kpool_pool_target_sparse(tt, detail::index_values(pools), P, out);
  else
    HLM_CUDA_PATH(op, cuda::kpool_pool_target_sparse(tt, pools.contiguous(), P, out));
  return out;
}

}  // namespace hlm::ops
