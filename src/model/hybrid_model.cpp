// HybridModel (model/hybrid_model.h): the decoder layer, the MTP block, the model's forward and
// backward. Every step runs through the layer modules; this file only wires them and owns the
// residual arithmetic of the MTP block, the embedding, the head and the losses.
#include "model/hybrid_model.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <span>

#include "core/enum_names.h"
#include "core/profile.h"
#include "core/rng.h"
#include "core/seq_layout.h"
#include "dist/comm.h"
#include "dist/context_parallel.h"
#include "model/model_cache.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/mhc.h"
#include "ops/tensor_ops.h"

namespace hlm {

namespace {

// Per-layer seeds: the model seed mixed with the layer index and a role tag, so every module's
// initialisation depends only on (seed, layer, role).
uint64_t sub_seed(uint64_t seed, int64_t layer, uint64_t role) {
  uint64_t x = seed ^ (0x9E3779B97F4A7C15ull * uint64_t(layer + 1)) ^ (role << 56);
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  return x;
}

// out = a + b elementwise (same shape, f32 or f64, any strides), on their device (ops/tensor_ops.h:
// one addition per element in a's dtype, the CPU's loop on CPU tensors).
Tensor add(const Tensor& a, const Tensor& b) {
  HLM_CHECK(a.shape() == b.shape() && a.dtype() == b.dtype() && a.device() == b.device(),
            "HybridModel: residual add of {} and {}", a.describe(), b.describe());
  Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
  ops::copy_into(out, a);
  ops::add_(out, b);
  return out;
}

void add_into(Tensor& acc, const Tensor& b) {
  if (!acc.defined()) {
    acc = Tensor::empty(b.shape(), b.dtype(), b.device());
    ops::copy_into(acc, b);
    return;
  }
  acc = add(acc, b);
}

// An integer tensor (i64 / i32, any device) as a contiguous host i64 tensor.
Tensor host_i64(const Tensor& t) {
  const Tensor h = t.is_cpu() ? t : t.to(Device::cpu);
  return h.dtype() == DType::i64 ? h.contiguous() : h.to(DType::i64);
}

// A contiguous host i64 tensor's values.
std::span<const int64_t> host_ids(const Tensor& t) {
  return {t.data<int64_t>(), size_t(t.numel())};
}

// A host tensor on device dev (itself on the CPU).
Tensor on(Device dev, const Tensor& t) {
  return dev == Device::cpu ? t : t.to(dev);
}

// The targets that are not ignored (-100).
int64_t count_targets(const int64_t* t, int64_t n) {
  return int64_t(std::count_if(t, t + n, [](int64_t v) { return v != -100; }));
}

// The output head and its cross-entropy in chunks of rows, so that no [T, V] logits are held
// (training on CUDA): for each chunk the logits, the chunk's row losses, their gradient and the
// head's backward. `count` is the whole batch's count of targets, so every row's dlogits is the
// unchunked one (dloss (softmax - onehot) / count) and the mean is the row losses summed in FP64
// in token order, as the unchunked op sums them. Returns the mean loss and d hidden (dloss
// included); the head's weight gradient accumulates here, in the forward.
struct HeadLoss {
  double loss = 0;
  Tensor d_hidden;
};
HeadLoss chunked_head_loss(const Context& ctx, Linear& head, const Tensor& hidden,
                           const Tensor& targets, int64_t count, double dloss, int64_t rows) {
  const int64_t T = hidden.size(0), V = head.out_features();
  // Chunks of at most 512 MiB of f32 logits unless given.
  if (rows <= 0) rows = std::max<int64_t>(1, (int64_t(1) << 27) / std::max<int64_t>(V, 1));
  HeadLoss r;
  r.d_hidden = Tensor::empty(hidden.shape(), hidden.dtype(), hidden.device());
  double sum = 0;
  for (int64_t r0 = 0; r0 < T; r0 += rows) {
    const int64_t r1 = std::min(T, r0 + rows);
    const Tensor h = ops::contiguous(hidden.slice(0, r0, r1));
    const Tensor tg = targets.slice(0, r0, r1);
    Linear::Saved hs;
    const Tensor logits = head.forward(ctx, h, &hs);
    ops::CrossEntropyResult ce = ops::cross_entropy_forward(logits, tg);
    for (double v : ce.row_loss.to(Device::cpu).to_f64_vector()) sum += v;
    const Tensor dh =
        head.backward(ctx, ops::cross_entropy_backward(logits, tg, ce, dloss, count), hs);
    Tensor dst = r.d_hidden.slice(0, r0, r1);
    ops::copy_into(dst, dh);
  }
  r.loss = count > 0 ? sum / double(count) : 0.0;
  return r;
}

Tensor normal_tensor(const Shape& shape, DType dt, uint64_t seed, uint64_t stream, double std) {
  Tensor t = Tensor::empty(shape, DType::f64);
  Rng rng(seed, stream);
  rng.fill_normal(t, 0.0, std);
  return t.to(dt);
}

// Positions i of each sequence whose successor i+1 is in the same sequence: next[i] = i + 1,
// else -1.
std::vector<int64_t> successors(const std::vector<int64_t>& cu) {
  std::vector<int64_t> next(size_t(cu.back()), -1);
  for (size_t n = 0; n + 1 < cu.size(); ++n)
    for (int64_t i = cu[n]; i + 1 < cu[n + 1]; ++i) next[size_t(i)] = i + 1;
  return next;
}

constexpr auto kRecomputeNames = enum_names<Recompute::full>({"none", "selective", "full"});

}  // namespace

const char* recompute_name(Recompute r) {
  return kRecomputeNames.name(r);
}

Recompute parse_recompute(const std::string& s) {
  return kRecomputeNames.parse(s, "recompute");
}

// ---- layer configs from the model config --------------------------------------------------------

KdaConfig kda_layer_config(const ModelConfig& c) {
  KdaConfig k;
  k.hidden_size = c.hidden_size;
  k.num_heads = c.kda.num_heads;
  k.num_v_heads = c.kda.num_v_heads;
  k.head_k_dim = c.kda.head_dim;
  k.head_v_dim = c.kda.v_head_dim;
  k.conv_kernel = c.kda.conv_kernel;
  k.decay_rank = c.kda.f_lora_rank;
  k.output_gate_rank = c.kda.g_lora_rank;
  k.output_gate_bias = c.kda.output_gate_bias;
  if (c.kda.lower_bound) {
    k.gate = ops::KdaGateKind::lower_bound;
    k.lower_bound = *c.kda.lower_bound;
  } else {
    k.gate = ops::KdaGateKind::standard;
  }
  k.norm_eps = c.rms_norm_eps;
  k.naming = KdaNaming::glm5_next_transformers;
  return k;
}

namespace {
MlaConfig mla_config(const ModelConfig& c, DType dt) {
  MlaConfig m;
  m.hidden_size = c.hidden_size;
  m.num_heads = c.mla.num_heads;
  m.q_lora_rank = c.mla.q_lora_rank;
  m.kv_lora_rank = c.mla.kv_lora_rank;
  m.qk_nope_head_dim = c.mla.qk_nope_head_dim;
  m.qk_rope_head_dim = c.mla.qk_rope_head_dim;
  m.v_head_dim = c.mla.v_head_dim;
  m.rms_norm_eps = c.rms_norm_eps;
  m.rope = !c.mla.use_nope;
  m.rope_theta = c.mla.rope_theta;
  if (!c.mla.rope_scaling.type.empty() && m.rotary()) {
    YarnConfig y;
    y.factor = c.mla.rope_scaling.factor;
    y.original_max_position_embeddings =
        double(c.mla.rope_scaling.original_max_position_embeddings);
    y.beta_fast = c.mla.rope_scaling.beta_fast;
    y.beta_slow = c.mla.rope_scaling.beta_slow;
    y.mscale = c.mla.rope_scaling.mscale;
    y.mscale_all_dim = c.mla.rope_scaling.mscale_all_dim;
    m.yarn = y;
  }
  m.form = MlaForm::absorbed;
  m.param_dtype = dt;
  m.init_std = c.initializer_range;
  return m;
}

bool power_of_two(int64_t x) {
  return x > 0 && (x & (x - 1)) == 0;
}
}  // namespace

DsaLayerConfig dsa_layer_config(const ModelConfig& c, DType dt, uint64_t seed) {
  DsaLayerConfig d;
  d.mla = mla_config(c, dt);
  IndexerConfig ix;
  ix.hidden_size = c.hidden_size;
  ix.q_lora_rank = c.mla.q_lora_rank;
  ix.n_heads = c.indexer.n_heads;
  ix.head_dim = c.indexer.head_dim;
  ix.topk = c.indexer.topk;
  ix.rope_dim = c.mla.applies_rope() ? c.mla.qk_rope_head_dim : 0;
  ix.rope_theta = c.mla.rope_theta;
  ix.rope_interleave = c.indexer.rope_interleave;
  ix.kpool = c.indexer.kpool;
  ix.kpool_always_select_tail = c.indexer.kpool_always_select_tail;
  // The rotation is orthonormal (scores are unchanged in exact arithmetic); it matters for the
  // FP8 scoring path and needs a power-of-two width.
  ix.hadamard = power_of_two(c.indexer.head_dim);
  ix.dtype = dt;
  ix.seed = seed;
  ix.init_std = c.initializer_range;
  d.indexer = ix;
  d.stage = DsaStage::sparse;
  d.indexer_loss = c.indexer.loss_coeff > 0;
  d.indexer_loss_coeff = c.indexer.loss_coeff;
  return d;
}

MoeConfig moe_layer_config(const ModelConfig& c, DType dt, uint64_t seed) {
  MoeConfig m;
  m.hidden_size = c.hidden_size;
  m.n_experts = c.moe.n_routed_experts;
  m.top_k = c.moe.num_experts_per_tok;
  m.n_group = c.moe.n_group;
  m.topk_group = c.moe.topk_group;
  m.norm_topk_prob = c.moe.norm_topk_prob;
  m.routed_scaling_factor = c.moe.routed_scaling_factor;
  m.moe_intermediate_size = c.moe.moe_intermediate_size;
  m.n_shared_experts = c.moe.n_shared_experts;
  m.swiglu_limit = c.swiglu_limit;
  m.aux_loss_coeff = c.moe.router_aux_loss_coef;
  m.dtype = dt;
  m.seed = seed;
  m.init_std = c.initializer_range;
  return m;
}

DenseMlpConfig dense_mlp_config(const ModelConfig& c, DType dt, uint64_t seed) {
  DenseMlpConfig m;
  m.hidden_size = c.hidden_size;
  m.intermediate_size = c.intermediate_size;
  m.swiglu_limit = c.swiglu_limit;
  m.dtype = dt;
  m.seed = seed;
  m.init_std = c.initializer_range;
  return m;
}

MhcSiteConfig mhc_site_config(const ModelConfig& c, DType dt, uint64_t seed) {
  MhcSiteConfig m;
  m.hidden_size = c.hidden_size;
  m.hc_mult = c.mhc.hc_mult;
  m.hc_eps = c.mhc.hc_eps;
  m.norm_eps = c.rms_norm_eps;
  m.sinkhorn_iters = c.mhc.sinkhorn_iters;
  m.init = MhcInit::hf;
  m.naming = MhcNaming::transformers;
  m.init_std = c.initializer_range;
  m.dtype = dt;
  m.seed = seed;
  return m;
}

// The tensor-parallel group of the options (null without one, or for a group of one).
dist::Comm* tp_group(const HybridModelOptions& o) {
  return o.tensor_comm && o.tensor_comm->size() > 1 ? o.tensor_comm : nullptr;
}

// A layer's output or input gradient summed over the tensor-parallel group tp (null: t itself).
Tensor tp_sum(dist::Comm* tp, const Tensor& t) {
  return tp ? dist::allreduce_from(*tp, t) : t;
}

// The sequences of a layout that hold a token (what the MoE sequence aux loss averages over).
int64_t nonempty_seqs(const SeqLayout& seqs) {
  int64_t k = 0;
  for (int64_t q = 0; q < seqs.num_seqs(); ++q) k += seqs.length(q) > 0;
  return k;
}

// Under tensor parallelism: this rank's part of a layer built whole (so that its initial values
// are the whole layer's, drawn as one process draws them) and then sliced.
template <class L, class Cfg, class Init, class Layout>
std::unique_ptr<L> tp_part(dist::Comm& tp, const Cfg& whole_cfg, const Cfg& part_cfg,
                           const Init& make, const Layout& layouts_of) {
  const std::unique_ptr<L> whole = make(whole_cfg);
  std::unique_ptr<L> part = make(part_cfg);
  tp_load_shard(*whole, *part, layouts_of(*whole), tp.rank(), tp.size());
  return part;
}

// ---- the feed-forward block
// ----------------------------------------------------------------------

// The FFN of a decoder layer or of the MTP block (layer `index`): a MoE layer or a dense MLP,
// "<path>" in the checkpoint either way (the owner adds it as its child "mlp").
class FeedForward : public Module {
 public:
  struct Saved {
    DenseMlp::Saved mlp;
    MoeLayer::Saved moe;
    std::vector<int64_t> tp_rows;  // tensor parallel MoE: the ranks' row bounds
    double tp_aux_scale = 1;       // and the factor on its aux loss (tp_moe_forward)
  };
  struct Out {  // MoE only
    double aux_loss = 0;
    Tensor counts, topk;
  };

  FeedForward(const ModelConfig& c, MlpKind kind, int64_t index, const HybridModelOptions& o,
              const std::string& path)
      : tp_(tp_group(o)), tcp_(o.tensor_context_comm) {
    if (kind == MlpKind::moe) {
      MoeConfig m = moe_layer_config(c, o.dtype, sub_seed(o.seed, index, 6));
      if (o.expert_comm && o.expert_comm->size() > 1) {
        ep_ = o.expert_comm;
        m.ep_size = ep_->size();
        m.ep_rank = ep_->rank();
      }
      moe_ = std::make_unique<MoeLayer>(m, c.precision, path);
      add_child("", moe_.get());
    } else {
      const DenseMlpConfig mc = dense_mlp_config(c, o.dtype, sub_seed(o.seed, index, 7));
      auto make = [&](const DenseMlpConfig& k) {
        return std::make_unique<DenseMlp>(k, c.precision, path);
      };
      mlp_ = tp_ ? tp_part<DenseMlp>(*tp_, mc, mlp_tp_config(mc, tp_->size()), make,
                                     [&](DenseMlp&) { return mlp_tp_params(mc); })
                 : make(mc);
      add_child("", mlp_.get());
    }
  }

  MoeLayer* moe() const { return moe_.get(); }

  // cached: a forward over the inference cache, which computes neither the aux loss nor the
  // expert load (each a host read of the selection).
  Tensor forward(const Context& c, const Tensor& x, const SeqLayout& cu, Saved* s, Out* out,
                 const Tensor& replay, bool cached, const dist::CpSlice* cp = nullptr) const {
    if (!moe_) {
      const Tensor y = mlp_->forward(c, x, s ? &s->mlp : nullptr);
      return tp_sum(tp_, y);
    }
    if (tp_) return tp_moe_forward(c, x, cu, s, out, replay, cp);
    MoeLayer::Output o =
        moe_->forward(c, x, cu, s ? &s->moe : nullptr, replay, ep_, /*stats=*/!cached, cp);
    if (out) {
      out->aux_loss = o.aux_loss;
      out->counts = o.counts;
      out->topk = o.topk_idx;
    }
    return o.y;
  }

  Tensor backward(const Context& c, const Tensor& dy, Saved& s, double d_aux) {
    if (moe_ && tp_) {  // this rank's rows of dy, the input gradients gathered back
      const int64_t b0 = s.tp_rows[size_t(tp_->rank())], b1 = s.tp_rows[size_t(tp_->rank()) + 1];
      const Tensor dx =
          moe_->backward(c, ops::contiguous(dy.slice(0, b0, b1)), s.moe, d_aux * s.tp_aux_scale);
      return dist::allgather_rows(*tp_, dx, s.tp_rows);
    }
    if (moe_) return moe_->backward(c, dy, s.moe, d_aux);
    const Tensor dx = mlp_->backward(c, dy, s.mlp);
    return tp_sum(tp_, dx);
  }

 private:
  // Tensor parallel MoE: the layer on this rank's even share of the rows (a context-parallel
  // slice of the batch over the group, so the aux loss of a sequence split between ranks takes
  // the whole sequence's counts), the outputs and selections gathered back. With expert
  // parallelism the share's rows are dispatched over the expert group as a rank's own tokens
  // are (the expert group then spans ranks of other tensor-parallel groups, which hold other
  // tokens). The aux loss and the counts are this rank's share (the model sums them over the
  // group): the layer averages its sequences' shares over its own pieces, so the share is
  // rescaled to the whole batch's sequence count (as data parallelism's aux_sequences does).
  // Under context parallelism (cp) the rows are the slice's, and the share is a slice of the whole
  // batch over the tensor-context group (HybridModelOptions::tensor_context_comm): every tensor
  // group's slice split over its ranks, in (context rank, tensor rank) order.
  Tensor tp_moe_forward(const Context& c, const Tensor& x, const SeqLayout& cu, Saved* s, Out* out,
                        const Tensor& replay, const dist::CpSlice* cp) const {
    const int64_t T = x.size(0), n = tp_->size();
    HLM_CHECK(T >= n,
              "HybridModel: a tensor-parallel MoE layer splits the batch's rows over the group's "
              "{} ranks, but the batch has {} tokens",
              n, T);
    std::vector<int64_t> bounds;  // the rows of each tensor rank, within x
    for (int64_t b : dist::CpSlice::even_bounds(T, int(n))) bounds.push_back(b);
    std::optional<dist::CpSlice> slice;
    int64_t off = 0;  // the first row of x in the slice's global layout
    if (cp) {
      const int nc = cp->size();
      std::vector<int64_t> all;
      for (int q = 0; q < nc; ++q) {
        HLM_CHECK(cp->tokens(q) >= n,
                  "HybridModel: context rank {} holds {} tokens, fewer than the {} tensor ranks "
                  "that split its MoE rows",
                  q, cp->tokens(q), n);
        const std::vector<int64_t> e = dist::CpSlice::even_bounds(cp->tokens(q), int(n));
        for (int r = 0; r < n; ++r) all.push_back(cp->begin(q) + e[size_t(r)]);
      }
      all.push_back(cp->global().total_tokens());
      slice.emplace(*tcp_, cp->global(), all);
      off = cp->begin(cp->rank());
    } else {
      slice.emplace(*tp_, cu, bounds);
    }
    const int64_t b0 = bounds[size_t(tp_->rank())], b1 = bounds[size_t(tp_->rank()) + 1];
    HLM_CHECK(slice->begin(slice->rank()) == off + b0 && slice->end(slice->rank()) == off + b1,
              "HybridModel: the tensor-parallel MoE rows do not match the slice");
    const Tensor rp = replay.defined() ? ops::contiguous(replay.slice(0, b0, b1)) : Tensor();
    MoeLayer::Output o = moe_->forward(c, ops::contiguous(x.slice(0, b0, b1)), slice->local(),
                                       s ? &s->moe : nullptr, rp, ep_, /*stats=*/true, &*slice);
    const double aux_scale = double(nonempty_seqs(slice->local())) / double(nonempty_seqs(cu));
    if (s) {
      s->tp_rows = bounds;
      s->tp_aux_scale = aux_scale;
    }
    if (out) {
      out->aux_loss = o.aux_loss * aux_scale;
      out->counts = o.counts;
      out->topk = dist::allgather_rows(*tp_, o.topk_idx, bounds);
    }
    return dist::allgather_rows(*tp_, o.y, bounds);
  }

  std::unique_ptr<MoeLayer> moe_;
  std::unique_ptr<DenseMlp> mlp_;
  dist::Comm* ep_ = nullptr;   // the expert-parallel group (HybridModelOptions::expert_comm)
  dist::Comm* tp_ = nullptr;   // the tensor-parallel group (HybridModelOptions::tensor_comm)
  dist::Comm* tcp_ = nullptr;  // HybridModelOptions::tensor_context_comm
};

// ---- the decoder layer --------------------------------------------------------------------------

// A decoder layer's part of a forward over a cache: the cache, the batch's slots, the layer.
struct CacheCall {
  ModelCache* cache = nullptr;
  const std::vector<int64_t>* slots = nullptr;
  int64_t layer = 0;
  bool draft_last = false;  // every sequence is [token, draft]: keep the KDA states between them
};

// A context-parallel forward (ModelInputs::cp): this rank's slice and the KDA layers' mode.
struct CpCall {
  const dist::CpSlice* slice = nullptr;
  KdaCpMode mode = KdaCpMode::chunkwise;
};

// Rows `rows` of x [T, D] as [R, D], and the inverse: y's rows written at `rows` of out.
Tensor rows_of(const Tensor& x, const std::vector<int64_t>& rows) {
  return ops::gather_rows(ops::contiguous(x), rows);
}

// The most tokens of a call over the cache whose mHC sites run collapse and norm as one pass
// (ops::mhc_collapse_norm: each token reads the site's whole projection, so it is for decode
// steps; a prefill takes the cuBLAS projection).
constexpr int64_t kFusedCollapseTokens = 64;

// A DSA layer initialised from `seed` (its indexer from its config's seed); under tensor
// parallelism this rank's part of it, whose indexer loss target is summed over the group.
std::unique_ptr<DsaLayer> make_dsa(const DsaLayerConfig& d, const PrecisionPolicy& pol,
                                   const std::string& path, uint64_t seed, dist::Comm* tp) {
  auto make = [&](const DsaLayerConfig& k) {
    auto l = std::make_unique<DsaLayer>(k, pol, path);
    l->init_weights(seed);
    return l;
  };
  if (!tp) return make(d);
  auto part = tp_part<DsaLayer>(*tp, d, dsa_tp_config(d, tp->size()), make,
                                [](DsaLayer& whole) { return dsa_tp_params(whole); });
  part->set_tensor_parallel(tp);
  return part;
}

// One decoder layer: attention site (attn_hc, input_layernorm, self_attn) and FFN site (ffn_hc,
// post_attention_layernorm, mlp). Also used without mHC (plain residual) when mhc is off.
class DecoderLayer : public Module {
 public:
  struct Saved {
    Tensor x;           // input streams [T, n, D] (always kept)
    Tensor given;       // the DSA selection given to the forward (kept for the re-run)
    CpCall cp;          // context parallel (kept for the re-run)
    bool full = false;  // false under Recompute::full: backward re-runs the layer
    MhcSite::Saved attn_site, ffn_site;
    RmsNorm::Saved in_norm, post_norm;
    KdaLayer::Saved kda;
    DsaLayer::Saved dsa;
    FeedForward::Saved ffn;
  };
  struct Out : FeedForward::Out {
    double indexer_loss = 0;
    int64_t indexer_rows = 0;  // the rows the indexer loss averages over (0: none)
    Tensor indices;            // DSA only: the attended sets
  };

  DecoderLayer(const ModelConfig& c, int64_t index, const HybridModelOptions& o)
      : recompute_(o.recompute), mhc_(c.mhc.enabled), tp_(tp_group(o)) {
    const std::string path = "model.layers." + std::to_string(index);
    const DType dt = o.dtype;
    const PrecisionPolicy& pol = c.precision;
    if (mhc_) {
      attn_hc_ = std::make_unique<MhcSite>(mhc_site_config(c, dt, sub_seed(o.seed, index, 1)),
                                           MhcSiteKind::attn, pol, path);
      ffn_hc_ = std::make_unique<MhcSite>(mhc_site_config(c, dt, sub_seed(o.seed, index, 2)),
                                          MhcSiteKind::ffn, pol, path);
      add_child("", attn_hc_.get());
      add_child("", ffn_hc_.get());
    }
    in_norm_ = std::make_unique<RmsNorm>(RmsNormConfig{c.hidden_size, c.rms_norm_eps, dt},
                                         path + ".input_layernorm");
    post_norm_ = std::make_unique<RmsNorm>(RmsNormConfig{c.hidden_size, c.rms_norm_eps, dt},
                                           path + ".post_attention_layernorm");
    add_child("input_layernorm", in_norm_.get());
    add_child("post_attention_layernorm", post_norm_.get());
    const std::string attn_path = path + ".self_attn";
    switch (c.layer_kind(index)) {
      case LayerKind::kda: {
        const KdaConfig kc = kda_layer_config(c);
        auto make = [&](const KdaConfig& k) {
          auto l = std::make_unique<KdaLayer>(k, pol, attn_path, dt);
          l->init_weights(sub_seed(o.seed, index, 3), c.initializer_range);
          return l;
        };
        kda_ = tp_ ? tp_part<KdaLayer>(*tp_, kc, kda_tp_config(kc, tp_->size()), make,
                                       [&](KdaLayer&) { return kda_tp_params(kc); })
                   : make(kc);
        add_child("self_attn", kda_.get());
        break;
      }
      case LayerKind::dsa:
      case LayerKind::mla: {
        DsaLayerConfig d = dsa_layer_config(c, dt, sub_seed(o.seed, index, 4));
        // Dense MLA layers and "shared" DSA layers (which attend the previous DSA layer's
        // selection) have no indexer of their own.
        shared_ = c.layer_kind(index) == LayerKind::dsa && !c.indexer_kinds.empty() &&
                  c.indexer_kinds[size_t(index)] == IndexerKind::shared;
        if (c.layer_kind(index) == LayerKind::mla || shared_) d.indexer.reset();
        if (!d.indexer) d.indexer_loss = false;
        dsa_ = make_dsa(d, pol, attn_path, sub_seed(o.seed, index, 5), tp_);
        add_child("self_attn", dsa_.get());
        break;
      }
    }
    ffn_ = std::make_unique<FeedForward>(c, c.mlp_kind(index), index, o, path + ".mlp");
    add_child("mlp", ffn_.get());
  }

  bool is_moe() const { return ffn_->moe() != nullptr; }
  MoeLayer* moe() { return ffn_->moe(); }
  DsaLayer* dsa() { return dsa_.get(); }
  KdaLayer* kda() { return kda_.get(); }
  bool is_dsa() const { return dsa_ != nullptr; }
  bool shares_selection() const { return shared_; }

  // X [T, n, D] -> X' [T, n, D]. given: the DSA selection to attend (undefined: the layer's own).
  Tensor forward(const Context& ctx, const Tensor& x, const SeqLayout& cu, Saved* s, Out* out,
                 const Tensor& replay, const Tensor& given, const CacheCall* cc = nullptr,
                 const CpCall& cp = {}) const {
    if (cc) {
      Saved local;
      return run(ctx, x, cu, &local, out, replay, given, cc);
    }
    if (ctx.training && s && recompute_ == Recompute::full) {
      Saved local;
      local.cp = cp;
      Tensor y = run(ctx, x, cu, &local, out, replay, given);
      s->x = x;
      s->given = given;
      s->cp = cp;
      s->full = false;
      return y;
    }
    if (s) s->full = true;
    Saved local;
    Saved& w = s ? *s : local;
    w.cp = cp;
    return run(ctx, x, cu, &w, out, replay, given);
  }

  // dX' -> dX; parameter grads +=. d_aux: weight of the MoE aux loss; indexer_scale: of the
  // indexer loss.
  Tensor backward(const Context& ctx, const Tensor& dx_out, Saved& s, const SeqLayout& cu,
                  double d_aux, double indexer_scale, const Tensor& replay) {
    if (!s.full) {
      // Full recompute: re-run the layer (deterministic: the same selection and routing).
      Saved again;
      again.cp = s.cp;
      Out ignored;
      run(ctx, s.x, cu, &again, &ignored, replay, s.given);
      return run_backward(ctx, dx_out, again, d_aux, indexer_scale);
    }
    return run_backward(ctx, dx_out, s, d_aux, indexer_scale);
  }

 private:
  // A site's sublayer input from the streams x [T, n, D]: the mHC collapse (hc null: no mHC, x
  // is [T, 1, D]) and the norm, or both in one pass (fused: a decode step over the cache).
  static Tensor site_input(const Context& c, const Tensor& x, const MhcSite* hc,
                           const RmsNorm& norm, MhcSite::Saved& hs, RmsNorm::Saved* ns,
                           bool fused) {
    if (fused) return hc->collapse_norm(x, norm.weight_value(), norm.config().eps, hs);
    const Tensor u = hc ? hc->collapse(c, x, hs) : x.reshape({x.size(0), x.size(2)});
    return norm.forward(c, u, ns);
  }

  Context sub_ctx(const Context& ctx) const {
    Context c = ctx;
    c.recompute = ctx.training && recompute_ == Recompute::selective;
    return c;
  }

  Tensor run(const Context& ctx, const Tensor& x, const SeqLayout& cu, Saved* s, Out* out,
             const Tensor& replay, const Tensor& given, const CacheCall* cc = nullptr) const {
    const Context c = sub_ctx(ctx);
    const bool train = ctx.training;
    s->x = x;
    const int64_t T = x.size(0), D = x.size(2);
    // Attention site.
    profile::Scope ps_hc("mhc + norm");
    // A decode step over the cache: each site's collapse and its norm in one pass.
    const bool fused = mhc_ && cc && !train && T <= kFusedCollapseTokens;
    Tensor a = site_input(c, x, attn_hc_.get(), *in_norm_, s->attn_site,
                          train ? &s->in_norm : nullptr, fused);
    ps_hc.end();
    profile::Scope ps_att(kda_ ? "kda layer" : "dsa layer");
    Tensor y;
    if (kda_ && cc && cc->draft_last) {
      // [token, draft] per sequence: the token from the slots' states, then the draft from the
      // states after the token; both kept (the draft's until ModelCache::accept_drafts).
      const int64_t N = cu.num_seqs();
      std::vector<int64_t> first, last;
      for (int64_t n = 0; n < N; ++n) first.push_back(2 * n), last.push_back(2 * n + 1);
      const SeqLayout ones = SeqLayout::from_lengths(std::vector<int64_t>(size_t(N), 1));
      const KdaState init = cc->cache->kda_states(cc->layer, *cc->slots);
      KdaState mid, fin;
      const Tensor y1 = kda_->forward(c, rows_of(a, first), ones, &init, nullptr, &mid);
      const Tensor y2 = kda_->forward(c, rows_of(a, last), ones, &mid, nullptr, &fin);
      cc->cache->store_kda_states(cc->layer, *cc->slots, mid);
      cc->cache->store_kda_draft_states(cc->layer, *cc->slots, fin);
      y = Tensor::empty({T, D}, y1.dtype(), y1.device());
      ops::scatter_rows(y, first, ops::contiguous(y1));
      ops::scatter_rows(y, last, ops::contiguous(y2));
    } else if (kda_ && cc && T == cu.num_seqs() && a.dtype() == DType::f32) {
      // A decode step (one token per sequence): the recurrent states advance in place.
      y = kda_->decode_step(a, cc->cache->kda_pool(cc->layer), *cc->slots);
    } else if (kda_ && cc) {
      // Continue from the slots' states and keep the final ones.
      const KdaState init = cc->cache->kda_states(cc->layer, *cc->slots);
      KdaState fin;
      y = kda_->forward(c, a, cu, &init, nullptr, &fin);
      cc->cache->store_kda_states(cc->layer, *cc->slots, fin);
    } else if (kda_ && s->cp.slice) {
      y = kda_->forward(c, a, *s->cp.slice, train ? &s->kda : nullptr, s->cp.mode);
      y = tp_sum(tp_, y);
    } else if (kda_) {
      y = kda_->forward(c, a, cu, nullptr, train ? &s->kda : nullptr);
      y = tp_sum(tp_, y);
    } else {
      DsaCacheView view;
      if (cc) view = cc->cache->dsa_view(cc->layer, *cc->slots);
      DsaLayer::Output o =
          cc ? dsa_->forward_cached(a, cu, view, given)
             : dsa_->forward(c, a, cu, train ? &s->dsa : nullptr, given, s->cp.slice);
      y = tp_sum(tp_, o.y);
      if (out) {
        if (o.has_indexer_loss) {
          out->indexer_loss = o.indexer_loss;
          out->indexer_rows = o.indexer_loss_rows;
        }
        out->indices = o.indices;
      }
    }
    ps_att.end();
    profile::Scope ps_hc2("mhc + norm");
    Tensor x1 = mhc_ ? attn_hc_->write_back(c, y, s->attn_site) : add(x, y.reshape({T, 1, D}));
    // FFN site.
    Tensor b = site_input(c, x1, ffn_hc_.get(), *post_norm_, s->ffn_site,
                          train ? &s->post_norm : nullptr, fused);
    ps_hc2.end();
    profile::Scope ps_ffn(ffn_->moe() ? "moe" : "mlp");
    Tensor f =
        ffn_->forward(c, b, cu, train ? &s->ffn : nullptr, out, replay, cc != nullptr, s->cp.slice);
    ps_ffn.end();
    HLM_PROFILE("mhc + norm");
    return mhc_ ? ffn_hc_->write_back(c, f, s->ffn_site) : add(x1, f.reshape({T, 1, D}));
  }

  Tensor run_backward(const Context& ctx, const Tensor& dx2, Saved& s, double d_aux,
                      double indexer_scale) {
    const Context c = sub_ctx(ctx);
    const int64_t T = dx2.size(0), D = dx2.size(2);
    // FFN site.
    profile::Scope ps_hc("mhc + norm");
    MhcSite::Partial p2;
    Tensor dy2;
    if (mhc_) {
      p2 = ffn_hc_->backward_write_back(c, dx2, s.ffn_site);
      dy2 = p2.dy;
    } else {
      dy2 = dx2.reshape({T, D});
    }
    ps_hc.end();
    profile::Scope ps_ffn(ffn_->moe() ? "moe" : "mlp");
    Tensor db = ffn_->backward(c, dy2, s.ffn, d_aux);
    ps_ffn.end();
    profile::Scope ps_hc2("mhc + norm");
    Tensor du2 = post_norm_->backward(c, db, s.post_norm);
    Tensor dx1 = mhc_ ? ffn_hc_->backward_collapse(c, du2, s.ffn_site, p2)
                      : add(dx2, du2.reshape({T, 1, D}));
    // Attention site.
    MhcSite::Partial p1;
    Tensor dy1;
    if (mhc_) {
      p1 = attn_hc_->backward_write_back(c, dx1, s.attn_site);
      dy1 = p1.dy;
    } else {
      dy1 = dx1.reshape({T, D});
    }
    ps_hc2.end();
    profile::Scope ps_att(kda_ ? "kda layer" : "dsa layer");
    Tensor da =
        kda_ ? kda_->backward(c, dy1, s.kda).dx : dsa_->backward(c, dy1, s.dsa, indexer_scale);
    da = tp_sum(tp_, da);
    ps_att.end();
    HLM_PROFILE("mhc + norm");
    Tensor du = in_norm_->backward(c, da, s.in_norm);
    return mhc_ ? attn_hc_->backward_collapse(c, du, s.attn_site, p1)
                : add(dx1, du.reshape({T, 1, D}));
  }

  Recompute recompute_;
  bool mhc_;
  dist::Comm* tp_;  // the tensor-parallel group (HybridModelOptions::tensor_comm) or null
  bool shared_ = false;
  std::unique_ptr<MhcSite> attn_hc_, ffn_hc_;
  std::unique_ptr<RmsNorm> in_norm_, post_norm_;
  std::unique_ptr<KdaLayer> kda_;
  std::unique_ptr<DsaLayer> dsa_;
  std::unique_ptr<FeedForward> ffn_;
};

// ---- the MTP block ------------------------------------------------------------------------------

class MtpBlock : public Module {
 public:
  struct Saved {
    Tensor x;  // [T, D] the block input m (as recompute keeps it)
    RmsNorm::Saved enorm, hnorm, in_norm, post_norm, head_norm;
    Linear::Saved eh;
    DsaLayer::Saved dsa;
    FeedForward::Saved ffn;
  };
  struct Out : FeedForward::Out {
    double indexer_loss = 0;
    int64_t indexer_rows = 0;
  };

  MtpBlock(const ModelConfig& c, const HybridModelOptions& o)
      : recompute_(o.recompute), tp_(tp_group(o)) {
    const int64_t L = c.num_hidden_layers, D = c.hidden_size;
    const std::string path = "model.layers." + std::to_string(L);
    const DType dt = o.dtype;
    // keep_mtp_spec_in_bf16: the MTP block's own projection never runs FP8 (role mtp).
    PrecisionPolicy pol = c.precision;
    enorm_ = std::make_unique<RmsNorm>(RmsNormConfig{D, c.rms_norm_eps, dt}, path + ".enorm");
    hnorm_ = std::make_unique<RmsNorm>(RmsNormConfig{D, c.rms_norm_eps, dt}, path + ".hnorm");
    eh_.init(2 * D, D, false, pol.resolve(path + ".eh_proj", ModuleRole::mtp), dt);
    eh_.weight().value =
        normal_tensor({D, 2 * D}, dt, sub_seed(o.seed, L, 8), 0, c.initializer_range);
    in_norm_ =
        std::make_unique<RmsNorm>(RmsNormConfig{D, c.rms_norm_eps, dt}, path + ".input_layernorm");
    post_norm_ = std::make_unique<RmsNorm>(RmsNormConfig{D, c.rms_norm_eps, dt},
                                           path + ".post_attention_layernorm");
    head_norm_ =
        std::make_unique<RmsNorm>(RmsNormConfig{D, c.rms_norm_eps, dt}, path + ".shared_head.norm");
    DsaLayerConfig d = dsa_layer_config(c, dt, sub_seed(o.seed, L, 4));
    dsa_ = make_dsa(d, pol, path + ".self_attn", sub_seed(o.seed, L, 5), tp_);
    ffn_ = std::make_unique<FeedForward>(c, c.mtp_mlp_kind(), L, o, path + ".mlp");
    add_child("enorm", enorm_.get());
    add_child("hnorm", hnorm_.get());
    add_child("eh_proj", &eh_);
    add_child("input_layernorm", in_norm_.get());
    add_child("self_attn", dsa_.get());
    add_child("post_attention_layernorm", post_norm_.get());
    add_child("mlp", ffn_.get());
    add_child("shared_head.norm", head_norm_.get());
  }

  bool is_moe() const { return ffn_->moe() != nullptr; }
  MoeLayer* moe() { return ffn_->moe(); }
  DsaLayer* dsa() { return dsa_.get(); }

  // e [T, D] (embedding of the next token, zeros where there is none), h [T, D] (the main
  // stack's mean-contracted hidden) -> the normed output [T, D] for the shared head.
  // cp: context parallel (ModelInputs::cp): the DSA layer and the MoE take the slice.
  Tensor forward(const Context& ctx, const Tensor& e, const Tensor& h, const SeqLayout& cu,
                 Saved* s, Out* out, const Tensor& replay, const CacheCall* cc = nullptr,
                 const dist::CpSlice* cp = nullptr) const {
    Context c = ctx;
    c.recompute = ctx.training && recompute_ == Recompute::selective;
    const bool train = ctx.training && s;
    const int64_t T = e.size(0), D = e.size(1);
    Tensor en = enorm_->forward(c, e, train ? &s->enorm : nullptr);
    Tensor hn = hnorm_->forward(c, h, train ? &s->hnorm : nullptr);
    Tensor cat = Tensor::empty({T, 2 * D}, en.dtype(), en.device());
    Tensor cat_e = cat.slice(1, 0, D), cat_h = cat.slice(1, D, 2 * D);
    ops::copy_into(cat_e, en);  // [e; h]: embedding first (docs/model.md, "MTP")
    ops::copy_into(cat_h, hn);
    Tensor m = eh_.forward(c, cat, train ? &s->eh : nullptr);
    Tensor a = in_norm_->forward(c, m, train ? &s->in_norm : nullptr);
    DsaCacheView view;
    if (cc) view = cc->cache->dsa_view(cc->layer, *cc->slots);
    DsaLayer::Output o = cc ? dsa_->forward_cached(a, cu, view)
                            : dsa_->forward(c, a, cu, train ? &s->dsa : nullptr, Tensor(), cp);
    if (out && o.has_indexer_loss) {
      out->indexer_loss = o.indexer_loss;
      out->indexer_rows = o.indexer_loss_rows;
    }
    Tensor m2 = add(m, tp_sum(tp_, o.y));
    Tensor b = post_norm_->forward(c, m2, train ? &s->post_norm : nullptr);
    Tensor f = ffn_->forward(c, b, cu, train ? &s->ffn : nullptr, out, replay, cc != nullptr, cp);
    Tensor m3 = add(m2, f);
    return head_norm_->forward(c, m3, train ? &s->head_norm : nullptr);
  }

  // d(output) -> (d e, d h); parameter grads +=.
  std::pair<Tensor, Tensor> backward(const Context& ctx, const Tensor& dout, Saved& s, double d_aux,
                                     double indexer_scale) {
    Context c = ctx;
    c.recompute = ctx.training && recompute_ == Recompute::selective;
    const int64_t D = dout.size(1);
    Tensor dm3 = head_norm_->backward(c, dout, s.head_norm);
    Tensor db = ffn_->backward(c, dm3, s.ffn, d_aux);
    Tensor dm2 = add(dm3, post_norm_->backward(c, db, s.post_norm));
    Tensor da = dsa_->backward(c, dm2, s.dsa, indexer_scale);
    da = tp_sum(tp_, da);
    Tensor dm = add(dm2, in_norm_->backward(c, da, s.in_norm));
    Tensor dcat = eh_.backward(c, dm, s.eh);
    Tensor de = enorm_->backward(c, ops::contiguous(dcat.slice(1, 0, D)), s.enorm);
    Tensor dh = hnorm_->backward(c, ops::contiguous(dcat.slice(1, D, 2 * D)), s.hnorm);
    return {de, dh};
  }

 private:
  Recompute recompute_;
  dist::Comm* tp_;  // the tensor-parallel group (HybridModelOptions::tensor_comm) or null
  std::unique_ptr<RmsNorm> enorm_, hnorm_, in_norm_, post_norm_, head_norm_;
  Linear eh_;
  std::unique_ptr<DsaLayer> dsa_;
  std::unique_ptr<FeedForward> ffn_;
};

// ---- the model ----------------------------------------------------------------------------------

struct HybridModel::Saved {
  Tensor tokens, targets;          // host i64
  Tensor tokens_dev, targets_dev;  // the same on the parameters' device
  SeqLayout seqs;
  std::vector<int64_t> cu_vec;
  bool training = false;
  bool aux = true;
  // The gradient factors of the losses' shares (ModelInputs' normalizers): 1 in a one-part step.
  double aux_scale = 1;  // non-empty sequences here / aux_sequences
  int64_t lm_norm = 0;   // the main CE's denominator (0: its own count)
  int64_t mtp_norm = 0;  // the MTP CE's
  std::vector<DecoderLayer::Saved> layers;
  std::vector<Tensor> replay;  // per MoE layer (as given)
  Tensor h;                    // [T, D] mean-contracted hidden (before model.norm)
  RmsNorm::Saved norm;
  Tensor hidden;
  // main loss
  bool has_lm = false;
  bool has_processor = false;
  Tensor d_hidden_processor;  // from the output processor
  Linear::Saved head;
  Tensor logits;
  ops::CrossEntropyResult ce;
  // The chunked head + loss (chunked_head_loss): d hidden computed in the forward.
  bool fused_head = false;
  Tensor d_hidden_head;
  // MTP
  bool has_mtp = false;
  double mtp_scale = 0;
  Tensor next_tokens;  // [T] i64 (0 where there is no next token), on the parameters' device
  Tensor next_valid;   // [T] u8
  Tensor mtp_targets;  // [T] i64, on the parameters' device
  MtpBlock::Saved mtp;
  Linear::Saved mtp_head;
  Tensor mtp_logits;
  ops::CrossEntropyResult mtp_ce;
  bool mtp_fused = false;
  Tensor d_mtp_out;  // the chunked MTP head's d(MTP block output)
};

void HybridModel::SavedDeleter::operator()(Saved* s) const {
  delete s;
}

HybridModel::HybridModel(const ModelConfig& config, const HybridModelOptions& options)
    : cfg_(config), opt_(options) {
  cfg_.validate();
  HLM_CHECK(opt_.dtype == DType::f64 || opt_.dtype == DType::f32 || opt_.dtype == DType::bf16,
            "HybridModel: dtype must be f64, f32 or bf16, got {}", dtype_name(opt_.dtype));
  const int64_t V = cfg_.vocab_size, D = cfg_.hidden_size;
  embed_ = &add_param("model.embed_tokens.weight",
                      normal_tensor({V, D}, opt_.dtype, opt_.seed, 1, cfg_.initializer_range));
  for (int64_t l = 0; l < cfg_.num_hidden_layers; ++l) {
    layers_.push_back(std::make_unique<DecoderLayer>(cfg_, l, opt_));
    add_child("model.layers." + std::to_string(l), layers_.back().get());
  }
  norm_ = std::make_unique<RmsNorm>(RmsNormConfig{D, cfg_.rms_norm_eps, opt_.dtype}, "model.norm");
  add_child("model.norm", norm_.get());
  // The head: lm_head.weight [V, D], or the embedding's table when tied (a Linear outside the
  // parameter tree whose weight is pointed at the embedding before each use).
  lm_head_ = std::make_unique<Linear>(
      D, V, false, cfg_.precision.resolve("lm_head", ModuleRole::lm_head), opt_.dtype);
  if (cfg_.tie_word_embeddings) {
    lm_head_->weight().value = embed_->value;
  } else {
    lm_head_->weight().value =
        normal_tensor({V, D}, opt_.dtype, opt_.seed, 2, cfg_.initializer_range);
    add_child("lm_head", lm_head_.get());
  }
  if (opt_.mtp && cfg_.mtp.num_layers > 0) {
    HLM_CHECK(cfg_.mtp.num_layers == 1,
              "HybridModel: num_nextn_predict_layers = {}: one MTP depth is supported",
              cfg_.mtp.num_layers);
    mtp_ = std::make_unique<MtpBlock>(cfg_, opt_);
    add_child("model.layers." + std::to_string(cfg_.num_hidden_layers), mtp_.get());
  }
}

HybridModel::~HybridModel() = default;

DType HybridModel::compute_dtype() const {
  return hlm::compute_dtype(opt_.dtype);
}

void HybridModel::set_dsa_stage(DsaStage stage) {
  for (auto& l : layers_)
    if (l->dsa()) l->dsa()->set_stage(stage);
  if (mtp_) mtp_->dsa()->set_stage(stage);
}

Device HybridModel::device() const {
  return embed_->value.device();
}

Tensor HybridModel::mtp_forward_cached(const Tensor& next_tokens, const Tensor& h,
                                       const SeqLayout& seqs, ModelCache& cache,
                                       const std::vector<int64_t>& slots) const {
  HLM_CHECK(mtp_ != nullptr, "HybridModel::mtp_forward_cached: the model has no MTP block");
  HLM_CHECK(cache.speculative(),
            "HybridModel::mtp_forward_cached: the cache was made without speculative");
  const Device dev = embed_->value.device();
  HLM_CHECK(cache.device() == dev,
            "HybridModel::mtp_forward_cached: the cache is on {}, the model on {}",
            device_name(cache.device()), device_name(dev));
  const int64_t R = next_tokens.defined() ? next_tokens.numel() : 0, D = cfg_.hidden_size;
  HLM_CHECK(R >= 1 && next_tokens.dim() == 1 && h.defined() && h.shape() == (Shape{R, D}),
            "HybridModel::mtp_forward_cached: next_tokens [R >= 1] and h [R, {}], got {} and {}", D,
            next_tokens.defined() ? next_tokens.describe() : "undefined",
            h.defined() ? h.describe() : "undefined");
  seqs.check_tokens(R, "HybridModel::mtp_forward_cached");
  HLM_CHECK(int64_t(slots.size()) == seqs.num_seqs(),
            "HybridModel::mtp_forward_cached: {} slots for {} sequences", slots.size(),
            seqs.num_seqs());
  const DType cdt = compute_dtype();
  const Tensor tok = host_i64(next_tokens);
  for (int64_t r = 0; r < R; ++r)
    HLM_CHECK(tok.data<int64_t>()[r] >= 0 && tok.data<int64_t>()[r] < cfg_.vocab_size,
              "HybridModel::mtp_forward_cached: next token {} is outside [0, {})",
              tok.data<int64_t>()[r], cfg_.vocab_size);
  std::vector<int64_t> counts;
  for (int64_t n = 0; n < seqs.num_seqs(); ++n) counts.push_back(seqs.length(n));
  // The MTP rows lie in the main sequence's pages: they may not run ahead of it.
  for (size_t n = 0; n < slots.size(); ++n)
    HLM_CHECK(cache.mtp_length(slots[n]) + counts[n] <= cache.length(slots[n]),
              "HybridModel::mtp_forward_cached: slot {} has {} tokens, {} MTP rows and {} more "
              "asked",
              slots[n], cache.length(slots[n]), cache.mtp_length(slots[n]), counts[n]);
  Context ctx;
  ctx.training = false;
  const Tensor e =
      ops::as_dtype(ops::embedding_forward(embed_->value, on(dev, tok), host_ids(tok)), cdt);
  const CacheCall cc{&cache, &slots, cache.mtp_layer(), false};
  const Tensor o =
      mtp_->forward(ctx, e, ops::as_dtype(on(dev, h), cdt), seqs, nullptr, nullptr, Tensor(), &cc);
  cache.advance_mtp(slots, counts);
  if (cfg_.tie_word_embeddings) lm_head_->weight().value = embed_->value;
  return lm_head_->forward(ctx, o, nullptr);
}

std::vector<Param*> HybridModel::expert_params() {
  std::vector<Param*> v;
  auto add = [&](MoeLayer* m) {
    v.push_back(&m->experts_gate_up());
    v.push_back(&m->experts_down());
  };
  for (const auto& l : layers_)
    if (l->is_moe()) add(l->moe());
  if (mtp_ && mtp_->is_moe()) add(mtp_->moe());
  return v;
}

int64_t HybridModel::num_moe_layers() const {
  int64_t n = 0;
  for (const auto& l : layers_) n += l->is_moe();
  if (mtp_) n += mtp_->is_moe();
  return n;
}

ModelOutput HybridModel::forward(const Context& ctx, const ModelInputs& in, SavedPtr* saved) const {
  HLM_CHECK(in.tokens.defined() && in.tokens.dim() == 1 && in.tokens.size(0) >= 1,
            "HybridModel::forward: tokens must be [T >= 1] token ids, got {}",
            in.tokens.defined() ? in.tokens.describe() : "undefined");
  // Integer ids only: a float id would be truncated (5.7 -> 5) or, for NaN, have no value.
  HLM_CHECK(in.tokens.dtype() == DType::i64 || in.tokens.dtype() == DType::i32,
            "HybridModel::forward: tokens must be i64 or i32 token ids, got {}",
            in.tokens.describe());
  const int64_t T = in.tokens.size(0), D = cfg_.hidden_size;
  const DType cdt = compute_dtype();
  // Token ids and targets are read on the host (checks, MTP's next tokens) and used on the
  // parameters' device.
  const Device dev = embed_->value.device();
  Tensor tokens = host_i64(in.tokens);
  // The batch's sequences, checked once (the tensor as given: i64 / i32 only, then the values);
  // under context parallelism the slice's own.
  const SeqLayout seqs = [&] {
    if (!in.cp) return SeqLayout::from_tensor(in.cu_seqlens, T, "HybridModel::forward: cu_seqlens");
    const dist::CpSlice& cp = *in.cp;
    HLM_CHECK(T == cp.tokens(cp.rank()),
              "HybridModel::forward: context-parallel rank {} holds {} tokens, tokens has {}",
              cp.rank(), cp.tokens(cp.rank()), T);
    if (in.cu_seqlens.defined())
      HLM_CHECK(
          SeqLayout::from_tensor(in.cu_seqlens, T, "HybridModel::forward: cu_seqlens").offsets() ==
              cp.local().offsets(),
          "HybridModel::forward: under context parallelism cu_seqlens must be the slice's "
          "own layout (or undefined)");
    return cp.local();
  }();
  const std::vector<int64_t>& cu_vec = seqs.offsets();
  const bool has_targets = in.targets.defined();
  dist::Comm* tp = tp_group(opt_);
  if (tp)
    HLM_CHECK(in.cache == nullptr,
              "HybridModel::forward: a tensor-parallel model does not run over a cache yet");
  if (tp && in.cp) {
    const dist::Comm* tcp = opt_.tensor_context_comm;
    HLM_CHECK(tcp && tcp->size() == in.cp->size() * tp->size() &&
                  tcp->rank() == in.cp->rank() * tp->size() + tp->rank(),
              "HybridModel::forward: tensor and context parallelism together need "
              "HybridModelOptions::tensor_context_comm: the {} x {} ranks of this part of the "
              "batch, ordered by (context rank, tensor rank)",
              in.cp->size(), tp->size());
  }
  if (in.cp) {
    HLM_CHECK(in.cache == nullptr,
              "HybridModel::forward: a forward over a cache does not run context parallel");
  }
  if (has_targets)
    HLM_CHECK(in.targets.dim() == 1 && in.targets.size(0) == T,
              "HybridModel::forward: targets must be [{}], got {}", T, in.targets.describe());
  const int64_t n_moe = num_moe_layers();
  HLM_CHECK(in.replay.empty() || int64_t(in.replay.size()) == n_moe,
            "HybridModel::forward: replay must hold one entry per MoE layer ({}), got {}", n_moe,
            in.replay.size());
  auto replay_of = [&](int64_t m) { return in.replay.empty() ? Tensor() : in.replay[size_t(m)]; };

  const bool train = ctx.training && saved != nullptr;
  const bool cached = in.cache != nullptr;
  if (cached) {
    HLM_CHECK(!ctx.training && saved == nullptr && !has_targets && !in.output_processor &&
                  in.replay.empty() && in.dsa_indices.empty(),
              "HybridModel::forward: a forward over a cache is inference only (no training, "
              "targets, output processor, replay or given selections)");
    HLM_CHECK(in.cache->device() == dev,
              "HybridModel::forward: the cache is on {}, the model on {}",
              device_name(in.cache->device()), device_name(dev));
    HLM_CHECK(in.cache->dtype() == cdt,
              "HybridModel::forward: the cache holds {}, the model computes in {}",
              dtype_name(in.cache->dtype()), dtype_name(cdt));
    HLM_CHECK(int64_t(in.cache_slots.size()) == seqs.num_seqs(),
              "HybridModel::forward: {} cache slots for {} sequences", in.cache_slots.size(),
              seqs.num_seqs());
    if (in.draft_last) {
      HLM_CHECK(in.cache->speculative(),
                "HybridModel::forward: draft_last needs a cache made with speculative");
      for (int64_t q = 0; q < seqs.num_seqs(); ++q)
        HLM_CHECK(seqs.length(q) == 2,
                  "HybridModel::forward: with draft_last every sequence is [token, draft]; "
                  "sequence {} has {} tokens",
                  q, seqs.length(q));
    }
  } else {
    HLM_CHECK(!in.draft_last, "HybridModel::forward: draft_last needs a cache");
  }
  if (!in.logit_rows.empty()) {
    HLM_CHECK(!has_targets && !in.output_processor,
              "HybridModel::forward: logit_rows is for inference (no targets)");
    for (int64_t r : in.logit_rows)
      HLM_CHECK(r >= 0 && r < T, "HybridModel::forward: logit row {} is outside [0, {})", r, T);
  }
  std::unique_ptr<Saved> s(new Saved);
  s->tokens = tokens;
  s->tokens_dev = on(dev, tokens);
  s->seqs = seqs;
  s->cu_vec = cu_vec;
  s->training = ctx.training;
  s->aux = in.aux_losses;
  s->replay = in.replay;
  HLM_CHECK(in.lm_normalizer >= 0 && in.mtp_normalizer >= 0 && in.aux_sequences >= 0,
            "HybridModel::forward: the loss normalizers must be >= 0, got {}, {}, {}",
            in.lm_normalizer, in.mtp_normalizer, in.aux_sequences);
  HLM_CHECK((in.lm_normalizer == 0 && in.mtp_normalizer == 0 && in.aux_sequences == 0) ||
                (has_targets && !in.output_processor),
            "HybridModel::forward: loss normalizers need targets (and no output processor)");
  if (in.aux_sequences > 0) {
    const int64_t nonempty = nonempty_seqs(seqs);
    HLM_CHECK(nonempty <= in.aux_sequences,
              "HybridModel::forward: aux_sequences {} is below this batch's {} sequences",
              in.aux_sequences, nonempty);
    s->aux_scale = double(nonempty) / double(in.aux_sequences);
  }
  s->lm_norm = in.lm_normalizer;
  s->mtp_norm = in.mtp_normalizer;
  // A normalizer below this part's own count would make a share larger than the whole.
  auto normalizer = [](int64_t given, int64_t own, const char* what) {
    HLM_CHECK(given == 0 || given >= own,
              "HybridModel::forward: {} {} is below this batch's {} targets", what, given, own);
    return given > 0 ? given : own;
  };
  s->layers.resize(layers_.size());

  ModelOutput out;
  profile::Scope ps_emb("embedding");
  // The ids are checked here, on the host (a device check would wait for the device).
  Tensor e =
      ops::as_dtype(ops::embedding_forward(embed_->value, s->tokens_dev, host_ids(tokens)), cdt);
  ps_emb.end();
  const int64_t n = cfg_.mhc.streams();
  Tensor x = cfg_.mhc.enabled ? ops::mhc_expand(e, n) : e.reshape({T, 1, D});
  int64_t n_dsa = 0;
  for (const auto& l : layers_) n_dsa += l->is_dsa();
  HLM_CHECK(in.dsa_indices.empty() || int64_t(in.dsa_indices.size()) == n_dsa,
            "HybridModel::forward: dsa_indices must hold one entry per DSA layer ({}), got {}",
            n_dsa, in.dsa_indices.size());
  if (cached) {
    // Every input is checked (the token ids by the embedding): the pages for the new tokens, all
    // or nothing, before anything is written.
    std::vector<int64_t> lengths;
    for (int64_t q = 0; q < seqs.num_seqs(); ++q) lengths.push_back(seqs.length(q));
    in.cache->reserve(in.cache_slots, lengths);
  }
  int64_t moe_i = 0, dsa_i = 0;
  Tensor prev_sel;  // the last DSA layer's attended sets ("shared" indexer layers reuse them)
  for (size_t l = 0; l < layers_.size(); ++l) {
    DecoderLayer::Out lo;
    const Tensor rp = layers_[l]->is_moe() ? replay_of(moe_i) : Tensor();
    Tensor given;
    if (layers_[l]->is_dsa()) {
      if (!in.dsa_indices.empty()) given = in.dsa_indices[size_t(dsa_i)];
      if (!given.defined() && layers_[l]->shares_selection()) {
        HLM_CHECK(dsa_i > 0,
                  "HybridModel: layer {} shares the selection of a previous DSA layer, but "
                  "there is none before it",
                  l);
        // Undefined on CUDA when that layer attended every causal token (no index tensor):
        // then this one does too.
        given = prev_sel;
      }
    }
    const CacheCall cc{in.cache, &in.cache_slots, int64_t(l), in.draft_last};
    x = layers_[l]->forward(ctx, x, seqs, train ? &s->layers[l] : nullptr, &lo, rp, given,
                            cached ? &cc : nullptr, CpCall{in.cp, in.cp_mode});
    if (layers_[l]->is_dsa()) {
      ++dsa_i;
      prev_sel = lo.indices;
      out.dsa_indices.push_back(lo.indices);
      out.indexer_losses.push_back(lo.indexer_loss);
      out.indexer_rows.push_back(lo.indexer_rows);
    }
    if (layers_[l]->is_moe()) {
      ++moe_i;
      out.aux_loss += lo.aux_loss * s->aux_scale;
      out.expert_counts.push_back(lo.counts);
      out.expert_topk.push_back(lo.topk);
    }
    out.indexer_loss += lo.indexer_loss;
  }
  if (cached) {
    // A draft joins its sequence only when accepted (ModelCache::accept_drafts).
    std::vector<int64_t> lengths;
    for (int64_t q = 0; q < seqs.num_seqs(); ++q)
      lengths.push_back(seqs.length(q) - (in.draft_last ? 1 : 0));
    in.cache->advance(in.cache_slots, lengths);
  }
  profile::Scope ps_head("final norm + head + loss");
  Tensor h = cfg_.mhc.enabled ? ops::mhc_mean_contract(x) : x.reshape({T, D});
  s->h = h;
  if (cached) out.pre_norm = h;
  out.hidden = norm_->forward(ctx, h, train ? &s->norm : nullptr);
  s->hidden = out.hidden;

  if (cfg_.tie_word_embeddings) lm_head_->weight().value = embed_->value;
  double objective = 0;
  if (in.output_processor) {
    Tensor dh = Tensor::zeros({T, D}, cdt, dev);
    out.lm_loss = in.output_processor(out.hidden, &dh);
    s->has_processor = true;
    s->d_hidden_processor = dh;
    objective += out.lm_loss;
  }
  // Training on CUDA without logits asked for: the head and the loss in chunks of rows.
  const bool fused =
      train && has_targets && !in.logits && !in.output_processor && dev != Device::cpu;
  if (fused && cfg_.tie_word_embeddings) lm_head_->weight().grad = embed_->grad;
  if (fused) {
    s->targets = host_i64(in.targets);
    s->targets_dev = on(dev, s->targets);
    out.lm_count = count_targets(s->targets.data<int64_t>(), s->targets.numel());
    HeadLoss hl = chunked_head_loss(ctx, *lm_head_, out.hidden, s->targets_dev,
                                    normalizer(in.lm_normalizer, out.lm_count, "lm_normalizer"),
                                    1.0, opt_.loss_chunk_rows);
    out.lm_loss = hl.loss;
    s->fused_head = true;
    s->d_hidden_head = hl.d_hidden;
    objective += out.lm_loss;
  }
  if (!in.logit_rows.empty()) {
    out.logits = lm_head_->forward(ctx, ops::gather_rows(out.hidden, in.logit_rows), nullptr);
  } else if ((in.logits || has_targets) && !in.output_processor && !fused) {
    out.logits = lm_head_->forward(ctx, out.hidden, train ? &s->head : nullptr);
    s->logits = out.logits;
  }
  if (has_targets && !in.output_processor && !fused) {
    s->targets = host_i64(in.targets);
    s->targets_dev = on(dev, s->targets);
    s->ce = ops::cross_entropy_forward(out.logits, s->targets_dev);
    out.lm_count = s->ce.count;
    const int64_t norm = normalizer(in.lm_normalizer, out.lm_count, "lm_normalizer");
    out.lm_loss =
        norm == out.lm_count ? s->ce.loss : s->ce.loss * double(out.lm_count) / double(norm);
    s->has_lm = true;
    objective += out.lm_loss;
  }

  ps_head.end();
  if (mtp_ && has_targets) {
    HLM_PROFILE("mtp");
    // Inputs: the embedding of token i+1 (zeros at a sequence's last position); targets: the
    // target of position i+1 (the token i+2), ignored where i+1 is outside the sequence.
    const std::vector<int64_t> next = successors(cu_vec);
    const int64_t* tok = tokens.data<int64_t>();
    const int64_t* tgt = s->targets.data<int64_t>();
    std::vector<int64_t> nt(size_t(T), 0), mt(size_t(T), -100);
    std::vector<uint8_t> valid(size_t(T), 0);
    for (int64_t i = 0; i < T; ++i)
      if (next[size_t(i)] >= 0) {
        nt[size_t(i)] = tok[next[size_t(i)]];
        mt[size_t(i)] = tgt[next[size_t(i)]];
        valid[size_t(i)] = 1;
      }
    // Context parallel: a slice whose last sequence goes on into the next rank takes that rank's
    // first token and target as its last position's (one all-gather of each rank's first pair).
    if (in.cp) {
      const dist::CpSlice& cp = *in.cp;
      const std::vector<int64_t> firsts =
          cp.allgather(Tensor::from_vector<int64_t>({1, 2}, {tok[0], tgt[0]})).to_i64_vector();
      if (cp.goes_on(cp.rank())) {
        const size_t r = size_t(cp.rank()) + 1;
        nt[size_t(T - 1)] = firsts[2 * r];
        mt[size_t(T - 1)] = firsts[2 * r + 1];
        valid[size_t(T - 1)] = 1;
      }
    }
    s->next_tokens = on(dev, Tensor::from_vector({T}, nt));
    s->next_valid = Tensor::from_vector({T}, valid);
    s->mtp_targets = on(dev, Tensor::from_vector({T}, mt));
    Tensor en = ops::as_dtype(ops::embedding_forward(embed_->value, s->next_tokens, nt), cdt);
    for (int64_t i = 0; i < T; ++i)
      if (!valid[size_t(i)]) en.select(0, i).zero_();
    MtpBlock::Out mo;
    Tensor o = mtp_->forward(ctx, en, h, seqs, train ? &s->mtp : nullptr, &mo,
                             mtp_->is_moe() ? replay_of(moe_i) : Tensor(), nullptr, in.cp);
    if (mtp_->is_moe()) {
      out.aux_loss += mo.aux_loss * s->aux_scale;
      out.expert_counts.push_back(mo.counts);
      out.expert_topk.push_back(mo.topk);
    }
    out.indexer_loss += mo.indexer_loss;
    out.indexer_losses.push_back(mo.indexer_loss);
    out.indexer_rows.push_back(mo.indexer_rows);
    s->mtp_scale = cfg_.mtp.loss_scaling_factor;
    if (fused) {
      out.mtp_count = count_targets(mt.data(), int64_t(mt.size()));
      HeadLoss hl =
          chunked_head_loss(ctx, *lm_head_, o, s->mtp_targets,
                            normalizer(in.mtp_normalizer, out.mtp_count, "mtp_normalizer"),
                            s->mtp_scale, opt_.loss_chunk_rows);
      out.mtp_loss = hl.loss;
      s->mtp_fused = true;
      s->d_mtp_out = hl.d_hidden;
    } else {
      out.mtp_logits = lm_head_->forward(ctx, o, train ? &s->mtp_head : nullptr);
      s->mtp_logits = out.mtp_logits;
      s->mtp_ce = ops::cross_entropy_forward(out.mtp_logits, s->mtp_targets);
      out.mtp_count = s->mtp_ce.count;
      const int64_t norm = normalizer(in.mtp_normalizer, out.mtp_count, "mtp_normalizer");
      out.mtp_loss = norm == out.mtp_count ? s->mtp_ce.loss
                                           : s->mtp_ce.loss * double(out.mtp_count) / double(norm);
    }
    s->has_mtp = true;
    objective += s->mtp_scale * out.mtp_loss;
  }
  if (tp) {
    // The MoE layers ran on each rank's share of the rows: their aux losses and counts summed
    // over the group are the whole batch's (the same on every rank, as every other term is).
    const Tensor aux = dist::allreduce_from(*tp, Tensor::from_vector<double>({1}, {out.aux_loss}));
    out.aux_loss = aux.data<double>()[0];
    for (Tensor& c : out.expert_counts) c = dist::allreduce_from(*tp, c);
  }
  if (in.aux_losses) objective += out.aux_loss + out.indexer_loss;
  out.loss = objective;
  if (train) *saved = SavedPtr(s.release());
  return out;
}

void HybridModel::backward(const Context& ctx, const Saved& saved_in, const Tensor& d_extra,
                           const std::vector<double>& indexer_scales) {
  Saved& s = const_cast<Saved&>(saved_in);  // layer backward re-runs consume their Saved
  HLM_CHECK(s.training, "HybridModel::backward: the forward did not run in training mode");
  const int64_t T = s.tokens.size(0), D = cfg_.hidden_size;
  const DType cdt = compute_dtype();
  const double d_aux = s.aux ? s.aux_scale : 0.0;
  int64_t n_dsa = s.has_mtp ? 1 : 0;
  for (const auto& l : layers_) n_dsa += l->is_dsa();
  HLM_CHECK(indexer_scales.empty() || int64_t(indexer_scales.size()) == n_dsa,
            "HybridModel::backward: indexer_scales must hold one factor per DSA layer ({}), got {}",
            n_dsa, indexer_scales.size());
  for (double f : indexer_scales)
    HLM_CHECK(std::isfinite(f) && f >= 0,
              "HybridModel::backward: indexer scale {} is not finite "
              "and >= 0",
              f);
  // The factor of DSA layer i's indexer loss (ModelOutput::indexer_rows' order).
  auto indexer_scale = [&](int64_t i) {
    return (s.aux ? 1.0 : 0.0) * (indexer_scales.empty() ? 1.0 : indexer_scales[size_t(i)]);
  };
  if (cfg_.tie_word_embeddings) {
    lm_head_->weight().value = embed_->value;
    lm_head_->weight().grad = embed_->grad;
  }
  // Gradient of the hidden states (after model.norm).
  profile::Scope ps_head("final norm + head + loss");
  Tensor d_hidden;
  if (s.has_lm) {
    Tensor dlogits = ops::cross_entropy_backward(s.logits, s.targets_dev, s.ce, 1.0, s.lm_norm);
    d_hidden = lm_head_->backward(ctx, dlogits, s.head);
  }
  if (s.fused_head) d_hidden = s.d_hidden_head;
  if (s.has_processor) add_into(d_hidden, s.d_hidden_processor);
  if (d_extra.defined()) {
    HLM_CHECK(d_extra.dim() == 2 && d_extra.size(0) == T && d_extra.size(1) == D,
              "HybridModel::backward: d_hidden must be [{}, {}], got {}", T, D, d_extra.describe());
    add_into(d_hidden, ops::as_dtype(d_extra, cdt));
  }
  if (!d_hidden.defined()) d_hidden = Tensor::zeros({T, D}, cdt, embed_->value.device());
  Tensor dh = norm_->backward(ctx, d_hidden, s.norm);
  ps_head.end();
  // MTP: its loss reaches h, the embedding (through the next tokens) and its own block.
  if (s.has_mtp) {
    HLM_PROFILE("mtp");
    Tensor dout = s.mtp_fused ? s.d_mtp_out
                              : lm_head_->backward(
                                    ctx,
                                    ops::cross_entropy_backward(s.mtp_logits, s.mtp_targets,
                                                                s.mtp_ce, s.mtp_scale, s.mtp_norm),
                                    s.mtp_head);
    auto [de, dh_mtp] = mtp_->backward(ctx, dout, s.mtp, d_aux, indexer_scale(n_dsa - 1));
    dh = add(dh, dh_mtp);
    const uint8_t* valid = s.next_valid.data<uint8_t>();
    for (int64_t i = 0; i < T; ++i)
      if (!valid[i]) de.select(0, i).zero_();
    ops::embedding_backward(de, s.next_tokens, embed_->grad);
  }
  const int64_t n = cfg_.mhc.streams();
  Tensor dx = cfg_.mhc.enabled ? ops::mhc_mean_contract_backward(dh, n) : dh.reshape({T, 1, D});
  int64_t moe_i = num_moe_layers() - (mtp_ && mtp_->is_moe() ? 1 : 0);
  int64_t dsa_i = n_dsa - (s.has_mtp ? 1 : 0);
  for (size_t l = layers_.size(); l-- > 0;) {
    Tensor rp;
    if (layers_[l]->is_moe()) {
      --moe_i;
      if (!s.replay.empty()) rp = s.replay[size_t(moe_i)];
    }
    const double ix = layers_[l]->is_dsa() ? indexer_scale(--dsa_i) : 0.0;
    dx = layers_[l]->backward(ctx, dx, s.layers[l], s.seqs, d_aux, ix, rp);
  }
  HLM_PROFILE("embedding");
  Tensor de = cfg_.mhc.enabled ? ops::mhc_expand_backward(dx) : dx.reshape({T, D});
  ops::embedding_backward(de, s.tokens_dev, embed_->grad);
}

std::vector<TpParam> HybridModel::tensor_parallel_params() {
  std::map<std::string, TpParam> split;  // the layouts of the tensor-parallel layers
  std::vector<std::string> moe_prefixes;
  auto add = [&](const std::string& prefix, const std::vector<TpParam>& v) {
    for (TpParam p : v) {
      p.name = prefix + p.name;
      split[p.name] = p;
    }
  };
  const int tp = tp_group(opt_) ? tp_group(opt_)->size() : 1;
  auto add_layer = [&](const std::string& path, KdaLayer* kda, DsaLayer* dsa, MoeLayer* moe) {
    if (tp == 1) return;
    if (kda) {  // the layer holds 1/tp of the heads: the whole layer's layout
      KdaConfig whole = kda->config();
      whole.num_heads *= tp;
      whole.num_v_heads *= tp;
      add(path + ".self_attn.", kda_tp_params(whole));
    }
    if (dsa) {
      MlaConfig whole = dsa->config();
      whole.num_heads *= tp;
      add(path + ".self_attn.", mla_tp_params(whole));
      for (const TpParam& p : dsa_tp_params(*dsa))
        if (p.split == TpSplit::identical) add(path + ".self_attn.", {p});
    }
    if (moe) {
      moe_prefixes.push_back(path + ".mlp.");
    } else {
      DenseMlpConfig whole;
      whole.intermediate_size = cfg_.intermediate_size;
      add(path + ".mlp.", mlp_tp_params(whole));
    }
  };
  for (size_t l = 0; l < layers_.size(); ++l) {
    DecoderLayer& d = *layers_[l];
    add_layer("model.layers." + std::to_string(l), d.kda(), d.dsa(), d.moe());
  }
  if (mtp_)
    add_layer("model.layers." + std::to_string(cfg_.num_hidden_layers), nullptr, mtp_->dsa(),
              mtp_->moe());
  std::vector<TpParam> out;
  for (const auto& [name, p] : named_parameters()) {
    const auto it = split.find(name);
    if (it != split.end()) {
      out.push_back(it->second);
      continue;
    }
    bool in_moe = false;
    for (const std::string& m : moe_prefixes) in_moe = in_moe || name.rfind(m, 0) == 0;
    out.push_back({name, in_moe ? TpSplit::replicated : TpSplit::identical, {}});
  }
  return out;
}

void HybridModel::update_moe_bias(const std::vector<Tensor>& counts) {
  HLM_CHECK(int64_t(counts.size()) == num_moe_layers(),
            "HybridModel::update_moe_bias: {} count tensors for {} MoE layers", counts.size(),
            num_moe_layers());
  size_t i = 0;
  for (auto& l : layers_)
    if (l->is_moe()) l->moe()->update_bias(counts[i++], cfg_.moe.bias_update_rate);
  if (mtp_ && mtp_->is_moe()) mtp_->moe()->update_bias(counts[i++], cfg_.moe.bias_update_rate);
}

}  // namespace hlm
