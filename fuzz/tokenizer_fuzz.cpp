// libFuzzer target: the tokenizer. An input that parses as JSON is read as a tokenizer.json (it
// must load or raise hlm::Error); any other input is text for the test tokenizer
// (tests/data/tokenizer): encode must succeed on well-formed UTF-8 and raise hlm::Error on
// anything else, every id must lie in the vocabulary, and decode must take the ids back without
// error. A tokenizer.json that loads is then run on a fixed text the same way. Anything else is a
// bug. scripts/fuzz.sh runs it.
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace {

void exercise(const hlm::tokenizer::Tokenizer& tok, const std::string& text) {
  std::vector<uint32_t> ids;
  try {
    ids = tok.encode(text, true);
  } catch (const hlm::Error&) {
    return;  // ill-formed UTF-8
  }
  for (uint32_t id : ids)
    if (int64_t(id) >= tok.vocab_size()) std::abort();
  (void)tok.decode(ids);
  (void)tok.decode(ids, true);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const hlm::tokenizer::Tokenizer test_tok =
      hlm::tokenizer::Tokenizer::load(HLM_SOURCE_DIR "/tests/data/tokenizer/tokenizer.json");
  const std::string input(reinterpret_cast<const char*>(data), size);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(input);
  } catch (const nlohmann::json::exception&) {
    exercise(test_tok, input);
    return 0;
  }
  try {
    const auto tok = hlm::tokenizer::Tokenizer::from_json(j, "fuzz");
    exercise(tok, "Hello, world! 123 ünïcode 漢字 \n\t  end");
  } catch (const hlm::Error&) {
  }
  return 0;
}
