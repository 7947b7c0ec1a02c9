// `hybridlm demo` (also what `hybridlm` with no arguments runs until the trainer lands): a built-in
// random KDA problem (T = 1000 tokens packed in 3 sequences, H = 4, K = V = 64, lower-bound gate
// fused, l2-normalised q/k, beta from logits), run with the chunked f32 op forward + backward and
// with the FP64 recurrence; prints the relative error of every output and gradient against FP64
// and the chunked op's tokens/s.
#include <chrono>
#include <cmath>
#include <cstdio>

#include "cli/command.h"
#include "core/rng.h"
#include "ops/kda.h"

namespace hlm::cli {
namespace {

double rel_err(const Tensor& a, const Tensor& b) {
  const auto x = a.to_f64_vector(), y = b.to_f64_vector();
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) num += (x[i] - y[i]) * (x[i] - y[i]), den += y[i] * y[i];
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

void run_demo() {
  const int64_t T = 1000, H = 4, K = 64, V = 64, N = 3;
  Rng rng(20261202);
  ops::KdaArgs a;
  a.q = randn({T, H, K}, DType::f32, rng);
  a.k = randn({T, H, K}, DType::f32, rng);
  a.v = randn({T, H, V}, DType::f32, rng);
  a.g = randn({T, H, K}, DType::f32, rng);
  a.beta = randn({T, H}, DType::f32, rng);
  a.use_qk_l2norm = true;
  a.beta_logits = true;
  a.gate = ops::KdaGateKind::lower_bound;
  a.lower_bound = -5;
  a.A_log = Tensor::zeros({H}, DType::f32);
  a.dt_bias = rand_uniform({H * K}, DType::f32, rng, -1, 1);
  a.initial_state = randn({N, H, K, V}, DType::f32, rng, 0.1);
  a.seqs = SeqLayout::from_offsets({0, 317, 700, 1000}, T);
  Tensor d_o = randn({T, H, V}, DType::f32, rng), dht = randn({N, H, K, V}, DType::f32, rng);

  using clk = std::chrono::steady_clock;
  auto secs = [](clk::time_point t0) {
    return std::chrono::duration<double>(clk::now() - t0).count();
  };
  auto t0 = clk::now();
  auto out = ops::kda_chunk(a);
  const double tf = secs(t0);
  t0 = clk::now();
  auto g = ops::kda_chunk_backward(a, d_o, dht);
  const double tb = secs(t0);
  auto ref = ops::kda_recurrent(a);
  auto gref = ops::kda_recurrent_backward(a, d_o, dht);

  std::printf(
      "KDA demo: T=%lld tokens in %lld sequences (317, 383, 300), H=%lld, K=V=%lld,\n"
      "lower-bound gate -5 fused, q/k L2 norm, beta logits; chunked f32 (C=64) vs FP64 "
      "recurrence\n\n",
      (long long)T, (long long)N, (long long)H, (long long)K);
  std::printf("  %-16s %s\n", "tensor", "rel. L2 error vs FP64");
  auto row = [](const char* n, double e) { std::printf("  %-16s %.3e\n", n, e); };
  row("o", rel_err(out.o, ref.o));
  row("final_state", rel_err(out.final_state, ref.final_state));
  row("dq", rel_err(g.dq, gref.dq));
  row("dk", rel_err(g.dk, gref.dk));
  row("dv", rel_err(g.dv, gref.dv));
  row("dz (gate)", rel_err(g.dg, gref.dg));
  row("dbeta (logits)", rel_err(g.dbeta, gref.dbeta));
  row("dinitial_state", rel_err(g.dinitial_state, gref.dinitial_state));
  row("dA_log", rel_err(g.dA_log, gref.dA_log));
  row("ddt_bias", rel_err(g.ddt_bias, gref.ddt_bias));
  std::printf("\n  chunked forward : %8.3f ms  %10.0f tokens/s\n", tf * 1e3, double(T) / tf);
  std::printf("  chunked backward: %8.3f ms  %10.0f tokens/s (includes the forward recompute)\n",
              tb * 1e3, double(T) / tb);
}

std::function<void()> setup_demo(CLI::App&) {
  return [] { run_demo(); };
}

}  // namespace

HLM_REGISTER_COMMAND("demo", "KDA demo: chunked op vs FP64 recurrence, errors and tokens/s",
                     setup_demo);

}  // namespace hlm::cli
