// GEMM on CUDA through cuBLAS (ops/gemm.h): C = alpha * op(A) op(B) + beta * C, row-major.
//
// cuBLAS is column-major. A row-major matrix X [r, c] with leading dimension ld is the
// column-major X^T [c, r] with the same ld, so the row-major product C = op(A) op(B) is the
// column-major C^T = op(B)^T op(A)^T: one cublasGemmEx call with the operands swapped,
//   (op_b, op_a, n, m, k, B, ldb, A, lda, C, ldc),
// where op_x is CUBLAS_OP_T exactly when X is used transposed in row-major terms. Views are
// handled as on the CPU (ops/cpu/gemm.cpp): last dimension contiguous = row-major with
// ld = stride(0); first dimension contiguous = the transpose of a row-major matrix (flip the
// flag); anything else is copied to a contiguous buffer first. A C that is not row-major is
// computed in a contiguous buffer and copied back.
//
// Dtypes (the CPU gemm's rules):
//   plain      A, B, C f32: CUBLAS_COMPUTE_32F (FP32 FMA accumulation; never TF32: the handle's
//              math mode is CUBLAS_DEFAULT_MATH and the compute type is not *_FAST_TF32);
//              A, B, C f64: CUBLAS_COMPUTE_64F.
//   round_bf16 A and B rounded to bf16 once (a bf16 operand is used as is), bf16 tensor-core
//              products with CUBLAS_COMPUTE_32F accumulation; C f32 or bf16 is written directly
//              (the epilogue alpha acc + beta C in FP32, one rounding to C's dtype), C f64 through
//              an f32 buffer (as the CPU path: the epilogue in FP32).
// Grouped (gemm_grouped, the MoE experts): one cublasGemmGroupedBatchedEx call, one group of one
// problem per product, each mapped to column-major as above; the pointer arrays are copied to the
// device, the sizes, leading dimensions and scalars stay on the host. Where cuBLAS answers
// CUBLAS_STATUS_NOT_SUPPORTED for the dtype, the products run as a loop of cublasGemmEx calls.
// Determinism: one handle per device, created lazily on first use, bound to the default stream,
// atomics not allowed and reduced-precision reductions disallowed; cuBLAS then returns the same
// bits for the same call run after run on the same GPU.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <vector>

#include "ops/cuda/gemm.cuh"
#include "ops/gemm_operand.h"
#include "ops/tensor_ops.h"

namespace hlm::ops::cuda {
namespace {

void check_cublas(cublasStatus_t st, const char* what) {
  HLM_CHECK(st == CUBLAS_STATUS_SUCCESS, "cuBLAS {} failed: {} ({})", what,
            cublasGetStatusString(st), int(st));
}

// The handle of the current device, created on first use.
cublasHandle_t handle() {
  static std::mutex mu;
  static std::vector<cublasHandle_t> handles;
  int dev = 0;
  const cudaError_t err = cudaGetDevice(&dev);
  HLM_CHECK(err == cudaSuccess, "gemm: cudaGetDevice: {}", cudaGetErrorString(err));
  std::lock_guard<std::mutex> lock(mu);
  if (size_t(dev) >= handles.size()) handles.resize(size_t(dev) + 1, nullptr);
  cublasHandle_t& h = handles[size_t(dev)];
  if (h == nullptr) {
    check_cublas(cublasCreate(&h), "cublasCreate");
    check_cublas(cublasSetStream(h, nullptr), "cublasSetStream");
    check_cublas(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST), "cublasSetPointerMode");
    check_cublas(cublasSetAtomicsMode(h, CUBLAS_ATOMICS_NOT_ALLOWED), "cublasSetAtomicsMode");
    check_cublas(
        cublasSetMathMode(h, cublasMath_t(CUBLAS_DEFAULT_MATH |
                                          CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)),
        "cublasSetMathMode");
  }
  return h;
}

using detail::as_blas;
using detail::BlasMat;

cudaDataType_t cuda_type(DType dt) {
  switch (dt) {
    case DType::f32:
      return CUDA_R_32F;
    case DType::f64:
      return CUDA_R_64F;
    case DType::bf16:
      return CUDA_R_16BF;
    default:
      HLM_FAIL("gemm on CUDA: unsupported dtype {}", dtype_name(dt));
  }
}

int as_int(int64_t v, const char* what) {
  HLM_CHECK(v >= 0 && v < INT32_MAX, "gemm on CUDA: {} = {} exceeds the cuBLAS int range", what, v);
  return int(v);
}

// C (row-major, contiguous last dimension) = alpha op(A) op(B) + beta C.
void run(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, int64_t m, int64_t n,
         int64_t k, double alpha, double beta, cublasComputeType_t compute) {
  const BlasMat ma = as_blas(a, ta), mb = as_blas(b, tb);
  const int64_t ldc = m <= 1 ? std::max<int64_t>(n, 1) : c.stride(0);
  const cublasOperation_t op_b = mb.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_a = ma.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  const float fa = float(alpha), fb = float(beta);
  const bool f64 = compute == CUBLAS_COMPUTE_64F;
  const void* pa = f64 ? static_cast<const void*>(&alpha) : static_cast<const void*>(&fa);
  const void* pb = f64 ? static_cast<const void*>(&beta) : static_cast<const void*>(&fb);
  check_cublas(
      cublasGemmEx(handle(), op_b, op_a, as_int(n, "n"), as_int(m, "m"), as_int(k, "k"), pa, mb.ptr,
                   cuda_type(b.dtype()), mb.ld, ma.ptr, cuda_type(a.dtype()), ma.ld, pb, c.raw(),
                   cuda_type(c.dtype()), as_int(ldc, "ldc"), compute, CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx");
}

// C of any strides: through a contiguous buffer of dtype cdt when C is not row-major or not cdt.
void run_into(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, DType cdt, int64_t m,
              int64_t n, int64_t k, double alpha, double beta, cublasComputeType_t compute) {
  if (detail::blas_row_major(c) && c.dtype() == cdt) {
    run(a, ta, b, tb, c, m, n, k, alpha, beta, compute);
    return;
  }
  Tensor tmp = Tensor::empty({m, n}, cdt, Device::cuda);
  if (beta != 0.0) copy_into(tmp, c);
  run(a, ta, b, tb, tmp, m, n, k, alpha, beta, compute);
  copy_into(c, tmp);
}

}  // namespace

namespace {
std::atomic<int64_t> g_grouped_calls{0}, g_grouped_loops{0};
}  // namespace

ops::GemmGroupedCounts gemm_grouped_counts() {
  return {g_grouped_calls.load(), g_grouped_loops.load()};
}

void gemm_grouped(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c,
                  const std::vector<GemmGroup>& groups, double alpha, double beta) {
  if (groups.empty()) return;
  ++g_grouped_calls;
  const DType dt = c.dtype();
  const bool f64 = dt == DType::f64;
  const cublasComputeType_t compute = f64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F;
  const cudaDataType_t ty = cuda_type(dt), ty_ab = cuda_type(a.dtype());
  const size_t G = groups.size(), es = dtype_size(dt), es_ab = dtype_size(a.dtype());
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T (see the top of this file):
  // cuBLAS's A is our B, its m our n.
  const std::vector<cublasOperation_t> op_a(G, ta ? CUBLAS_OP_T : CUBLAS_OP_N),
      op_b(G, tb ? CUBLAS_OP_T : CUBLAS_OP_N);
  std::vector<int> m(G), n(G), k(G), lda(G), ldb(G), ldc(G), size(G, 1);
  std::vector<int64_t> ptr(3 * G);
  const auto* pa = static_cast<const char*>(a.raw());
  const auto* pb = static_cast<const char*>(b.raw());
  auto* pc = static_cast<char*>(c.raw());
  for (size_t g = 0; g < G; ++g) {
    const GemmGroup& q = groups[g];
    m[g] = as_int(q.m, "m");
    n[g] = as_int(q.n, "n");
    k[g] = as_int(q.k, "k");
    lda[g] = as_int(q.lda > 0 ? q.lda : (ta ? q.m : q.k), "lda");
    ldb[g] = as_int(q.ldb > 0 ? q.ldb : (tb ? q.k : q.n), "ldb");
    ldc[g] = as_int(q.ldc > 0 ? q.ldc : q.n, "ldc");
    ptr[g] = reinterpret_cast<int64_t>(pa + size_t(q.a_off) * es_ab);
    ptr[G + g] = reinterpret_cast<int64_t>(pb + size_t(q.b_off) * es_ab);
    ptr[2 * G + g] = reinterpret_cast<int64_t>(pc + size_t(q.c_off) * es);
  }
  const std::vector<float> fa(G, float(alpha)), fb(G, float(beta));
  const std::vector<double> da(G, alpha), db(G, beta);
  const void* al = f64 ? static_cast<const void*>(da.data()) : static_cast<const void*>(fa.data());
  const void* be = f64 ? static_cast<const void*>(db.data()) : static_cast<const void*>(fb.data());
  // The pointer arrays live on the device (a synchronous copy; the tensor outlives the call's
  // queued work by the allocator's stream-order rule, core/cuda_cache.h).
  const Tensor dptr = Tensor::from_vector<int64_t>({int64_t(3 * G)}, ptr).to(Device::cuda);
  void* const* arr = static_cast<void* const*>(dptr.raw());
  const cublasStatus_t st =
      cublasGemmGroupedBatchedEx(handle(), op_b.data(), op_a.data(), n.data(), m.data(), k.data(),
                                 al, arr + G, ty_ab, ldb.data(), arr, ty_ab, lda.data(), be,
                                 arr + 2 * G, ty, ldc.data(), int(G), size.data(), compute);
  if (st != CUBLAS_STATUS_NOT_SUPPORTED) {
    check_cublas(st, "cublasGemmGroupedBatchedEx");
    return;
  }
  ++g_grouped_loops;
  for (size_t g = 0; g < G; ++g)
    check_cublas(cublasGemmEx(handle(), op_b[g], op_a[g], n[g], m[g], k[g],
                              f64 ? static_cast<const void*>(&da[g]) : &fa[g],
                              reinterpret_cast<const void*>(ptr[G + g]), ty_ab, ldb[g],
                              reinterpret_cast<const void*>(ptr[g]), ty_ab, lda[g],
                              f64 ? static_cast<const void*>(&db[g]) : &fb[g],
                              reinterpret_cast<void*>(ptr[2 * G + g]), ty, ldc[g], compute,
                              CUBLAS_GEMM_DEFAULT),
                 "cublasGemmEx");
}

void gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, int64_t m, int64_t n,
          int64_t k, double alpha, double beta, GemmOptions opt) {
  if (!opt.round_bf16) {
    const bool f64 = a.dtype() == DType::f64;
    run_into(a, ta, b, tb, c, a.dtype(), m, n, k, alpha, beta,
             f64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F);
    return;
  }
  const Tensor a16 = ops::as_dtype(a, DType::bf16), b16 = ops::as_dtype(b, DType::bf16);
  const DType cdt = c.dtype() == DType::bf16 ? DType::bf16 : DType::f32;
  run_into(a16, ta, b16, tb, c, cdt, m, n, k, alpha, beta, CUBLAS_COMPUTE_32F);
}

}  // namespace hlm::ops::cuda
