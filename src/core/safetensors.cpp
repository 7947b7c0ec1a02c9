#include "core/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

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

Contents parse(const std::vector<uint8_t>& bytes, const std::string& what) {
  HLM_CHECK(bytes.size() >= 8,
            "{}: not a safetensors file (only {} bytes, the header length "
            "needs 8)",
            what, bytes.size());
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[size_t(i)];
  HLM_CHECK(n <= bytes.size() - 8, "{}: header length {} exceeds the file size {}", what, n,
            bytes.size());
  HLM_CHECK(n <= (uint64_t(100) << 20), "{}: header length {} is larger than 100 MiB", what, n);
  const std::string header(reinterpret_cast<const char*>(bytes.data()) + 8, size_t(n));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(header);
  } catch (const nlohmann::json::exception& e) {
    HLM_FAIL("{}: malformed JSON header: {}", what, e.what());
  }
  HLM_CHECK(j.is_object(), "{}: the header must be a JSON object", what);
  const uint64_t data_begin = 8 + n, data_size = bytes.size() - data_begin;

  Contents c;
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
        c.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string tw = what + ": tensor '" + name + "'";
    HLM_CHECK(
        v.is_object() && v.contains("dtype") && v.contains("shape") && v.contains("data_offsets"),
        "{}: entry must have dtype, shape and data_offsets", tw);
    HLM_CHECK(v["dtype"].is_string(), "{}: dtype must be a string", tw);
    const DType dt = dtype_from_string(v["dtype"].get<std::string>(), tw);
    HLM_CHECK(v["shape"].is_array(), "{}: shape must be an array", tw);
    Shape shape;
    uint64_t numel = 1;
    for (const auto& d : v["shape"]) {
      HLM_CHECK(d.is_number_unsigned() || (d.is_number_integer() && d.get<int64_t>() >= 0),
                "{}: shape entries must be non-negative integers", tw);
      const uint64_t dv = d.get<uint64_t>();
      HLM_CHECK(dv < (uint64_t(1) << 40) && (dv == 0 || numel <= (uint64_t(1) << 40) / dv),
                "{}: shape is too large", tw);
      numel *= dv;
      shape.push_back(int64_t(dv));
    }
    const auto& off = v["data_offsets"];
    HLM_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() &&
                  off[1].is_number_unsigned(),
              "{}: data_offsets must be two non-negative integers", tw);
    const uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
    HLM_CHECK(b <= e && e <= data_size,
              "{}: data_offsets [{}, {}) outside the data buffer of {} "
              "bytes",
              tw, b, e, data_size);
    HLM_CHECK(e - b == numel * dtype_size(dt),
              "{}: data_offsets span {} bytes but dtype {} and "
              "shape {} need {}",
              tw, e - b, dtype_to_string(dt), shape_str(shape), numel * dtype_size(dt));
    ranges.push_back({b, e, name});
    Tensor t = Tensor::empty(shape, dt);
    if (e > b) std::memcpy(t.raw(), bytes.data() + data_begin + b, size_t(e - b));
    c.tensors.emplace(name, std::move(t));
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& x, const Range& y) { return x.b != y.b ? x.b < y.b : x.e < y.e; });
  for (size_t i = 1; i < ranges.size(); ++i) {
    HLM_CHECK(ranges[i].b >= ranges[i - 1].e || ranges[i].b == ranges[i].e ||
                  ranges[i - 1].b == ranges[i - 1].e,
              "{}: tensors '{}' and '{}' overlap in the data buffer", what, ranges[i - 1].name,
              ranges[i].name);
  }
  return c;
}

Contents load(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  HLM_CHECK(f.good(), "cannot open safetensors file '{}'", path);
  f.seekg(0, std::ios::end);
  const auto size = f.tellg();
  HLM_CHECK(size >= 0, "cannot read '{}'", path);
  f.seekg(0);
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  f.read(reinterpret_cast<char*>(bytes.data()), size);
  HLM_CHECK(f.good() || f.eof(), "error reading '{}'", path);
  return parse(bytes, path);
}

std::vector<uint8_t> serialize(const TensorMap& tensors, const Metadata& metadata) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (auto& [k, v] : metadata) m[k] = v;
    h["__metadata__"] = m;
  }
  uint64_t offset = 0;
  std::vector<Tensor> cpu;
  for (auto& [name, t] : tensors) {
    HLM_CHECK(t.defined(), "safetensors: tensor '{}' is undefined", name);
    HLM_CHECK(!name.empty() && name != "__metadata__", "safetensors: invalid tensor name '{}'",
              name);
    Tensor c = t.is_cpu() ? t.contiguous() : t.to(Device::cpu);
    const uint64_t nb = c.nbytes();
    h[name] = {{"dtype", dtype_to_string(c.dtype())},
               {"shape", c.shape()},
               {"data_offsets", {offset, offset + nb}}};
    offset += nb;
    cpu.push_back(std::move(c));
  }
  std::string header = h.dump();
  while ((8 + header.size()) % 8 != 0) header.push_back(' ');  // align the data buffer
  std::vector<uint8_t> out(8 + header.size() + offset);
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
  const std::vector<uint8_t> bytes = serialize(tensors, metadata);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  HLM_CHECK(fd >= 0, "cannot create '{}'", tmp);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w <= 0) {
      ::close(fd);
      ::unlink(tmp.c_str());
      HLM_FAIL("error writing '{}'", tmp);
    }
    done += size_t(w);
  }
  const bool synced = ::fsync(fd) == 0;
  ::close(fd);
  if (!synced || std::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    HLM_FAIL("cannot write '{}'", path);
  }
}

}  // namespace hlm::safetensors
