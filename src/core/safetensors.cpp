#include "core/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "core/checksum.h"
#include "core/file_io.h"
#include "core/memory.h"

namespace hlm::safetensors {

const char* dtype_to_string(DType dt) {
  switch (dt) {
    case DType::f64:
      return "F64";
    case DType::f32:
      return "F32";
    case DType::bf16:
      return "BF16";
    case DType::f16:
      return "F16";
    case DType::e4m3:
      return "F8_E4M3";
    case DType::e5m2:
      return "F8_E5M2";
    case DType::i64:
      return "I64";
    case DType::i32:
      return "I32";
    case DType::u8:
      return "U8";
  }
  return "?";
}

DType dtype_from_string(const std::string& s, const std::string& what) {
  static const std::pair<const char*, DType> table[] = {
      {"F64", DType::f64}, {"F32", DType::f32},      {"BF16", DType::bf16},
      {"F16", DType::f16}, {"F8_E4M3", DType::e4m3}, {"F8_E5M2", DType::e5m2},
      {"I64", DType::i64}, {"I32", DType::i32},      {"U8", DType::u8}};
  for (auto& [name, dt] : table)
    if (s == name) return dt;
  HLM_FAIL(
      "{}: unsupported dtype '{}' (expected F64, F32, BF16, F16, F8_E4M3, F8_E5M2, I64, I32 "
      "or U8)",
      what, s);
}

namespace {

// The parsed header and what the checksum covers of it.
struct Parsed {
  Header h;
  std::string canonical;  // the header without the checksum entry, as dump() writes it
  std::string crc;        // the stored checksum ("" when the file has none)
};

// nlohmann::json keeps the last of duplicate keys; this parser callback records the first
// duplicate of each object instead.
struct DuplicateFinder {
  std::vector<std::set<std::string>> open;
  std::string duplicate;
  int duplicate_depth = -1;
};

Parsed parse_header_text(const uint8_t* p, uint64_t n, uint64_t data_size,
                         const std::string& what) {
  HLM_CHECK(n >= 2 && p[0] == '{',
            "{}: the header must be a JSON object starting with '{{' (the first header byte is "
            "{})",
            what, n == 0 ? std::string("missing") : fmt::format("0x{:02x}", p[0]));
  const std::string header(reinterpret_cast<const char*>(p), size_t(n));
  DuplicateFinder dup;
  nlohmann::json::parser_callback_t cb = [&dup](int depth, nlohmann::json::parse_event_t ev,
                                                nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (ev == E::object_start) dup.open.emplace_back();
    if (ev == E::object_end && !dup.open.empty()) dup.open.pop_back();
    if (ev == E::key && !dup.open.empty() && parsed.is_string() &&
        !dup.open.back().insert(parsed.get<std::string>()).second && dup.duplicate_depth < 0) {
      dup.duplicate = parsed.get<std::string>();
      dup.duplicate_depth = depth;
    }
    return true;
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(header, cb);
  } catch (const nlohmann::json::exception& e) {
    HLM_FAIL("{}: malformed JSON header: {}", what, e.what());
  }
  HLM_CHECK(j.is_object(), "{}: the header must be a JSON object", what);
  HLM_CHECK(dup.duplicate_depth < 0, "{}: the header gives the key '{}' twice{}", what,
            dup.duplicate, dup.duplicate_depth <= 1 ? " (two tensors of one name)" : "");

  Parsed out;
  Header& h = out.h;
  h.data_size = data_size;
  struct Range {
    uint64_t b, e;
    std::string name;
  };
  std::vector<Range> ranges;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      HLM_CHECK(v.is_object(), "{}: __metadata__ must be an object of strings", what);
      for (auto m = v.begin(); m != v.end(); ++m) {
        HLM_CHECK(m.value().is_string(), "{}: __metadata__ value '{}' is not a string", what,
                  m.key());
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string tw = what + ": tensor '" + name + "'";
    HLM_CHECK(!name.empty(), "{}: a tensor has an empty name", what);
    HLM_CHECK(
        v.is_object() && v.contains("dtype") && v.contains("shape") && v.contains("data_offsets"),
        "{}: entry must have dtype, shape and data_offsets", tw);
    HLM_CHECK(v["dtype"].is_string(), "{}: dtype must be a string", tw);
    TensorInfo info;
    info.dtype = dtype_from_string(v["dtype"].get<std::string>(), tw);
    HLM_CHECK(v["shape"].is_array(), "{}: shape must be an array", tw);
    uint64_t numel = 1;
    for (const auto& d : v["shape"]) {
      HLM_CHECK(d.is_number_unsigned() || (d.is_number_integer() && d.get<int64_t>() >= 0),
                "{}: shape entries must be non-negative integers", tw);
      const uint64_t dv = d.get<uint64_t>();
      HLM_CHECK(dv < (uint64_t(1) << 40) && (dv == 0 || numel <= (uint64_t(1) << 40) / dv),
                "{}: shape is too large", tw);
      numel *= dv;
      info.shape.push_back(int64_t(dv));
    }
    const auto& off = v["data_offsets"];
    HLM_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() &&
                  off[1].is_number_unsigned(),
              "{}: data_offsets must be two non-negative integers", tw);
    info.begin = off[0].get<uint64_t>();
    info.end = off[1].get<uint64_t>();
    HLM_CHECK(info.begin <= info.end && info.end <= data_size,
              "{}: data_offsets [{}, {}) outside the data buffer of {} bytes", tw, info.begin,
              info.end, data_size);
    HLM_CHECK(info.end - info.begin == numel * dtype_size(info.dtype),
              "{}: data_offsets span {} bytes but dtype {} and shape {} need {}", tw,
              info.end - info.begin, dtype_to_string(info.dtype), shape_str(info.shape),
              numel * dtype_size(info.dtype));
    ranges.push_back({info.begin, info.end, name});
    h.tensors.emplace(name, std::move(info));
  }
  // The tensors tile the data buffer: [0, e1), [e1, e2), ..., [., data_size).
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& x, const Range& y) { return x.b != y.b ? x.b < y.b : x.e < y.e; });
  uint64_t pos = 0;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const Range& r = ranges[i];
    HLM_CHECK(r.b >= pos, "{}: tensors '{}' and '{}' overlap in the data buffer", what,
              ranges[i - 1].name, r.name);
    HLM_CHECK(r.b == pos,
              "{}: the data buffer has {} bytes at offset {} that no tensor covers (before "
              "tensor '{}'): the header length or the offsets are wrong",
              what, r.b - pos, pos, r.name);
    pos = r.e;
  }
  HLM_CHECK(
      pos == data_size,
      "{}: the tensors cover {} bytes of the {}-byte data buffer; {} trailing bytes belong to "
      "no tensor (the header length or the offsets are wrong, or the file was appended to)",
      what, pos, data_size, data_size - pos);

  auto crc = h.metadata.find(kChecksumKey);
  if (crc != h.metadata.end()) {
    out.crc = crc->second;
    nlohmann::json canon = std::move(j);
    auto& meta = canon["__metadata__"];
    meta.erase(kChecksumKey);
    if (meta.empty()) canon.erase("__metadata__");
    out.canonical = canon.dump();
  }
  return out;
}

std::string canonical_header(const nlohmann::json& h) {
  try {
    return h.dump();
  } catch (const nlohmann::json::exception& e) {
    HLM_FAIL("safetensors: a tensor name or metadata value is not valid UTF-8: {}", e.what());
  }
}

// `data_crc`: the CRC-64 of the whole data buffer.
void check_crc(const Parsed& p, uint64_t data_crc, const std::string& what) {
  const uint64_t got = crc64(p.canonical.data(), p.canonical.size(), data_crc);
  HLM_CHECK(p.crc == crc64_hex(got),
            "{}: checksum mismatch ({} '{}', the contents give '{}'): the file was damaged or "
            "modified after it was written",
            what, kChecksumKey, p.crc, crc64_hex(got));
}

void verify_checksum(const Parsed& p, const uint8_t* data, const std::string& what) {
  if (p.crc.empty() && p.h.metadata.count(kChecksumKey) == 0) return;
  check_crc(p, crc64(data, size_t(p.h.data_size)), what);
}

uint64_t header_length(const uint8_t* b, uint64_t file_size, const std::string& what) {
  HLM_CHECK(file_size >= 8, "{}: not a safetensors file (only {} bytes, the header length needs 8)",
            what, file_size);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | b[size_t(i)];
  HLM_CHECK(n <= file_size - 8, "{}: header length {} exceeds the file size {}", what, n,
            file_size);
  HLM_CHECK(n <= (uint64_t(100) << 20), "{}: header length {} is larger than 100 MiB", what, n);
  return n;
}

}  // namespace

Contents parse(const std::vector<uint8_t>& bytes, const std::string& what) {
  const uint64_t n = header_length(bytes.data(), bytes.size(), what);
  const uint64_t data_begin = 8 + n;
  Parsed p = parse_header_text(bytes.data() + 8, n, bytes.size() - data_begin, what);
  p.h.data_begin = data_begin;
  verify_checksum(p, bytes.data() + data_begin, what);
  Contents c;
  c.metadata = std::move(p.h.metadata);
  for (auto& [name, info] : p.h.tensors) {
    Tensor t = Tensor::empty(info.shape, info.dtype);
    if (info.end > info.begin)
      std::memcpy(t.raw(), bytes.data() + data_begin + info.begin, size_t(info.end - info.begin));
    c.tensors.emplace(name, std::move(t));
  }
  return c;
}

Contents load(const std::string& path) {
  return parse(read_regular_file(path, "safetensors file"), path);
}

Header read_header(const std::string& path) {
  uint64_t size = 0;
  const auto head = read_regular_file_prefix(path, "safetensors file", 8, &size);
  const uint64_t n = header_length(head.data(), size, path);
  const auto bytes = read_regular_file_prefix(path, "safetensors file", 8 + n, &size);
  HLM_CHECK(bytes.size() == 8 + n, "{}: the file changed while its header was read", path);
  Parsed p = parse_header_text(bytes.data() + 8, n, size - 8 - n, path);
  p.h.data_begin = 8 + n;
  return std::move(p.h);
}

void stream(const std::string& path,
            const std::function<bool(const std::string&, const TensorInfo&)>& want,
            const std::function<void(const std::string&, Tensor)>& take,
            const std::function<void(const Header&)>& on_header) {
  const RegularFile f(path, "safetensors file");
  uint8_t len[8] = {};
  if (f.size() >= 8) f.read_at(0, len, 8);
  const uint64_t n = header_length(len, f.size(), path);
  std::vector<uint8_t> head(static_cast<size_t>(n));
  f.read_at(8, head.data(), n);
  Parsed p = parse_header_text(head.data(), n, f.size() - 8 - n, path);
  const uint64_t data_begin = 8 + n;
  p.h.data_begin = data_begin;
  if (on_header) on_header(p.h);
  std::vector<const std::pair<const std::string, TensorInfo>*> order;
  for (const auto& e : p.h.tensors) order.push_back(&e);
  std::sort(order.begin(), order.end(),
            [](auto* a, auto* b) { return a->second.begin < b->second.begin; });
  const bool checked = !p.crc.empty() || p.h.metadata.count(kChecksumKey) > 0;
  uint64_t crc = 0;
  std::vector<uint8_t> chunk;
  for (const auto* e : order) {
    const TensorInfo& info = e->second;
    const uint64_t bytes = info.end - info.begin;
    if (want(e->first, info)) {
      Tensor t = Tensor::empty(info.shape, info.dtype);
      f.read_at(data_begin + info.begin, t.raw(), bytes);
      if (checked) crc = crc64(t.raw(), size_t(bytes), crc);
      take(e->first, std::move(t));
    } else if (checked) {
      chunk.resize(size_t(std::min<uint64_t>(bytes, uint64_t(1) << 20)));
      for (uint64_t at = 0; at < bytes; at += chunk.size()) {
        const uint64_t k = std::min<uint64_t>(chunk.size(), bytes - at);
        f.read_at(data_begin + info.begin + at, chunk.data(), k);
        crc = crc64(chunk.data(), size_t(k), crc);
      }
    }
  }
  if (checked) check_crc(p, crc, path);
}

std::vector<uint8_t> serialize(const TensorMap& tensors, const Metadata& metadata) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  nlohmann::json canon = nlohmann::json::object();  // the checksummed form (sorted keys)
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (auto& [k, v] : metadata)
      if (k != kChecksumKey) m[k] = v, canon["__metadata__"][k] = v;
    h["__metadata__"] = m;
  } else {
    h["__metadata__"] = nlohmann::ordered_json::object();
  }
  uint64_t offset = 0;
  std::vector<Tensor> cpu;
  for (auto& [name, t] : tensors) {
    HLM_CHECK(t.defined(), "safetensors: tensor '{}' is undefined", name);
    HLM_CHECK(!name.empty() && name != "__metadata__", "safetensors: invalid tensor name '{}'",
              name);
    Tensor c = t.is_cpu() ? t.contiguous() : t.to(Device::cpu);
    const uint64_t nb = c.nbytes();
    const nlohmann::json entry = {{"dtype", dtype_to_string(c.dtype())},
                                  {"shape", c.shape()},
                                  {"data_offsets", {offset, offset + nb}}};
    h[name] = entry;
    canon[name] = entry;
    offset = checked_add_u(offset, nb, "safetensors: the data buffer size");
    cpu.push_back(std::move(c));
  }
  uint64_t crc = 0;
  for (auto& c : cpu) crc = crc64(c.raw(), c.nbytes(), crc);
  const std::string canonical = canonical_header(canon);
  h["__metadata__"][kChecksumKey] = crc64_hex(crc64(canonical.data(), canonical.size(), crc));
  std::string header;
  try {
    header = h.dump();
  } catch (const nlohmann::json::exception& e) {
    HLM_FAIL("safetensors: a tensor name or metadata value is not valid UTF-8: {}", e.what());
  }
  while ((8 + header.size()) % 8 != 0) header.push_back(' ');  // align the data buffer
  std::vector<uint8_t> out(size_t(checked_add_u(8 + header.size(), offset, "safetensors: file")));
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[size_t(i)] = uint8_t(n >> (8 * i));
  std::memcpy(out.data() + 8, header.data(), header.size());
  uint8_t* p = out.data() + 8 + header.size();
  for (auto& c : cpu) {
    if (c.nbytes()) std::memcpy(p, c.raw(), c.nbytes());
    p += c.nbytes();
  }
  return out;
}

void save(const std::string& path, const TensorMap& tensors, const Metadata& metadata) {
  const std::string target = resolve_output_path(path, "output");
  const std::vector<uint8_t> bytes = serialize(tensors, metadata);
  write_file_replacing(target, bytes, "output '" + path + "'");
}

}  // namespace hlm::safetensors
