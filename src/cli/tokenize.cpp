// `hybridlm tokenize`: a Hugging Face tokenizer.json (tokenizer/tokenizer.h; docs/tokenizer.md)
// on a text or a file.
//
//   hybridlm tokenize --tokenizer DIR|FILE (--text STRING | --file PATH)
//                     [--add-special-tokens] [--decode [--skip-special-tokens]]
// Without --decode: prints the ids of the text on one line, separated by spaces. With --decode:
// the input is ids (separated by spaces, commas or newlines) and the decoded text is printed,
// followed by a newline. --add-special-tokens applies the tokenizer's post-processor template
// (e.g. "[gMASK] <sop> $A"); --skip-special-tokens leaves special tokens out of the decoded text.
#include <charconv>
#include <cstdio>
#include <string>
#include <vector>

#include "cli/command.h"
#include "core/error.h"
#include "core/file_io.h"
#include "tokenizer/tokenizer.h"

namespace hlm::cli {
namespace {

struct TokenizeArgs {
  std::string tokenizer, text, file;
  bool decode = false, add_special = false, skip_special = false;
};

// The ids of `s`: decimal integers separated by spaces, tabs, newlines or commas.
std::vector<uint32_t> parse_ids(const std::string& s, const std::string& what) {
  std::vector<uint32_t> ids;
  size_t i = 0;
  const auto sep = [](char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == ',';
  };
  while (i < s.size()) {
    if (sep(s[i])) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < s.size() && !sep(s[j])) ++j;
    uint32_t v = 0;
    const auto [p, ec] = std::from_chars(s.data() + i, s.data() + j, v);
    if (ec != std::errc() || p != s.data() + j)
      throw Error(
          fmt::format("--decode: {} holds \"{}\" (byte offset {}), which is not a token "
                      "id (a decimal integer in [0, 2^32))",
                      what, printable(s.substr(i, std::min<size_t>(j - i, 40))), i));
    ids.push_back(v);
    i = j;
  }
  return ids;
}

void run_tokenize(const TokenizeArgs& a) {
  if (a.skip_special && !a.decode) throw Error("--skip-special-tokens applies to --decode only");
  if (a.add_special && a.decode) throw Error("--add-special-tokens applies to encoding only");
  const tokenizer::Tokenizer tok = tokenizer::Tokenizer::load(a.tokenizer);
  std::string input = a.text;
  if (!a.file.empty()) {
    const std::vector<uint8_t> bytes = read_regular_file(a.file, "--file");
    input.assign(bytes.begin(), bytes.end());
  }
  const std::string what = a.file.empty() ? std::string("--text") : "--file " + a.file;
  if (a.decode) {
    const std::string text = tok.decode(parse_ids(input, what), a.skip_special);
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fputc('\n', stdout);
    return;
  }
  const std::vector<uint32_t> ids = tok.encode(input, a.add_special);
  std::string line;
  line.reserve(ids.size() * 6 + 1);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) line += ' ';
    line += std::to_string(ids[i]);
  }
  line += '\n';
  std::fwrite(line.data(), 1, line.size(), stdout);
}

std::function<void()> setup_tokenize(CLI::App& app) {
  auto a = std::make_shared<TokenizeArgs>();
  app.add_option("--tokenizer", a->tokenizer,
                 "a Hugging Face tokenizer.json, or the directory holding it")
      ->required();
  auto* text = app.add_option("--text", a->text, "the text to encode (or ids with --decode)");
  auto* file = app.add_option("--file", a->file, "a file holding the text (or ids with --decode)")
                   ->check(input_file());
  text->excludes(file);
  file->excludes(text);
  app.add_flag("--decode", a->decode, "decode ids to text instead");
  app.add_flag("--add-special-tokens", a->add_special,
               "add the post-processor's special tokens (e.g. [gMASK] <sop>)");
  app.add_flag("--skip-special-tokens", a->skip_special,
               "with --decode: leave special tokens out of the text");
  return [a, text, file] {
    if (text->count() == 0 && file->count() == 0)
      throw Error("give the input as --text STRING or --file PATH");
    run_tokenize(*a);
  };
}

}  // namespace

HLM_REGISTER_COMMAND("tokenize",
                     "encode text to token ids (or decode ids) with a Hugging Face tokenizer.json",
                     setup_tokenize);

}  // namespace hlm::cli
