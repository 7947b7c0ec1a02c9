// The whole training step on one GPU: a GLM-5.3-Flash-shaped hybrid (configs/bench_glm_2b.json:
// 2.16 B parameters, 12 layers KKKD x 3, mHC with 4 streams, MoE of 64 experts of 256 top-8 plus
// a shared expert, KPool DSA with top-2048, MTP) trained in bf16 with AdamW on random tokens,
// `batch` documents of `seq` tokens packed into one step.
//
//   bench_model_gpu [--config FILE] [--seq N] [--batch N] [--steps N] [--warmup N]
//                   [--recompute none|selective|full] [--no-mtp] [--no-profile]
//
// --no-mtp builds the model without its MTP block (as bench/model_step_torch.py's PyTorch model,
// for the side-by-side ratio).
//
// Prints the median step time (forward, backward, AdamW and the MoE bias update; the device
// synchronised at both ends), tokens/s, model TFLOP/s and MFU against 790 TFLOP/s (the BF16
// tensor-core rate the project's targets count against), the peak device memory of a step, and
// then one more step with the profiler on (core/profile.h): where the time goes, op by op.
//
// Model FLOPs of a step (the convention of the MFU literature: the model's arithmetic, not the
// kernels'; recomputation not counted):
//   6 N_act tokens                       every GEMM forward and backward, N_act = the parameters a
//                                        token runs through (active_parameter_count) less its
//                                        embedding row, plus lm_head once more for MTP
//   + 3 x the attention's forward, per token:
//     KDA, per value head:  6 K V + 2 C (K + V)       q S, k S and the state update; the chunk's
//                                                     C x C scores and their product (C = 64)
//     DSA:  2 H n (D_qk + d_v), n = min(topk, position + 1)   the absorbed attention over the
//                                                             selected latents (D = kv_lora_rank)
//           + 2 H n D_qk                          the indexer loss's target (when its coefficient
//                                                 is not 0)
//           + 2 H_I d_I (position + 1) / P                    the indexer over the pooled keys
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/json.h"
#include "core/profile.h"
#include "core/rng.h"
#include "gpu_timing.h"
#include "model/config_limits.h"
#include "model/hybrid_model.h"
#include "ops/gemm.h"
#include "train/adamw.h"

#ifdef HLM_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace {

using namespace hlm;

constexpr double kPeakTflops = 790.0;

struct Args {
  std::string config = "configs/bench_glm_2b.json";
  int64_t seq = 4096, batch = 2, steps = 5, warmup = 2;
  std::string recompute = "none";
  bool profile = true;
  bool mtp = true;
};

[[noreturn]] void usage(const char* msg) {
  std::fprintf(
      stderr,
      "bench_model_gpu: %s\nusage: bench_model_gpu [--config FILE] [--seq N] [--batch N] "
      "[--steps N] [--warmup N] [--recompute none|selective|full] [--no-mtp] [--no-profile]\n",
      msg);
  std::exit(2);
}

int64_t positive(const char* flag, const char* v) {
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  if (end == v || *end != '\0' || n < 1 || n > (int64_t(1) << 24))
    usage((std::string(flag) + " needs an integer in [1, 2^24], got '" + v + "'").c_str());
  return n;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "--no-profile" || f == "--no-mtp") {
      (f == "--no-mtp" ? a.mtp : a.profile) = false;
      continue;
    }
    if (i + 1 >= argc) usage(("missing the value of " + f).c_str());
    const char* v = argv[++i];
    if (f == "--config")
      a.config = v;
    else if (f == "--seq")
      a.seq = positive("--seq", v);
    else if (f == "--batch")
      a.batch = positive("--batch", v);
    else if (f == "--steps")
      a.steps = positive("--steps", v);
    else if (f == "--warmup")
      a.warmup = positive("--warmup", v);
    else if (f == "--recompute")
      a.recompute = v;
    else
      usage(("unknown option " + f).c_str());
  }
  return a;
}

// The attention's forward FLOPs of one sequence of S tokens (the header's model).
double attention_fwd_flops(const ModelConfig& c, int64_t S) {
  double kda = 0, dsa = 0;
  const int64_t n_kda = c.count_layers(LayerKind::kda), n_dsa = c.count_layers(LayerKind::dsa);
  if (n_kda > 0) {
    const double K = double(c.kda.head_dim), V = double(c.kda.v_head_dim), C = 64;
    kda = double(n_kda) * double(S) * double(c.kda.num_v_heads) * (6 * K * V + 2 * C * (K + V));
  }
  if (n_dsa > 0) {
    const double H = double(c.mla.num_heads);
    const double Dl = double(c.mla.kv_lora_rank + c.mla.qk_rope_head_dim);
    const double dv = double(c.mla.kv_lora_rank), topk = double(c.indexer.topk);
    const double HI = double(c.indexer.n_heads), dI = double(c.indexer.head_dim);
    const double P = double(std::max<int64_t>(c.indexer.kpool, 1));
    for (int64_t t = 0; t < S; ++t) {
      const double n = std::min(topk, double(t + 1));
      dsa += 2 * H * n * (Dl + dv) + (c.indexer.loss_coeff > 0 ? 2 * H * n * Dl : 0.0) +
             2 * HI * dI * double(t + 1) / P;
    }
    dsa *= double(n_dsa);
  }
  return kda + dsa;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
#ifndef HLM_HAVE_CUDA
  std::puts("bench_model_gpu: built without CUDA");
  return 0;
#else
  try {
    if (!cuda_available() || cuda_emulated()) {
      std::puts("bench_model_gpu: no CUDA device (or the emulation): nothing to time");
      return 0;
    }
    const ModelConfig cfg = ModelConfig::from_json(read_json_file(a.config), a.config);
    HybridModelOptions mo;
    mo.dtype = DType::bf16;
    mo.seed = 1;
    mo.recompute = parse_recompute(a.recompute);
    mo.mtp = a.mtp;
    const int64_t T = a.seq * a.batch;
    std::printf("model %s: %.3f B parameters (%.1f M active per token), bf16, recompute %s\n",
                a.config.c_str(), double(parameter_count(cfg, a.mtp)) * 1e-9,
                double(active_parameter_count(cfg, a.mtp)) * 1e-6, a.recompute.c_str());
    std::printf("step: %lld documents of %lld tokens (T = %lld)\n", (long long)a.batch,
                (long long)a.seq, (long long)T);
    HybridModel model(cfg, mo);
    model.to(Device::cuda);
    model.set_dsa_stage(DsaStage::sparse);
    model.zero_grad();
    train::AdamW opt(model.named_parameters());

    Rng rng(5);
    std::vector<int64_t> tok(size_t(T + 1));
    for (auto& t : tok) t = int64_t(rng.below(uint64_t(cfg.vocab_size)));
    std::vector<int64_t> cu;
    for (int64_t b = 0; b <= a.batch; ++b) cu.push_back(b * a.seq);
    ModelInputs in;
    in.tokens = Tensor::from_vector({T}, std::vector<int64_t>(tok.begin(), tok.end() - 1));
    in.targets = Tensor::from_vector({T}, std::vector<int64_t>(tok.begin() + 1, tok.end()));
    in.cu_seqlens = Tensor::from_vector({a.batch + 1}, cu);
    in.logits = false;  // the head and the loss in chunks of rows

    double loss = 0;
    auto step = [&] {
      HLM_PROFILE("step");
      model.zero_grad();
      HybridModel::SavedPtr saved;
      profile::Scope ps_f("forward");
      const ModelOutput out = model.forward(Context{true, false}, in, &saved);
      ps_f.end();
      profile::Scope ps_b("backward");
      model.backward(Context{true, false}, *saved);
      ps_b.end();
      {
        HLM_PROFILE("optimizer");
        opt.step(1e-4);
      }
      saved.reset();
      model.update_moe_bias(out.expert_counts);
      loss = out.lm_loss;
    };
    for (int64_t i = 0; i < a.warmup; ++i) step();
    cuda_reset_peak_memory();
    const std::vector<double> ms = bench::event_times_ms(step, int(a.steps), 0);
    const CudaMemoryStats mem = cuda_memory_stats();
    std::vector<double> sorted = ms;
    std::sort(sorted.begin(), sorted.end());
    const double med = sorted[sorted.size() / 2];
    const bool mtp = a.mtp && cfg.mtp.num_layers > 0;
    const double n_act = double(active_parameter_count(cfg, a.mtp)) - double(cfg.hidden_size) +
                         (mtp ? double(cfg.vocab_size) * double(cfg.hidden_size) : 0.0);
    const double flops =
        6 * n_act * double(T) + 3 * double(a.batch) * attention_fwd_flops(cfg, a.seq);
    const double tflops = flops / (med * 1e-3) * 1e-12;
    std::printf("step times (ms):");
    for (double t : ms) std::printf(" %.1f", t);
    std::printf(
        "\nmedian step %.1f ms: %.0f tokens/s, %.1f model TFLOP/s (%.2f TFLOP per step), MFU "
        "%.1f%% of %.0f; loss %.4f\n",
        med, double(T) / (med * 1e-3), tflops, flops * 1e-12, 100 * tflops / kPeakTflops,
        kPeakTflops, loss);
    std::printf(
        "device memory: peak in use %.2f GiB, peak reserved %.2f GiB; %llu cudaMalloc calls\n",
        double(mem.peak_in_use_bytes) / 1073741824.0,
        double(mem.peak_reserved_bytes) / 1073741824.0, (unsigned long long)mem.cuda_malloc_count);
    const ops::GemmGroupedCounts gg = ops::gemm_grouped_counts();
    std::printf("grouped GEMM calls %lld, %lld of them as one cublasGemmEx per group\n",
                (long long)gg.calls, (long long)gg.per_group_loops);
    if (a.profile) {
      profile::set_enabled(true);
      profile::reset();
      step();
      profile::set_enabled(false);
      std::printf("one step with the profiler on (the device synchronised around each scope):\n%s",
                  profile::report().c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_model_gpu: %s\n", e.what());
    return 2;
  }
#endif
}
