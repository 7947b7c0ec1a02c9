// Limits of a model config and the memory estimate (model/config_limits.h).
#include "model/config_limits.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.h"
#include "core/memory.h"

namespace hlm {

namespace {

void bound(int64_t v, int64_t max, const char* field, const std::string& what) {
  HLM_CHECK(v <= max, "{}: '{}' is {}, more than the limit of {}", what, field, v, max);
}

// Checked arithmetic for the counts below (every operand is bounded, but sums of products can
// still approach 2^63 at the bounds).
struct Count {
  int64_t v = 0;
  Count& add(int64_t x) {
    v = checked_add(v, x, "the parameter count");
    return *this;
  }
};
int64_t mul(int64_t a, int64_t b) {
  return checked_mul(a, b, "the parameter count");
}
int64_t mul(int64_t a, int64_t b, int64_t c) {
  return mul(mul(a, b), c);
}

int64_t linear(int64_t in, int64_t out, bool bias = false) {
  return checked_add(mul(in, out), bias ? out : 0, "the parameter count");
}

int64_t mhc_site(const ModelConfig& c) {
  const int64_t n = c.mhc.hc_mult, m = mul(2 + n, n);
  return Count{}.add(mul(m, n, c.hidden_size)).add(m).add(3).v;
}

int64_t kda_layer(const ModelConfig& c) {
  const int64_t D = c.hidden_size, H = c.kda.num_heads, HV = c.kda.num_v_heads, K = c.kda.head_dim,
                V = c.kda.v_head_dim, W = c.kda.conv_kernel;
  const int64_t qk = mul(H, K), vd = mul(HV, V), hvk = mul(HV, K);
  Count n;
  n.add(linear(D, qk)).add(linear(D, qk)).add(linear(D, vd));
  if (c.kda.f_lora_rank > 0)
    n.add(linear(D, c.kda.f_lora_rank)).add(linear(c.kda.f_lora_rank, hvk));
  else
    n.add(linear(D, hvk));
  n.add(linear(D, HV));
  if (c.kda.g_lora_rank > 0)
    n.add(linear(D, c.kda.g_lora_rank)).add(linear(c.kda.g_lora_rank, vd, c.kda.output_gate_bias));
  else
    n.add(linear(D, vd, c.kda.output_gate_bias));
  n.add(linear(vd, D));
  n.add(mul(checked_add(mul(2, qk), vd, "the parameter count"), W));  // conv1d [C, 1, W]
  n.add(HV).add(hvk).add(V);                                          // A_log, dt_bias, o_norm
  return n.v;
}

int64_t mla(const ModelConfig& c) {
  const int64_t D = c.hidden_size, H = c.mla.num_heads, rq = c.mla.q_lora_rank,
                rkv = c.mla.kv_lora_rank, dn = c.mla.qk_nope_head_dim, dr = c.mla.qk_rope_head_dim,
                dv = c.mla.v_head_dim;
  Count n;
  if (rq > 0)
    n.add(rq).add(linear(D, rq)).add(linear(rq, mul(H, dn + dr)));
  else
    n.add(linear(D, mul(H, dn + dr)));
  n.add(rkv).add(linear(D, rkv + dr)).add(linear(rkv, mul(H, dn + dv))).add(linear(mul(H, dv), D));
  return n.v;
}

int64_t indexer(const ModelConfig& c) {
  const int64_t D = c.hidden_size, H = c.indexer.n_heads, d = c.indexer.head_dim,
                P = c.indexer.kpool;
  Count n;
  n.add(linear(c.mla.q_lora_rank, mul(H, d))).add(linear(D, d)).add(linear(D, H)).add(2 * d);
  if (P > 1) n.add(mul(d, D)).add(mul(P, d));  // compress gate [d, D], ape [P, d]
  return n.v;
}

int64_t dense_mlp(int64_t D, int64_t I) {
  return mul(3, D, I);
}

int64_t moe(const ModelConfig& c) {
  const int64_t D = c.hidden_size, E = c.moe.n_routed_experts, I = c.moe.moe_intermediate_size;
  Count n;
  n.add(mul(mul(E, 3), D, I)).add(linear(D, E)).add(E);  // experts, router, correction bias
  if (c.moe.n_shared_experts > 0) n.add(dense_mlp(D, mul(I, c.moe.n_shared_experts)));
  return n.v;
}

int64_t ffn(const ModelConfig& c, MlpKind k) {
  return k == MlpKind::moe ? moe(c) : dense_mlp(c.hidden_size, c.intermediate_size);
}

uint64_t u(int64_t v) {
  return uint64_t(v);
}
// Byte counts saturate at 2^64 - 1: the estimate is a lower bound, and one that large is
// refused all the same.
uint64_t umul(uint64_t a, uint64_t b) {
  uint64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}
uint64_t umul(uint64_t a, uint64_t b, uint64_t c) {
  return umul(umul(a, b), c);
}
uint64_t uadd(uint64_t a, uint64_t b) {
  uint64_t r = 0;
  return __builtin_add_overflow(a, b, &r) ? UINT64_MAX : r;
}

}  // namespace

void check_limits(const ModelConfig& c, const std::string& what) {
  using namespace limits;
  bound(c.vocab_size, kMaxVocabSize, "vocab_size", what);
  bound(c.hidden_size, kMaxHiddenSize, "hidden_size", what);
  bound(c.num_hidden_layers, kMaxLayers, "num_hidden_layers", what);
  bound(c.max_position_embeddings, kMaxPositionEmbeddings, "max_position_embeddings", what);
  bound(c.intermediate_size, kMaxIntermediateSize, "intermediate_size", what);
  bound(c.kda.num_heads, kMaxHeads, "linear_num_heads", what);
  bound(c.kda.num_v_heads, kMaxHeads, "linear_num_value_heads", what);
  bound(c.kda.head_dim, kMaxHeadDim, "linear_head_dim", what);
  bound(c.kda.v_head_dim, kMaxHeadDim, "linear_value_head_dim", what);
  bound(c.kda.conv_kernel, kMaxConvKernel, "linear_conv_kernel_dim", what);
  bound(c.kda.f_lora_rank, kMaxRank, "kda_f_lora_rank", what);
  bound(c.kda.g_lora_rank, kMaxRank, "kda_gate_lora_rank", what);
  bound(c.mla.num_heads, kMaxHeads, "num_attention_heads", what);
  bound(c.mla.num_kv_heads, kMaxHeads, "num_key_value_heads", what);
  bound(c.mla.q_lora_rank, kMaxRank, "q_lora_rank", what);
  bound(c.mla.kv_lora_rank, kMaxRank, "kv_lora_rank", what);
  bound(c.mla.qk_nope_head_dim, kMaxHeadDim, "qk_nope_head_dim", what);
  bound(c.mla.qk_rope_head_dim, kMaxHeadDim, "qk_rope_head_dim", what);
  bound(c.mla.v_head_dim, kMaxHeadDim, "v_head_dim", what);
  bound(c.mla.rope_scaling.original_max_position_embeddings, kMaxPositionEmbeddings,
        "rope_scaling.original_max_position_embeddings", what);
  bound(c.indexer.n_heads, kMaxHeads, "index_n_heads", what);
  bound(c.indexer.head_dim, kMaxHeadDim, "index_head_dim", what);
  bound(c.indexer.topk, kMaxIndexTopk, "index_topk", what);
  bound(c.indexer.kpool, kMaxKpool, "index_kpool", what);
  bound(c.moe.n_routed_experts, kMaxExperts, "n_routed_experts", what);
  bound(c.moe.num_experts_per_tok, kMaxExperts, "num_experts_per_tok", what);
  bound(c.moe.n_shared_experts, kMaxSharedExperts, "n_shared_experts", what);
  bound(c.moe.moe_intermediate_size, kMaxIntermediateSize, "moe_intermediate_size", what);
  bound(c.moe.n_group, kMaxExperts, "n_group", what);
  bound(c.moe.topk_group, kMaxExperts, "topk_group", what);
  bound(c.mhc.hc_mult, kMaxHcMult, "hc_mult", what);
  bound(c.mhc.sinkhorn_iters, kMaxSinkhornIters, "hc_sinkhorn_iters", what);
  bound(c.mtp.num_layers, kMaxMtpLayers, "num_nextn_predict_layers", what);
  const int64_t p = parameter_count(c, true);
  HLM_CHECK(p <= kMaxParameters, "{}: the model has {} parameters, more than the limit of {}", what,
            p, kMaxParameters);
}

void check_raw_limits(const nlohmann::json& text, const std::string& what) {
  using namespace limits;
  static const std::pair<const char*, int64_t> bounds[] = {
      {"num_hidden_layers", kMaxLayers},
      {"vocab_size", kMaxVocabSize},
      {"hidden_size", kMaxHiddenSize},
      {"max_position_embeddings", kMaxPositionEmbeddings},
      {"intermediate_size", kMaxIntermediateSize},
      {"linear_num_heads", kMaxHeads},
      {"linear_num_value_heads", kMaxHeads},
      {"linear_head_dim", kMaxHeadDim},
      {"linear_value_head_dim", kMaxHeadDim},
      {"linear_conv_kernel_dim", kMaxConvKernel},
      {"kda_f_lora_rank", kMaxRank},
      {"kda_gate_lora_rank", kMaxRank},
      {"num_attention_heads", kMaxHeads},
      {"num_key_value_heads", kMaxHeads},
      {"q_lora_rank", kMaxRank},
      {"kv_lora_rank", kMaxRank},
      {"qk_nope_head_dim", kMaxHeadDim},
      {"qk_rope_head_dim", kMaxHeadDim},
      {"v_head_dim", kMaxHeadDim},
      {"index_n_heads", kMaxHeads},
      {"index_head_dim", kMaxHeadDim},
      {"index_topk", kMaxIndexTopk},
      {"index_kpool", kMaxKpool},
      {"n_routed_experts", kMaxExperts},
      {"num_experts_per_tok", kMaxExperts},
      {"n_shared_experts", kMaxSharedExperts},
      {"moe_intermediate_size", kMaxIntermediateSize},
      {"n_group", kMaxExperts},
      {"topk_group", kMaxExperts},
      {"hc_mult", kMaxHcMult},
      {"hc_sinkhorn_iters", kMaxSinkhornIters},
      {"num_nextn_predict_layers", kMaxMtpLayers},
  };
  if (!text.is_object()) return;
  for (const auto& [key, max] : bounds) {
    auto it = text.find(key);
    if (it == text.end() || !it->is_number()) continue;
    const double v = it->get<double>();
    HLM_CHECK(!(v > double(max)), "{}: '{}' is {}, more than the limit of {}", what, key,
              it->dump(), max);
  }
}

int64_t parameter_count(const ModelConfig& c, bool mtp) {
  const int64_t V = c.vocab_size, D = c.hidden_size;
  Count n;
  n.add(mul(V, D));                              // embed_tokens
  if (!c.tie_word_embeddings) n.add(mul(V, D));  // lm_head
  n.add(D);                                      // model.norm
  const int64_t site = c.mhc.enabled ? mhc_site(c) : 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    n.add(mul(2, site)).add(mul(2, D));  // attn_hc, ffn_hc, input / post-attention norms
    switch (c.layer_kind(l)) {
      case LayerKind::kda:
        n.add(kda_layer(c));
        break;
      case LayerKind::mla:
        n.add(mla(c));
        break;
      case LayerKind::dsa:
        n.add(mla(c));
        if (c.indexer_kinds.empty() || c.indexer_kinds[size_t(l)] == IndexerKind::full)
          n.add(indexer(c));
        break;
    }
    n.add(ffn(c, c.mlp_kind(l)));
  }
  if (mtp && c.mtp.num_layers > 0) {
    // enorm, hnorm, input / post-attention norms, shared_head.norm; eh_proj [D, 2D]; a DSA
    // layer with its indexer; the MTP FFN.
    n.add(mul(5, D)).add(mul(2, D, D)).add(mla(c)).add(indexer(c)).add(ffn(c, c.mtp_mlp_kind()));
  }
  return n.v;
}

uint64_t MemoryEstimate::total() const {
  return uadd(uadd(parameters, training), activations);
}

std::string MemoryEstimate::describe() const {
  return fmt::format("weights {}, gradients and optimizer state {}, activations {}",
                     format_bytes(double(parameters)), format_bytes(double(training)),
                     format_bytes(double(activations)));
}

MemoryEstimate estimate_memory(const ModelConfig& c, const Workload& w) {
  HLM_CHECK(w.tokens >= 0 && w.max_seq_len >= 0, "estimate_memory: negative token counts");
  const uint64_t P = u(parameter_count(c, w.mtp));
  const uint64_t pb = dtype_size(w.dtype);
  const uint64_t cb = w.dtype == DType::f64 ? 8 : 4;  // compute dtype
  MemoryEstimate m;
  m.parameters = umul(P, pb);
  if (w.bf16_gemm_weights && pb > 2) {
    const uint64_t experts =
        u(mul(c.moe.n_routed_experts, mul(3, c.hidden_size, c.moe.moe_intermediate_size)));
    auto bf16_experts = [&](int64_t layer) {
      return c.precision
                 .resolve(fmt::format("model.layers.{}.mlp.experts", layer), ModuleRole::moe_expert)
                 .kind == GemmKind::bf16;
    };
    uint64_t narrowed = 0;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l)
      if (c.is_moe_layer(l) && bf16_experts(l)) narrowed = uadd(narrowed, experts);
    if (w.mtp && c.mtp.num_layers > 0 && c.mtp_mlp_kind() == MlpKind::moe &&
        bf16_experts(c.num_hidden_layers))
      narrowed = uadd(narrowed, experts);
    m.parameters -= umul(narrowed, pb - 2);
  }
  if (w.training) {
    // Gradients: f32, or f64 for f64 parameters.
    const uint64_t gb = w.dtype == DType::f64 ? 8 : 4;
    // AdamW: m and v in the master's dtype, and the FP32 master of 16-bit parameters.
    const uint64_t ob = w.optimizer ? (w.dtype == DType::f64 ? 16 : (pb < 4 ? 12 : 8)) : 0;
    m.training = umul(P, gb + ob);
  }
  const uint64_t T = u(w.tokens),
                 L = u(w.max_seq_len > 0 ? std::min(w.max_seq_len, w.tokens) : w.tokens);
  const uint64_t n = u(c.mhc.streams()), D = u(c.hidden_size), V = u(c.vocab_size);
  const uint64_t stream = umul(T, n, umul(D, cb));
  const uint64_t logits = umul(T, V, cb);
  // The index and score tables one attention layer materialises: dense MLA [T, L] i32 indices;
  // DSA: the attended set ([T, topk], or [T, L] in the dense warm-up) and, for a layer with its
  // own indexer, the scores over the pooled keys [T, ceil(L / P)].
  const uint64_t topk = std::min(u(c.indexer.topk), L);
  const uint64_t pooled = (L + u(c.indexer.kpool) - 1) / u(c.indexer.kpool);
  auto attention = [&](LayerKind k, bool own_indexer) -> uint64_t {
    if (k == LayerKind::kda) return 0;
    if (k == LayerKind::mla) return umul(T, L, 4);
    uint64_t b = umul(T, w.dense_attention ? L : topk, 4);
    if (own_indexer) b = uadd(b, umul(T, pooled, cb));
    return b;
  };
  // The largest working set of one layer: what its token mixer or its FFN materialises per token
  // (KDA: q, k, v; MLA: q, the latent kv, the heads' output; dense MLP: gate | up; MoE: the
  // experts' gate | up for the top-k, the router logits, the shared experts' gate | up).
  auto per_token = [&](LayerKind k, MlpKind f) -> uint64_t {
    uint64_t a = 0;
    if (k == LayerKind::kda)
      a = u(2 * c.kda.num_heads * c.kda.head_dim + c.kda.num_v_heads * c.kda.v_head_dim);
    else
      a = u(c.mla.num_heads * c.mla.qk_head_dim() + c.mla.kv_lora_rank + c.mla.qk_rope_head_dim +
            c.mla.num_heads * c.mla.v_head_dim);
    uint64_t b = 0;
    if (f == MlpKind::dense)
      b = u(2 * c.intermediate_size);
    else
      b = u(c.moe.num_experts_per_tok * 2 * c.moe.moe_intermediate_size + c.moe.n_routed_experts +
            2 * c.moe.moe_intermediate_size * c.moe.n_shared_experts);
    return std::max(a, b);
  };
  uint64_t work = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    work = std::max(work, per_token(c.layer_kind(l), c.mlp_kind(l)));
  if (w.mtp && c.mtp.num_layers > 0)
    work = std::max(work, per_token(LayerKind::dsa, c.mtp_mlp_kind()));
  const uint64_t working = umul(T, work, cb);
  uint64_t attn_sum = 0, attn_max = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const bool own = c.indexer_kinds.empty() || c.indexer_kinds[size_t(l)] == IndexerKind::full;
    const uint64_t a = attention(c.layer_kind(l), own);
    attn_sum = uadd(attn_sum, a);
    attn_max = std::max(attn_max, a);
  }
  const bool has_mtp = w.mtp && c.mtp.num_layers > 0;
  if (has_mtp) {
    const uint64_t a = attention(LayerKind::dsa, true);
    attn_sum = uadd(attn_sum, a);
    attn_max = std::max(attn_max, a);
  }
  if (w.training) {
    // Every layer keeps its input streams and its attention tables for the backward (under any
    // recompute mode), one layer's working set exists at a time at least; logits and their
    // gradient (and the MTP head's) live together.
    m.activations = uadd(umul(u(c.num_hidden_layers) + 1, stream), attn_sum);
    m.activations = uadd(m.activations, working);
    m.activations = uadd(m.activations, umul(has_mtp ? 4 : 2, logits));
  } else {
    // A forward pass: a layer's input and output streams, its working set or its attention
    // table, the logits.
    m.activations = uadd(uadd(umul(2, stream), std::max(attn_max, working)), logits);
  }
  return m;
}

namespace {

int64_t moe_layer_count(const ModelConfig& c, bool mtp) {
  int64_t moe_layers = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) moe_layers += c.is_moe_layer(l) ? 1 : 0;
  if (mtp && c.mtp.num_layers > 0 && c.mtp_mlp_kind() == MlpKind::moe) ++moe_layers;
  return moe_layers;
}

}  // namespace

int64_t tensor_parallel_split_count(const ModelConfig& c, bool mtp) {
  const int64_t D = c.hidden_size;
  // A KDA layer less its replicated low-rank gates and o_norm; an MLA less its latent
  // projections and their norms.
  const int64_t kda = kda_layer(c);
  const int64_t kda_rep = (c.kda.f_lora_rank > 0 ? linear(D, c.kda.f_lora_rank) : 0) +
                          (c.kda.g_lora_rank > 0 ? linear(D, c.kda.g_lora_rank) : 0) +
                          c.kda.v_head_dim;
  const int64_t rq = c.mla.q_lora_rank, rkv = c.mla.kv_lora_rank;
  const int64_t mla_rep =
      (rq > 0 ? rq + linear(D, rq) : 0) + rkv + linear(D, rkv + c.mla.qk_rope_head_dim);
  const int64_t dense = dense_mlp(D, c.intermediate_size);
  Count n;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    n.add(c.layer_kind(l) == LayerKind::kda ? kda - kda_rep : mla(c) - mla_rep);
    if (c.mlp_kind(l) == MlpKind::dense) n.add(dense);
  }
  if (mtp && c.mtp.num_layers > 0) {
    n.add(mla(c) - mla_rep);
    if (c.mtp_mlp_kind() == MlpKind::dense) n.add(dense);
  }
  return n.v;
}

int64_t routed_expert_parameter_count(const ModelConfig& c, bool mtp) {
  return mul(moe_layer_count(c, mtp), c.moe.n_routed_experts,
             mul(3, c.hidden_size, c.moe.moe_intermediate_size));
}

int64_t active_parameter_count(const ModelConfig& c, bool mtp) {
  int64_t n = parameter_count(c, mtp);
  const int64_t unused = c.moe.n_routed_experts - c.moe.num_experts_per_tok;
  const int64_t expert = mul(3, c.hidden_size, c.moe.moe_intermediate_size);
  if (unused > 0) n -= mul(moe_layer_count(c, mtp), unused, expert);
  return n - mul(c.vocab_size - 1, c.hidden_size);
}

uint64_t CacheEstimate::at(uint64_t seq_len) const {
  const uint64_t pools = seq_len / pool, tail = pool > 1 ? seq_len % pool : 0;
  const uint64_t index = uadd(umul(pools, key_dim, eb), umul(tail, tail_dim, eb));
  return uadd(uadd(kda_fixed, umul(latent_per_token, seq_len)), umul(index_layers, index));
}

CacheEstimate estimate_decode_cache(const ModelConfig& c, uint64_t eb) {
  CacheEstimate e;
  e.eb = eb;
  const uint64_t H = u(c.kda.num_heads), HV = u(c.kda.num_v_heads), K = u(c.kda.head_dim),
                 V = u(c.kda.v_head_dim), W = u(c.kda.conv_kernel);
  const uint64_t kda_state = uadd(umul(HV, K, umul(V, 4)), umul(W - 1, u(2) * H * K + HV * V, eb));
  const uint64_t latent = umul(u(c.mla.kv_lora_rank + c.mla.qk_rope_head_dim), eb);
  e.pool = std::max<uint64_t>(1, u(c.indexer.kpool));
  e.key_dim = u(c.indexer.head_dim);
  e.tail_dim = e.key_dim + (c.indexer.kpool_compress ? u(c.hidden_size) : 0);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (c.layer_kind(l) == LayerKind::kda) {
      e.kda_fixed = uadd(e.kda_fixed, kda_state);
      continue;
    }
    e.latent_per_token = uadd(e.latent_per_token, latent);
    const bool own = c.indexer_kinds.empty() || c.indexer_kinds[size_t(l)] == IndexerKind::full;
    if (c.layer_kind(l) == LayerKind::dsa && own) ++e.index_layers;
  }
  return e;
}

void check_memory_for(const ModelConfig& c, const Workload& w, const std::string& what) {
  check_limits(c, what);
  const MemoryEstimate m = estimate_memory(c, w);
  const uint64_t limit = memory_limit();
  HLM_CHECK(m.total() <= limit,
            "{} needs at least {} bytes ({}: {}; {} tokens{}), more than the memory limit of {} "
            "bytes ({}; set HLM_MEMORY_LIMIT to change it)",
            what, m.total(), format_bytes(double(m.total())), m.describe(), w.tokens,
            w.max_seq_len > 0 && w.max_seq_len < w.tokens
                ? fmt::format(", sequences of up to {}", w.max_seq_len)
                : std::string(),
            limit, format_bytes(double(limit)));
}

}  // namespace hlm
