// Packed batches, MQAR and token-stream sources (see data.h and docs/training.md).
#include "train/data.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>

#include "core/file_io.h"
#include "core/seq_layout.h"
#include "tokenizer/tokenizer.h"

namespace hlm::train {
namespace {

Tensor i64_tensor(const std::vector<int64_t>& v) {
  return Tensor::from_vector<int64_t>({int64_t(v.size())}, v);
}

// A regular file only (a FIFO, device or directory is refused without blocking), no larger than
// the memory limit (core/file_io.h).
std::vector<uint8_t> read_file_bytes(const std::string& path, const char* what) {
  return read_regular_file(path, what);
}

// Offset of the first byte that is not part of a well-formed UTF-8 sequence (RFC 3629: no
// overlong forms, no surrogates, nothing above U+10FFFF), or -1.
int64_t first_invalid_utf8(const std::vector<uint8_t>& s) {
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const uint8_t c = s[i];
    size_t len;
    uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xe0) == 0xc0) {
      len = 2, cp = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      len = 3, cp = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      len = 4, cp = c & 0x07;
    } else {
      return int64_t(i);
    }
    if (i + len > n) return int64_t(i);
    for (size_t k = 1; k < len; ++k) {
      if ((s[i + k] & 0xc0) != 0x80) return int64_t(i);
      cp = (cp << 6) | (s[i + k] & 0x3f);
    }
    const uint32_t min_cp = len == 2 ? 0x80 : len == 3 ? 0x800 : 0x10000;
    if (cp < min_cp || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return int64_t(i);
    i += len;
  }
  return -1;
}

}  // namespace

// ---- Batch -------------------------------------------------------------------------------------

int64_t Batch::num_loss_tokens() const {
  if (!loss_mask.defined()) return 0;
  const uint8_t* m = loss_mask.contiguous().data<uint8_t>();
  int64_t n = 0;
  for (int64_t i = 0; i < loss_mask.numel(); ++i) n += m[i] != 0;
  return n;
}

void check_batch(const Batch& b, int64_t vocab_size) {
  HLM_CHECK(vocab_size > 0, "check_batch: vocab_size must be > 0, got {}", vocab_size);
  for (auto [t, name] : {std::pair{&b.tokens, "tokens"},
                         {&b.targets, "targets"},
                         {&b.cu_seqlens, "cu_seqlens"},
                         {&b.eval_positions, "eval_positions"}}) {
    HLM_CHECK(t->defined(), "batch.{} is undefined", name);
    HLM_CHECK(t->is_cpu() && t->dtype() == DType::i64 && t->dim() == 1,
              "batch.{} must be a 1-D i64 CPU tensor, got {}", name, t->describe());
  }
  HLM_CHECK(b.loss_mask.defined() && b.loss_mask.is_cpu() && b.loss_mask.dtype() == DType::u8 &&
                b.loss_mask.dim() == 1,
            "batch.loss_mask must be a 1-D u8 CPU tensor, got {}",
            b.loss_mask.defined() ? b.loss_mask.describe() : std::string("undefined"));
  const int64_t T = b.tokens.numel();
  check_shape(b.targets, {T}, "batch.targets");
  check_shape(b.loss_mask, {T}, "batch.loss_mask");
  SeqLayout::from_tensor(b.cu_seqlens, T, "batch.cu_seqlens");
  const auto tok = b.tokens.to_f64_vector(), tgt = b.targets.to_f64_vector();
  const Tensor mask = b.loss_mask.contiguous();
  const uint8_t* m = mask.data<uint8_t>();
  for (int64_t i = 0; i < T; ++i) {
    const int64_t x = int64_t(tok[size_t(i)]), y = int64_t(tgt[size_t(i)]);
    HLM_CHECK(x >= 0 && x < vocab_size, "batch.tokens[{}] = {} is outside [0, {})", i, x,
              vocab_size);
    HLM_CHECK(y == kIgnoreIndex || (y >= 0 && y < vocab_size),
              "batch.targets[{}] = {} is outside [0, {}) and not the ignore index {}", i, y,
              vocab_size, kIgnoreIndex);
    HLM_CHECK((m[i] != 0) == (y != kIgnoreIndex),
              "batch.loss_mask[{}] = {} disagrees with targets[{}] = {}", i, int(m[i]), i, y);
  }
  const auto ev = b.eval_positions.to_f64_vector();
  for (size_t q = 0; q < ev.size(); ++q) {
    const int64_t p = int64_t(ev[q]);
    HLM_CHECK(p >= 0 && p < T, "batch.eval_positions[{}] = {} is outside [0, {})", q, p, T);
    HLM_CHECK(q == 0 || p > int64_t(ev[q - 1]), "batch.eval_positions must increase, [{}] = {}", q,
              p);
    HLM_CHECK(int64_t(tgt[size_t(p)]) != kIgnoreIndex,
              "batch.eval_positions[{}] = {} has no target", q, p);
  }
}

Document lm_document(std::vector<int64_t> tokens) {
  Document d;
  d.targets.resize(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i)
    d.targets[i] = i + 1 < tokens.size() ? tokens[i + 1] : kIgnoreIndex;
  d.tokens = std::move(tokens);
  return d;
}

// ---- Packer ------------------------------------------------------------------------------------

Packer::Packer(int64_t budget) : budget_(budget) {
  HLM_CHECK(budget > 0, "Packer: the token budget must be > 0, got {}", budget);
  tokens_.reserve(size_t(budget));
  targets_.reserve(size_t(budget));
}

int64_t Packer::add(const Document& doc, int64_t begin) {
  const int64_t L = doc.size();
  HLM_CHECK(int64_t(doc.targets.size()) == L, "Packer: document has {} tokens but {} targets", L,
            doc.targets.size());
  HLM_CHECK(begin >= 0 && begin <= L, "Packer: begin {} is outside the document [0, {}]", begin, L);
  for (size_t q = 0; q < doc.eval_positions.size(); ++q) {
    const int64_t p = doc.eval_positions[q];
    HLM_CHECK(p >= 0 && p < L, "Packer: eval position {} is outside the document of length {}", p,
              L);
    HLM_CHECK(q == 0 || p > doc.eval_positions[q - 1], "Packer: eval positions must increase");
    HLM_CHECK(doc.targets[size_t(p)] != kIgnoreIndex, "Packer: eval position {} has no target", p);
  }
  const int64_t n = std::min(L - begin, remaining());
  if (n <= 0) return 0;
  const int64_t base = size();
  tokens_.insert(tokens_.end(), doc.tokens.begin() + begin, doc.tokens.begin() + begin + n);
  targets_.insert(targets_.end(), doc.targets.begin() + begin, doc.targets.begin() + begin + n);
  for (int64_t p : doc.eval_positions)
    if (p >= begin && p < begin + n) eval_.push_back(base + p - begin);
  cu_.push_back(size());
  return n;
}

Batch Packer::finish() {
  Batch b;
  std::vector<uint8_t> mask(targets_.size());
  for (size_t i = 0; i < targets_.size(); ++i) mask[i] = targets_[i] != kIgnoreIndex;
  b.tokens = i64_tensor(tokens_);
  b.targets = i64_tensor(targets_);
  b.loss_mask = Tensor::from_vector<uint8_t>({int64_t(mask.size())}, mask);
  b.cu_seqlens = i64_tensor(cu_);
  b.eval_positions = i64_tensor(eval_);
  tokens_.clear(), targets_.clear(), eval_.clear();
  cu_.assign(1, 0);
  return b;
}

// ---- MQAR --------------------------------------------------------------------------------------

MqarTask::MqarTask(const MqarConfig& cfg) : cfg_(cfg) {
  HLM_CHECK(cfg.num_keys >= 1, "mqar: num_keys must be >= 1, got {}", cfg.num_keys);
  HLM_CHECK(cfg.vocab_size > cfg.num_keys,
            "mqar: vocab_size ({}) must exceed num_keys ({}) to leave room for the values",
            cfg.vocab_size, cfg.num_keys);
  HLM_CHECK(cfg.min_pairs >= 1 && cfg.min_pairs <= cfg.max_pairs,
            "mqar: need 1 <= min_pairs <= max_pairs, got {} and {}", cfg.min_pairs, cfg.max_pairs);
  HLM_CHECK(cfg.max_pairs <= cfg.num_keys,
            "mqar: max_pairs ({}) must not exceed num_keys ({}): keys of a document are distinct",
            cfg.max_pairs, cfg.num_keys);
  HLM_CHECK(std::isfinite(cfg.query_fraction) && cfg.query_fraction > 0 && cfg.query_fraction <= 1,
            "mqar: query_fraction must be in (0, 1], got {}", cfg.query_fraction);
  HLM_CHECK(cfg.tokens_per_step >= 4 * cfg.max_pairs,
            "mqar: tokens_per_step ({}) must hold the longest document (4 * max_pairs = {})",
            cfg.tokens_per_step, 4 * cfg.max_pairs);
  HLM_CHECK(cfg.eval_batches >= 0, "mqar: eval_batches must be >= 0, got {}", cfg.eval_batches);
}

std::string MqarTask::describe() const {
  return fmt::format(
      "MQAR: vocab {} (keys [0, {}), values [{}, {})), {}..{} pairs per document, query fraction "
      "{:g}, loss on {}, {} tokens per step, seed {}, chance accuracy {:.4f}",
      cfg_.vocab_size, cfg_.num_keys, cfg_.num_keys, cfg_.vocab_size, cfg_.min_pairs,
      cfg_.max_pairs, cfg_.query_fraction, cfg_.loss_on_all_tokens ? "all tokens" : "answers",
      cfg_.tokens_per_step, cfg_.seed, chance_accuracy());
}

Batch MqarTask::batch(int64_t step) const {
  HLM_CHECK(step >= 0 && uint64_t(step) < kEvalStream, "mqar: step {} is outside [0, 2^62)", step);
  return batch_for_stream(uint64_t(step));
}

Batch MqarTask::eval_batch(int64_t index) const {
  HLM_CHECK(index >= 0 && index < cfg_.eval_batches,
            "mqar: eval batch {} is outside [0, {}) (eval_batches)", index, cfg_.eval_batches);
  return batch_for_stream(kEvalStream + uint64_t(index));
}

Batch MqarTask::batch_for_stream(uint64_t stream) const {
  Rng rng(cfg_.seed, stream);
  const int64_t K = cfg_.num_keys, NV = num_values();
  // Keys are drawn without replacement by a partial Fisher-Yates shuffle of this pool; the pool
  // starts as the identity every step and carries its order from document to document (any
  // arrangement of the pool gives a uniform draw).
  std::vector<int64_t> pool(static_cast<size_t>(K));
  for (int64_t i = 0; i < K; ++i) pool[size_t(i)] = i;
  std::vector<int64_t> keys, values, order;
  Packer packer(cfg_.tokens_per_step);
  Document d;
  while (!packer.full()) {
    const int64_t P =
        cfg_.min_pairs + int64_t(rng.below(uint64_t(cfg_.max_pairs - cfg_.min_pairs + 1)));
    keys.resize(size_t(P));
    values.resize(size_t(P));
    for (int64_t i = 0; i < P; ++i) {
      const int64_t j = i + int64_t(rng.below(uint64_t(K - i)));
      std::swap(pool[size_t(i)], pool[size_t(j)]);
      keys[size_t(i)] = pool[size_t(i)];
    }
    for (int64_t i = 0; i < P; ++i) values[size_t(i)] = K + int64_t(rng.below(uint64_t(NV)));
    const int64_t Q =
        std::clamp<int64_t>(std::llround(cfg_.query_fraction * double(P)), int64_t(1), P);
    order.resize(size_t(P));
    for (int64_t i = 0; i < P; ++i) order[size_t(i)] = i;
    for (int64_t i = 0; i < Q; ++i) {
      const int64_t j = i + int64_t(rng.below(uint64_t(P - i)));
      std::swap(order[size_t(i)], order[size_t(j)]);
    }
    const int64_t L = 2 * P + 2 * Q;
    d.tokens.resize(size_t(L));
    d.eval_positions.resize(size_t(Q));
    for (int64_t i = 0; i < P; ++i) {
      d.tokens[size_t(2 * i)] = keys[size_t(i)];
      d.tokens[size_t(2 * i + 1)] = values[size_t(i)];
    }
    for (int64_t j = 0; j < Q; ++j) {
      const int64_t pos = 2 * P + 2 * j, pair = order[size_t(j)];
      d.tokens[size_t(pos)] = keys[size_t(pair)];
      d.tokens[size_t(pos + 1)] = values[size_t(pair)];
      d.eval_positions[size_t(j)] = pos;
    }
    d.targets.assign(size_t(L), kIgnoreIndex);
    if (cfg_.loss_on_all_tokens) {
      for (int64_t i = 0; i + 1 < L; ++i) d.targets[size_t(i)] = d.tokens[size_t(i + 1)];
    } else {
      for (int64_t p : d.eval_positions) d.targets[size_t(p)] = d.tokens[size_t(p + 1)];
    }
    packer.add(d);
  }
  return packer.finish();
}

// ---- accuracy ----------------------------------------------------------------------------------

Accuracy accuracy_from_logits(const Batch& b, const Tensor& logits) {
  const int64_t T = b.num_tokens();
  HLM_CHECK(logits.defined() && logits.is_cpu() && is_floating(logits.dtype()),
            "accuracy: logits must be a floating CPU tensor");
  HLM_CHECK(logits.dim() == 2 && logits.size(0) == T,
            "accuracy: logits must be [T = {}, V], got {}", T, logits.describe());
  const auto ev = b.eval_positions.to_f64_vector();
  const auto tgt = b.targets.to_f64_vector();
  Accuracy a;
  for (double pe : ev) {
    const int64_t p = int64_t(pe);
    HLM_CHECK(p >= 0 && p < T, "accuracy: eval position {} is outside [0, {})", p, T);
    const auto row = logits.select(0, p).to_f64_vector();
    int64_t best = -1;
    double best_v = 0;
    for (size_t v = 0; v < row.size(); ++v) {
      if (std::isnan(row[v])) {
        best = -1;
        break;
      }
      if (best < 0 || row[v] > best_v) best = int64_t(v), best_v = row[v];
    }
    a.total += 1;
    a.correct += best >= 0 && best == int64_t(tgt[size_t(p)]);
  }
  return a;
}

Accuracy accuracy_from_ids(const Batch& b, const Tensor& ids) {
  const int64_t T = b.num_tokens();
  HLM_CHECK(ids.defined() && ids.is_cpu() &&
                (ids.dtype() == DType::i64 || ids.dtype() == DType::i32) && ids.dim() == 1,
            "accuracy: predicted ids must be a 1-D i64 or i32 CPU tensor");
  const auto ev = b.eval_positions.to_f64_vector();
  const int64_t Q = int64_t(ev.size());
  HLM_CHECK(ids.numel() == T || ids.numel() == Q,
            "accuracy: predicted ids must be [T = {}] or [Q = {}], got {}", T, Q, ids.describe());
  const bool per_token = ids.numel() == T;
  const auto pred = ids.to_f64_vector(), tgt = b.targets.to_f64_vector();
  Accuracy a;
  for (int64_t q = 0; q < Q; ++q) {
    const int64_t p = int64_t(ev[size_t(q)]);
    HLM_CHECK(p >= 0 && p < T, "accuracy: eval position {} is outside [0, {})", p, T);
    a.total += 1;
    a.correct += pred[size_t(per_token ? p : q)] == tgt[size_t(p)];
  }
  return a;
}

// ---- token streams -----------------------------------------------------------------------------

TokenStream::TokenStream(std::vector<uint32_t> ids, int64_t vocab_size,
                         const TokenStreamConfig& cfg, std::string what)
    : ids_(std::move(ids)), vocab_(vocab_size), cfg_(cfg), what_(std::move(what)) {
  HLM_CHECK(vocab_size > 0 && vocab_size <= (int64_t(1) << 32),
            "{}: vocab_size must be in [1, 2^32], got {}", what_, vocab_size);
  HLM_CHECK(cfg.tokens_per_step > 0, "{}: tokens_per_step must be > 0, got {}", what_,
            cfg.tokens_per_step);
  seq_len_ = cfg.seq_len == 0 ? cfg.tokens_per_step : cfg.seq_len;
  HLM_CHECK(seq_len_ > 0 && cfg.tokens_per_step % seq_len_ == 0,
            "{}: seq_len ({}) must be > 0 and divide tokens_per_step ({})", what_, seq_len_,
            cfg.tokens_per_step);
  HLM_CHECK(cfg.bos_id < vocab_size && cfg.eos_id < vocab_size,
            "{}: bos_id ({}) and eos_id ({}) must be < vocab_size ({})", what_, cfg.bos_id,
            cfg.eos_id, vocab_size);
  HLM_CHECK(!(cfg.bos_id >= 0 && seq_len_ < 2), "{}: with a BOS token seq_len must be >= 2", what_);
  for (size_t i = 0; i < ids_.size(); ++i)
    HLM_CHECK(int64_t(ids_[i]) < vocab_size,
              "{}: token id {} at position {} (byte offset {}) is >= vocab_size {}", what_, ids_[i],
              i, 4 * i, vocab_size);
  const int64_t N = int64_t(ids_.size());
  windows_ = cfg.bos_id >= 0 ? N / seq_len_ : (N >= 1 ? (N - 1) / seq_len_ : 0);
  HLM_CHECK(windows_ >= 1, "{}: {} tokens are fewer than one window of {} tokens ({})", what_, N,
            seq_len_, cfg.bos_id >= 0 ? "seq_len" : "seq_len + 1");
}

std::string TokenStream::describe() const {
  return fmt::format("{}: {} tokens, vocab {}, {} windows of {} tokens, {} per step, {}", what_,
                     ids_.size(), vocab_, windows_, seq_len_, cfg_.tokens_per_step / seq_len_,
                     cfg_.shuffle ? fmt::format("shuffled (seed {})", cfg_.seed) : "in order");
}

int64_t TokenStream::window_of_draw(int64_t k) const {
  HLM_CHECK(k >= 0, "{}: window draw {} is negative", what_, k);
  const int64_t epoch = k / windows_, idx = k % windows_;
  if (!cfg_.shuffle) return idx;
  std::lock_guard<std::mutex> lock(mu_);
  if (perm_epoch_ != epoch) {
    // Fisher-Yates over the windows with Philox stream `epoch` of the seed.
    Rng rng(cfg_.seed, uint64_t(epoch));
    perm_.resize(size_t(windows_));
    for (int64_t i = 0; i < windows_; ++i) perm_[size_t(i)] = i;
    for (int64_t i = windows_ - 1; i > 0; --i)
      std::swap(perm_[size_t(i)], perm_[size_t(rng.below(uint64_t(i + 1)))]);
    perm_epoch_ = epoch;
  }
  return perm_[size_t(idx)];
}

Batch TokenStream::batch(int64_t step) const {
  HLM_CHECK(step >= 0, "{}: step {} is negative", what_, step);
  const int64_t per_step = cfg_.tokens_per_step / seq_len_, L = seq_len_;
  const bool bos = cfg_.bos_id >= 0;
  Packer packer(cfg_.tokens_per_step);
  Document d;
  for (int64_t j = 0; j < per_step; ++j) {
    const int64_t w = window_of_draw(step * per_step + j);
    const int64_t s = w * L;
    d.tokens.resize(size_t(L));
    d.targets.resize(size_t(L));
    for (int64_t i = 0; i < L; ++i) {
      // Position i reads x[s + i - bos] (or the BOS) and learns x[s + i + 1 - bos].
      const int64_t src = s + i - (bos ? 1 : 0);
      d.tokens[size_t(i)] = src < s ? cfg_.bos_id : int64_t(ids_[size_t(src)]);
      d.targets[size_t(i)] = int64_t(ids_[size_t(src + 1)]);
    }
    if (cfg_.eos_id < 0) {
      packer.add(d);
      continue;
    }
    // Split after every EOS: it ends its document, so it has no target.
    int64_t begin = 0;
    for (int64_t i = 0; i < L; ++i) {
      if (d.tokens[size_t(i)] != cfg_.eos_id && i + 1 < L) continue;
      if (d.tokens[size_t(i)] == cfg_.eos_id) d.targets[size_t(i)] = kIgnoreIndex;
      Document piece;
      piece.tokens.assign(d.tokens.begin() + begin, d.tokens.begin() + i + 1);
      piece.targets.assign(d.targets.begin() + begin, d.targets.begin() + i + 1);
      packer.add(piece);
      begin = i + 1;
    }
  }
  return packer.finish();
}

std::unique_ptr<TokenStream> open_text_file(const std::string& path, TokenStreamConfig cfg) {
  const auto bytes = read_file_bytes(path, "text data file");
  const int64_t bad = first_invalid_utf8(bytes);
  HLM_CHECK(bad < 0, "text data file '{}': invalid UTF-8 at byte offset {} (byte 0x{:02x})", path,
            bad, bad >= 0 ? bytes[size_t(bad)] : 0);
  std::vector<uint32_t> ids(bytes.begin(), bytes.end());
  cfg.bos_id = kByteBos;
  cfg.eos_id = -1;
  return std::make_unique<TokenStream>(std::move(ids), kByteVocab, cfg,
                                       fmt::format("text data file '{}'", path));
}

std::unique_ptr<TokenStream> open_text_file(const std::string& path,
                                            const tokenizer::Tokenizer& tok,
                                            const TokenStreamConfig& cfg) {
  const auto bytes = read_file_bytes(path, "text data file");
  const int64_t bad = first_invalid_utf8(bytes);
  HLM_CHECK(bad < 0, "text data file '{}': invalid UTF-8 at byte offset {} (byte 0x{:02x})", path,
            bad, bad >= 0 ? bytes[size_t(bad)] : 0);
  // BOS / EOS: ids with a token of the tokenizer.
  const auto name = [&](int64_t id, const char* what) {
    if (id < 0) return std::string("none");
    HLM_CHECK(id < tok.vocab_size(),
              "text data file '{}': the {} id {} is outside the vocabulary "
              "of the tokenizer {} (ids 0..{})",
              path, what, id, tok.source(), tok.vocab_size() - 1);
    return fmt::format("{} = \"{}\"", id, printable(tok.id_to_token(uint32_t(id))));
  };
  const std::string bos = name(cfg.bos_id, "BOS"), eos = name(cfg.eos_id, "EOS");
  std::vector<uint32_t> ids =
      tok.encode(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
  return std::make_unique<TokenStream>(
      std::move(ids), tok.vocab_size(), cfg,
      fmt::format("text data file '{}' (tokenizer {}, BOS {}, EOS {})", path, tok.source(), bos,
                  eos));
}

std::unique_ptr<TokenStream> open_bin_file(const std::string& path, int64_t vocab_size,
                                           const TokenStreamConfig& cfg) {
  HLM_CHECK(vocab_size > 0, "token file '{}': a vocab_size > 0 is needed to check the ids", path);
  const auto bytes = read_file_bytes(path, "token file");
  HLM_CHECK(bytes.size() % 4 == 0,
            "token file '{}': size {} bytes is not a multiple of 4 (little-endian uint32 ids)",
            path, bytes.size());
  std::vector<uint32_t> ids(bytes.size() / 4);
  for (size_t i = 0; i < ids.size(); ++i)
    ids[i] = uint32_t(bytes[4 * i]) | uint32_t(bytes[4 * i + 1]) << 8 |
             uint32_t(bytes[4 * i + 2]) << 16 | uint32_t(bytes[4 * i + 3]) << 24;
  return std::make_unique<TokenStream>(std::move(ids), vocab_size, cfg,
                                       fmt::format("token file '{}'", path));
}

std::unique_ptr<TokenStream> open_data_file(const std::string& path, int64_t vocab_size,
                                            const TokenStreamConfig& cfg) {
  const bool bin = path.size() >= 4 && path.compare(path.size() - 4, 4, ".bin") == 0;
  if (bin) return open_bin_file(path, vocab_size, cfg);
  HLM_CHECK(vocab_size <= 0 || vocab_size >= kByteVocab,
            "text data file '{}': byte-level text needs a vocabulary of at least {} (256 bytes + "
            "BOS + EOS), the model has {}",
            path, kByteVocab, vocab_size);
  return open_text_file(path, cfg);
}

}  // namespace hlm::train
