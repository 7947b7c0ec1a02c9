#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <array>
#include <deque>
#include <filesystem>
#include <unordered_map>

#include "core/error.h"
#include "core/file_io.h"
#include "core/json.h"
#include "tokenizer/bpe.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/regex.h"
#include "tokenizer/utf8.h"

namespace hlm::tokenizer {

using nlohmann::json;
namespace fs = std::filesystem;

namespace {

// The pre-tokenizer of GPT-2, which a ByteLevel step with use_regex = true applies.
constexpr const char* kByteLevelRegex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Ids are dense enough to be an index: at most 2^24 of them.
constexpr int64_t kMaxVocab = int64_t(1) << 24;

enum class Behavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

const char* behavior_name(Behavior b) {
  switch (b) {
    case Behavior::removed:
      return "Removed";
    case Behavior::isolated:
      return "Isolated";
    case Behavior::merged_with_previous:
      return "MergedWithPrevious";
    case Behavior::merged_with_next:
      return "MergedWithNext";
    case Behavior::contiguous:
      return "Contiguous";
  }
  return "?";
}

struct Step {
  enum Kind { split, byte_level } kind = split;
  std::unique_ptr<Regex> regex;  // split
  bool literal = false;
  Behavior behavior = Behavior::isolated;
  bool invert = false;
  bool add_prefix_space = false, use_regex = false;  // byte_level
};

// Unicode White_Space (Rust's char::is_whitespace, which the lstrip / rstrip of added tokens use).
bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0d) || cp == 0x20 || cp == 0x85 || cp == 0xa0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 || cp == 0x202f ||
         cp == 0x205f || cp == 0x3000;
}

// The added tokens of one pass as a byte trie: the longest token starting at a position is found
// by one walk from there.
class AddedMatcher {
 public:
  void add(const std::string& content, uint32_t index) {
    int32_t node = 0;
    for (char c : content) {
      const uint64_t key = uint64_t(node) << 8 | uint8_t(c);
      auto it = edges_.find(key);
      if (it == edges_.end()) {
        it = edges_.emplace(key, int32_t(terminal_.size())).first;
        terminal_.push_back(-1);
      }
      node = it->second;
    }
    if (terminal_[size_t(node)] < 0) terminal_[size_t(node)] = int32_t(index);
    first_[uint8_t(content[0])] = true;
  }
  bool empty() const { return edges_.empty(); }
  // The first position >= from where a token starts, the longest one there: (begin, end, index);
  // begin == npos when none.
  std::array<size_t, 3> find(std::string_view s, size_t from) const {
    for (size_t i = from; i < s.size(); ++i) {
      if (!first_[uint8_t(s[i])]) continue;
      int32_t node = 0;
      size_t best_end = 0;
      int32_t best = -1;
      for (size_t k = i; k < s.size(); ++k) {
        const auto it = edges_.find(uint64_t(node) << 8 | uint8_t(s[k]));
        if (it == edges_.end()) break;
        node = it->second;
        if (terminal_[size_t(node)] >= 0) best = terminal_[size_t(node)], best_end = k + 1;
      }
      if (best >= 0) return {i, best_end, size_t(best)};
    }
    return {std::string_view::npos, 0, 0};
  }

 private:
  std::unordered_map<uint64_t, int32_t> edges_;  // (node << 8 | byte) -> child
  std::vector<int32_t> terminal_{-1};            // node -> index of the token ending there
  std::array<bool, 256> first_{};
};

// A stretch of the input: either an added token or text still to pre-tokenize.
struct Segment {
  std::string_view text;
  int64_t token = -1;  // the added token's id
};

struct TemplateItem {
  bool sequence = false;      // the encoded text
  std::vector<uint32_t> ids;  // else the special token's ids
};

}  // namespace

struct Tokenizer::Impl {
  std::string source;
  std::vector<std::string> tokens;  // id -> token
  std::vector<uint8_t> has_token;   // id has a token
  std::vector<uint8_t> special;     // id is a special added token
  std::unique_ptr<Bpe> bpe;
  std::vector<AddedToken> added;
  TokenMap added_ids;  // content -> id
  AddedMatcher raw_matcher, normalized_matcher;
  std::vector<Step> steps;
  std::unique_ptr<Regex> byte_level_regex;
  std::vector<std::vector<TemplateItem>> templates;  // the post-processors' single templates
  std::optional<uint32_t> bos, eos;
  bool nfc = false;  // the normalizer
  std::string steps_desc;

  // Cuts the added tokens of `m` out of `text` (HF AddedVocabulary::find_matches).
  void split_added(const AddedMatcher& m, std::string_view text, std::vector<Segment>& out) const {
    if (m.empty()) {
      if (!text.empty()) out.push_back({text, -1});
      return;
    }
    size_t start_offset = 0, from = 0;
    while (from < text.size()) {
      const auto [b, e, index] = m.find(text, from);
      if (b == std::string_view::npos) break;
      const AddedToken& t = added[index];
      size_t start = b, stop = e;
      if (t.lstrip) {
        // Back over the whitespace before the token, not into what an earlier token took.
        size_t p = start;
        while (p > start_offset) {
          size_t q = p - 1;
          while (q > start_offset && (uint8_t(text[q]) & 0xc0) == 0x80) --q;
          const size_t n = utf8_sequence_length(text, q);
          if (n == 0 || !is_white_space(utf8_decode(text, q, n))) break;
          p = q;
        }
        start = p;
      }
      if (t.rstrip) {
        while (stop < text.size()) {
          const size_t n = utf8_sequence_length(text, stop);
          if (n == 0 || !is_white_space(utf8_decode(text, stop, n))) break;
          stop += n;
        }
      }
      if (start_offset < start)
        out.push_back({text.substr(start_offset, start - start_offset), -1});
      out.push_back({text.substr(start, stop - start), int64_t(t.id)});
      start_offset = from = stop;
    }
    if (start_offset < text.size()) out.push_back({text.substr(start_offset), -1});
  }

  // One pre-tokenizer step over the words (each non-empty).
  void apply_step(const Step& s, std::vector<std::string>& words) const {
    std::vector<std::string> next;
    next.reserve(words.size());
    std::vector<std::pair<size_t, size_t>> found;
    struct Piece {
      size_t b, e;
      bool match;
    };
    std::vector<Piece> pieces, out;
    const ByteLevelAlphabet& alpha = ByteLevelAlphabet::get();
    for (std::string& w : words) {
      if (s.kind == Step::byte_level) {
        if (s.add_prefix_space && w[0] != ' ') w.insert(w.begin(), ' ');
        if (!s.use_regex) {
          std::string out;
          out.reserve(w.size() * 2);
          alpha.encode(w, out);
          next.push_back(std::move(out));
          continue;
        }
        found.clear();
        byte_level_regex->find_all(w, found);
        size_t prev = 0;
        const auto emit = [&](size_t b, size_t e) {
          if (b == e) return;
          std::string out;
          alpha.encode(std::string_view(w).substr(b, e - b), out);
          next.push_back(std::move(out));
        };
        for (const auto& [b, e] : found) {
          emit(prev, b);
          emit(b, e);
          prev = e;
        }
        emit(prev, w.size());
        continue;
      }
      // Split: the pieces of w, matches and the stretches between them, each flagged.
      found.clear();
      s.regex->find_all(w, found);
      pieces.clear();
      out.clear();
      size_t prev = 0;
      for (const auto& [b, e] : found) {
        if (prev != b) pieces.push_back({prev, b, false});
        pieces.push_back({b, e, true});
        prev = e;
      }
      if (prev != w.size()) pieces.push_back({prev, w.size(), false});
      if (s.invert)
        for (Piece& p : pieces) p.match = !p.match;
      switch (s.behavior) {
        case Behavior::isolated:
          out.swap(pieces);
          break;
        case Behavior::removed:
          for (const Piece& p : pieces)
            if (!p.match) out.push_back(p);
          break;
        case Behavior::merged_with_previous: {
          bool previous_match = false;
          for (const Piece& p : pieces) {
            if (p.match && !previous_match && !out.empty())
              out.back().e = p.e;
            else
              out.push_back(p);
            previous_match = p.match;
          }
          break;
        }
        case Behavior::merged_with_next: {
          bool previous_match = false;
          for (size_t k = pieces.size(); k-- > 0;) {
            const Piece& p = pieces[k];
            if (p.match && !previous_match && !out.empty())
              out.back().b = p.b;
            else
              out.push_back(p);
            previous_match = p.match;
          }
          std::reverse(out.begin(), out.end());
          break;
        }
        case Behavior::contiguous: {
          bool previous_match = false;
          for (const Piece& p : pieces) {
            if (p.match == previous_match && !out.empty())
              out.back().e = p.e;
            else
              out.push_back(p);
            previous_match = p.match;
          }
          break;
        }
      }
      for (const Piece& p : out)
        if (p.e > p.b) next.push_back(w.substr(p.b, p.e - p.b));
    }
    words = std::move(next);
  }
};

namespace {

[[noreturn]] void refuse(const JsonReader& r, const std::string& name, const json& v,
                         const std::string& supported) {
  r.error(name, fmt::format("is {}: not supported ({})", json_value_str(v), supported));
}

// A key that is absent, null, or `ok`; any other value is refused.
void expect_null_or(JsonReader& r, const std::string& key, const json& ok, const std::string& why) {
  const json* v = r.find_non_null(key);
  if (v && *v != ok) refuse(r, key, *v, why);
}

Step parse_split(JsonReader& r) {
  Step s;
  s.kind = Step::split;
  JsonReader pat = r.child("pattern");
  const json* re = pat.find("Regex");
  const json* str = pat.find("String");
  if ((re != nullptr) == (str != nullptr))
    r.fail("pattern", "an object with one key, \"Regex\" or \"String\"", pat.object());
  s.literal = str != nullptr;
  const std::string p = pat.to_string(s.literal ? *str : *re, s.literal ? "String" : "Regex");
  s.regex = std::make_unique<Regex>(
      p, s.literal,
      fmt::format("{}: '{}'", r.source(), pat.path_of(s.literal ? "String" : "Regex")));
  s.behavior = r.get_enum("behavior", Behavior::isolated,
                          {{"Removed", Behavior::removed},
                           {"Isolated", Behavior::isolated},
                           {"MergedWithPrevious", Behavior::merged_with_previous},
                           {"MergedWithNext", Behavior::merged_with_next},
                           {"Contiguous", Behavior::contiguous}});
  s.invert = r.get_bool("invert", false);
  return s;
}

Step parse_byte_level(JsonReader& r) {
  Step s;
  s.kind = Step::byte_level;
  s.add_prefix_space = r.get_bool("add_prefix_space", true);
  s.use_regex = r.get_bool("use_regex", true);
  r.get_bool("trim_offsets", true);  // offsets only
  return s;
}

void parse_pre_tokenizer(JsonReader& top, Tokenizer::Impl& t) {
  const json* v = top.find("pre_tokenizer");
  const std::string supported = "supported: Sequence, Split, ByteLevel";
  if (!v || v->is_null())
    top.error("pre_tokenizer", "is null: a byte-level BPE needs a ByteLevel pre-tokenizer");
  if (!v->is_object()) top.fail("pre_tokenizer", "an object", *v);
  JsonReader pre(*v, top.source(), "pre_tokenizer");
  const std::string type = pre.req_string("type");
  std::vector<std::pair<json, std::string>> list;  // each step and its path
  if (type == "Sequence") {
    const json* seq = pre.find("pretokenizers");
    if (!seq || !seq->is_array()) pre.fail("pretokenizers", "an array", seq ? *seq : json());
    for (size_t i = 0; i < seq->size(); ++i)
      list.emplace_back((*seq)[i], fmt::format("pre_tokenizer.pretokenizers[{}]", i));
  } else {
    list.emplace_back(*v, "pre_tokenizer");
  }
  int byte_levels = 0;
  for (const auto& [j, path] : list) {
    if (!j.is_object()) top.fail(path, "an object", j);
    JsonReader r(j, top.source(), path);
    const std::string ty = r.req_string("type");
    if (ty == "Split") {
      t.steps.push_back(parse_split(r));
      const Step& s = t.steps.back();
      t.steps_desc += fmt::format("{}Split({} \"{}\", {}{})", t.steps_desc.empty() ? "" : " + ",
                                  s.literal ? "string" : "regex", printable(s.regex->pattern()),
                                  behavior_name(s.behavior), s.invert ? ", inverted" : "");
    } else if (ty == "ByteLevel") {
      if (++byte_levels > 1) r.error("type", "is a second ByteLevel step: only one is supported");
      t.steps.push_back(parse_byte_level(r));
      const Step& s = t.steps.back();
      t.steps_desc +=
          fmt::format("{}ByteLevel(add_prefix_space {}, use_regex {})",
                      t.steps_desc.empty() ? "" : " + ", s.add_prefix_space, s.use_regex);
      if (s.use_regex && !t.byte_level_regex)
        t.byte_level_regex = std::make_unique<Regex>(kByteLevelRegex, false, "ByteLevel regex");
    } else {
      refuse(r, "type", ty, supported);
    }
  }
  if (byte_levels == 0)
    top.error("pre_tokenizer",
              "has no ByteLevel step: only byte-level BPE tokenizers are supported");
}

// The normalizer: null, NFC, or a Sequence of those.
void parse_normalizer(JsonReader& top, Tokenizer::Impl& t) {
  const json* v = top.find_non_null("normalizer");
  if (!v) return;
  const std::string supported = "supported: null, NFC, a Sequence of NFC";
  if (!v->is_object()) top.fail("normalizer", "an object or null", *v);
  JsonReader r(*v, top.source(), "normalizer");
  const std::string type = r.req_string("type");
  if (type == "NFC") {
    t.nfc = true;
    return;
  }
  if (type != "Sequence") refuse(r, "type", type, supported);
  const json* seq = r.find("normalizers");
  if (!seq || !seq->is_array()) r.fail("normalizers", "an array", seq ? *seq : json());
  for (size_t i = 0; i < seq->size(); ++i) {
    const json& n = (*seq)[i];
    const std::string name = fmt::format("normalizers[{}]", i);
    if (!n.is_object() || !n.contains("type")) r.fail(name, "an object with a \"type\"", n);
    if (n["type"] != "NFC") refuse(r, name + ".type", n["type"], supported);
    t.nfc = true;  // NFC twice is NFC
  }
}

void parse_decoder(JsonReader& top) {
  const json* v = top.find("decoder");
  const std::string supported = "supported: ByteLevel";
  if (!v || v->is_null()) top.error("decoder", "is null: a ByteLevel decoder is required");
  if (!v->is_object()) top.fail("decoder", "an object", *v);
  JsonReader r(*v, top.source(), "decoder");
  const std::string type = r.req_string("type");
  if (type == "ByteLevel") return;
  if (type == "Sequence") {
    const json* seq = r.find("decoders");
    if (seq && seq->is_array() && seq->size() == 1 && (*seq)[0].is_object() &&
        (*seq)[0].value("type", "") == "ByteLevel")
      return;
    r.error("decoders", "must be one ByteLevel decoder (supported: ByteLevel)");
  }
  refuse(r, "type", type, supported);
}

void parse_post_processor(JsonReader& top, Tokenizer::Impl& t, int64_t vocab) {
  const json* v = top.find_non_null("post_processor");
  if (!v) return;
  const std::string supported = "supported: null, ByteLevel, TemplateProcessing, Sequence";
  std::vector<std::pair<json, std::string>> list;
  if (!v->is_object()) top.fail("post_processor", "an object or null", *v);
  if (v->value("type", "") == "Sequence") {
    const json* seq = v->contains("processors") ? &(*v)["processors"] : nullptr;
    if (!seq || !seq->is_array())
      top.fail("post_processor.processors", "an array", seq ? *seq : json());
    for (size_t i = 0; i < seq->size(); ++i)
      list.emplace_back((*seq)[i], fmt::format("post_processor.processors[{}]", i));
  } else {
    list.emplace_back(*v, "post_processor");
  }
  for (const auto& [j, path] : list) {
    if (!j.is_object()) top.fail(path, "an object", j);
    JsonReader r(j, top.source(), path);
    const std::string type = r.req_string("type");
    if (type == "ByteLevel") continue;  // offsets only: the ids stay as they are
    if (type != "TemplateProcessing") refuse(r, "type", type, supported);
    // The special tokens the template names, with their ids.
    JsonReader specials = r.child("special_tokens");
    std::unordered_map<std::string, std::vector<uint32_t>> special_ids;
    for (auto it = specials.object().begin(); it != specials.object().end(); ++it) {
      JsonReader s = specials.child(it.key());
      const json* ids = s.find("ids");
      if (!ids || !ids->is_array()) s.fail("ids", "an array of ids", ids ? *ids : json());
      std::vector<uint32_t> out;
      for (size_t i = 0; i < ids->size(); ++i)
        out.push_back(uint32_t(s.to_int((*ids)[i], fmt::format("ids[{}]", i), {0, vocab - 1})));
      special_ids[it.key()] = std::move(out);
    }
    const json* single = r.find("single");
    if (!single || !single->is_array()) r.fail("single", "an array", single ? *single : json());
    std::vector<TemplateItem> items;
    for (size_t i = 0; i < single->size(); ++i) {
      const json& it = (*single)[i];
      const std::string name = fmt::format("single[{}]", i);
      if (it.is_object() && it.size() == 1 && it.contains("Sequence")) {
        const json& seq = it["Sequence"];
        if (!seq.is_object() || seq.value("id", "") != "A")
          r.fail(name, "{\"Sequence\": {\"id\": \"A\", ...}} in a single template", it);
        items.push_back({true, {}});
      } else if (it.is_object() && it.size() == 1 && it.contains("SpecialToken")) {
        const json& st = it["SpecialToken"];
        const std::string id = st.is_object() ? st.value("id", "") : "";
        const auto f = special_ids.find(id);
        if (f == special_ids.end())
          r.error(name,
                  fmt::format("names the special token {} that 'special_tokens' lacks",
                              json_value_str(st.is_object() && st.contains("id") ? st["id"] : st)));
        items.push_back({false, f->second});
      } else {
        r.fail(name, "{\"Sequence\": ...} or {\"SpecialToken\": ...}", it);
      }
    }
    t.templates.push_back(std::move(items));
  }
}

void parse_model(JsonReader& top, Tokenizer::Impl& t, TokenMap& vocab) {
  JsonReader m = top.child("model");
  const std::string type = m.req_string("type");
  if (type != "BPE") refuse(m, "type", type, "supported: BPE");
  if (const json* d = m.find_non_null("dropout"); d && !(d->is_number() && d->get<double>() == 0))
    refuse(m, "dropout", *d, "supported: null (no dropout)");
  expect_null_or(m, "continuing_subword_prefix", "", "supported: null");
  expect_null_or(m, "end_of_word_suffix", "", "supported: null");
  if (m.get_bool("byte_fallback", false))
    refuse(m, "byte_fallback", true,
           "supported: false (the byte-level alphabet covers every byte)");
  const bool ignore_merges = m.get_bool("ignore_merges", false);
  const bool fuse_unk = m.get_bool("fuse_unk", false);
  const std::optional<std::string> unk = m.opt_string("unk_token");

  const json* vj = m.find("vocab");
  if (!vj || !vj->is_object()) m.fail("vocab", "an object (token -> id)", vj ? *vj : json());
  vocab.reserve(vj->size());
  std::vector<std::string> by_id;
  for (auto it = vj->begin(); it != vj->end(); ++it) {
    const int64_t id = m.to_int(it.value(), "vocab." + printable(it.key()), {0, kMaxVocab - 1});
    if (it.key().empty()) m.error("vocab", fmt::format("has an empty token (id {})", id));
    if (size_t(id) >= by_id.size()) by_id.resize(size_t(id) + 1);
    if (!by_id[size_t(id)].empty())
      m.error("vocab", fmt::format("gives the id {} to both \"{}\" and \"{}\"", id,
                                   printable(by_id[size_t(id)]), printable(it.key())));
    by_id[size_t(id)] = it.key();
    vocab.emplace(it.key(), uint32_t(id));
  }
  std::optional<uint32_t> unk_id;
  if (unk) {
    const auto it = vocab.find(*unk);
    if (it == vocab.end())
      m.error("unk_token", fmt::format("\"{}\" is not in model.vocab", printable(*unk)));
    unk_id = it->second;
  }

  const json* mj = m.find("merges");
  if (!mj || !mj->is_array()) m.fail("merges", "an array", mj ? *mj : json());
  std::vector<std::pair<std::pair<uint32_t, uint32_t>, uint32_t>> merges;
  merges.reserve(mj->size());
  std::string joined;
  for (size_t i = 0; i < mj->size(); ++i) {
    const json& e = (*mj)[i];
    const std::string name = fmt::format("merges[{}]", i);
    std::string a, b;
    if (e.is_string()) {
      const std::string& s = e.get_ref<const std::string&>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || sp == 0 || sp + 1 == s.size())
        m.fail(name, "\"LEFT RIGHT\" (two tokens and one space) or [\"LEFT\", \"RIGHT\"]", e);
      a = s.substr(0, sp), b = s.substr(sp + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      a = e[0].get<std::string>(), b = e[1].get<std::string>();
    } else {
      m.fail(name, "\"LEFT RIGHT\" or [\"LEFT\", \"RIGHT\"]", e);
    }
    const auto ia = vocab.find(a), ib = vocab.find(b);
    for (const auto& [tok, it] : {std::pair{&a, ia}, std::pair{&b, ib}})
      if (it == vocab.end())
        m.error(name, fmt::format("names the token \"{}\", which is not in model.vocab",
                                  printable(*tok)));
    joined = a + b;
    const auto ij = vocab.find(joined);
    if (ij == vocab.end())
      m.error(name, fmt::format("merges \"{}\" and \"{}\" into \"{}\", which is not in "
                                "model.vocab",
                                printable(a), printable(b), printable(joined)));
    merges.push_back({{ia->second, ib->second}, ij->second});
  }
  t.tokens = std::move(by_id);
  t.has_token.assign(t.tokens.size(), 0);
  for (size_t i = 0; i < t.tokens.size(); ++i) t.has_token[i] = !t.tokens[i].empty();
  t.bpe = std::make_unique<Bpe>(vocab, merges, ignore_merges, unk_id, fuse_unk);
}

// The added tokens, with the ids `tokenizers` gives them when it reads the file (its
// AddedVocabulary::add_tokens; the "id" fields are not used, it only warns when they differ): a
// content seen before keeps its id, a token of the model's vocabulary takes that id, any other
// the next id after the vocabulary's entries and the added tokens so far.
void parse_added_tokens(JsonReader& top, Tokenizer::Impl& t, const TokenMap& vocab) {
  const json* a = top.find_non_null("added_tokens");
  if (a && !a->is_array()) top.fail("added_tokens", "an array", *a);
  const int64_t model_size = int64_t(vocab.size());
  int64_t max_added = -1;
  std::unordered_map<std::string, bool> special_content;
  for (size_t i = 0; a && i < a->size(); ++i) {
    const std::string path = fmt::format("added_tokens[{}]", i);
    if (!(*a)[i].is_object()) top.fail(path, "an object", (*a)[i]);
    JsonReader r((*a)[i], top.source(), path);
    AddedToken tok;
    r.req_int("id", {0, kMaxVocab - 1});
    tok.content = r.req_string("content");
    if (tok.content.empty()) r.error("content", "is empty");
    if (first_invalid_utf8(tok.content) >= 0) r.error("content", "is not valid UTF-8");
    tok.special = r.get_bool("special", false);
    tok.lstrip = r.get_bool("lstrip", false);
    tok.rstrip = r.get_bool("rstrip", false);
    tok.normalized = r.get_bool("normalized", !tok.special);
    if (r.get_bool("single_word", false)) refuse(r, "single_word", true, "supported: false");
    if (tok.special) special_content[tok.content] = true;
    int64_t id;
    if (const auto it = t.added_ids.find(tok.content); it != t.added_ids.end())
      id = it->second;
    else if (const auto iv = vocab.find(tok.content); iv != vocab.end())
      id = iv->second;
    else if (max_added < 0)
      id = model_size;
    else
      id = max_added >= model_size || model_size == 0 ? max_added + 1 : model_size;
    if (id >= kMaxVocab)
      r.error("content", fmt::format("gets the id {}: more than 2^24 ids are not supported", id));
    max_added = std::max(max_added, id);
    tok.id = uint32_t(id);
    if (tok.id >= t.tokens.size()) {
      t.tokens.resize(tok.id + 1);
      t.has_token.resize(tok.id + 1, 0);
    }
    t.tokens[tok.id] = tok.content;
    t.has_token[tok.id] = 1;
    t.added_ids[tok.content] = tok.id;
    const uint32_t index = uint32_t(t.added.size());
    (tok.normalized ? t.normalized_matcher : t.raw_matcher).add(tok.content, index);
    t.added.push_back(std::move(tok));
  }
  t.special.assign(t.tokens.size(), 0);
  for (AddedToken& tok : t.added) {
    tok.special = special_content.count(tok.content) > 0;
    t.special[tok.id] = tok.special;
  }
}

std::shared_ptr<Tokenizer::Impl> parse(const json& j, const std::string& source) {
  if (!j.is_object())
    throw Error(fmt::format("{}: a tokenizer.json must be a JSON object, got {}", source,
                            json_value_str(j)));
  auto t = std::make_shared<Tokenizer::Impl>();
  t->source = source;
  JsonReader top(j, source);
  if (const json* v = top.find_non_null("truncation"))
    refuse(top, "truncation", *v, "supported: null");
  if (const json* v = top.find_non_null("padding")) refuse(top, "padding", *v, "supported: null");
  TokenMap vocab;
  parse_model(top, *t, vocab);
  parse_added_tokens(top, *t, vocab);
  parse_normalizer(top, *t);
  parse_pre_tokenizer(top, *t);
  parse_decoder(top);
  parse_post_processor(top, *t, int64_t(t->tokens.size()));
  return t;
}

// "bos_token" / "eos_token" of tokenizer_config.json: a token string, {"content": ...} or null.
std::optional<uint32_t> config_token(JsonReader& r, const std::string& key,
                                     const Tokenizer::Impl& t) {
  const json* v = r.find_non_null(key);
  if (!v) return std::nullopt;
  std::string content;
  if (v->is_string())
    content = v->get<std::string>();
  else if (v->is_object() && v->contains("content") && (*v)["content"].is_string())
    content = (*v)["content"].get<std::string>();
  else
    r.fail(key, "a token string, {\"content\": TOKEN} or null", *v);
  if (const auto it = t.added_ids.find(content); it != t.added_ids.end()) return it->second;
  if (const auto it = t.bpe->vocab().find(content); it != t.bpe->vocab().end()) return it->second;
  r.error(key, fmt::format("\"{}\" is not a token of {}", printable(content), t.source));
}

}  // namespace

Tokenizer Tokenizer::from_json(const json& j, const std::string& source) {
  return Tokenizer(parse(j, source));
}

Tokenizer Tokenizer::load(const std::string& path) {
  std::error_code ec;
  fs::path file = path;
  if (fs::is_directory(path, ec)) file = fs::path(path) / "tokenizer.json";
  if (!fs::exists(file, ec))
    throw Error(fmt::format("tokenizer '{}': {} does not exist", path,
                            file.string() == path ? "the file" : file.string()));
  const json j = read_json_file(file.string());
  auto t = parse(j, file.string());
  const fs::path cfg = file.parent_path() / "tokenizer_config.json";
  if (fs::exists(cfg, ec)) {
    const json c = read_json_file(cfg.string());
    if (!c.is_object())
      throw Error(
          fmt::format("{}: must be a JSON object, got {}", cfg.string(), json_value_str(c)));
    JsonReader r(c, cfg.string());
    t->bos = config_token(r, "bos_token", *t);
    t->eos = config_token(r, "eos_token", *t);
  }
  return Tokenizer(std::move(t));
}

std::vector<uint32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const Impl& t = *impl_;
  const int64_t bad = first_invalid_utf8(text);
  if (bad >= 0)
    throw Error(
        fmt::format("tokenizer: the text to encode is not valid UTF-8 (byte offset {}, "
                    "byte 0x{:02x})",
                    bad, uint8_t(text[size_t(bad)])));
  // 1. Added tokens: those matched on the raw text, then those matched on the normalized text.
  std::vector<Segment> raw, segs;
  std::deque<std::string> normalized;  // the text of the segments after the normalizer
  t.split_added(t.raw_matcher, text, raw);
  for (const Segment& s : raw) {
    if (s.token >= 0) {
      segs.push_back(s);
      continue;
    }
    std::string_view n = s.text;
    if (t.nfc) n = normalized.emplace_back(nfc(s.text));
    t.split_added(t.normalized_matcher, n, segs);
  }
  // 2-3. Pre-tokenize each stretch of text, BPE each word (repeated words from the cache).
  std::vector<uint32_t> ids;
  ids.reserve(text.size() / 3 + 8);
  std::unordered_map<std::string, std::pair<uint32_t, uint32_t>, StringHash, std::equal_to<>>
      cache;  // word -> [offset, count) in cached
  std::vector<uint32_t> cached;
  constexpr size_t kMaxCachedWord = 64, kMaxCacheEntries = size_t(1) << 18;
  std::vector<std::string> words;
  for (const Segment& s : segs) {
    if (s.token >= 0) {
      ids.push_back(uint32_t(s.token));
      continue;
    }
    words.clear();
    words.emplace_back(s.text);
    for (const Step& step : t.steps) t.apply_step(step, words);
    for (const std::string& w : words) {
      if (w.size() > kMaxCachedWord) {
        t.bpe->encode_word(w, ids);
        continue;
      }
      const auto it = cache.find(w);
      if (it != cache.end()) {
        ids.insert(ids.end(), cached.begin() + it->second.first,
                   cached.begin() + it->second.first + it->second.second);
        continue;
      }
      const size_t before = ids.size();
      t.bpe->encode_word(w, ids);
      if (cache.size() < kMaxCacheEntries) {
        cache.emplace(w, std::pair{uint32_t(cached.size()), uint32_t(ids.size() - before)});
        cached.insert(cached.end(), ids.begin() + int64_t(before), ids.end());
      }
    }
  }
  // 4. The post-processors' templates.
  if (add_special_tokens) {
    for (const auto& tmpl : t.templates) {
      std::vector<uint32_t> out;
      for (const TemplateItem& it : tmpl) {
        const auto& src = it.sequence ? ids : it.ids;
        out.insert(out.end(), src.begin(), src.end());
      }
      ids = std::move(out);
    }
  }
  return ids;
}

std::vector<std::string> Tokenizer::pre_tokenize(std::string_view text) const {
  const int64_t bad = first_invalid_utf8(text);
  if (bad >= 0)
    throw Error(
        fmt::format("tokenizer: the text to pre-tokenize is not valid UTF-8 (byte offset "
                    "{})",
                    bad));
  std::vector<std::string> words;
  if (text.empty()) return words;
  words.emplace_back(text);
  for (const Step& step : impl_->steps) impl_->apply_step(step, words);
  return words;
}

std::string Tokenizer::decode(std::span<const uint32_t> ids, bool skip_special_tokens) const {
  const Impl& t = *impl_;
  const ByteLevelAlphabet& alpha = ByteLevelAlphabet::get();
  std::string bytes;
  for (size_t i = 0; i < ids.size(); ++i) {
    const uint32_t id = ids[i];
    if (id >= t.tokens.size() || !t.has_token[id])
      throw Error(fmt::format("tokenizer: cannot decode id {} at position {}: {}", id, i,
                              id >= t.tokens.size()
                                  ? fmt::format("the vocabulary has ids 0..{}", t.tokens.size() - 1)
                                  : std::string("no token has that id")));
    if (skip_special_tokens && t.special[id]) continue;
    const std::string& tok = t.tokens[id];
    if (const auto b = alpha.decode(tok))
      bytes += *b;
    else
      bytes += tok;  // a character outside the byte-level alphabet: the token as it is
  }
  return utf8_lossy(bytes);
}

int64_t Tokenizer::vocab_size() const {
  return int64_t(impl_->tokens.size());
}

std::optional<uint32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (const auto it = impl_->added_ids.find(token); it != impl_->added_ids.end()) return it->second;
  const auto& v = impl_->bpe->vocab();
  if (const auto it = v.find(token); it != v.end()) return it->second;
  return std::nullopt;
}

const std::string& Tokenizer::id_to_token(uint32_t id) const {
  if (id >= impl_->tokens.size() || !impl_->has_token[id])
    throw Error(fmt::format("tokenizer: id {} has no token (vocabulary size {})", id,
                            impl_->tokens.size()));
  return impl_->tokens[id];
}

bool Tokenizer::is_special(uint32_t id) const {
  return id < impl_->special.size() && impl_->special[id];
}

const std::vector<AddedToken>& Tokenizer::added_tokens() const {
  return impl_->added;
}
std::optional<uint32_t> Tokenizer::bos_token() const {
  return impl_->bos;
}
std::optional<uint32_t> Tokenizer::eos_token() const {
  return impl_->eos;
}
const std::string& Tokenizer::source() const {
  return impl_->source;
}

std::string Tokenizer::describe() const {
  const Impl& t = *impl_;
  size_t specials = 0;
  for (const AddedToken& a : t.added) specials += a.special;
  bool jit = true;
  for (const Step& s : t.steps)
    if (s.regex && !s.regex->jit() && !s.literal) jit = false;
  return fmt::format(
      "{}: byte-level BPE, vocab {} ({} tokens, {} merges, {} added of which {} "
      "special), normalizer {}, pre-tokenizer {}{}",
      t.source, t.tokens.size(), t.bpe->vocab().size(), t.bpe->num_merges(), t.added.size(),
      specials, t.nfc ? "NFC" : "none", t.steps_desc, jit ? "" : " (regex without JIT)");
}

}  // namespace hlm::tokenizer
