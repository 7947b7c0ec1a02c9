#include "tokenizer/bpe.h"

#include <queue>

#include "tokenizer/utf8.h"

namespace hlm::tokenizer {

Bpe::Bpe(TokenMap vocab,
         const std::vector<std::pair<std::pair<uint32_t, uint32_t>, uint32_t>>& merges,
         bool ignore_merges, std::optional<uint32_t> unk, bool fuse_unk)
    : vocab_(std::move(vocab)), ignore_merges_(ignore_merges), unk_(unk), fuse_unk_(fuse_unk) {
  merges_.reserve(merges.size());
  for (size_t r = 0; r < merges.size(); ++r) {
    const auto& [pair, id] = merges[r];
    merges_[uint64_t(pair.first) << 32 | pair.second] = Merge{uint32_t(r), id};
  }
  // Single characters of the first 0x800 code points (the byte-level alphabet is below U+0144)
  // are looked up in a table.
  small_char_id_.assign(0x800, -1);
  for (const auto& [tok, id] : vocab_) {
    if (tok.empty() || utf8_sequence_length(tok, 0) != tok.size()) continue;
    const uint32_t cp = utf8_decode(tok, 0, tok.size());
    if (cp < small_char_id_.size()) small_char_id_[cp] = id;
  }
}

std::optional<uint32_t> Bpe::char_id(std::string_view word, size_t i, size_t len) const {
  const uint32_t cp = utf8_decode(word, i, len);
  if (cp < small_char_id_.size()) {
    const int64_t id = small_char_id_[cp];
    return id < 0 ? std::nullopt : std::optional<uint32_t>(uint32_t(id));
  }
  const auto it = vocab_.find(word.substr(i, len));
  return it == vocab_.end() ? std::nullopt : std::optional<uint32_t>(it->second);
}

void Bpe::encode_word(std::string_view word, std::vector<uint32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    const auto it = vocab_.find(word);
    if (it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  // The symbols as a doubly linked list over an array; a merged-away symbol is dead.
  struct Symbol {
    uint32_t id;
    int32_t prev, next;
    bool alive;
  };
  std::vector<Symbol> sym;
  sym.reserve(word.size());
  bool last_unk = false;
  for (size_t i = 0; i < word.size();) {
    size_t n = utf8_sequence_length(word, i);
    if (n == 0) n = 1;  // never for checked input: one byte stands for itself
    const auto id = char_id(word, i, n);
    i += n;
    if (!id) {
      if (!unk_) continue;  // no unknown token: the character is dropped
      if (fuse_unk_ && last_unk) continue;
      last_unk = true;
      sym.push_back({*unk_, int32_t(sym.size()) - 1, int32_t(sym.size()) + 1, true});
      continue;
    }
    last_unk = false;
    sym.push_back({*id, int32_t(sym.size()) - 1, int32_t(sym.size()) + 1, true});
  }
  if (sym.empty()) return;
  sym.back().next = -1;

  // Candidate merges, lowest rank first, then leftmost.
  struct Cand {
    uint32_t rank;
    int32_t pos;
    uint32_t id;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  const auto push = [&](int32_t pos) {
    if (pos < 0) return;
    const int32_t nx = sym[size_t(pos)].next;
    if (nx < 0) return;
    const auto it = merges_.find(uint64_t(sym[size_t(pos)].id) << 32 | sym[size_t(nx)].id);
    if (it != merges_.end()) heap.push({it->second.rank, pos, it->second.id});
  };
  for (int32_t p = 0; p + 1 < int32_t(sym.size()); ++p) push(p);
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    Symbol& s = sym[size_t(c.pos)];
    if (!s.alive || s.next < 0) continue;
    // Still the same pair? (either symbol may have been merged since the candidate was pushed)
    const auto it = merges_.find(uint64_t(s.id) << 32 | sym[size_t(s.next)].id);
    if (it == merges_.end() || it->second.id != c.id) continue;
    Symbol& r = sym[size_t(s.next)];
    s.id = c.id;
    r.alive = false;
    s.next = r.next;
    if (r.next >= 0) sym[size_t(r.next)].prev = c.pos;
    push(s.prev);
    push(c.pos);
  }
  for (int32_t p = 0; p >= 0; p = sym[size_t(p)].next) out.push_back(sym[size_t(p)].id);
}

}  // namespace hlm::tokenizer
