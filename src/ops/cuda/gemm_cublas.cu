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
// Products of one shape whose operands step by constant strides (the MLA's per-head products)
// go to one cublasGemmStridedBatchedEx call instead: one kernel, nothing copied.
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
std::atomic<int64_t> g_grouped_calls{0}, g_grouped_loops{0}, g_grouped_strided{0};
}  // namespace

ops::GemmGroupedCounts gemm_grouped_counts() {
  return {g_grouped_calls.load(), g_grouped_loops.load(), g_grouped_strided.load()};
}

namespace {

// One product of a grouped call: row-major C [m, n] = op(A) [m, k] op(B) [k, n], rows lda / ldb /
// ldc apart.
struct GroupProduct {
  const void *a, *b;
  void* c;
  int64_t m, n, k, lda, ldb, ldc;
};

// The element stride of the pointers p(0), p(1), ... when they step by a constant number of
// elements of es bytes (0 for one product), else -1.
template <class F>
int64_t pointer_stride(size_t G, size_t es, F&& p) {
  if (G < 2) return 0;
  const auto at = [&](size_t g) { return reinterpret_cast<intptr_t>(p(g)); };
  const intptr_t d = at(1) - at(0);
  if (d < 0 || d % intptr_t(es) != 0) return -1;
  for (size_t g = 2; g < G; ++g)
    if (at(g) - at(g - 1) != d) return -1;
  return int64_t(d / intptr_t(es));
}

// One cublasGemmGroupedBatchedEx call over the products (a loop of cublasGemmEx where cuBLAS does
// not take the dtypes; one cublasGemmStridedBatchedEx call where they have one shape at constant
// strides): A and B of dtype ab, C of dtype cd.
void grouped_call(const std::vector<GroupProduct>& ps, bool ta, bool tb, DType ab, DType cd,
                  double alpha, double beta) {
  ++g_grouped_calls;
  const bool f64 = cd == DType::f64;
  const cublasComputeType_t compute = f64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F;
  const cudaDataType_t ty = cuda_type(cd), ty_ab = cuda_type(ab);
  const size_t G = ps.size();
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T (see the top of this file):
  // cuBLAS's A is our B, its m our n.
  // Products of one shape at constant pointer strides (the MLA's per-head products): one strided
  // batched call, one kernel and no pointer arrays (cuBLAS ran a grouped call of equal groups as
  // a kernel per group).
  const GroupProduct& q0 = ps.front();
  const bool uniform = std::all_of(ps.begin(), ps.end(), [&](const GroupProduct& q) {
    return q.m == q0.m && q.n == q0.n && q.k == q0.k && q.lda == q0.lda && q.ldb == q0.ldb &&
           q.ldc == q0.ldc;
  });
  const size_t es_ab = dtype_size(ab), es_c = dtype_size(cd);
  const int64_t sa = pointer_stride(G, es_ab, [&](size_t g) { return ps[g].a; }),
                sb = pointer_stride(G, es_ab, [&](size_t g) { return ps[g].b; }),
                sc = pointer_stride(G, es_c, [&](size_t g) { return ps[g].c; });
  if (uniform && sa >= 0 && sb >= 0 && sc >= 0) {
    ++g_grouped_strided;
    const float fa = float(alpha), fb = float(beta);
    check_cublas(cublasGemmStridedBatchedEx(
                     handle(), tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                     as_int(q0.n, "n"), as_int(q0.m, "m"), as_int(q0.k, "k"),
                     f64 ? static_cast<const void*>(&alpha) : &fa, q0.b, ty_ab,
                     as_int(q0.ldb, "ldb"), sb, q0.a, ty_ab, as_int(q0.lda, "lda"), sa,
                     f64 ? static_cast<const void*>(&beta) : &fb, q0.c, ty, as_int(q0.ldc, "ldc"),
                     sc, as_int(int64_t(G), "groups"), compute, CUBLAS_GEMM_DEFAULT),
                 "cublasGemmStridedBatchedEx");
    return;
  }
  const std::vector<cublasOperation_t> op_a(G, ta ? CUBLAS_OP_T : CUBLAS_OP_N),
      op_b(G, tb ? CUBLAS_OP_T : CUBLAS_OP_N);
  std::vector<int> m(G), n(G), k(G), lda(G), ldb(G), ldc(G), size(G, 1);
  std::vector<int64_t> ptr(3 * G);
  for (size_t g = 0; g < G; ++g) {
    const GroupProduct& q = ps[g];
    m[g] = as_int(q.m, "m");
    n[g] = as_int(q.n, "n");
    k[g] = as_int(q.k, "k");
    lda[g] = as_int(q.lda, "lda");
    ldb[g] = as_int(q.ldb, "ldb");
    ldc[g] = as_int(q.ldc, "ldc");
    ptr[g] = reinterpret_cast<int64_t>(q.a);
    ptr[G + g] = reinterpret_cast<int64_t>(q.b);
    ptr[2 * G + g] = reinterpret_cast<int64_t>(q.c);
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
    check_cublas(
        cublasGemmEx(handle(), op_b[g], op_a[g], n[g], m[g], k[g],
                     f64 ? static_cast<const void*>(&da[g]) : &fa[g], ps[g].b, ty_ab, ldb[g],
                     ps[g].a, ty_ab, lda[g], f64 ? static_cast<const void*>(&db[g]) : &fb[g],
                     ps[g].c, ty, ldc[g], compute, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx");
}

}  // namespace

void gemm_grouped(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c,
                  const std::vector<GemmGroup>& groups, double alpha, double beta) {
  if (groups.empty()) return;
  const size_t es = dtype_size(c.dtype()), es_ab = dtype_size(a.dtype());
  const auto* pa = static_cast<const char*>(a.raw());
  const auto* pb = static_cast<const char*>(b.raw());
  auto* pc = static_cast<char*>(c.raw());
  std::vector<GroupProduct> ps;
  for (const GemmGroup& q : groups)
    ps.push_back({pa + size_t(q.a_off) * es_ab, pb + size_t(q.b_off) * es_ab,
                  pc + size_t(q.c_off) * es, q.m, q.n, q.k, q.lda > 0 ? q.lda : (ta ? q.m : q.k),
                  q.ldb > 0 ? q.ldb : (tb ? q.k : q.n), q.ldc > 0 ? q.ldc : q.n});
  grouped_call(ps, ta, tb, a.dtype(), c.dtype(), alpha, beta);
}

void gemm_multi(const Tensor& a_, bool ta, const std::vector<Tensor>& b_, bool tb,
                std::vector<Tensor>& c, GemmOptions opt) {
  const DType ab = opt.round_bf16 ? DType::bf16 : a_.dtype();
  const Tensor a = ops::as_dtype(a_, ab);
  std::vector<Tensor> b;
  std::vector<GroupProduct> ps;
  // A row stride is only read between rows: with one row, the row length.
  auto ld = [](const Tensor& t) { return t.size(0) > 1 ? t.stride(0) : t.size(1); };
  for (size_t i = 0; i < b_.size(); ++i) {
    b.push_back(ops::as_dtype(b_[i], ab));
    const int64_t m = c[i].size(0), n = c[i].size(1), k = ta ? a.size(0) : a.size(1);
    ps.push_back({a.raw(), b.back().raw(), c[i].raw(), m, n, k, ld(a), ld(b.back()), ld(c[i])});
  }
  grouped_call(ps, ta, tb, ab, c.front().dtype(), 1.0, 0.0);
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
