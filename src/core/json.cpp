// JSON I/O and JsonReader (core/json.h).
#include "core/json.h"

#include <fmt/format.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/file_io.h"

namespace hlm {

using nlohmann::json;

json read_json_file(const std::string& path) {
  // A regular file only (a FIFO or a device would block or never end), read whole.
  const std::vector<uint8_t> bytes = read_regular_file(path, "JSON file");
  try {
    return json::parse(bytes.begin(), bytes.end());
  } catch (const json::exception& e) {
    throw Error(fmt::format("{}: malformed JSON: {}", path, e.what()));
  }
}

std::string json_value_str(const json& v) {
  if (v.is_number_float() && !std::isfinite(v.get<double>()))
    return fmt::format("{}", v.get<double>());
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  constexpr size_t kMax = 80;
  if (s.size() > kMax) s = s.substr(0, kMax) + "...";
  return s;
}

namespace {

std::string bound_str(int64_t b) {
  if (b == kJsonIntLimit) return "2^53";
  if (b == -kJsonIntLimit) return "-2^53";
  return std::to_string(b);
}

// "an integer", "an integer >= 1", "an integer in [0, 7]". The default bounds are shown only
// when asked (a value outside them).
std::string int_expected(IntRange r, bool show_all) {
  const bool lo = r.min != -kJsonIntLimit, hi = r.max != kJsonIntLimit;
  if (show_all || (lo && hi))
    return fmt::format("an integer in [{}, {}]", bound_str(r.min), bound_str(r.max));
  if (lo) return fmt::format("an integer >= {}", r.min);
  if (hi) return fmt::format("an integer <= {}", r.max);
  return "an integer";
}

std::string double_expected(DoubleRange r) {
  const bool lo = std::isfinite(r.min), hi = std::isfinite(r.max);
  if (lo && hi) return fmt::format("a number in [{}, {}]", r.min, r.max);
  if (lo) return fmt::format("a number >= {}", r.min);
  if (hi) return fmt::format("a number <= {}", r.max);
  return "a finite number";
}

}  // namespace

JsonReader::JsonReader(const json& obj, std::string source, std::string path)
    : obj_(obj), source_(std::move(source)), path_(std::move(path)) {
  if (obj_.is_object()) return;
  if (path_.empty())
    throw Error(fmt::format("{}: expected a JSON object, got {} {}", source_, obj_.type_name(),
                            json_value_str(obj_)));
  throw Error(
      fmt::format("{}: '{}' must be an object, got {}", source_, path_, json_value_str(obj_)));
}

std::string JsonReader::path_of(const std::string& name) const {
  if (path_.empty()) return name;
  if (!name.empty() && name[0] == '[') return path_ + name;
  return path_ + "." + name;
}

bool JsonReader::has(const std::string& key) const {
  return obj_.contains(key);
}

const json* JsonReader::find(const std::string& key) {
  read_.insert(key);
  auto it = obj_.find(key);
  return it == obj_.end() ? nullptr : &*it;
}

const json* JsonReader::find_non_null(const std::string& key) {
  const json* v = find(key);
  return v && !v->is_null() ? v : nullptr;
}

void JsonReader::mark(const std::string& key) {
  read_.insert(key);
}

void JsonReader::fail(const std::string& name, const std::string& expected, const json& got) const {
  throw Error(fmt::format("{}: '{}' must be {}, got {}", source_, path_of(name), expected,
                          json_value_str(got)));
}

void JsonReader::error(const std::string& name, const std::string& message) const {
  throw Error(fmt::format("{}: '{}' {}", source_, path_of(name), message));
}

void JsonReader::rethrow_under(const std::string& name, const std::exception& e) const {
  throw Error(fmt::format("{}: '{}': {}", source_, path_of(name), e.what()));
}

// ---- values -------------------------------------------------------------------------------------

int64_t JsonReader::to_int(const json& v, const std::string& name, IntRange r) const {
  if (!v.is_number_integer()) fail(name, int_expected(r, false), v);
  if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
    fail(name, int_expected(r, true), v);
  const int64_t x = v.get<int64_t>();
  if (x < r.min || x > r.max)
    fail(name, int_expected(r, x < -kJsonIntLimit || x > kJsonIntLimit), v);
  return x;
}

double JsonReader::to_double(const json& v, const std::string& name, DoubleRange r) const {
  if (!v.is_number()) fail(name, double_expected(r), v);
  const double x = v.get<double>();
  if (!std::isfinite(x) || x < r.min || x > r.max) fail(name, double_expected(r), v);
  return x;
}

bool JsonReader::to_bool(const json& v, const std::string& name) const {
  if (!v.is_boolean()) fail(name, "true or false", v);
  return v.get<bool>();
}

std::string JsonReader::to_string(const json& v, const std::string& name) const {
  if (!v.is_string()) fail(name, "a string", v);
  return v.get<std::string>();
}

std::vector<std::string> JsonReader::to_string_list(const json& v, const std::string& name) const {
  if (!v.is_array()) fail(name, "a list of strings", v);
  std::vector<std::string> out;
  for (size_t i = 0; i < v.size(); ++i)
    out.push_back(to_string(v[i], fmt::format("{}[{}]", name, i)));
  return out;
}

std::string JsonReader::one_of(const std::vector<const char*>& names) {
  if (names.size() == 1) return fmt::format("\"{}\"", names[0]);
  std::string s = "one of ";
  for (size_t i = 0; i < names.size(); ++i)
    s += fmt::format("{}\"{}\"", i == 0 ? "" : ", ", names[i]);
  return s;
}

// ---- keys ---------------------------------------------------------------------------------------

int64_t JsonReader::get_int(const std::string& key, int64_t def, IntRange r) {
  return get_with(key, def, [&](const json& v) { return to_int(v, key, r); });
}

std::optional<int64_t> JsonReader::opt_int(const std::string& key, IntRange r) {
  return opt_with(key, [&](const json& v) { return to_int(v, key, r); });
}

int64_t JsonReader::req_int(const std::string& key, IntRange r) {
  const json* v = find(key);
  if (!v) error(key, fmt::format("is missing ({} is required)", int_expected(r, false)));
  return to_int(*v, key, r);
}

double JsonReader::get_double(const std::string& key, double def, DoubleRange r) {
  return get_with(key, def, [&](const json& v) { return to_double(v, key, r); });
}

std::optional<double> JsonReader::opt_double(const std::string& key, DoubleRange r) {
  return opt_with(key, [&](const json& v) { return to_double(v, key, r); });
}

bool JsonReader::get_bool(const std::string& key, bool def) {
  return get_with(key, def, [&](const json& v) { return to_bool(v, key); });
}

std::string JsonReader::get_string(const std::string& key, const std::string& def) {
  return get_with(key, def, [&](const json& v) { return to_string(v, key); });
}

std::optional<std::string> JsonReader::opt_string(const std::string& key) {
  return opt_with(key, [&](const json& v) { return to_string(v, key); });
}

std::string JsonReader::req_string(const std::string& key) {
  const json* v = find(key);
  if (!v) error(key, "is missing (a string is required)");
  return to_string(*v, key);
}

std::optional<std::vector<std::string>> JsonReader::opt_string_list(const std::string& key) {
  return opt_with(key, [&](const json& v) { return to_string_list(v, key); });
}

void JsonReader::expect_one_of(const std::string& key, std::initializer_list<const char*> allowed) {
  const json* v = find_non_null(key);
  if (!v) return;
  if (v->is_string())
    for (const char* a : allowed)
      if (v->get_ref<const std::string&>() == a) return;
  fail(key, one_of(std::vector<const char*>(allowed)), *v);
}

JsonReader JsonReader::child(const std::string& key) {
  const json* v = find(key);
  if (!v) error(key, "is missing (an object is required)");
  if (!v->is_object()) fail(key, "an object", *v);
  return JsonReader(*v, source_, path_of(key));
}

std::optional<JsonReader> JsonReader::opt_child(const std::string& key) {
  const json* v = find_non_null(key);
  if (!v) return std::nullopt;
  if (!v->is_object()) fail(key, "an object or null", *v);
  return JsonReader(*v, source_, path_of(key));
}

std::vector<std::string> JsonReader::unread_keys(const std::set<std::string>& ignored) const {
  std::vector<std::string> out;
  for (auto it = obj_.begin(); it != obj_.end(); ++it)
    if (!read_.count(it.key()) && !ignored.count(it.key())) out.push_back(it.key());
  return out;
}

void JsonReader::check_unknown_keys(const std::set<std::string>& ignored,
                                    const std::string& hint) const {
  const std::vector<std::string> unknown = unread_keys(ignored);
  if (unknown.empty()) return;
  std::string names;
  for (const auto& u : unknown)
    names += fmt::format("{}'{}'", names.empty() ? "" : ", ", path_of(u));
  throw Error(fmt::format("{}: unknown key{} {}{}{}", source_, unknown.size() > 1 ? "s" : "", names,
                          hint.empty() ? "" : " ", hint));
}

}  // namespace hlm
