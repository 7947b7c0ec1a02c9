// kda_tf32_study: which stages of the CUDA chunked KDA may take plain TF32 for their bf16 products.
// For each mask of stages (bit 1 << KdaStage, src/ops/cuda/kda_chunk/heuristics.h) it runs the
// forward and the backward on bf16 inputs with those stages in TF32 and the others in 3xTF32
// (cuda::kda::forward / backward take the mask), and prints each output's relative L2 error
// against the FP32 path (f32 inputs holding the same bf16 values: FP32 FMA products) and, on a
// GPU, the median time of forward + backward. The library's default is heuristics.h's
// kTf32Stages; the time beside FLA comes from bench/kda_chunk_bench.py --tf32-stages.
//
//   kda_tf32_study [--masks 0,1,2,4,8,16,32,31,63] [--T 512] [--H 2] [--N 2] [--K 64] [--V 64]
//                  [--gate lower_bound|standard|none] [--reps 5] [--seed 1234]
#include <cuda_runtime.h>

#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "lab.h"
#include "ops/cuda/kda_chunk/heuristics.h"
#include "ops/cuda/kda_chunk/params.cuh"

namespace hlm::kda_lab {
namespace {

namespace kc = ops::cuda::kda;

const char* kUsage =
    "kda_tf32_study [--masks 0,1,2,4,8,16,32,31,63] [--T 512] [--H 2] [--N 2] [--K 64] [--V 64]\n"
    "               [--gate lower_bound|standard|none] [--reps 5] [--seed 1234]\n"
    "Errors (and, on a GPU, times) of the bf16 path per set of TF32 stages against the FP32 "
    "path.\n";

struct Result {
  ops::KdaOutput out;
  ops::KdaGrads grads;
};

Result run_once(const Inputs& in, unsigned tf32) {
  const char* op = "kda_tf32_study";
  const ops::KdaDims d = ops::kda_check(in.a, op);
  ops::kda_check_grads(in.a, d, in.d_o, in.d_final, op);
  Result r;
  r.out = kc::forward(in.a, d, {}, tf32);
  r.grads = kc::backward(in.a, d, in.d_o, in.d_final, {}, tf32);
  return r;
}

std::string stages_of(unsigned mask) {
  static const char* names[] = {"intra", "state", "state-bwd", "contractions", "wy", "intra-bwd"};
  std::string s;
  for (int i = 0; i < 6; ++i)
    if ((mask >> i) & 1u) {
      if (!s.empty()) s += '+';
      s += names[i];
    }
  return s.empty() ? "none (3xTF32 everywhere)" : s;
}

int run(int argc, char** argv) {
  std::vector<unsigned> masks = {0, 1, 2, 4, 8, 16, 32, kc::kTf32Stages, 63};
  Problem p = parse(argc, argv, kUsage, [&](const std::string& o, const std::string& v) {
    if (o != "--masks") return false;
    masks.clear();
    std::stringstream ss(v);
    std::string m;
    while (std::getline(ss, m, ',')) masks.push_back(unsigned(std::stoul(m, nullptr, 0)));
    return true;
  });
  HLM_CHECK(cuda_available(), "no CUDA device (nor the CUDA emulation)");
  p.dtype = "bf16";
  const Inputs host = make_inputs(p);
  const Inputs bf = on_device(host, DType::bf16);
  // The FP32 path on the same values: the bf16-rounded inputs widened back to f32.
  Inputs h32 = host;
  for (Tensor* t : {&h32.a.q, &h32.a.k, &h32.a.v, &h32.a.g, &h32.a.beta, &h32.d_o})
    *t = t->to(DType::bf16).to(DType::f32);
  const Result ref = run_once(on_device(h32, DType::f32), 0);

  const bool timed = !cuda_emulated();
  std::printf("kda TF32 study: %s; relative L2 error against the FP32 path%s\n",
              describe(p).c_str(), timed ? ", median ms of forward + backward" : "");
  std::printf("%6s %9s %9s %9s %9s %9s %9s %9s %9s %9s %9s  %s\n", "mask", "o", "ht", "dq", "dk",
              "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias", timed ? "ms   stages" : "stages");
  for (unsigned mask : masks) {
    const Result r = run_once(bf, mask);
    auto err = [](const Tensor& x, const Tensor& y) { return x.defined() ? rel_l2(x, y) : 0.0; };
    std::printf("%#6x %9.2e %9.2e %9.2e %9.2e %9.2e %9.2e %9.2e %9.2e %9.2e %9.2e", mask,
                err(r.out.o, ref.out.o), err(r.out.final_state, ref.out.final_state),
                err(r.grads.dq, ref.grads.dq), err(r.grads.dk, ref.grads.dk),
                err(r.grads.dv, ref.grads.dv), err(r.grads.dg, ref.grads.dg),
                err(r.grads.dbeta, ref.grads.dbeta),
                err(r.grads.dinitial_state, ref.grads.dinitial_state),
                err(r.grads.dA_log, ref.grads.dA_log), err(r.grads.ddt_bias, ref.grads.ddt_bias));
    if (timed) {
      cudaEvent_t e0, e1;
      cudaEventCreate(&e0);
      cudaEventCreate(&e1);
      std::vector<double> ms;
      for (int i = 0; i < p.reps; ++i) {
        cudaEventRecord(e0);
        run_once(bf, mask);
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float m = 0;
        cudaEventElapsedTime(&m, e0, e1);
        ms.push_back(m);
      }
      cudaEventDestroy(e0);
      cudaEventDestroy(e1);
      std::printf("  %8.3f", median(ms));
    }
    std::printf("  %s\n", stages_of(mask).c_str());
  }
  return 0;
}

}  // namespace
}  // namespace hlm::kda_lab

int main(int argc, char** argv) {
  try {
    return hlm::kda_lab::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kda_tf32_study: %s\n", e.what());
    return 2;
  }
}
