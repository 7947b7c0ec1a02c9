// safetensors I/O (https://github.com/huggingface/safetensors, format: 8-byte little-endian header
// length N, N bytes of JSON header, then the data buffer; each tensor entry gives dtype, shape and
// [begin, end) byte offsets into the buffer). Reading validates everything: header length within
// the file, JSON well formed, known dtypes, offsets inside the buffer, end - begin equal to the
// byte size of the shape, no two tensors overlapping. A bad file raises hlm::Error naming the file
// and the tensor; it never crashes. Writing goes to a temporary file that is flushed and renamed.
#pragma once

#include <cstdint>
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

// Parse a whole file image. `what` names the source in error messages.
Contents parse(const std::vector<uint8_t>& bytes, const std::string& what);
Contents load(const std::string& path);
// Serialise (tensors in name order, data aligned to 8 bytes as the reference writer does).
std::vector<uint8_t> serialize(const TensorMap& tensors, const Metadata& metadata = {});
// Atomic save: write `path.tmp.<pid>`, fsync, rename over `path`.
void save(const std::string& path, const TensorMap& tensors, const Metadata& metadata = {});

// safetensors dtype strings ("F32", "BF16", "F8_E4M3", ...) <-> DType.
const char* dtype_to_string(DType dt);
DType dtype_from_string(const std::string& s, const std::string& what);

}  // namespace hlm::safetensors
