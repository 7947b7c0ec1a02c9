// safetensors I/O (https://github.com/huggingface/safetensors, format: 8-byte little-endian header
// length N, N bytes of JSON header, then the data buffer; each tensor entry gives dtype, shape and
// [begin, end) byte offsets into the buffer). Reading validates everything the format's own loader
// does, and more: the file is a regular file (core/file_io.h), the header length lies within the
// file, the header is a UTF-8 JSON object starting with '{' whose keys are unique (a name given
// twice is an error, not "the last one wins"), dtypes are known, end - begin equals the byte size
// of the shape, and the tensors cover the data buffer exactly: sorted by offset, each begins where
// the previous one ends, the first at 0 and the last at the end of the file (no gap, no overlap,
// no trailing bytes). A file that carries the metadata entry "hlm_crc64" must match it (below).
// A bad file raises hlm::Error naming the file and the tensor; it never crashes.
//
// Checksums: every file save() / serialize() writes carries "hlm_crc64" in its __metadata__, the
// CRC-64/XZ (core/checksum.h) of the data buffer followed by the canonical form of the header
// without that entry (nlohmann::json's dump() of the parsed header: keys sorted, no spaces).
// parse() / load() verify it when present, so a bit flip anywhere in a file hybridlm wrote is an
// error naming the file; files from other writers have no such entry and are read as they are.
//
// Writing goes to a temporary file in the directory of the target, flushed and renamed over it.
// The target is resolved first (core/file_io.h, resolve_output_path): symbolic links are
// followed, and a directory, device, FIFO or socket is refused, never replaced.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace hlm::safetensors {

using TensorMap = std::map<std::string, Tensor>;
using Metadata = std::map<std::string, std::string>;

struct Contents {
  TensorMap tensors;  // CPU tensors in the file's dtypes
  Metadata metadata;  // the optional "__metadata__" entry
};

// What the header says about one tensor.
struct TensorInfo {
  DType dtype = DType::f32;
  Shape shape;
  uint64_t begin = 0, end = 0;  // byte offsets in the data buffer
};
struct Header {
  std::map<std::string, TensorInfo> tensors;
  Metadata metadata;
  uint64_t data_begin = 0;  // 8 + N
  uint64_t data_size = 0;   // bytes of the data buffer
};

// The metadata key of the checksum.
inline constexpr const char* kChecksumKey = "hlm_crc64";

// Parse a whole file image. `what` names the source in error messages.
Contents parse(const std::vector<uint8_t>& bytes, const std::string& what);
Contents load(const std::string& path);
// The validated header of a file, read without its data (the checksum, which covers the data, is
// not verified): to check shapes before allocating anything.
Header read_header(const std::string& path);
// Reads a file tensor by tensor, in the order of their data, never holding more than one tensor:
// the header is validated as load() does; each tensor that want(name, info) accepts is read into a
// new CPU tensor and handed to take(name, tensor); the others are skipped. A file with the
// "hlm_crc64" entry has its skipped bytes read through the checksum (1 MiB at a time), which is
// verified at the end (after the tensors were handed over). on_header, when given, sees the
// validated header (names, shapes, metadata) before the first tensor is asked about.
void stream(const std::string& path,
            const std::function<bool(const std::string&, const TensorInfo&)>& want,
            const std::function<void(const std::string&, Tensor)>& take,
            const std::function<void(const Header&)>& on_header = {});
// Serialise (tensors in name order, data aligned to 8 bytes as the reference writer does), with
// the checksum entry (a "hlm_crc64" in `metadata` is replaced).
std::vector<uint8_t> serialize(const TensorMap& tensors, const Metadata& metadata = {});
// Atomic save: the target resolved (see above), a temporary file beside it written and fsynced,
// renamed over it, the directory fsynced.
void save(const std::string& path, const TensorMap& tensors, const Metadata& metadata = {});

// safetensors dtype strings ("F32", "BF16", "F8_E4M3", ...) <-> DType.
const char* dtype_to_string(DType dt);
DType dtype_from_string(const std::string& s, const std::string& what);

}  // namespace hlm::safetensors
