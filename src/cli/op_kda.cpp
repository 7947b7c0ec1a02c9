// `hybridlm op kda` and `hybridlm op kda_gate`: the KDA core op and its decay gate on tensors from
// a safetensors file, for cross-checking against FLA (chunk_kda / fused_recurrent_kda) or the CUDA
// kernels (docs/kda.md).
//   hybridlm op kda [--impl chunk|recurrent] [--backward] --in IN --out OUT
//       IN: q, k [T,H,K]; v [T,HV,V]; g [T,HV,K] (log decay, activated: finite, <= 0); beta
//           [T,HV] (finite, in [0, 1]); every floating input finite;
//           cu_seqlens (I64 or I32 [N+1]); optional initial_state [N,HV,K,V] ([K,V] layout),
//           scale (F64 scalar; default K^-1/2); with --backward: do [T,HV,V], optional dht.
//           F32 or F64 (q, k used as given: no L2 norm applied).
//       OUT (F64 when the inputs are F64, else F32): o, final_state; with --backward also dq, dk,
//           dv, dg, dbeta, dinitial_state.
//   hybridlm op kda_gate [--lower-bound X] --in IN --out OUT
//       IN: z [T,HV,K], A_log [HV] (optional with --lower-bound), dt_bias [HV*K] (optional).
//       OUT: g [T,HV,K] (F64 when z is F64, else F32). Without --lower-bound: the standard gate.
// Every error exits with status 2 and one line on stderr, and writes nothing.
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cli/command.h"
#include "core/error.h"
#include "ops/kda.h"

namespace hlm::cli {
namespace {

// Every element of `t` finite and in [lo, hi]; an error names the tensor, the first bad element
// and the range (the op's math assumes these ranges: beta is a gate in [0, 1], g a log decay
// <= 0, so that exp(g) <= 1; a value outside them makes the state grow without bound).
void check_values(const OpInputs& in, const Tensor& t, const char* name, double lo, double hi,
                  const char* meaning) {
  const std::vector<double> v = t.to_f64_vector();
  for (size_t i = 0; i < v.size(); ++i)
    HLM_CHECK(std::isfinite(v[i]) && v[i] >= lo && v[i] <= hi,
              "{}: '{}' holds {} at flat index {}; expected {} values in [{}, {}]", in.path(), name,
              v[i], i, meaning, lo, hi);
}

void check_finite(const OpInputs& in, const Tensor& t, const char* name) {
  const double inf = std::numeric_limits<double>::infinity();
  check_values(in, t, name, -inf, inf, "finite");
}

struct KdaCliArgs {
  std::string in, out, impl = "chunk";
  bool backward = false;
};

void run_kda(const KdaCliArgs& c) {
  const OpInputs in(c.in);
  ops::KdaArgs a;
  a.q = in.floating("q");
  a.k = in.floating("k");
  a.v = in.floating("v");
  a.g = in.floating("g");
  a.beta = in.floating("beta");
  const std::string cu_what = in.path() + ": cu_seqlens";
  a.seqs = SeqLayout::from_tensor(in.get("cu_seqlens"), a.q.dim() >= 1 ? a.q.size(0) : 0,
                                  cu_what.c_str());
  if (in.has("initial_state")) a.initial_state = in.floating("initial_state");
  if (in.has("scale")) {
    const Tensor& s = in.get("scale");
    HLM_CHECK(s.numel() == 1 && is_floating(s.dtype()),
              "{}: 'scale' must be a floating scalar, got {}", in.path(), s.describe());
    a.scale = s.item();
    HLM_CHECK(std::isfinite(a.scale) && a.scale > 0, "{}: 'scale' must be finite and > 0, got {}",
              in.path(), a.scale);
  }
  check_finite(in, a.q, "q");
  check_finite(in, a.k, "k");
  check_finite(in, a.v, "v");
  check_values(in, a.g, "g", -std::numeric_limits<double>::max(), 0.0, "log-decay (finite, <= 0)");
  check_values(in, a.beta, "beta", 0.0, 1.0, "gate");
  if (a.initial_state.defined()) check_finite(in, a.initial_state, "initial_state");
  const DType out_dt = a.q.dtype() == DType::f64 ? DType::f64 : DType::f32;
  const bool chunk = c.impl == "chunk";
  safetensors::TensorMap out;
  Tensor d_o, dht;
  if (c.backward) {
    d_o = in.floating("do");
    check_finite(in, d_o, "do");
    if (in.has("dht")) {
      dht = in.floating("dht");
      check_finite(in, dht, "dht");
    }
  }
  auto fw = chunk ? ops::kda_chunk(a) : ops::kda_recurrent(a);
  out["o"] = fw.o.to(out_dt);
  out["final_state"] = fw.final_state.to(out_dt);
  if (c.backward) {
    auto g =
        chunk ? ops::kda_chunk_backward(a, d_o, dht) : ops::kda_recurrent_backward(a, d_o, dht);
    out["dq"] = g.dq.to(out_dt);
    out["dk"] = g.dk.to(out_dt);
    out["dv"] = g.dv.to(out_dt);
    out["dg"] = g.dg.to(out_dt);
    out["dbeta"] = g.dbeta.to(out_dt);
    out["dinitial_state"] = g.dinitial_state.to(out_dt);
  }
  safetensors::save(c.out, out);
}

struct GateCliArgs {
  std::string in, out;
  std::optional<double> lower_bound;
};

void run_kda_gate(const GateCliArgs& c) {
  const OpInputs in(c.in);
  ops::KdaGateArgs a;
  a.z = in.floating("z");
  if (c.lower_bound) {
    a.kind = ops::KdaGateKind::lower_bound;
    a.lower_bound = *c.lower_bound;
    if (in.has("A_log")) a.A_log = in.floating("A_log");
  } else {
    a.kind = ops::KdaGateKind::standard;
    a.A_log = in.floating("A_log");
  }
  if (in.has("dt_bias")) a.dt_bias = in.floating("dt_bias");
  safetensors::save(c.out, {{"g", ops::kda_gate(a)}});
}

std::function<void()> setup_kda(CLI::App& app) {
  auto a = std::make_shared<KdaCliArgs>();
  app.add_option("--in", a->in, "input safetensors (q, k, v, g, beta, cu_seqlens, ...)")
      ->required()
      ->check(input_file());
  app.add_option("--out", a->out, "output safetensors (o, final_state, grads)")->required();
  app.add_option("--impl", a->impl, "chunk (C=64 WY form) or recurrent (FP64 step form)")
      ->check(CLI::IsMember({"chunk", "recurrent"}));
  app.add_flag("--backward", a->backward, "also compute the gradients from do (and dht)");
  return [a] { run_kda(*a); };
}

std::function<void()> setup_kda_gate(CLI::App& app) {
  auto a = std::make_shared<GateCliArgs>();
  app.add_option("--in", a->in, "input safetensors (z, A_log, dt_bias)")
      ->required()
      ->check(input_file());
  app.add_option("--out", a->out, "output safetensors (g)")->required();
  app.add_option("--lower-bound", a->lower_bound, "lower-bound gate with this bound, in [-5, 0)");
  return [a] { run_kda_gate(*a); };
}

}  // namespace

HLM_REGISTER_OP("kda", "KDA core op (chunk or FP64 recurrent), forward and optional backward",
                setup_kda);
HLM_REGISTER_OP("kda_gate", "KDA decay gate g from z, A_log, dt_bias", setup_kda_gate);

}  // namespace hlm::cli
