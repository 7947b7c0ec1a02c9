// KDA decode step on the GPU: one token for each of N sequences, H = HV = 64, K = V = 128, bf16
// inputs, FP32 state updated in place. Prints one table: ms (median of 50 timed steps after 10
// warm-ups, CUDA events), tokens/s, GB/s and the fraction of the 4.3 TB/s copy roofline. The bytes
// counted are the state read and written once plus the inputs and the output.
// The anchor, FLA's fused_recurrent_kda on the same shapes, is bench/kda_decode_fla.py.
#include <algorithm>
#include <cstdio>
#include <vector>

#include "core/rng.h"
#include "ops/kda_decode.h"

#ifdef HLM_HAVE_CUDA
#include <cuda_runtime.h>
#endif

int main() {
#ifndef HLM_HAVE_CUDA
  std::puts("bench_kda_decode_gpu: built without CUDA");
  return 0;
#else
  using namespace hlm;
  if (!cuda_available()) {
    std::puts("bench_kda_decode_gpu: no CUDA device present");
    return 0;
  }
  const int64_t H = 64, K = 128, V = 128;
  std::printf("%6s %4s %4s %4s %10s %12s %9s %9s\n", "N", "HV", "K", "V", "ms", "Mtok/s", "GB/s",
              "roofline");
  for (int64_t N : {1, 8, 32, 128, 512}) {
    Rng rng(1234 + uint64_t(N));
    ops::KdaDecodeArgs a;
    a.q = randn({N, H, K}, DType::bf16, rng).to(Device::cuda);
    a.k = randn({N, H, K}, DType::bf16, rng).to(Device::cuda);
    a.v = randn({N, H, V}, DType::bf16, rng).to(Device::cuda);
    a.g = rand_uniform({N, H, K}, DType::f32, rng, -5, -0.001).to(Device::cuda);
    a.beta = rand_uniform({N, H}, DType::f32, rng, 0.01, 0.99).to(Device::cuda);
    a.state = randn({N, H, K, V}, DType::f32, rng, 0.1).to(Device::cuda);
    a.use_qk_l2norm = true;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (int i = 0; i < 10; ++i) ops::kda_decode_step(a);
    std::vector<float> ms;
    for (int i = 0; i < 50; ++i) {
      cudaEventRecord(e0);
      ops::kda_decode_step(a);
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      float t = 0;
      cudaEventElapsedTime(&t, e0, e1);
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    const double t = ms[ms.size() / 2];
    const double bytes = double(N) * H * (2.0 * K * V * 4 + 2 * K * 2 + V * 2 + K * 4 + 4 + V * 4);
    const double gbs = bytes / (t * 1e-3) / 1e9;
    std::printf("%6ld %4ld %4ld %4ld %10.4f %12.3f %9.1f %8.1f%%\n", long(N), long(H), long(K),
                long(V), t, double(N) / (t * 1e-3) / 1e6, gbs, 100.0 * gbs / 4300.0);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
  }
  return 0;
#endif
}
