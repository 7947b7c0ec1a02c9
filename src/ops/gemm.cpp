// GEMM on the CPU through OpenBLAS: C = alpha * op(A) op(B) + beta * C.
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
// Two backends (gemm_backend(), set by set_gemm_backend or HLM_GEMM=invariant|blas):
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
#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "ops/gemm.h"
#include "ops/gemm_operand.h"
#include "ops/op_checks.h"
#include "ops/tensor_ops.h"

namespace hlm::ops {

namespace detail {

BlasMat as_blas(const Tensor& t, bool trans) {
  const int64_t r = t.size(0), c = t.size(1);
  const int64_t s0 = t.stride(0), s1 = t.stride(1);
  auto ld_of = [&](int64_t ld) {
    HLM_CHECK(ld < INT32_MAX, "gemm: leading dimension {} of {} exceeds the BLAS int range", ld,
              t.describe());
    return int(ld);
  };
  BlasMat m;
  if ((c <= 1 || s1 == 1) && (r <= 1 || s0 >= std::max<int64_t>(c, 1))) {
    m.ptr = t.raw();
    m.ld = ld_of(r <= 1 ? std::max<int64_t>(c, 1) : s0);
    m.trans = trans;
    return m;
  }
  if ((r <= 1 || s0 == 1) && (c <= 1 || s1 >= std::max<int64_t>(r, 1))) {
    // Column-major storage: t = (t^T)^T with t^T row-major [C, R], ld = stride(1).
    m.ptr = t.raw();
    m.ld = ld_of(c <= 1 ? std::max<int64_t>(r, 1) : s1);
    m.trans = !trans;
    return m;
  }
  m.keep = contiguous(t);
  m.ptr = m.keep.raw();
  m.ld = ld_of(std::max<int64_t>(c, 1));
  m.trans = trans;
  return m;
}

bool blas_row_major(const Tensor& t) {
  const int64_t r = t.size(0), c = t.size(1);
  return (c <= 1 || t.stride(1) == 1) && (r <= 1 || t.stride(0) >= std::max<int64_t>(c, 1));
}

}  // namespace detail

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

GemmBackend backend_from_env() {
  const char* e = std::getenv("HLM_GEMM");
  if (e == nullptr || *e == 0 || std::strcmp(e, "invariant") == 0) return GemmBackend::invariant;
  if (std::strcmp(e, "blas") == 0) return GemmBackend::blas;
  HLM_FAIL("HLM_GEMM must be \"invariant\" or \"blas\", got \"{}\"", e);
}

std::atomic<GemmBackend>& backend_slot() {
  static std::atomic<GemmBackend> slot{backend_from_env()};
  return slot;
}

// C = alpha * op(A) op(B) + beta * C for row-major C of dtype T (T = float or double), with A and
// B of dtype T too, on the selected backend.
template <class T>
void blas_gemm(const BlasMat& a, const BlasMat& b, T* c, int ldc, int64_t m, int64_t n, int64_t k,
               double alpha, double beta) {
  if (gemm_backend() == GemmBackend::invariant) {
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
                     int64_t n, int64_t k, double alpha, double beta) {
  const BlasMat ma = as_blas(a, ta), mb = as_blas(b, tb);
  if (detail::blas_row_major(c)) {
    const int ldc = int(m <= 1 ? std::max<int64_t>(n, 1) : c.stride(0));
    blas_gemm<T>(ma, mb, c.data<T>(), ldc, m, n, k, alpha, beta);
    return;
  }
  // C is not row-major: compute on a contiguous copy and write it back.
  Tensor tmp = beta == 0.0 ? Tensor::empty(c.shape(), c.dtype()) : c.clone();
  blas_gemm<T>(ma, mb, tmp.data<T>(), int(std::max<int64_t>(n, 1)), m, n, k, alpha, beta);
  c.copy_(tmp);
}

// The bf16 path: operands rounded to bf16 (held as f32), FP32 accumulation; then
// C = alpha * acc + beta * C in C's dtype.
void gemm_bf16(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, int64_t m, int64_t n,
               int64_t k, double alpha, double beta) {
  // to(bf16) rounds to nearest even once, from whatever precision the operand holds.
  const Tensor a16 = a.dtype() == DType::bf16 ? a.to(DType::f32) : a.to(DType::bf16).to(DType::f32);
  const Tensor b16 = b.dtype() == DType::bf16 ? b.to(DType::f32) : b.to(DType::bf16).to(DType::f32);
  if (c.dtype() == DType::f32) {
    gemm_same_dtype<float>(a16, ta, b16, tb, c, m, n, k, alpha, beta);
    return;
  }
  Tensor acc = Tensor::empty({m, n}, DType::f32);
  blas_gemm<float>(as_blas(a16, ta), as_blas(b16, tb), acc.data<float>(),
                   int(std::max<int64_t>(n, 1)), m, n, k, 1.0, 0.0);
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

GemmBackend gemm_backend() {
  return backend_slot().load(std::memory_order_relaxed);
}
void set_gemm_backend(GemmBackend b) {
  backend_slot().store(b, std::memory_order_relaxed);
}
const char* gemm_backend_name(GemmBackend b) {
  return b == GemmBackend::invariant ? "invariant" : "blas";
}

void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, double alpha,
          double beta, GemmOptions opt) {
  constexpr const char* op = "gemm";
  for (auto [t, name] : {std::pair<const Tensor*, const char*>{&a, "A"}, {&b, "B"}, {&c, "C"}}) {
    HLM_CHECK(t->defined(), "gemm: {} is undefined", name);
    HLM_CHECK(t->device() == a.device(), "gemm: {} must be on the device of A ({}), got {}", name,
              a.describe(), t->describe());
    HLM_CHECK(t->dim() == 2, "gemm: {} must be 2-D, got {}", name, t->describe());
  }
  const bool on_cuda = a.device() == Device::cuda;
#ifndef HLM_HAVE_CUDA
  HLM_CHECK(!on_cuda, "gemm: A is a CUDA tensor ({}) but this build has no CUDA support",
            a.describe());
#endif
  const int64_t m = trans_a ? a.size(1) : a.size(0);
  const int64_t k = trans_a ? a.size(0) : a.size(1);
  const int64_t kb = trans_b ? b.size(1) : b.size(0);
  const int64_t n = trans_b ? b.size(0) : b.size(1);
  HLM_CHECK(k == kb,
            "gemm: inner dimensions differ: op(A) is [{}, {}] (A {}{}), op(B) is [{}, {}] (B {}{})",
            m, k, shape_str(a.shape()), trans_a ? " transposed" : "", kb, n, shape_str(b.shape()),
            trans_b ? " transposed" : "");
  HLM_CHECK(c.size(0) == m && c.size(1) == n, "gemm: C must have shape [{}, {}], got {}", m, n,
            c.describe());
  HLM_CHECK(m < INT_MAX && n < INT_MAX && k < INT_MAX,
            "gemm: dimensions [{}, {}, {}] exceed BLAS int range", m, n, k);
  if (opt.round_bf16) {
    for (auto [t, name] : {std::pair<const Tensor*, const char*>{&a, "A"}, {&b, "B"}, {&c, "C"}})
      HLM_CHECK(t->dtype() == DType::f32 || t->dtype() == DType::f64 || t->dtype() == DType::bf16,
                "gemm (round_bf16): {} must be f32, f64 or bf16, got {}", name, t->describe());
  } else {
    HLM_CHECK(a.dtype() == DType::f32 || a.dtype() == DType::f64,
              "gemm: A must be f32 or f64, got {}", a.describe());
    detail::require_same_dtype(b, a, op, "B", "A");
    detail::require_same_dtype(c, a, op, "C", "A");
  }
  if (m == 0 || n == 0) return;
  if (k == 0) {  // C = beta C (beta == 0: C = 0 without reading it), on either device
    scale_(c, beta);
    return;
  }
  if (on_cuda) {
#ifdef HLM_HAVE_CUDA
    cuda::gemm(a, trans_a, b, trans_b, c, m, n, k, alpha, beta, opt);
#endif
    return;
  }
  if (opt.round_bf16) {
    gemm_bf16(a, trans_a, b, trans_b, c, m, n, k, alpha, beta);
  } else if (a.dtype() == DType::f32) {
    gemm_same_dtype<float>(a, trans_a, b, trans_b, c, m, n, k, alpha, beta);
  } else {
    gemm_same_dtype<double>(a, trans_a, b, trans_b, c, m, n, k, alpha, beta);
  }
}

Tensor matmul(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, GemmOptions opt) {
  HLM_CHECK(a.defined() && a.dim() == 2, "matmul: A must be a 2-D tensor, got {}", a.describe());
  HLM_CHECK(b.defined() && b.dim() == 2, "matmul: B must be a 2-D tensor, got {}", b.describe());
  const int64_t m = trans_a ? a.size(1) : a.size(0);
  const int64_t n = trans_b ? b.size(0) : b.size(1);
  Tensor c = Tensor::empty({m, n}, a.dtype(), a.device());
  gemm(a, trans_a, b, trans_b, c, 1.0, 0.0, opt);
  return c;
}

}  // namespace hlm::ops
