// CPU KDA chunked op (kda_chunk, f32, C = 64): forward and forward+backward at T = 4096, H = 4,
// K = V = 128, one sequence, lower-bound gate values, l2-normalised q/k. Counter: tokens/s.
#include <benchmark/benchmark.h>

#include "core/rng.h"
#include "ops/kda.h"

namespace {

using namespace hlm;

struct Inputs {
  ops::KdaArgs a;
  Tensor d_o, dht;
};

Inputs make(int64_t T, int64_t H, int64_t K, int64_t V) {
  Rng rng(42);
  Inputs in;
  in.a.q = randn({T, H, K}, DType::f32, rng);
  in.a.k = randn({T, H, K}, DType::f32, rng);
  in.a.use_qk_l2norm = true;
  in.a.v = randn({T, H, V}, DType::f32, rng);
  in.a.g = rand_uniform({T, H, K}, DType::f32, rng, -5, -0.01);
  in.a.beta = rand_uniform({T, H}, DType::f32, rng, 0.05, 0.95);
  in.a.seqs = SeqLayout::single(T);
  in.d_o = randn({T, H, V}, DType::f32, rng);
  in.dht = randn({1, H, K, V}, DType::f32, rng);
  return in;
}

void BM_KdaChunkForward(benchmark::State& st) {
  const int64_t T = st.range(0);
  Inputs in = make(T, 4, 128, 128);
  for (auto _ : st) {
    auto o = ops::kda_chunk(in.a);
    benchmark::DoNotOptimize(o.o.raw());
  }
  st.counters["tokens/s"] =
      benchmark::Counter(double(T), benchmark::Counter::kIsIterationInvariantRate);
}

void BM_KdaChunkForwardBackward(benchmark::State& st) {
  const int64_t T = st.range(0);
  Inputs in = make(T, 4, 128, 128);
  for (auto _ : st) {
    auto o = ops::kda_chunk(in.a);
    auto g = ops::kda_chunk_backward(in.a, in.d_o, in.dht);
    benchmark::DoNotOptimize(o.o.raw());
    benchmark::DoNotOptimize(g.dq.raw());
  }
  st.counters["tokens/s"] =
      benchmark::Counter(double(T), benchmark::Counter::kIsIterationInvariantRate);
}

BENCHMARK(BM_KdaChunkForward)->Arg(4096)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_KdaChunkForwardBackward)->Arg(4096)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
