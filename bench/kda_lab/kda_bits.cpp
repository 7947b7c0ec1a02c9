// kda_bits OUT.safetensors: runs the CUDA chunked KDA forward and backward (ops::kda_chunk,
// ops::kda_chunk_backward on CUDA tensors) on a fixed set of seeded inputs and writes every
// output, bit for bit, to one safetensors file. Two builds of the kernels that must give the same
// bits (a refactoring, another compiler) are compared with `kda_bits --compare A B`, tensor by
// tensor (names, dtypes, shapes and data bytes; the files' headers may differ, e.g. in their
// metadata); the CUDA emulation build (HLM_CUDA_EMU) runs it without a GPU.
//
// Cases: f32 and bf16 inputs (bf16 also with exact_bf16_products); packed sequences of 1, 63, 65
// and 200 tokens; H = 2, HV = 4 (GVA), K = V = 64; plain log decay (mild, and strong enough to
// take the per-element diagonal path), the fused lower-bound and standard gates with the fused
// q/k L2 norm and beta logits; an initial state and a final-state gradient. Each case runs in the
// three training modes: the backward recomputes everything, reads the forward's saved
// intermediates (KdaSave::all), or its kept A_qk and M^-1 (KdaSave::kept).
// Tensors are named "<case>/<mode>/<output>". Only the public interface (ops/kda.h) is used, so
// the same source builds against any revision of the library.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "core/rng.h"
#include "core/safetensors.h"
#include "core/tensor.h"
#include "ops/kda.h"

namespace {

using hlm::Device;
using hlm::DType;
using hlm::Rng;
using hlm::Shape;
using hlm::Tensor;
using hlm::ops::KdaArgs;
using hlm::ops::KdaGateKind;
using hlm::ops::KdaGrads;
using hlm::ops::KdaOutput;
using hlm::ops::KdaSave;

enum class Gate { plain, strong, lower_bound, standard };

struct Case {
  std::string name;
  DType dt;
  Gate gate;
  bool exact = false;  // KdaArgs::exact_bf16_products
};

constexpr int64_t kH = 2, kHV = 4, kK = 64, kV = 64;
const std::vector<int64_t> kLens = {1, 63, 65, 200};

// Rows of unit L2 norm (the plain cases feed q, k already normalised).
Tensor unit_rows(const Shape& s, DType dt, Rng& rng) {
  Tensor x = hlm::randn(s, DType::f64, rng);
  double* p = x.data<double>();
  const int64_t d = s.back(), rows = x.numel() / d;
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += p[r * d + i] * p[r * d + i];
    const double inv = 1.0 / std::sqrt(ss);
    for (int64_t i = 0; i < d; ++i) p[r * d + i] *= inv;
  }
  return x.to(dt);
}

// The inputs of a case on the host, and d_o / d_final_state.
struct Inputs {
  KdaArgs a;
  Tensor d_o, d_final;
};

Inputs make_inputs(const Case& c, Rng& rng) {
  std::vector<int64_t> cu{0};
  for (int64_t l : kLens) cu.push_back(cu.back() + l);
  const int64_t T = cu.back(), N = int64_t(kLens.size());
  Inputs in;
  KdaArgs& a = in.a;
  if (c.gate == Gate::plain || c.gate == Gate::strong) {
    a.q = unit_rows({T, kH, kK}, c.dt, rng);
    a.k = unit_rows({T, kH, kK}, c.dt, rng);
    a.beta = hlm::rand_uniform({T, kHV}, c.dt, rng, 0.05, 0.95);
    Tensor u = hlm::rand_uniform({T, kHV, kK}, DType::f64, rng, 0, 1);
    double* p = u.data<double>();
    for (int64_t i = 0; i < u.numel(); ++i)
      p[i] = c.gate == Gate::plain ? -5.0 * p[i] * p[i] * p[i] - 1e-3 : -12.0 * p[i] - 1e-3;
    a.g = u.to(c.dt);
  } else {
    a.q = hlm::randn({T, kH, kK}, c.dt, rng);
    a.k = hlm::randn({T, kH, kK}, c.dt, rng);
    a.use_qk_l2norm = true;
    a.beta = hlm::randn({T, kHV}, c.dt, rng);
    a.beta_logits = true;
    a.g = hlm::randn({T, kHV, kK}, c.dt, rng, 2.0);
    a.gate = c.gate == Gate::lower_bound ? KdaGateKind::lower_bound : KdaGateKind::standard;
    a.A_log = hlm::rand_uniform({kHV}, DType::f32, rng, -1.0, 1.0);
    a.dt_bias = hlm::rand_uniform({kHV * kK}, DType::f32, rng, -1, 1);
  }
  a.v = hlm::randn({T, kHV, kV}, c.dt, rng);
  a.initial_state = hlm::randn({N, kHV, kK, kV}, DType::f32, rng, 0.5);
  a.seqs = hlm::SeqLayout::from_offsets(cu, T);
  a.exact_bf16_products = c.exact;
  in.d_o = hlm::randn({T, kHV, kV}, c.dt, rng);
  in.d_final = hlm::randn({N, kHV, kK, kV}, DType::f32, rng, 0.5);
  return in;
}

Inputs to_device(const Inputs& h) {
  Inputs d = h;
  for (Tensor* t : {&d.a.q, &d.a.k, &d.a.v, &d.a.g, &d.a.beta, &d.a.initial_state, &d.a.A_log,
                    &d.a.dt_bias, &d.d_o, &d.d_final})
    if (t->defined()) *t = t->to(Device::cuda);
  return d;
}

void put(hlm::safetensors::TensorMap& m, const std::string& name, const Tensor& t) {
  if (t.defined()) m[name] = t.to(Device::cpu).contiguous();
}

}  // namespace

// 0 when A and B hold the same tensors bit for bit, 1 otherwise (each difference printed).
int compare_files(const char* a_path, const char* b_path) {
  const auto a = hlm::safetensors::load(a_path), b = hlm::safetensors::load(b_path);
  int64_t differ = 0, bytes = 0;
  for (const auto& [name, x] : a.tensors) {
    auto it = b.tensors.find(name);
    if (it == b.tensors.end()) {
      std::printf("only in %s: %s\n", a_path, name.c_str());
      ++differ;
      continue;
    }
    const Tensor& y = it->second;
    const bool same = x.dtype() == y.dtype() && x.shape() == y.shape() &&
                      std::memcmp(x.raw(), y.raw(), x.nbytes()) == 0;
    if (!same)
      std::printf("differs: %s (%s vs %s)\n", name.c_str(), x.describe().c_str(),
                  y.describe().c_str());
    differ += !same;
    bytes += int64_t(x.nbytes());
  }
  for (const auto& [name, y] : b.tensors)
    if (!a.tensors.count(name)) {
      std::printf("only in %s: %s\n", b_path, name.c_str());
      ++differ;
    }
  if (differ) {
    std::printf("kda_bits: %lld tensor(s) differ\n", (long long)differ);
    return 1;
  }
  std::printf("kda_bits: identical, %zu tensors, %lld data bytes\n", a.tensors.size(),
              (long long)bytes);
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "--compare") {
    try {
      return compare_files(argv[2], argv[3]);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kda_bits: %s\n", e.what());
      return 2;
    }
  }
  if (argc != 2) {
    std::fprintf(stderr, "usage: kda_bits OUT.safetensors | kda_bits --compare A B\n");
    return 2;
  }
  if (!hlm::cuda_available()) {
    std::fprintf(stderr, "kda_bits: no CUDA device (nor the CUDA emulation)\n");
    return 1;
  }
  const std::vector<Case> cases = {
      {"f32_plain", DType::f32, Gate::plain},
      {"f32_strong", DType::f32, Gate::strong},
      {"f32_lower_bound", DType::f32, Gate::lower_bound},
      {"f32_standard", DType::f32, Gate::standard},
      {"bf16_plain", DType::bf16, Gate::plain},
      {"bf16_strong", DType::bf16, Gate::strong},
      {"bf16_lower_bound", DType::bf16, Gate::lower_bound},
      {"bf16_standard", DType::bf16, Gate::standard},
      {"bf16_lower_bound_exact", DType::bf16, Gate::lower_bound, true},
  };
  hlm::safetensors::TensorMap out;
  try {
    for (size_t ci = 0; ci < cases.size(); ++ci) {
      const Case& c = cases[ci];
      Rng rng(20240611, ci);
      const Inputs in = to_device(make_inputs(c, rng));
      for (const char* mode : {"recompute", "saved", "kept"}) {
        const std::string p = c.name + "/" + mode + "/";
        KdaOutput o;
        KdaGrads g;
        if (std::string(mode) == "recompute") {
          o = hlm::ops::kda_chunk(in.a);
          g = hlm::ops::kda_chunk_backward(in.a, in.d_o, in.d_final);
        } else {
          const KdaSave what = std::string(mode) == "saved" ? KdaSave::all : KdaSave::kept;
          Tensor saved;
          o = hlm::ops::kda_chunk(in.a, &saved, what);
          g = hlm::ops::kda_chunk_backward(in.a, in.d_o, in.d_final, saved, what);
        }
        put(out, p + "o", o.o);
        put(out, p + "final_state", o.final_state);
        put(out, p + "dq", g.dq);
        put(out, p + "dk", g.dk);
        put(out, p + "dv", g.dv);
        put(out, p + "dg", g.dg);
        put(out, p + "dbeta", g.dbeta);
        put(out, p + "dinitial_state", g.dinitial_state);
        put(out, p + "dA_log", g.dA_log);
        put(out, p + "ddt_bias", g.ddt_bias);
        std::printf("%s done\n", p.c_str());
        std::fflush(stdout);
      }
    }
    hlm::safetensors::save(argv[1], out);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kda_bits: %s\n", e.what());
    return 1;
  }
  std::printf("%zu tensors written to %s\n", out.size(), argv[1]);
  return 0;
}
