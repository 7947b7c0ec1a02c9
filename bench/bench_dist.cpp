// Timings of the parallel runs across processes (docs/parallel.md, "Measuring on several GPUs"),
// one process per GPU under `mpirun -np N` (bench/multi_gpu.sh runs them); each prints one line
// per measurement from rank 0, the time being the slowest rank's (the median over the repeats).
//
//   bench_dist comm DEVICE MiB...   the deterministic collectives of dist/comm.h over the world
//       (NCCL on cuda, one GPU per rank; MPI on cpu) on f32 tensors of each size: allreduce_sum,
//       reduce_scatter_sum, allgather (of the size's 1/N per rank) and alltoall. Bus bandwidth
//       as NCCL's tests define it: the size over the time times 2 (N-1)/N for the all-reduce and
//       (N-1)/N for the others, so it compares with the link's bandwidth whatever N.
//   bench_dist kda-cp CONFIG DEVICE T MODE [REPS]   one KDA layer of the model config CONFIG
//       (f32 parameters, the config's GEMM precision) forward and backward over one sequence of
//       T tokens split evenly over the N ranks, MODE chunkwise or headwise (N = 1: the plain
//       layer on the whole sequence): milliseconds and tokens/s of the step.
// Exit status 2 with a one-line message on bad arguments.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "core/rng.h"
#include "dist/comm.h"
#include "dist/context_parallel.h"
#include "dist/nccl_comm.h"
#include "layers/kda/kda_layer.h"
#include "model/config.h"
#include "model/hybrid_model.h"

namespace {

using hlm::Device;
using hlm::DType;
using hlm::Tensor;
using hlm::dist::Comm;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The device of a DEVICE argument; on cuda this rank takes GPU local_rank % count.
Device parse_device(const std::string& s) {
  HLM_CHECK(s == "cpu" || s == "cuda", "DEVICE must be cpu or cuda, got '{}'", s);
  if (s == "cpu") return Device::cpu;
  HLM_CHECK(hlm::cuda_device_count() > 0, "cuda: no CUDA device is present");
  hlm::cuda_select_device(hlm::dist::local_rank() % hlm::cuda_device_count());
  return Device::cuda;
}

// The median over `reps` runs of the slowest rank's time of f() (after one warm-up run), each
// run started together (a barrier) and ended with the device idle.
template <class F>
double time_op(Comm& w, Device dev, int reps, const F& f) {
  std::vector<double> runs;
  for (int i = -1; i < reps; ++i) {
    w.barrier();
    const double t0 = now_s();
    f();
    if (dev != Device::cpu) hlm::device_synchronize();
    const double mine = now_s() - t0;
    const Tensor all = w.allgather(Tensor::from_vector<double>({1}, {mine}));
    if (i >= 0) {
      const std::vector<double> v = all.to_f64_vector();
      runs.push_back(*std::max_element(v.begin(), v.end()));
    }
  }
  std::sort(runs.begin(), runs.end());
  return runs[runs.size() / 2];
}

int comm_bench(const std::string& device, const std::vector<std::string>& sizes) {
  const Device dev = parse_device(device);
  Comm& w = hlm::dist::world();
  const int N = w.size();
  std::unique_ptr<Comm> nccl;
  Comm* c = &w;
  if (dev != Device::cpu) {
    nccl = hlm::dist::nccl_comm(w);
    c = nccl.get();
  }
  if (w.rank() == 0)
    std::printf("comm: %d ranks, %s backend; bus bandwidth as NCCL's tests define it\n", N,
                c->backend());
  for (const std::string& s : sizes) {
    double mib = 0;
    try {
      mib = std::stod(s);
    } catch (...) {
      HLM_FAIL("comm: size '{}' is not a number of MiB", s);
    }
    HLM_CHECK(mib > 0 && mib <= 16384, "comm: size {} MiB must be in (0, 16384]", s);
    // f32 elements, a multiple of N.
    const int64_t n = std::max<int64_t>(N, int64_t(mib * 1048576.0 / 4) / N * N);
    const double bytes = double(n) * 4;
    Tensor t = Tensor::zeros({n}, DType::f32, c->memory());
    const Tensor part = Tensor::zeros({n / N}, DType::f32, c->memory());
    const Tensor blocks = t.view({int64_t(N), n / N});
    const int reps = mib >= 256 ? 5 : 11;
    struct Op {
      const char* name;
      double factor;  // bus bytes per byte of the size
      double s;
    };
    const double f = double(N - 1) / double(N);
    Op ops[] = {
        {"allreduce_sum", 2 * f, time_op(w, dev, reps, [&] { c->allreduce_sum(t); })},
        {"reduce_scatter_sum", f, time_op(w, dev, reps, [&] { (void)c->reduce_scatter_sum(t); })},
        {"allgather", f, time_op(w, dev, reps, [&] { (void)c->allgather(part); })},
        {"alltoall", f, time_op(w, dev, reps, [&] { (void)c->alltoall(blocks); })}};
    if (w.rank() == 0)
      for (const Op& o : ops)
        std::printf("comm: %-18s %10.2f MiB  %9.3f ms  algbw %8.2f GB/s  busbw %8.2f GB/s\n",
                    o.name, bytes / 1048576.0, o.s * 1e3, bytes / o.s / 1e9,
                    bytes * o.factor / o.s / 1e9);
  }
  return 0;
}

// A whole decimal number in [lo, hi], or hlm::Error naming `what`.
int64_t parse_count(const std::string& s, const char* what, int64_t lo, int64_t hi) {
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(s, &used);
  } catch (...) {
    used = 0;
  }
  HLM_CHECK(used == s.size() && !s.empty() && v >= lo && v <= hi,
            "{} must be a whole number in [{}, {}], got '{}'", what, lo, hi, s);
  return v;
}

int kda_cp_bench(const std::string& config, const std::string& device, const std::string& tokens,
                 const std::string& mode_name, const std::string& reps_arg) {
  const Device dev = parse_device(device);
  HLM_CHECK(mode_name == "chunkwise" || mode_name == "headwise",
            "kda-cp: MODE must be chunkwise or headwise, got '{}'", mode_name);
  const int64_t T = parse_count(tokens, "kda-cp: T", 1, int64_t(1) << 24);
  const int reps = int(parse_count(reps_arg, "kda-cp: REPS", 1, 1000));
  Comm& w = hlm::dist::world();
  const int N = w.size(), R = w.rank();
  HLM_CHECK(T >= N, "kda-cp: T {} leaves a rank of the {} without a token", T, N);
  const hlm::ModelConfig mc = hlm::ModelConfig::load(config);
  const hlm::KdaConfig kc = hlm::kda_layer_config(mc);
  const hlm::KdaCpMode mode =
      mode_name == "headwise" ? hlm::KdaCpMode::headwise : hlm::KdaCpMode::chunkwise;
  HLM_CHECK(mode != hlm::KdaCpMode::headwise || kc.num_heads % N == 0,
            "kda-cp: headwise needs the {} heads to divide by the {} ranks", kc.num_heads, N);
  hlm::KdaLayer layer(kc, mc.precision, "kda", DType::f32);
  layer.init_weights(2026, mc.initializer_range);
  layer.to(dev);
  const hlm::SeqLayout seqs = hlm::SeqLayout::from_lengths({T});
  const hlm::dist::CpSlice slice(w, seqs, hlm::dist::CpSlice::even_bounds(T, N));
  const int64_t Tl = slice.tokens(R);
  hlm::Rng rng(7, uint64_t(R));
  Tensor x = Tensor::empty({Tl, kc.hidden_size}, DType::f32);
  Tensor dy = Tensor::empty({Tl, kc.hidden_size}, DType::f32);
  rng.fill_uniform(x, -1, 1);
  rng.fill_uniform(dy, -1, 1);
  x = x.to(dev);
  dy = dy.to(dev);
  const hlm::Context ctx{true, false};
  auto step = [&] {
    layer.zero_grad();
    hlm::KdaLayer::Saved s;
    if (N == 1) {
      (void)layer.forward(ctx, x, seqs, nullptr, &s);
    } else {
      (void)layer.forward(ctx, x, slice, &s, mode);
    }
    (void)layer.backward(ctx, dy, s);
  };
  const double sec = time_op(w, dev, reps, step);
  if (R == 0)
    std::printf(
        "kda-cp: %s, %d rank(s), T %lld (%lld per rank), %lld heads x %lld: forward + backward "
        "%.2f ms, %.0f tokens/s (%.0f per rank)\n",
        N == 1 ? "one process" : mode_name.c_str(), N, (long long)T, (long long)Tl,
        (long long)kc.num_heads, (long long)kc.head_k_dim, sec * 1e3, double(T) / sec,
        double(T) / sec / N);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::vector<std::string> a(argv + 1, argv + argc);
    if (a.size() >= 3 && a[0] == "comm")
      return comm_bench(a[1], std::vector<std::string>(a.begin() + 2, a.end()));
    if ((a.size() == 5 || a.size() == 6) && a[0] == "kda-cp")
      return kda_cp_bench(a[1], a[2], a[3], a[4], a.size() == 6 ? a[5] : "3");
    std::fprintf(stderr,
                 "usage: bench_dist comm DEVICE MiB... | bench_dist kda-cp CONFIG DEVICE T "
                 "chunkwise|headwise [REPS]\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_dist: %s\n", e.what());
    hlm::dist::end_job_on_error(2);
    return 2;
  }
}
