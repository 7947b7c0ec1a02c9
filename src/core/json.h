// JSON I/O and the one typed reader of JSON objects: model config.json, training configs and
// the precision keys are all read through JsonReader.
//
// A JsonReader reads the keys of one JSON object with their types and ranges checked and
// remembers which keys it was asked for, so the rest can be reported as unknown. Every error is
// an hlm::Error naming the document, the key path inside it and what was expected, e.g.
//   config.json: 'hidden_size' must be an integer >= 1, got "abc"
//   train.json: 'steps' must be an integer, got 1e+30
//   config.json: unknown key 'rope_scaling.factr' (expected type, factor, ...)
//
// Conventions of the typed reads:
//   get_X(key, def, ...)  absent -> def; present -> must be an X (null is a type error);
//   opt_X(key, ...)       absent or null -> nullopt;
//   req_X(key, ...)       absent -> error ("'key' is missing"); present -> must be an X.
//   Integers are JSON integers only: a float is refused even when it is whole (4.0, 1e30, and
//   99999999999999999999, which JSON parsers hold as a float), and so is an integer outside the
//   range: nothing saturates or wraps. The default range is [-2^53, 2^53] (the integers every
//   JSON implementation holds exactly); pass an IntRange to narrow or widen it.
//   Doubles are any JSON number (integers too) and must be finite, optionally within a range.
//   Enums are strings from a list of (name, value) pairs; the message lists the names.
// to_X(value, name, ...) check a value found inside the object (an array element, a value
// looked up with find()); `name` is its path relative to the object ("eos_token_id[1]").
#pragma once

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace hlm {

// Reads a JSON file; an hlm::Error naming the path when it cannot be opened or is malformed.
nlohmann::json read_json_file(const std::string& path);

// The default bound of JSON integers: 2^53.
inline constexpr int64_t kJsonIntLimit = int64_t(1) << 53;

struct IntRange {
  int64_t min = -kJsonIntLimit;
  int64_t max = kJsonIntLimit;
};
struct DoubleRange {
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
};

class JsonReader {
 public:
  // `obj` must be a JSON object (else an error). `source` names the document in messages (a file
  // path, "training config"); `path` is the key path of `obj` inside it ("" at the top level).
  // The reader keeps a reference to `obj`: it must outlive the reader.
  JsonReader(const nlohmann::json& obj, std::string source, std::string path = "");

  const std::string& source() const { return source_; }
  const nlohmann::json& object() const { return obj_; }
  // The full key path of a name relative to this object: "mqar" + "max_pairs" -> "mqar.max_pairs".
  std::string path_of(const std::string& name) const;

  // ---- raw access ----
  bool has(const std::string& key) const;  // present (null included); does not mark it read
  const nlohmann::json* find(const std::string& key);  // marks it read; nullptr when absent
  const nlohmann::json* find_non_null(const std::string& key);  // nullptr when absent or null
  void mark(const std::string& key);  // counts as read (known but ignored here)

  // ---- typed reads ----
  int64_t get_int(const std::string& key, int64_t def, IntRange r = {});
  std::optional<int64_t> opt_int(const std::string& key, IntRange r = {});
  int64_t req_int(const std::string& key, IntRange r = {});
  double get_double(const std::string& key, double def, DoubleRange r = {});
  std::optional<double> opt_double(const std::string& key, DoubleRange r = {});
  bool get_bool(const std::string& key, bool def);
  std::string get_string(const std::string& key, const std::string& def);
  std::optional<std::string> opt_string(const std::string& key);
  std::string req_string(const std::string& key);
  std::optional<std::vector<std::string>> opt_string_list(const std::string& key);
  template <class T>
  T get_enum(const std::string& key, T def,
             std::initializer_list<std::pair<const char*, T>> names) {
    return get_with(key, def, [&](const nlohmann::json& v) { return to_enum(v, key, names); });
  }
  template <class T>
  std::optional<T> opt_enum(const std::string& key,
                            std::initializer_list<std::pair<const char*, T>> names) {
    return opt_with(key, [&](const nlohmann::json& v) { return to_enum(v, key, names); });
  }

  // A key that is accepted with one of `allowed` only (absent or null: nothing to check).
  void expect_one_of(const std::string& key, std::initializer_list<const char*> allowed);

  // A string turned into a value by `parse` (a function that throws hlm::Error for a string it
  // does not know): its message is reported under the key ("<source>: 'key': <message>").
  template <class T, class Parse>
  T get_parsed(const std::string& key, T def, Parse&& parse) {
    const nlohmann::json* v = find(key);
    if (!v) return def;
    const std::string s = to_string(*v, key);
    try {
      return parse(s);
    } catch (const std::exception& e) {
      rethrow_under(key, e);
    }
  }

  // A nested object: child() requires it (absent or not an object: error); opt_child() gives
  // nullopt when it is absent or null. The child's messages name "key.field".
  JsonReader child(const std::string& key);
  std::optional<JsonReader> opt_child(const std::string& key);

  // ---- checks of values found inside this object ----
  int64_t to_int(const nlohmann::json& v, const std::string& name, IntRange r = {}) const;
  double to_double(const nlohmann::json& v, const std::string& name, DoubleRange r = {}) const;
  bool to_bool(const nlohmann::json& v, const std::string& name) const;
  std::string to_string(const nlohmann::json& v, const std::string& name) const;
  std::vector<std::string> to_string_list(const nlohmann::json& v, const std::string& name) const;
  template <class T>
  T to_enum(const nlohmann::json& v, const std::string& name,
            std::initializer_list<std::pair<const char*, T>> names) const {
    std::vector<const char*> list;
    if (v.is_string()) {
      const std::string& s = v.get_ref<const std::string&>();
      for (const auto& [n, value] : names)
        if (s == n) return value;
    }
    for (const auto& n : names) list.push_back(n.first);
    fail(name, one_of(list), v);
  }

  // "<source>: '<path>' must be <expected>, got <value>".
  [[noreturn]] void fail(const std::string& name, const std::string& expected,
                         const nlohmann::json& got) const;
  // "<source>: '<path>' <message>".
  [[noreturn]] void error(const std::string& name, const std::string& message) const;

  // ---- unknown keys ----
  // The keys of the object that were not read and are not in `ignored`, in key order.
  std::vector<std::string> unread_keys(const std::set<std::string>& ignored = {}) const;
  // Throws when unread_keys(ignored) is not empty, naming every one of them:
  // "<source>: unknown key(s) 'a', 'b.c' <hint>".
  void check_unknown_keys(const std::set<std::string>& ignored = {},
                          const std::string& hint = "") const;

 private:
  static std::string one_of(const std::vector<const char*>& names);
  [[noreturn]] void rethrow_under(const std::string& name, const std::exception& e) const;

  // The get_X and opt_X rules of every type: `to` checks and converts a value that is present
  // (get: absent -> def; opt: absent or null -> nullopt).
  template <class T, class To>
  T get_with(const std::string& key, T def, To&& to) {
    const nlohmann::json* v = find(key);
    return v ? T(to(*v)) : def;
  }
  template <class To>
  auto opt_with(const std::string& key, To&& to)
      -> std::optional<decltype(to(std::declval<const nlohmann::json&>()))> {
    const nlohmann::json* v = find_non_null(key);
    if (!v) return std::nullopt;
    return to(*v);
  }

  const nlohmann::json& obj_;
  std::string source_, path_;
  std::set<std::string> read_;
};

// A JSON value as messages show it: dump() (strings quoted), NaN / Inf spelled out, and long
// values cut at about 80 characters.
std::string json_value_str(const nlohmann::json& v);

}  // namespace hlm
