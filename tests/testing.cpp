#include "testing.h"

#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <thread>

#include "ops/dispatch.h"

namespace hlm::testing {

uint64_t test_seed() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "none";
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return h;
}

static double dtype_eps(DType dt) {
  switch (dt) {
    case DType::f64:
      return 0x1p-52;
    case DType::f32:
      return 0x1p-23;
    case DType::bf16:
      return 0x1p-7;
    case DType::f16:
      return 0x1p-10;
    case DType::e4m3:
      return 0x1p-3;
    case DType::e5m2:
      return 0x1p-2;
    default:
      return 1.0;
  }
}

ErrorStats compare(const Tensor& out, const Tensor& ref) {
  HLM_CHECK(out.shape() == ref.shape(), "compare: shapes {} and {}", shape_str(out.shape()),
            shape_str(ref.shape()));
  const auto o = out.to_f64_vector(), r = ref.to_f64_vector();
  ErrorStats s;
  double num = 0, den = 0, scale = 0;
  for (double v : r) scale = std::max(scale, std::isfinite(v) ? std::fabs(v) : 0.0);
  const double eps = dtype_eps(out.dtype());
  for (size_t i = 0; i < o.size(); ++i) {
    const bool fo = std::isfinite(o[i]), fr = std::isfinite(r[i]);
    if (fo != fr) {
      ++s.nan_mismatch;
      if (s.worst < 0 || std::isfinite(s.max_abs)) {
        s.worst = int64_t(i), s.worst_out = o[i], s.worst_ref = r[i];
        s.max_abs = std::numeric_limits<double>::infinity();
      }
      continue;
    }
    if (!fo) continue;
    const double d = std::fabs(o[i] - r[i]);
    num += d * d;
    den += r[i] * r[i];
    const double ulp = d / (eps * std::max(std::fabs(r[i]), 1e-3 * scale + 1e-300));
    s.max_ulp = std::max(s.max_ulp, ulp);
    if (std::isfinite(s.max_abs) && (s.worst < 0 || d > s.max_abs)) {
      s.max_abs = d, s.worst = int64_t(i), s.worst_out = o[i], s.worst_ref = r[i];
    }
  }
  s.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return s;
}

std::string ErrorStats::report(const Tensor& t) const {
  std::string idx = "[";
  int64_t rem = worst;
  std::vector<int64_t> mi(size_t(t.dim()));
  for (int64_t d = t.dim() - 1; d >= 0 && rem >= 0; --d) {
    mi[size_t(d)] = rem % std::max<int64_t>(t.size(d), 1);
    rem /= std::max<int64_t>(t.size(d), 1);
  }
  for (size_t d = 0; d < mi.size(); ++d) idx += (d ? ", " : "") + std::to_string(mi[d]);
  idx += "]";
  return fmt::format(
      "rel_l2 {:.3e}, max_abs {:.3e}, max {:.1f} eps; worst at {} (flat {}): got {:.9g}, "
      "expected {:.9g}; NaN/Inf mismatches {}",
      rel_l2, max_abs, max_ulp, idx, worst, worst_out, worst_ref, nan_mismatch);
}

Tolerance tolerance_for(DType dt) {
  switch (dt) {
    case DType::f64:
      return {1e-12, 1e-10};
    case DType::f32:
      return {1e-5, 1e-4};
    case DType::bf16:
      return {3e-3, 3e-2};
    case DType::f16:
      return {1e-3, 1e-2};
    default:
      return {1e-1, 1.0};
  }
}

::testing::AssertionResult close(const Tensor& out, const Tensor& ref, Tolerance tol) {
  if (out.shape() != ref.shape())
    return ::testing::AssertionFailure()
           << "shape " << shape_str(out.shape()) << " vs " << shape_str(ref.shape());
  const ErrorStats s = compare(out, ref);
  if (s.nan_mismatch == 0 && s.rel_l2 <= tol.rel_l2 && s.max_abs <= tol.max_abs)
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << s.report(out) << " (tolerance rel_l2 " << tol.rel_l2
                                       << ", max_abs " << tol.max_abs << ")";
}

::testing::AssertionResult bit_equal(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype())
    return ::testing::AssertionFailure() << a.describe() << " vs " << b.describe();
  Tensor ca = a.contiguous().to(Device::cpu), cb = b.contiguous().to(Device::cpu);
  const auto* pa = static_cast<const unsigned char*>(ca.raw());
  const auto* pb = static_cast<const unsigned char*>(cb.raw());
  const size_t es = ca.element_size();
  for (int64_t i = 0; i < ca.numel(); ++i) {
    if (std::memcmp(pa + i * es, pb + i * es, es) != 0) {
      const auto va = ca.to_f64_vector(), vb = cb.to_f64_vector();
      return ::testing::AssertionFailure()
             << "first difference at flat index " << i << ": " << fmt::format("{:.17g}", va[i])
             << " vs " << fmt::format("{:.17g}", vb[i]);
    }
  }
  return ::testing::AssertionSuccess();
}

double dot(const Tensor& a, const Tensor& b) {
  const auto va = a.to_f64_vector(), vb = b.to_f64_vector();
  HLM_CHECK(va.size() == vb.size(), "dot: sizes {} and {}", va.size(), vb.size());
  double s = 0;
  for (size_t i = 0; i < va.size(); ++i) s += va[i] * vb[i];
  return s;
}

::testing::AssertionResult grad_check(const std::function<double()>& loss, Tensor& x,
                                      const Tensor& grad, double h, double tol, int64_t max_elems) {
  if (x.dtype() != DType::f64 || !x.is_contiguous())
    return ::testing::AssertionFailure() << "grad_check needs a contiguous f64 tensor";
  if (grad.shape() != x.shape())
    return ::testing::AssertionFailure()
           << "grad shape " << shape_str(grad.shape()) << " vs x " << shape_str(x.shape());
  const auto g = grad.to_f64_vector();
  double* p = x.data<double>();
  const int64_t n = x.numel();
  const int64_t step = std::max<int64_t>(1, n / std::max<int64_t>(max_elems, 1));
  double worst = 0;
  int64_t worst_i = -1;
  double worst_fd = 0;
  for (int64_t i = (n > max_elems ? step / 2 : 0); i < n; i += step) {
    const double orig = p[i];
    p[i] = orig + h;
    const double lp = loss();
    p[i] = orig - h;
    const double lm = loss();
    p[i] = orig;
    const double fd = (lp - lm) / (2 * h);
    const double err = std::fabs(fd - g[size_t(i)]) / std::max(1.0, std::fabs(fd));
    if (err > worst) worst = err, worst_i = i, worst_fd = fd;
  }
  if (worst <= tol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "gradient mismatch at flat index " << worst_i << ": analytic "
         << fmt::format("{:.12g}", g[size_t(worst_i)]) << ", finite difference "
         << fmt::format("{:.12g}", worst_fd) << " (error " << worst << " > " << tol << ")";
}

Tensor randn_unit_rows(const Shape& shape, DType dt, Rng& rng) {
  Tensor x = randn(shape, DType::f64, rng);
  double* d = x.data<double>();
  const int64_t D = shape.back();
  for (int64_t i = 0; i < x.numel() / D; ++i) {
    double n = 0;
    for (int64_t c = 0; c < D; ++c) n += d[i * D + c] * d[i * D + c];
    for (int64_t c = 0; c < D; ++c) d[i * D + c] /= std::sqrt(n);
  }
  return x.to(dt);
}

PoisonOutputs::PoisonOutputs() {
  ops::set_poison_outputs(true);
}
PoisonOutputs::~PoisonOutputs() {
  ops::set_poison_outputs(false);
}

Tensor round_bf16(const Tensor& t) {
  return t.to(DType::bf16).to(DType::f32);
}

Tensor gpu(const Tensor& t) {
  return t.defined() ? t.to(Device::cuda) : Tensor();
}
Tensor cpu(const Tensor& t) {
  return t.defined() ? t.to(Device::cpu) : Tensor();
}

}  // namespace hlm::testing

namespace hlm::testing {

void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no hlm::Error (expected one mentioning '" << needle << "')";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "'" << e.what() << "' does not mention '" << needle << "'";
  }
}

Tensor cu_of(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> cu{0};
  for (int64_t l : lengths) cu.push_back(cu.back() + l);
  return Tensor::from_vector<int64_t>({int64_t(cu.size())}, cu);
}

SeqLayout seqs_of(const std::vector<int64_t>& lengths) {
  return SeqLayout::from_lengths(lengths);
}

std::vector<AuxPiece> aux_pieces(const SeqLayout& seqs, const Tensor& topk_idx, int64_t E,
                                 const std::vector<int64_t>& bounds) {
  const std::vector<int64_t> idx = topk_idx.to_i64_vector();
  const int64_t K = topk_idx.size(1);
  const std::vector<int64_t>& cu = seqs.offsets();
  std::vector<AuxPiece> out;
  for (size_t p = 0; p + 1 < bounds.size(); ++p) {
    AuxPiece a;
    a.begin = bounds[p];
    a.end = bounds[p + 1];
    std::vector<int64_t> lengths;
    for (size_t q = 0; q + 1 < cu.size(); ++q) {
      const int64_t lo = std::max(cu[q], a.begin), hi = std::min(cu[q + 1], a.end);
      if (lo >= hi) continue;  // not in this piece (empty sequences are nowhere)
      lengths.push_back(hi - lo);
      a.whole.lengths.push_back(cu[q + 1] - cu[q]);
      std::vector<int64_t> c(size_t(E), 0);
      for (int64_t t = cu[q]; t < cu[q + 1]; ++t)
        for (int64_t k = 0; k < K; ++k) ++c[size_t(idx[size_t(t * K + k)])];
      a.whole.counts.insert(a.whole.counts.end(), c.begin(), c.end());
    }
    a.seqs = SeqLayout::from_lengths(lengths);
    out.push_back(std::move(a));
  }
  return out;
}

int64_t total(const std::vector<int64_t>& lengths) {
  int64_t t = 0;
  for (int64_t l : lengths) t += l;
  return t;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::pair<int, std::string> run_command(const std::string& command) {
  std::string out;
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (!p) return {-1, "popen failed"};
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

std::string dist_check() {
  if (const char* p = std::getenv("HLM_DIST_CHECK")) return p;
#ifdef HLM_DIST_CHECK
  return HLM_DIST_CHECK;
#else
  return "hlm_dist_check";
#endif
}

std::string expect_dist_check(int n, const std::string& args) {
  const auto [rc, out] = run_command(mpirun_prefix(n) + dist_check() + " " + args);
  EXPECT_EQ(rc, 0) << out;
  int passed = 0;
  for (size_t at = 0; (at = out.find("checks passed", at)) != std::string::npos; ++at) ++passed;
  EXPECT_EQ(passed, n) << out;
  EXPECT_EQ(out.find("FAILED"), std::string::npos) << out;
  return out;
}

bool mpirun_available() {
  return run_command("command -v mpirun").first == 0;
}

std::string mpirun_prefix(int n) {
  const int threads = std::max(1, int(std::thread::hardware_concurrency()) / std::max(1, n));
  return "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader "
         "ASAN_OPTIONS=detect_leaks=0 OMP_NUM_THREADS=" +
         std::to_string(threads) + " timeout 300 mpirun --oversubscribe -np " + std::to_string(n) +
         " ";
}

const char* const kSmallModelJson = R"({
  "model_type": "glm5_next_text", "vocab_size": 24, "hidden_size": 16,
  "num_hidden_layers": 2, "layer_pattern": "KD", "first_k_dense_replace": 1,
  "intermediate_size": 24, "initializer_range": 0.2,
  "linear_num_heads": 2, "linear_head_dim": 8, "linear_conv_kernel_dim": 4,
  "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 8, "kv_lora_rank": 8,
  "qk_nope_head_dim": 4, "qk_rope_head_dim": 0, "v_head_dim": 4,
  "index_n_heads": 2, "index_head_dim": 8, "index_topk": 4, "index_kpool": 2,
  "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
  "moe_intermediate_size": 8, "mhc": true, "hc_mult": 4,
  "num_nextn_predict_layers": 1, "gemm_precision": "native"
})";

}  // namespace hlm::testing
