// The embedding and the cross-entropy on the GPU at GLM-5.3-Flash sizes (V = 154880, D = 4096).
// Prints one table: ms (median of 20 timed calls after 3 warm-ups, CUDA events around the op's
// front door, so the device check of the ids / targets and, for the cross-entropy forward, the
// copy of the row losses to the host are included), GB/s and the fraction of the 4.3 TB/s copy
// roofline. Bytes counted: cross-entropy forward reads the logits once, backward reads them and
// writes dlogits; embedding forward reads and writes T rows; embedding backward reads dy and reads
// and writes each touched row of dtable once.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <set>
#include <vector>

#include "core/rng.h"
#include "gpu_timing.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"

#ifdef HLM_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#ifdef HLM_HAVE_CUDA
namespace {

double median_ms(const std::function<void()>& f) {
  return hlm::bench::median_ms(f, 20, 3);
}

void row(const char* what, const char* dt, long t, long v, long d, double ms, double bytes) {
  const double gbs = bytes / (ms * 1e-3) / 1e9;
  std::printf("%-22s %-5s %6ld %7ld %5ld %9.3f %9.1f %8.1f%%\n", what, dt, t, v, d, ms, gbs,
              100.0 * gbs / 4300.0);
}

}  // namespace
#endif

int main() {
#ifndef HLM_HAVE_CUDA
  std::puts("bench_ce_embedding_gpu: built without CUDA");
  return 0;
#else
  using namespace hlm;
  if (!cuda_available()) {
    std::puts("bench_ce_embedding_gpu: no CUDA device present");
    return 0;
  }
  const int64_t V = 154880, D = 4096;
  std::printf("%-22s %-5s %6s %7s %5s %9s %9s %9s\n", "op", "dtype", "T", "V", "D", "ms", "GB/s",
              "roofline");
  for (DType dt : {DType::bf16, DType::f32})
    for (int64_t T : {4096, 16384}) {
      Rng rng(7 + uint64_t(T));
      // Random logits: one block of 256 rows drawn on the host, repeated down the tensor.
      Tensor logits = Tensor::empty({T, V}, dt, Device::cuda);
      const Tensor block = randn({256, V}, DType::f32, rng, 2.0).to(dt).to(Device::cuda);
      for (int64_t r = 0; r < T; r += 256) logits.slice(0, r, r + 256).copy_(block);
      std::vector<int64_t> tg(static_cast<size_t>(T));
      for (size_t i = 0; i < tg.size(); ++i) tg[i] = i % 8 == 7 ? -100 : int64_t(rng.below(V));
      const Tensor targets = Tensor::from_vector<int64_t>({T}, tg).to(Device::cuda);
      const double es = double(dtype_size(dt)), n = double(T) * double(V);
      ops::CrossEntropyResult r;
      const double f = median_ms([&] { r = ops::cross_entropy_forward(logits, targets); });
      row("cross_entropy fwd", dtype_name(dt), long(T), long(V), 0, f, n * es);
      const double b = median_ms([&] { (void)ops::cross_entropy_backward(logits, targets, r); });
      row("cross_entropy bwd", dtype_name(dt), long(T), long(V), 0, b, 2 * n * es);
    }
  for (int64_t T : {4096, 16384}) {
    Rng rng(11 + uint64_t(T));
    std::vector<int64_t> uni(static_cast<size_t>(T)), hot(static_cast<size_t>(T));
    for (size_t i = 0; i < uni.size(); ++i) {
      uni[i] = int64_t(rng.below(V));
      hot[i] = i % 2 == 0 ? 0 : uni[i];  // half of the tokens on one id (padding-like)
    }
    for (DType dt : {DType::bf16, DType::f32}) {
      const Tensor table = randn({V, D}, DType::f32, rng, 0.02).to(dt).to(Device::cuda);
      const Tensor ids = Tensor::from_vector<int64_t>({T}, uni).to(Device::cuda);
      const double ms = median_ms([&] { (void)ops::embedding_forward(table, ids); });
      row("embedding fwd", dtype_name(dt), long(T), long(V), long(D), ms,
          2.0 * double(T) * double(D) * double(dtype_size(dt)));
    }
    Tensor dtable = Tensor::zeros({V, D}, DType::f32, Device::cuda);
    const Tensor dy = randn({T, D}, DType::f32, rng).to(Device::cuda);
    for (int k = 0; k < 2; ++k) {
      const std::vector<int64_t>& v = k == 0 ? uni : hot;
      const Tensor ids = Tensor::from_vector<int64_t>({T}, v).to(Device::cuda);
      const double rows = double(std::set<int64_t>(v.begin(), v.end()).size());
      const double ms = median_ms([&] { ops::embedding_backward(dy, ids, dtable); });
      row(k == 0 ? "embedding bwd uniform" : "embedding bwd half hot", "f32", long(T), long(V),
          long(D), ms, (double(T) + 2 * rows) * double(D) * 4.0);
    }
  }
  return 0;
#endif
}
