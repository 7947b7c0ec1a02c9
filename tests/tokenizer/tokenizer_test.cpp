// The byte-level BPE tokenizer (src/tokenizer/) against Hugging Face `tokenizers`: the ids of every
// text of tests/data/tokenizer/cases.json (made by tools/tokenizer/make_test_data.py from a
// tokenizer it trains with the GLM pre-tokenizer) equal the ids `tokenizers` gave, with and
// without the post-processor's special tokens, and so do the ids of the variants (other
// pre-tokenizers, ignore_merges, ...); decoding gives what `tokenizers` decodes, decode(encode(t))
// is t, the BPE merge loop agrees with a plain quadratic reference on random words, every malformed
// tokenizer.json is refused with a one-line error naming what is wrong, and 1 MB of text encodes
// in well under a second.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/rng.h"
#include "testing.h"
#include "tokenizer/bpe.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/regex.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace hlm::tokenizer {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const std::string kDataDir = std::string(HLM_SOURCE_DIR) + "/tests/data/tokenizer";

json read_json(const std::string& path) {
  std::ifstream f(path);
  EXPECT_TRUE(f.good()) << path;
  return json::parse(f);
}
const json& cases() {
  static const json j = read_json(kDataDir + "/cases.json");
  return j;
}
const json& tokenizer_json() {
  static const json j = read_json(kDataDir + "/tokenizer.json");
  return j;
}
std::vector<uint32_t> ids_of(const json& a) {
  return a.get<std::vector<uint32_t>>();
}

// The merge patch make_test_data.py applies: objects merge key by key, anything else (null too)
// replaces.
json merge_patch(json target, const json& patch) {
  if (!patch.is_object() || !target.is_object()) return patch;
  for (auto it = patch.begin(); it != patch.end(); ++it)
    target[it.key()] = merge_patch(target.contains(it.key()) ? target[it.key()] : json(), *it);
  return target;
}

std::string show(const std::string& s) {
  return printable(s);
}

TEST(Tokenizer, EveryCaseGivesTheIdsOfHuggingFaceTokenizers) {
  const Tokenizer tok = Tokenizer::load(kDataDir);
  EXPECT_EQ(tok.vocab_size(), cases()["vocab_size"].get<int64_t>());
  int matched = 0, total = 0;
  for (const json& c : cases()["cases"]) {
    const std::string text = c["text"];
    ++total;
    const auto ids = tok.encode(text);
    const auto with = tok.encode(text, true);
    EXPECT_EQ(ids, ids_of(c["ids"])) << "text \"" << show(text) << "\"";
    EXPECT_EQ(with, ids_of(c["ids_with_specials"])) << "text \"" << show(text) << "\"";
    // The pre-tokenizer's pieces (PCRE2 here, Oniguruma there) are the same.
    const auto pieces = c["pieces"].get<std::vector<std::string>>();
    EXPECT_EQ(tok.pre_tokenize(text), pieces) << "text \"" << show(text) << "\"";
    matched += ids == ids_of(c["ids"]) && with == ids_of(c["ids_with_specials"]) &&
               tok.pre_tokenize(text) == pieces;
  }
  std::printf("[ tokenizer ] %d of %d cases give the ids and pieces of tokenizers %s\n", matched,
              total, cases()["tokenizers_version"].get<std::string>().c_str());
  EXPECT_GE(total, 30);
}

TEST(Tokenizer, DecodeGivesWhatHuggingFaceDecodesAndRoundTrips) {
  const Tokenizer tok = Tokenizer::load(kDataDir);
  int round_trips = 0, lossy = 0;
  for (const json& c : cases()["cases"]) {
    const std::string text = c["text"];
    const auto ids = ids_of(c["ids"]);
    const std::string want = c.value("decoded", text);
    const std::string want_skip = c.value("decoded_skip_special", text);
    EXPECT_EQ(tok.decode(ids), want) << "text \"" << show(text) << "\"";
    EXPECT_EQ(tok.decode(ids, true), want_skip) << "text \"" << show(text) << "\"";
    // decode(encode(text)) is the text, but where an lstrip / rstrip token took the whitespace
    // beside it (tokenizers loses that whitespace too).
    const std::string back = tok.decode(tok.encode(text));
    if (text.find("<mask>") == std::string::npos) {
      EXPECT_EQ(back, text);
      round_trips += back == text;
    } else {
      EXPECT_NE(back, text);
      ++lossy;
    }
  }
  EXPECT_EQ(lossy, 1);
  EXPECT_GE(round_trips, 30);
  for (const json& c : cases()["decode_cases"]) {
    const auto ids = ids_of(c["ids"]);
    EXPECT_EQ(tok.decode(ids), c["decoded"].get<std::string>()) << c["ids"].dump();
    EXPECT_EQ(tok.decode(ids, true), c["decoded_skip_special"].get<std::string>())
        << c["ids"].dump();
  }
}

TEST(Tokenizer, VariantsGiveTheIdsOfHuggingFaceTokenizers) {
  int n = 0;
  std::set<std::string> names;
  for (const json& v : cases()["variants"]) {
    const std::string name = v["name"];
    names.insert(name);
    const Tokenizer tok = Tokenizer::from_json(merge_patch(tokenizer_json(), v["patch"]), name);
    for (const json& c : v["cases"]) {
      const std::string text = c["text"];
      EXPECT_EQ(tok.encode(text), ids_of(c["ids"])) << name << ": \"" << show(text) << "\"";
      EXPECT_EQ(tok.encode(text, true), ids_of(c["ids_with_specials"]))
          << name << ": \"" << show(text) << "\"";
      ++n;
    }
  }
  for (const char* want :
       {"gpt2_byte_level", "split_removed", "split_merged_with_previous", "split_merged_with_next",
        "split_contiguous", "split_isolated_inverted", "split_string_pattern", "split_anchors",
        "ignore_merges", "no_post_processor", "nfc", "nfc_sequence"})
    EXPECT_TRUE(names.count(want)) << want;
  std::printf("[ tokenizer ] %zu variants, %d cases\n", names.size(), n);
  // ignore_merges makes a difference: the word "zzzzqq" (in the vocabulary, built by no merge).
  const json patch = {{"model", {{"vocab", {{"zzzzqq", 900}}}}}};
  const Tokenizer plain = Tokenizer::from_json(merge_patch(tokenizer_json(), patch), "plain");
  json im = patch;
  im["model"]["ignore_merges"] = true;
  const Tokenizer whole = Tokenizer::from_json(merge_patch(tokenizer_json(), im), "ignore_merges");
  EXPECT_EQ(whole.encode("zzzzqq"), std::vector<uint32_t>{900});
  EXPECT_GT(plain.encode("zzzzqq").size(), 1u);
}

// \s and \S mean Oniguruma's White_Space (U+0085 in, U+180E out), also inside classes; \Q...\E
// and an escaped backslash stay as they are.
TEST(Tokenizer, SpacesAreRewrittenToOnigurumasMeaning) {
  EXPECT_EQ(
      oniguruma_spaces(R"(\s+(?!\S)|[^\s\p{L}]|\\s|\Qa\sb\E\s)"),
      R"(\p{White_Space}+(?!\P{White_Space})|[^\p{White_Space}\p{L}]|\\s|\Qa\sb\E\p{White_Space})");
  const Regex re(R"(\s+)", false, "test");
  std::vector<std::pair<size_t, size_t>> found;
  re.find_all("a\u0085b\u180ec\u3000d", found);
  EXPECT_EQ(found, (std::vector<std::pair<size_t, size_t>>{{1, 3}, {8, 11}}));
}

TEST(Tokenizer, MergesInTheStringFormGiveTheSameIds) {
  json j = tokenizer_json();
  json& merges = j["model"]["merges"];
  ASSERT_TRUE(merges[0].is_array());  // the file holds the pair form
  for (json& m : merges) m = m[0].get<std::string>() + " " + m[1].get<std::string>();
  const Tokenizer a = Tokenizer::load(kDataDir), b = Tokenizer::from_json(j, "string merges");
  for (const json& c : cases()["cases"]) {
    EXPECT_EQ(b.encode(c["text"].get<std::string>()), ids_of(c["ids"]));
    EXPECT_EQ(b.encode(c["text"].get<std::string>()), a.encode(c["text"].get<std::string>()));
  }
}

TEST(Tokenizer, SpecialTokensAndTheConfigsBosEos) {
  const Tokenizer tok = Tokenizer::load(kDataDir + "/tokenizer.json");
  EXPECT_EQ(tok.token_to_id("<|endoftext|>"), std::optional<uint32_t>(2));
  EXPECT_EQ(tok.token_to_id("[gMASK]"), std::optional<uint32_t>(0));
  EXPECT_TRUE(tok.is_special(0));
  EXPECT_FALSE(tok.is_special(800));  // <think>: added, not special
  EXPECT_EQ(tok.id_to_token(0), "[gMASK]");
  EXPECT_EQ(tok.eos_token(), std::optional<uint32_t>(2));  // tokenizer_config.json
  EXPECT_EQ(tok.bos_token(), std::nullopt);                // "bos_token": null
  EXPECT_EQ(tok.encode("a<|endoftext|>b"),
            (std::vector<uint32_t>{*tok.token_to_id("a"), 2, *tok.token_to_id("b")}));
  EXPECT_NE(tok.describe().find("vocab 803"), std::string::npos) << tok.describe();
}

// The byte-level alphabet from its definition: 256 distinct code points, the printable bytes
// standing for themselves, the others from U+0100 in order; every one is a token of the
// trained vocabulary (trained with the whole alphabet).
TEST(Tokenizer, ByteLevelAlphabet) {
  const ByteLevelAlphabet& a = ByteLevelAlphabet::get();
  std::set<uint32_t> seen;
  uint32_t next = 0x100;
  for (unsigned b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xff && b != 0xad);
    EXPECT_EQ(a.code_point(uint8_t(b)), printable ? b : next) << b;
    if (!printable) ++next;
    seen.insert(a.code_point(uint8_t(b)));
    EXPECT_EQ(a.byte_of(a.code_point(uint8_t(b))), std::optional<uint8_t>(uint8_t(b)));
  }
  EXPECT_EQ(seen.size(), 256u);
  EXPECT_EQ(next, 0x144u);
  EXPECT_EQ(a.code_point(' '), 0x120u);   // 'Ġ'
  EXPECT_EQ(a.code_point('\n'), 0x10au);  // 'Ċ'
  EXPECT_EQ(a.byte_of(0x144), std::nullopt);
  EXPECT_EQ(a.byte_of(0x4e00), std::nullopt);
  const json& vocab = tokenizer_json()["model"]["vocab"];
  for (unsigned b = 0; b < 256; ++b) {
    std::string ch;
    utf8_append(ch, a.code_point(uint8_t(b)));
    EXPECT_TRUE(vocab.contains(ch)) << b;
  }
}

TEST(Tokenizer, Utf8LossyReplacesMaximalIllFormedSubsequences) {
  const std::string r = "\xef\xbf\xbd";
  EXPECT_EQ(utf8_lossy("abc"), "abc");
  EXPECT_EQ(utf8_lossy("\xe4\xbd\xa0"), "\xe4\xbd\xa0");
  EXPECT_EQ(utf8_lossy("\xe4\xbd"), r);  // a truncated sequence: one U+FFFD
  EXPECT_EQ(utf8_lossy("\xe4"
                       "A"),
            r + "A");                                        // broken by an ASCII byte
  EXPECT_EQ(utf8_lossy("\xc0\xaf"), r + r);                  // C0 starts no sequence
  EXPECT_EQ(utf8_lossy("\xed\xa0\x80"), r + r + r);          // a surrogate: ED takes 80..9F only
  EXPECT_EQ(utf8_lossy("\xf4\x90\x80\x80"), r + r + r + r);  // above U+10FFFF
  EXPECT_EQ(utf8_lossy("\xf0\x9f\x98"), r);
  EXPECT_EQ(first_invalid_utf8("ok\xe4\xbd"), 2);
  EXPECT_EQ(first_invalid_utf8("\xf0\x9f\x98\x80"), -1);
}

// The merge loop (a priority queue over a linked list) against the plain definition: merge the
// adjacent pair of lowest rank, leftmost first, until none has a merge.
TEST(Tokenizer, BpeMergeLoopMatchesAQuadraticReference) {
  Rng rng(::hlm::testing::test_seed());
  // An alphabet of 4 letters, merges among random tokens built from them.
  TokenMap vocab;
  std::vector<std::string> tokens = {"a", "b", "c", "d"};
  for (uint32_t i = 0; i < 4; ++i) vocab[tokens[i]] = i;
  std::vector<std::pair<std::pair<uint32_t, uint32_t>, uint32_t>> merges;
  std::set<std::pair<uint32_t, uint32_t>> used;
  while (merges.size() < 60) {
    const uint32_t l = uint32_t(rng.below(tokens.size())), r = uint32_t(rng.below(tokens.size()));
    if (!used.insert({l, r}).second) continue;
    const std::string m = tokens[l] + tokens[r];
    auto it = vocab.find(m);
    if (it == vocab.end()) {
      it = vocab.emplace(m, uint32_t(tokens.size())).first;
      tokens.push_back(m);
    }
    merges.push_back({{l, r}, it->second});
  }
  const Bpe bpe(vocab, merges, false, std::nullopt, false);
  const auto reference = [&](const std::string& word) {
    std::vector<uint32_t> s;
    for (char c : word) s.push_back(vocab.at(std::string(1, c)));
    for (;;) {
      size_t best = SIZE_MAX, rank = SIZE_MAX;
      for (size_t i = 0; i + 1 < s.size(); ++i)
        for (size_t r = 0; r < merges.size() && r < rank; ++r)
          if (merges[r].first == std::pair{s[i], s[i + 1]}) best = i, rank = r;
      if (best == SIZE_MAX) return s;
      s[best] = merges[rank].second;
      s.erase(s.begin() + int64_t(best) + 1);
    }
  };
  for (int t = 0; t < 300; ++t) {
    std::string w;
    const size_t n = 1 + rng.below(t < 250 ? 24 : 400);
    for (size_t i = 0; i < n; ++i) w += char('a' + rng.below(rng.below(2) ? 2 : 4));
    std::vector<uint32_t> got;
    bpe.encode_word(w, got);
    ASSERT_EQ(got, reference(w)) << w;
  }
}

// ---- malformed tokenizer.json files --------------------------------------------------------

class TokenizerErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / fmt::format("hlm_tok_{}_{}", ::getpid(), info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text) {
    const fs::path p = dir_ / name;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
    return p.string();
  }
  // Loading `path` throws one line holding every needle.
  void expect_refused(const std::string& path, const std::vector<std::string>& needles) {
    try {
      Tokenizer::load(path);
      ADD_FAILURE() << path << " was accepted";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
      for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << msg;
    }
  }
  void expect_patch_refused(const json& patch, const std::vector<std::string>& needles) {
    const std::string dir = (dir_ / fmt::format("case{}", n_++)).string();
    write(fs::path(dir).filename().string() + "/tokenizer.json",
          merge_patch(tokenizer_json(), patch).dump());
    SCOPED_TRACE(patch.dump());
    expect_refused(dir, needles);
  }
  fs::path dir_;
  int n_ = 0;
};

TEST_F(TokenizerErrors, MissingOrMalformedFiles) {
  expect_refused((dir_ / "nowhere").string(), {"nowhere", "does not exist"});
  fs::create_directories(dir_ / "empty_dir");
  expect_refused((dir_ / "empty_dir").string(), {"tokenizer.json", "does not exist"});
  expect_refused(write("bad/tokenizer.json", R"({"model": {"type": "BPE",)"), {"malformed JSON"});
  expect_refused(write("array/tokenizer.json", "[1, 2]"), {"must be a JSON object"});
  // tokenizer_config.json naming a token the tokenizer lacks.
  write("cfg/tokenizer.json", tokenizer_json().dump());
  write("cfg/tokenizer_config.json", R"({"eos_token": "<|eos|>"})");
  expect_refused((dir_ / "cfg").string(), {"tokenizer_config.json", "'eos_token'", "<|eos|>"});
}

TEST_F(TokenizerErrors, UnsupportedParts) {
  expect_patch_refused({{"model", {{"type", "WordPiece"}}}},
                       {"'model.type' is \"WordPiece\"", "not supported"});
  expect_patch_refused({{"model", {{"byte_fallback", true}}}}, {"'model.byte_fallback'"});
  expect_patch_refused({{"model", {{"dropout", 0.1}}}}, {"'model.dropout'"});
  expect_patch_refused({{"model", {{"continuing_subword_prefix", "##"}}}},
                       {"'model.continuing_subword_prefix'"});
  expect_patch_refused({{"normalizer", {{"type", "NFKC"}}}},
                       {"'normalizer.type' is \"NFKC\"", "not supported"});
  expect_patch_refused(
      {{"normalizer", {{"type", "Sequence"}, {"normalizers", {{{"type", "Lowercase"}}}}}}},
      {"'normalizer.normalizers[0].type' is \"Lowercase\"", "supported: null, NFC"});
  expect_patch_refused({{"pre_tokenizer", {{"type", "Whitespace"}}}},
                       {"'pre_tokenizer.type' is \"Whitespace\""});
  expect_patch_refused(
      {{"pre_tokenizer", {{"type", "Sequence"}, {"pretokenizers", {{{"type", "Digits"}}}}}}},
      {"'pre_tokenizer.pretokenizers[0].type' is \"Digits\""});
  expect_patch_refused(
      {{"pre_tokenizer",
        {{"type", "Sequence"},
         {"pretokenizers",
          {{{"type", "Split"}, {"pattern", {{"Regex", "\\s+"}}}, {"behavior", "Isolated"}}}}}}},
      {"'pre_tokenizer'", "no ByteLevel step"});
  expect_patch_refused(
      {{"pre_tokenizer",
        {{"type", "Sequence"},
         {"pretokenizers",
          {{{"type", "Split"}, {"pattern", {{"Regex", "(ab"}}}, {"behavior", "Isolated"}},
           {{"type", "ByteLevel"}}}}}}},
      {"pretokenizers[0].pattern.Regex", "does not compile"});
  expect_patch_refused(
      {{"pre_tokenizer",
        {{"type", "Sequence"},
         {"pretokenizers",
          {{{"type", "Split"}, {"pattern", {{"Regex", "a"}}}, {"behavior", "Sideways"}},
           {{"type", "ByteLevel"}}}}}}},
      {"'pre_tokenizer.pretokenizers[0].behavior'", "Sideways"});
  expect_patch_refused({{"pre_tokenizer", nullptr}}, {"'pre_tokenizer' is null"});
  expect_patch_refused({{"decoder", {{"type", "WordPiece"}}}}, {"'decoder.type' is \"WordPiece\""});
  expect_patch_refused({{"post_processor", {{"type", "BertProcessing"}}}},
                       {"'post_processor.type' is \"BertProcessing\""});
  expect_patch_refused({{"truncation", {{"max_length", 8}}}}, {"'truncation'"});
}

TEST_F(TokenizerErrors, BadVocabularyMergesAndAddedTokens) {
  json j = tokenizer_json();
  j["model"]["merges"][3] = {"Ġ", "no-such-token"};
  write("m1/tokenizer.json", j.dump());
  expect_refused((dir_ / "m1").string(),
                 {"'model.merges[3]'", "\"no-such-token\"", "not in model.vocab"});
  j = tokenizer_json();
  j["model"]["merges"][5] = "a zz";  // both in the vocabulary, "azz" is not
  j["model"]["vocab"]["zz"] = 900;
  write("m2/tokenizer.json", j.dump());
  expect_refused((dir_ / "m2").string(), {"'model.merges[5]'", "\"azz\""});
  j = tokenizer_json();
  j["model"]["merges"][0] = "nospace";
  write("m3/tokenizer.json", j.dump());
  expect_refused((dir_ / "m3").string(), {"'model.merges[0]'", "nospace"});
  j = tokenizer_json();
  j["model"]["vocab"]["duplicate"] = 7;
  write("v1/tokenizer.json", j.dump());
  expect_refused((dir_ / "v1").string(), {"'model.vocab'", "id 7", "duplicate"});
  j = tokenizer_json();
  j["model"]["vocab"]["neg"] = -1;
  write("v2/tokenizer.json", j.dump());
  expect_refused((dir_ / "v2").string(), {"'model.vocab.neg'", "-1"});
  j = tokenizer_json();
  j["added_tokens"][0]["single_word"] = true;
  write("a1/tokenizer.json", j.dump());
  expect_refused((dir_ / "a1").string(), {"'added_tokens[0].single_word'"});
  j = tokenizer_json();
  j["added_tokens"][1].erase("id");
  write("a2/tokenizer.json", j.dump());
  expect_refused((dir_ / "a2").string(), {"'added_tokens[1].id' is missing"});
}

TEST_F(TokenizerErrors, BadInputToEncodeAndDecode) {
  const Tokenizer tok = Tokenizer::load(kDataDir);
  ::hlm::testing::expect_error([&] { tok.encode("ok \xe4\xbd ok"); },
                               "not valid UTF-8 (byte offset 3");
  ::hlm::testing::expect_error(
      [&] {
        const std::vector<uint32_t> ids = {5, 6, 5000};
        tok.decode(ids);
      },
      "cannot decode id 5000 at position 2");
  ::hlm::testing::expect_error([&] { tok.id_to_token(803); }, "id 803 has no token");
}

// ---- throughput ------------------------------------------------------------------------------

TEST(TokenizerSpeed, OneMegabyteEncodesInWellUnderASecond) {
  const Tokenizer tok = Tokenizer::load(kDataDir);
  // ~1 MB from the cases' texts (every script, digits, code, whitespace), shuffled.
  Rng rng(::hlm::testing::test_seed());
  std::vector<std::string> parts;
  for (const json& c : cases()["cases"]) parts.push_back(c["text"]);
  std::string text;
  while (text.size() < (size_t(1) << 20)) {
    text += parts[rng.below(parts.size())];
    text += rng.below(4) ? " " : "\n";
  }
  const auto t0 = std::chrono::steady_clock::now();
  const auto ids = tok.encode(text);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto t1 = std::chrono::steady_clock::now();
  const std::string back = tok.decode(ids);
  const double sd = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  std::printf("[ tokenizer ] encode %.2f MB -> %zu ids in %.3f s (%.1f MB/s); decode %.3f s\n",
              double(text.size()) / 1e6, ids.size(), s, double(text.size()) / 1e6 / s, sd);
  EXPECT_LT(s, 2.0);  // generous: about 0.1-0.2 s on one core
  // The lstrip/rstrip <mask> token eats whitespace: compare without it.
  std::string plain;
  for (const std::string& p : parts)
    if (p.find("<mask>") == std::string::npos) plain += p + " ";
  EXPECT_EQ(tok.decode(tok.encode(plain)), plain);
  // ~1 MB of random words (few repeats: the word cache helps little).
  const std::vector<std::string> letters = {"a",  "b",  "c",  "d",  "e",  "h", "i", "l", "n", "o",
                                            "r",  "s",  "t",  "u",  "y",  "é", "ü", "ñ", "ß", "你",
                                            "好", "世", "界", "の", "한", "ж", "A", "T", "1", "7"};
  std::string words;
  while (words.size() < (size_t(1) << 20)) {
    const size_t n = 1 + rng.below(9);
    for (size_t i = 0; i < n; ++i) words += letters[rng.below(letters.size())];
    words += rng.below(8) ? " " : rng.below(2) ? ", " : ".\n";
  }
  const auto t3 = std::chrono::steady_clock::now();
  const auto rids = tok.encode(words);
  const double sr = std::chrono::duration<double>(std::chrono::steady_clock::now() - t3).count();
  std::printf("[ tokenizer ] encode %.2f MB of random words -> %zu ids in %.3f s (%.1f MB/s)\n",
              double(words.size()) / 1e6, rids.size(), sr, double(words.size()) / 1e6 / sr);
  EXPECT_LT(sr, 2.0);
  EXPECT_EQ(tok.decode(rids), words);
  // One 256 KB word that merges ("thethe..."): the merge loop is O(n log n), not quadratic.
  std::string word;
  while (word.size() < (size_t(1) << 18)) word += "the";
  const auto t2 = std::chrono::steady_clock::now();
  const auto wids = tok.encode(word);
  const double sw = std::chrono::duration<double>(std::chrono::steady_clock::now() - t2).count();
  std::printf("[ tokenizer ] one 256 KB word -> %zu ids in %.3f s\n", wids.size(), sw);
  EXPECT_LT(wids.size(), word.size() / 2);  // it merged
  EXPECT_LT(sw, 2.0);
  EXPECT_EQ(tok.decode(wids), word);
}

}  // namespace
}  // namespace hlm::tokenizer
