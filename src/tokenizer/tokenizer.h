// A byte-level BPE tokenizer read from a Hugging Face `tokenizer.json` (the kind the GLM family
// ships): text -> ids and ids -> text, giving the ids Hugging Face `tokenizers` gives.
//
// encode(text):
//   1. the added tokens (`added_tokens`) are cut out of the text, leftmost-longest first: those
//      with normalized = false from the raw text, then the normalizer (none or NFC) runs on what
//      is left, and those with normalized = true are cut out of that; lstrip / rstrip tokens take
//      the whitespace beside them;
//   2. every other stretch goes through the pre-tokenizer steps (`Split` with a regex or a string,
//      `ByteLevel`), which cut it into words and write their bytes in the byte-level alphabet;
//   3. each word is encoded by the BPE model (tokenizer/bpe.h), repeated words from a cache;
//   4. with add_special_tokens, the post-processor's template adds its special tokens.
// decode(ids): the tokens of the ids (special ones left out on request), their characters mapped
// back to bytes (a token with a character outside the byte-level alphabet, such as an added
// token, as its own UTF-8), and the bytes read as UTF-8 with U+FFFD for ill-formed stretches.
//
// What is read and what is refused (each refusal a one-line hlm::Error naming the field and its
// value): docs/tokenizer.md.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace hlm::tokenizer {

struct AddedToken {
  uint32_t id = 0;
  std::string content;
  bool special = false, lstrip = false, rstrip = false, normalized = false;
};

class Tokenizer {
 public:
  // `path`: a tokenizer.json file, or a directory holding one. The directory's
  // tokenizer_config.json, when there is one, names the BOS and EOS tokens (bos_token(),
  // eos_token()).
  static Tokenizer load(const std::string& path);
  // From the parsed JSON of a tokenizer.json; `source` names it in messages. Sees no
  // tokenizer_config.json.
  static Tokenizer from_json(const nlohmann::json& j, const std::string& source);

  // The ids of `text` (well-formed UTF-8, else an error naming the byte offset).
  std::vector<uint32_t> encode(std::string_view text, bool add_special_tokens = false) const;
  // The words the pre-tokenizer cuts `text` into, in the byte-level alphabet (what
  // `tokenizers`' pre_tokenizer.pre_tokenize_str gives: no added tokens, no normalizer).
  std::vector<std::string> pre_tokenize(std::string_view text) const;
  // The text of `ids` (an id without a token is an error naming it and its position).
  std::string decode(std::span<const uint32_t> ids, bool skip_special_tokens = false) const;

  // One more than the largest id of the vocabulary and the added tokens.
  int64_t vocab_size() const;
  std::optional<uint32_t> token_to_id(std::string_view token) const;
  // The token of `id` (an error when it has none).
  const std::string& id_to_token(uint32_t id) const;
  bool is_special(uint32_t id) const;
  const std::vector<AddedToken>& added_tokens() const;
  // The BOS / EOS tokens tokenizer_config.json names ("bos_token", "eos_token": a string or an
  // object with "content"), when it names them.
  std::optional<uint32_t> bos_token() const;
  std::optional<uint32_t> eos_token() const;
  // The file it was read from, or the source given to from_json().
  const std::string& source() const;
  // One line: the file, vocabulary size, merges, added tokens, the pre-tokenizer steps.
  std::string describe() const;

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

}  // namespace hlm::tokenizer
