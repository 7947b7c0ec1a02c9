// Generation (infer::Generator over a ModelCache) on the CPU or CUDA: the time to the first token
// (the prefill of the prompts) and the decode throughput at batch 1, 8 and 64, for a model config
// with random weights.
//
//   bench_decode [--config FILE] [--prompt N] [--new N] [--batches 1,8,64] [--dtype f32|f64]
//                [--device cpu|cuda] [--temperature T [--top-k K] [--top-p P]]
//
// Per batch B: B prompts of N random tokens are submitted to one Generator; its first step
// prefills them all (one packed forward), every later step decodes one token of each. Reported:
// the prefill time and tokens/s, the decode steps' median time and tokens/s (B per step), and
// the copies to the host per decode step (each a wait for the device; core/device.h), to the
// device (uploads), and the uploads that waited for a staging slot (ring waits: the host had run
// a ring's length ahead of the device).
// Greedy, or sampled with --temperature (request b seeded with b); the steps are timed with a
// steady clock around Generator::step, after a short warm-up generation. HLM_PROFILE=1 prints where
// each batch's decode steps spent their time, HLM_PROFILE=host how long the host took to issue
// each part (core/profile.h; the root scope "decode step" is the whole step, its pick's wait
// included); in the CUDA emulation build both also list the decode steps' kernel launches by
// kernel. On CUDA the decode steps alone are bracketed for a profiler (core/device.h,
// cuda_profiler_collect): `ncu --profile-from-start off --metrics gpu__time_duration.sum ...
// bench_decode ...` times each of their kernels, prefill and warm-up left out.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/device.h"
#include "core/profile.h"
#include "core/rng.h"
#include "infer/generator.h"
#include "model/config.h"
#include "model/hybrid_model.h"

namespace {

using namespace hlm;

struct Args {
  std::string config = "configs/tiny.json";
  int64_t prompt = 256, generate = 32;
  std::vector<int64_t> batches = {1, 8, 64};
  DType dtype = DType::f32;
  Device device = Device::cpu;
  infer::SamplingParams sampling;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "bench_decode: %s\nusage: bench_decode [--config FILE] [--prompt N] "
               "[--new N] [--batches 1,8,64] [--dtype f32|f64] [--device cpu|cuda] "
               "[--temperature T [--top-k K] [--top-p P]]\n",
               why.c_str());
  std::exit(2);
}

int64_t count(const char* v, const char* flag) {
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  if (*v == 0 || *end != 0 || x < 1 || x > (1 << 24)) usage(std::string(flag) + " needs a count");
  return x;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (i + 1 >= argc) usage(f + " needs a value");
    const char* v = argv[++i];
    if (f == "--config") {
      a.config = v;
    } else if (f == "--prompt") {
      a.prompt = count(v, "--prompt");
    } else if (f == "--new") {
      a.generate = count(v, "--new");
    } else if (f == "--batches") {
      a.batches.clear();
      std::stringstream ss(v);
      for (std::string s; std::getline(ss, s, ',');)
        a.batches.push_back(count(s.c_str(), f.c_str()));
    } else if (f == "--dtype") {
      const std::string d = v;
      if (d != "f32" && d != "f64") usage("--dtype is f32 or f64");
      a.dtype = d == "f64" ? DType::f64 : DType::f32;
    } else if (f == "--device") {
      const std::string d = v;
      if (d != "cpu" && d != "cuda") usage("--device is cpu or cuda");
      a.device = d == "cuda" ? Device::cuda : Device::cpu;
    } else if (f == "--temperature" || f == "--top-p") {
      char* end = nullptr;
      const double x = std::strtod(v, &end);
      if (*v == 0 || *end != 0) usage(f + " needs a number");
      (f == "--temperature" ? a.sampling.temperature : a.sampling.top_p) = x;
    } else if (f == "--top-k") {
      a.sampling.top_k = count(v, "--top-k");
    } else {
      usage("unknown option " + f);
    }
  }
  try {
    a.sampling.validate();
  } catch (const std::exception& e) {
    usage(e.what());
  }
  if (a.sampling.greedy() && (a.sampling.top_k != 0 || a.sampling.top_p != 1))
    usage("--top-k and --top-p need --temperature");
  return a;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  try {
    const ModelConfig cfg = ModelConfig::load(a.config);
    HybridModelOptions o;
    o.dtype = a.dtype;
    o.mtp = false;
    o.seed = 1;
    if (a.device == Device::cuda && !cuda_available()) usage("--device cuda: no CUDA device");
    HybridModel model(cfg, o);
    model.keep_gemm_weights_in_bf16();  // as generate and serve load it: the same results
    if (a.device == Device::cuda) model.to(Device::cuda);
    const std::string mode = a.sampling.greedy() ? "greedy"
                                                 : fmt::format("temperature {} top-k {} top-p {}",
                                                               a.sampling.temperature,
                                                               a.sampling.top_k, a.sampling.top_p);
    std::printf(
        "model %s (D %lld, %lld layers %s, vocab %lld), %s on %s; prompts of %lld tokens, "
        "%lld new tokens each, %s\n",
        a.config.c_str(), (long long)cfg.hidden_size, (long long)cfg.num_hidden_layers,
        cfg.layer_pattern().c_str(), (long long)cfg.vocab_size, dtype_name(a.dtype),
        device_name(a.device), (long long)a.prompt, (long long)a.generate, mode.c_str());
    std::printf("%6s | %12s %14s | %14s %14s %11s %12s %12s\n", "batch", "prefill ms",
                "prefill tok/s", "decode step ms", "decode tok/s", "waits/step", "uploads/step",
                "ring waits");
    Rng rng(7);
    {  // warm-up: the threads and the allocator's first pages
      infer::Generator gen(model, {.max_seqs = 1, .max_tokens = 64});
      infer::Request r;
      r.prompt = {1, 2, 3, 4, 5, 6, 7, 8};
      r.max_new = 4;
      gen.run({r});
    }
    for (int64_t B : a.batches) {
      infer::Generator gen(model, {.max_seqs = B, .max_tokens = B * (a.prompt + a.generate + 64)});
      for (int64_t b = 0; b < B; ++b) {
        infer::Request r;
        for (int64_t i = 0; i < a.prompt; ++i)
          r.prompt.push_back(int64_t(rng.next_u32() % uint32_t(cfg.vocab_size)));
        r.max_new = a.generate;
        r.stop = {};
        r.sampling = a.sampling;
        r.sampling.seed = uint64_t(b);
        gen.submit(r);
      }
      auto t0 = std::chrono::steady_clock::now();
      gen.step();  // prefill of every prompt (+ their first tokens)
      const double prefill = seconds_since(t0);
      profile::reset();  // the report covers the decode steps
      reset_transfer_stats();
      std::vector<double> steps;
      const auto launches0 = profile::launches_by_kernel();
      cuda_profiler_collect(true);
      while (gen.busy()) {
        t0 = std::chrono::steady_clock::now();
        {
          HLM_PROFILE("decode step");
          gen.step();
        }
        steps.push_back(seconds_since(t0));
      }
      cuda_profiler_collect(false);
      if (profile::enabled()) {
        std::printf("%s", profile::report().c_str());
        if (profile::counts_launches())
          std::printf("%s", profile::launch_report(launches0, profile::launches_by_kernel(),
                                                   int64_t(steps.size()))
                                .c_str());
        profile::reset();
      }
      // Copies per decode step (core/device.h): to the host, each a wait for the device; to the
      // device, staged (the host goes on).
      const TransferStats ts = transfer_stats();
      const double per = steps.empty() ? 0 : 1.0 / double(steps.size());
      const double waits = double(ts.to_host) * per;
      const double uploads = double(ts.to_device + ts.to_device_staged) * per;
      const double ring_waits = double(ts.staging_waits) * per;
      std::sort(steps.begin(), steps.end());
      const double med = steps.empty() ? 0 : steps[steps.size() / 2];
      std::printf("%6lld | %12.2f %14.0f | %14.3f %14.1f %11.2f %12.2f %12.2f\n", (long long)B,
                  prefill * 1e3, double(B * a.prompt) / prefill, med * 1e3,
                  med > 0 ? double(B) / med : 0.0, waits, uploads, ring_waits);
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_decode: %s\n", e.what());
    return 2;
  }
  return 0;
}
