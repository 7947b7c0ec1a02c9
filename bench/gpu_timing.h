// CUDA-event timing shared by the GPU benchmarks: each timed call sits between two events on the
// default stream, so it measures the device time of what the call queues plus the host time
// between the events (host checks and launches included).
#pragma once

#ifdef HLM_HAVE_CUDA
#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <vector>

namespace hlm::bench {

// Milliseconds of each of `reps` calls of f, after `warmup` calls that are not timed.
inline std::vector<double> event_times_ms(const std::function<void()>& f, int reps,
                                          int warmup = 1) {
  for (int i = 0; i < warmup; ++i) f();
  cudaDeviceSynchronize();
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(e0);
    f();
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float t = 0;
    cudaEventElapsedTime(&t, e0, e1);
    ms.push_back(double(t));
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return ms;
}

// The median of event_times_ms.
inline double median_ms(const std::function<void()>& f, int reps, int warmup = 1) {
  std::vector<double> ms = event_times_ms(f, reps, warmup);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace hlm::bench
#endif
