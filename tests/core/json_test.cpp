// JsonReader (core/json.h): typed reads with the document and the key path in every message,
// integer ranges without saturation (huge numbers, floats given for integers, unsigned values
// past int64), finite doubles, enums, optional keys, nested objects, unknown keys;
// read_json_file errors.
#include "core/json.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

#include "core/error.h"
#include "testing.h"

namespace hlm {
namespace {

using nlohmann::json;

// The message of the hlm::Error that f throws ("(no error)" when it does not).
json doc() {
  return json::parse(R"({
    "hidden_size": 64, "eps": 1e-5, "flag": true, "name": "kda", "nothing": null,
    "huge_int": 99999999999999999999, "huge_float": 1e30, "big_unsigned": 18446744073709551615,
    "float_int": 4.0, "text": "abc", "neg": -3, "list": ["a", "b"], "bad_list": ["a", 3],
    "rope": {"factor": 4, "type": "yarn", "extra": 1, "inner": {"x": "y"}}
  })");
}

TEST(JsonReader, TypedReadsReturnTheValues) {
  const json j = doc();
  JsonReader r(j, "config.json");
  EXPECT_EQ(r.get_int("hidden_size", 0, {1}), 64);
  EXPECT_EQ(r.req_int("neg"), -3);
  EXPECT_EQ(r.get_int("absent", 7), 7);  // absent: the default
  EXPECT_EQ(r.opt_int("absent"), std::nullopt);
  EXPECT_EQ(r.opt_int("nothing"), std::nullopt);  // null: none
  EXPECT_EQ(r.get_double("eps", 0), 1e-5);
  EXPECT_EQ(r.get_double("hidden_size", 0), 64.0);  // an integer is a number
  EXPECT_EQ(r.opt_double("nothing"), std::nullopt);
  EXPECT_TRUE(r.get_bool("flag", false));
  EXPECT_FALSE(r.get_bool("absent_flag", false));
  EXPECT_EQ(r.get_string("name", ""), "kda");
  EXPECT_EQ(r.req_string("name"), "kda");
  EXPECT_EQ(r.opt_string("nothing"), std::nullopt);
  EXPECT_EQ(r.opt_string_list("list"), (std::vector<std::string>{"a", "b"}));
  enum class K { kda, dsa };
  EXPECT_EQ(r.get_enum("name", K::dsa, {{"kda", K::kda}, {"dsa", K::dsa}}), K::kda);
  EXPECT_EQ(r.get_enum("absent", K::dsa, {{"kda", K::kda}, {"dsa", K::dsa}}), K::dsa);
  EXPECT_FALSE(r.opt_enum<K>("nothing", {{"kda", K::kda}}).has_value());
  EXPECT_EQ(r.get_parsed("name", 0, [](const std::string& s) { return int(s.size()); }), 3);
  // The full int64 range when asked for.
  const json big = {{"seed", std::numeric_limits<int64_t>::max()}};
  JsonReader b(big, "train.json");
  EXPECT_EQ(b.get_int("seed", 0, {0, std::numeric_limits<int64_t>::max()}),
            std::numeric_limits<int64_t>::max());
}

TEST(JsonReader, ErrorsNameTheDocumentTheKeyAndTheValue) {
  const json j = doc();
  JsonReader r(j, "config.json");
  // bad type: the brief's example, verbatim
  EXPECT_EQ(testing::error_of([&] { r.get_int("text", 0, {1}); }),
            "config.json: 'text' must be an integer >= 1, got \"abc\"");
  // out of range: refused, not clamped
  EXPECT_EQ(testing::error_of([&] {
              r.get_int("neg", 0, {0, 10});
            }),
            "config.json: 'neg' must be an integer in [0, 10], got -3");
  // a float for an integer, whole or not, small or huge
  EXPECT_EQ(testing::error_of([&] { r.get_int("float_int", 0); }),
            "config.json: 'float_int' must be an integer, got 4.0");
  EXPECT_EQ(testing::error_of([&] { r.get_int("huge_float", 0, {1}); }),
            "config.json: 'huge_float' must be an integer >= 1, got 1e+30");
  // 99999999999999999999 does not fit 64 bits: JSON parsers hold it as a float
  EXPECT_EQ(testing::error_of([&] { r.get_int("huge_int", 0, {1}); }),
            "config.json: 'huge_int' must be an integer >= 1, got 1e+20");
  // 2^64 - 1 is a JSON unsigned integer: outside every int64 range, never wrapped to -1
  EXPECT_EQ(
      testing::error_of([&] { r.get_int("big_unsigned", 0, {0}); }),
      "config.json: 'big_unsigned' must be an integer in [0, 2^53], got 18446744073709551615");
  EXPECT_EQ(testing::error_of([&] {
              r.get_int("big_unsigned", 0, {0, std::numeric_limits<int64_t>::max()});
            }),
            "config.json: 'big_unsigned' must be an integer in [0, 9223372036854775807], got "
            "18446744073709551615");
  // the default range is +-2^53: an integer past it names the bound it broke
  const json past = {{"n", (int64_t(1) << 53) + 1}};
  JsonReader p(past, "c.json");
  EXPECT_EQ(testing::error_of([&] { p.get_int("n", 0, {1}); }),
            "c.json: 'n' must be an integer in [1, 2^53], got 9007199254740993");
  EXPECT_EQ(p.get_int("n", 0, {1, std::numeric_limits<int64_t>::max()}), (int64_t(1) << 53) + 1);
  // null is a type error unless the read is optional
  EXPECT_EQ(testing::error_of([&] { r.get_int("nothing", 0); }),
            "config.json: 'nothing' must be an integer, got null");
  EXPECT_EQ(testing::error_of([&] { r.get_bool("nothing", false); }),
            "config.json: 'nothing' must be true or false, got null");
  // missing required keys
  EXPECT_EQ(testing::error_of([&] { r.req_int("vocab_size", {1}); }),
            "config.json: 'vocab_size' is missing (an integer >= 1 is required)");
  EXPECT_EQ(testing::error_of([&] { r.req_string("model_type"); }),
            "config.json: 'model_type' is missing (a string is required)");
  // other types
  EXPECT_EQ(testing::error_of([&] { r.get_double("text", 0); }),
            "config.json: 'text' must be a finite number, got \"abc\"");
  EXPECT_EQ(testing::error_of([&] {
              r.get_double("eps", 0, {0.1, 1.0});
            }),
            "config.json: 'eps' must be a number in [0.1, 1], got 1e-05");
  EXPECT_EQ(testing::error_of([&] { r.get_double("neg", 0, {0}); }),
            "config.json: 'neg' must be a number >= 0, got -3");
  EXPECT_EQ(testing::error_of([&] { r.get_bool("text", false); }),
            "config.json: 'text' must be true or false, got \"abc\"");
  EXPECT_EQ(testing::error_of([&] { r.get_string("flag", ""); }),
            "config.json: 'flag' must be a string, got true");
  EXPECT_EQ(testing::error_of([&] { r.opt_string_list("bad_list"); }),
            "config.json: 'bad_list[1]' must be a string, got 3");
  EXPECT_EQ(testing::error_of([&] { r.opt_string_list("text"); }),
            "config.json: 'text' must be a list of strings, got \"abc\"");
  enum class K { kda, dsa };
  EXPECT_EQ(testing::error_of([&] {
              r.get_enum("text", K::kda, {{"kda", K::kda}, {"dsa", K::dsa}});
            }),
            "config.json: 'text' must be one of \"kda\", \"dsa\", got \"abc\"");
  EXPECT_EQ(testing::error_of([&] { r.expect_one_of("text", {"silu"}); }),
            "config.json: 'text' must be \"silu\", got \"abc\"");
  EXPECT_EQ(testing::error_of([&] {
              r.get_parsed("text", 0, [](const std::string& s) -> int {
                throw Error("unknown schedule '" + s + "'");
              });
            }),
            "config.json: 'text': unknown schedule 'abc'");
  // not an object
  EXPECT_EQ(testing::error_of([] { JsonReader(json::array({1}), "x.json"); }),
            "x.json: expected a JSON object, got array [1]");
  EXPECT_EQ(testing::error_of([&] { r.child("list"); }),
            "config.json: 'list' must be an object, got [\"a\",\"b\"]");
  EXPECT_EQ(testing::error_of([&] { r.child("absent_object"); }),
            "config.json: 'absent_object' is missing (an object is required)");
}

TEST(JsonReader, NonFiniteNumbersAreRefused) {
  // JSON text has no NaN / Inf (the parser refuses 1e400 as an overflow), but a json built in
  // code can hold either.
  EXPECT_THROW(json::parse(R"({"inf": 1e400})"), json::exception);
  const json j = {{"inf", std::numeric_limits<double>::infinity()}, {"nan", std::nan("")}};
  JsonReader r(j, "c.json");
  EXPECT_EQ(testing::error_of([&] { r.get_double("inf", 0); }),
            "c.json: 'inf' must be a finite number, got inf");
  EXPECT_EQ(testing::error_of([&] {
              r.get_double("nan", 0, {0, 1});
            }),
            "c.json: 'nan' must be a number in [0, 1], got nan");
  EXPECT_EQ(testing::error_of([&] { r.get_int("nan", 0); }),
            "c.json: 'nan' must be an integer, got nan");
}

TEST(JsonReader, NestedObjectsNameTheFullPath) {
  const json j = doc();
  JsonReader r(j, "config.json");
  JsonReader rope = r.child("rope");
  EXPECT_EQ(rope.get_double("factor", 1), 4.0);
  EXPECT_EQ(testing::error_of([&] { rope.get_int("type", 0); }),
            "config.json: 'rope.type' must be an integer, got \"yarn\"");
  JsonReader inner = rope.child("inner");
  EXPECT_EQ(testing::error_of([&] { inner.get_bool("x", false); }),
            "config.json: 'rope.inner.x' must be true or false, got \"y\"");
  EXPECT_EQ(testing::error_of([&] { inner.to_int(json("z"), "[2]"); }),
            "config.json: 'rope.inner[2]' must be an integer, got \"z\"");
  EXPECT_FALSE(r.opt_child("nothing").has_value());  // null: none
  EXPECT_EQ(testing::error_of([&] { r.opt_child("text"); }),
            "config.json: 'text' must be an object or null, got \"abc\"");
  EXPECT_EQ(testing::error_of([&] { rope.error("factor", "and 'type' disagree"); }),
            "config.json: 'rope.factor' and 'type' disagree");
}

TEST(JsonReader, ReportsEveryUnknownKey) {
  const json j = doc();
  JsonReader r(j, "config.json");
  r.get_int("hidden_size", 0);
  r.find("eps");
  r.mark("flag");
  r.opt_string("name");
  EXPECT_TRUE(r.has("text"));  // has() does not count as a read
  const std::vector<std::string> expected = {"bad_list", "big_unsigned", "float_int", "huge_float",
                                             "huge_int", "list",         "neg",       "nothing",
                                             "rope",     "text"};
  EXPECT_EQ(r.unread_keys(), expected);
  EXPECT_EQ(r.unread_keys({"bad_list", "big_unsigned", "float_int", "huge_float", "huge_int",
                           "list", "neg", "nothing", "rope"}),
            std::vector<std::string>{"text"});
  EXPECT_EQ(testing::error_of([&] {
              r.check_unknown_keys({"bad_list", "big_unsigned", "float_int", "huge_float",
                                    "huge_int", "list", "neg", "nothing"},
                                   "(see the docs)");
            }),
            "config.json: unknown keys 'rope', 'text' (see the docs)");
  // A child names its unknown keys with the path; reads of absent keys do not hide any.
  JsonReader rope = r.child("rope");
  rope.get_double("factor", 1);
  rope.get_string("type", "");
  rope.get_double("beta_fast", 32);
  EXPECT_EQ(testing::error_of([&] { rope.check_unknown_keys({"inner"}); }),
            "config.json: unknown key 'rope.extra'");
  rope.mark("extra");
  rope.mark("inner");
  EXPECT_NO_THROW(rope.check_unknown_keys());
}

TEST(JsonReader, ValuesInMessagesAreShort) {
  json j = {{"long", std::string(500, 'x')}};
  JsonReader r(j, "c.json");
  const std::string msg = testing::error_of([&] { r.get_int("long", 0); });
  EXPECT_LT(msg.size(), 160u) << msg;
  EXPECT_NE(msg.find("..."), std::string::npos) << msg;
  // Invalid UTF-8 (a raw --set value) is shown, not a second exception.
  json bad = {{"s", std::string("\xff\xfe")}};
  JsonReader rb(bad, "c.json");
  EXPECT_NE(testing::error_of([&] { rb.get_int("s", 0); }).find("'s' must be an integer"),
            std::string::npos);
}

TEST(ReadJsonFile, ErrorsNameThePath) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("hlm_json_test_" + std::to_string(::getpid())))
          .string();
  std::filesystem::create_directories(dir);
  const std::string good = dir + "/good.json", bad = dir + "/bad.json";
  std::ofstream(good) << R"({"a": [1, 2]})";
  std::ofstream(bad) << R"({"a": )";
  EXPECT_EQ(read_json_file(good), json::parse(R"({"a": [1, 2]})"));
  const std::string e = testing::error_of([&] { read_json_file(bad); });
  EXPECT_EQ(e.rfind(bad + ": malformed JSON", 0), 0u) << e;
  // Read as a regular file only (core/file_io.h): the message names the path and the reason.
  const std::string missing = testing::error_of([&] { read_json_file(dir + "/none.json"); });
  EXPECT_NE(missing.find("'" + dir + "/none.json': cannot open the file"), std::string::npos)
      << missing;
  mkfifo((dir + "/fifo.json").c_str(), 0600);
  const std::string fifo = testing::error_of([&] { read_json_file(dir + "/fifo.json"); });
  EXPECT_NE(fifo.find("fifo.json"), std::string::npos) << fifo;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace hlm
