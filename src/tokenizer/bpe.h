// The BPE model of a byte-level BPE tokenizer: a vocabulary (token string -> id) and ranked
// merges (pair of ids -> rank, id of the merged token). A word (one pre-tokenized piece, already
// in the byte-level alphabet) starts as one symbol per character; the adjacent pair of lowest
// rank is merged, the leftmost first among equal ranks, until no pair of the word has a merge.
// This is Hugging Face `tokenizers`' BPE (without dropout): a priority queue of candidate merges
// over a linked list of symbols, O(n log n) in the length of the word.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace hlm::tokenizer {

// Hash of std::string keys that also looks up std::string_view without a copy.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using TokenMap = std::unordered_map<std::string, uint32_t, StringHash, std::equal_to<>>;

class Bpe {
 public:
  struct Merge {
    uint32_t rank, id;
  };
  // `vocab` token -> id; merges[r] = the pair (left id, right id) of rank r with the id of the
  // merged token (the caller checked that every id is in the vocabulary). A later merge of the
  // same pair replaces an earlier one. `unk`: the id that stands for a character missing from the
  // vocabulary (consecutive ones fused into one when fuse_unk); without one such a character is
  // dropped, as `tokenizers` does.
  Bpe(TokenMap vocab, const std::vector<std::pair<std::pair<uint32_t, uint32_t>, uint32_t>>& merges,
      bool ignore_merges, std::optional<uint32_t> unk, bool fuse_unk);

  // Appends the ids of `word` (UTF-8) to `out`.
  void encode_word(std::string_view word, std::vector<uint32_t>& out) const;

  const TokenMap& vocab() const { return vocab_; }
  size_t num_merges() const { return merges_.size(); }

 private:
  std::optional<uint32_t> char_id(std::string_view word, size_t i, size_t len) const;

  TokenMap vocab_;
  std::unordered_map<uint64_t, Merge> merges_;  // key: left << 32 | right
  std::vector<int64_t> small_char_id_;          // id of code point cp < its size, or -1
  bool ignore_merges_;
  std::optional<uint32_t> unk_;
  bool fuse_unk_;
};

}  // namespace hlm::tokenizer
