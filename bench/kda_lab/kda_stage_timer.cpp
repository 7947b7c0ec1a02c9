// kda_stage_timer: the time of each stage of the CUDA chunked KDA backward, by cudaEvents between
// the stage launchers (src/ops/cuda/kda_chunk/params.cuh) called in the order the library calls
// them (bwd_launch.cu): the recompute's intra and state kernels (unless the forward saved its
// intermediates), the reverse state pass, the contractions over V, the WY backward, the intra
// backward, the GVA / L2-norm / beta finish and the gate parameter sums. Prints the median of
// --reps runs after a warm-up, and checks that the stages so run give the bits of
// kda_chunk_backward_cuda (exit status 1 otherwise).
//
//   kda_stage_timer [--T 512] [--H 2] [--N 2] [--K 64] [--V 64] [--dtype bf16|f32]
//                   [--gate lower_bound|standard|none] [--mode recompute|kept|saved] [--exact]
//                   [--reps 5] [--seed 1234]
// The backward shapes of bench/RESULTS.md ("Anchors and targets"): --T 8192 --H 32 --N 1 --K 128
// --V 128 and --T 32768 --H 64 --N 8 --K 128 --V 128. On the CUDA emulation the times are the CPU's
// (only the bit check means anything there).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "lab.h"
#include "ops/cuda/kda_chunk/heuristics.h"
#include "ops/cuda/kda_chunk/params.cuh"

namespace hlm::kda_lab {
namespace {

namespace kc = ops::cuda::kda;

const char* kUsage =
    "kda_stage_timer [--T 512] [--H 2] [--N 2] [--K 64] [--V 64] [--dtype bf16|f32]\n"
    "                [--gate lower_bound|standard|none] [--mode recompute|kept|saved] [--exact]\n"
    "                [--reps 5] [--seed 1234]\n"
    "Times each stage of the CUDA chunked KDA backward (cudaEvents between the stage launchers).\n";

// cudaEvents recorded after each stage of one run.
struct Marks {
  std::vector<std::pair<const char*, cudaEvent_t>> marks;
  void mark(const char* name) {
    cudaEvent_t e;
    cudaEventCreate(&e);
    cudaEventRecord(e);
    marks.push_back({name, e});
  }
  // Milliseconds of each stage (between consecutive marks).
  std::vector<std::pair<const char*, double>> times() {
    cudaEventSynchronize(marks.back().second);
    std::vector<std::pair<const char*, double>> t;
    for (size_t i = 1; i < marks.size(); ++i) {
      float ms = 0;
      cudaEventElapsedTime(&ms, marks[i - 1].second, marks[i].second);
      t.push_back({marks[i].first, ms});
    }
    for (auto& m : marks) cudaEventDestroy(m.second);
    marks.clear();
    return t;
  }
};

// One backward through the stage launchers, in the library's order (bwd_launch.cu: backward).
template <class Tin>
ops::KdaGrads staged_backward(const ops::KdaArgs& a, const ops::KdaDims& d, const Tensor& d_o,
                              const Tensor& d_final, const ops::KdaChunkBwdCudaBuffers& b,
                              Marks& m) {
  const unsigned tf32 = kc::tf32_stages(a.exact_bf16_products);
  const kc::BwdCall c = kc::bwd_plan(a, d, d_o, d_final, b);
  const kc::Plan& pl = c.plan;
  m.mark("start");
  if (c.recompute) {  // launch.cu: recompute
    if (pl.NC > 0) {
      kc::launch_intra<Tin>(pl, kc::intra_params<Tin>(a, pl, c.x), tf32);
      m.mark("recompute intra");
    }
    kc::launch_state<Tin>(pl, kc::state_params<Tin>(a, pl, c.x, nullptr), tf32);
    m.mark("recompute state");
  }
  const kc::BwdParams<Tin> bp = kc::bwd_params<Tin>(a, c, d_o, d_final);
  kc::launch_state_bwd<Tin>(pl, bp, tf32);
  m.mark("reverse state");
  if (pl.NC > 0) {
    kc::launch_bwd_products<Tin>(pl, bp, tf32);
    m.mark("contractions");
    kc::launch_wy_bwd<Tin>(pl, bp, tf32);
    m.mark("wy bwd");
    kc::launch_intra_bwd<Tin>(pl, bp, tf32);
    m.mark("intra bwd");
    kc::launch_qk_bwd<Tin>(pl, bp);
    m.mark("qk finish");
  }
  if (bp.o_dA || bp.o_ddt) {
    kc::launch_gate_sums<Tin>(pl, bp);
    m.mark("gate sums");
  }
  device_synchronize();
  const cudaError_t err = cudaGetLastError();
  HLM_CHECK(err == cudaSuccess, "kda_stage_timer: kernels: {}", cudaGetErrorString(err));
  return c.grads;
}

int run(int argc, char** argv) {
  std::string mode = "recompute";
  const Problem p = parse(argc, argv, kUsage, [&](const std::string& o, const std::string& v) {
    if (o != "--mode") return false;
    mode = v;
    return true;
  });
  HLM_CHECK(mode == "recompute" || mode == "kept" || mode == "saved",
            "--mode must be recompute, kept or saved, got {}", mode);
  HLM_CHECK(cuda_available(), "no CUDA device (nor the CUDA emulation)");
  const DType dt = p.dtype == "bf16" ? DType::bf16 : DType::f32;
  const Inputs in = on_device(make_inputs(p), dt);
  const ops::KdaArgs& a = in.a;
  const char* op = "kda_stage_timer";
  const ops::KdaDims d = ops::kda_check(a, op);
  ops::kda_check_grads(a, d, in.d_o, in.d_final, op);

  // The forward, keeping or saving what the backward reads; caller buffers for the backward, so
  // that the timed runs allocate nothing.
  ops::KdaChunkCudaBuffers fb;
  ops::KdaChunkBwdCudaBuffers b;
  if (mode == "saved") {
    fb.saved = Tensor::empty({ops::kda_chunk_cuda_saved_floats(a)}, DType::f32, Device::cuda);
    b.saved = fb.saved;
  } else if (mode == "kept") {
    fb.kept = Tensor::empty({ops::kda_chunk_cuda_kept_floats(a)}, DType::f32, Device::cuda);
    b.kept = fb.kept;
  }
  ops::kda_chunk_forward_cuda(a, fb);
  b.workspace = Tensor::empty({ops::kda_chunk_bwd_cuda_workspace_floats(a, mode == "saved")},
                              DType::f32, Device::cuda);
  const ops::KdaGrads ref = ops::kda_chunk_backward_cuda(a, in.d_o, in.d_final, b);
  b.dq = ref.dq.clone(), b.dk = ref.dk.clone(), b.dv = ref.dv.clone(), b.dg = ref.dg.clone();
  b.dbeta = ref.dbeta.clone(), b.dinitial_state = ref.dinitial_state.clone();
  if (ref.dA_log.defined()) b.dA_log = ref.dA_log.clone();
  if (ref.ddt_bias.defined()) b.ddt_bias = ref.ddt_bias.clone();

  // The stages, warm-up first.
  std::vector<std::vector<std::pair<const char*, double>>> runs;
  ops::KdaGrads g;
  for (int r = 0; r <= p.reps; ++r) {
    Marks m;
    g = dt == DType::bf16 ? staged_backward<__nv_bfloat16>(a, d, in.d_o, in.d_final, b, m)
                          : staged_backward<float>(a, d, in.d_o, in.d_final, b, m);
    if (r > 0) runs.push_back(m.times());
  }
  bool same = true;
  for (auto [x, y] : {std::pair{&g.dq, &ref.dq},
                      {&g.dk, &ref.dk},
                      {&g.dv, &ref.dv},
                      {&g.dg, &ref.dg},
                      {&g.dbeta, &ref.dbeta},
                      {&g.dinitial_state, &ref.dinitial_state},
                      {&g.dA_log, &ref.dA_log},
                      {&g.ddt_bias, &ref.ddt_bias}})
    same = same && same_bits(*x, *y);

  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  std::printf("kda backward stages: %s, mode %s, V tile %d, TF32 stages 0x%x, median of %d%s\n",
              describe(p).c_str(), mode.c_str(), kc::state_tile(kc::plan(d), sms),
              kc::tf32_stages(a.exact_bf16_products), p.reps,
              cuda_emulated() ? " (CUDA emulation: CPU times)" : "");
  double total = 0;
  std::vector<double> med;
  for (size_t s = 0; s < runs[0].size(); ++s) {
    std::vector<double> v;
    for (const auto& run : runs) v.push_back(run[s].second);
    med.push_back(median(v));
    total += med.back();
  }
  for (size_t s = 0; s < med.size(); ++s)
    std::printf("  %-16s %9.3f ms  %5.1f%%\n", runs[0][s].first, med[s],
                100.0 * med[s] / std::max(total, 1e-12));
  std::printf("  %-16s %9.3f ms\n", "sum", total);
  std::printf("same bits as kda_chunk_backward_cuda: %s\n", same ? "yes" : "NO");
  return same ? 0 : 1;
}

}  // namespace
}  // namespace hlm::kda_lab

int main(int argc, char** argv) {
  try {
    return hlm::kda_lab::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kda_stage_timer: %s\n", e.what());
    return 2;
  }
}
