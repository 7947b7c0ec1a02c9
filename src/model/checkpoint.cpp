// Checkpoint I/O (model/checkpoint.h): HF-layout safetensors load/save, atomic writes.
#include "model/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>

#include "core/error.h"
#include "core/file_io.h"
#include "core/memory.h"
#include "layers/module.h"
#include "layers/precision.h"
#include "model/checkpoint_layout.h"
#include "model/config_limits.h"

namespace hlm::checkpoint {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

bool starts_with(const std::string& s, const std::string& p) {
  return s.size() >= p.size() && s.compare(0, p.size(), p) == 0;
}
bool ends_with(const std::string& s, const std::string& p) {
  return s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
}

std::string list_names(const std::vector<std::string>& names, size_t max_shown = 20) {
  std::string s;
  for (size_t i = 0; i < names.size() && i < max_shown; ++i)
    s += fmt::format("{}'{}'", i ? ", " : "", names[i]);
  if (names.size() > max_shown) s += fmt::format(" (and {} more)", names.size() - max_shown);
  return s;
}

std::string errno_str() {
  return std::strerror(errno);
}

// ---- atomic files ----------------------------------------------------------------------------

std::atomic<uint64_t> g_counter{0};

std::string temp_path_for(const std::string& final_path) {
  const fs::path p(final_path);
  const std::string name =
      fmt::format(".{}.tmp.{}.{}", p.filename().string(), ::getpid(), g_counter.fetch_add(1));
  return (p.parent_path() / name).string();
}

// Write bytes to a new temporary file next to `final_path`, fsync it; returns its path.
std::string write_temp(const std::string& final_path, const std::vector<uint8_t>& bytes) {
  const std::string tmp = temp_path_for(final_path);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  HLM_CHECK(fd >= 0, "cannot create '{}': {}", tmp, errno_str());
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const std::string err = errno_str();
      ::close(fd);
      ::unlink(tmp.c_str());
      HLM_FAIL("error writing '{}' ({} of {} bytes written): {}", tmp, done, bytes.size(), err);
    }
    done += size_t(w);
  }
  if (::fsync(fd) != 0) {
    const std::string err = errno_str();
    ::close(fd);
    ::unlink(tmp.c_str());
    HLM_FAIL("fsync of '{}' failed: {}", tmp, err);
  }
  if (::close(fd) != 0) {
    const std::string err = errno_str();
    ::unlink(tmp.c_str());
    HLM_FAIL("closing '{}' failed: {}", tmp, err);
  }
  return tmp;
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);  // some file systems do not support it (EINVAL): the renames are still done
  ::close(fd);
}

// A set of files written as temporaries, renamed together. Destruction without commit() deletes
// the temporaries.
class AtomicFileSet {
 public:
  explicit AtomicFileSet(std::function<void(const std::string&)> hook) : hook_(std::move(hook)) {}
  ~AtomicFileSet() {
    for (auto& [tmp, final_path] : files_) ::unlink(tmp.c_str());
  }
  AtomicFileSet(const AtomicFileSet&) = delete;
  AtomicFileSet& operator=(const AtomicFileSet&) = delete;

  // The target is resolved (core/file_io.h): a symbolic link is written through, and a
  // directory, device, FIFO or socket of that name is refused, never replaced.
  void add(const std::string& final_path, const std::vector<uint8_t>& bytes) {
    const std::string target = resolve_output_path(final_path, "checkpoint file");
    const std::string tmp = write_temp(target, bytes);
    files_.emplace_back(tmp, target);
    if (hook_) hook_(tmp);
  }
  // Rename in the order added, then fsync the directories.
  void commit() {
    std::set<std::string> dirs;
    while (!files_.empty()) {
      auto [tmp, final_path] = files_.front();
      check_output_target(final_path, "checkpoint file");
      if (std::rename(tmp.c_str(), final_path.c_str()) != 0)
        HLM_FAIL("cannot rename '{}' to '{}': {}", tmp, final_path, errno_str());
      files_.erase(files_.begin());
      dirs.insert(fs::path(final_path).parent_path().string());
    }
    for (auto& d : dirs) fsync_dir(d);
  }

 private:
  std::function<void(const std::string&)> hook_;
  std::vector<std::pair<std::string, std::string>> files_;  // (tmp, final)
};

void make_dirs(const std::string& dir) {
  if (dir.empty()) return;
  std::error_code ec;
  fs::create_directories(dir, ec);
  HLM_CHECK(!ec && fs::is_directory(dir), "cannot create the directory '{}': {}", dir,
            ec ? ec.message() : "a file of that name exists");
}

std::string make_save_id() {
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::system_clock::now().time_since_epoch())
                      .count();
  return fmt::format("{:x}-{}-{}", ns, ::getpid(), g_counter.fetch_add(1));
}

std::vector<uint8_t> text_bytes(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

bool is_shard_name(const std::string& name) {
  return starts_with(name, "model-") && ends_with(name, ".safetensors") &&
         name.find("-of-") != std::string::npos;
}

// ---- reading ---------------------------------------------------------------------------------

struct Source {
  std::string where;               // what error messages call the checkpoint
  std::vector<std::string> files;  // full paths, in load order
  bool sharded = false;
  std::map<std::string, std::string> weight_map;  // checkpoint name -> full shard path
  std::string save_id;                            // from the index metadata ("" if none)
};

Source open_source(const std::string& path) {
  Source s;
  std::error_code ec;
  std::string index;
  if (fs::is_directory(path, ec)) {
    const std::string single = (fs::path(path) / kSingleFile).string();
    const std::string idx = (fs::path(path) / kIndexFile).string();
    const bool has_single = fs::exists(single), has_index = fs::exists(idx);
    HLM_CHECK(!(has_single && has_index),
              "checkpoint '{}': both {} and {} exist (an interrupted save in another layout?); "
              "remove the stale one",
              path, kSingleFile, kIndexFile);
    HLM_CHECK(has_single || has_index, "checkpoint '{}': neither {} nor {} exists", path,
              kSingleFile, kIndexFile);
    if (has_single) {
      s.where = single;
      s.files.push_back(single);
      return s;
    }
    index = idx;
  } else {
    HLM_CHECK(fs::is_regular_file(path, ec), "checkpoint '{}' does not exist", path);
    if (!ends_with(path, ".index.json")) {
      s.where = path;
      s.files.push_back(path);
      return s;
    }
    index = path;
  }
  s.where = index;
  s.sharded = true;
  const json j = read_json_file(index);
  HLM_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
            "{}: expected an object with a \"weight_map\" object", index);
  if (j.contains("metadata") && j["metadata"].is_object()) {
    auto id = j["metadata"].find("hlm_save_id");
    if (id != j["metadata"].end() && id->is_string()) s.save_id = id->get<std::string>();
  }
  const fs::path dir = fs::path(index).parent_path();
  std::set<std::string> seen;
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    HLM_CHECK(it.value().is_string(), "{}: weight_map['{}'] must be a file name, got {}", index,
              it.key(), it.value().dump());
    const std::string f = it.value().get<std::string>();
    HLM_CHECK(!f.empty() && f.find('/') == std::string::npos && f != "." && f != "..",
              "{}: weight_map['{}'] is '{}', expected a file name in the same directory", index,
              it.key(), f);
    const std::string full = (dir / f).string();
    s.weight_map[it.key()] = full;
    if (seen.insert(full).second) s.files.push_back(full);
  }
  std::sort(s.files.begin(), s.files.end());
  for (const auto& f : s.files)
    HLM_CHECK(fs::is_regular_file(f), "{}: shard '{}' does not exist", index, f);
  return s;
}

// Checks one file of the source against the index: the tensors it holds (`names`) are the ones
// the index places in it, and its save id is the index's.
template <class Map>
void check_shard(const Source& src, const std::string& file, const Map& names,
                 const Metadata& metadata) {
  if (!src.sharded) return;
  for (auto& [name, t] : names) {
    auto it = src.weight_map.find(name);
    HLM_CHECK(it != src.weight_map.end() && it->second == file,
              "{}: shard '{}' holds tensor '{}', which the index {}", src.where, file, name,
              it == src.weight_map.end() ? "does not list" : "places in " + it->second);
  }
  for (auto& [name, f] : src.weight_map)
    if (f == file)
      HLM_CHECK(names.count(name), "{}: tensor '{}' is not in its shard '{}'", src.where, name,
                file);
  if (!src.save_id.empty()) {
    auto id = metadata.find("hlm_save_id");
    HLM_CHECK(id != metadata.end() && id->second == src.save_id,
              "{}: shard '{}' belongs to another save (hlm_save_id '{}' vs the index's '{}'): the "
              "checkpoint was left inconsistent by an interrupted save",
              src.where, file, id == metadata.end() ? "" : id->second, src.save_id);
  }
}

// Load one whole file of the source and check it against the index.
safetensors::Contents load_file(const Source& src, const std::string& file) {
  safetensors::Contents c = safetensors::load(file);
  check_shard(src, file, c.tensors, c.metadata);
  return c;
}

std::string quoted(const std::string& name) {
  return "'" + name + "'";
}
// How messages name a loaded tensor: 'name', or 'checkpoint name' (as 'canonical name').
std::string display_name(const std::string& orig, const std::string& canon) {
  return orig == canon ? quoted(canon) : fmt::format("'{}' (as '{}')", orig, canon);
}

std::string element_str(const Tensor& t, int64_t i) {
  Tensor c = t.is_cpu() ? t.contiguous() : t.to(Device::cpu);
  double v = 0;
  convert_elements(static_cast<const char*>(c.raw()) + size_t(i) * c.element_size(), c.dtype(), &v,
                   DType::f64, 1);
  return fmt::format("{}", v);
}

// `name`: as display_name() gives it.
void check_finite(const Tensor& t, const std::string& name, const std::string& where,
                  const char* stage) {
  const int64_t bad = first_non_finite(t);
  HLM_CHECK(bad < 0, "{}: tensor {} ({}) has a non-finite value {} at flat index {}{}", where, name,
            t.describe(), element_str(t, bad), bad, stage);
}

std::string scale_name(const std::string& weight) {
  return weight + "_scale_inv";
}

// Checkpoint tensor names -> canonical names, with collisions reported.
std::map<std::string, std::string> canonical_names(const std::vector<std::string>& names,
                                                   const std::string& where) {
  std::map<std::string, std::string> out;  // canonical -> checkpoint name
  for (const auto& n : names) {
    const std::string c = canonical_name(n);
    auto [it, fresh] = out.emplace(c, n);
    HLM_CHECK(fresh, "{}: tensors '{}' and '{}' both map to '{}'", where, it->second, n, c);
  }
  return out;
}

bool ignored_name(const std::string& canon, const LoadOptions& o) {
  for (const auto& p : o.ignore_prefixes)
    if (starts_with(canon, p)) return true;
  if (o.ignore_layers_from >= 0 && starts_with(canon, "model.layers.")) {
    const size_t b = std::strlen("model.layers."), e = canon.find('.', b);
    if (e != std::string::npos && e > b) {
      const std::string num = canon.substr(b, e - b);
      if (num.find_first_not_of("0123456789") == std::string::npos && num.size() < 18 &&
          std::stoll(num) >= o.ignore_layers_from)
        return true;
    }
  }
  return false;
}

// `name`: as display_name() gives it.
void assign(const std::string& name, const Tensor& src, Tensor& dst, const std::string& where,
            const LoadOptions& o) {
  HLM_CHECK(dst.defined(), "{}: the target tensor for {} is undefined", where, name);
  HLM_CHECK(src.shape() == dst.shape(),
            "{}: tensor {} has shape {} in the checkpoint but the model expects {}", where, name,
            shape_str(src.shape()), shape_str(dst.shape()));
  const bool convertible = is_floating(src.dtype()) && is_floating(dst.dtype());
  HLM_CHECK(src.dtype() == dst.dtype() || convertible,
            "{}: tensor {} is {} in the checkpoint but the model holds {} (only floating "
            "dtypes convert)",
            where, name, dtype_name(src.dtype()), dtype_name(dst.dtype()));
  if (o.check_finite) check_finite(src, name, where, "");
  if (src.dtype() == dst.dtype()) {
    dst.copy_(src);
    return;
  }
  Tensor conv = src.to(dst.dtype());
  if (o.check_finite)
    check_finite(
        conv, name, where,
        fmt::format(" after conversion from {} (out of range)", dtype_name(src.dtype())).c_str());
  dst.copy_(conv);
}

}  // namespace

std::string canonical_name(const std::string& n) {
  if (starts_with(n, "model.language_model.")) return "model." + n.substr(21);
  if (starts_with(n, "language_model.model.")) return "model." + n.substr(21);
  if (starts_with(n, "language_model.lm_head.")) return n.substr(15);
  if (starts_with(n, "model.") || starts_with(n, "lm_head.")) return n;
  return "model." + n;
}

int64_t first_non_finite(const Tensor& t) {
  if (!t.defined() || !is_floating(t.dtype())) return -1;
  Tensor c = t.is_cpu() ? t.contiguous() : t.to(Device::cpu);
  const int64_t n = c.numel();
  const void* p = c.raw();
  switch (c.dtype()) {
    case DType::f64: {
      const double* d = static_cast<const double*>(p);
      for (int64_t i = 0; i < n; ++i)
        if (!std::isfinite(d[i])) return i;
      return -1;
    }
    case DType::f32: {
      const float* d = static_cast<const float*>(p);
      for (int64_t i = 0; i < n; ++i)
        if (!std::isfinite(d[i])) return i;
      return -1;
    }
    case DType::bf16:
    case DType::f16: {
      const uint16_t mask = c.dtype() == DType::bf16 ? 0x7f80 : 0x7c00;
      const uint16_t* d = static_cast<const uint16_t*>(p);
      for (int64_t i = 0; i < n; ++i)
        if ((d[i] & mask) == mask) return i;
      return -1;
    }
    case DType::e4m3: {  // no inf; NaN = S.1111.111
      const uint8_t* d = static_cast<const uint8_t*>(p);
      for (int64_t i = 0; i < n; ++i)
        if ((d[i] & 0x7f) == 0x7f) return i;
      return -1;
    }
    case DType::e5m2: {  // exponent all ones: inf or NaN
      const uint8_t* d = static_cast<const uint8_t*>(p);
      for (int64_t i = 0; i < n; ++i)
        if ((d[i] & 0x7c) == 0x7c) return i;
      return -1;
    }
    default:
      return -1;
  }
}

Tensor dequantize_fp8_blockwise(const Tensor& w, const Tensor& scale_inv, int64_t br, int64_t bc,
                                const std::string& what) {
  HLM_CHECK(w.dtype() == DType::e4m3 || w.dtype() == DType::e5m2,
            "{}: block-FP8 weight must be e4m3 or e5m2, got {}", what, dtype_name(w.dtype()));
  HLM_CHECK(is_floating(scale_inv.dtype()), "{}: scale_inv must be floating, got {}", what,
            dtype_name(scale_inv.dtype()));
  HLM_CHECK(br > 0 && bc > 0, "{}: FP8 block size {}x{} must be positive", what, br, bc);
  HLM_CHECK(w.dim() >= 2, "{}: block-FP8 weight must have >= 2 dimensions, got {}", what,
            shape_str(w.shape()));
  const int64_t R = w.size(-2), C = w.size(-1);
  Shape expect = w.shape();
  expect[expect.size() - 2] = (R + br - 1) / br;
  expect[expect.size() - 1] = (C + bc - 1) / bc;
  HLM_CHECK(scale_inv.shape() == expect,
            "{}: scale_inv has shape {} but weight {} with {}x{} blocks needs {}", what,
            shape_str(scale_inv.shape()), shape_str(w.shape()), br, bc, shape_str(expect));
  Tensor out = w.to(DType::f32).contiguous();
  Tensor s = scale_inv.to(DType::f32).contiguous();
  float* o = out.data<float>();
  const float* sp = s.data<float>();
  const int64_t batches = R * C == 0 ? 0 : out.numel() / (R * C);
  const int64_t sr = expect[expect.size() - 2], sc = expect[expect.size() - 1];
  for (int64_t b = 0; b < batches; ++b)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) o[(b * R + r) * C + c] *= sp[(b * sr + r / br) * sc + c / bc];
  return out;
}

LoadReport load_into(const std::string& path, const Targets& targets, const LoadOptions& o) {
  const Source src = open_source(path);
  LoadReport rep;
  std::vector<std::pair<std::string, Tensor>> model;  // the targets, by their module-tree names
  {
    std::set<std::string> seen;
    for (auto& [name, t] : targets) {
      HLM_CHECK(t != nullptr, "load_into: target '{}' is null", name);
      HLM_CHECK(seen.insert(name).second, "load_into: target '{}' given twice", name);
      model.emplace_back(name, *t);
    }
  }
  // The file-side targets: views of the targets' storage, named as the checkpoint's layout
  // names them (filled once the checkpoint's names are known).
  std::vector<FileTensor> files;
  std::map<std::string, Tensor*> want;

  std::map<std::string, std::string> canon;  // canonical -> checkpoint name
  std::set<std::string> consumed_scales;     // canonical scale names used for dequantisation
  // Name-level checks once every name is known (upfront for shards, after reading a single
  // file).
  auto check_names = [&]() {
    std::vector<std::string> names;
    for (auto& [c, orig] : canon)
      if (!ignored_name(c, o)) names.push_back(c);
    rep.layout = o.layout ? *o.layout : detect_layout(names, src.where);
    files = file_tensors(model, rep.layout);
    for (FileTensor& f : files)
      HLM_CHECK(want.emplace(f.name, &f.view).second,
                "load_into: two targets are named '{}' in the {} layout", f.name,
                layout_name(rep.layout));
    std::vector<std::string> missing, unexpected;
    for (auto& [name, t] : want)
      if (!canon.count(name)) missing.push_back(name);
    for (auto& [c, orig] : canon) {
      if (want.count(c)) continue;
      if (ends_with(c, "_scale_inv")) {
        const std::string base = c.substr(0, c.size() - std::strlen("_scale_inv"));
        if (want.count(base) && canon.count(base)) {
          consumed_scales.insert(c);
          continue;
        }
      }
      if (ignored_name(c, o)) {
        rep.ignored.push_back(c);
      } else {
        unexpected.push_back(c);
      }
    }
    if (!missing.empty()) {
      HLM_CHECK(o.allow_missing, "{}: {} tensor{} the model expects {} missing: {}", src.where,
                missing.size(), missing.size() > 1 ? "s" : "", missing.size() > 1 ? "are" : "is",
                list_names(missing));
      rep.missing = missing;
    }
    if (!unexpected.empty()) {
      HLM_CHECK(o.allow_unexpected,
                "{}: {} unexpected tensor{} (not in the model): {} (LoadOptions::allow_unexpected "
                "or ignore_prefixes to skip them)",
                src.where, unexpected.size(), unexpected.size() > 1 ? "s" : "",
                list_names(unexpected));
      rep.unexpected = unexpected;
    }
  };
  if (src.sharded) {
    std::vector<std::string> names;
    for (auto& [n, f] : src.weight_map) names.push_back(n);
    canon = canonical_names(names, src.where);
    check_names();
  }

  std::map<std::string, Tensor> pending_w, pending_s;  // block-FP8 weights / scales by canonical
  auto finish_fp8 = [&](const std::string& base, const std::string& where) {
    auto w = pending_w.find(base);
    auto s = pending_s.find(scale_name(base));
    if (w == pending_w.end() || s == pending_s.end()) return;
    if (o.check_finite) check_finite(s->second, quoted(scale_name(base)), where, "");
    Tensor deq = dequantize_fp8_blockwise(w->second, s->second, o.fp8_block_rows, o.fp8_block_cols,
                                          where + ": tensor '" + base + "'");
    assign(quoted(base), deq, *want.at(base), where, o);
    rep.loaded.push_back(base);
    rep.file_names[base] = canon.at(base);
    rep.dequantized.push_back(base);
    pending_w.erase(w);
    pending_s.erase(s);
  };

  // Each file is read tensor by tensor (safetensors::stream): only the tensors the model takes,
  // one at a time, so a checkpoint far larger than memory loads into a model that fits.
  for (const std::string& file : src.files) {
    auto on_header = [&](const safetensors::Header& header) {
      check_shard(src, file, header.tensors, header.metadata);
      rep.files.push_back(file);
      if (!src.sharded) {
        std::vector<std::string> names;
        for (auto& [n, info] : header.tensors) names.push_back(n);
        canon = canonical_names(names, src.where);
        check_names();
      }
    };
    auto wanted = [&](const std::string& orig, const safetensors::TensorInfo&) {
      const std::string cn = canonical_name(orig);
      return consumed_scales.count(cn) > 0 || want.count(cn) > 0;
    };
    auto take = [&](const std::string& orig, Tensor t) {
      const std::string cn = canonical_name(orig);
      if (consumed_scales.count(cn)) {
        pending_s[cn] = t;
        finish_fp8(cn.substr(0, cn.size() - std::strlen("_scale_inv")), file);
        return;
      }
      auto it = want.find(cn);
      const bool has_scale = consumed_scales.count(scale_name(cn)) > 0;
      if (has_scale && (t.dtype() == DType::e4m3 || t.dtype() == DType::e5m2)) {
        pending_w[cn] = t;
        finish_fp8(cn, file);
        return;
      }
      HLM_CHECK(!has_scale,
                "{}: tensor '{}' is {} but has a scale_inv companion (expected an e4m3/e5m2 "
                "block-FP8 weight)",
                file, orig, dtype_name(t.dtype()));
      assign(display_name(orig, cn), t, *it->second, file, o);
      rep.loaded.push_back(cn);
      rep.file_names[cn] = orig;
    };
    safetensors::stream(file, wanted, take, on_header);
  }
  HLM_CHECK(pending_w.empty() && pending_s.empty(),
            "{}: {} block-FP8 weight/scale pair(s) incomplete", src.where,
            pending_w.size() + pending_s.size());
  return rep;
}

LoadReport load_module(const std::string& path, Module& module, const LoadOptions& o) {
  Targets t;
  for (auto& [name, p] : module.named_parameters()) t.emplace_back(name, &p->value);
  return load_into(path, t, o);
}

TensorMap read_checkpoint(const std::string& path, const LoadOptions& o) {
  const Source src = open_source(path);
  TensorMap raw;
  std::map<std::string, std::string> origin;  // canonical -> checkpoint name
  for (const std::string& file : src.files) {
    safetensors::Contents c = load_file(src, file);
    for (auto& [orig, t] : c.tensors) {
      const std::string cn = canonical_name(orig);
      auto [it, fresh] = origin.emplace(cn, orig);
      HLM_CHECK(fresh, "{}: tensors '{}' and '{}' both map to '{}'", src.where, it->second, orig,
                cn);
      raw.emplace(cn, t);
    }
  }
  TensorMap out;
  for (auto& [name, t] : raw) {
    if (ends_with(name, "_scale_inv") &&
        raw.count(name.substr(0, name.size() - std::strlen("_scale_inv"))))
      continue;  // consumed by its weight below
    Tensor v = t;
    auto s = raw.find(scale_name(name));
    if (s != raw.end() && (t.dtype() == DType::e4m3 || t.dtype() == DType::e5m2))
      v = dequantize_fp8_blockwise(t, s->second, o.fp8_block_rows, o.fp8_block_cols,
                                   src.where + ": tensor '" + name + "'");
    else if (s != raw.end())
      out.emplace(s->first, s->second);  // not a block-FP8 pair: keep both as they are
    if (o.check_finite) check_finite(v, quoted(name), src.where, "");
    out.emplace(name, v);
  }
  return out;
}

std::map<std::string, Shape> read_shapes(const std::string& path, const LoadOptions& o) {
  std::map<std::string, Shape> out;
  for (auto& [name, info] : read_infos(path, o)) out.emplace(name, info.shape);
  return out;
}

std::map<std::string, safetensors::TensorInfo> read_infos(const std::string& path,
                                                          const LoadOptions& o) {
  const Source src = open_source(path);
  std::map<std::string, safetensors::TensorInfo> raw;
  std::map<std::string, std::string> origin;  // canonical -> checkpoint name
  for (const std::string& file : src.files) {
    const safetensors::Header h = safetensors::read_header(file);
    for (const auto& [orig, info] : h.tensors) {
      if (src.sharded) {
        auto it = src.weight_map.find(orig);
        HLM_CHECK(it != src.weight_map.end() && it->second == file,
                  "{}: shard '{}' holds tensor '{}', which the index {}", src.where, file, orig,
                  it == src.weight_map.end() ? "does not list" : "places in " + it->second);
      }
      const std::string cn = canonical_name(orig);
      auto [it, fresh] = origin.emplace(cn, orig);
      HLM_CHECK(fresh, "{}: tensors '{}' and '{}' both map to '{}'", src.where, it->second, orig,
                cn);
      raw.emplace(cn, info);
    }
  }
  std::map<std::string, safetensors::TensorInfo> out;
  for (const auto& [name, info] : raw) {
    if (ends_with(name, "_scale_inv") &&
        raw.count(name.substr(0, name.size() - std::strlen("_scale_inv"))))
      continue;
    if (ignored_name(name, o)) continue;
    out.emplace(name, info);
  }
  return out;
}

void check_against_config(const std::string& path, const ModelConfig& config, bool mtp,
                          const LoadOptions& o) {
  const std::map<std::string, Shape> shapes = read_shapes(path, o);
  const Shape vd{config.vocab_size, config.hidden_size};
  for (const char* name : {"model.embed_tokens.weight", "lm_head.weight"}) {
    auto it = shapes.find(name);
    if (it == shapes.end()) continue;
    HLM_CHECK(it->second == vd,
              "checkpoint '{}': tensor '{}' has shape {} but the config's vocab_size and "
              "hidden_size need {}",
              path, name, shape_str(it->second), shape_str(vd));
  }
  int64_t held = 0;
  for (const auto& [name, shape] : shapes)
    held = checked_add(held, shape_numel(shape), "the checkpoint's element count");
  int64_t want = parameter_count(config, mtp);
  if (o.allow_missing && !config.tie_word_embeddings && !shapes.count("lm_head.weight"))
    want -= config.vocab_size * config.hidden_size;
  // Far fewer values than the config's model needs (more than twice the checkpoint's): the model
  // is not built (a config claiming a huge model would allocate it first). A few missing, or
  // more than needed: the load names the missing and unexpected tensors.
  HLM_CHECK(want - held <= held,
            "checkpoint '{}' holds {} parameter values in {} tensors, but its config describes a "
            "model of {}: the checkpoint and the config do not match (tensors are missing, or the "
            "config is not this checkpoint's)",
            path, held, shapes.size(), want);
}

// ---- save ------------------------------------------------------------------------------------

void save_checkpoint(const std::string& dir, const NamedTensors& tensors, const ModelConfig* config,
                     const SaveOptions& opts) {
  std::set<std::string> names;
  NamedTensors prepared;
  prepared.reserve(tensors.size());
  for (auto& [name, t] : tensors) {
    HLM_CHECK(!name.empty(), "save_checkpoint: empty tensor name");
    HLM_CHECK(names.insert(name).second, "save_checkpoint: tensor '{}' given twice", name);
    HLM_CHECK(t.defined(), "save_checkpoint: tensor '{}' is undefined", name);
    Tensor v = t;
    if (opts.cast_floating_to && is_floating(t.dtype()) && t.dtype() != *opts.cast_floating_to &&
        !is_keep_fp32_name(name))
      v = (t.is_cpu() ? t : t.to(Device::cpu)).to(*opts.cast_floating_to);
    prepared.emplace_back(name, v);
  }
  make_dirs(dir);

  // Shards: greedy in the given order.
  std::vector<std::vector<size_t>> shards(1);
  uint64_t cur = 0;
  for (size_t i = 0; i < prepared.size(); ++i) {
    const uint64_t nb = prepared[i].second.nbytes();
    if (opts.max_shard_bytes > 0 && !shards.back().empty() && cur + nb > opts.max_shard_bytes) {
      shards.emplace_back();
      cur = 0;
    }
    shards.back().push_back(i);
    cur += nb;
  }
  const bool sharded = opts.max_shard_bytes > 0;
  const std::string save_id = make_save_id();
  Metadata meta = opts.metadata;
  meta["format"] = "pt";
  meta["hlm_save_id"] = save_id;

  const fs::path d(dir);
  AtomicFileSet files(opts.after_temp_written);
  std::set<std::string> written;
  json weight_map = json::object();
  uint64_t total = 0;
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string fname =
        sharded ? fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards.size())
                : std::string(kSingleFile);
    TensorMap m;
    for (size_t i : shards[s]) {
      m.emplace(prepared[i].first, prepared[i].second);
      weight_map[prepared[i].first] = fname;
      total += prepared[i].second.nbytes();
    }
    files.add((d / fname).string(), safetensors::serialize(m, meta));
    written.insert(fname);
  }
  if (config) files.add((d / kConfigFile).string(), text_bytes(config->to_json().dump(2) + "\n"));
  if (sharded) {
    const json index = {{"metadata", {{"total_size", total}, {"hlm_save_id", save_id}}},
                        {"weight_map", weight_map}};
    files.add((d / kIndexFile).string(), text_bytes(index.dump(2) + "\n"));
    written.insert(kIndexFile);
  }
  files.commit();

  // Remove what belongs to an earlier save in another layout.
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(d, ec)) {
    const std::string name = e.path().filename().string();
    const bool stale =
        !written.count(name) && (name == kSingleFile || name == kIndexFile || is_shard_name(name));
    if (stale) fs::remove(e.path(), ec);
  }
  fsync_dir(dir);
}

NamedTensors module_tensors(Module& module) {
  NamedTensors out;
  // Parameters on a GPU are written from host copies.
  for (auto& [name, p] : module.named_parameters())
    out.emplace_back(name, p->value.is_cpu() ? p->value : p->value.to(Device::cpu));
  return out;
}

void save_module(const std::string& dir, Module& module, const ModelConfig* config,
                 const SaveOptions& opts) {
  save_module_tensors(dir, module_tensors(module), config, opts);
}

void save_module_tensors(const std::string& dir, const NamedTensors& all, const ModelConfig* config,
                         const SaveOptions& opts) {
  NamedTensors tree;
  for (const auto& [name, t] : all)
    if (!opts.skip.count(name)) tree.emplace_back(name, t);
  NamedTensors named;
  for (FileTensor& f : file_tensors(tree, opts.layout)) {
    auto d = opts.dtype_of.find(f.name);
    if (d != opts.dtype_of.end() && d->second != f.view.dtype())
      f.view = (f.view.is_cpu() ? f.view : f.view.to(Device::cpu)).to(d->second);
    named.emplace_back(std::move(f.name), std::move(f.view));
  }
  save_checkpoint(dir, named, config, opts);
}

void save_config(const std::string& path, const ModelConfig& config) {
  make_dirs(fs::path(path).parent_path().string());
  write_file_atomic(path, text_bytes(config.to_json().dump(2) + "\n"));
}

void save_tensor_map(const std::string& path, const TensorMap& tensors, const Metadata& metadata,
                     const SaveOptions& opts) {
  make_dirs(fs::path(path).parent_path().string());
  Metadata meta = opts.metadata;
  for (auto& [k, v] : metadata) meta[k] = v;
  meta["format"] = "pt";
  write_file_atomic(path, safetensors::serialize(tensors, meta), opts.after_temp_written);
}

safetensors::Contents load_tensor_map(const std::string& path, bool check) {
  safetensors::Contents c = safetensors::load(path);
  if (check)
    for (auto& [name, t] : c.tensors) check_finite(t, quoted(name), path, "");
  return c;
}

void write_file_atomic(const std::string& path, const std::vector<uint8_t>& bytes,
                       const std::function<void(const std::string&)>& after_temp_written) {
  AtomicFileSet f(after_temp_written);
  f.add(path, bytes);
  f.commit();
}

}  // namespace hlm::checkpoint
