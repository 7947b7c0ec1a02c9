// `hybridlm tokenize` and `hybridlm train --tokenizer` run as a user runs them (the built binary),
// with the tokenizer of tests/data/tokenizer (trained by tools/tokenizer/make_test_data.py):
// tokenize prints the ids Hugging Face `tokenizers` gave (cases.json) and decodes them back;
// train --tokenizer trains on a text file encoded with it (the token count it reports is the
// count tokenize prints for the same file, EOS from tokenizer_config.json); bad requests (a
// missing tokenizer, a bad id, a model vocabulary smaller than the tokenizer's, --tokenizer
// without text data) exit with status 2 and one line. Skips when the binary has not been built.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "testing.h"

namespace hlm {
namespace {

namespace fs = std::filesystem;

const std::string kTok = std::string(HLM_SOURCE_DIR) + "/tests/data/tokenizer";

const char* const kModel = testing::kSmallModelJson;

const char* kTrain = R"({
  "model": "small_model.json", "steps": 2, "tokens_per_step": 64, "seq_len": 32, "lr": 0.01,
  "warmup_steps": 1, "eval_interval": 0, "eval_batches": 1, "log_interval": 1,
  "checkpoint_interval": 0
})";

class TokenizeCli : public ::testing::Test {
 protected:
  void SetUp() override {
    bin_ = std::string(HLM_BINARY_DIR) + "/hybridlm";
    if (!fs::exists(bin_)) GTEST_SKIP() << "binary " << bin_ << " not built (ninja hybridlm)";
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / fmt::format("hlm_tok_cli_{}_{}", ::getpid(), info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  std::string path(const std::string& n) const { return (dir_ / n).string(); }
  void write(const std::string& n, const std::string& text) const {
    std::ofstream(path(n), std::ios::binary) << text;
  }
  std::string read(const std::string& n) const {
    std::ifstream f(path(n), std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
  int run(const std::string& args) {
    const std::string cmd = "cd " + dir_.string() + " && OMP_NUM_THREADS=1 " + bin_ + " " + args +
                            " > out.txt 2> err.txt";
    const int st = std::system(cmd.c_str());
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  }
  // Exit status 2, one line on stderr holding the needle.
  void expect_refused(const std::string& args, const std::string& needle) {
    EXPECT_EQ(run(args), 2) << args;
    const std::string e = read("err.txt");
    EXPECT_EQ(std::count(e.begin(), e.end(), '\n'), 1) << args << ": " << e;
    EXPECT_NE(e.find(needle), std::string::npos) << args << ": " << e;
  }
  static std::string join(const std::vector<uint32_t>& ids) {
    std::string s;
    for (size_t i = 0; i < ids.size(); ++i) s += (i ? " " : "") + std::to_string(ids[i]);
    return s;
  }
  std::string bin_;
  fs::path dir_;
};

TEST_F(TokenizeCli, PrintsTheIdsOfHuggingFaceTokenizersAndDecodesThem) {
  std::ifstream f(kTok + "/cases.json");
  const nlohmann::json cases = nlohmann::json::parse(f)["cases"];
  int checked = 0;
  for (const auto& c : cases) {
    const std::string text = c["text"];
    if (text.empty()) continue;
    const auto ids = c["ids"].get<std::vector<uint32_t>>();
    // Through a file: any bytes, newlines included.
    write("in.txt", text);
    ASSERT_EQ(run("tokenize --tokenizer " + kTok + " --file in.txt"), 0) << read("err.txt");
    EXPECT_EQ(read("out.txt"), join(ids) + "\n") << text;
    write("ids.txt", join(ids));
    ASSERT_EQ(run("tokenize --tokenizer " + kTok + " --file ids.txt --decode"), 0)
        << read("err.txt");
    EXPECT_EQ(read("out.txt"), c.value("decoded", text) + "\n");
    ++checked;
  }
  EXPECT_GE(checked, 30);
  // --text, the tokenizer.json path itself, the template's special tokens, skipping them.
  ASSERT_EQ(run("tokenize --tokenizer " + kTok +
                "/tokenizer.json --text 'Hello world' "
                "--add-special-tokens"),
            0)
      << read("err.txt");
  const std::string with = read("out.txt");
  EXPECT_EQ(with.rfind("0 1 ", 0), 0u) << with;  // [gMASK] <sop>
  ASSERT_EQ(run("tokenize --tokenizer " + kTok + " --decode --skip-special-tokens --text '" +
                with.substr(0, with.size() - 1) + "'"),
            0);
  EXPECT_EQ(read("out.txt"), "Hello world\n");
  ASSERT_EQ(run("tokenize --tokenizer " + kTok + " --decode --text '" +
                with.substr(0, with.size() - 1) + "'"),
            0);
  EXPECT_EQ(read("out.txt"), "[gMASK]<sop>Hello world\n");
}

TEST_F(TokenizeCli, BadRequestsExitWithStatus2) {
  expect_refused("tokenize --tokenizer nowhere --text hi", "does not exist");
  write("bad.json", "{\"model\": ");
  expect_refused("tokenize --tokenizer bad.json --text hi", "malformed JSON");
  expect_refused("tokenize --tokenizer " + kTok + " --decode --text '5 6 99999'",
                 "cannot decode id 99999 at position 2");
  expect_refused("tokenize --tokenizer " + kTok + " --decode --text '5 x6'",
                 "\"x6\" (byte offset 2), which is not a token id");
  expect_refused("tokenize --tokenizer " + kTok + " --text hi --file in.txt", "excludes");
  expect_refused("tokenize --tokenizer " + kTok, "--text STRING or --file PATH");
  write("latin1.txt", "caf\xe9");
  expect_refused("tokenize --tokenizer " + kTok + " --file latin1.txt",
                 "not valid UTF-8 (byte offset 3");
}

TEST_F(TokenizeCli, TrainEncodesTheTextWithTheTokenizer) {
  write("small_model.json", kModel);
  write("train.json", kTrain);
  std::string book;
  for (int i = 0; i < 40; ++i)
    book += fmt::format("Chapter {}. The quick brown fox, naïve café, 你好世界 {}!\n<|endoftext|>",
                        i, i * 7919);
  write("book.txt", book);
  // The tokenizer's vocabulary (803 ids) does not fit the model's 24.
  expect_refused("train --config train.json --out r0 --data book.txt --tokenizer " + kTok,
                 "its vocabulary has 803 ids, more than the model's vocab_size 24");
  expect_refused("train --config train.json --out r1 --tokenizer " + kTok,
                 "'tokenizer' encodes a text file given as 'data'");
  write("ids.bin", std::string(64, '\0'));
  expect_refused("train --config train.json --out r2 --data ids.bin --tokenizer " + kTok +
                     " --set model.vocab_size=803",
                 "is a .bin of token ids already");
  expect_refused(
      "train --config train.json --out r3 --data book.txt --tokenizer nowhere "
      "--set model.vocab_size=803",
      "does not exist");
  // A short run: the data line names the tokenizer, the token count and the EOS of
  // tokenizer_config.json; the count is what `tokenize` gives for the file.
  ASSERT_EQ(run("train --config train.json --out run --data book.txt --tokenizer " + kTok +
                " --set model.vocab_size=803"),
            0)
      << read("err.txt");
  const std::string out = read("out.txt");
  ASSERT_EQ(run("tokenize --tokenizer " + kTok + " --file book.txt"), 0) << read("err.txt");
  const std::string ids = read("out.txt");
  const size_t n = size_t(std::count(ids.begin(), ids.end(), ' ')) + 1;
  EXPECT_NE(out.find(fmt::format("{} tokens, vocab 803", n)), std::string::npos) << out;
  EXPECT_NE(out.find("BOS none, EOS 2 = \"<|endoftext|>\""), std::string::npos) << out;
  EXPECT_NE(out.find("training summary"), std::string::npos) << out;
  // The run's training config keeps the tokenizer; resuming with another is refused.
  std::ifstream cfg(path("run/train_config.json"));
  const auto tc = nlohmann::json::parse(cfg);
  EXPECT_EQ(fs::path(tc["tokenizer"].get<std::string>()), fs::absolute(kTok));
  expect_refused("train --resume run --steps 3 --tokenizer " + kTok,
                 "--tokenizer and --resume exclude each other");
  // BOS from the model config (tokenizer_config.json names none), EOS still from
  // tokenizer_config.json; without tokenizer_config.json both come from the model config.
  ASSERT_EQ(run("train --config train.json --out bos --data book.txt --tokenizer " + kTok +
                " --set model.vocab_size=803 --set model.bos_token_id=1 --steps 1"),
            0)
      << read("err.txt");
  EXPECT_NE(read("out.txt").find("BOS 1 = \"<sop>\", EOS 2 = \"<|endoftext|>\""), std::string::npos)
      << read("out.txt");
  fs::create_directories(dir_ / "bare");
  fs::copy_file(kTok + "/tokenizer.json", dir_ / "bare" / "tokenizer.json");
  ASSERT_EQ(run("train --config train.json --out bare_run --data book.txt --tokenizer bare "
                "--set model.vocab_size=803 --set model.eos_token_id=3 --steps 1"),
            0)
      << read("err.txt");
  EXPECT_NE(read("out.txt").find("BOS none, EOS 3 = \"<|user|>\""), std::string::npos)
      << read("out.txt");
  // Without --tokenizer the byte-level path is unchanged: 258 tokens of vocabulary.
  ASSERT_EQ(run("train --config train.json --out bytes --data book.txt --set model.vocab_size=258"),
            0)
      << read("err.txt");
  EXPECT_NE(read("out.txt").find(fmt::format("{} tokens, vocab 258", book.size())),
            std::string::npos)
      << read("out.txt");
}

}  // namespace
}  // namespace hlm
