// The front door of GEMM (ops/gemm.h): the backend choice, argument checks, and the switch to the
// CPU reference (ops/cpu/gemm.cpp) or cuBLAS (ops/cuda/gemm_cublas.cu).
#include "ops/gemm.h"

#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <tuple>

#include "ops/cpu/gemm.h"
#include "ops/cuda/gemm.cuh"
#include "ops/dispatch.h"
#include "ops/op_checks.h"
#include "ops/tensor_ops.h"

namespace hlm::ops {

namespace {

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
  switch (a.device()) {
    case Device::cpu:
      cpu::gemm(a, trans_a, b, trans_b, c, m, n, k, alpha, beta, opt, gemm_backend());
      break;
    case Device::cuda:
      HLM_CUDA_PATH(op, cuda::gemm(a, trans_a, b, trans_b, c, m, n, k, alpha, beta, opt));
      break;
  }
}

Tensor matmul(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, GemmOptions opt) {
  HLM_CHECK(a.defined() && a.dim() == 2, "matmul: A must be a 2-D tensor, got {}", a.describe());
  HLM_CHECK(b.defined() && b.dim() == 2, "matmul: B must be a 2-D tensor, got {}", b.describe());
  const int64_t m = trans_a ? a.size(1) : a.size(0);
  const int64_t n = trans_b ? b.size(0) : b.size(1);
  Tensor c = detail::new_output({m, n}, a.dtype(), a.device());
  gemm(a, trans_a, b, trans_b, c, 1.0, 0.0, opt);
  return c;
}

GemmGroupedCounts gemm_grouped_counts() {
#ifdef HLM_HAVE_CUDA
  return cuda::gemm_grouped_counts();
#else
  return {};  // no CUDA calls in a build without CUDA
#endif
}

namespace {

// The [rows, cols] block of contiguous t at element off, rows ld apart (0: cols).
Tensor block(const Tensor& t, int64_t off, int64_t rows, int64_t cols, int64_t ld = 0) {
  return t.as_strided({rows, cols}, {ld > 0 ? ld : cols, 1}, off);
}

}  // namespace

void gemm_multi(const Tensor& a, bool trans_a, const std::vector<Tensor>& b, bool trans_b,
                std::vector<Tensor>& c, GemmOptions opt) {
  constexpr const char* op = "gemm_multi";
  HLM_CHECK(!b.empty() && b.size() == c.size(), "{}: {} B operands for {} outputs", op, b.size(),
            c.size());
  HLM_CHECK(a.defined() && a.dim() == 2, "{}: A must be 2-D, got {}", op,
            a.defined() ? a.describe() : "undefined");
  bool direct = a.device() == Device::cuda && a.stride(1) == 1;
  for (size_t i = 0; i < b.size(); ++i) {
    HLM_CHECK(b[i].defined() && c[i].defined() && b[i].dim() == 2 && c[i].dim() == 2,
              "{}: product {} needs 2-D B and C", op, i);
    const int64_t m = trans_a ? a.size(1) : a.size(0), k = trans_a ? a.size(0) : a.size(1);
    const int64_t kb = trans_b ? b[i].size(1) : b[i].size(0);
    const int64_t n = trans_b ? b[i].size(0) : b[i].size(1);
    HLM_CHECK(k == kb && c[i].size(0) == m && c[i].size(1) == n,
              "{}: product {}: op(A) [{}, {}], op(B) [{}, {}], C {}", op, i, m, k, kb, n,
              c[i].describe());
    direct = direct && m >= 1 && n >= 1 && k >= 1 && b[i].device() == a.device() &&
             c[i].device() == a.device() && b[i].stride(1) == 1 && c[i].stride(1) == 1 &&
             c[i].dtype() == c[0].dtype() &&
             (opt.round_bf16 ? c[i].dtype() == DType::f32 || c[i].dtype() == DType::bf16
                             : c[i].dtype() == a.dtype() && b[i].dtype() == a.dtype());
  }
  if (!direct) {  // the CPU, or what one grouped call does not take: one gemm each
    for (size_t i = 0; i < b.size(); ++i) gemm(a, trans_a, b[i], trans_b, c[i], 1.0, 0.0, opt);
    return;
  }
  HLM_CUDA_PATH(op, cuda::gemm_multi(a, trans_a, b, trans_b, c, opt));
}

void gemm_grouped(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                  const std::vector<GemmGroup>& groups, double alpha, double beta,
                  GemmOptions opt) {
  constexpr const char* op = "gemm_grouped";
  for (auto [t, name] : {std::pair<const Tensor*, const char*>{&a, "A"}, {&b, "B"}, {&c, "C"}}) {
    HLM_CHECK(t->defined() && t->is_contiguous(), "{}: {} must be a contiguous tensor, got {}", op,
              name, t->defined() ? t->describe() : "undefined");
    HLM_CHECK(t->device() == a.device(), "{}: {} must be on the device of A ({}), got {}", op, name,
              a.describe(), t->describe());
  }
  if (opt.round_bf16) {
    HLM_CHECK(c.dtype() == DType::f32, "{} (round_bf16): C must be f32, got {}", op, c.describe());
    for (auto [t, name] : {std::pair<const Tensor*, const char*>{&a, "A"}, {&b, "B"}})
      HLM_CHECK(t->dtype() == DType::f32 || t->dtype() == DType::bf16,
                "{} (round_bf16): {} must be f32 or bf16, got {}", op, name, t->describe());
  } else {
    HLM_CHECK(c.dtype() == DType::f32 || c.dtype() == DType::f64,
              "{}: C must be f32 or f64, got {}", op, c.describe());
    detail::require_same_dtype(a, c, op, "A", "C");
    detail::require_same_dtype(b, c, op, "B", "C");
  }
  std::vector<GemmGroup> run;  // the groups with k >= 1
  for (size_t g = 0; g < groups.size(); ++g) {
    const GemmGroup& q = groups[g];
    HLM_CHECK(q.m >= 1 && q.n >= 1 && q.k >= 0 && q.m < INT_MAX && q.n < INT_MAX && q.k < INT_MAX,
              "{}: group {} has [m, n, k] = [{}, {}, {}] (m, n >= 1, k >= 0, each < 2^31)", op, g,
              q.m, q.n, q.k);
    // Each block as rows x cols, rows ld apart.
    const int64_t ar = trans_a ? q.k : q.m, ac = trans_a ? q.m : q.k;
    const int64_t br = trans_b ? q.n : q.k, bc = trans_b ? q.k : q.n;
    for (auto [off, rows, cols, ld, t, name] :
         {std::tuple<int64_t, int64_t, int64_t, int64_t, const Tensor*, const char*>{
              q.a_off, ar, ac, q.lda, &a, "A"},
          {q.b_off, br, bc, q.ldb, &b, "B"},
          {q.c_off, q.m, q.n, q.ldc, &c, "C"}}) {
      HLM_CHECK(ld == 0 || ld >= cols, "{}: group {}'s {} rows are {} apart, shorter than {}", op,
                g, name, ld, cols);
      const int64_t span = rows == 0 || cols == 0 ? 0 : (rows - 1) * (ld > 0 ? ld : cols) + cols;
      HLM_CHECK(off >= 0 && off + span <= t->numel(),
                "{}: group {}'s block of {} ({} x {} from {}, rows {} apart) is outside {}", op, g,
                name, rows, cols, off, ld > 0 ? ld : cols, t->describe());
    }
    if (q.k == 0) {
      Tensor cg = block(c, q.c_off, q.m, q.n, q.ldc);
      scale_(cg, beta);
    } else {
      run.push_back(q);
    }
  }
  if (run.empty()) return;
  switch (a.device()) {
    case Device::cpu:
      for (const GemmGroup& q : run) {
        Tensor cg = block(c, q.c_off, q.m, q.n, q.ldc);
        gemm(trans_a ? block(a, q.a_off, q.k, q.m, q.lda) : block(a, q.a_off, q.m, q.k, q.lda),
             trans_a,
             trans_b ? block(b, q.b_off, q.n, q.k, q.ldb) : block(b, q.b_off, q.k, q.n, q.ldb),
             trans_b, cg, alpha, beta, opt);
      }
      break;
    case Device::cuda:
      if (opt.round_bf16) {
        const Tensor a16 = as_dtype(a, DType::bf16), b16 = as_dtype(b, DType::bf16);
        HLM_CUDA_PATH(op, cuda::gemm_grouped(a16, trans_a, b16, trans_b, c, run, alpha, beta));
      } else {
        HLM_CUDA_PATH(op, cuda::gemm_grouped(a, trans_a, b, trans_b, c, run, alpha, beta));
      }
      break;
  }
}

}  // namespace hlm::ops
