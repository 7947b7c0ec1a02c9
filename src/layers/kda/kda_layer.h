// KdaLayer: the Kimi Delta Attention layer of GLM-5.3-Flash / Kimi-Linear (docs/kda.md, "The
// layer"), CPU or CUDA, packed THD input.
//
// Explicit forward and backward, no autograd (docs/architecture.md, layers/module.h): forward(ctx,
// x, cu_seqlens, states, saved) fills the named Saved fields backward needs (or only the layer
// input under ctx.recompute, and backward re-runs the forward); backward(ctx, dy, saved) writes the
// activation gradients (dx and the gradients of the initial states, =) and accumulates every
// parameter gradient into Param::grad (+=).
//
// Per token x in R^D of a packed batch [T, D] with cu_seqlens [N+1] (H qk heads, HV value heads,
// G = HV / H, head dims K and V, conv width W):
//   q~ = q_proj x [H K],  k~ = k_proj x [H K],  v~ = v_proj x [HV V]                 (no bias)
//   q, k, v = SiLU(causal depthwise conv_W(q~, k~, v~))     per channel, restarting at every
//             sequence start (or continuing from the conv state: the last W-1 inputs q~|k~|v~)
//   beta = sigmoid(b_proj x) [HV]
//   z = f_b_proj(f_a_proj x) [HV K]                         (rank 0: z = f_proj x)
//   g = lower_bound * sigmoid(exp(A_log[h]) (z + dt_bias))  (lower-bound gate), or
//     = -exp(A_log[h]) softplus(z + dt_bias)               (standard gate)
//   o = KDA(l2norm(q) K^-1/2, l2norm(k), v, g, beta; S_0) [HV V]  per sequence (ops/kda.h)
//   og = g_b_proj(g_a_proj x) [HV V]                        (rank 0: og = g_proj x)
//   o' = o / sqrt(mean_V(o^2) + eps) * o_norm * sigmoid(og) per head (one weight [V] for all)
//   y = o_proj o' [D]
// The q/k L2 norm, beta sigmoid and decay gate run fused inside the core op (kda_chunk, or the
// FP64 kda_recurrent when config.core == recurrent), which also returns the final state S_T.
//
// Dtypes: parameters f64, f32 or bf16 (A_log and dt_bias keep_fp32: they stay f32 through
// to_dtype(bf16)); activations are computed in f64 when x is f64, else in f32 (bf16 parameters are
// read as f32). y and dx have x's dtype; states and their gradients are in the compute dtype.
// Every Linear's GEMM precision comes from the PrecisionPolicy: role kda_proj for q/k/v/o (so
// kda_disable_fp8 and modules_to_not_convert take them out of FP8), kda_gate for f_a/f_b/g_a/g_b/
// b_proj (never FP8), with the module path "<path>.<name>" (e.g.
// "model.layers.0.self_attn.q_proj").
//
// Devices: the layer runs where its parameters are (Module::to(Device::cuda) moves them); x, the
// states and dy must be on that device (cu_seqlens may be on either; it is read on the host). On
// CUDA every op dispatches to its CUDA implementation: cuBLAS GEMMs (native f32 or bf16
// precision; fp8_block is CPU-only for now and throws), the CUDA conv / gated RMSNorm ops, the
// CUDA kda_chunk forward and backward (so f32 or bf16 parameters, f32 or bf16 x; f64 and the
// recurrent core stay on the CPU), and ops/tensor_ops.h for conversions and gradient sums.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/seq_layout.h"
#include "layers/linear.h"
#include "layers/module.h"
#include "layers/precision.h"
#include "ops/kda_gate.h"

namespace hlm {

namespace dist {
class CpSlice;
}
struct KdaCpSaved;  // context parallel: what the forward passes to the backward (kda_layer.cpp)
struct KdaCpRun;    // context parallel: the slice, and the states the forward exchanged

// Checkpoint parameter names (relative to the layer, e.g. "model.layers.0.self_attn").
enum class KdaNaming : uint8_t {
  // GLM-5.3-Flash checkpoint: q_proj, k_proj, v_proj, one fused depthwise conv over q|k|v
  // "conv1d.weight" [2HK + HV V, 1, W], f_a_proj, f_b_proj, A_log [HV], dt_bias [HV K], b_proj,
  // g_a_proj, g_b_proj, o_norm.weight [V], o_proj.
  glm5_next,
  // transformers' modeling_glm5_next module tree: as glm5_next, but the decay gate is a child
  // "forget_gate" holding f_a_proj, f_b_proj, A_log and dt_bias ("forget_gate.A_log", ...).
  glm5_next_transformers,
  // Kimi-Linear / FLA / vLLM: separate convs "q_conv1d.weight" [HK, 1, W], "k_conv1d.weight",
  // "v_conv1d.weight" [HV V, 1, W]; the other names as glm5_next.
  kimi_linear,
};
const char* kda_naming_name(KdaNaming n);  // "glm5_next", "glm5_next_transformers", "kimi_linear"

// How a KDA layer splits a context-parallel batch (docs/parallel.md, "Context parallelism"):
//   chunkwise: each rank runs its token slice, the recurrent states chained across the ranks;
//   headwise:  an all-to-all gives each rank every token of num_heads / size heads, which it runs
//              over the whole sequences, and a second one brings the outputs back.
enum class KdaCpMode : uint8_t { chunkwise, headwise };

// Which core op the layer runs: the chunked op (training and prefill), or the FP64 recurrence
// (a reference mode: its results are rounded to the compute dtype).
enum class KdaCoreImpl : uint8_t { chunk, recurrent };
// What the CUDA chunk core's training forward keeps for its backward (KdaConfig::core_save).
enum class KdaCoreSave : uint8_t { none, kept, all };

// The layer's configuration. The defaults are GLM-5.3-Flash's (docs/model_config.md, "KDA"). The
// model config parser fills the fields; validate() checks every field (hlm::Error naming it) and
// the KdaLayer constructor calls it, so no layer is ever built from an invalid config.
struct KdaConfig {
  int64_t hidden_size = 4096;      // D
  int64_t num_heads = 64;          // H: q/k heads
  int64_t num_v_heads = 64;        // HV: value heads (GVA), a multiple of num_heads
  int64_t head_k_dim = 128;        // K
  int64_t head_v_dim = 128;        // V
  int64_t conv_kernel = 4;         // W >= 1 (short conv width)
  int64_t decay_rank = 128;        // rank of f_a -> f_b; 0: one full-rank f_proj [HV K, D]
  int64_t output_gate_rank = 128;  // rank of g_a -> g_b; 0: one full-rank g_proj [HV V, D]
  bool output_gate_bias = false;   // a bias on g_b_proj (g_proj) (FLA's layer has one)
  ops::KdaGateKind gate = ops::KdaGateKind::lower_bound;
  double lower_bound = ops::kKdaLowerBound;  // lower-bound gate only: ops::check_kda_lower_bound
  double norm_eps = 1e-5;                    // o_norm eps (GLM passes rms_norm_eps)
  KdaNaming naming = KdaNaming::glm5_next;
  KdaCoreImpl core = KdaCoreImpl::chunk;
  // CUDA chunk core in training: what its forward keeps for the backward (the same bits in all
  // three; K = V = 128, f32):
  //   none: nothing, the backward recomputes every intermediate (the least memory);
  //   kept: A_qk and M^-1 (512 bytes per token and value head, as FLA keeps its A_qk and A_kk):
  //         the backward recomputes the rest, 3-5% faster core forward + backward;
  //   all:  every intermediate (~5.5 KiB per token and value head): the backward skips the
  //         recompute, ~1.2x faster core forward + backward, much more activation memory.
  KdaCoreSave core_save = KdaCoreSave::kept;

  void validate() const;  // throws hlm::Error naming the field and the expected range
  int64_t qk_dim() const { return num_heads * head_k_dim; }    // H K
  int64_t v_dim() const { return num_v_heads * head_v_dim; }   // HV V
  int64_t conv_dim() const { return 2 * qk_dim() + v_dim(); }  // channels of q~|k~|v~

  static KdaConfig glm5_3_flash();     // D 4096, 64 heads, K = V = 128, ranks 128, bound -5
  static KdaConfig kimi_linear_48b();  // D 2304, 32 heads, K = V = 128, ranks 128, standard gate
};

// The state a sequence carries between calls (prefill -> decode, or chunked prefill).
struct KdaState {
  Tensor conv;       // [N, W-1, 2HK + HV V]: the last W-1 conv inputs q~|k~|v~ (oldest first)
  Tensor recurrent;  // [N, HV, K, V]: S, [K, V] layout (ops/kda.h)
};

class KdaLayer : public Module {
 public:
  struct Saved {
    // Always filled (also under ctx.recompute):
    Tensor x;          // [T, D] the layer input, in the compute dtype
    SeqLayout seqs;    // the batch's sequences
    KdaState initial;  // the initial states as given, in the compute dtype (undefined: zeros)
    DType x_dtype = DType::f32;
    bool recompute = false;  // true: nothing below is filled; backward re-runs the forward
    // The full save:
    Linear::Saved q_proj, k_proj, v_proj, b_proj, o_proj;
    Linear::Saved f_a, f_b;      // full-rank decay gate: f_b is f_proj's (f_a unused)
    Linear::Saved g_a, g_b;      // full-rank output gate: g_b is g_proj's (g_a unused)
    Tensor q_pre, k_pre, v_pre;  // [T, HK], [T, HK], [T, HV V] conv inputs
    Tensor q, k, v;              // [T, H, K], [T, H, K], [T, HV, V] conv outputs (core inputs)
    Tensor z;                    // [T, HV, K] raw gate input f_b(f_a x)
    Tensor beta_logits;          // [T, HV]
    Tensor o;                    // [T, HV, V] core output
    Tensor og;                   // [T, HV, V] output-gate logits
    Tensor rstd;                 // [T, HV] o_norm 1 / sqrt(mean(o^2) + eps)
    Tensor core;                 // what the core's forward kept (core_save, CUDA)
    // Context parallel (the forward given a CpSlice): the slice and what the backward passes back
    // to the other ranks; `initial` then holds the states this rank's first sequence continued
    // from (the conv inputs before the slice, the recurrent state at its start).
    std::shared_ptr<const KdaCpSaved> cp;
  };

  struct Grads {
    Tensor dx;          // [T, D], dtype of x
    KdaState dinitial;  // gradients of the initial states that were given (else undefined)
  };

  // path: the module's full name (e.g. "model.layers.0.self_attn"), used for the precision policy
  // and in error messages. dt: parameter dtype (f64, f32 or bf16); A_log and dt_bias are f32 for
  // bf16 (f64 for f64). Parameters start at zero: call init_weights.
  KdaLayer(const KdaConfig& config, const PrecisionPolicy& policy, const std::string& path,
           DType dt = DType::f32);

  // Deterministic initialisation from an hlm RNG seed (each parameter from its own Philox stream,
  // so a value depends only on the seed and the parameter):
  //   Linear weights  U(-1/sqrt(in), 1/sqrt(in)) (PyTorch's default), or N(0, init_std) when
  //                   init_std > 0 (HF initializer_range); g bias 0
  //   conv weights    U(-1/sqrt(W), 1/sqrt(W)) (PyTorch Conv1d, fan_in = W for depthwise)
  //   A_log           log U(1, 16) (standard gate); 0 (lower-bound gate, as FLA)
  //   dt_bias         softplus^-1(dt) = dt + log(-expm1(-dt)), dt = exp(U(log 1e-3, log 1e-1))
  //                   clamped to >= 1e-4
  //   o_norm weight   1
  void init_weights(uint64_t seed, double init_std = 0.0);

  // x [T, D] (f64, f32 or bf16, on the parameters' device); cu_seqlens [N+1] i64/i32 ending at T
  // (undefined: one sequence). initial: optional states (either part may be undefined: zeros).
  // saved: filled when ctx.training. final_state: when given, receives the states after the last
  // token of every sequence (conv [N, W-1, 2HK + HV V] and recurrent [N, HV, K, V], compute dtype).
  Tensor forward(const Context& ctx, const Tensor& x, const Tensor& cu_seqlens,
                 const KdaState* initial, Saved* saved, KdaState* final_state = nullptr) const;
  // The same with a checked layout of N >= 1 sequences covering the T tokens.
  Tensor forward(const Context& ctx, const Tensor& x, const SeqLayout& seqs,
                 const KdaState* initial, Saved* saved, KdaState* final_state = nullptr) const;

  // Context parallel (docs/parallel.md, "Context parallelism"): x [cp.tokens(rank), D] holds this
  // rank's slice of a packed batch split over cp's group (every rank of it calls, with the same
  // slice bounds and mode), and y is that slice of the layer's output over the whole batch.
  //   chunkwise: the short conv takes its first W-1 inputs from the ranks before; the recurrent
  //              state at the slice start is chained from the earlier ranks' states and
  //              transition matrices (one all-gather); the backward passes the state and conv
  //              gradients back the same way.
  //   headwise:  the conv inputs, gate input and beta logits go to the rank of their heads (one
  //              all-to-all; num_heads must divide by the group's size), the conv and the core
  //              run there over the whole sequences, and the core's output comes back (another).
  // No initial or final states (the batch starts from zeros). Parameter gradients are this rank's
  // share: their sum over the group is the whole batch's.
  Tensor forward(const Context& ctx, const Tensor& x, const dist::CpSlice& cp, Saved* saved,
                 KdaCpMode mode = KdaCpMode::chunkwise) const;

  // Inference: one decode step of N sequences, one token each (x [N, D], computing in f32), over
  // the state pools of an inference cache (pool.conv [S, W-1, 2HK + HV V] and pool.recurrent
  // [S, HV, K, V], f32, on x's device; slots: N distinct rows of them). The conv states of the
  // slots are gathered, advanced and written back (small); the recurrent states are advanced in
  // place by ops::kda_decode_step through its slot indices, so they are never copied. The math of
  // forward over one-token sequences from those states, by the recurrent step.
  Tensor decode_step(const Tensor& x, const KdaState& pool,
                     const std::vector<int64_t>& slots) const;

  // dy [T, D]; d_final: optional gradients of the final states (either part may be undefined).
  Grads backward(const Context& ctx, const Tensor& dy, const Saved& saved,
                 const KdaState* d_final = nullptr);

  const KdaConfig& config() const { return cfg_; }
  const std::string& path() const { return path_; }

  // (checkpoint name relative to the layer, Linear) of every projection, in a fixed order.
  std::vector<std::pair<std::string, Linear*>> linears();
  Param& A_log() { return *A_log_; }
  Param& dt_bias() { return *dt_bias_; }
  Param& o_norm_weight() { return *o_norm_; }
  // The conv weight parameters: one fused [2HK + HV V, 1, W] (glm5_next*) or three (kimi_linear).
  std::vector<Param*> conv_weights() { return conv_params_; }

 private:
  void check_input(const Tensor& x) const;  // x [T, D] on the parameters' device
  struct Conv {
    Param* param = nullptr;  // holds these channels: rows [row0, row0 + channels) of its [C, 1, W]
    int64_t row0 = 0, channels = 0;
  };
  // The forward into a full Saved (s may be null when nothing is saved). With cp, the initial
  // states come from the other ranks (into cp->init) instead of init.
  Tensor run_forward(const Context& ctx, const Tensor& xc, const SeqLayout& seqs,
                     const KdaState& init, Saved* s, KdaState* final_state,
                     KdaCpRun* cp = nullptr) const;
  // [c1 - c0, W] in dt: channels [c0, c1) of part `which` (c1 < 0: to the last).
  Tensor conv_weight(int which, DType dt, int64_t c0 = 0, int64_t c1 = -1) const;
  // The three parts' conv weights as one contiguous [C, W] in dt (a view of the parameter when it
  // holds all three in dt).
  Tensor conv_weights(DType dt) const;
  std::string where() const;  // "KdaLayer 'path'"

  KdaConfig cfg_;
  std::string path_;
  Linear q_proj_, k_proj_, v_proj_, b_proj_, o_proj_;
  std::unique_ptr<Linear> f_a_, f_b_, g_a_, g_b_;  // f_b / g_b are f_proj / g_proj at full rank
  std::vector<Param*> conv_params_;
  Conv conv_[3];  // q, k, v
  Param* A_log_ = nullptr;
  Param* dt_bias_ = nullptr;
  Param* o_norm_ = nullptr;
  std::vector<std::pair<std::string, Linear*>> linears_;
};

}  // namespace hlm
