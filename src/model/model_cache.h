// ModelCache: the inference state of the sequences a model is generating, in a memory budget fixed
// when it is made (docs/inference.md, "The cache").
//
//   sequence slots   max_seqs of them; a slot holds, for every KDA layer, the conv state
//                    [W-1, 2HK + HV V] and the recurrent state [HV, K, V] (fixed size whatever
//                    the sequence's length), and for every KPool layer the incomplete pool's keys
//                    and gates [P, d_I] (the tail);
//   token pages      `page` tokens each, from one pool shared by all sequences; a page holds its
//                    tokens' rows of every DSA / MLA layer: the latent row [r_kv + d_r] (NoPE: the
//                    512-wide latent), and the indexer's scoring key [d_I] (P = 1) or the pooled
//                    keys of its page / P pools (KPool). Pages are taken as a sequence grows and
//                    given back when it closes.
//
// So a long sequence takes pages only for what grows with its length, and the KDA layers cost a
// fixed slot. Storage is in the model's compute dtype (f32; f64 for f64 models) on the model's
// device (CacheOptions::device), but for the latent rows on CUDA: those are kept as the attention
// takes them there, bf16 unless the MLA projections are native (Mla::attention_operand), half the
// bytes, and the training forward's operands bit for bit.
//
// Use: open() a slot per sequence, reserve() pages for the tokens of the next forward (all or
// nothing: a request that does not fit changes nothing), run the forward with the slots
// (ModelInputs::cache), advance() the lengths; close() frees the slot and its pages.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "layers/dsa/dsa_cache.h"
#include "layers/kda/kda_layer.h"
#include "model/config.h"

namespace hlm {

struct CacheOptions {
  int64_t max_seqs = 8;        // sequence slots
  int64_t max_tokens = 32768;  // token capacity of the page pool (rounded up to whole pages)
  int64_t page = 64;           // tokens per page (rounded up to a multiple of the KPool size)
  // Speculative decoding with the MTP block as the drafter (docs/inference.md, "Speculative
  // decoding"): the MTP block's DSA layer gets its own rows (in the same pages, its own length
  // per slot), and every KDA layer a second state per slot, the state after a draft token until
  // the draft is accepted or dropped.
  bool speculative = false;
  Device device = Device::cpu;  // where the storage lives: the model's device
};

struct CacheBytes {
  int64_t per_token = 0;     // page storage per token (every DSA / MLA layer)
  int64_t per_sequence = 0;  // one slot: the KDA states and the KPool tails
  int64_t slots = 0;         // all slots
  int64_t pages = 0;         // the page pool
  int64_t total() const { return slots + pages; }
  int64_t page_tokens = 0;  // tokens per page
  int64_t num_pages = 0;    // pages in the pool
};

class ModelCache {
 public:
  ModelCache(const ModelConfig& cfg, DType dtype, const CacheOptions& opt = {});

  // The dtype of layer `layer`'s latent rows (the MTP block's: num_hidden_layers) in a cache of
  // compute dtype `dtype` on `device`: bf16 on CUDA unless the layer's kv_b_proj resolves to
  // native, else `dtype`.
  static DType latent_dtype(const ModelConfig& cfg, DType dtype, Device device, int64_t layer);
  // The bytes a cache of these options takes (nothing allocated).
  static CacheBytes plan(const ModelConfig& cfg, DType dtype, const CacheOptions& opt);
  const CacheBytes& bytes() const { return bytes_; }
  // The bytes of the tensors this cache allocated: slots (KDA states, KPool tails) and pages.
  CacheBytes allocated() const;
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int64_t max_seqs() const { return int64_t(len_.size()); }

  // A free slot with an empty sequence and zero states; hlm::Error when every slot is taken.
  int64_t open();
  void close(int64_t slot);  // frees the slot and its pages
  bool is_open(int64_t slot) const;
  int64_t length(int64_t slot) const;  // tokens cached
  int64_t free_slots() const;
  int64_t free_pages() const { return int64_t(free_.size()); }
  int64_t page_tokens() const { return page_; }
  int64_t pages_held(int64_t slot) const;  // pages the slot's sequence holds
  // Pages that counts more tokens of slot would take.
  int64_t pages_needed(int64_t slot, int64_t count) const;
  // Speculative decoding (CacheOptions::speculative):
  bool speculative() const { return speculative_; }
  int64_t mtp_layer() const { return mtp_layer_; }  // the MTP block's entry (num_hidden_layers)
  int64_t mtp_length(int64_t slot) const;           // MTP rows cached (at most length(slot))
  void advance_mtp(const std::vector<int64_t>& slots, const std::vector<int64_t>& counts);
  // After a forward whose last token per sequence was a draft (ModelInputs::draft_last; the
  // forward advanced each length by the tokens before it): an accepted draft becomes part of its
  // sequence (its KDA states become the slot's), a rejected one is dropped (its rows are left
  // beyond the length, to be overwritten).
  void accept_drafts(const std::vector<int64_t>& slots, const std::vector<bool>& accepted);
  // The KDA states after the draft token (written by the draft forward).
  void store_kda_draft_states(int64_t layer, const std::vector<int64_t>& slots, const KdaState& s);

  // Pages for counts[i] more tokens of slots[i] (distinct open slots), taken all or none: throws
  // hlm::Error naming the tokens asked and the room left when they do not fit.
  void reserve(const std::vector<int64_t>& slots, const std::vector<int64_t>& counts);
  // The counts of the forward that filled the reserved rows become part of the sequences.
  void advance(const std::vector<int64_t>& slots, const std::vector<int64_t>& counts);

  // ---- what the model's layers read and write ----
  bool is_kda(int64_t layer) const { return layers_[size_t(layer)].kda; }
  // The KDA states of `slots` gathered [N, ...] (compute dtype), and written back.
  KdaState kda_states(int64_t layer, const std::vector<int64_t>& slots) const;
  void store_kda_states(int64_t layer, const std::vector<int64_t>& slots, const KdaState& s);
  // A KDA layer's state pools themselves ([S, ...], shared storage): what KdaLayer::decode_step
  // advances in place.
  KdaState kda_pool(int64_t layer) const;
  // A DSA / MLA layer's view for a forward over `slots`, whose new tokens start at length(slot).
  DsaCacheView dsa_view(int64_t layer, const std::vector<int64_t>& slots) const;

 private:
  struct Layer {
    bool kda = false;
    Tensor conv, state;                  // KDA: [S, W-1, C], [S, HV, K, V]
    Tensor draft_conv, draft_state;      // KDA, speculative: the states after a draft token
    Tensor kv, keys, tail_k, tail_gate;  // DSA / MLA
  };
  void check_slot(int64_t slot, const char* what) const;
  // Row i of s's states into rows slots[i] of conv / state.
  void put_states(Tensor& conv, Tensor& state, const std::vector<int64_t>& slots,
                  const KdaState& s) const;

  DType dtype_;
  Device device_ = Device::cpu;
  int64_t page_ = 0;
  bool speculative_ = false;
  int64_t mtp_layer_ = -1;
  std::vector<int64_t> mtp_len_;  // per slot
  CacheBytes bytes_;
  std::vector<Layer> layers_;
  std::vector<int64_t> len_;                 // per slot; -1: free
  std::vector<std::vector<int64_t>> pages_;  // per slot
  std::vector<int64_t> free_;                // free pages (taken from the back)
};

}  // namespace hlm
