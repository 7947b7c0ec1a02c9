// GEMM on the CPU (ops/gemm.h, the reference; entry point in ops/cpu/gemm.h):
// C = alpha * op(A) op(B) + beta * C.
//
//   op(A) [M, K], op(B) [K, N], C [M, N]; op(X) = X or X^T.
//   C[m, n] = alpha * sum_k op(A)[m, k] * op(B)[k, n] + beta * C[m, n]
//
// BLAS wants each operand as a pointer plus a leading dimension, row-major here (CblasRowMajor).
// A 2-D view whose last dimension is contiguous is row-major with ld = stride(0); a view whose
// first dimension is contiguous (e.g. a transpose() of a contiguous tensor) is the transpose of a
// row-major matrix, so we flip its transpose flag instead of copying. Anything else is copied.
// With beta == 0, C is not read (a NaN poison in C does not leak into the result).
// With round_bf16, both operands are rounded to bf16 and multiplied with FP32 accumulation
// (cblas_sgemm), as a bf16 tensor-core GEMM does; the result goes to C in C's dtype.
//
// Two backends (the front door passes gemm_backend(): set_gemm_backend or HLM_GEMM=invariant|blas):
//   invariant (default): our own kernel. Every element is one strictly sequential sum over k,
//     C[m, n] = alpha * (((a_m0 b_0n + a_m1 b_1n) + a_m2 b_2n) + ...) + beta * C[m, n],
//     so a row of C depends only on its row of op(A) and on op(B): the same bits whatever the
//     number of rows M (a packed batch equals its sequences run one by one, through every Linear)
//     and whatever the thread count (threads split rows). Vectorised across n, never across k.
//   blas: OpenBLAS. Faster on large products; bit-identical run to run at a fixed thread count,
//     but its kernels depend on M and on the thread partition (edge tiles, small-matrix paths), so
//     rows of a 70-row product can differ in the last bit from the same rows of a 130-row one.
#include <cblas.h>

#include <algorithm>
#include <vector>

#include "ops/cpu/gemm.h"
#include "ops/gemm_operand.h"

namespace hlm::ops::cpu {

namespace {

using detail::as_blas;
using detail::BlasMat;

CBLAS_TRANSPOSE tr(bool t) {
  return t ? CblasTrans : CblasNoTrans;
}

// The invariant kernel: C = alpha * op(A) op(B) + beta * C, row-major C [m, n] with leading
// dimension ldc. op(B) is packed once into a contiguous row-major [k, n] buffer; then each block of
// kRows rows and kCols columns accumulates over k in order, the inner loop running across columns.
template <class T>
void invariant_gemm(const BlasMat& a, const BlasMat& b, T* c, int64_t ldc, int64_t m, int64_t n,
                    int64_t k, double alpha, double beta) {
  constexpr int64_t kRows = 4, kCols = 256;
  const T* pb = static_cast<const T*>(b.ptr);
  std::vector<T> packed;
  if (b.trans || b.ld != n) {
    packed.resize(size_t(k) * size_t(n));
    for (int64_t kk = 0; kk < k; ++kk)
      for (int64_t j = 0; j < n; ++j)
        packed[size_t(kk * n + j)] = b.trans ? pb[j * b.ld + kk] : pb[kk * b.ld + j];
    pb = packed.data();
  }
  const T* pa = static_cast<const T*>(a.ptr);
  auto a_at = [&](int64_t i, int64_t kk) {
    return a.trans ? pa[kk * a.ld + i] : pa[i * a.ld + kk];
  };
  const T ta = T(alpha), tb = T(beta);
  const int64_t row_blocks = (m + kRows - 1) / kRows;
#pragma omp parallel for schedule(static) if (m * n * k > (int64_t(1) << 16))
  for (int64_t rb = 0; rb < row_blocks; ++rb) {
    const int64_t i0 = rb * kRows, rows = std::min(kRows, m - i0);
    T acc[kRows][kCols];
    for (int64_t j0 = 0; j0 < n; j0 += kCols) {
      const int64_t cols = std::min(kCols, n - j0);
      for (int64_t r = 0; r < rows; ++r) std::fill(acc[r], acc[r] + cols, T(0));
      for (int64_t kk = 0; kk < k; ++kk) {
        const T* brow = pb + kk * n + j0;
        for (int64_t r = 0; r < rows; ++r) {
          const T av = a_at(i0 + r, kk);
          T* ar = acc[r];
#pragma omp simd
          for (int64_t j = 0; j < cols; ++j) ar[j] += av * brow[j];
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        T* crow = c + (i0 + r) * ldc + j0;
        if (beta == 0.0) {
          for (int64_t j = 0; j < cols; ++j) crow[j] = ta * acc[r][j];
        } else {
          for (int64_t j = 0; j < cols; ++j) crow[j] = ta * acc[r][j] + tb * crow[j];
        }
      }
    }
  }
}

// C = alpha * op(A) op(B) + beta * C for row-major C of dtype T (T = float or double), with A and
// B of dtype T too, on the selected backend.
template <class T>
void blas_gemm(const BlasMat& a, const BlasMat& b, T* c, int ldc, int64_t m, int64_t n, int64_t k,
               double alpha, double beta, GemmBackend backend) {
  if (backend == GemmBackend::invariant) {
    invariant_gemm<T>(a, b, c, ldc, m, n, k, alpha, beta);
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    cblas_sgemm(CblasRowMajor, tr(a.trans), tr(b.trans), int(m), int(n), int(k), float(alpha),
                static_cast<const float*>(a.ptr), a.ld, static_cast<const float*>(b.ptr), b.ld,
                float(beta), c, ldc);
  } else {
    cblas_dgemm(CblasRowMajor, tr(a.trans), tr(b.trans), int(m), int(n), int(k), alpha,
                static_cast<const double*>(a.ptr), a.ld, static_cast<const double*>(b.ptr), b.ld,
                beta, c, ldc);
  }
}

// Full C update for T = float / double when A, B, C all hold T.
template <class T>
void gemm_same_dtype(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, int64_t m,
                     int64_t n, int64_t k, double alpha, double beta, GemmBackend backend) {
  const BlasMat ma = as_blas(a, ta), mb = as_blas(b, tb);
  if (detail::blas_row_major(c)) {
    const int ldc = int(m <= 1 ? std::max<int64_t>(n, 1) : c.stride(0));
    blas_gemm<T>(ma, mb, c.data<T>(), ldc, m, n, k, alpha, beta, backend);
    return;
  }
  // C is not row-major: compute on a contiguous copy and write it back.
  Tensor tmp = beta == 0.0 ? Tensor::empty(c.shape(), c.dtype()) : c.clone();
  blas_gemm<T>(ma, mb, tmp.data<T>(), int(std::max<int64_t>(n, 1)), m, n, k, alpha, beta, backend);
  c.copy_(tmp);
}

// The bf16 path: operands rounded to bf16 (held as f32), FP32 accumulation; then
// C = alpha * acc + beta * C in C's dtype.
void gemm_bf16(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, int64_t m, int64_t n,
               int64_t k, double alpha, double beta, GemmBackend backend) {
  // to(bf16) rounds to nearest even once, from whatever precision the operand holds.
  const Tensor a16 = a.dtype() == DType::bf16 ? a.to(DType::f32) : a.to(DType::bf16).to(DType::f32);
  const Tensor b16 = b.dtype() == DType::bf16 ? b.to(DType::f32) : b.to(DType::bf16).to(DType::f32);
  if (c.dtype() == DType::f32) {
    gemm_same_dtype<float>(a16, ta, b16, tb, c, m, n, k, alpha, beta, backend);
    return;
  }
  Tensor acc = Tensor::empty({m, n}, DType::f32);
  blas_gemm<float>(as_blas(a16, ta), as_blas(b16, tb), acc.data<float>(),
                   int(std::max<int64_t>(n, 1)), m, n, k, 1.0, 0.0, backend);
  // Epilogue in FP32 (as the tensor-core epilogue does), then one cast to C's dtype.
  Tensor out = Tensor::empty({m, n}, DType::f32);
  const Tensor cold = beta == 0.0 ? Tensor() : c.to(DType::f32);
  const float fa = float(alpha), fb = float(beta);
  const float* pa = acc.data<float>();
  float* po = out.data<float>();
  const float* pc = cold.defined() ? cold.data<float>() : nullptr;
  for (int64_t i = 0; i < m * n; ++i) po[i] = pc ? fa * pa[i] + fb * pc[i] : fa * pa[i];
  c.copy_(out);
}

}  // namespace

void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, int64_t m,
          int64_t n, int64_t k, double alpha, double beta, GemmOptions opt, GemmBackend backend) {
  if (opt.round_bf16) {
    gemm_bf16(a, trans_a, b, trans_b, c, m, n, k, alpha, beta, backend);
  } else if (a.dtype() == DType::f32) {
    gemm_same_dtype<float>(a, trans_a, b, trans_b, c, m, n, k, alpha, beta, backend);
  } else {
    gemm_same_dtype<double>(a, trans_a, b, trans_b, c, m, n, k, alpha, beta, backend);
  }
}

}  // namespace hlm::ops::cpu
