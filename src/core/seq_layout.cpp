// SeqLayout (core/seq_layout.h): the checks once, the derived tables cached.
#include "core/seq_layout.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

namespace hlm {

struct SeqLayout::State {
  std::vector<int64_t> offsets;
  int64_t max_length = 0;
  std::mutex mu;  // guards the caches below
  std::map<Device, Tensor> cu;
  std::map<int64_t, ChunkTable> chunks;
  std::map<std::pair<int64_t, Device>, Tensor> chunk_meta;
};

SeqLayout::SeqLayout() : SeqLayout(std::make_shared<State>()) {
  s_->offsets = {0, 0};
}

SeqLayout::SeqLayout(std::shared_ptr<State> s) : s_(std::move(s)) {}

SeqLayout SeqLayout::from_offsets(std::vector<int64_t> cu, int64_t total_tokens, const char* what) {
  HLM_CHECK(total_tokens >= 0, "{}: the token count must be >= 0, got {}", what, total_tokens);
  HLM_CHECK(!cu.empty(), "{} must have N+1 >= 1 entries, got none", what);
  HLM_CHECK(cu.front() == 0, "{} must start at 0, got {}", what, cu.front());
  int64_t longest = 0;
  for (size_t i = 1; i < cu.size(); ++i) {
    HLM_CHECK(cu[i] >= cu[i - 1], "{} must be non-decreasing, got {} at index {} after {}", what,
              cu[i], i, cu[i - 1]);
    longest = std::max(longest, cu[i] - cu[i - 1]);
  }
  HLM_CHECK(cu.back() == total_tokens, "{} must end at the token count T = {}, got {}", what,
            total_tokens, cu.back());
  auto s = std::make_shared<State>();
  s->offsets = std::move(cu);
  s->max_length = longest;
  return SeqLayout(std::move(s));
}

SeqLayout SeqLayout::from_tensor(const Tensor& t, int64_t total_tokens, const char* what) {
  if (!t.defined()) return single(total_tokens);
  HLM_CHECK(t.dtype() == DType::i64 || t.dtype() == DType::i32, "{} must be i64 or i32, got {}",
            what, t.describe());
  HLM_CHECK(t.dim() == 1, "{} must be 1-D [N+1], got {}", what, t.describe());
  const Tensor host = (t.is_cpu() ? t : t.to(Device::cpu)).to(DType::i64).contiguous();
  const int64_t* p = host.data<int64_t>();
  return from_offsets(std::vector<int64_t>(p, p + host.numel()), total_tokens, what);
}

SeqLayout SeqLayout::from_lengths(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> cu(lengths.size() + 1, 0);
  for (size_t i = 0; i < lengths.size(); ++i) {
    HLM_CHECK(lengths[i] >= 0, "sequence length {} at index {} must be >= 0", lengths[i], i);
    HLM_CHECK(cu[i] <= INT64_MAX - lengths[i], "sequence lengths overflow int64 at index {}", i);
    cu[i + 1] = cu[i] + lengths[i];
  }
  const int64_t total = cu.back();
  return from_offsets(std::move(cu), total, "sequence lengths");
}

SeqLayout SeqLayout::single(int64_t total_tokens) {
  return from_offsets({0, total_tokens}, total_tokens, "a single sequence");
}

int64_t SeqLayout::total_tokens() const {
  return s_->offsets.back();
}

int64_t SeqLayout::num_seqs() const {
  return int64_t(s_->offsets.size()) - 1;
}

const std::vector<int64_t>& SeqLayout::offsets() const {
  return s_->offsets;
}

int64_t SeqLayout::max_length() const {
  return s_->max_length;
}

void SeqLayout::check_tokens(int64_t T, const char* op, const char* what) const {
  HLM_CHECK(T == total_tokens(), "{}: the sequence layout covers {} tokens, {} has {}", op,
            total_tokens(), what, T);
}

const Tensor& SeqLayout::cu_seqlens(Device dev) const {
  std::lock_guard<std::mutex> lock(s_->mu);
  auto it = s_->cu.find(dev);
  if (it != s_->cu.end()) return it->second;
  Tensor host = Tensor::from_vector<int64_t>({int64_t(s_->offsets.size())}, s_->offsets);
  return s_->cu.emplace(dev, dev == Device::cpu ? host : host.to(dev)).first->second;
}

const SeqLayout::ChunkTable& SeqLayout::chunks(int64_t chunk) const {
  HLM_CHECK(chunk >= 1, "SeqLayout::chunks: the chunk size must be >= 1, got {}", chunk);
  HLM_CHECK(total_tokens() < (int64_t(1) << 31) - chunk,
            "SeqLayout::chunks: T = {} tokens exceed the int32 chunk table", total_tokens());
  std::lock_guard<std::mutex> lock(s_->mu);
  auto it = s_->chunks.find(chunk);
  if (it != s_->chunks.end()) return it->second;
  std::vector<int32_t> bos, len, first{0};
  const auto& cu = s_->offsets;
  for (size_t n = 0; n + 1 < cu.size(); ++n) {
    for (int64_t s = cu[n]; s < cu[n + 1]; s += chunk) {
      bos.push_back(int32_t(s));
      len.push_back(int32_t(std::min(chunk, cu[n + 1] - s)));
    }
    first.push_back(int32_t(bos.size()));
  }
  ChunkTable t;
  t.chunk = chunk;
  t.num_chunks = int64_t(bos.size());
  t.meta = std::move(bos);
  t.meta.insert(t.meta.end(), len.begin(), len.end());
  t.meta.insert(t.meta.end(), first.begin(), first.end());
  return s_->chunks.emplace(chunk, std::move(t)).first->second;
}

const Tensor& SeqLayout::chunk_meta(int64_t chunk, Device dev) const {
  const ChunkTable& t = chunks(chunk);
  std::lock_guard<std::mutex> lock(s_->mu);
  const auto key = std::make_pair(chunk, dev);
  auto it = s_->chunk_meta.find(key);
  if (it != s_->chunk_meta.end()) return it->second;
  Tensor host = Tensor::from_vector<int32_t>({int64_t(t.meta.size())}, t.meta);
  return s_->chunk_meta.emplace(key, dev == Device::cpu ? host : host.to(dev)).first->second;
}

}  // namespace hlm
