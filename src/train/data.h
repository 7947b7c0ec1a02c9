// Training data as packed THD batches: the Batch struct, the packer, the built-in MQAR task and the
// text / pre-tokenized token-stream sources. Every source is a pure function of (its settings,
// step): batch(step) regenerates any step's batch exactly, so the data position of a resumed run is
// just its step. Formats and decisions: docs/training.md.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/rng.h"
#include "core/tensor.h"

namespace hlm::tokenizer {
class Tokenizer;
}

namespace hlm::train {

constexpr int64_t kIgnoreIndex = -100;  // a target that takes no loss (ops::cross_entropy)

// One step's packed batch of T tokens in N sequences.
struct Batch {
  Tensor tokens;          // [T] i64, the model input
  Tensor targets;         // [T] i64: the next token of the document, kIgnoreIndex where no loss
                          //   (a document's last token, masked positions)
  Tensor loss_mask;       // [T] u8: 1 where targets != kIgnoreIndex, else 0
  Tensor cu_seqlens;      // [N+1] i64, sequence n holds tokens [cu[n], cu[n+1])
  Tensor eval_positions;  // [Q] i64, increasing: the positions accuracy scores (MQAR answers,
                          //   each with a target); empty for text sources

  int64_t num_tokens() const { return tokens.defined() ? tokens.numel() : 0; }
  int64_t num_sequences() const { return cu_seqlens.defined() ? cu_seqlens.numel() - 1 : 0; }
  int64_t num_loss_tokens() const;
};

// Every invariant above, plus tokens in [0, vocab_size) and targets in [0, vocab_size) or
// kIgnoreIndex. Throws hlm::Error naming the field and the position.
void check_batch(const Batch& b, int64_t vocab_size);

// A document before packing: its tokens and, per position, the target that position learns.
struct Document {
  std::vector<int64_t> tokens;
  std::vector<int64_t> targets;         // same length; kIgnoreIndex where no loss
  std::vector<int64_t> eval_positions;  // document-relative, increasing, each with a target
  int64_t size() const { return int64_t(tokens.size()); }
};
// A plain language-modelling document: targets[i] = tokens[i + 1], kIgnoreIndex at the end.
Document lm_document(std::vector<int64_t> tokens);

// Packs documents end to end, each as its own sequence, into at most `budget` tokens.
// A document that does not fit in what is left is cut: its first remaining() tokens become the
// last sequence of the batch. Each position keeps the target it has in its document (the token
// after a cut is still the target of the position before it). A caller that streams documents can
// continue a cut document in the next batch with add(doc, begin); the built-in sources regenerate
// every step from the step alone and never carry a tail over (docs/training.md).
class Packer {
 public:
  explicit Packer(int64_t budget);
  int64_t budget() const { return budget_; }
  int64_t size() const { return int64_t(tokens_.size()); }
  int64_t remaining() const { return budget_ - size(); }
  bool full() const { return remaining() == 0; }
  int64_t num_sequences() const { return int64_t(cu_.size()) - 1; }

  // Appends positions [begin, begin + n) of `doc` as one new sequence, with
  // n = min(doc.size() - begin, remaining()); returns n (0 adds nothing: no empty sequences).
  // The document is validated (hlm::Error on inconsistent targets or eval positions).
  int64_t add(const Document& doc, int64_t begin = 0);
  // The batch of everything added (T = size()); the packer is empty afterwards.
  Batch finish();

 private:
  int64_t budget_;
  std::vector<int64_t> tokens_, targets_, cu_{0}, eval_;
};

// A source of training batches.
class DataSource {
 public:
  virtual ~DataSource() = default;
  // The batch of optimizer step `step` (>= 0; the trainer uses batch(s) for update s).
  virtual Batch batch(int64_t step) const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t tokens_per_step() const = 0;
  virtual std::string describe() const = 0;
};

// ---- MQAR: multi-query associative recall (Arora et al. 2023, "Zoology") ----------------------
// A document with P key-value pairs and Q queries (length 2P + 2Q):
//   k_1 v_1 k_2 v_2 ... k_P v_P  q_1 a_1 q_2 a_2 ... q_Q a_Q
// keys are P distinct tokens of [0, num_keys), values tokens of [num_keys, vocab_size) (drawn with
// replacement), the queries q_j are Q distinct keys of the document in random order and a_j is the
// value paired with q_j. The answer positions (those of q_j, whose target is a_j) are the eval
// positions; the loss is on them only, or on every next token when loss_on_all_tokens.
// P is uniform in [min_pairs, max_pairs], Q = clamp(round(query_fraction * P), 1, P).
// Chance accuracy: 1 / (vocab_size - num_keys) for a guess among the values.
struct MqarConfig {
  int64_t vocab_size = 256;
  int64_t num_keys = 128;  // keys [0, num_keys), values [num_keys, vocab_size)
  int64_t min_pairs = 2;
  int64_t max_pairs = 16;
  double query_fraction = 1.0;  // in (0, 1]
  bool loss_on_all_tokens = false;
  int64_t tokens_per_step = 1024;  // T of every batch (>= 4 * max_pairs)
  int64_t eval_batches = 4;        // batches in the held-out set
  uint64_t seed = 0;
};

class MqarTask : public DataSource {
 public:
  // Training step s uses the Philox stream s of `seed`, held-out batch i the stream
  // kEvalStream + i: the evaluation set never shares random numbers with training.
  static constexpr uint64_t kEvalStream = uint64_t(1) << 62;

  explicit MqarTask(const MqarConfig& cfg);  // validates (hlm::Error naming the field)
  const MqarConfig& config() const { return cfg_; }

  Batch batch(int64_t step) const override;
  Batch eval_batch(int64_t index) const;  // 0 <= index < eval_batches
  int64_t num_eval_batches() const { return cfg_.eval_batches; }
  int64_t vocab_size() const override { return cfg_.vocab_size; }
  int64_t tokens_per_step() const override { return cfg_.tokens_per_step; }
  int64_t num_values() const { return cfg_.vocab_size - cfg_.num_keys; }
  double chance_accuracy() const { return 1.0 / double(num_values()); }
  std::string describe() const override;

  // Documents packed until the budget is full, the last one cut at it (Packer).
  Batch batch_for_stream(uint64_t stream) const;

 private:
  MqarConfig cfg_;
};

// Accuracy over eval positions: the fraction whose prediction equals the target exactly.
struct Accuracy {
  int64_t correct = 0, total = 0;
  double value() const { return total > 0 ? double(correct) / double(total) : 0.0; }
  Accuracy& operator+=(const Accuracy& o) {
    correct += o.correct, total += o.total;
    return *this;
  }
};
// From logits [T, V] (floating; argmax per row, ties to the lowest id, a row with NaN is wrong).
Accuracy accuracy_from_logits(const Batch& b, const Tensor& logits);
// From predicted ids (integer): [T] (one per position) or [Q] (one per eval position, in order).
Accuracy accuracy_from_ids(const Batch& b, const Tensor& ids);

// ---- token streams: byte-level text and pre-tokenized .bin -------------------------------------
// The stream x[0..N) is cut into windows of seq_len tokens; window w is one sequence:
//   without BOS: tokens x[wL .. wL+L),            targets x[wL+1 .. wL+L+1)   (floor((N-1)/L)
//   windows) with BOS b:  tokens b, x[wL .. wL+L-1),       targets x[wL .. wL+L)       (floor(N/L)
//   windows)
// With an EOS id, a window is further split after every EOS token (whose target is kIgnoreIndex):
// documents separated in the stream are separate sequences. Step s holds tokens_per_step / seq_len
// windows, the global draws k = s * per_step + j; draw k takes window perm_e(k mod W) of epoch
// e = k div W, perm_e a Philox permutation of stream e (shuffle) or the identity.
struct TokenStreamConfig {
  int64_t tokens_per_step = 1024;
  int64_t seq_len = 0;  // 0: tokens_per_step; must divide tokens_per_step
  bool shuffle = true;
  uint64_t seed = 0;
  int64_t bos_id = -1;  // >= 0: prepended to every window
  int64_t eos_id = -1;  // >= 0: document separator
};

// Byte-level vocabulary of text files: bytes 0..255, then the specials.
constexpr int64_t kByteBos = 256;  // starts every window of a text file
constexpr int64_t kByteEos = 257;  // reserved (end of generation); never in a text file
constexpr int64_t kByteVocab = 258;

class TokenStream : public DataSource {
 public:
  // ids must be < vocab_size (else hlm::Error naming the position); `what` names the source.
  TokenStream(std::vector<uint32_t> ids, int64_t vocab_size, const TokenStreamConfig& cfg,
              std::string what);

  Batch batch(int64_t step) const override;
  int64_t vocab_size() const override { return vocab_; }
  int64_t tokens_per_step() const override { return cfg_.tokens_per_step; }
  std::string describe() const override;
  const TokenStreamConfig& config() const { return cfg_; }
  int64_t num_tokens() const { return int64_t(ids_.size()); }
  int64_t seq_len() const { return seq_len_; }
  int64_t num_windows() const { return windows_; }
  // The window taken by global draw k (see above).
  int64_t window_of_draw(int64_t k) const;

 private:
  std::vector<uint32_t> ids_;
  int64_t vocab_;
  TokenStreamConfig cfg_;
  std::string what_;
  int64_t seq_len_ = 0, windows_ = 0;
  mutable std::mutex mu_;  // guards the cached permutation
  mutable int64_t perm_epoch_ = -1;
  mutable std::vector<int64_t> perm_;
};

// A UTF-8 text file as byte tokens (vocab kByteVocab, BOS kByteBos on every window; cfg.bos_id
// and cfg.eos_id are overridden). Invalid UTF-8 is an error naming the byte offset.
std::unique_ptr<TokenStream> open_text_file(const std::string& path, TokenStreamConfig cfg);
// A UTF-8 text file encoded with `tok` (tokenizer/tokenizer.h): vocab tok.vocab_size(), BOS and EOS
// as cfg gives them (the caller picks them; -1: none). Special-token strings in the text (such as
// "<|endoftext|>") are encoded as those tokens, as Hugging Face tokenizers does. Invalid UTF-8 is
// an error naming the byte offset.
std::unique_ptr<TokenStream> open_text_file(const std::string& path,
                                            const tokenizer::Tokenizer& tok,
                                            const TokenStreamConfig& cfg);
// Little-endian uint32 ids; the size must be a multiple of 4 and every id < vocab_size (else an
// error naming the id, its position and byte offset).
std::unique_ptr<TokenStream> open_bin_file(const std::string& path, int64_t vocab_size,
                                           const TokenStreamConfig& cfg);
// `--data FILE`: a ".bin" file is pre-tokenized ids (vocab_size required), anything else text.
std::unique_ptr<TokenStream> open_data_file(const std::string& path, int64_t vocab_size,
                                            const TokenStreamConfig& cfg);

}  // namespace hlm::train
