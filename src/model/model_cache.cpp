// ModelCache (model/model_cache.h): slots, pages and the per-layer storage.
#include "model/model_cache.h"

#include <algorithm>
#include <numeric>
#include <string>

#include "core/error.h"
#include "layers/dsa/mla.h"
#include "layers/precision.h"
#include "ops/tensor_ops.h"

namespace hlm {

namespace {

// Whether layer l of cfg has its own indexer (a DSA layer not marked "shared").
bool has_indexer(const ModelConfig& cfg, int64_t l) {
  return cfg.layer_kind(l) == LayerKind::dsa &&
         !(!cfg.indexer_kinds.empty() && cfg.indexer_kinds[size_t(l)] == IndexerKind::shared);
}

int64_t page_of(const ModelConfig& cfg, const CacheOptions& o) {
  const int64_t P = std::max<int64_t>(1, cfg.indexer.kpool);
  return (std::max<int64_t>(1, o.page) + P - 1) / P * P;
}

}  // namespace

DType ModelCache::latent_dtype(const ModelConfig& cfg, DType dtype, Device device, int64_t layer) {
  // The layer's kv_b_proj as the model names it (DsaLayer::forward_cached checks the cache's
  // dtype against the built layer's).
  const std::string kv_b = "model.layers." + std::to_string(layer) + ".self_attn.kv_b_proj";
  return Mla::attention_dtype(cfg.precision.resolve(kv_b, ModuleRole::mla_proj).kind, dtype,
                              device);
}

CacheBytes ModelCache::plan(const ModelConfig& cfg, DType dtype, const CacheOptions& o) {
  HLM_CHECK(dtype == DType::f32 || dtype == DType::f64,
            "ModelCache: the cache holds f32 or f64 (the compute dtype), got {}",
            dtype_name(dtype));
  HLM_CHECK(o.max_seqs >= 1 && o.max_seqs <= (int64_t(1) << 20),
            "ModelCache: max_seqs must be in [1, 2^20], got {}", o.max_seqs);
  HLM_CHECK(o.max_tokens >= 1 && o.max_tokens <= (int64_t(1) << 40),
            "ModelCache: max_tokens must be in [1, 2^40], got {}", o.max_tokens);
  HLM_CHECK(o.page >= 1 && o.page <= (int64_t(1) << 20),
            "ModelCache: page must be in [1, 2^20] tokens, got {}", o.page);
  const int64_t es = int64_t(dtype_size(dtype)), P = std::max<int64_t>(1, cfg.indexer.kpool);
  CacheBytes b;
  b.page_tokens = page_of(cfg, o);
  b.num_pages = (o.max_tokens + b.page_tokens - 1) / b.page_tokens;
  const int64_t Dkv = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim;
  auto latent_bytes = [&](int64_t l) {
    return b.page_tokens * Dkv * int64_t(dtype_size(latent_dtype(cfg, dtype, o.device, l)));
  };
  int64_t per_page = 0;  // bytes
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    if (cfg.layer_kind(l) == LayerKind::kda) {
      const KdaHparams& k = cfg.kda;
      b.per_sequence += es * ((k.conv_kernel - 1) *
                                  (2 * k.num_heads * k.head_dim + k.num_v_heads * k.v_head_dim) +
                              k.num_v_heads * k.head_dim * k.v_head_dim);
      continue;
    }
    per_page += latent_bytes(l);
    if (!has_indexer(cfg, l)) continue;
    per_page += es * (b.page_tokens / P) * cfg.indexer.head_dim;
    if (P > 1) b.per_sequence += es * 2 * P * cfg.indexer.head_dim;
  }
  if (o.speculative) {
    HLM_CHECK(cfg.mtp.num_layers >= 1,
              "ModelCache: speculative decoding drafts with the MTP block, and the config has none "
              "(num_nextn_predict_layers = 0)");
    // The MTP block's DSA layer (its own indexer), and a second KDA state per slot.
    per_page +=
        latent_bytes(cfg.num_hidden_layers) + es * (b.page_tokens / P) * cfg.indexer.head_dim;
    if (P > 1) b.per_sequence += es * 2 * P * cfg.indexer.head_dim;
    const KdaHparams& k = cfg.kda;
    b.per_sequence +=
        es * cfg.count_layers(LayerKind::kda) *
        ((k.conv_kernel - 1) * (2 * k.num_heads * k.head_dim + k.num_v_heads * k.v_head_dim) +
         k.num_v_heads * k.head_dim * k.v_head_dim);
  }
  b.per_token = per_page / b.page_tokens;
  b.slots = b.per_sequence * o.max_seqs;
  b.pages = per_page * b.num_pages;
  return b;
}

ModelCache::ModelCache(const ModelConfig& cfg, DType dtype, const CacheOptions& o)
    : dtype_(dtype), device_(o.device), page_(page_of(cfg, o)), bytes_(plan(cfg, dtype, o)) {
  const int64_t S = o.max_seqs, R = bytes_.num_pages * page_;
  const int64_t P = std::max<int64_t>(1, cfg.indexer.kpool), d = cfg.indexer.head_dim;
  speculative_ = o.speculative;
  const int64_t n_layers = cfg.num_hidden_layers + (speculative_ ? 1 : 0);
  if (speculative_) mtp_layer_ = cfg.num_hidden_layers;
  for (int64_t l = 0; l < n_layers; ++l) {
    Layer L;
    if (l < cfg.num_hidden_layers && cfg.layer_kind(l) == LayerKind::kda) {
      const KdaHparams& k = cfg.kda;
      L.kda = true;
      L.conv = Tensor::zeros(
          {S, k.conv_kernel - 1, 2 * k.num_heads * k.head_dim + k.num_v_heads * k.v_head_dim},
          dtype, device_);
      L.state = Tensor::zeros({S, k.num_v_heads, k.head_dim, k.v_head_dim}, dtype, device_);
      if (speculative_) {
        L.draft_conv = Tensor::zeros(L.conv.shape(), dtype, device_);
        L.draft_state = Tensor::zeros(L.state.shape(), dtype, device_);
      }
    } else {
      L.kv = Tensor::zeros({R, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim},
                           latent_dtype(cfg, dtype, device_, l), device_);
      if (l == mtp_layer_ || has_indexer(cfg, l)) {
        L.keys = Tensor::zeros({R / P, d}, dtype, device_);
        if (P > 1) {
          L.tail_k = Tensor::zeros({S, P, d}, dtype, device_);
          L.tail_gate = Tensor::zeros({S, P, d}, dtype, device_);
        }
      }
    }
    layers_.push_back(std::move(L));
  }
  len_.assign(size_t(S), -1);
  mtp_len_.assign(size_t(S), 0);
  pages_.resize(size_t(S));
  free_.resize(size_t(bytes_.num_pages));
  // Taken from the back: page 0 first.
  std::iota(free_.rbegin(), free_.rend(), int64_t(0));
}

CacheBytes ModelCache::allocated() const {
  CacheBytes b;
  auto add = [](int64_t& to, const Tensor& t) { to += t.defined() ? int64_t(t.nbytes()) : 0; };
  for (const Layer& L : layers_) {
    for (const Tensor* t :
         {&L.conv, &L.state, &L.draft_conv, &L.draft_state, &L.tail_k, &L.tail_gate})
      add(b.slots, *t);
    add(b.pages, L.kv);
    add(b.pages, L.keys);
  }
  b.page_tokens = page_;
  b.num_pages = bytes_.num_pages;
  return b;
}

void ModelCache::check_slot(int64_t slot, const char* what) const {
  HLM_CHECK(slot >= 0 && slot < max_seqs() && len_[size_t(slot)] >= 0,
            "ModelCache::{}: slot {} is not an open sequence (slots 0..{})", what, slot,
            max_seqs() - 1);
}

int64_t ModelCache::open() {
  for (size_t s = 0; s < len_.size(); ++s) {
    if (len_[s] >= 0) continue;
    len_[s] = 0;
    mtp_len_[s] = 0;
    for (Layer& L : layers_)
      for (Tensor* t : {&L.conv, &L.state, &L.tail_k, &L.tail_gate})
        if (t->defined()) t->select(0, int64_t(s)).zero_();
    return int64_t(s);
  }
  throw Error(fmt::format("ModelCache: all {} sequence slots are in use", max_seqs()));
}

void ModelCache::close(int64_t slot) {
  check_slot(slot, "close");
  for (int64_t p : pages_[size_t(slot)]) free_.push_back(p);
  pages_[size_t(slot)].clear();
  len_[size_t(slot)] = -1;
}

bool ModelCache::is_open(int64_t slot) const {
  return slot >= 0 && slot < max_seqs() && len_[size_t(slot)] >= 0;
}

int64_t ModelCache::length(int64_t slot) const {
  check_slot(slot, "length");
  return len_[size_t(slot)];
}

int64_t ModelCache::free_slots() const {
  return int64_t(std::count(len_.begin(), len_.end(), int64_t(-1)));
}

int64_t ModelCache::pages_held(int64_t slot) const {
  check_slot(slot, "pages_held");
  return int64_t(pages_[size_t(slot)].size());
}

int64_t ModelCache::pages_needed(int64_t slot, int64_t count) const {
  check_slot(slot, "reserve");
  const int64_t need = (len_[size_t(slot)] + count + page_ - 1) / page_;
  return std::max<int64_t>(0, need - int64_t(pages_[size_t(slot)].size()));
}

void ModelCache::reserve(const std::vector<int64_t>& slots, const std::vector<int64_t>& counts) {
  HLM_CHECK(slots.size() == counts.size(), "ModelCache::reserve: {} slots and {} counts",
            slots.size(), counts.size());
  int64_t need = 0, tokens = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    HLM_CHECK(counts[i] >= 0, "ModelCache::reserve: count {} for slot {}", counts[i], slots[i]);
    HLM_CHECK(std::count(slots.begin(), slots.end(), slots[i]) == 1,
              "ModelCache::reserve: slot {} appears twice", slots[i]);
    need += pages_needed(slots[i], counts[i]);
    tokens += counts[i];
  }
  HLM_CHECK(need <= free_pages(),
            "ModelCache: {} more tokens need {} pages of {} tokens, {} of {} are free (the cache "
            "holds {} tokens)",
            tokens, need, page_, free_pages(), bytes_.num_pages, bytes_.num_pages * page_);
  for (size_t i = 0; i < slots.size(); ++i)
    for (int64_t k = pages_needed(slots[i], counts[i]); k > 0; --k) {
      pages_[size_t(slots[i])].push_back(free_.back());
      free_.pop_back();
    }
}

void ModelCache::advance(const std::vector<int64_t>& slots, const std::vector<int64_t>& counts) {
  HLM_CHECK(slots.size() == counts.size(), "ModelCache::advance: {} slots and {} counts",
            slots.size(), counts.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    check_slot(slots[i], "advance");
    const int64_t n = len_[size_t(slots[i])] + counts[i];
    HLM_CHECK(counts[i] >= 0 && n <= int64_t(pages_[size_t(slots[i])].size()) * page_,
              "ModelCache::advance: slot {} has room for {} tokens, not {}", slots[i],
              int64_t(pages_[size_t(slots[i])].size()) * page_, n);
    len_[size_t(slots[i])] = n;
  }
}

KdaState ModelCache::kda_states(int64_t layer, const std::vector<int64_t>& slots) const {
  const Layer& L = layers_[size_t(layer)];
  HLM_CHECK(L.kda, "ModelCache: layer {} is not a KDA layer", layer);
  // Rows of a [S, ...] tensor as [N, ...].
  auto gather = [&](const Tensor& t) {
    Shape shape = t.shape();
    const int64_t S = shape[0], row = t.numel() / std::max<int64_t>(S, 1);
    shape[0] = int64_t(slots.size());
    if (row == 0) return Tensor::zeros(shape, t.dtype(), t.device());
    return ops::gather_rows(t.view({S, row}), slots).view(shape);
  };
  KdaState s;
  s.conv = gather(L.conv);
  s.recurrent = gather(L.state);
  return s;
}

KdaState ModelCache::kda_pool(int64_t layer) const {
  const Layer& L = layers_[size_t(layer)];
  HLM_CHECK(L.kda, "ModelCache: layer {} is not a KDA layer", layer);
  return KdaState{L.conv, L.state};
}

void ModelCache::store_kda_states(int64_t layer, const std::vector<int64_t>& slots,
                                  const KdaState& s) {
  Layer& L = layers_[size_t(layer)];
  HLM_CHECK(L.kda, "ModelCache: layer {} is not a KDA layer", layer);
  put_states(L.conv, L.state, slots, s);
}

int64_t ModelCache::mtp_length(int64_t slot) const {
  check_slot(slot, "mtp_length");
  return mtp_len_[size_t(slot)];
}

void ModelCache::advance_mtp(const std::vector<int64_t>& slots,
                             const std::vector<int64_t>& counts) {
  HLM_CHECK(speculative_, "ModelCache::advance_mtp: the cache was made without speculative");
  HLM_CHECK(slots.size() == counts.size(), "ModelCache::advance_mtp: {} slots and {} counts",
            slots.size(), counts.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    check_slot(slots[i], "advance_mtp");
    const int64_t n = mtp_len_[size_t(slots[i])] + counts[i];
    HLM_CHECK(counts[i] >= 0 && n <= len_[size_t(slots[i])],
              "ModelCache::advance_mtp: slot {} would hold {} MTP rows for {} tokens", slots[i], n,
              len_[size_t(slots[i])]);
    mtp_len_[size_t(slots[i])] = n;
  }
}

void ModelCache::store_kda_draft_states(int64_t layer, const std::vector<int64_t>& slots,
                                        const KdaState& s) {
  Layer& L = layers_[size_t(layer)];
  HLM_CHECK(L.kda && speculative_, "ModelCache: layer {} keeps no draft states", layer);
  put_states(L.draft_conv, L.draft_state, slots, s);
}

void ModelCache::put_states(Tensor& conv, Tensor& state, const std::vector<int64_t>& slots,
                            const KdaState& s) const {
  for (size_t i = 0; i < slots.size(); ++i) {
    Tensor c = conv.select(0, slots[i]), r = state.select(0, slots[i]);
    ops::copy_into(c, ops::as_dtype(s.conv.select(0, int64_t(i)), dtype_));
    ops::copy_into(r, ops::as_dtype(s.recurrent.select(0, int64_t(i)), dtype_));
  }
}

void ModelCache::accept_drafts(const std::vector<int64_t>& slots,
                               const std::vector<bool>& accepted) {
  HLM_CHECK(speculative_, "ModelCache::accept_drafts: the cache was made without speculative");
  HLM_CHECK(slots.size() == accepted.size(), "ModelCache::accept_drafts: {} slots, {} flags",
            slots.size(), accepted.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    check_slot(slots[i], "accept_drafts");
    if (!accepted[i]) continue;
    HLM_CHECK(len_[size_t(slots[i])] + 1 <= int64_t(pages_[size_t(slots[i])].size()) * page_,
              "ModelCache::accept_drafts: slot {} has no row for its draft", slots[i]);
    ++len_[size_t(slots[i])];
    for (Layer& L : layers_) {
      if (!L.kda) continue;
      Tensor c = L.conv.select(0, slots[i]), r = L.state.select(0, slots[i]);
      ops::copy_into(c, L.draft_conv.select(0, slots[i]));
      ops::copy_into(r, L.draft_state.select(0, slots[i]));
    }
  }
}

DsaCacheView ModelCache::dsa_view(int64_t layer, const std::vector<int64_t>& slots) const {
  const Layer& L = layers_[size_t(layer)];
  HLM_CHECK(!L.kda, "ModelCache: layer {} is a KDA layer", layer);
  DsaCacheView v;
  v.kv = L.kv;
  v.keys = L.keys;
  v.tail_k = L.tail_k;
  v.tail_gate = L.tail_gate;
  v.page = page_;
  for (int64_t s : slots) {
    check_slot(s, "dsa_view");
    v.slot.push_back(s);
    v.start.push_back(layer == mtp_layer_ ? mtp_len_[size_t(s)] : len_[size_t(s)]);
    v.pages.push_back(&pages_[size_t(s)]);
  }
  return v;
}

}  // namespace hlm
