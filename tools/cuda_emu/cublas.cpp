// The subset of cuBLAS that hybridlm calls (ops/cuda/gemm_cublas.cu), for the CPU emulation
// build: handle management, cublasGemmEx with f32 / f64 / bf16 / f16 matrices,
// cublasGemmStridedBatchedEx and cublasGemmGroupedBatchedEx (each of their problems one
// cublasGemmEx). The same C declarations as cublas_api.h, so this file replaces libcublas.
//
// cublasGemmEx: column-major C = alpha op(A) op(B) + beta C. The sum over k is formed in FP64 and
// rounded once to the compute type (FP32 for CUBLAS_COMPUTE_32F*, FP64 for CUBLAS_COMPUTE_64F*),
// then alpha acc + beta C in the compute type, rounded to C's type; C is not read when beta is 0
// (as cuBLAS: a NaN there does not propagate). cuBLAS's own summation order is not documented,
// so results agree with it to the rounding of the compute type, not to the bit.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cstdint>
#include <vector>

namespace {

struct EmuHandle {
  cudaStream_t stream = nullptr;
};

double load(const void* p, cudaDataType t, int64_t i) {
  switch (t) {
    case CUDA_R_32F:
      return static_cast<const float*>(p)[i];
    case CUDA_R_64F:
      return static_cast<const double*>(p)[i];
    case CUDA_R_16BF:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case CUDA_R_16F:
      return __half2float(static_cast<const __half*>(p)[i]);
    default:
      return 0;
  }
}

void store(void* p, cudaDataType t, int64_t i, double v) {
  switch (t) {
    case CUDA_R_32F:
      static_cast<float*>(p)[i] = float(v);
      return;
    case CUDA_R_64F:
      static_cast<double*>(p)[i] = v;
      return;
    case CUDA_R_16BF:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(float(v));
      return;
    case CUDA_R_16F:
      static_cast<__half*>(p)[i] = __float2half_rn(float(v));
      return;
    default:
      return;
  }
}

size_t load_size(cudaDataType t) {
  switch (t) {
    case CUDA_R_64F:
      return 8;
    case CUDA_R_32F:
      return 4;
    default:
      return 2;  // bf16, f16
  }
}

bool supported(cudaDataType t) {
  return t == CUDA_R_32F || t == CUDA_R_64F || t == CUDA_R_16BF || t == CUDA_R_16F;
}

std::atomic<uint64_t> g_blas_calls{0};
thread_local bool t_in_grouped = false;

// While alive, the cublasGemmEx calls of this thread belong to one batched or grouped call.
struct InBatch {
  InBatch() { t_in_grouped = true; }
  ~InBatch() { t_in_grouped = false; }
  InBatch(const InBatch&) = delete;
  InBatch& operator=(const InBatch&) = delete;
};

}  // namespace

namespace hlm::emu {
uint64_t blas_calls() {
  return g_blas_calls.load();
}
}  // namespace hlm::emu

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  *handle = reinterpret_cast<cublasHandle_t>(new EmuHandle);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  delete reinterpret_cast<EmuHandle*>(handle);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  reinterpret_cast<EmuHandle*>(handle)->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t mode) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  return mode == CUBLAS_POINTER_MODE_HOST ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_SUPPORTED;
}

cublasStatus_t cublasSetAtomicsMode(cublasHandle_t handle, cublasAtomicsMode_t) {
  return handle ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t) {
  return handle ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}

const char* cublasGetStatusString(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    default:
      return "CUBLAS_STATUS (CPU emulation)";
  }
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void* alpha,
                            const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C,
                            cudaDataType Ctype, int ldc, cublasComputeType_t computeType,
                            cublasGemmAlgo_t) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!t_in_grouped) ++g_blas_calls;
  if (m < 0 || n < 0 || k < 0) return CUBLAS_STATUS_INVALID_VALUE;
  if (!supported(Atype) || !supported(Btype) || !supported(Ctype))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  const bool ta = transa != CUBLAS_OP_N, tb = transb != CUBLAS_OP_N;
  if (lda < (ta ? k : m) || ldb < (tb ? n : k) || ldc < m) return CUBLAS_STATUS_INVALID_VALUE;
  const bool f64 = computeType == CUBLAS_COMPUTE_64F || computeType == CUBLAS_COMPUTE_64F_PEDANTIC;
  const double al = f64 ? *static_cast<const double*>(alpha) : *static_cast<const float*>(alpha);
  const double be = f64 ? *static_cast<const double*>(beta) : *static_cast<const float*>(beta);
  // op(A) as rows of k (row i: op(A)[i][0..k)), op(B) as columns of k, widened to FP64 once.
  std::vector<double> a(size_t(m) * size_t(k)), b(size_t(n) * size_t(k));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t l = 0; l < k; ++l)
      a[size_t(i * k + l)] = load(A, Atype, ta ? l + i * lda : i + l * lda);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t l = 0; l < k; ++l)
      b[size_t(j * k + l)] = load(B, Btype, tb ? j + l * ldb : l + j * ldb);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < m; ++i) {
      const double* ar = a.data() + i * k;
      const double* bc = b.data() + j * k;
      double s = 0;
      for (int64_t l = 0; l < k; ++l) s += ar[l] * bc[l];
      const int64_t ci = i + j * int64_t(ldc);
      if (f64) {
        store(C, Ctype, ci, be == 0 ? al * s : al * s + be * load(C, Ctype, ci));
      } else {
        const float acc = float(s), fa = float(al), fb = float(be);
        store(C, Ctype, ci, be == 0 ? fa * acc : fa * acc + fb * float(load(C, Ctype, ci)));
      }
    }
  return CUBLAS_STATUS_SUCCESS;
}

// Problem i of the batch at A + i strideA, B + i strideB, C + i strideC (elements), in order.
cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa,
                                          cublasOperation_t transb, int m, int n, int k,
                                          const void* alpha, const void* A, cudaDataType Atype,
                                          int lda, long long int strideA, const void* B,
                                          cudaDataType Btype, int ldb, long long int strideB,
                                          const void* beta, void* C, cudaDataType Ctype, int ldc,
                                          long long int strideC, int batchCount,
                                          cublasComputeType_t computeType, cublasGemmAlgo_t algo) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (batchCount < 0) return CUBLAS_STATUS_INVALID_VALUE;
  if (!supported(Atype) || !supported(Btype) || !supported(Ctype))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  ++g_blas_calls;
  const InBatch in_batch;  // the problems below are this call's, not calls of their own
  const auto at = [](const void* p, cudaDataType t, long long off) {
    return static_cast<const char*>(p) + off * load_size(t);
  };
  for (int i = 0; i < batchCount; ++i) {
    const cublasStatus_t st =
        cublasGemmEx(handle, transa, transb, m, n, k, alpha, at(A, Atype, i * strideA), Atype, lda,
                     at(B, Btype, i * strideB), Btype, ldb, beta,
                     const_cast<char*>(at(C, Ctype, i * strideC)), Ctype, ldc, computeType, algo);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
  }
  return CUBLAS_STATUS_SUCCESS;
}

// The groups in order, each problem of a group in order; alpha_array / beta_array hold one scalar
// of the compute type per group (host), the matrix pointer arrays one pointer per problem.
cublasStatus_t cublasGemmGroupedBatchedEx(
    cublasHandle_t handle, const cublasOperation_t transa_array[],
    const cublasOperation_t transb_array[], const int m_array[], const int n_array[],
    const int k_array[], const void* alpha_array, const void* const Aarray[], cudaDataType_t Atype,
    const int lda_array[], const void* const Barray[], cudaDataType_t Btype, const int ldb_array[],
    const void* beta_array, void* const Carray[], cudaDataType_t Ctype, const int ldc_array[],
    int group_count, const int group_size[], cublasComputeType_t computeType) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (group_count < 0) return CUBLAS_STATUS_INVALID_VALUE;
  ++g_blas_calls;
  const InBatch in_batch;  // the problems below are this call's, not calls of their own
  const bool f64 = computeType == CUBLAS_COMPUTE_64F || computeType == CUBLAS_COMPUTE_64F_PEDANTIC;
  const size_t scalar = f64 ? sizeof(double) : sizeof(float);
  int64_t p = 0;
  for (int g = 0; g < group_count; ++g) {
    if (group_size[g] < 0) return CUBLAS_STATUS_INVALID_VALUE;
    const void* al = static_cast<const char*>(alpha_array) + size_t(g) * scalar;
    const void* be = static_cast<const char*>(beta_array) + size_t(g) * scalar;
    for (int j = 0; j < group_size[g]; ++j, ++p) {
      const cublasStatus_t st =
          cublasGemmEx(handle, transa_array[g], transb_array[g], m_array[g], n_array[g], k_array[g],
                       al, Aarray[p], Atype, lda_array[g], Barray[p], Btype, ldb_array[g], be,
                       Carray[p], Ctype, ldc_array[g], computeType, CUBLAS_GEMM_DEFAULT);
      if (st != CUBLAS_STATUS_SUCCESS) return st;
    }
  }
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
