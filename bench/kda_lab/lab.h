// What the KDA lab programs (kda_stage_timer.cpp, kda_tf32_study.cpp) share: the problem from the
// command line, its seeded inputs, and small helpers. Header-only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "core/rng.h"
#include "core/tensor.h"
#include "ops/kda.h"

namespace hlm::kda_lab {

// The problem: N packed sequences of T / N tokens (the last one takes the rest), H qk heads,
// HV = H value heads, head dims K, V; `gate`: "lower_bound" (the default: the fused lower-bound
// gate -5 with the fused q/k L2 norm and beta logits, the target configuration), "standard" (the
// same with the standard gate) or "none" (a plain log decay g in (-5, 0), unit q / k rows, beta in
// (0, 1)); an initial state and a final-state gradient.
struct Problem {
  int64_t T = 512, H = 2, N = 2, K = 64, V = 64;
  std::string dtype = "bf16";  // of q, k, v, g, beta and d_o: bf16 or f32
  std::string gate = "lower_bound";
  bool exact = false;  // KdaArgs::exact_bf16_products
  int reps = 5;
  uint64_t seed = 1234;
};

// --name value pairs into p (and the program's own options through `extra`, which returns
// whether it took the option); --help prints `usage` and exits.
template <class Extra>
inline Problem parse(int argc, char** argv, const char* usage, Extra&& extra) {
  Problem p;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("%s", usage);
      std::exit(0);
    }
    if (a == "--exact") {
      p.exact = true;
      continue;
    }
    HLM_CHECK(i + 1 < argc, "option {} needs a value", a);
    const std::string v = argv[++i];
    if (a == "--T")
      p.T = std::stoll(v);
    else if (a == "--H")
      p.H = std::stoll(v);
    else if (a == "--N")
      p.N = std::stoll(v);
    else if (a == "--K")
      p.K = std::stoll(v);
    else if (a == "--V")
      p.V = std::stoll(v);
    else if (a == "--dtype")
      p.dtype = v;
    else if (a == "--gate")
      p.gate = v;
    else if (a == "--reps")
      p.reps = std::stoi(v);
    else if (a == "--seed")
      p.seed = std::stoull(v);
    else
      HLM_CHECK(extra(a, v), "unknown option {} (--help lists them)", a);
  }
  HLM_CHECK(p.dtype == "bf16" || p.dtype == "f32", "--dtype must be bf16 or f32, got {}", p.dtype);
  HLM_CHECK(p.gate == "lower_bound" || p.gate == "standard" || p.gate == "none",
            "--gate must be lower_bound, standard or none, got {}", p.gate);
  HLM_CHECK(p.N >= 1 && p.T >= p.N && p.reps >= 1, "need T >= N >= 1 and reps >= 1");
  return p;
}

inline std::string describe(const Problem& p) {
  return fmt::format("{} T={} H=HV={} N={} K={} V={} gate={}{}", p.dtype, p.T, p.H, p.N, p.K, p.V,
                     p.gate, p.exact ? " exact_bf16_products" : "");
}

// The inputs of a problem on the host, in f32 (round them with to(bf16) for a bf16 run).
struct Inputs {
  ops::KdaArgs a;
  Tensor d_o, d_final;
};

inline Inputs make_inputs(const Problem& p) {
  Rng rng(p.seed);
  std::vector<int64_t> cu{0};
  for (int64_t n = 1; n <= p.N; ++n) cu.push_back(n == p.N ? p.T : n * (p.T / p.N));
  const int64_t T = p.T, H = p.H, K = p.K, V = p.V, N = p.N;
  Inputs in;
  ops::KdaArgs& a = in.a;
  const DType f = DType::f32;
  if (p.gate == "none") {
    auto unit = [&](const Shape& s) {
      Tensor x = randn(s, f, rng);
      float* d = x.data<float>();
      for (int64_t r = 0; r < x.numel() / K; ++r) {
        double ss = 0;
        for (int64_t i = 0; i < K; ++i) ss += double(d[r * K + i]) * d[r * K + i];
        for (int64_t i = 0; i < K; ++i) d[r * K + i] = float(d[r * K + i] / std::sqrt(ss));
      }
      return x;
    };
    a.q = unit({T, H, K});
    a.k = unit({T, H, K});
    a.beta = rand_uniform({T, H}, f, rng, 0.05, 0.95);
    a.g = rand_uniform({T, H, K}, f, rng, -5.0, -1e-3);
  } else {
    a.q = randn({T, H, K}, f, rng);
    a.k = randn({T, H, K}, f, rng);
    a.use_qk_l2norm = true;
    a.beta = randn({T, H}, f, rng);
    a.beta_logits = true;
    a.g = randn({T, H, K}, f, rng, 2.0);
    a.gate = p.gate == "lower_bound" ? ops::KdaGateKind::lower_bound : ops::KdaGateKind::standard;
    a.lower_bound = -5.0;
    a.A_log = rand_uniform({H}, f, rng, -1.0, 1.0);
    a.dt_bias = rand_uniform({H * K}, f, rng, -1, 1);
  }
  a.v = randn({T, H, V}, f, rng);
  a.initial_state = randn({N, H, K, V}, f, rng, 0.5);
  a.seqs = hlm::SeqLayout::from_offsets(cu, T);
  a.exact_bf16_products = p.exact;
  in.d_o = randn({T, H, V}, f, rng);
  in.d_final = randn({N, H, K, V}, f, rng, 0.5);
  return in;
}

// q, k, v, g, beta and d_o in dtype dt (the f32 parameters and states stay f32), on the device.
inline Inputs on_device(const Inputs& h, DType dt) {
  Inputs d = h;
  for (Tensor* t : {&d.a.q, &d.a.k, &d.a.v, &d.a.g, &d.a.beta, &d.d_o}) *t = t->to(dt);
  for (Tensor* t : {&d.a.q, &d.a.k, &d.a.v, &d.a.g, &d.a.beta, &d.a.initial_state, &d.a.A_log,
                    &d.a.dt_bias, &d.d_o, &d.d_final})
    if (t->defined()) *t = t->to(Device::cuda);
  return d;
}

// ||x - ref|| / ||ref|| in FP64 (tensors on any device, any float dtype).
inline double rel_l2(const Tensor& x, const Tensor& ref) {
  const std::vector<double> a = x.to(Device::cpu).to_f64_vector();
  const std::vector<double> b = ref.to(Device::cpu).to_f64_vector();
  HLM_CHECK(a.size() == b.size(), "rel_l2: {} against {}", x.describe(), ref.describe());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
  return std::sqrt(num / std::max(den, 1e-300));
}

// Whether two tensors hold the same bytes.
inline bool same_bits(const Tensor& x, const Tensor& y) {
  if (x.defined() != y.defined()) return false;
  if (!x.defined()) return true;
  const Tensor a = x.to(Device::cpu).contiguous(), b = y.to(Device::cpu).contiguous();
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::equal(static_cast<const char*>(a.raw()),
                    static_cast<const char*>(a.raw()) + a.nbytes(),
                    static_cast<const char*>(b.raw()));
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace hlm::kda_lab
