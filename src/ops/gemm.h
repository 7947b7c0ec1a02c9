// GEMM: C = alpha * op(A) op(B) + beta * C on 2-D tensors (CPU: f32 and f64; CUDA: below).
//   op(A) is A [M, K] or, with trans_a, A^T for A [K, M]; likewise op(B) is [K, N].
//   A, B, C may be strided views whose last dimension is contiguous (row stride = leading dim).
// Options: round_bf16 rounds both operands to bf16 first (FP32 accumulation), the numerics of a
// bf16 tensor-core GEMM; the result is written in C's dtype.
// Backends (ops/cpu/gemm.cpp): `invariant` (default) is our own kernel, each element one
// sequential sum over k, so every row of C has the same bits whatever the number of rows and the
// thread count (batch invariance: a packed batch equals its sequences one by one); `blas` is
// OpenBLAS (faster on large products, not batch invariant). The environment variable
// HLM_GEMM=invariant|blas picks the initial backend.
// CUDA: when A, B and C are CUDA tensors (all three on one device), cuBLAS runs the product
// (ops/cuda/gemm_cublas.cu): the same arguments, checks and dtype rules, f32 / f64 operands
// with FP32 / FP64 accumulation (no TF32), round_bf16 with bf16 tensor-core operands and FP32
// accumulation (C f32, bf16 or f64; the epilogue in FP32). Deterministic run to run; the
// summation order differs from the CPU kernels (f32 results agree to ~1e-6 relative).
#pragma once

#include <vector>

#include "core/tensor.h"

namespace hlm::ops {

struct GemmOptions {
  bool round_bf16 = false;
};

enum class GemmBackend { invariant, blas };
GemmBackend gemm_backend();
void set_gemm_backend(GemmBackend b);
const char* gemm_backend_name(GemmBackend b);

void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
          double alpha = 1.0, double beta = 0.0, GemmOptions opt = {});
// New [M, N] tensor = op(A) op(B), dtype of A.
Tensor matmul(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, GemmOptions opt = {});

// A grouped GEMM (the experts of an MoE layer): for every group g,
//   C_g = alpha op(A_g) op(B_g) + beta C_g,   op(A_g) [m, k], op(B_g) [k, n], C_g [m, n],
// where A_g, B_g and C_g are contiguous row-major blocks starting at element a_off / b_off /
// c_off of a, b and c (A_g is [m, k], or [k, m] with trans_a; B_g is [k, n], or [n, k] with
// trans_b), rows lda / ldb / ldc apart where those are given. a, b, c: contiguous tensors on one
// device; every block inside its tensor; m, n >= 1, k >= 0. dtypes as gemm: f32 / f64 operands of
// C's dtype, or with round_bf16 f32 / bf16 operands rounded to bf16 (FP32 accumulation) into an f32
// C. CPU: one gemm per group in order; CUDA: one cublasGemmGroupedBatchedEx call
// (ops/cuda/gemm_cublas.cu). Deterministic run to run. lda / ldb / ldc: the row strides of the
// blocks (0: packed, the row length), so a group may be the strided rows of a wider tensor (a
// head's columns of [T, H, d]).
struct GemmGroup {
  int64_t m, n, k;
  int64_t a_off, b_off, c_off;
  int64_t lda = 0, ldb = 0, ldc = 0;
};
void gemm_grouped(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                  const std::vector<GemmGroup>& groups, double alpha = 1.0, double beta = 0.0,
                  GemmOptions opt = {});
// One A, several products (the projections that read one input): c[i] = op(A) op(B_i) for every
// i, A [m, k] (or [k, m] with trans_a) and each c[i] [m, n_i] 2-D with a contiguous last
// dimension, each B_i [k, n_i] (or [n_i, k] with trans_b); dtypes as gemm, every c[i] of one
// dtype. CPU: one gemm per product in order (their bits). CUDA: one cublasGemmGroupedBatchedEx
// call for all (counted by gemm_grouped_counts), A converted once under round_bf16.
void gemm_multi(const Tensor& a, bool trans_a, const std::vector<Tensor>& b, bool trans_b,
                std::vector<Tensor>& c, GemmOptions opt = {});
// CUDA grouped GEMM calls since the start: all of them, those that cuBLAS did not take as one
// grouped call for their dtypes (run as one cublasGemmEx per group instead), and those whose
// products had one shape at constant operand strides (run as one strided batched call).
struct GemmGroupedCounts {
  int64_t calls = 0, per_group_loops = 0, strided = 0;
};
GemmGroupedCounts gemm_grouped_counts();

}  // namespace hlm::ops
